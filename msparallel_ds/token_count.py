"""The engine's global token count without a collective of its own (dp-only steps, DeepSpeed ZeRO 1-3).

Every rank back-propagates sum(its token losses) x dp / N, N the global batch's valid tokens, so N must be known
before the first backward: a count all-reduce of its own, started before the forward. Where no batch agreement
carries it (no tp / cp / pp peers), that collective is one of the two the step makes beyond plain DeepSpeed, and on
gloo each costs a wake-up of every rank (benchmarks/README.md, issue 44 item 12). Most runs see the same N every step
(fixed-length or packed rows, nothing ignored), so after one counted step the engine back-propagates with the last
step's N (the reference) and sums this step's count inside the loss sum's all-reduce, which it makes anyway; before
the optimizer step every rank knows the true N:
- the same as the reference: the gradients are exactly those of the counted path (same factor, bit for bit);
- different (ignored labels, ragged rows): every gradient is off by the one factor N / reference, the same on every
  rank, and DeepSpeed's ZeRO optimizer divides it out at this step through its loss scale (static 1.0 outside fp16;
  its norm, clipping and update all read the scale), as Megatron divides its summed gradients by the global token
  count after the reduction. The engine then counts first again for the rest of the run: data whose N varies keep
  the counted path's exact rounding.

Only where that division is sound: a ZeRO 1-3 optimizer with its static scale at 1 (not fp16's dynamic scaling, not
ZeRO-0's plain optimizer, not DeepSpeed's own Muon, whose update is scale-free), and a loss that is the token mean
alone (no aux / z / indexer loss, no MTP, no summed multi-copy loss: their terms are not divided by N).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["divides_gradients", "divided_by"]


def divides_gradients(ds_engine) -> bool:
    """Whether DeepSpeed's optimizer can divide this step's gradients by a factor before its norm and update."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = ds_engine.optimizer
    if ds_engine.fp16_enabled() or not isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        return False
    if type(getattr(opt, "loss_scaler", None)) is not LossScaler or opt.custom_loss_scaler or opt.loss_scale != 1.0:
        return False
    return not any(getattr(p, "use_muon", False) for p in ds_engine.module.parameters())


@contextmanager
def divided_by(ds_engine, factor: Optional[float]) -> Iterator[None]:
    """DeepSpeed's next optimizer step divides the reduced gradients by `factor` (None: as they are)."""
    if factor is None:
        yield
        return
    opt = ds_engine.optimizer
    opt.loss_scale = factor  # the static scaler's cur_scale: read by the step's norm, clipping and unscale
    try:
        yield
    finally:
        opt.loss_scale = 1.0
