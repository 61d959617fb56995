"""`msparallel-ds demo`: a real multi-process training run of a MindFormers strategy, checked against one process.

With no arguments: the bundled YAML (msparallel_ds/data/demo.yaml: dp 2 x tp 2 with sequence parallel x cp 2 ring,
vocab parallel, ZeRO-1, recompute of the first two layers, clipping) on 8 CPU processes (gloo), a tiny Llama
trained for 10 steps on public-domain text (byte tokens) through msp.initialize / engine.train_batch. Then the same
steps in one process with the unsharded model and plain torch (HF loss, AdamW, clip_grad_norm_), and the line
    parity: max |loss - single-process loss| = X over N steps
The workers are forked after the heavy imports (torch, transformers, DeepSpeed), so they start in seconds.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

DEMO_CONFIG = Path(__file__).with_name("data") / "demo.yaml"


def _quiet() -> None:
    """Keep the demo's output readable: DeepSpeed's per-rank INFO lines and its use of a renamed torch collective."""
    import logging
    import warnings

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)


DEFAULT_ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def _optimizer(cfg):
    """None (msp.initialize builds the YAML's optimizer), or the demo's default AdamW when the YAML has none."""
    import torch

    if cfg.optimizer is not None:
        return None
    return lambda params: torch.optim.AdamW(params, **DEFAULT_ADAMW)


def _worker(rank: int, world: int, cfg, batches, send) -> None:
    import msparallel_ds as msp
    from msparallel_ds.tiny import dp_rows, tiny_llama

    _quiet()
    engine = msp.initialize(tiny_llama(), cfg, optimizer=_optimizer(cfg), total_steps=len(batches))
    for step, batch in enumerate(batches):
        loss = engine.train_batch(dp_rows(batch, engine.layout))
        if rank == 0:
            send((step, loss.item()))


def reference_losses(cfg, plan, batches) -> list[float]:
    """The same steps in one process: unsharded model, HF loss over the global batch, the YAML's optimizer and lr
    schedule (msp.build_optimizer / msp.build_lr_scheduler, as msp.initialize builds them), clip_grad_norm_."""
    import torch

    import msparallel_ds as msp
    from msparallel_ds.tiny import tiny_llama

    model = tiny_llama()
    default = _optimizer(cfg)
    opt = msp.build_optimizer(model, cfg) if default is None else default(model.parameters())
    sched = msp.build_lr_scheduler(opt, cfg, total_steps=len(batches))
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        if plan.gradient_clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan.gradient_clipping)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def _demo_config(path: Path):
    """The YAML with the demo model's shape written into model.model_config, so the MindFormers rules (heads over
    model_parallel, sequence over cp, ...) check it against the model that will really run: a clear ConfigError
    before any process starts."""
    import yaml

    from msparallel_ds import load_config
    from msparallel_ds.tiny import tiny_llama_config

    load_config(path)  # the YAML as written first: its own errors name its own keys
    raw = yaml.safe_load(path.read_text())
    mc = tiny_llama_config()
    model = raw.setdefault("model", {}).setdefault("model_config", {})
    model.update(num_layers=mc.num_hidden_layers, hidden_size=mc.hidden_size, num_heads=mc.num_attention_heads,
                 n_kv_heads=mc.num_key_value_heads, vocab_size=mc.vocab_size)
    model["seq_length"] = min(model.get("seq_length") or 64, 256)  # a real run's 4k-128k would only be slow here
    return load_config(raw)


def _bar(done: int, total: int, width: int = 24) -> str:
    n = round(width * done / total)
    return "[" + "#" * n + "." * (width - n) + "]"


def run_demo(config: Optional[str] = None, nproc: Optional[int] = None, steps: int = 10, *, timeout: float = 300,
             echo: Callable[[str], None] = print) -> dict:
    """Train on `nproc` forked processes, then in one process; returns losses and the parity figures."""
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise ValueError(f"nproc={nproc!r} must be a positive int (or None: the YAML's world size)")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    import torch  # noqa: F401  heavy imports before forking, so the workers share them
    import transformers.models.llama.modeling_llama  # noqa: F401

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401

    import msparallel_ds.engine  # noqa: F401
    from msparallel_ds import make_plan
    from msparallel_ds.tiny import text_batches

    path = Path(config) if config else DEMO_CONFIG
    cfg = _demo_config(path)
    world = nproc if nproc is not None else cfg.dp * cfg.tp * cfg.cp * cfg.pp
    plan = make_plan(cfg, world_size=world)
    seq = cfg.model.seq_length or 64
    echo(f"msparallel-ds demo: {path}\n")
    echo(plan.summary() + "\n")
    from msparallel_ds.tiny import tiny_llama_config

    mc = tiny_llama_config()
    echo(f"training a tiny Llama ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}, {mc.num_attention_heads} "
         f"heads, {mc.num_key_value_heads} kv heads, vocab {mc.vocab_size}) on {world} CPU processes (gloo): {steps} "
         f"steps, global batch {plan.global_batch_size} x {seq} byte tokens of public-domain text")
    batches = text_batches(steps, plan.global_batch_size, seq)

    from msparallel_ds.launch import run_local

    losses: list[Optional[float]] = [None] * steps
    start = time.monotonic()

    def progress(rank, message):
        step, loss = message
        losses[step] = loss
        elapsed = time.monotonic() - start
        echo(f"  step {step + 1:3d}/{steps} {_bar(step + 1, steps)} loss {loss:.5f}  ({elapsed:.1f} s)")

    run_local(_worker, world, (cfg, batches), timeout=timeout, on_message=progress)
    parallel_s = time.monotonic() - start

    echo(f"\nthe same {steps} steps in one process (unsharded model, HF loss, the same optimizer and "
         "schedule, clip_grad_norm_):")
    ref = reference_losses(cfg, plan, batches)
    diffs = [abs(a - b) for a, b in zip(losses, ref)]
    worst = max(diffs)
    rel = max(d / abs(r) for d, r in zip(diffs, ref))
    for i, (a, b) in enumerate(zip(losses, ref)):
        echo(f"  step {i + 1:3d}: parallel {a:.6f}  single-process {b:.6f}")
    echo(f"\nparity: max |loss - single-process loss| = {worst:.3g} over {steps} steps "
         f"(max relative {rel:.3g}; parallel run {parallel_s:.1f} s)")
    return {"losses": losses, "reference": ref, "max_abs": worst, "max_rel": rel, "world_size": world,
            "parallel_seconds": parallel_s, "finite": all(math.isfinite(x) for x in losses)}
