"""Multi-copy (micro_batch_interleave_num) and fine-grain interleave: step time and how much of the hideable
communication time they hide, on tp ranks with sequence parallel.

A Llama built from LlamaConfig (no download) runs forward + backward (HF loss) on --world processes (gloo, tp =
world, use_seq_parallel), every variant on the same token ids and weights:
  baseline      msp.parallelize without the feature (blocking collectives in the HF layer calls)
  N=1           the interleave schedule with one copy (async collectives; the input-grad collective overlaps the
                weight-grad GEMMs; nothing else to overlap with)
  N=2, N=4      micro_batch_interleave_num copies
  fine_grain=2  fine_grain_interleave with 2 token chunks, one copy
Three links:
  real          gloo as is. On a CPU machine its threads share the cores with compute, so little can be hidden.
  modelled      every collective completes no earlier than alpha + bus_bytes / bandwidth after it started, by
                sleeping (instruments.modelled_link): a link whose time frees the core. Unless --bandwidth is
                given it is calibrated so the baseline's modelled communication time equals its compute time.
                gloo still moves the real bytes underneath, on the same cores as the compute.
  cpu_free      the modelled link with collectives that move no bytes (_cpu_free.py: outputs filled from this
                rank's own data, for timing only): the same schedule with none of gloo's CPU in the step, as on a
                GPU whose copies run on their own engine. Not the row: it shows what of the row's gap is gloo's.
Hidden fraction = (baseline step - variant step) / min(compute, comm), the baseline's compute being its step time
without the modelled link minus the time it blocked in collectives, and comm the modelled (or, for the real link,
the blocked) collective time per step. 1.0 = everything hideable was hidden; the speedup bound is 2x.
Real-link bound (modelled rows): the hidden fraction the variant would reach if its modelled-link step were its
real-link step. The modelled link only delays collectives, so a variant's real-link step is a floor of its
modelled one: what the variant's own CPU work (its compute, its python, gloo's threads moving the bytes on the same
cores) costs, which no schedule of the same work on this machine can hide. It also reports the baseline's forward
compute (`compute_fwd_s`), for the forward's own bound (see benchmarks/README.md).
Where a modelled step's time goes (rank 0, per round medians; instruments.comm_stats): `exposed` = time blocked
before collectives' modelled completion, the link time the schedule left exposed (`link hidden` = 1 - exposed /
hideable: the schedule's own share); `gloo late` = time blocked after it, the real gloo collective finishing
later than the modelled link would (its threads share the cores); `other` = step - blocked - the baseline's
compute, the variant's extra CPU time (python, smaller GEMMs, gloo's threads beside compute). From the kernel's
per-thread schedstat, per step: the main thread's CPU time, its time runnable but descheduled (another thread or
process had the core), and the CPU time of the process's other threads (gloo's workers moving the bytes).

Timing: --repeats rounds, the variant order rotated per round; each round times --steps steps per variant after a
warm-up step (barrier before each step, the slowest rank's time) and keeps their median; reported: the median over
rounds of the step time, and of the per-round speedup and hidden fraction against that round's baseline (other
load on a shared machine moves whole rounds, which the per-round ratios cancel). The JSON keeps every round.

    python benchmarks/interleave.py                        # 2 CPU processes, writes results/interleave_cpu.json
    python benchmarks/interleave.py --alpha 50e-6 --bandwidth 2e8
    python benchmarks/interleave.py --variants fine_grain=2   # the baseline and one variant (A/B runs)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path

from _cpu_free import cpu_free_collectives  # benchmarks/ is sys.path[0] when run as a script
from _ranks import run_ranks

# per modelled step on rank 0: time blocked before / in all collectives, and the threads' times (_thread_times)
SPLIT = ("link_exposed_s", "blocked_s", "main_cpu_s", "main_descheduled_s", "other_threads_cpu_s")
VARIANTS = [("baseline", 0, 1), ("N=1", 1, 1), ("N=2", 2, 1), ("N=4", 4, 1), ("fine_grain=2", 1, 2)]


def _config(a):
    return {
        "parallel_config": {"data_parallel": 1, "model_parallel": a.world, "context_parallel": 1, "pipeline_stage": 1,
                            "use_seq_parallel": True, "vocab_emb_dp": True},
        "runner_config": {"batch_size": a.rows},
        "model": {"model_config": {"num_layers": a.layers, "num_heads": a.heads, "n_kv_heads": a.kv_heads,
                                   "hidden_size": a.hidden, "seq_length": a.seq, "vocab_size": a.vocab,
                                   "compute_dtype": "float32", "param_init_type": "float32"}},
    }


def _model(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                      attention_dropout=0.0, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float()


def _worker(rank, world, a):
    """One rank (run by _ranks.run_ranks, which sets the env, reports and cleans up); rank 0 returns the results."""
    import torch
    import torch.distributed as dist

    import msparallel_ds as msp
    from msparallel_ds.interleave.multi_copy import install
    from msparallel_ds.distributed.instruments import comm_stats, modelled_link

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = msp.init_parallel(msp.load_config(_config(a)))
    variants = _chosen(a)
    models = {}
    for name, copies, chunks in variants:
        model = msp.parallelize(_model(a), layout)
        if copies:
            install(model, copies, chunks)
        models[name] = model.train()
    ids = torch.randint(0, a.vocab, (a.rows, a.seq), generator=torch.Generator().manual_seed(1))

    main_tid = threading.get_native_id()

    fake_calls = {}

    def step(model, threads=None, cpu_free=False):
        """One forward + backward; the slowest rank's time. threads (a list): gets this rank's _thread_times
        deltas over the step (None without schedstat) appended. cpu_free: the step's collectives move no bytes
        (_cpu_free.py); the barrier and the max over ranks stay real."""
        dist.barrier()
        s0 = _thread_times(main_tid) if threads is not None else None
        t0 = time.perf_counter()
        with (cpu_free_collectives(fake_calls) if cpu_free else contextlib.nullcontext()):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        t = torch.tensor([time.perf_counter() - t0])
        if threads is not None:
            s1 = _thread_times(main_tid)
            threads.append(None if s0 is None or s1 is None else [b - a for a, b in zip(s0, s1)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        model.zero_grad(set_to_none=True)
        return t.item()

    def split_step(model, cpu_free):
        """step() under the modelled link: (time, *this rank's SPLIT values; None where schedstat is missing)."""
        threads = []
        with comm_stats() as st:
            t = step(model, threads, cpu_free)
        return (t, st["link_exposed_s"], st["blocked_s"], *(threads[0] or (None,) * 3))

    def timed(link, split, cpu_free=False):
        """Per round, the median step time of each variant: {variant: [round medians]}; with a link, also this
        rank's medians of the SPLIT values into split {variant: {key: [round medians]}}."""
        times = {name: [] for name, _, _ in variants}
        for r in range(a.repeats):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for name, _, _ in order:
                with (modelled_link(*link) if link else contextlib.nullcontext()):
                    step(models[name], cpu_free=cpu_free)
                    runs = [split_step(models[name], cpu_free) if link else (step(models[name]),)
                            for _ in range(a.steps)]
                times[name].append(statistics.median(x[0] for x in runs))
                if link:
                    for i, key in enumerate(SPLIT, 1):
                        if runs[0][i] is not None:
                            split.setdefault(name, {}).setdefault(key, []).append(
                                statistics.median(x[i] for x in runs))
        return times

    # the baseline's compute and collectives without the modelled link
    step(models["baseline"])
    base_off, blocked, counts = [], [], None
    for _ in range(a.steps * 2):
        with comm_stats() as st:
            base_off.append(step(models["baseline"]))
        blocked.append(st["blocked_s"])
        counts = (st["collectives"], st["bus_bytes"])
    t_off, t_blocked = statistics.median(base_off), statistics.median(blocked)
    compute = t_off - t_blocked
    n_coll, nbytes = counts

    def forward(model):  # the forward alone (its graph dropped): its share bounds what a forward can hide
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False)
        return time.perf_counter() - t0

    fwd_off, fwd_blocked = [], []
    for _ in range(a.steps * 2):
        with comm_stats() as st:
            fwd_off.append(forward(models["baseline"]))
        fwd_blocked.append(st["blocked_s"])
    compute_fwd = statistics.median(fwd_off) - statistics.median(fwd_blocked)
    bw = a.bandwidth or nbytes / max(compute - n_coll * a.alpha, 1e-6)
    link = torch.tensor([a.alpha, bw])
    dist.broadcast(link, 0)  # one link model for every rank
    alpha, bw = link.tolist()
    with modelled_link(alpha, bw), comm_stats() as st:
        step(models["baseline"])
    comm_modelled = st["modelled_s"]
    with modelled_link(alpha, bw), comm_stats() as st:
        forward(models["baseline"])
    comm_fwd_modelled = st["modelled_s"]

    split, split_free = {}, {}
    results = {"real": timed(None, split), "modelled": timed((alpha, bw), split)}
    if a.cpu_free:
        results["cpu_free"] = timed((alpha, bw), split_free, cpu_free=True)
        if not fake_calls:
            raise RuntimeError("cpu_free link: no collective of the step reached the patch")
    return {"compute_s": compute, "compute_fwd_s": compute_fwd, "blocked_real_s": t_blocked,
            "collectives_per_step": n_coll, "bus_bytes_per_step": nbytes, "alpha_s": alpha, "bandwidth_Bps": bw,
            "comm_modelled_s": comm_modelled, "comm_fwd_modelled_s": comm_fwd_modelled, "step_s": results,
            "modelled_split_rank0": split, "cpu_free_split_rank0": split_free, "cpu_free_calls": fake_calls} \
        if rank == 0 else None


