"""`msparallel-ds train`'s per-step overhead: the runner's Trainer against the same steps through msp.initialize in a
hand-written loop.

Both train the same run: tests/fixtures/mf_reference/run.yaml (a MindFormers-derived legacy Llama YAML) with the
model scaled to hidden 128 / 4 layers / 8 heads / 4 kv heads / vocab 256 / seq 32, random init from `seed`, the
YAML's AdamWeightDecay + cosine warm-up schedule, clipping on, on the public-domain MindRecord of
tests/fixtures/mindrecord/text with MindDataset's global shuffle, a global batch of 16 rows, MFLossMonitor every step:
  runner    msparallel_ds.run.Trainer(RunSpec) .train() with --stop-after (what `msparallel-ds train` runs per rank:
            data through StepBatches, the loss line, metrics.jsonl, the CheckpointMonitor check; no checkpoint due)
  loop      the loop a user writes: msp.initialize(build_model, cfg, total_steps=...), this dp rank's rows from
            msparallel_ds.data.open_train_dataset in the same order, input_ids[:-1] on input_ids[1:], train_batch,
            float(loss), a print per step
Per-step time excluding start-up: the time between the ends of consecutive steps (the runner: between its
monitor.log calls, so logging, metrics.jsonl and the loop's own work count), the slowest rank's, over the steps
after `--warmup`; per run its median. Runs alternate runner / loop (each in its own group of processes, forked after
the heavy imports), the first variant swapped every repeat; reported per layout: the median over repeats of the
per-repeat ratio runner / loop (target <= 1.03), the medians of each, the same ratio for CPU time (all ranks'
time.process_time per step, which other load on shared cores disturbs much less than wall time), the time per step
outside engine.train_batch (the loop's own work: the runner's overhead is the difference), and the largest loss
difference between the two (they train the same steps).

    python benchmarks/runner.py      # dp2 (2 processes) and dp2 x tp2 (4), 5 repeats; writes results/runner_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
from _ranks import run_ranks  # noqa: E402

YAML = ROOT / "tests" / "fixtures" / "mf_reference" / "run.yaml"
DATA = ROOT / "tests" / "fixtures" / "mindrecord" / "text"
LAYOUTS = {"dp2": (2, 1), "dp2_tp2": (2, 2)}
VARIANTS = ("runner", "loop")


def _sets(args: dict, dp: int, tp: int) -> list:
    return ["load_checkpoint=", f"train_dataset.data_loader.dataset_dir={DATA}",
            "train_dataset.data_loader.shuffle=true",
            "use_parallel=true", f"parallel_config.data_parallel={dp}", f"parallel_config.model_parallel={tp}",
            f"runner_config.batch_size={args['global_batch'] // dp}", f"runner_config.epochs={args['epochs']}",
            f"model.model_config.hidden_size={args['hidden']}", f"model.model_config.num_layers={args['layers']}",
            f"model.model_config.num_heads={args['heads']}", f"model.model_config.n_kv_heads={args['kv_heads']}",
            "model.model_config.vocab_size=256", "model.model_config.seq_length=32",
            "model.model_config.multiple_of=64"]


def _setup(rank: int, args: dict):
    import logging
    import warnings

    import deepspeed.ops
    import torch
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only op: a minute of C++ build
    return open(os.path.join(args["out"], f"log_rank{rank}.txt"), "w") if rank == 0 else open(os.devnull, "w")


def _runner_rank(rank: int, world: int, dp: int, tp: int, args: dict) -> dict:
    log = _setup(rank, args)
    from msparallel_ds.run.spec import RunSpec
    from msparallel_ds.run.trainer import Trainer

    n = args["warmup"] + args["steps"]
    spec = RunSpec.load(str(YAML), (), _sets(args, dp, tp), output_dir=os.path.join(args["out"], "runner"),
                        stop_after=n)
    trainer = Trainer(spec, echo=lambda *a: print(*a, file=log))
    rec, log_step = _Record(trainer.engine), trainer.monitor.log

    def timed(step, loss, *a, **k):  # the end of a step: after train_batch, before logging and the checkpoint check
        rec.end(loss)
        return log_step(step, loss, *a, **k)
    trainer.monitor.log = timed
    trainer.train()
    log.close()
    return rec.result()


class _Record:
    """Per step: wall and CPU time at the step's end, and the wall / CPU time inside engine.train_batch (wrapped)."""

    def __init__(self, engine):
        self.ends, self.cpu_ends, self.inside, self.cpu_inside, self.losses = [], [], [], [], []
        inner = engine.train_batch

        def train_batch(batch):
            t, c = time.perf_counter(), time.process_time()
            out = inner(batch)
            self.inside.append(time.perf_counter() - t)
            self.cpu_inside.append(time.process_time() - c)
            return out
        engine.train_batch = train_batch

    def end(self, loss: float) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.losses.append(loss)

    def result(self) -> dict:
        return {"ends": self.ends, "cpu_ends": self.cpu_ends, "inside": self.inside, "cpu_inside": self.cpu_inside,
                "losses": self.losses}


