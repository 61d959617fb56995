"""Our engine's per-step overhead over plain DeepSpeed ZeRO-2, where it is largest: a tiny model, dp only.

msp.initialize (data_parallel = world, ZeRO-2 from the YAML) against deepspeed.initialize with the same
zero_optimization section (plan.to_deepspeed()), on the same tiny Llama (hidden 64, 4 layers, seq 128, 2 rows per
rank), the same batch and AdamW: with so little compute per step, any extra collective or per-step Python work shows.
Both variants are benchmarks/train.py's (ds_zero2, msp_dp): same model builder, same engines, same timing (barrier,
then the step; a step's time is the slowest rank's).

Rounds alternate A/B and B/A (each variant in its own group of processes, forked after the heavy imports); per
round, the ratio of the median step times (msp / DeepSpeed: above 1 = we are slower). Reported: the median over
rounds of that ratio, and the same for CPU time (all ranks' process time per step, which other load on the shared
cores disturbs less). A last pass per variant (not timed) counts the torch.distributed calls per step, by op and
group size, with their payload bytes (benchmarks/_collectives.py).

    python benchmarks/overhead.py                  # 4 CPU processes, 9 rounds; writes results/overhead_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
import train  # noqa: E402

BASE, OURS = "ds_zero2", "msp_dp"


def _round(args: dict, first: str, second: str) -> dict:
    out = {}
    for name in (first, second):
        res = train._run_group(name, args)
        if "error" in res:
            raise SystemExit(f"{name} failed: {res['error']}")
        out[name] = res
    return out


def _collective_table(counts: dict) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k} x{v[0]:g} ({v[1]:.0f} B)" for k, v in sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows-per-rank", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9, help="A/B rounds (order alternates)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    ap.add_argument("--no-count", action="store_true", help="skip the collective-counting pass")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "overhead_cpu.json"))
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    args = {"world": a.world, "tp": 1, "device": "cpu", "threads": 1, "hidden": a.hidden, "ffn": a.ffn,
            "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads, "vocab": a.vocab, "seq": a.seq,
            "global_batch": a.rows_per_rank * a.world, "attn": "sdpa", "lr": 1e-3, "warmup": a.warmup,
            "steps": a.steps, "repeats": a.rounds, "timeout": 300}
    common.preload(args)
    import msparallel_ds as msp

    plan = msp.make_plan(msp.load_config(common.msp_yaml(args, train._layout(OURS, a.world, 1))),
                         world_size=a.world)
    args["zero"] = plan.to_deepspeed()["zero_optimization"]
    load0, t0 = os.getloadavg(), time.monotonic()
    rounds = []
    for r in range(a.rounds):
        res = _round(args, *((BASE, OURS) if r % 2 == 0 else (OURS, BASE)))
        ratio = res[OURS]["median_step_s"] / res[BASE]["median_step_s"]
        cpu = statistics.median(res[OURS]["cpu_s_per_step"]) / statistics.median(res[BASE]["cpu_s_per_step"])
        rounds.append({"step_s": {n: res[n]["median_step_s"] for n in res}, "ratio": ratio, "cpu_ratio": cpu,
                       "final_loss": {n: res[n]["final_loss"] for n in res}})
        print(f"[round {r + 1}/{a.rounds}] {BASE} {res[BASE]['median_step_s'] * 1e3:.1f} ms, {OURS} "
              f"{res[OURS]['median_step_s'] * 1e3:.1f} ms: ratio {ratio:.3f} (CPU {cpu:.3f})", flush=True)
    counts = {}
    if not a.no_count:
        for name in (BASE, OURS):
            res = train._run_group(name, {**args, "count_collectives": True})
            counts[name] = res.get("collectives_per_step", {"error": res.get("error")})
    summary = {n: statistics.median(r["step_s"][n] for r in rounds) for n in (BASE, OURS)}
    ratio = statistics.median(r["ratio"] for r in rounds)
    cpu_ratio = statistics.median(r["cpu_ratio"] for r in rounds)
    print()
    print(f"{'variant':<10} {'step ms (median)':>17} {'x ' + BASE:>12} {'CPU x ' + BASE:>14}  collectives per step")
    print(f"{BASE:<10} {summary[BASE] * 1e3:17.1f} {1.0:12.3f} {1.0:14.3f}  {_collective_table(counts.get(BASE))}")
    print(f"{OURS:<10} {summary[OURS] * 1e3:17.1f} {ratio:12.3f} {cpu_ratio:14.3f}  "
          f"{_collective_table(counts.get(OURS))}")
    print(f"ratios: median over {a.rounds} alternating rounds of (median step time, slowest rank) {OURS} / {BASE}; "
          f"above 1 = slower. Collectives: torch.distributed calls per step (op@group size x calls (payload bytes)).")
    import deepspeed
    import torch

    report = {"config": args, "rounds": rounds, "median_step_s": summary, "ratio": ratio, "cpu_ratio": cpu_ratio,
              "ratios_per_round": [r["ratio"] for r in rounds], "collectives_per_step": counts,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "deepspeed": deepspeed.__version__, "load_avg_at_start": load0,
                          "load_avg_at_end": os.getloadavg(), "total_wall_s": time.monotonic() - t0}}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
