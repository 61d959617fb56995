"""World-1 training step: msp.initialize against plain HF model + DeepSpeed ZeRO-0, same model, batch and optimizer.

The model is a random-weight Llama built from the YAML's model_config (benchmarks/gpu/llama_1b_bf16.yaml: 1.1B
params, bf16, seq 4096, batch 2), HF's sdpa attention. Variants, each in its own process (a crash or an
out-of-memory in one leaves the others standing; every peak-memory figure is that process's own):
  msp_off / msp_on   msp.initialize(model, YAML) with recompute_config.recompute False / True; engine.train_batch
  ds_off / ds_on     deepspeed.initialize on the plain HF model, the same ZeRO stage, dtype, clipping and torch
                     AdamW; HF's own loss; ds_on: model.gradient_checkpointing_enable()
Per variant: `--warmup` untimed steps, then `--steps` timed ones (synchronize around each step; median). Reported:
tokens/s, model TFLOP/s and MFU (model FLOPs per token = 6 x matmul params (all but the input embedding) +
6 x layers x seq x hidden for causal attention (QK^T and PV, half the square, fwd + bwd), recompute not counted),
peak allocated memory (torch.cuda.max_memory_allocated) against the plan's estimate (msparallel_ds.memory:
estimate_memory(make_plan(YAML, world_size=1)).total_gib), and the loss of the first and last step (one fixed random
batch: the loss falls when the model trains). Ratios msp / ds per recompute setting.

    python benchmarks/gpu/train_step.py --json OUT.json                 # on a GPU (about 2 minutes on an H100)
    python benchmarks/gpu/train_step.py --tiny --json /tmp/ts.json      # CPU dry run: tiny Llama, fp32, gloo

World 1 only (a one-process group: nccl on CUDA, gloo on CPU); nothing here needs several GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = Path(__file__).resolve().parent / "llama_1b_bf16.yaml"
VARIANTS = ("msp_off", "ds_off", "msp_on", "ds_on")
# Dense bf16 tensor-core peak (datasheet, TFLOP/s) for MFU; --peak-tflops overrides, unknown devices get none.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "B200": 2250.0}
TINY = {"num_layers": 2, "num_heads": 4, "n_kv_heads": 2, "hidden_size": 64, "ffn_hidden_size": 128,
        "seq_length": 64, "vocab_size": 256, "compute_dtype": "float32", "param_init_type": "float32"}


def load_yaml(path: Path, tiny: bool, recompute: bool) -> dict:
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    if tiny:
        doc["model"]["model_config"].update(TINY)
    doc.setdefault("recompute_config", {})["recompute"] = recompute
    return doc


def model_shape(doc: dict) -> dict:
    m = doc["model"]["model_config"]
    return {"layers": m["num_layers"], "hidden": m["hidden_size"], "ffn": m["ffn_hidden_size"],
            "heads": m["num_heads"], "kv_heads": m.get("n_kv_heads") or m["num_heads"], "vocab": m["vocab_size"],
            "seq": m["seq_length"], "batch": doc["runner_config"]["batch_size"],
            "dtype": m.get("compute_dtype", "float32")}


def flops_per_token(model, shape: dict) -> float:
    """6 x the parameters a token's matmuls use (all but the input embedding; the head is a matmul) plus causal
    attention's QK^T and PV: 2 matmuls x 2 FLOPs x seq/2 keys x hidden, x3 for forward + backward."""
    embed = model.get_input_embeddings().weight.numel()
    matmul = sum(p.numel() for p in model.parameters()) - embed
    return 6.0 * matmul + 6.0 * shape["layers"] * shape["seq"] * shape["hidden"]


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, val in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return val
    return None


# ------------------------------------------------------------------------------------------------ one variant
def build_model(shape: dict, device, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq"],
                      attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):  # random init on the GPU: seconds, not minutes of CPU init for 1B weights
        model = LlamaForCausalLM(cfg)
    return model.to(dtype)


def optimizer_factory(doc: dict):
    import torch

    o = doc.get("optimizer", {})
    kw = {"lr": float(o.get("learning_rate", 1e-4)), "betas": tuple(o.get("betas", (0.9, 0.95))),
          "eps": float(o.get("eps", 1e-8)), "weight_decay": float(o.get("weight_decay", 0.0))}
    return lambda params: torch.optim.AdamW(params, **kw)


