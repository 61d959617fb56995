"""Pipeline bubble and step time per schedule (gpipe, 1f1b, interleaved 1F1B v=2, zero_bubble_v), through
msp.initialize on CPU processes, next to the theory.

Every decoder layer gets a FIXED cost: it sleeps t_f in forward, t_b in the backward for its input and t_w in the
backward for its weights (separate autograd paths, so zero-bubble schedules can run the weight part later; the
others run both in one backward). Sleeping uses no CPU, so 4 processes on 2 shared cores keep exact,
reproducible stage costs (real compute would be slowed unevenly by the other ranks and the machine's load); the
tiny model's own compute and the gloo transfers are real and count as overhead. Per rank:
  busy   = time measured inside the layer costs during the step (perf_counter around each sleep)
  bubble = 1 - busy / step time        (idle waiting for neighbours + communication + Python overhead)
Theory, p stages, m micro-batches, v virtual chunks, F = B = W: gpipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B
((p-1)/v)/(m+(p-1)/v); zero_bubble_v about 0 for m >= 2p (ZB-V paper). "order ideal" replays the action order the
torch schedule really runs (msparallel_ds.draw.schedule) with these fixed costs and zero other work: for ZB-V at
m 8, p 4 it is 5.9%, not 0 (the last rank cannot start before p - 1 forwards of one chunk have passed).
Where the rest goes, per rank (mean over ranks, seconds per step): "model" = time inside the stages' forward /
backward actions minus the fixed costs (the tiny model's real compute, autograd, torch's stage bookkeeping);
"outside" = the engine's work around the schedule (batch check, loss and gradient collectives, optimizer) on the
rank that leaves the schedule last (the others also wait there for it). The rest is P2P waiting and schedule Python.
Benchmarks are not tests: nothing is asserted.

    python benchmarks/pipeline.py                  # pp 4 on 4 processes, m 8, writes results/pipeline_cpu.json
    python benchmarks/pipeline.py --pp 2 --micro 4 --cost-ms 20
    python benchmarks/pipeline.py --draw benchmarks/results/pipeline   # + measured vs theory timelines (png)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import statistics
import time

from _ranks import run_ranks  # benchmarks/ is sys.path[0] when run as a script

SCHEDULES = {  # name -> (pipeline_scheduler, virtual chunks)
    "gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved_1f1b_v2": ("1f1b", 2),
    "zero_bubble_v": ("zero_bubble_v", 2),
}


def theory(name: str, p: int, m: int) -> float:
    v = SCHEDULES[name][1]
    if name == "zero_bubble_v":
        return 0.0
    return ((p - 1) / v) / (m + (p - 1) / v)


def yaml(pp: int, m: int, sched: str, vpp: int, layers: int) -> dict:
    return {"parallel_config": {"data_parallel": 1, "pipeline_stage": pp, "micro_batch_num": m},
            "parallel": {"pipeline_config": {"pipeline_interleave": vpp > 1, "pipeline_scheduler": sched}},
            "runner_config": {"batch_size": 1},
            "model": {"model_config": {"num_layers": layers, "pp_interleave_num": vpp, "num_heads": 4,
                                       "n_kv_heads": 2, "hidden_size": 64, "vocab_size": 256}}}


def _add_fixed_cost(layer, t_f: float, t_b: float, t_w: float, state: dict, stage: int) -> None:
    """The layer sleeps t_f forward, t_b in its input's backward, t_w in its weight's backward; each sleep is
    added to state["busy"] and logged as (stage, kind, start, end) since state["t0"] (the step's start)."""
    import torch

    class Cost(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd, bwd, kinds):
            ctx.bwd, ctx.kind = bwd, kinds[1]
            _sleep(fwd, kinds[0])
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            _sleep(ctx.bwd, ctx.kind)
            return g, None, None, None

    def _sleep(seconds, kind):
        if seconds:
            t = time.perf_counter()
            time.sleep(seconds)
            end = time.perf_counter()
            state["busy"] += end - t
            state["events"].append((stage, kind, t - state["t0"], end - state["t0"]))

    inner = layer.forward

    def forward(hidden_states, *args, **kwargs):
        return inner(Cost.apply(hidden_states, t_f, t_b, ("F", "B")), *args, **kwargs)

    layer.forward = forward
    down = layer.mlp.down_proj  # a weight used once: its gradient path alone carries t_w

    def down_forward(x):
        return torch.nn.functional.linear(x, Cost.apply(down.weight, 0.0, t_w, ("F", "W")), down.bias)

    down.forward = down_forward


def _time_actions(engine, state: dict) -> None:
    """Add the wall time of every stage forward / backward action to state["actions"] and of the whole schedule
    step to state["schedule"] (two perf_counter calls per action: microseconds against 30 ms costs)."""
    def timed(fn, key):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                state[key] += time.perf_counter() - t
        return call

    for stage in engine.stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed(getattr(stage, name), "actions"))
    engine.schedule.step = timed(engine.schedule.step, "schedule")


