"""Run one benchmark variant on `world` local processes (forked after the heavy imports on CPU, spawned on CUDA):
each calls target(rank, world, port, *args, out) and puts (rank, ok, payload) on `out`. Shared by train.py and
moe.py so they start, collect and clean up their rank groups the same way."""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, args: tuple, *, timeout: float, spawn: bool = False, name: str = "bench"):
    """(per-rank results in rank order, None) or (None, {"error": last line, "traceback": text}); plus wall seconds.
    A rank's error or a dead rank stops the others within 5 s; a hang stops at `timeout`."""
    ctx = mp.get_context("spawn" if spawn else "fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out), name=f"{name}-rank{r}")
             for r in range(world)]
    t_start = time.monotonic()
    for p in procs:
        p.start()
    deadline, results, errors = t_start + timeout, {}, {}
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, ok, payload = out.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} without reporting"
                continue
            (results if ok else errors)[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for p in procs:
            p.join(timeout=5 if p.is_alive() else 0)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
    wall = time.monotonic() - t_start
    if errors or len(results) < world:
        text = errors[min(errors)] if errors else f"timed out after {timeout} s"
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1]
        return None, {"error": last, "traceback": text, "wall_s": wall}, wall
    return [results[r] for r in range(world)], None, wall