def run_variant(name: str, doc: dict, warmup: int, steps: int) -> dict:
    import torch

    from msparallel_ds import runtime

    runtime.quiet_deepspeed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    shape = model_shape(doc)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(shape["dtype"], torch.float32) if cuda \
        else torch.float32
    recompute = name.endswith("_on")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_model(shape, device, dtype)
    fpt = flops_per_token(model, shape)
    n_params = sum(p.numel() for p in model.parameters())
    opt = optimizer_factory(doc)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
    if name.startswith("msp"):
        import msparallel_ds as msp

        eng = msp.initialize(model, doc, optimizer=opt)
        ds_config = eng.ds.config

        def step():
            return eng.train_batch({"input_ids": ids, "labels": ids})
    else:
        import deepspeed

        if not cuda:  # as msp.initialize does: no JIT build of DeepSpeed's CPU shm op (inference only)
            runtime.disable_inference_shm_build()
        runtime.ensure_distributed(None)
        if recompute:  # transformers >= 5.2x renamed it; the GPU machine's 5.17 has the old name only
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        rw = doc.get("runner_wrapper", {})
        ds_config = {"train_micro_batch_size_per_gpu": shape["batch"], "train_batch_size": shape["batch"],
                     "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
                     "zero_allow_untested_optimizer": True, "steps_per_print": 2**30,
                     "gradient_clipping": float(rw.get("max_grad_norm", 1.0)) if rw.get("use_clip_grad") else 0.0}
        if cuda and dtype == torch.bfloat16:
            ds_config["bf16"] = {"enabled": True}
        eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config, dist_init_required=False)
        x = ids.to(device)

        def step():
            loss = eng(input_ids=x, labels=x).loss
            eng.backward(loss)
            eng.step()
            return loss.detach()

    setup_s = time.perf_counter() - t0
    losses, times = [], []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        s0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - s0
        losses.append(float(loss))
        if i >= warmup:
            times.append(dt)
    med = statistics.median(times)
    tokens = shape["batch"] * shape["seq"]
    out = {"variant": name, "recompute": recompute, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "dtype": str(dtype).replace("torch.", ""), "params": n_params, "flops_per_token": fpt,
           "tokens_per_step": tokens, "setup_s": setup_s, "step_s": times, "step_median_s": med,
           "tokens_per_s": tokens / med, "model_tflops": fpt * tokens / med / 1e12,
           "loss_first": losses[0], "loss_last": losses[-1], "zero_stage": ds_config["zero_optimization"]["stage"],
           "bf16": bool(ds_config.get("bf16", {}).get("enabled"))}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def plan_estimate(doc: dict) -> dict | None:
    import msparallel_ds as msp
    from msparallel_ds.memory import estimate_memory

    est = estimate_memory(msp.make_plan(msp.load_config(doc), world_size=1))
    return est.as_dict() if est is not None else None


def child(args) -> int:
    doc = load_yaml(args.yaml, args.tiny, args.one.endswith("_on"))
    try:
        res = run_variant(args.one, doc, args.warmup, args.steps)
        res["plan_estimate"] = plan_estimate(doc)
        res["status"] = "ok"
    except Exception as exc:  # noqa: BLE001  (out of memory, a DeepSpeed error: reported, the next variant runs)
        import traceback

        traceback.print_exc()
        res = {"variant": args.one, "status": f"failed: {type(exc).__name__}: {str(exc)[:500]}"}
    Path(args.child_json).write_text(json.dumps(res, indent=1))
    return 0 if res["status"] == "ok" else 1