def _loop_rank(rank: int, world: int, dp: int, tp: int, args: dict) -> dict:
    log = _setup(rank, args)
    import itertools

    import numpy as np
    import torch

    import msparallel_ds as msp
    from msparallel_ds.data import open_train_dataset
    from msparallel_ds.run.model import build_model
    from msparallel_ds.run.spec import RunSpec

    raw = RunSpec.load(str(YAML), (), _sets(args, dp, tp)).raw
    run_yaml = os.path.join(args["out"], f"loop_rank{rank}.yaml")
    with open(run_yaml, "w") as f:
        import yaml
        yaml.safe_dump(raw, f)
    g, b = args["global_batch"], args["global_batch"] // dp
    per_epoch = open_train_dataset(raw).n_rows // g
    torch.distributed.init_process_group("gloo")  # as a script under torchrun would
    engine = msp.initialize(lambda: build_model(raw, run_yaml, int(raw.get("seed", 0))), msp.load_config(raw),
                            total_steps=args["epochs"] * per_epoch)
    rows = open_train_dataset(raw, dp_rank=engine.layout.rank("dp"), dp_size=dp)
    rec = _Record(engine)
    for step in range(args["warmup"] + args["steps"]):
        epoch, i = divmod(step, per_epoch)
        ids = np.stack([r["input_ids"] for r in itertools.islice(rows.epoch(epoch, i * b), b)]).astype(np.int64)
        labels = torch.as_tensor(ids[:, 1:].copy())
        labels[torch.as_tensor(ids[:, :-1]) == 0] = -100  # pad_token_id 0: no target, as MindFormers' llama
        loss = float(engine.train_batch({"input_ids": torch.as_tensor(ids[:, :-1]), "shift_labels": labels}))
        rec.end(loss)
        print(f"step {step + 1} loss {loss:.6f}", file=log)
    log.close()
    return rec.result()


def _run(variant: str, layout: str, args: dict) -> dict:
    dp, tp = LAYOUTS[layout]
    fn = _runner_rank if variant == "runner" else _loop_rank
    ranks, failed, wall = run_ranks(fn, dp * tp, (dp, tp, args), timeout=args["timeout"], name=variant)
    if failed:
        return failed
    w, med = args["warmup"], statistics.median

    def per_step(key):
        return [[e[i] - e[i - 1] for i in range(w, len(e))] for e in (r[key] for r in ranks)]
    steps = [max(t) for t in zip(*per_step("ends"))]  # the slowest rank's
    cpu = [sum(t) for t in zip(*per_step("cpu_ends"))]  # all ranks' CPU time
    # outside train_batch: the loop's own work per step (data, logging, bookkeeping), each rank's, the largest
    outside = [max(t) for t in zip(*[[a - b for a, b in zip(d, r["inside"][w:])]
                                     for d, r in zip(per_step("ends"), ranks)])]
    cpu_outside = [sum(t) for t in zip(*[[a - b for a, b in zip(d, r["cpu_inside"][w:])]
                                         for d, r in zip(per_step("cpu_ends"), ranks)])]
    return {"step_s": steps, "median_step_s": med(steps), "cpu_s": cpu, "median_cpu_s": med(cpu),
            "outside_s": outside, "median_outside_s": med(outside), "cpu_outside_s": cpu_outside,
            "median_cpu_outside_s": med(cpu_outside), "losses": ranks[0]["losses"], "wall_s": wall}


