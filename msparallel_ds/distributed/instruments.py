"""Debugging / benchmark instruments of the collectives: event recording, a modelled link and counters.

All off by default: the collectives call the hooks below, which cost one `is None` test each when off.
`recording()` logs issue / wait / compute / sync events with the copy id and phase (fwd/bwd) for the order tests;
`modelled_link(alpha, bw)` floors every collective's completion at alpha + bus_bytes / bw after its start by
sleeping (no CPU), so overlap can be measured on a machine whose real link shares the cores with compute;
`comm_stats()` counts the collectives that completed; `tapped_collectives(on_call)` reports every torch.distributed
call a block makes (anyone's, DeepSpeed's included), for the benchmarks' and tests' counters.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["record", "recording", "modelled_link", "comm_stats", "tapped_collectives", "current_copy",
           "current_log", "active_copy", "is_recording", "bus_bytes", "sync_start", "sync_done", "issue_clock",
           "async_started", "wait_clock", "async_finished"]


class _State:
    """The instruments' state; every field None (off) unless a context manager below enables it."""
    __slots__ = ("log", "link", "copy", "stats")

    def __init__(self) -> None:
        self.log: Optional[list] = None                  # recording(): list of event tuples
        self.link: Optional[tuple[float, float]] = None  # modelled_link(): (alpha seconds, bytes per second)
        self.copy: Optional[int] = None                  # the copy (or chunk) whose forward code runs now
        self.stats: Optional[dict] = None                # comm_stats(): counters of the collectives that completed


_state = _State()


# ---------------------------------------------------------------------------------------------- public API
def record(event: str, name: str, phase: Optional[str] = None, copy: Optional[int] = None) -> None:
    """Append (event, copy, phase, name) to the active recording; no-op (one test) when none is active.
    phase None: bwd inside an autograd backward, else fwd."""
    if _state.log is not None:
        if phase is None:
            phase = "bwd" if torch._C._current_autograd_node() is not None else "fwd"
        _state.log.append((event, _state.copy if copy is None else copy, phase, name))


@contextlib.contextmanager
def recording():
    """Log collectives and compute marks: yields the list of (event, copy, phase, name) tuples, event in
    issue | wait | compute | sync (a blocking collective) | grad_issue | grad_wait (a tp-replicated weight's
    gradient sum, tensor_parallel/replicated.py), phase fwd | bwd."""
    prev, _state.log = _state.log, []
    try:
        yield _state.log
    finally:
        _state.log = prev


# the torch.distributed entry points tapped_collectives wraps (those absent from this torch are skipped)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all",
               "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
               "all_gather_object", "broadcast_object_list")


@contextlib.contextmanager
def tapped_collectives(on_call: Callable[[str, tuple, dict], None], ops: tuple[str, ...] = COLLECTIVES):
    """While the block runs, on_call(op, args, kwargs) before each torch.distributed call of `ops`; nested calls
    (a collective of torch.distributed calling another) report once, at the outermost entry point. The module
    attributes are patched, so callers that bound a function earlier (`from torch.distributed import x`) are not
    seen. Not for timed code: the wrapper costs some Python per call."""
    import torch.distributed as dist

    depth = [0]
    originals = {op: getattr(dist, op) for op in ops if hasattr(dist, op)}

    def wrap(op, fn):
        @functools.wraps(fn)
        def tapped(*args, **kwargs):
            if depth[0] == 0:
                on_call(op, args, kwargs)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return tapped

    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
    try:
        yield
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)


@contextlib.contextmanager
def modelled_link(alpha_s: float, bytes_per_s: float):
    """Every collective completes no earlier than alpha_s + bus_bytes / bytes_per_s after it started (a sleep,
    which frees the core); bus bytes: ring volume per rank, (n-1)/n of the gathered size (x2 for all-reduce)."""
    prev, _state.link = _state.link, (float(alpha_s), float(bytes_per_s))
    try:
        yield
    finally:
        _state.link = prev