# ------------------------------------------------------------------------------------------------ parent
def _fmt(x, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(x, spec) if x is not None else "-".rjust(width)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent(args) -> int:
    t_start = time.perf_counter()
    out_json = Path(args.json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    report = {"yaml": str(args.yaml), "tiny": args.tiny, "warmup": args.warmup, "steps": args.steps,
              "variants": {}, "ratios": {}}
    for name in args.variants:
        left = args.budget - (time.perf_counter() - t_start)
        if left < args.min_variant_s:
            report["variants"][name] = {"variant": name, "status": f"skipped: time budget ({left:.0f} s left)"}
            print(f"[train_step] {name}: skipped, {left:.0f} s left of the budget", flush=True)
            continue
        child_json = out_json.with_name(f"{out_json.stem}.{name}.json")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                   WORLD_SIZE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, __file__, "--one", name, "--child-json", str(child_json), "--yaml", str(args.yaml),
               "--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
        t0 = time.perf_counter()
        print(f"[train_step] {name}: starting (timeout {min(args.variant_timeout, left):.0f} s)", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=min(args.variant_timeout, left), check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
        if child_json.is_file():
            res = json.loads(child_json.read_text())
            child_json.unlink()
        else:
            res = {"variant": name, "status": "timeout" if rc is None else f"failed: rc={rc}, no result written"}
        res["wall_s"] = time.perf_counter() - t0
        report["variants"][name] = res
        msg = (f"{res['tokens_per_s']:.0f} tokens/s, {res['model_tflops']:.1f} TFLOP/s, loss "
               f"{res['loss_first']:.3f} -> {res['loss_last']:.3f}" if res.get("status") == "ok" else res["status"])
        print(f"[train_step] {name}: {msg} ({res['wall_s']:.0f} s)", flush=True)
    ok = {k: v for k, v in report["variants"].items() if v.get("status") == "ok"}
    peak = peak_tflops(next(iter(ok.values()))["device"], args.peak_tflops) if ok else None
    report["peak_bf16_tflops"] = peak
    for v in ok.values():
        v["mfu"] = v["model_tflops"] / peak if peak else None
        est = (v.get("plan_estimate") or {}).get("total_gib")
        if est and v.get("peak_allocated_gib"):
            v["estimate_over_measured"] = est / v["peak_allocated_gib"]
    for rc in ("off", "on"):
        a, b = ok.get(f"msp_{rc}"), ok.get(f"ds_{rc}")
        if a and b:
            report["ratios"][f"recompute_{rc}"] = {"tokens_per_s_msp_over_ds": a["tokens_per_s"] / b["tokens_per_s"]}
            if a.get("peak_allocated_gib") and b.get("peak_allocated_gib"):
                report["ratios"][f"recompute_{rc}"]["peak_mem_msp_over_ds"] = (a["peak_allocated_gib"]
                                                                               / b["peak_allocated_gib"])
    out_json.write_text(json.dumps(report, indent=1))
    print(f"\n{'variant':<8} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'est GiB':>8} {'est/meas':>8} "
          f"{'loss first->last':>18}")
    for name, v in report["variants"].items():
        if v.get("status") != "ok":
            print(f"{name:<8} {v['status']}")
            continue
        est = (v.get("plan_estimate") or {}).get("total_gib")
        cols = [_fmt(v.get("mfu"), "6.3f"), _fmt(v.get("peak_allocated_gib"), "9.2f"), _fmt(est, "8.2f"),
                _fmt(v.get("estimate_over_measured"), "8.2f")]
        print(f"{name:<8} {v['tokens_per_s']:9.0f} {v['model_tflops']:8.1f} {' '.join(cols)} "
              f"{v['loss_first']:8.3f} -> {v['loss_last']:.3f}")
    for k, r in report["ratios"].items():
        print(f"{k}: msp/ds tokens/s {r['tokens_per_s_msp_over_ds']:.3f}"
              + (f", peak memory {r['peak_mem_msp_over_ds']:.3f}" if "peak_mem_msp_over_ds" in r else ""))
    print(f"wrote {out_json}")
    bad = [k for k, v in report["variants"].items() if v.get("status") != "ok"]
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny Llama (hidden 64, 2 layers, seq 64), fp32")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=1e9, help="seconds for all variants; later ones are skipped")
    ap.add_argument("--variant-timeout", type=float, default=240.0)
    ap.add_argument("--min-variant-s", type=float, default=25.0, help="do not start a variant with less time left")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: by device)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "train_step_gpu.json"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        sys.path.insert(0, str(ROOT))
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
