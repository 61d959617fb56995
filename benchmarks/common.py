"""What the benchmarks share: the tiny Llama they train (built from LlamaConfig, no download), its fixed random
batch, the msp YAML of a dp x tp layout, the heavy imports to load once before forking rank groups, and RSS
readings. train.py, memory.py, overhead.py, suggest.py and runner.py import it (and not each other's helpers)."""
from __future__ import annotations

import os
import resource
import sys

# Imported before forking (some lazily by the engines: DeepSpeed's ZeRO optimizer check imports its Muon
# optimizer, which pulls in torch inductor, about 7 s per process on a busy 2-core machine).
PRELOAD = ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
           "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_config",
           "deepspeed.module_inject.auto_tp", "deepspeed.module_inject.layers", "deepspeed.module_inject.tp_shard",
           "deepspeed.module_inject.tp_plan_converter", "deepspeed.module_inject.autotp_config",
           "deepspeed.module_inject.replace_module", "transformers", "transformers.models.llama.modeling_llama",
           "msparallel_ds", "msparallel_ds.engine", "msparallel_ds.strategy", "msparallel_ds.distributed.layout",
           "msparallel_ds.context_parallel.batch", "msparallel_ds.tensor_parallel.apply",
           "msparallel_ds.tensor_parallel.vocab")


def msp_yaml(args: dict, lay: dict) -> dict:
    """The MindFormers YAML (as a dict) of an msp variant: ZeRO-2, no clipping, micro batch = global / dp."""
    return {
        "parallel_config": {"data_parallel": lay["dp"], "model_parallel": lay["tp"], "context_parallel": 1,
                            "pipeline_stage": 1, "use_seq_parallel": lay["sp"], "vocab_emb_dp": True,
                            "micro_batch_num": 1},
        "parallel": {"enable_parallel_optimizer": True,
                     "parallel_optimizer_config": {"optimizer_level": "level2"}},
        "runner_config": {"batch_size": args["global_batch"] // lay["dp"], "gradient_accumulation_steps": 1},
        "runner_wrapper": {"use_clip_grad": False},
        "model": {"model_config": {"num_layers": args["layers"], "num_heads": args["heads"],
                                   "n_kv_heads": args["kv_heads"], "hidden_size": args["hidden"],
                                   "seq_length": args["seq"], "vocab_size": args["vocab"],
                                   "compute_dtype": "float32", "param_init_type": "float32"}},
    }


def tiny_llama(args: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # identical initial weights in every variant and on every rank
    cfg = LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["ffn"],
                      num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
                      num_key_value_heads=args["kv_heads"], max_position_embeddings=args["seq"],
                      attention_dropout=0.0, attn_implementation=args["attn"])
    return LlamaForCausalLM(cfg).float()


def fixed_batches(args: dict) -> list:
    """One fixed random global batch, trained on at every step: the loss then falls step after step (the model
    memorises it), which shows that every variant trains, and trains the same thing."""
    import torch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, args["vocab"], (args["global_batch"], args["seq"]), generator=g)
    return [ids] * (args["warmup"] + args["steps"])


def rss_mib() -> float:
    """Current resident set size of this process (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mib()


def peak_rss_mib() -> float:
    per_mib = 2**20 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_mib


def preload(args: dict) -> None:
    """Import the heavy modules (and the lazily imported ones a run touches) once here, so forked groups start
    without re-importing them; one thread and no parallel region here, so forking stays safe."""
    if args["device"] == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import torch

    torch.set_num_threads(1)
    for mod in PRELOAD:
        try:
            importlib.import_module(mod)
        except ImportError:  # a module moved: it is then imported by the runs themselves, only slower
            pass
    if args["device"] == "cpu":
        tiny_llama(args)  # the first build also resolves transformers' lazy imports (attention, init functions)
