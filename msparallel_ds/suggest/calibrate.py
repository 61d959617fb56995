"""Measure the cost model's figures on this machine: a matmul FLOP rate, and the all-reduce bus bandwidth and latency
of the current process group, or (no process group) of `world` spawned processes over loopback gloo, each timing
its matmuls while the others do too: ranks that share cores (4 CPU processes on 2 cores) see the rate and the
collective latency they will see in training, not an idle machine's. Short by design (a few seconds; the probe
gives up after 20 s and keeps the defaults)."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from dataclasses import replace

from .cost import Links


def matmul_flops(n: int = 512, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of back-to-back n x n float32 matmuls (2 n^3 each) for `seconds`, after one warm-up: what a
    rank gets while the others run too (a best-of-few timing would catch a moment when they do not)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - t0)


def train_flops(h: int = 256, tokens: int = 512, seconds: float = 1.0) -> float:
    """Sustained FLOP/s of forward + backward through an MLP block (Linear h->4h, GELU, Linear 4h->h: 6 x params x
    tokens per pass): what a training step's layers reach, against matmul_flops' bare products (mfu)."""
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
    x = torch.randn(tokens, h)
    params = sum(p.numel() for p in net.parameters())
    net(x).sum().backward()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        net.zero_grad(set_to_none=True)
        net(x).sum().backward()
        count += 1
    return 6 * params * tokens * count / (time.perf_counter() - t0)


def layer_call_seconds(repeats: int = 20) -> float:
    """The fixed cost of one decoder layer's forward + backward call (Python, autograd, kernel launches): the
    difference between tiny Llamas (hidden 64, 8 tokens: negligible arithmetic) of 3 and 1 layers, / 2, medians of
    `repeats` calls."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..tiny import tiny_llama_config

    ids = torch.randint(0, 64, (1, 8))

    def call_time(layers: int) -> float:
        model = AutoModelForCausalLM.from_config(tiny_llama_config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa"))
        model(ids, labels=ids).loss.backward()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - t0)
        return sorted(times)[repeats // 2]

    return max(0.0, (call_time(3) - call_time(1)) / 2)


def adam_seconds_per_param(n: int = 1 << 20, repeats: int = 5) -> float:
    """Seconds per parameter of torch.optim.AdamW.step on one n-element fp32 parameter (median of `repeats`)."""
    import torch

    w = torch.nn.Parameter(torch.randn(n))
    w.grad = torch.randn(n)
    opt = torch.optim.AdamW([w], lr=1e-3)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2] / n


def _time_allreduce(nbytes: int, repeats: int) -> tuple[float, float]:
    """(bus bytes/s of an nbytes all-reduce, seconds of a 4-byte one) on the default group."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    big, tiny = torch.zeros(nbytes // 4), torch.zeros(1)
    dist.all_reduce(big)
    dist.all_reduce(tiny)
    t_big, t_tiny = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(big)
        t_big.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist.all_reduce(tiny)
        t_tiny.append(time.perf_counter() - t0)
    lat = sorted(t_tiny)[len(t_tiny) // 2]
    t = max(sorted(t_big)[len(t_big) // 2] - lat, 1e-9)
    return 2 * (n - 1) / n * nbytes / t, lat


def loaded_latency(steps: int = 40, n: int = 512) -> float:
    """Seconds one tiny all-reduce adds between compute on every rank (small matmuls), the way a training step
    meets its collectives: when ranks share cores, each call waits for every rank to be scheduled again, which an
    idle ping-pong (_time_allreduce) does not see. Timed with and without the calls, on every rank at once. The
    wait depends on the compute between calls (4 CPU ranks on 2 cores: 0.7 ms after 0.1 ms of compute, 1.3-1.9 ms
    after 6 ms, 0.8 ms after 45 ms), so n is sized like a decoder layer's work between two collectives."""
    import torch
    import torch.distributed as dist

    a, tiny = torch.randn(n, n), torch.zeros(1)

    def loop(comm: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            torch.mm(a, a)
            if comm:
                dist.all_reduce(tiny)
        dist.barrier()
        return time.perf_counter() - t0

    loop(True)
    return max(0.0, (loop(True) - loop(False)) / steps)


def _child(rank: int, world: int, port: int, nbytes: int, repeats: int, matmul_n: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dist.barrier()
        flops = matmul_flops(matmul_n)  # every rank at once: the rate under this many processes
        dist.barrier()
        achieved = train_flops()
        bw, _ = _time_allreduce(nbytes, repeats)
        out.put((rank, flops, bw, loaded_latency(), achieved, adam_seconds_per_param(), layer_call_seconds()))
    finally:
        dist.destroy_process_group()


def _loopback(nbytes: int, repeats: int, timeout: float, world: int, matmul_n: int):
    """(median matmul FLOP/s per rank, bus bytes/s, collective latency s, train-block FLOP/s, AdamW s per parameter,
    layer call s) of `world` spawned processes, or None."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, port, nbytes, repeats, matmul_n, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=timeout) for _ in range(world)]
    except Exception:  # noqa: BLE001  a probe that cannot finish keeps the defaults
        return None
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
    flops = sorted(g[1] for g in got)[world // 2]
    achieved = sorted(g[4] for g in got)[world // 2]
    adam = sorted(g[5] for g in got)[world // 2]
    call = sorted(g[6] for g in got)[world // 2]
    rank0 = next(g for g in got if g[0] == 0)
    return flops, rank0[2], rank0[3], achieved, adam, call


def calibrate(links: Links = Links(), nbytes: int = 8 << 20, repeats: int = 5, matmul_n: int = 512,
              timeout: float = 20.0, world: int = 2) -> tuple[Links, dict]:
    """Links with flops, intra/inter bandwidth and latency measured (one machine: intra = inter), plus a report.
    shared_cores is set when `world` processes outnumber this machine's cores (they take turns on them)."""
    import torch.distributed as dist

    cores = os.cpu_count() or 1
    if dist.is_available() and dist.is_initialized():
        flops, achieved, adam = matmul_flops(matmul_n), train_flops(), adam_seconds_per_param()
        call = layer_call_seconds()
        bw_lat = (_time_allreduce(nbytes, repeats)[0], loaded_latency())
        where, world = f"process group ({dist.get_backend()}, {dist.get_world_size()} ranks)", dist.get_world_size()
    else:
        probe = _loopback(nbytes, repeats, timeout, world, matmul_n)  # before any matmul in this process
        where = f"{world} spawned processes, loopback gloo"
        flops, bw_lat, achieved, adam, call = ((probe[0], probe[1:3], probe[3], probe[4], probe[5]) if probe else
                                               (matmul_flops(matmul_n), None, train_flops(),
                                                adam_seconds_per_param(), layer_call_seconds()))
    mfu = min(1.0, achieved / flops)
    shared = cores if world > cores else 0
    report = {"matmul_flops_per_rank": flops, "train_block_flops_per_rank": achieved, "mfu": mfu,
              "adam_s_per_param": adam, "layer_call_s": call,
              "matmul_n": matmul_n, "probe": where, "allreduce_bytes": nbytes, "cpu_cores": cores}
    out = replace(links, flops=flops, mfu=mfu, adam_s_per_param=adam, layer_call_s=call, shared_cores=shared)
    if bw_lat is not None:
        bw, lat = bw_lat
        out = replace(out, intra_bw=bw, inter_bw=bw, latency=lat)
        report.update(bus_bandwidth=bw, latency_s=lat)
    else:
        report["bandwidth"] = "probe failed or timed out: defaults kept"
    return out, report
