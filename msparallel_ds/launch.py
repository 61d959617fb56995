"""Run a function on N local CPU processes over gloo, with a deadline: the demo and the offline checkpoint converter.

    results = run_local(fn, world, args, timeout=300, on_message=print_progress)

fn(rank, world, *args, send) runs in each forked process after torch.distributed is up (gloo, the given timeout);
send(payload) passes progress to on_message in the parent; fn's return value is rank's result. The parent raises
with the rank and its traceback as soon as one rank fails or dies, and TimeoutError at the deadline; the other
processes are killed, so nothing hangs. Forking after the heavy imports lets the workers start in seconds.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

__all__ = ["run_local"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, timeout: float, args: Sequence, out) -> None:
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N processes share the cores
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        result = fn(rank, world, *args, lambda payload: out.put(("message", rank, payload)))
        dist.barrier()
        dist.destroy_process_group()
        out.put(("done", rank, result))
    except BaseException:  # reported to the parent, which stops the run with this rank's traceback
        out.put(("error", rank, traceback.format_exc()))


def run_local(fn: Callable, world: int, args: Sequence = (), *, timeout: float = 300,
              on_message: Optional[Callable[[int, Any], None]] = None) -> list:
    """fn's result on each of `world` processes (a list indexed by rank)."""
    ctx = mp.get_context("fork" if sys.platform != "win32" else "spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, timeout, tuple(args), out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: list = [None] * world
    done, deadline = 0, time.monotonic() + timeout
    try:
        while done < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} processes did not finish within {timeout:.0f} s")
            try:
                kind, rank, payload = out.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without reporting")
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if kind == "message":
                if on_message is not None:
                    on_message(rank, payload)
            else:
                results[rank] = payload
                done += 1
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results
