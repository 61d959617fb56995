"""Fused ring-attention kernels (ops/) on one GPU, against torch's flash attention in the same run.

(a) step kernel: TFLOP/s of one forward step (and one backward step) on a block, next to torch flash SDPA on the
    same block (ratio = ours / flash; done when >= 0.8);
(b) ring efficiency: one causal flash SDPA call over the whole sequence S, divided by the N zigzag ring steps of
    every rank run back to back with our kernels (no communication), forward and forward+backward, N in {2, 4, 8},
    S in {8k, 32k, 128k}, h = 32, h_kv = 8, d = 128, bf16. Reported both ways:
        eff_sum  = t_full / sum over ranks of t_rank          (total work, one GPU)
        eff_max  = t_full / (N * max over ranks of t_rank)     (what a real ring's slowest rank allows)
    done when eff_max(fwd+bwd) >= 0.95 at S/N >= 4k tokens per rank;
(c) max error against fp64 for N = 1..8: ours (fp32 state across steps, one rounding) next to the unfused
    per-step path (torch flash per block, block output rounded to bf16, fp32 merge: ring.py with cuda_flash).
The first lines measure the two ceilings (device copy bandwidth, bf16 matmul rate) for the notes' floor times.

    python benchmarks/ring_kernels.py                # everything (a few minutes on an H100)
    python benchmarks/ring_kernels.py --quick        # small sizes, to check it runs
    python benchmarks/ring_kernels.py --parts b --seqs 32768 --rings 8

Prints tables and writes JSON (default benchmarks/results/ring_kernels.json). Timing: CUDA events around the
region, warm-up first, median of the repeats; inputs random (never zeros). Needs a CUDA GPU of sm_80+ and builds
the extension on first use (python -m msparallel_ds.ops build does it ahead of time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEVICE = "cuda"


def _time(fn, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of fn() between CUDA events (after warm-up)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _randn(*shape, dtype, seed):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


_GQA_OK: dict = {}


def _flash_kv(q, k, v):
    """k, v as torch's flash SDPA will take them: as they are when it accepts enable_gqa (probed once, outside any
    timed region), else repeated to q's heads here, once."""
    if k.shape[1] == q.shape[1]:
        return k, v
    if "ok" not in _GQA_OK:
        try:
            _sdpa(q[:, :, :8], k[:, :, :8], v[:, :, :8], False)
            _GQA_OK["ok"] = True
        except (RuntimeError, TypeError):
            _GQA_OK["ok"] = False
    if _GQA_OK["ok"]:
        return k, v
    g = q.shape[1] // k.shape[1]
    return k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)


def _sdpa(q, k, v, causal):
    """torch's flash SDPA only (an error rather than a silent fallback to another kernel)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


# ------------------------------------------------------------------------------------------------ ceilings
def ceilings(quick: bool) -> dict:
    """Measured device copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    import torch

    n = (1 << 28) if not quick else (1 << 24)  # 512 MiB of bf16 (32 MiB quick)
    a = _randn(n, dtype=torch.bfloat16, seed=1)
    b = torch.empty_like(a)
    t_copy = _time(lambda: b.copy_(a), reps=10)
    m = 8192 if not quick else 2048
    x, y = _randn(m, m, dtype=torch.bfloat16, seed=2), _randn(m, m, dtype=torch.bfloat16, seed=3)
    t_mm = _time(lambda: x @ y, reps=10)
    return {"copy_bytes_per_s": 2 * a.numel() * a.element_size() / t_copy, "bf16_matmul_flop_per_s": 2 * m**3 / t_mm}


