"""Context-parallel attention on gloo processes: time, per-rank peak memory, bytes sent, error.

For each algorithm (ring, allgather, ulysses, hybrid) at each world size, every rank runs forward + backward on
its shard of the same full-sequence inputs. Reported per algorithm (max over ranks):
  - step time (fwd+bwd) and its ratio to single-process full-sequence attention in the same run,
  - peak bytes allocated during the step (torch.profiler memory timeline, inputs excluded) and its ratio to the
    single-process peak,
  - bytes each rank sent through torch.distributed (counted by wrapping the collectives) next to the volume
    theory predicts,
  - max abs error of out/dq/dk/dv against single-process attention on the full sequence.
The same run times DeepSpeed's Ulysses peer (deepspeed.sequence.layer.DistributedAttention) on identical inputs,
and then our Ulysses against it step by step: --pairs alternating repeats (the order flips every repeat), each
repeat's ratio our worst rank / DeepSpeed's worst rank, reported as the median of those ratios (the
"x DeepSpeed" line; a noisy shared machine moves both sides of one repeat alike).

    python benchmarks/attention.py --world-sizes 2 4 --seq 1024 --json benchmarks/results/attention.json

On a 2-core CPU machine the timings mostly show compute on shared cores (gloo and 4 ranks contend); the memory,
volume and error columns are the portable figures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the shared multi-process harness

from harness import run_distributed  # noqa: E402

ALGOS = ("ring", "allgather", "ulysses", "hybrid")


def _mesh(algo: str, world: int) -> tuple[int, int] | None:
    if algo in ("ring", "allgather"):
        return world, 1
    if algo == "ulysses":
        return 1, world
    return (2, world // 2) if world >= 4 and world % 2 == 0 else None


class SendCounter:
    """Counts bytes this rank hands to torch.distributed (what leaves the rank, per collective semantics)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.bytes, self.saved = dist, 0, {}

    @staticmethod
    def _nbytes(t) -> int:
        return t.numel() * t.element_size()

    def __enter__(self):
        d = self.dist
        world = lambda group: d.get_world_size(group)  # noqa: E731
        def arg(a, k, i, name):  # positional or keyword, as callers (DeepSpeed included) pass them
            return k[name] if name in k else a[i]

        def share(a, k, i, name, factor):  # bytes of one tensor argument x a per-collective factor
            group = k.get("group")
            n = world(group)
            return self._nbytes(arg(a, k, i, name)) * factor(n)

        gather = lambda n: n - 1  # noqa: E731  every other rank receives my part
        scatter = lambda n: (n - 1) / n  # noqa: E731  I keep 1/n of what I hold
        wraps = {
            # isend itself stays unwrapped: P2POp checks the op's identity
            "batch_isend_irecv": lambda a, k: sum(self._nbytes(op.tensor) for op in arg(a, k, 0, "p2p_op_list")
                                                  if op.op is d.isend),
            "all_gather": lambda a, k: share(a, k, 1, "tensor", gather),
            "all_gather_into_tensor": lambda a, k: share(a, k, 1, "input_tensor", gather),
            "all_gather_single": lambda a, k: share(a, k, 1, "input", gather),
            "reduce_scatter_tensor": lambda a, k: share(a, k, 1, "input", scatter),
            "reduce_scatter_single": lambda a, k: share(a, k, 1, "input", scatter),
            "all_to_all_single": lambda a, k: share(a, k, 1, "input", scatter),
            "all_to_all": lambda a, k: sum(self._nbytes(t) for t in arg(a, k, 1, "input_tensor_list"))
            * scatter(world(k.get("group"))),
            "all_reduce": lambda a, k: share(a, k, 0, "tensor", lambda n: 2 * (n - 1) / n),
        }
        for name, size in wraps.items():
            original = getattr(d, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def counting(*args, _orig=original, _size=size, **kwargs):
                self.bytes += int(_size(args, kwargs))
                return _orig(*args, **kwargs)

            setattr(d, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.dist, name, original)


def _peak_bytes(fn) -> int:
    """Peak of (allocated - freed) bytes during fn, from the profiler's allocation events in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn()
    events, stack = [], list(p.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


def _theory_bytes(algo, ring, uly, b, s, h, hkv, d, elt) -> int:
    """Bytes sent per rank for fwd+bwd: the textbook volume of each algorithm."""
    s_local = s // (ring * uly)
    kv = 2 * b * hkv * s_local * d * elt
    if algo == "ring":  # fwd: K/V R-1 hops; bwd: K/V R-1 hops + fp32 dK/dV R hops
        return (ring - 1) * kv * 2 + ring * kv * 4 // elt
    if algo == "allgather":  # fwd: all-gather K/V; bwd: again + reduce-scatter of fp32 dK/dV
        return (ring - 1) * kv * 2 + (ring - 1) * kv * 4 // elt
    q = b * h * s_local * d * elt
    kv_heads = max(hkv, uly) if algo in ("ulysses", "hybrid") else hkv
    kv_u = 2 * b * kv_heads * s_local * d * elt
    a2a = (uly - 1) / uly * (2 * q + kv_u) * 2  # q,k,v,out forward; dq,dk,dv,dout backward
    if algo == "ulysses":
        return int(a2a)
    s_seg = s // ring
    kv_seg = 2 * b * (kv_heads // uly) * s_seg * d * elt
    return int(a2a + (ring - 1) * kv_seg * 2 + ring * kv_seg * 4 // elt)


def _rank_main(rank, world, args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from msparallel_ds.context_parallel.api import context_parallel_attention, shard_sequence
    from msparallel_ds.context_parallel.ulysses import local_attention
    from msparallel_ds.distributed import init_parallel

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args["dtype"]]
    b, s, h, hkv, d = args["batch"], args["seq"], args["heads"], args["kv_heads"], args["dim"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    dout = torch.randn(b, s, h, d, generator=g).to(dtype)
    rows, steps = [], {}

    def reference():
        qq, kk, vv = (x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(h // hkv, 1), vv.repeat_interleave(h // hkv, 1),
                                           is_causal=True)
        o.backward(dout.double().transpose(1, 2))
        return o.transpose(1, 2), qq.grad.transpose(1, 2), kk.grad.transpose(1, 2), vv.grad.transpose(1, 2)

    ref = reference()

    def single():  # single-process baseline in the same run: full sequence, same kernels
        qq, kk, vv = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        o = local_attention(qq, kk, vv, causal=True, scale=d ** -0.5)
        o.backward(dout.transpose(1, 2))

    base_t = _time(single, args["repeats"]) if rank == 0 else 0.0
    base_mem = _peak_bytes(single) if rank == 0 else 0
    for algo in args["algos"]:
        mesh = _mesh(algo, world)
        if mesh is None or h % mesh[1] or (hkv % mesh[1] and mesh[1] % hkv):
            continue
        lay = init_parallel(SimpleNamespace(world_size=world, cp_algo=algo,
                                            mesh=dict(pp=1, dp=1, cp_ring=mesh[0], cp_ulysses=mesh[1], tp=1)))
        ql, kl, vl, dl = (shard_sequence(x, lay, dim=1, algo=algo) for x in (q, k, v, dout))

        def step():
            qq, kk, vv = (x.detach().requires_grad_() for x in (ql, kl, vl))
            o = context_parallel_attention(qq, kk, vv, lay, causal=True, algo=algo)
            o.backward(dl)
            return o, qq.grad, kk.grad, vv.grad

        got = step()
        err = max((g_.double() - shard_sequence(r, lay, dim=1, algo=algo)).abs().max().item()
                  for g_, r in zip(got, ref))
        t = _time(step, args["repeats"], barrier=dist.barrier)
        with SendCounter() as counter:
            step()
        mem = _peak_bytes(step)
        steps[algo] = step
        rows.append({"algo": algo, "ring": mesh[0], "ulysses": mesh[1], "time_s": t, "peak_bytes": mem,
                     "sent_bytes": counter.bytes,
                     "theory_bytes": _theory_bytes(algo, mesh[0], mesh[1], b, s, h, hkv, d, q.element_size()),
                     "max_err": err})
    rows.append(_deepspeed_ulysses(rank, world, q, k, v, dout, ref, args, steps))
    paired = None
    if "ulysses" in steps and "deepspeed_ulysses" in steps and args["pairs"]:
        paired = _paired_times(steps["ulysses"], steps["deepspeed_ulysses"], args["pairs"], dist.barrier)
    return {"rows": [r for r in rows if r], "single_time_s": base_t, "single_peak_bytes": base_mem,
            "paired": paired}


def _paired_times(ours, peer, pairs, barrier):
    """(our times, peer times), one of each per repeat, the order alternating so neither side always runs
    first (warm caches, a neighbour's load) on a shared machine."""
    ours(), peer()  # warm-up
    times = {0: [], 1: []}
    for i in range(pairs):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            barrier()
            t0 = time.perf_counter()
            (ours, peer)[side]()
            times[side].append(time.perf_counter() - t0)
    return times[0], times[1]


def _time(fn, repeats, barrier=None):
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _deepspeed_ulysses(rank, world, q, k, v, dout, ref, args, steps):
    """DeepSpeed's DistributedAttention (the Ulysses peer) on the same inputs; kv repeated (it has no GQA)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    try:
        import deepspeed.comm as ds_comm
        from deepspeed.sequence.layer import DistributedAttention
    except Exception as exc:  # pragma: no cover - peer not importable
        return {"algo": "deepspeed_ulysses", "skipped": str(exc)}
    h, hkv = q.shape[2], k.shape[2]
    if h % world:
        return None
    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    group = dist.new_group(list(range(world)))

    def local_attn(qq, kk, vv, *a, **kw):  # DistributedAttention layout: [s, b, h, d]
        o = F.scaled_dot_product_attention(qq.permute(1, 2, 0, 3), kk.permute(1, 2, 0, 3), vv.permute(1, 2, 0, 3),
                                           is_causal=True)
        return o.permute(2, 0, 1, 3)

    attn = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=0)
    n = q.shape[1] // world
    sl = slice(rank * n, (rank + 1) * n)
    kr, vr = (x.repeat_interleave(h // hkv, 2) for x in (k, v))
    ql, kl, vl, dl = (x[:, sl].transpose(0, 1).contiguous() for x in (q, kr, vr, dout))

    def step():
        qq, kk, vv = (x.detach().requires_grad_() for x in (ql, kl, vl))
        o = attn(qq, kk, vv, batch_dim_idx=1)
        o.backward(dl)
        return o

    try:
        out = step()
    except Exception as exc:  # gloo may lack the collective DeepSpeed uses
        return {"algo": "deepspeed_ulysses", "skipped": f"{type(exc).__name__}: {exc}"[:200]}
    err = (out.transpose(0, 1).double() - ref[0][:, sl]).abs().max().item()
    steps["deepspeed_ulysses"] = step
    t = _time(step, args["repeats"], barrier=dist.barrier)
    with SendCounter() as counter:
        step()
    return {"algo": "deepspeed_ulysses", "ring": 1, "ulysses": world, "time_s": t, "peak_bytes": _peak_bytes(step),
            "sent_bytes": counter.bytes, "theory_bytes": None, "max_err": err, "note": "kv repeated (no GQA)"}


def simulate_ring(n: int, args: dict) -> dict:
    """One process runs the N causal zigzag ring steps of every rank back to back (the step kernels and the fp32
    merge, no communication) and compares the slowest rank with 1/N of one full-sequence call: ring efficiency."""
    import torch

    from msparallel_ds.context_parallel.kernels import block_forward, select_backend
    from msparallel_ds.context_parallel.ring import forward_step
    from msparallel_ds.context_parallel.sharding import shard

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args["dtype"]]
    b, s, h, hkv, d = args["batch"], args["seq"], args["heads"], args["kv_heads"], args["dim"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n_, s, d, generator=g).to(device, dtype) for n_ in (h, hkv, hkv))
    backend = select_backend(device, dtype)
    scale = d ** -0.5
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def full():
        block_forward(q, k, v, causal=True, scale=scale, backend=backend)
        sync()

    local = [[shard(x, 2, n, 1, r, 0) for x in (q, k, v)] for r in range(n)]

    def rank_steps(r):  # the same step function the ring runs, with the blocks read locally
        out = lse = None
        for step in range(n):
            src = (r - step) % n
            out, lse = forward_step(local[r][0], local[src][1], local[src][2], src, r, out, lse, causal=True,
                                    scale=scale, backend=backend)
        out.to(dtype)
        sync()

    t_full = _time(full, args["repeats"])
    t_rank = max(_time(lambda r=r: rank_steps(r), args["repeats"]) for r in range(n))
    return {"ring": n, "device": device.type, "backend": backend.name, "full_time_s": t_full,
            "slowest_rank_time_s": t_rank, "ring_efficiency": t_full / n / t_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=7,
                    help="alternating repeats of our Ulysses vs DeepSpeed's (median of per-repeat ratios); 0: off")
    ap.add_argument("--simulate-ring", type=int, default=0, metavar="N",
                    help="time the N ring steps of each rank in one process (no communication) instead")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "attention.json"))
    a = ap.parse_args()
    args = {k: getattr(a, k) for k in ("algos", "seq", "batch", "heads", "kv_heads", "dim", "dtype", "repeats",
                                       "pairs")}
    if a.simulate_ring:
        res = simulate_ring(a.simulate_ring, args)
        print(f"simulated ring of {res['ring']} on {res['device']} ({res['backend']}): full sequence "
              f"{res['full_time_s'] * 1e3:.2f} ms, slowest rank's steps {res['slowest_rank_time_s'] * 1e3:.2f} ms, "
              f"ring efficiency {res['ring_efficiency']:.2f}")
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"config": args, "simulate_ring": res}, indent=2))
        return
    report = {"config": args, "runs": []}
    for world in a.world_sizes:
        per_rank = run_distributed(_rank_main, world, args, timeout=1800)
        single_t, single_mem = per_rank[0]["single_time_s"], per_rank[0]["single_peak_bytes"]
        rows = []
        for i, row in enumerate(per_rank[0]["rows"]):
            if "skipped" in row:
                rows.append({**row, "world": world})
                continue
            worst = {key: max(r["rows"][i][key] for r in per_rank) for key in ("time_s", "peak_bytes", "sent_bytes",
                                                                                 "max_err")}
            rows.append({**row, **worst, "world": world, "time_vs_single": worst["time_s"] / single_t,
                         "peak_vs_single": worst["peak_bytes"] / max(single_mem, 1)})
        run = {"world": world, "single_time_s": single_t, "single_peak_bytes": single_mem, "rows": rows}
        if per_rank[0]["paired"]:  # per repeat: worst rank of ours / worst rank of DeepSpeed's
            ours, peer = ([max(r["paired"][side][i] for r in per_rank) for i in range(a.pairs)] for side in (0, 1))
            ratios = sorted(o / p for o, p in zip(ours, peer))
            run["ulysses_vs_deepspeed"] = {"median_ratio": statistics.median(ratios), "ratios": ratios,
                                           "ours_s": ours, "deepspeed_s": peer}
        report["runs"].append(run)
    _print(report)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {a.json}")


def _print(report) -> None:
    head = f"{'world':>5} {'algo':<18} {'R x U':>6} {'time x single':>13} {'peak x single':>13} " \
           f"{'sent MiB':>9} {'theory MiB':>10} {'max err':>9}"
    print(head)
    print("-" * len(head))
    for run in report["runs"]:
        for r in run["rows"]:
            if "skipped" in r:
                print(f"{run['world']:>5} {r['algo']:<18} skipped: {r['skipped']}")
                continue
            theory = f"{r['theory_bytes'] / 2**20:10.2f}" if r.get("theory_bytes") else f"{'-':>10}"
            print(f"{run['world']:>5} {r['algo']:<18} {r['ring']}x{r['ulysses']:<4} {r['time_vs_single']:13.2f} "
                  f"{r['peak_vs_single']:13.2f} {r['sent_bytes'] / 2**20:9.2f} {theory} {r['max_err']:9.2e}")
        if "ulysses_vs_deepspeed" in run:
            p = run["ulysses_vs_deepspeed"]
            print(f"{run['world']:>5} ulysses x DeepSpeed  fwd+bwd time, median of {len(p['ratios'])} alternating "
                  f"repeats: {p['median_ratio']:.2f} (range {p['ratios'][0]:.2f}-{p['ratios'][-1]:.2f})")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