def _thread_times(main_tid):
    """(main thread's CPU s, its time runnable but not running s, the other threads' CPU s: gloo's workers) from
    /proc/self/task/*/schedstat, or None where the kernel has no schedstat."""
    main = others = None
    try:
        for task in Path("/proc/self/task").iterdir():
            cpu, waited = (int(v) * 1e-9 for v in (task / "schedstat").read_text().split()[:2])
            if int(task.name) == main_tid:
                main = (cpu, waited)
            else:
                others = (others or 0.0) + cpu
    except (OSError, ValueError):
        return None
    return None if main is None else (*main, others or 0.0)


def _chosen(a):
    return [v for v in VARIANTS if v[0] == "baseline" or a.variants is None or v[0] in a.variants]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="processes = tp size (use_seq_parallel)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rows", type=int, default=4, help="rows of one micro-batch (divisible by 4)")
    p.add_argument("--alpha", type=float, default=50e-6, help="modelled link latency per collective, seconds")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="modelled link bytes/s; default: calibrated so modelled comm = the baseline's compute")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS[1:]], default=None,
                   help="run only these variants (and the baseline); default: all")
    p.add_argument("--no-cpu-free", dest="cpu_free", action="store_false",
                   help="skip the third link: modelled, with collectives that move no bytes (_cpu_free.py)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "interleave_cpu.json"))
    a = p.parse_args(argv)

    ranks, failed, _ = run_ranks(_worker, a.world, (a,), timeout=3600, spawn=True, name="interleave")
    if failed:
        raise SystemExit(f"benchmark rank failed: {failed['traceback']}")
    res = ranks[0]

    modelled = min(res["compute_s"], res["comm_modelled_s"])  # cpu_free: the same modelled link
    hide_by = {"real": min(res["compute_s"], res["blocked_real_s"]), "modelled": modelled, "cpu_free": modelled}
    rows = []
    for link, times in res["step_s"].items():  # per-round ratios against the same round's baseline, then medians
        base = times["baseline"]
        for name, _, _ in _chosen(a):
            t = times[name]
            row = {"link": link, "variant": name, "step_s": statistics.median(t),
                   "speedup": statistics.median(b / x for b, x in zip(base, t)),
                   "hidden_fraction": statistics.median((b - x) / hide_by[link] for b, x in zip(base, t)),
                   "rounds_step_s": t}
            if link == "modelled":
                real = res["step_s"]["real"][name]  # the variant's own real-link step as its modelled step
                row["real_link_bound"] = statistics.median((b - x) / hide_by[link] for b, x in zip(base, real))
            if link != "real":
                sp = res[f"{link}_split_rank0"][name]
                exposed, blocked = statistics.median(sp["link_exposed_s"]), statistics.median(sp["blocked_s"])
                row.update(link_exposed_s=exposed, gloo_late_s=blocked - exposed,
                           link_hidden=1 - exposed / hide_by[link],
                           other_s=row["step_s"] - blocked - res["compute_s"],
                           **{k: statistics.median(sp[k]) for k in SPLIT[2:] if k in sp})
            rows.append(row)
    res.update(rows=rows, hideable_s=hide_by, args=vars(a))
    print(f"tp={a.world} + SP, {a.layers} layers, hidden {a.hidden}, seq {a.seq}, {a.rows} rows; compute "
          f"{res['compute_s'] * 1e3:.0f} ms/step (forward {res['compute_fwd_s'] * 1e3:.0f}), real gloo blocked "
          f"{res['blocked_real_s'] * 1e3:.0f} ms, modelled comm {res['comm_modelled_s'] * 1e3:.0f} ms (forward "
          f"{res['comm_fwd_modelled_s'] * 1e3:.0f}; {res['collectives_per_step']} collectives, "
          f"{res['bus_bytes_per_step'] / 1e6:.1f} MB bus; alpha {res['alpha_s'] * 1e6:.0f} us, "
          f"{res['bandwidth_Bps'] / 1e6:.0f} MB/s)")
    print(f"{'link':9} {'variant':13} {'step ms':>8} {'speedup':>8} {'hidden':>7} | {'real-link bound':>15} "
          f"{'link hidden':>11} {'exposed ms':>10} {'gloo late ms':>12} {'other ms':>9} | {'main CPU ms':>11} "
          f"{'main descheduled':>16} {'gloo threads CPU':>16}")
    for r in rows:
        line = (f"{r['link']:9} {r['variant']:13} {r['step_s'] * 1e3:8.1f} {r['speedup']:8.2f} "
                f"{r['hidden_fraction'] * 100:6.0f}%")
        if "link_hidden" in r:
            bound = f"{r['real_link_bound'] * 100:14.0f}%" if "real_link_bound" in r else f"{'-':>15}"
            line += (f" | {bound} {r['link_hidden'] * 100:10.0f}% "
                     f"{r['link_exposed_s'] * 1e3:10.1f} {r['gloo_late_s'] * 1e3:12.1f} {r['other_s'] * 1e3:9.1f}")
            if "main_cpu_s" in r:
                line += (f" | {r['main_cpu_s'] * 1e3:11.1f} {r['main_descheduled_s'] * 1e3:16.1f} "
                         f"{r['other_threads_cpu_s'] * 1e3:16.1f}")
        print(line)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