# ------------------------------------------------------------------------------------------------ (a)
def _step_case(fa, d: int, s: int, causal: bool, reps: int) -> dict:
    """One block (s x s), h = 32, h_kv = 8, bf16: our forward / backward step vs flash SDPA forward / backward."""
    import torch

    from msparallel_ds.ops.modes import Mode

    b, h, hkv = 1, 32, 8
    scale = d ** -0.5
    mode = Mode.CAUSAL if causal else Mode.FULL
    q = _randn(b, h, s, d, dtype=torch.bfloat16, seed=11)
    k, v = _randn(b, hkv, s, d, dtype=torch.bfloat16, seed=12), _randn(b, hkv, s, d, dtype=torch.bfloat16, seed=13)
    do = _randn(b, h, s, d, dtype=torch.bfloat16, seed=14)
    flop_fwd = 4 * b * h * s * s * d / (2 if causal else 1)  # useful FLOPs (causal: half the square)
    st = fa.new_state(q)
    t_ours = _time(lambda: fa.forward_step(q, k, v, st, mode, scale), reps=reps)
    out, lse = fa.finalize(st, torch.bfloat16)
    delta = fa.backward_preprocess(out, do)
    dq = torch.zeros(b, h, s, d, device=DEVICE)
    dk, dv = torch.zeros(b, hkv, s, d, device=DEVICE), torch.zeros(b, hkv, s, d, device=DEVICE)
    t_ours_bwd = _time(lambda: fa.backward_step(do, q, k, v, lse, delta, dq, dk, dv, mode, scale), reps=reps)
    kf, vf = _flash_kv(q, k, v)
    t_flash = _time(lambda: _sdpa(q, kf, vf, causal), reps=reps)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, kf, vf))
    t_flash_fb = _time(lambda: _sdpa(qg, kg, vg, causal).backward(do), reps=reps)
    t_flash_bwd = max(t_flash_fb - t_flash, 1e-9)
    return {"d": d, "s": s, "causal": causal, "ours_fwd_s": t_ours, "flash_fwd_s": t_flash,
            "ours_fwd_tflops": flop_fwd / t_ours / 1e12, "flash_fwd_tflops": flop_fwd / t_flash / 1e12,
            "fwd_ratio": t_flash / t_ours, "ours_bwd_s": t_ours_bwd, "flash_bwd_s": t_flash_bwd,
            "ours_bwd_tflops": 2.5 * flop_fwd / t_ours_bwd / 1e12, "flash_bwd_tflops": 2.5 * flop_fwd / t_flash_bwd / 1e12,
            "bwd_ratio": t_flash_bwd / t_ours_bwd}


def step_kernel(fa, seqs, d_list, reps) -> list[dict]:
    import torch

    rows = []
    for d in d_list:
        for s in seqs:
            for causal in (False, True):
                rows.append(_step_case(fa, d, s, causal, reps))
                torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ (b)
def _full_times(q, k, v, do, reps) -> tuple[float, float]:
    """One causal flash SDPA over the whole sequence: forward, and forward + backward."""
    kf, vf = _flash_kv(q, k, v)
    t_full = _time(lambda: _sdpa(q, kf, vf, True), reps=reps)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, kf, vf))
    t_full_fb = _time(lambda: _sdpa(qg, kg, vg, True).backward(do), reps=reps)
    return t_full, t_full_fb


def _ring_case(fa, q, k, v, do, N: int, reps: int) -> tuple[list[float], list[float]]:
    """Every rank's N zigzag steps with our kernels, one rank at a time: (fwd times, fwd+bwd times) per rank."""
    import torch

    from msparallel_ds.context_parallel import sharding
    from msparallel_ds.ops.modes import ring_schedule

    scale = q.shape[-1] ** -0.5
    shards = [[sharding.shard(x, 2, N, 1, r, 0) for x in (q, k, v, do)] for r in range(N)]

    def rank_fwd(r):
        qr = shards[r][0]
        st = fa.new_state(qr)
        for src, mode in ring_schedule(r, N, True):
            fa.forward_step(qr, shards[src][1], shards[src][2], st, mode, scale)
        return fa.finalize(st, torch.bfloat16)

    def rank_fwd_bwd(r):
        qr, dor = shards[r][0], shards[r][3]
        out, lse = rank_fwd(r)
        delta = fa.backward_preprocess(out, dor)
        dq = torch.zeros(qr.shape, dtype=torch.float32, device=DEVICE)
        for src, mode in ring_schedule(r, N, True):
            kb, vb = shards[src][1], shards[src][2]
            dkv = torch.zeros((2, *kb.shape), dtype=torch.float32, device=DEVICE)  # the travelling dK/dV buffer
            fa.backward_step(dor, qr, kb, vb, lse, delta, dq, dkv[0], dkv[1], mode, scale)
        return dq

    t_f = [_time(lambda r=r: rank_fwd(r), reps=reps) for r in range(N)]
    t_fb = [_time(lambda r=r: rank_fwd_bwd(r), reps=reps) for r in range(N)]
    return t_f, t_fb


