"""The one helper that runs a test function on N gloo processes (CPU), with a deadline.

    results = run_distributed(fn, 4, arg, timeout=60)   # fn(rank, world_size, arg) -> picklable

fn must be a module-level function (it is pickled to processes forked from a forkserver). Any rank's exception is
re-raised here with its rank and traceback; a hang (a rank stuck in a collective, a sleep) fails once
`timeout` seconds have passed since the start: stragglers are killed and TimeoutError is raised.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

__all__ = ["run_distributed", "DistributedTestError"]

# After the first failure, how long the other ranks get to report before they are killed
# (they are usually blocked in a collective with the failed rank and would only time out).
_GRACE_S = 3.0


class DistributedTestError(RuntimeError):
    """A rank raised; the message holds every reported rank's traceback text."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from one forkserver that imported these once per pytest session: a spawned rank spent about
# 3.4 s (4 ranks on 2 cores) importing them, for every one of the suite's ~100 multi-process cases. Nothing in
# the list may start threads or touch a tensor at import (a fork would inherit a half-made OpenMP pool).
_PRELOAD = ["torch", "torch.distributed", "yaml", "transformers", "transformers.models.llama.modeling_llama",
            "accelerate", "deepspeed", "msparallel_ds", "msparallel_ds.engine", "msparallel_ds.pipeline.engine",
            "msparallel_ds.integrations.accelerate"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the forkserver starts (the first call)
    return ctx


def _worker(fn, rank, world_size, port, timeout, args, kwargs, out, env):
    # The forkserver's environment is the one of the session's first call: take the caller's, as spawn does.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share few cores; oversubscription makes gloo crawl
    done = False
    try:
        # The group timeout makes a rank stuck in a collective raise instead of waiting forever.
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        # Pickle here, so an unpicklable result is reported as this rank's error, not lost.
        out.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
        done = True
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if done:
                # Stay alive until every rank is done: a rank whose fn ends with new_group can be
                # through its side of gloo's connectFullMesh while a peer is still in it, and
                # exiting then fails the peer ("Connection closed by peer"; seen once in CI).
                try:
                    dist.barrier()
                except Exception:  # a peer failed: its own error is what gets reported
                    pass
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size gloo processes; return results by rank."""
    ctx = _context()
    out = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, name=f"rank{r}",
                         args=(fn, r, world_size, port, timeout, args, kwargs, out, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results, errors = {}, {}
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, ok, payload = out.get(timeout=min(0.2, deadline - now))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill) never will.
                for r, p in enumerate(procs):
                    if r not in results and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} without reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if p.is_alive() else 0)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()

    if errors:
        first = min(errors)
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise DistributedTestError(
            f"rank {first} failed (failed ranks: {sorted(errors)} of {world_size}):\n{text}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout}s "
                           f"(hang or deadlock); they were killed")
    return [results[r] for r in range(world_size)]


def worst_over_ranks(per_rank) -> dict:
    """{case: errors} per rank -> {case: the elementwise max of its errors over the ranks} (a tuple)."""
    worst: dict = {}
    for res in per_rank:
        for case, errs in res.items():
            worst[case] = tuple(max(a, b) for a, b in zip(worst.get(case, errs), errs))
    return worst


def _isolated_child(fn, args, out) -> None:
    try:
        out.put((True, pickle.dumps(fn(*args))))
    except BaseException:
        out.put((False, traceback.format_exc()))


def run_isolated(fn, *args, timeout: float = 300):
    """fn(*args) in a fresh interpreter (spawn, not a daemon, so fn may fork its own workers): code that forks
    (msparallel-ds train's local launcher) must not fork the pytest process, whose earlier tests left thread pools
    that a forked child can deadlock on. fn must be importable by name; its exception is re-raised here as text."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_isolated_child, args=(fn, args, out))
    proc.start()
    try:
        ok, payload = out.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish within {timeout:.0f} s") from None
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise DistributedTestError(payload)
    return pickle.loads(payload)
