"""Training throughput and peak memory per rank: msparallel_ds against plain DeepSpeed in the same run.

A tiny Llama (built from LlamaConfig, no download) trains on N processes (gloo on CPU, nccl on CUDA), every
variant on the same random token ids (fixed seed), the same global batch and the same AdamW:
  ds_zero2        plain DeepSpeed ZeRO-2 data parallel (deepspeed.initialize without mpu, the HF model's own
                  loss); the baseline every ratio is taken against. Its zero_optimization section is the one the
                  msp_dp YAML maps to (plan.to_deepspeed()), so (a) and (b) differ only in the engine path.
  msp_dp          msp.initialize with data_parallel=N, model_parallel=1, optimizer_level: level2 (ZeRO-2): our
                  overhead at tp=1, cp=1 (issue 5 expects tokens/s within 5% of ds_zero2).
  msp_tp          data_parallel=N/tp x model_parallel=tp.
  msp_tp_sp       the same with use_seq_parallel: true.
  ds_autotp       DeepSpeed AutoTP for training ("tensor_parallel": {"autotp_size": tp} in the DeepSpeed config;
                  sharding happens inside deepspeed.initialize, following the HF base_model_tp_plan), dp=N/tp,
                  ZeRO-2 over dp, the HF model's own loss. It runs on CPU/gloo with DeepSpeed 0.19.8.

Default model: hidden 256, ffn 512, 4 layers, 8 heads / 4 kv heads, vocab 1024, seq 128, global batch 8 rows
(a step takes about 0.3-0.6 s on 4 processes sharing 2 cores); every size is an option.

Each variant runs in its own group of N processes (forked from this process after the heavy imports, so a group
starts in seconds, not tens of seconds, on CPU; spawned on CUDA, one GPU per rank); the whole comparison is
repeated --repeats times with the variant order rotated (interleaved, to spread drift from other load on the
machine). Per run: `--warmup` untimed steps, then `--steps` timed ones (barrier, then the step; a step's time is
the slowest rank's); tokens/s = global tokens per step / median step time. Also tokens per CPU-second: the same
tokens / the CPU time all ranks spent in the step (time.process_time), which other load on shared cores disturbs
much less than wall time. Reported: medians over repeats, and the median over repeats of the per-repeat ratio to
ds_zero2.

Memory per rank: on CPU the process's peak RSS (getrusage ru_maxrss: includes Python, torch, DeepSpeed and the
pages shared with the parent) and its delta over the RSS right after the model is built (before the engine);
on CUDA torch.cuda.max_memory_allocated and its delta over memory_allocated after the model is moved.
The final loss is the global-batch mean of the last step (the variants train the same thing: ds_zero2 and
msp_dp should agree to float32 reduction order).

    python benchmarks/train.py                      # 4 CPU processes, 3 repeats, writes results/train_cpu.json
    python benchmarks/train.py --device cuda --world 4 --hidden 1024 --layers 8 --seq 1024
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _collectives import count_collectives  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
from _ranks import run_ranks  # noqa: E402
from common import fixed_batches, msp_yaml, peak_rss_mib, preload, rss_mib, tiny_llama  # noqa: E402

VARIANTS = ("ds_zero2", "msp_dp", "msp_tp", "msp_tp_sp", "ds_autotp")
BASELINE = "ds_zero2"
def _layout(name: str, world: int, tp: int) -> dict:
    t = 1 if name in ("ds_zero2", "msp_dp") else tp
    return {"dp": world // t, "tp": t, "sp": name == "msp_tp_sp"}


def _deepspeed_engine(model, args, lay, zero, device):
    """Plain DeepSpeed: ZeRO-2 data parallel (tp=1), or AutoTP training (tp>1) from the config entry."""
    import deepspeed
    import torch

    ds_cfg = {"train_micro_batch_size_per_gpu": args["global_batch"] // lay["dp"], "gradient_accumulation_steps": 1,
              "zero_optimization": dict(zero), "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "steps_per_print": 2**30}
    if lay["tp"] > 1:
        # No train_batch_size: DeepSpeed 0.19.8 checks it against the world size (not dp) before AutoTP has
        # built its groups; micro batch x gas is what it uses per rank.
        ds_cfg["tensor_parallel"] = {"autotp_size": lay["tp"]}
    else:
        ds_cfg["train_batch_size"] = args["global_batch"]
    model.to(device)
    lr = args["lr"]
    # A callable optimizer: DeepSpeed builds it on the module's parameters after AutoTP has sharded them.
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=lambda p: torch.optim.AdamW(p, lr=lr), config=ds_cfg,
                                        dist_init_required=False)
    dp_rank = eng.mpu.get_data_parallel_rank() if eng.mpu is not None else eng.global_rank
    rows = args["global_batch"] // lay["dp"]

    def step(ids):
        x = ids[dp_rank * rows:(dp_rank + 1) * rows].to(device)
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        return loss.detach()

    def global_loss(loss):  # tp peers hold the same value and every dp rank the same token count
        import torch.distributed as dist

        loss = loss.float().clone()
        dist.all_reduce(loss)
        return loss.item() / dist.get_world_size()

    return step, global_loss, ds_cfg


def _msp_engine(model, args, lay):
    import torch

    import msparallel_ds as msp

    lr = args["lr"]
    eng = msp.initialize(model, msp_yaml(args, lay), optimizer=lambda p: torch.optim.AdamW(p, lr=lr))
    rows = eng.micro_batch_size * eng.gradient_accumulation_steps
    dp_rank = eng.layout.rank("dp")
    assert eng.layout.size("dp") * rows == args["global_batch"], "global batch does not split over dp"

    def step(ids):
        return eng.train_batch({"input_ids": ids[dp_rank * rows:(dp_rank + 1) * rows],
                                "labels": ids[dp_rank * rows:(dp_rank + 1) * rows]})

    return step, lambda loss: loss.item(), eng.ds.config


def _rank_main(rank: int, world: int, name: str, args: dict) -> dict:
    """One rank of variant `name` (run by _ranks.run_ranks, which sets the env, reports and cleans up)."""
    marks = {"start": time.perf_counter()}
    import logging
    import warnings

    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
    torch.set_num_threads(args["threads"])
    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:  # the shm op only serves inference all-reduce; building it costs a minute of C++ compilation
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args["timeout"]))
    marks["pg"] = time.perf_counter()
    lay = _layout(name, world, args["tp"])
    batches = fixed_batches(args)
    model = tiny_llama(args)
    if cuda:
        model.to(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = rss_mib()
    marks["model"] = time.perf_counter()
    if name.startswith("ds_"):
        step, global_loss, ds_cfg = _deepspeed_engine(model, args, lay, args["zero"], device)
    else:
        step, global_loss, ds_cfg = _msp_engine(model, args, lay)
    marks["engine"] = time.perf_counter()
    times, cpu_times, losses, counted = [], [], [], {}
    for i, ids in enumerate(batches):
        dist.barrier()
        counting = args.get("count_collectives") and i >= args["warmup"]  # a profile pass: not a timing run
        with count_collectives() if counting else contextlib.nullcontext(counted) as counts:
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(ids)
            if cuda:
                torch.cuda.synchronize()
        if i >= args["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        for key, (calls, nbytes) in counts.items() if counting else ():
            total = counted.setdefault(key, [0, 0])
            total[0], total[1] = total[0] + calls / args["steps"], total[1] + nbytes / args["steps"]
        losses.append(global_loss(loss))
    marks["steps"] = time.perf_counter()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
    keys = list(marks)
    res = {"phases_s": {k: marks[k] - marks[p] for p, k in itertools.pairwise(keys)}, "times_s": times,
           "cpu_times_s": cpu_times, "losses": losses, "peak_mib": peak, "base_mib": base,
           "collectives_per_step": counted,
           "ds_config": json.loads(json.dumps(ds_cfg, default=str)) if rank == 0 else None}
    return res

def _run_group(name: str, args: dict) -> dict:
    """One variant on `world` processes; returns per-rank results or {"error": ...}."""
    world = args["world"]
    ranks, failed, wall = run_ranks(_rank_main, world, (name, args), timeout=args["timeout"],
                                    spawn=args["device"] == "cuda", name=name)
    if failed:
        return failed
    step_times = [max(r["times_s"][i] for r in ranks) for i in range(args["steps"])]  # the slowest rank's
    cpu_times = [sum(r["cpu_times_s"][i] for r in ranks) for i in range(args["steps"])]  # all ranks' CPU time
    med, cpu_med = statistics.median(step_times), statistics.median(cpu_times)
    tokens = args["global_batch"] * args["seq"]
    return {"step_times_s": step_times, "rank_step_times_s": [r["times_s"] for r in ranks],
            "rank_cpu_times_s": [r["cpu_times_s"] for r in ranks], "median_step_s": med, "tokens_per_s": tokens / med,
            "cpu_s_per_step": cpu_times, "tokens_per_cpu_s": tokens / cpu_med,
            "peak_mib_per_rank": [r["peak_mib"] for r in ranks], "base_mib_per_rank": [r["base_mib"] for r in ranks],
            "collectives_per_step": ranks[0]["collectives_per_step"], "losses": ranks[0]["losses"],
            "final_loss": ranks[0]["losses"][-1], "ds_config": ranks[0]["ds_config"],
            "phases_s": {k: max(r["phases_s"][k] for r in ranks) for k in ranks[0]["phases_s"]}, "wall_s": wall}


def _memory_columns(name: str, args: dict, row: dict, world: int) -> dict:
    """The plan's per-rank memory estimate of an msp variant (estimate_memory of its plan: the busiest rank) next to
    the measured peak of tensor memory per rank: on CPU from one separate untimed run (benchmarks/memory.py: torch
    profiler allocation events, not RSS), on CUDA torch.cuda.max_memory_allocated of the timed runs."""
    import memory as memory_bench  # benchmarks/memory.py (imports this module: loaded here, not at the top)

    import msparallel_ds as msp
    from msparallel_ds.memory import estimate_memory

    lay = _layout(name, world, args["tp"])
    layout = (lay["dp"], lay["tp"], 1, lay["sp"], None)
    est = estimate_memory(msp.make_plan(msp.load_config(memory_bench.layout_yaml(args, layout)), world_size=world))
    if args["device"] == "cuda":
        measured = row.get("peak_mib_per_rank")
    else:
        ranks, failed, _ = memory_bench.measure(layout, {**args, "memory_steps": 2, "breakdown": False})
        measured = max(r["measured"]["peak_mib"] for r in ranks) if ranks else None
        if failed:
            return {"estimate_mib_per_rank": est.total_gib * 1024, "memory_error": failed["error"]}
    return {"estimate_mib_per_rank": est.total_gib * 1024, "tensor_peak_mib_per_rank": measured,
            "estimate_ratio": est.total_gib * 1024 / measured if measured else None}


def _summarise(name: str, runs: list, base_runs: list, lay: dict) -> dict:
    ok = [r for r in runs if "error" not in r]
    row = {"variant": name, "layout": f"dp{lay['dp']} x tp{lay['tp']}" + (" +sp" if lay["sp"] else "")}
    if not ok:
        return {**row, "error": runs[0]["error"]}
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base_runs)
              if "error" not in r and "error" not in b]
    cpu_ratios = [r["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for r, b in zip(runs, base_runs)
                  if "error" not in r and "error" not in b]
    peaks = [max(r["peak_mib_per_rank"]) for r in ok]
    deltas = [max(p - b for p, b in zip(r["peak_mib_per_rank"], r["base_mib_per_rank"])) for r in ok]
    loss_diffs = [max(abs(x - y) for x, y in zip(r["losses"], b["losses"])) for r, b in zip(runs, base_runs)
                  if "error" not in r and "error" not in b]
    return {**row, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
            "median_step_s": statistics.median(r["median_step_s"] for r in ok),
            "ratio_vs_baseline": statistics.median(ratios) if ratios else None,
            "ratios_per_repeat": ratios,
            "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in ok),
            "cpu_ratio_vs_baseline": statistics.median(cpu_ratios) if cpu_ratios else None,
            "cpu_ratios_per_repeat": cpu_ratios, "peak_mib_per_rank": statistics.median(peaks),
            "delta_mib_per_rank": statistics.median(deltas), "final_loss": ok[-1]["final_loss"],
            "max_loss_diff_vs_baseline": max(loss_diffs) if loss_diffs else None, "failed_repeats": len(runs) - len(ok)}


def _memory_cells(r: dict) -> str:
    cells = [(r.get("estimate_mib_per_rank"), 8, ".1f"), (r.get("tensor_peak_mib_per_rank"), 10, ".1f"),
             (r.get("estimate_ratio"), 8, ".3f")]
    return " ".join(f"{v:{w}{f}}" if v is not None else f"{'-':>{w}}" for v, w, f in cells)


def _print(rows: list, args: dict) -> None:
    mem = "peak MiB/rank" if args["device"] == "cuda" else "peak RSS MiB/rank"
    head = (f"{'variant':<10} {'layout':<14} {'tokens/s':>9} {'x ' + BASELINE:>11} {'tok/CPU-s':>9} "
            f"{'x ' + BASELINE:>11} {mem:>17} {'delta MiB':>9} {'final loss':>10} {'est MiB':>8} "
            f"{'tensor MiB':>10} {'est/meas':>8}")
    print(head)
    print("-" * len(head))

    def ratio(x):
        return f"{x:11.3f}" if x is not None else f"{'-':>11}"

    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<10} {r['layout']:<14} not run: {r['error']}")
            continue
        print(f"{r['variant']:<10} {r['layout']:<14} {r['tokens_per_s']:9.0f} {ratio(r['ratio_vs_baseline'])} "
              f"{r['tokens_per_cpu_s']:9.0f} {ratio(r['cpu_ratio_vs_baseline'])} {r['peak_mib_per_rank']:17.0f} "
              f"{r['delta_mib_per_rank']:9.0f} {r['final_loss']:10.5f} " + _memory_cells(r))
    print(f"tokens/s: global tokens per step / median step time (slowest rank), median of {args['repeats']} "
          f"interleaved repeats; tok/CPU-s: the same tokens / CPU seconds all ranks spent on the step (less "
          f"sensitive to other load on shared cores); ratios: median of per-repeat ratios to {BASELINE}. est MiB: "
          f"the plan's estimate_memory per rank (msp variants); tensor MiB: measured peak of torch tensor bytes per "
          f"rank (CPU: one separate untimed run, torch profiler allocation events, benchmarks/memory.py; CUDA: "
          f"max_memory_allocated); est/meas: their ratio.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--world", type=int, default=4, help="processes per variant")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size of msp_tp, msp_tp_sp, ds_autotp")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512, help="intermediate size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8, help="rows per optimizer step over all dp ranks")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attention implementation")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of the whole comparison")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per variant group before it is killed")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/train_<device>.json")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    args = {k: getattr(a, k) for k in ("world", "tp", "device", "threads", "hidden", "ffn", "layers", "heads",
                                       "kv_heads", "vocab", "seq", "global_batch", "attn", "lr", "warmup", "steps",
                                       "repeats", "timeout")}
    if a.global_batch % a.world or a.world % a.tp:
        ap.error(f"--global-batch {a.global_batch} must split over --world {a.world}, and --tp {a.tp} divide it")
    preload(args)
    import deepspeed
    import torch
    import transformers

    import msparallel_ds as msp

    # (a) uses exactly the ZeRO section that (b)'s YAML maps to, so the two differ only in the engine path.
    plan = msp.make_plan(msp.load_config(msp_yaml(args, _layout("msp_dp", a.world, a.tp))), world_size=a.world)
    args["zero"] = plan.to_deepspeed()["zero_optimization"]
    names = list(dict.fromkeys([BASELINE] + a.variants))
    raw = {n: [] for n in names}
    t0, load0 = time.monotonic(), os.getloadavg() if hasattr(os, "getloadavg") else None
    for rep in range(a.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotate: no variant always runs first
        for name in order:
            res = _run_group(name, args)
            raw[name].append({"repeat": rep, **res})
            status = f"{res['tokens_per_s']:.0f} tokens/s" if "error" not in res else f"failed: {res['error']}"
            print(f"[repeat {rep + 1}/{a.repeats}] {name:<10} {status} ({res['wall_s']:.1f} s)", flush=True)
    by_rep = {n: sorted(raw[n], key=lambda r: r["repeat"]) for n in names}
    rows = [_summarise(n, by_rep[n], by_rep[BASELINE], _layout(n, a.world, a.tp)) for n in names]
    for row in rows:  # after the timed repeats, never inside them
        if row["variant"].startswith("msp_") and "error" not in row:
            row.update(_memory_columns(row["variant"], args, row, a.world))
    print()
    _print(rows, args)
    report = {
        "config": {k: v for k, v in args.items()},
        "machine": {"cpu_count": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else None, "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                    "load_avg_at_start": load0, "load_avg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
                    "total_wall_s": time.monotonic() - t0},
        "notes": {"tokens_per_s": "global tokens per step / median over timed steps of the slowest rank's step time; "
                                  "per variant the median over repeats",
                  "ratio_vs_baseline": f"median over repeats of tokens/s / {BASELINE} tokens/s in the same repeat",
                  "memory": ("torch.cuda.max_memory_allocated; delta over memory_allocated after the model is moved"
                             if a.device == "cuda" else
                             "ru_maxrss (process RSS incl. Python/torch/DeepSpeed); delta over VmRSS after the "
                             "model is built, before the engine"),
                  "estimate_mib_per_rank": "msparallel_ds.memory.estimate_memory(plan).total_gib of the variant's "
                                           "plan (model_config with the model's ffn size and flash attention)",
                  "tensor_peak_mib_per_rank": ("torch.cuda.max_memory_allocated" if a.device == "cuda" else
                                               "peak torch tensor bytes per rank (max over ranks) over the 2nd of "
                                               "2 steps of a separate untimed run: torch profiler allocation "
                                               "events from before the model is built (benchmarks/memory.py)"),
                  "ds_autotp": "DeepSpeed config 'tensor_parallel': {'autotp_size': tp} (deepspeed.tp_model_init is "
                               "record-only in 0.19.x: sharding happens in deepspeed.initialize). For Llama it follows "
                               "the HF base_model_tp_plan: q/k/v/gate/up column, o/down row (all-reduce), lm_head "
                               "column with gathered logits, untied embedding replicated; no sequence parallel. "
                               "train_batch_size omitted: DeepSpeed checks it against the world size, not dp, "
                               "before AutoTP has built its groups. Runs on CPU/gloo."},
        "summary": rows,
        "raw": raw,
    }
    path = Path(a.json or ROOT / "benchmarks" / "results" / f"train_{a.device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
