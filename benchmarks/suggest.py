"""Does suggest's cost model rank layouts the way they really run? And what does it choose for real MindFormers configs?

(1) Calibrate the cost model on this machine (matmul FLOP/s, loopback gloo all-reduce bandwidth and latency), then
run every layout suggest keeps for benchmarks/train.py's tiny Llama on 4 processes (gloo, CPU; the machine's memory
/ 4 per rank; each layout in its own group of 4 via _ranks.run_ranks, train.py's model, batches and preloading
reused), --warmup untimed steps then the median of --steps timed steps (a step's time is the slowest rank's).
Reported: the Spearman rank correlation of predicted vs measured step times (ranks with ties averaged, then
Pearson), and whether the predicted best is within 10% of the measured best.
(2) For real MindFormers configs (../shared/mindformers-configs): suggest's choice vs the hand-written strategy,
same model and world size (the YAML's degrees), --device-memory per device, both costed with the same model.

    python benchmarks/suggest.py                          # all feasible layouts; writes results/suggest_cpu.json
    python benchmarks/suggest.py --layouts 2 --steps 2 --warmup 1    # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402  (benchmarks/common.py: the tiny Llama, its batches and preloading)
from _ranks import run_ranks  # noqa: E402

# (DeepSeek-V3's 1024-device search takes minutes on 2 cores: pass it with --configs to include it)
CONFIGS = ("llama2__pretrain_llama2_70b.yaml", "qwen3__pretrain_qwen3_32b_4k.yaml",
           "mixtral__pretrain_mixtral-8x7b.yaml", "qwen2_5__finetune_qwen2.5_72B_32K.yaml")
SHARED = ROOT.parent / "shared" / "mindformers-configs"


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1  # ties share the average rank
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _base_yaml(args: dict) -> dict:
    y = common.msp_yaml(args, {"dp": args["world"], "tp": 1, "sp": False})
    y["model"]["model_config"]["ffn_hidden_size"] = args["ffn"]  # msp_yaml leaves it to the HF model
    return y


def _rank_main(rank: int, world: int, yaml_dict: dict, args: dict) -> dict:
    import logging

    import deepspeed.ops
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    import msparallel_ds as msp

    ds_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args["threads"])
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args["timeout"]))
    batches = common.fixed_batches(args)
    lr = args["lr"]
    eng = msp.initialize(common.tiny_llama(args), yaml_dict, optimizer=lambda p: torch.optim.AdamW(p, lr=lr))
    rows = args["global_batch"] // eng.layout.size("dp")
    d = eng.layout.rank("dp")
    times = []
    for i, ids in enumerate(batches):
        part = ids[d * rows:(d + 1) * rows]
        dist.barrier()
        t0 = time.perf_counter()
        eng.train_batch({"input_ids": part, "labels": part})
        if i >= args["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"times_s": times}


def measure(cands, args: dict) -> list[dict]:
    rows = []
    for i, cand in enumerate(cands):
        ranks, failed, wall = run_ranks(_rank_main, args["world"], (cand.yaml(), args), timeout=args["timeout"],
                                        name=f"suggest{i}")
        row = {"layout": cand.label, "predicted_s": cand.step_time, "memory_gib": cand.memory_gib, "why": cand.why,
               "wall_s": wall}
        if failed:
            row["error"] = failed["error"]
        else:
            steps = [max(r["times_s"][k] for r in ranks) for k in range(args["steps"])]
            row.update(measured_s=statistics.median(steps), step_times_s=steps)
        print(f"[{i + 1}/{len(cands)}] {cand.label:<52} predicted {cand.step_time:.4f} s  "
              + (f"measured {row['measured_s']:.4f} s" if "measured_s" in row else f"failed: {row['error']}"),
              flush=True)
        rows.append(row)
    return rows


def real_configs(names, memory_gib: float) -> list[dict]:
    from msparallel_ds.suggest import Links, cost_of_yaml, suggest
    from msparallel_ds.suggest.model import hand_written_world

    out = []
    for name in names:
        path = SHARED / name
        row = {"config": name}
        try:
            t0 = time.monotonic()
            world = hand_written_world(path)
            hand = cost_of_yaml(path, Links())
            best = suggest(path, world, memory_gib * 2**30, links=Links(), top=1)
            row.update(world=world, hand_layout=hand.label, hand_step_s=hand.step_time, hand_memory_gib=hand.memory_gib,
                       hand_over_memory=hand.memory_gib > 0.9 * memory_gib, search_s=time.monotonic() - t0)
            if best:
                row.update(suggest_layout=best[0].label, suggest_step_s=best[0].step_time,
                           suggest_memory_gib=best[0].memory_gib, speedup=hand.step_time / best[0].step_time)
            else:
                row["suggest_layout"] = "none fits"
        except Exception as exc:  # noqa: BLE001  a config whose shape does not parse is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        out.append(row)
        print(json.dumps(row, default=str), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", type=int, default=0, help="run at most this many (evenly spread over the ranking)")
    ap.add_argument("--all", action="store_true", help="every kept layout, not one per structure")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--mfu", type=float, default=None, help="share of the matmul rate a step reaches (default: "
                    "calibrated: forward + backward of an MLP block against bare matmuls, on the same processes)")
    ap.add_argument("--device-memory", type=float, default=64, help="GiB per device for the real configs")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "suggest_cpu.json"))
    a = ap.parse_args()
    args = {"world": 4, "device": "cpu", "threads": a.threads, "hidden": 256, "ffn": 512, "layers": 4, "heads": 8,
            "kv_heads": 4, "vocab": 1024, "seq": 128, "global_batch": 8, "attn": "sdpa", "lr": 1e-3,
            "warmup": a.warmup, "steps": a.steps, "timeout": a.timeout}
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    from dataclasses import replace

    from msparallel_ds.suggest import read_model, search
    from msparallel_ds.suggest.calibrate import calibrate

    links, calib = calibrate(world=args["world"])  # before the heavy imports: the probe spawns `world` processes
    links = replace(links, devices_per_node=args["world"], **({"mfu": a.mfu} if a.mfu else {}))
    print("calibration: " + json.dumps(calib, default=str), flush=True)
    common.preload(args)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    res = search(read_model(_base_yaml(args)), args["world"], host / args["world"], links)
    cands = res.candidates
    if not a.all:  # one layout per structure (the predicted best of its micro-batch / recompute / ZeRO variants)
        seen, picked = set(), []
        for c in cands:
            lay = c.layout
            key = (lay.pp, lay.vpp, lay.schedule, lay.dp, lay.cp, lay.cp_algo, lay.ulysses, lay.tp, lay.sp, lay.zero,
                   lay.mbi)
            if key not in seen:
                seen.add(key)
                picked.append(c)
        cands = picked
    if a.layouts and a.layouts < len(cands):
        step = (len(cands) - 1) / max(a.layouts - 1, 1)
        cands = [cands[round(i * step)] for i in range(a.layouts)]
    print(f"{res.counts['kept']} layouts kept of {res.counts['enumerated']} enumerated; running {len(cands)}",
          flush=True)
    rows = measure(cands, args)
    ok = [r for r in rows if "measured_s" in r]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok]) if len(ok) > 1 else float("nan")
    best_pred = min(ok, key=lambda r: r["predicted_s"]) if ok else None
    best_meas = min(ok, key=lambda r: r["measured_s"]) if ok else None
    within = bool(ok) and best_pred["measured_s"] <= 1.1 * best_meas["measured_s"]
    print(f"\n{'layout':<52} {'predicted s':>11} {'measured s':>10} {'GiB':>6}")
    for r in sorted(ok, key=lambda r: r["measured_s"]):
        print(f"{r['layout']:<52} {r['predicted_s']:11.4f} {r['measured_s']:10.4f} {r['memory_gib']:6.3f}")
    print(f"Spearman rho (predicted vs measured) = {rho:.3f} over {len(ok)} layouts; predicted best "
          f"{best_pred and best_pred['layout']!r} within 10% of the measured best "
          f"{best_meas and best_meas['layout']!r}: "
          f"{within}")
    print("\nreal MindFormers configs (hand-written vs suggest, same cost model, "
          f"{a.device_memory:g} GiB/device):")
    real = real_configs(a.configs, a.device_memory)
    for r in real:
        if "error" in r:
            print(f"{r['config']}: {r['error']}")
            continue
        over = " (OVER MEMORY under our estimate)" if r["hand_over_memory"] else ""
        print(f"{r['config']} world {r['world']}\n  hand    {r['hand_layout']:<58} {r['hand_step_s']:9.3f} s "
              f"{r['hand_memory_gib']:7.1f} GiB{over}\n  suggest {r.get('suggest_layout', '-'):<58} "
              f"{r.get('suggest_step_s', float('nan')):9.3f} s {r.get('suggest_memory_gib', float('nan')):7.1f} GiB")
    report = {"calibration": calib, "links": links.__dict__, "counts": res.counts, "runs": rows, "spearman": rho,
              "predicted_best_within_10pct": within, "real_configs": real, "config": args}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
