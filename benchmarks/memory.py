"""The plan's per-rank memory estimate (msparallel_ds.memory.estimate_memory) against the measured peak of tensor
memory per rank, for dense and pipeline layouts of benchmarks/common.py's model.

Each layout trains common.py's tiny Llama (hidden 256, ffn 512, 4 layers, 8 heads / 4 kv heads, vocab 1024, seq 128,
global batch 8, fp32, AdamW, optimizer_level level2) through msp.initialize on `--world` gloo CPU processes for
`--steps` steps. Measured per rank: the peak, over the last step, of the bytes held by torch tensors: the torch
profiler's allocation events (profile_memory=True) recorded from before the model is built, so parameters,
DeepSpeed's flat buffers and partitions, optimizer states, gradients, reduce buckets and activations all count at
their real sizes and Python / library memory does not (not RSS). A block freed on gloo's worker thread has no free
event: it is taken as freed when the python call that allocated it returns (reported as unreported_free_mib).
Estimated: estimate_memory(plan, stage) for the rank's pipeline stage (stage None when pp == 1).
Ratio = estimate / measured (the target is 0.85-1.15). `--breakdown` also lists, per rank, what is live at the
peak by allocation site (python stacks: slower).

    python benchmarks/memory.py                          # all layouts, writes results/memory_cpu.json
    python benchmarks/memory.py --layouts dp4 pp2_dp2 --breakdown
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
from _ranks import run_ranks  # noqa: E402

# name -> (dp, tp, pp, sequence parallel, pipeline scheduler); global batch and micro_batch_num from the options
LAYOUTS = {"dp4": (4, 1, 1, False, None), "dp2_tp2": (2, 2, 1, False, None), "dp2_tp2_sp": (2, 2, 1, True, None),
           "pp2_dp2": (2, 1, 2, False, "1f1b"), "pp2_tp2": (1, 2, 2, False, "1f1b"), "pp4": (1, 1, 4, False, "1f1b"),
           "pp2_dp2_gpipe": (2, 1, 2, False, "gpipe")}
DEFAULT = ("dp4", "dp2_tp2", "dp2_tp2_sp", "pp2_dp2", "pp2_tp2", "pp4")
MIB = float(1 << 20)


def layout_yaml(args: dict, layout: tuple) -> dict:
    """common.py's msp YAML for a layout (dp, tp, pp, sp, scheduler), with the model's real ffn size and attention
    kernel in model_config (the estimate reads them: HF's sdpa runs a flash kernel here, no s x s scores kept)."""
    dp, tp, pp, sp, sched = layout
    doc = common.msp_yaml(args, {"dp": dp, "tp": tp, "sp": sp})
    doc["model"]["model_config"].update(ffn_hidden_size=args["ffn"], use_flash_attention=args["attn"] == "sdpa")
    if pp > 1:
        mbn = args["micro_batches"]
        doc["parallel_config"].update(pipeline_stage=pp, micro_batch_num=mbn)
        doc["runner_config"]["batch_size"] = args["global_batch"] // (dp * mbn)
        doc["parallel"]["pipeline_config"] = {"pipeline_scheduler": sched}
    return doc


class PeakTracker:
    """Live bytes of CPU tensors from the profiler's allocation events (net of the frees it saw)."""

    def __init__(self, breakdown: bool):
        from torch.profiler import ProfilerActivity, profile

        self.breakdown = breakdown
        # python stacks: a free made on gloo's worker thread is not reported, so such an allocation is taken as
        # freed when the python call that made it returns (all_reduce_flat's flat copy of a gradient bucket)
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        return self.prof.__exit__(*exc)

    def peaks(self, window: str) -> dict:
        """Live bytes at the start, peak and end of the record_function range `window`; with breakdown, the live
        allocations at the peak grouped by allocation site."""
        allocs, marks = [], {}

        def walk(node):
            tag = str(node.tag)
            if tag.endswith("Allocation") and node.extra_fields.device.type == "cpu":
                allocs.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, node))
            elif tag.endswith("TorchOp") and _name(node) == window:
                marks[window] = (node.start_time_ns, node.end_time_ns)
            for child in node.children:
                walk(child)

        for root in self.prof.profiler.kineto_results.experimental_event_tree():
            walk(root)
        start_ns, end_ns = marks[window]
        live_ptr, lost, orphans = {}, [], 0
        for t, size, ptr, node in sorted(allocs, key=lambda a: a[0]):
            if size > 0 and ptr in live_ptr:  # the address came back: its earlier block was freed unseen
                lost.append(live_ptr[ptr])
            if size > 0:
                live_ptr[ptr] = (t, size, node)
            else:
                live_ptr.pop(ptr, None)
        for t, size, node in lost + list(live_ptr.values()):  # taken as freed when its python caller returned
            caller = _caller(node)
            if caller is not None and start_ns <= t <= end_ns:
                allocs.append((caller.end_time_ns, -size, None, node))
                orphans += size
        allocs.sort(key=lambda a: (a[0], a[1] < 0))
        level, start, peak, live, at_peak, by_ptr = 0, None, -1, {}, {}, {}
        for t, size, ptr, node in allocs:
            if t > end_ns:
                break
            if t >= start_ns and start is None:
                start = peak = level
            if size > 0:
                live[id(node)] = (size, node)
                by_ptr[ptr] = id(node)
            else:
                live.pop(by_ptr.pop(ptr, None) if ptr is not None else id(node), None)
            level += size
            if start is not None and level > peak:
                peak = level
                if self.breakdown:
                    at_peak = dict(live)
        out = {"start_mib": (start or 0) / MIB, "peak_mib": peak / MIB, "end_mib": level / MIB,
               "unreported_free_mib": orphans / MIB}
        if self.breakdown:
            groups = collections.Counter()
            for size, node in at_peak.values():
                groups[_site(node)] += size
            out["at_peak"] = [[k, round(v / MIB, 3)] for k, v in groups.most_common()]
        return out