@contextlib.contextmanager
def comm_stats():
    """Count the collectives completed inside: yields {collectives, bus_bytes, blocked_s (wall time the caller
    spent waiting in them), modelled_s (their modelled durations, with modelled_link), link_exposed_s (with
    modelled_link: the part of blocked_s before each collective's modelled completion, i.e. the link time the
    schedule left exposed; the rest of blocked_s is the real collective finishing later than the model)}."""
    prev = _state.stats
    _state.stats = {"collectives": 0, "bus_bytes": 0.0, "blocked_s": 0.0, "modelled_s": 0.0, "link_exposed_s": 0.0}
    try:
        yield _state.stats
    finally:
        _state.stats = prev


@contextlib.contextmanager
def current_copy(copy: Optional[int]):
    """Tag the events of the code inside with this copy id (the interleave scheduler sets it per step)."""
    prev, _state.copy = _state.copy, copy
    try:
        yield
    finally:
        _state.copy = prev


def current_log() -> Optional[list]:
    """The active recording's event list, None when no recording is active."""
    return _state.log


def is_recording() -> bool:
    return _state.log is not None


def active_copy() -> Optional[int]:
    """The copy id set by the innermost current_copy (None outside one)."""
    return _state.copy


# ---------------------------------------------------------------------------------------------- hooks
def bus_bytes(kind: str, full: Tensor, n: int) -> float:
    """Bytes one rank moves in a ring implementation; `full` is the gathered / pre-reduction tensor."""
    b = full.numel() * full.element_size() * (n - 1) / n
    return 2 * b if kind == "all_reduce" else b


def _floor(t0: float, nbytes: float) -> None:
    alpha, bw = _state.link
    left = t0 + alpha + nbytes / bw - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _count(nbytes: float, blocked_from: float, t0: Optional[float]) -> None:
    st = _state.stats
    st["collectives"] += 1
    st["bus_bytes"] += nbytes
    st["blocked_s"] += time.perf_counter() - blocked_from
    if _state.link is not None:
        modelled = _state.link[0] + nbytes / _state.link[1]
        st["modelled_s"] += modelled
        if t0 is not None:  # the caller waited from blocked_from; the link alone would have held it until t0 + modelled
            st["link_exposed_s"] += max(0.0, t0 + modelled - blocked_from)


def sync_start() -> Optional[float]:
    """Before a blocking collective: its start time when a link is modelled or stats are counted, else None."""
    return time.perf_counter() if _state.link is not None or _state.stats is not None else None


def sync_done(t0: Optional[float], kind: str, nbytes: float) -> None:
    """After a blocking collective started at t0 (sync_start): floor it, count it, log a sync event."""
    if t0 is not None:
        if _state.link is not None:
            _floor(t0, nbytes)
        if _state.stats is not None:
            _count(nbytes, t0, t0)
    record("sync", kind)


def issue_clock() -> Optional[float]:
    """Before an async collective is started: its start time when a link is modelled, else None."""
    return time.perf_counter() if _state.link is not None else None


def async_started(name: str, phase: str, copy: Optional[int], event: str = "issue") -> None:
    """An async collective is in flight: log `event`."""
    record(event, name, phase, copy)


def wait_clock() -> float:
    """Before waiting on an async collective: now when stats are counted (the blocked time starts), else 0."""
    return time.perf_counter() if _state.stats is not None else 0.0


def async_finished(t0: Optional[float], blocked_from: float, nbytes: float, name: str, phase: str,
                   copy: Optional[int], event: str = "wait") -> None:
    """After the wait of an async collective started at t0 (issue_clock): floor it, count it, log `event`."""
    if t0 is not None and _state.link is not None:
        _floor(t0, nbytes)
    if _state.stats is not None:
        _count(nbytes, blocked_from, t0)
    record(event, name, phase, copy)
