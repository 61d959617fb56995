"""Run one benchmark variant on `world` local processes (forked after the heavy imports on CPU, spawned on CUDA):
each runs target(rank, world, *args) with the torch.distributed env set; its return value (or traceback) comes
back, and its process group is destroyed. Shared by train.py and moe.py so they start, collect and clean up their
rank groups the same way."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(target, rank: int, world: int, port: int, args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        payload = target(rank, world, *args)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        out.put((rank, True, payload))
    except BaseException:  # noqa: BLE001  reported to the parent, which records it
        out.put((rank, False, traceback.format_exc()))


def run_ranks(target, world: int, args: tuple, *, timeout: float, spawn: bool = False, name: str = "bench"):
    """(per-rank results in rank order, None) or (None, {"error": last line, "traceback": text}); plus wall seconds.
    A rank's error or a dead rank stops the others within 5 s; a hang stops at `timeout`."""
    ctx = mp.get_context("spawn" if spawn else "fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, args, out), name=f"{name}-rank{r}")
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