def _name(node) -> str:
    try:
        return node.name
    except UnicodeDecodeError:  # a few profiler names are not valid UTF-8
        return "?"


def _caller(node):
    """The innermost python call around an allocation (None without python stacks)."""
    n = node.parent
    while n is not None and not str(n.tag).endswith("PyCall"):
        n = n.parent
    return n


def _site(node) -> str:
    """The allocating op and the first python frames above it outside torch."""
    parts, n = [], node.parent
    while n is not None and len(parts) < 4:
        name = _name(n)
        if str(n.tag).endswith("PyCall"):
            if "site-packages/torch/" not in name and not name.startswith("<built-in"):
                parts.append(name.rsplit("/", 1)[-1][:60])
        elif str(n.tag).endswith("TorchOp") and not parts:
            parts.append(name)
        n = n.parent
    return " < ".join(parts)


def _rank_main(rank: int, world: int, layout: tuple, args: dict) -> dict:
    import logging
    import warnings
    from datetime import timedelta

    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger
    from torch.profiler import record_function

    import msparallel_ds as msp
    from msparallel_ds.memory import estimate_memory

    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")  # level2 with pp runs as level1: the plan and the estimate say so
    torch.set_num_threads(args["threads"])
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args["timeout"]))
    ids = common.fixed_batches(args)[0]
    doc = layout_yaml(args, layout)
    with PeakTracker(args.get("breakdown", False)) as tracker:
        model = common.tiny_llama(args)  # built under the tracker: the parameters count
        eng = msp.initialize(model, doc, optimizer=lambda p: torch.optim.AdamW(p, lr=args["lr"]))
        rows = eng.micro_batch_size * eng.gradient_accumulation_steps
        d = eng.layout.rank("dp")
        for i in range(args["memory_steps"]):
            dist.barrier()
            with record_function(f"memory_step_{i}"):
                eng.train_batch({"input_ids": ids[d * rows:(d + 1) * rows], "labels": ids[d * rows:(d + 1) * rows]})
    measured = tracker.peaks(f"memory_step_{args['memory_steps'] - 1}")
    stage = eng.layout.rank("pp") if eng.layout.size("pp") > 1 else None
    est = estimate_memory(eng.plan, stage)
    return {"rank": rank, "stage": stage, "tp_rank": eng.layout.rank("tp"), "measured": measured,
            "estimate": asdict(est), "estimate_mib": est.total_gib * 1024}


def measure(layout: tuple, args: dict) -> tuple:
    """(per-rank results, None) or (None, {"error": ...}) and wall seconds: one untimed run of `layout`."""
    ranks, failed, wall = run_ranks(_rank_main, args["world"], (layout, args), timeout=args["timeout"],
                                    name="memory")
    return ranks, failed, wall


