"""Issue 16 (hardening), the smaller items: NaN-preserving context-parallel merges, clear errors and exit codes in
the CLI/demo/API, and the usability fixes of the exports and examples."""
import math

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed


# ------------------------------------------------------------------------------ NaN-preserving attention merges
def _nan_cases(rank, world_size):
    from msparallel_ds.context_parallel import sharding
    from msparallel_ds.context_parallel.allgather import allgather_attention
    from msparallel_ds.context_parallel.ring import ring_attention

    res = {}
    for dtype in (torch.float32, torch.float64):
        for backend in (None, "math"):
            for name, op in (("ring", ring_attention), ("allgather", allgather_attention)):
                for causal in (True, False):
                    g = torch.Generator().manual_seed(0)
                    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=dtype) for _ in range(3))
                    q_nan = q.clone()
                    q_nan[0, 0, 3, 0] = float("nan")
                    for tag, (qq, scale) in {"nan_q": (q_nan, 0.5), "nan_scale": (q, float("nan")),
                                             "finite": (q, 0.5)}.items():
                        ref = F.scaled_dot_product_attention(qq.double(), k.double(), v.double(), is_causal=causal,
                                                             scale=scale)
                        out = op(*(sharding.shard(t, 2, world_size, 1, rank, 0) for t in (qq, k, v)), None,
                                 causal=causal, scale=scale, backend=backend)
                        want = sharding.shard(ref, 2, world_size, 1, rank, 0)
                        key = (str(dtype), backend, name, causal, tag)
                        res[key] = (out.isnan().tolist() == want.isnan().tolist(),
                                    torch.allclose(out.double().nan_to_num(), want.nan_to_num(), atol=1e-5))
    return res


@pytest.mark.distributed
def test_ring_and_allgather_keep_nan_like_sdpa():
    """Before: nan_to_num in the merges (and torch's CPU flash op) turned a NaN query / softmax_scale into finite
    numbers; now the NaN pattern equals fp64 single-process SDPA's, and finite values are unchanged."""
    bad = {}
    for rank, res in enumerate(run_distributed(_nan_cases, 2, timeout=180)):
        bad.update({(rank, *k): v for k, v in res.items() if not all(v)})
    assert not bad, bad


def test_fully_masked_rows_still_give_zero():
    from msparallel_ds.context_parallel import kernels

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False  # query row 1 sees nothing
    out, lse = kernels.block_forward(q, k, v, causal=False, scale=0.3, backend=kernels.BACKENDS["math"], mask=mask)
    assert torch.isneginf(lse[:, :, 1]).all() and (out[:, :, 1] == 0).all() and out.isfinite().all()
    dq, dk, dv = kernels.block_backward(torch.randn_like(out), q, k, v, out, lse, causal=False, scale=0.3,
                                        backend=kernels.BACKENDS["math"], mask=mask)
    assert all(g.isfinite().all() for g in (dq, dk, dv)) and (dq[:, :, 1] == 0).all()
    # merging two empty blocks keeps 0 (the -inf - -inf case); an empty block does not change a real one
    empty_o, empty_l = torch.zeros(1, 2, 4, 8), torch.full((1, 2, 4), -math.inf)
    o, l = kernels.merge(empty_o.clone(), empty_l.clone(), empty_o.clone(), empty_l.clone())
    assert (o == 0).all() and torch.isneginf(l).all()
    real_o, real_l = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4)
    o, l = kernels.merge(empty_o.clone(), empty_l.clone(), real_o.clone(), real_l.clone())
    assert torch.allclose(o, real_o) and torch.allclose(l, real_l)
    # a NaN block poisons the running result instead of vanishing
    nan_l = real_l.clone()
    nan_l[0, 0, 2] = float("nan")
    o, l = kernels.merge(real_o.clone(), real_l.clone(), real_o.clone(), nan_l)
    assert o[0, 0, 2].isnan().all() and l[0, 0, 2].isnan() and o[0, 1].isfinite().all()