def ring_efficiency(fa, seqs, rings, reps) -> list[dict]:
    import torch

    rows = []
    b, h, hkv, d = 1, 32, 8, 128
    for S in seqs:
        q = _randn(b, h, S, d, dtype=torch.bfloat16, seed=21)
        k, v = _randn(b, hkv, S, d, dtype=torch.bfloat16, seed=22), _randn(b, hkv, S, d, dtype=torch.bfloat16, seed=23)
        do = _randn(b, h, S, d, dtype=torch.bfloat16, seed=24)
        t_full, t_full_fb = _full_times(q, k, v, do, reps)
        torch.cuda.empty_cache()
        for N in rings:
            if S % (2 * N):
                continue
            t_f, t_fb = _ring_case(fa, q, k, v, do, N, reps)
            torch.cuda.empty_cache()
            rows.append({"S": S, "N": N, "tokens_per_rank": S // N, "full_fwd_s": t_full, "full_fwd_bwd_s": t_full_fb,
                         "rank_fwd_s": t_f, "rank_fwd_bwd_s": t_fb,
                         "eff_sum_fwd": t_full / sum(t_f), "eff_max_fwd": t_full / (N * max(t_f)),
                         "eff_sum_fwd_bwd": t_full_fb / sum(t_fb), "eff_max_fwd_bwd": t_full_fb / (N * max(t_fb))})
    return rows