def summarise(raw: dict) -> list:
    """Per layout, over the repeats where both variants finished: medians and per-repeat ratios (see the docstring).
    overhead_ratio: (loop step + the runner's extra time outside train_batch) / loop step, the runner's own cost
    per step, which shared-core noise in the (identical) train_batch time does not swamp."""
    summary, med = [], statistics.median
    for lay, runs in raw.items():
        ok = [(r, lp) for r, lp in zip(runs["runner"], runs["loop"]) if "error" not in r and "error" not in lp]
        if not ok:
            summary.append({"layout": lay, "error": "no repeat finished"})
            continue
        ratios = [r["median_step_s"] / lp["median_step_s"] for r, lp in ok]
        cpu_ratios = [r["median_cpu_s"] / lp["median_cpu_s"] for r, lp in ok]
        diff = max(abs(x - y) / abs(y) for r, lp in ok for x, y in zip(r["losses"], lp["losses"]))
        row = {"layout": lay, "processes": LAYOUTS[lay][0] * LAYOUTS[lay][1], "repeats": len(ok),
               "runner_ms": med(r["median_step_s"] for r, _ in ok) * 1e3,
               "loop_ms": med(lp["median_step_s"] for _, lp in ok) * 1e3,
               "ratio": med(ratios), "ratios": ratios, "cpu_ratio": med(cpu_ratios), "cpu_ratios": cpu_ratios,
               "runner_outside_ms": med(r["median_outside_s"] for r, _ in ok) * 1e3,
               "loop_outside_ms": med(lp["median_outside_s"] for _, lp in ok) * 1e3,
               "runner_cpu_outside_ms": med(r["median_cpu_outside_s"] for r, _ in ok) * 1e3,
               "loop_cpu_outside_ms": med(lp["median_cpu_outside_s"] for _, lp in ok) * 1e3,
               "max_loss_rel_diff": diff}
        row["overhead_ratio"] = (row["loop_ms"] + row["runner_outside_ms"] - row["loop_outside_ms"]) / row["loop_ms"]
        summary.append(row)
    return summary


def _print(summary: list) -> None:
    print(f"\n{'layout':<8} {'procs':>5} {'runner ms':>9} {'loop ms':>8} {'ratio':>6} {'CPU ratio':>9} "
          f"{'outside train_batch ms (runner/loop)':>37} {'CPU outside ms':>15} {'overhead':>8}  loss diff")
    for s in summary:
        if "error" in s:
            print(f"{s['layout']:<8} {s['error']}")
            continue
        print(f"{s['layout']:<8} {s['processes']:>5} {s['runner_ms']:>9.1f} {s['loop_ms']:>8.1f} {s['ratio']:>6.3f} "
              f"{s['cpu_ratio']:>9.3f} {s['runner_outside_ms']:>28.2f} / {s['loop_outside_ms']:<6.2f} "
              f"{s['runner_cpu_outside_ms']:>6.2f} / {s['loop_cpu_outside_ms']:<6.2f} {s['overhead_ratio']:>8.4f}  "
              f"{s['max_loss_rel_diff']:.1e}")
        print(f"{'':<8} per-repeat ratios {' '.join(f'{r:.3f}' for r in s['ratios'])}; CPU "
              f"{' '.join(f'{r:.3f}' for r in s['cpu_ratios'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="default: benchmarks/results/runner_cpu.json")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    args = {"warmup": a.warmup, "steps": a.steps, "hidden": a.hidden, "layers": a.layers, "heads": a.heads,
            "kv_heads": a.kv_heads, "global_batch": a.global_batch, "epochs": 100, "timeout": a.timeout,
            "device": "cpu", "vocab": 256, "seq": 32, "ffn": 4 * a.hidden, "attn": "sdpa"}
    common.preload(args)
    import importlib
    for mod in ("msparallel_ds.run.trainer", "msparallel_ds.run.model", "msparallel_ds.data.mindrecord", "yaml"):
        importlib.import_module(mod)
    t0, load0 = time.monotonic(), os.getloadavg()
    raw = {lay: {v: [] for v in VARIANTS} for lay in a.layouts}
    with tempfile.TemporaryDirectory() as out:
        args["out"] = out
        for rep in range(a.repeats):
            for lay in a.layouts:
                order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
                for v in order:
                    res = _run(v, lay, args)
                    raw[lay][v].append(res)
                    msg = f"{res['median_step_s'] * 1e3:.1f} ms/step" if "error" not in res else res["error"]
                    print(f"[repeat {rep + 1}/{a.repeats}] {lay:<8} {v:<7} {msg} ({res['wall_s']:.1f} s)", flush=True)
    summary = summarise(raw)
    _print(summary)
    import torch
    report = {"config": {k: v for k, v in args.items() if k != "out"},
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "load_avg_at_start": load0, "load_avg_at_end": os.getloadavg(),
                          "total_wall_s": time.monotonic() - t0},
              "notes": {"step_s": "time between the ends of consecutive steps after the warm-up, the slowest rank's",
                        "ratio": "median over repeats of runner median step time / loop median step time",
                        "cpu_ratio": "the same for the CPU time all ranks spent per step (time.process_time)",
                        "outside_ms": "per step, the step time less the time inside engine.train_batch: the loop's "
                                      "own work (wall: the largest rank's; CPU: all ranks' sum)",
                        "overhead_ratio": "(loop_ms + runner_outside_ms - loop_outside_ms) / loop_ms"},
              "summary": summary, "raw": raw}
    path = Path(a.json or ROOT / "benchmarks" / "results" / "runner_cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