# ------------------------------------------------------------------------------ messages and exit codes
def test_shard_dim_must_be_an_int():
    """Before: shard(dim=1.0) was a raw 'tuple indices must be integers' TypeError."""
    from msparallel_ds.context_parallel import sharding

    x = torch.arange(16.).view(2, 8)
    for bad in (1.0, True, "1"):
        with pytest.raises(TypeError, match=r"dim=.* must be an int.*e\.g\. dim=1"):
            sharding.shard(x, bad, 2, 1, 0, 0)
        with pytest.raises(TypeError, match=r"must be an int"):
            sharding.unshard([x, x], bad, 2, 1)
        with pytest.raises(TypeError, match=r"must be an int"):
            sharding.pad_to_multiple(x, bad, 4)
    with pytest.raises(ValueError, match="out of range"):
        sharding.shard(x, 2, 2, 1, 0, 0)
    import numpy as np

    assert torch.equal(sharding.shard(x, np.int64(1), 2, 1, 0, 0), sharding.shard(x, 1, 2, 1, 0, 0))


@pytest.fixture
def cli(capsys):
    from msparallel_ds.cli import main

    def run(*argv):
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err
    return run


def test_export_to_a_missing_folder_exits_2(cli, tmp_path):
    """Before: exit 1 with a traceback and 'internal error'."""
    code, _, err = cli("export", "configs/tiny_dp1.yaml", "--to", "deepspeed", "-o", str(tmp_path / "no" / "x.json"))
    assert code == 2
    assert "cannot write --output" in err and "exists" in err and "internal error" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (("--nproc", "0"), "--nproc 0 must be >= 1"),
    (("--nproc", "-2"), "--nproc -2 must be >= 1"),
    (("--timeout", "0"), "--timeout 0.0 must be a positive number"),
    (("--timeout", "nan"), "--timeout nan must be a positive number"),
    (("--timeout", "-5"), "--timeout -5.0 must be a positive number"),
])
def test_demo_bad_nproc_or_timeout_exits_2_before_any_work(cli, argv, needle):
    """Before: --nproc 0 silently used the YAML's world; --timeout 0 was a traceback."""
    code, out, err = cli("demo", *argv)
    assert code == 2 and needle in err and "Traceback" not in err
    assert out == ""  # nothing ran


def test_run_demo_rejects_bad_nproc_and_timeout():
    from msparallel_ds.demo import run_demo

    with pytest.raises(ValueError, match="nproc=0 must be a positive int"):
        run_demo(nproc=0)
    with pytest.raises(ValueError, match="timeout=0 must be a positive number"):
        run_demo(timeout=0)


def test_convert_checkpoint_bad_timeout_exits_2(cli, tmp_path):
    code, _, err = cli("convert-checkpoint", str(tmp_path), str(tmp_path / "o"), "--to-config",
                       "configs/tiny_dp1.yaml", "--timeout", "0")
    assert code == 2 and "--timeout 0.0 must be a positive number" in err


def test_cp_attention_dropout_error_names_the_models_own_key():
    """Before: GPT-2 (attn_pdrop) was told to set attention_dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from msparallel_ds.integrations.hf_attention import make_cp_attention

    attention = make_cp_attention(layout=None)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)).train()
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                         num_attention_heads=2, vocab_size=32, attention_dropout=0.1)).train()
    q = torch.zeros(1, 2, 4, 8)
    for module, key in ((gpt2.transformer.h[0].attn, "attn_pdrop"), (llama.model.layers[0].self_attn,
                                                                      "attention_dropout")):
        with pytest.raises(ValueError, match=rf"set {key}=0\.0 in the model config"):
            attention(module, q, q, q, None, dropout=0.1)


def test_from_pretrained_missing_path_is_a_clear_error(tmp_path):
    """Before: HF's 'Repo id must use alphanumeric chars' (and a process group was needed first)."""
    import msparallel_ds as msp
    import torch.distributed as dist

    for path, why in ((tmp_path / "nope", "nothing there"), (tmp_path, "no config.json")):
        with pytest.raises(FileNotFoundError, match=rf"no checkpoint at {path}.*{why}"):
            msp.from_pretrained(path, "configs/tiny_dp1.yaml")
    assert not dist.is_initialized()  # checked before any process group is started


_PLAIN_PYTHON = """
import sys, torch
import msparallel_ds as msp
from msparallel_ds.tiny import tiny_llama
model = tiny_llama()
model.save_pretrained(sys.argv[1])
got = msp.from_pretrained(sys.argv[1], "configs/tiny_dp1.yaml")
ids = torch.arange(8)[None]
assert torch.allclose(got(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-5)
print("ok")
"""