def _order_ideal(args, name: str):
    """The torch schedule's own action order replayed with the benchmark's fixed costs (msparallel_ds.draw):
    (table in seconds, ideal step s, ideal bubble)."""
    from msparallel_ds.config import load_config
    from msparallel_ds.draw.schedule import Block, schedule_table
    from msparallel_ds.plan import make_plan

    sched, vpp = SCHEDULES[name]
    layers = args.pp * 2
    # a whole backward does the layer's B and W sleeps: twice a forward; split ones (I, W) one each
    table = schedule_table(make_plan(load_config(yaml(args.pp, args.micro, sched, vpp, layers))), costs={"B": 2.0})
    unit = args.cost_ms / 1000 * (2 // vpp)  # a unit is one stage's forward over its layers
    table.blocks = {r: [Block(b.rank, b.stage, b.kind, b.microbatch, b.start * unit, b.end * unit) for b in bl]
                    for r, bl in table.blocks.items()}
    table.makespan *= unit
    return table, table.makespan, table.bubble


def _worker(rank, world, args):
    """One rank (run by _ranks.run_ranks, which sets the env, reports and cleans up): its results per schedule."""
    import torch
    import torch.distributed as dist

    import msparallel_ds as msp
    from msparallel_ds.tiny import tiny_llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cost = args.cost_ms / 1000
    results = {}
    for name, (sched, vpp) in SCHEDULES.items():
        layers = args.pp * 2  # 2 layers per rank: one per chunk at v = 2
        engine = msp.initialize(tiny_llama(num_hidden_layers=layers), msp.load_config(
            yaml(args.pp, args.micro, sched, vpp, layers)),
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        state = {"busy": 0.0, "t0": 0.0, "events": [], "actions": 0.0, "schedule": 0.0}
        per_stage = layers // (args.pp * vpp)
        for idx, layer in engine.model.model.layers.items():
            _add_fixed_cost(layer, cost, cost, cost, state, int(idx) // per_stage)
        _time_actions(engine, state)
        ids = torch.randint(0, 256, (args.micro, args.seq), generator=torch.Generator().manual_seed(0))
        steps, fractions, model, outside = [], [], [], []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            state.update(busy=0.0, events=[], actions=0.0, schedule=0.0)
            t = state["t0"] = time.perf_counter()
            engine.train_batch({"input_ids": ids})
            dt = time.perf_counter() - t
            if i >= args.warmup:
                steps.append(dt)
                fractions.append(1 - state["busy"] / dt)
                model.append(state["actions"] - state["busy"])
                outside.append(dt - state["schedule"])
        if rank == 0:
            print(f"{name}: step {statistics.median(steps):.3f} s", file=sys.stderr, flush=True)
        results[name] = {"step_s": statistics.median(steps), "bubble": statistics.median(fractions),
                         "model_s": statistics.median(model), "outside_s": statistics.median(outside),
                         "busy_s": state["busy"], "events": state["events"], "last_step_s": dt}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_num")
    ap.add_argument("--cost-ms", type=float, default=10.0, help="per layer and micro-batch: F = B = W cost")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline_cpu.json"))
    ap.add_argument("--draw", default=None, metavar="DIR", help="also draw each schedule's measured timeline next "
                    "to the theory (pipeline_<schedule>.png; needs matplotlib)")
    args = ap.parse_args()

    ranks, failed, _ = run_ranks(_worker, args.pp, (args,), timeout=600, spawn=True, name="pipeline")
    if failed:
        raise SystemExit(f"benchmark rank failed: {failed['traceback']}")
    per_rank = dict(enumerate(ranks))
    p_, m = args.pp, args.micro
    ideal = 2 * m * 3 * args.cost_ms / 1000  # 2 layers per rank x m micro-batches x (F + B + W)
    rows = []
    for name in SCHEDULES:
        ranks = [per_rank[r][name] for r in range(args.pp)]
        _, order_step, order_bubble = _order_ideal(args, name)
        rows.append({"schedule": name, "virtual_chunks": SCHEDULES[name][1],
                     "step_s": max(r["step_s"] for r in ranks),
                     "bubble_measured_mean": statistics.mean(r["bubble"] for r in ranks),
                     "bubble_measured_per_rank": [round(r["bubble"], 4) for r in ranks],
                     "bubble_theory": theory(name, p_, m), "bubble_order_ideal": order_bubble,
                     "order_ideal_step_s": order_step, "ideal_step_s": ideal,
                     "model_s_mean": statistics.mean(r["model_s"] for r in ranks),
                     "outside_s_last_rank": min(r["outside_s"] for r in ranks),
                     "model_s_per_rank": [round(r["model_s"], 4) for r in ranks]})
    print(f"pp={p_} micro_batch_num={m} cost F=B=W={args.cost_ms} ms/layer, 2 layers per rank, "
          f"ideal busy step {ideal:.3f} s")
    print(f"{'schedule':22s} {'step s':>7s} {'order ideal s':>13s} {'bubble meas.':>12s} {'theory':>7s} "
          f"{'order ideal':>11s} {'model s':>8s} {'outside s':>9s}  bubble per rank")
    for r in rows:
        print(f"{r['schedule']:22s} {r['step_s']:7.3f} {r['order_ideal_step_s']:13.3f} "
              f"{r['bubble_measured_mean']:12.3f} {r['bubble_theory']:7.3f} {r['bubble_order_ideal']:11.3f} "
              f"{r['model_s_mean']:8.3f} {r['outside_s_last_rank']:9.3f}  {r['bubble_measured_per_rank']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "device": "cpu (gloo)", "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")
    if args.draw:
        _draw(args, per_rank)


def _draw(args, per_rank: dict) -> None:
    """Per schedule: the last timed step as measured (each rank's F / B / W sleeps, seconds since the step's start)
    above the theory for the same schedule (msparallel_ds.draw's table, unit cost = --cost-ms)."""
    from msparallel_ds.draw.schedule import Block, ScheduleTable, draw_timelines

    os.makedirs(args.draw, exist_ok=True)
    for name, (sched, vpp) in SCHEDULES.items():
        theory_t = _order_ideal(args, name)[0]
        got = {r: [Block(r, st, k, -1, a, b) for st, k, a, b in per_rank[r][name]["events"]]
               for r in range(args.pp)}
        step = max(per_rank[r][name]["last_step_s"] for r in range(args.pp))
        measured = ScheduleTable(name, args.pp, args.pp * vpp, args.micro, {}, got, step)
        path = os.path.join(args.draw, f"pipeline_{name}.png")
        draw_timelines([(f"{name}: measured (last step, pp {args.pp}, m {args.micro}, F = B = W = "
                         f"{args.cost_ms:g} ms per layer; {step:.3f} s)", measured),
                        (f"{name}: theory ({theory_t.makespan:.3f} s, bubble {theory_t.bubble:.1%}, "
                         f"order from {theory_t.source})", theory_t)], path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