# ------------------------------------------------------------------------------------------------ (c)
def ring_error(fa, S, rings) -> list[dict]:
    """Max |error| against fp64 of the output, fused ring vs the unfused per-step path, and of our gradients."""
    import torch
    import torch.nn.functional as F

    from msparallel_ds.context_parallel import kernels, ring, sharding
    from msparallel_ds.ops.modes import ring_schedule
    from msparallel_ds.ops.ring_steps import simulate_ring

    b, h, hkv, d = 1, 32, 8, 128
    scale = d ** -0.5
    q = _randn(b, h, S, d, dtype=torch.bfloat16, seed=31)
    k, v = _randn(b, hkv, S, d, dtype=torch.bfloat16, seed=32), _randn(b, hkv, S, d, dtype=torch.bfloat16, seed=33)
    do = _randn(b, h, S, d, dtype=torch.bfloat16, seed=34)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64.repeat_interleave(h // hkv, 1), v64.repeat_interleave(h // hkv, 1),
                                         is_causal=True, scale=scale)
    ref.backward(do.double())
    ref = ref.detach()
    grads_ref = {"dq": q64.grad, "dk": k64.grad, "dv": v64.grad}
    flash = kernels.BACKENDS["cuda_flash"]
    rows = []
    for N in rings:
        if S % (2 * N):
            continue
        got = simulate_ring(q, k, v, do, N, causal=True, scale=scale, kern=fa)
        shards = [[sharding.shard(x, 2, N, 1, r, 0) for x in (q, k, v)] for r in range(N)]
        unfused = []
        for r in range(N):
            out = lse = None
            for src, _ in ring_schedule(r, N, True):
                out, lse = ring.forward_step(shards[r][0], shards[src][1], shards[src][2], src, r, out, lse,
                                             causal=True, scale=scale, backend=flash)
            unfused.append(out)
        unfused = sharding.unshard(unfused, 2, N, 1)

        def err(x, want=ref):
            return (x.double() - want).abs().max().item()

        rows.append({"N": N, "fused_out_bf16": err(got["out"]), "unfused_out_bf16": err(unfused.to(torch.bfloat16)),
                     "unfused_out_fp32": err(unfused),
                     **{f"fused_{n}": err(got[n], grads_ref[n]) for n in ("dq", "dk", "dv")}})
    return rows


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (checks that it runs)")
    ap.add_argument("--parts", default="abc", help="which of a, b, c to run (default abc)")
    ap.add_argument("--seqs", type=int, nargs="+", default=None, help="(b) sequence lengths (default 8k 32k 128k)")
    ap.add_argument("--rings", type=int, nargs="+", default=None, help="(b) ring sizes (default 2 4 8)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "ring_kernels.json"))
    a = ap.parse_args()

    import torch

    from msparallel_ds import ops

    reason = ops.unavailable_reason()
    if reason is not None:
        print(f"benchmarks/ring_kernels.py needs a CUDA GPU (sm_80 or newer) with a CUDA build of torch: {reason}",
              file=sys.stderr)
        return 1
    try:
        ops.load()
    except ops.OpsUnavailable as exc:
        print(f"benchmarks/ring_kernels.py: {exc}", file=sys.stderr)
        return 1
    from msparallel_ds.ops import attention as fa

    reps = a.reps or (2 if a.quick else 5)
    seqs = a.seqs or ([4096] if a.quick else [8192, 32768, 131072])
    rings = a.rings or ([2, 4] if a.quick else [2, 4, 8])
    dev = torch.cuda.get_device_properties(0)
    report = {"device": dev.name, "sm": f"{dev.major}{dev.minor}", "torch": torch.__version__,
              "cuda": torch.version.cuda, "quick": a.quick}
    report["ceilings"] = ceilings(a.quick)
    c = report["ceilings"]
    print(f"{dev.name}: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{c['bf16_matmul_flop_per_s'] / 1e12:.0f} TFLOP/s (measured ceilings)")
    if "a" in a.parts:
        report["step_kernel"] = step_kernel(fa, [1024, 2048] if a.quick else [1024, 2048, 4096, 8192],
                                            [128] if a.quick else [64, 128], reps)
        print("\n(a) one block, h=32 h_kv=8 bf16: TFLOP/s ours vs flash SDPA (ratio = flash time / ours)")
        print(f"{'d':>4} {'s':>6} {'mask':<7} {'fwd ours':>9} {'flash':>7} {'ratio':>6} {'bwd ours':>9} {'flash':>7} "
              f"{'ratio':>6}")
        for r in report["step_kernel"]:
            print(f"{r['d']:>4} {r['s']:>6} {'causal' if r['causal'] else 'full':<7} {r['ours_fwd_tflops']:9.0f} "
                  f"{r['flash_fwd_tflops']:7.0f} {r['fwd_ratio']:6.2f} {r['ours_bwd_tflops']:9.0f} "
                  f"{r['flash_bwd_tflops']:7.0f} {r['bwd_ratio']:6.2f}")
    if "b" in a.parts:
        report["ring_efficiency"] = ring_efficiency(fa, seqs, rings, reps)
        print("\n(b) causal zigzag ring on one GPU (no communication), h=32 h_kv=8 d=128 bf16: t_full / t_ring")
        print(f"{'S':>7} {'N':>3} {'S/N':>6} {'fwd sum':>8} {'fwd max':>8} {'f+b sum':>8} {'f+b max':>8}")
        for r in report["ring_efficiency"]:
            print(f"{r['S']:>7} {r['N']:>3} {r['tokens_per_rank']:>6} {r['eff_sum_fwd']:8.3f} {r['eff_max_fwd']:8.3f} "
                  f"{r['eff_sum_fwd_bwd']:8.3f} {r['eff_max_fwd_bwd']:8.3f}")
    if "c" in a.parts:
        S = 1680 if a.quick else 3360  # a multiple of 2N for every N in 1..8
        report["ring_error"] = ring_error(fa, S, list(range(1, 9)))
        print(f"\n(c) max |error| vs fp64, causal ring, S={S} h=32 h_kv=8 d=128 bf16")
        print(f"{'N':>3} {'ours out':>9} {'unfused out':>12} {'unfused fp32':>13} {'ours dq':>9} {'ours dk':>9} "
              f"{'ours dv':>9}")
        for r in report["ring_error"]:
            print(f"{r['N']:>3} {r['fused_out_bf16']:9.2e} {r['unfused_out_bf16']:12.2e} {r['unfused_out_fp32']:13.2e} "
                  f"{r['fused_dq']:9.2e} {r['fused_dk']:9.2e} {r['fused_dv']:9.2e}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