def test_from_pretrained_in_plain_python_starts_its_process_group(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _PLAIN_PYTHON, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=240, env=env)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_half_model_on_cpu_is_cast_to_float32_with_a_warning():
    """Before: fp16 YAML + model.half() on CPU died in DeepSpeed's grad reduction right after 'running in fp32'."""
    from types import SimpleNamespace

    from msparallel_ds.runtime import cpu_float32

    model = torch.nn.Linear(4, 4).half()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params)
    plan = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(compute_dtype="float16")))
    with pytest.warns(UserWarning, match="float16 parameters are cast to float32.*compute_dtype=float16"):
        cpu_float32(model, SimpleNamespace(device_type="cpu"), plan)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(model.parameters()) == params and opt.param_groups[0]["params"][0] is params[0]  # same objects
    gpu = torch.nn.Linear(4, 4).half()
    cpu_float32(gpu, SimpleNamespace(device_type="cuda"), plan)  # untouched where DeepSpeed runs half precision
    assert gpu.weight.dtype == torch.float16


# ------------------------------------------------------------------------------ usability
def test_accelerate_export_of_a_pipeline_yaml_warns_and_says_so(cli, tmp_path):
    out = tmp_path / "acc.yaml"
    code, _, err = cli("export", "configs/tiny_pp2.yaml", "--to", "accelerate", "-o", str(out))
    assert code == 0 and "warning: parallel_config.pipeline_stage=2" in err
    text = out.read_text()
    assert "# WARNING: parallel_config.pipeline_stage=2" in text and "MindFormersAccelerator" in text
    code, _, err = cli("export", "configs/tiny_dp2_tp2.yaml", "--to", "accelerate", "-o", str(out))
    text = out.read_text()
    assert code == 0 and "warning" not in err and "WARNING" not in text
    assert "plain accelerate.Accelerator()" in text and "MindFormersAccelerator" in text
    import yaml

    assert yaml.safe_load(text)["distributed_type"] == "DEEPSPEED"  # the comments keep it a valid file


def test_trainer_batch_warning_names_batch_size_times_interleave(tmp_path):
    import warnings

    import yaml
    from transformers import TrainingArguments

    from msparallel_ds.integrations.trainer import MindFormersTrainer

    raw = yaml.safe_load(open("configs/tiny_dp1.yaml"))
    raw["runner_config"]["batch_size"] = 1
    raw["micro_batch_interleave_num"] = 2
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to=[])
    import torch.distributed as dist

    started = dist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            MindFormersTrainer(model=None, args=args, parallel_config=raw)
        except Exception:  # the Trainer itself needs a model; the warning comes before
            pass
        finally:
            if dist.is_initialized() and not started:  # leave no process group to later tests in this process
                dist.destroy_process_group()
    text = " ".join(str(w.message) for w in caught)
    assert "per_device_train_batch_size=8 replaced by 2" in text
    assert "runner_config.batch_size=1 x micro_batch_interleave_num=2" in text


def test_quiet_deepspeed_names_the_cpu_accelerator(monkeypatch):
    import warnings

    from msparallel_ds.runtime import quiet_deepspeed

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with warnings.catch_warnings():
        quiet_deepspeed()
        if not torch.cuda.is_available():
            import os

            assert os.environ["DS_ACCELERATOR"] == "cpu"
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning,
                                   "x.py", 1, module="deepspeed.comm.torch")
        assert not caught


def test_train_deepspeed_takes_the_yamls_optimizer_unless_lr_is_given():
    import sys

    import msparallel_ds as msp

    sys.path.insert(0, "examples")
    try:
        from train_deepspeed import optimizer_choice
    finally:
        sys.path.remove("examples")
    plan = msp.make_plan(msp.load_config("configs/tiny_dp2_tp2.yaml"))
    factory, sched, line = optimizer_choice(plan, None)
    assert factory is None and sched is None and "the YAML's AdamW as torch.optim.AdamW" in line  # msp.initialize's
    factory, sched, line = optimizer_choice(plan, 1e-4)
    opt = factory([torch.nn.Parameter(torch.zeros(1))])
    assert opt.param_groups[0]["lr"] == 1e-4 and opt.param_groups[0]["betas"] == (0.9, 0.95) and "--lr" in line
    assert sched(opt) is None  # --lr: a constant rate, not the YAML's schedule
    raw = {"parallel_config": {"data_parallel": 1}, "optimizer": {"type": "AdamW", "learning_rate": 1e-3},
           "lr_schedule": {"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 2}}
    plan = msp.make_plan(msp.load_config(raw), world_size=1)
    assert "ConstantWarmUpLR" in optimizer_choice(plan, None)[2]