def _summarise(name: str, ranks: list) -> dict:
    dp, tp, pp, sp, sched = LAYOUTS[name]
    rows = []
    for r in ranks:
        peak = r["measured"]["peak_mib"]
        rows.append({"rank": r["rank"], "stage": r["stage"], "estimate_mib": r["estimate_mib"], "measured_mib": peak,
                     "ratio": r["estimate_mib"] / peak, "estimate": r["estimate"], "measured": r["measured"]})
    worst = max(rows, key=lambda x: x["measured_mib"])
    return {"layout": name, "dp": dp, "tp": tp, "pp": pp, "sp": sp, "pp_schedule": sched, "ranks": rows,
            "max_abs_error": max(abs(x["ratio"] - 1) for x in rows), "busiest_rank": worst["rank"]}


def _print(results: list) -> None:
    head = (f"{'layout':<14} {'rank':>4} {'stage':>5} {'estimate MiB':>12} {'measured MiB':>12} {'ratio':>6}  "
            f"{'weights':>7} {'grads':>6} {'optim':>6} {'buffers':>7} {'act':>6} {'logits':>6}")
    print(head)
    print("-" * len(head))
    for res in results:
        if "error" in res:
            print(f"{res['layout']:<14} not run: {res['error']}")
            continue
        for r in res["ranks"]:
            e = r["estimate"]
            parts = [e[k] * 1024 for k in ("weights_gib", "grads_gib", "optimizer_gib", "buffers_gib",
                                                    "activations_gib", "logits_gib")]
            stage = "-" if r["stage"] is None else str(r["stage"])
            print(f"{res['layout']:<14} {r['rank']:>4} {stage:>5} {r['estimate_mib']:12.2f} {r['measured_mib']:12.2f} "
                  f"{r['ratio']:6.3f}  " + " ".join(f"{p:>{w}.2f}" for p, w in zip(parts, (7, 6, 6, 7, 6, 6))))
    print("estimate: estimate_memory(plan, stage) of the rank's pipeline stage (parts in MiB); measured: peak bytes "
          "of live torch tensors over the last step (profiler allocation events since before the model was built); "
          "ratio = estimate / measured.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(DEFAULT), choices=list(LAYOUTS))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4, help="micro_batch_num of the pipeline layouts")
    ap.add_argument("--steps", type=int, default=2, help="steps per layout; the last one is measured")
    ap.add_argument("--breakdown", action="store_true", help="list what is live at each rank's peak")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="default: benchmarks/results/memory_cpu.json")
    a = ap.parse_args()
    args = {"world": a.world, "tp": 2, "device": "cpu", "threads": 1, "hidden": 256, "ffn": 512, "layers": 4,
            "heads": 8, "kv_heads": 4, "vocab": 1024, "seq": 128, "global_batch": 8, "attn": "sdpa", "lr": 1e-3,
            "warmup": 0, "steps": a.steps, "memory_steps": a.steps, "micro_batches": a.micro_batches,
            "breakdown": a.breakdown, "timeout": a.timeout}
    os.environ["OMP_NUM_THREADS"] = "1"
    common.preload(args)
    results = []
    for name in a.layouts:
        dp, tp, pp, _, _ = LAYOUTS[name]
        if dp * tp * pp != a.world:
            results.append({"layout": name, "error": f"needs {dp * tp * pp} processes, --world is {a.world}"})
            continue
        ranks, failed, wall = measure(LAYOUTS[name], args)
        results.append({"layout": name, **failed} if failed else {**_summarise(name, ranks), "wall_s": wall})
        print(f"{name}: {'failed: ' + failed['error'] if failed else 'done'} ({wall:.1f} s)", flush=True)
    print()
    _print(results)
    if a.breakdown:
        for res in results:
            for r in res.get("ranks", []):
                print(f"\n{res['layout']} rank {r['rank']}: live at the peak ({r['measured_mib']:.2f} MiB)")
                for site, mib in r["measured"]["at_peak"][:30]:
                    print(f"  {mib:8.3f}  {site}")
    import torch

    report = {"config": args, "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                          "torch": torch.__version__, "cpu_count": os.cpu_count()},
              "notes": {"measured": "peak over the last step of live CPU tensor bytes, from torch profiler allocation "
                                    "events (profile_memory=True) recorded from before the model is built",
                        "estimate": "msparallel_ds.memory.estimate_memory(plan, stage) of the rank's stage",
                        "ratio": "estimate / measured"},
              "results": results}
    path = Path(a.json or ROOT / "benchmarks" / "results" / "memory_cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
