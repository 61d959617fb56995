"""`parallel.parallel_mode` and `use_parallel`: the parallel degrees and gradient accumulation MindFormers 2.1
actually uses outside semi_auto / auto parallel (mindformers 2.1.0 wheel; paths under mindformers/)."""
from __future__ import annotations

import warnings
from typing import Any

from .errors import ConfigIssue, ConfigWarning

__all__ = ["apply_mode_resets"]


def apply_mode_resets(out: dict, issues: list[ConfigIssue], run_mode: Any = None) -> None:
    """The degrees MindFormers 2.1 actually uses outside semi_auto / auto parallel:
    - STAND_ALONE / MANUAL_PARALLEL with use_parallel true and run_mode predict: the manual groups
      initialize_model_parallel(tp=model_parallel, dp, pp, ep, order "tp-ep-pp-dp") (core/context/parallel.py:120-150;
      trainer/base_trainer.py:181 skips the trainer's reset when RUN_MODE is predict): those four degrees are kept,
      context parallel (not one of them) is 1.
    - training (any other run_mode) in data_parallel / stand_alone, and use_parallel false: the trainer resets every
      degree to 1 and folds gradient accumulation into the per-card batch (trainer/base_trainer.py:214, :280-296:
      batch_size x gradient_accumulation_steps, then :320-326 sets gradient_accumulation_steps to 1; the global batch
      is unchanged); the data-parallel degree then comes from the device count.
    As there, the degrees are validated first (a negative or non-integer one is still an error, left for the schema
    to report) and the hybrid ulysses rule is checked on the YAML's values; the reset context_parallel of 1 is not
    checked against ulysses_degree_in_cp again."""
    mode = out["parallel"].get("parallel_mode")
    pc = out["parallel_config"]
    reason = None
    if out.get("use_parallel") is False:
        reason = "use_parallel=false (stand-alone)"
    elif mode == "stand_alone" and run_mode == "predict":
        _manual_groups(pc)
        return
    elif mode in ("data_parallel", "stand_alone"):
        reason = f"parallel.parallel_mode={mode}"
    if reason is None:
        return
    cp, uly = pc.get("context_parallel", 1), pc.get("ulysses_degree_in_cp", 1)
    if pc.get("context_parallel_algo") == "hybrid_cp" and _is_int(cp) and _is_int(uly) and uly >= 1 and cp % uly:
        issues.append(ConfigIssue("parallel_config.ulysses_degree_in_cp", uly,
                                  f"must divide parallel_config.context_parallel={cp} (checked before {reason} "
                                  "resets it)", f"use one of {[d for d in range(1, cp + 1) if cp % d == 0]}"))
    degrees = ("data_parallel", "model_parallel", "context_parallel", "pipeline_stage", "expert_parallel",
               "ulysses_degree_in_cp")
    valid = [k for k in degrees if _is_int(pc.get(k, 1)) and pc.get(k, 1) >= 1]
    changed = [k for k in valid if pc.get(k, 1) != 1]
    if pc.get("use_seq_parallel") is True:
        changed.append("use_seq_parallel")
    if changed:
        warnings.warn(f"{reason}: MindFormers resets parallel_config {', '.join(changed)} "
                      "(model parallelism off, data parallel over all devices: trainer/base_trainer.py:280-296)",
                      ConfigWarning, stacklevel=5)
    for k in valid:
        pc[k] = 1
    pc["use_seq_parallel"] = False
    _fold_accumulation(out["runner_config"], reason)


def _manual_groups(pc: dict) -> None:
    """MANUAL_PARALLEL / STAND_ALONE prediction: MindFormers' manual groups take tp, dp, pp and ep only."""
    dropped = [k for k in ("context_parallel", "ulysses_degree_in_cp") if _is_int(pc.get(k, 1)) and pc.get(k, 1) > 1]
    if dropped:
        warnings.warn(f"parallel.parallel_mode=stand_alone (MANUAL_PARALLEL) with run_mode predict: MindFormers' "
                      "manual groups are initialize_model_parallel(tp=model_parallel, dp, pp, ep, order "
                      f"'tp-ep-pp-dp') (core/context/parallel.py:120-150), without context parallel: "
                      f"parallel_config {', '.join(dropped)} reset to 1", ConfigWarning, stacklevel=6)
        for k in dropped:
            pc[k] = 1
    tp, dp, pp, ep = (pc.get(k, 1) for k in ("model_parallel", "data_parallel", "pipeline_stage", "expert_parallel"))
    if not all(_is_int(v) and v >= 1 for v in (tp, dp, pp, ep)):
        return  # the schema reports the bad value
    order = []  # parallel_state.py:404-410 (RankGenerator, order tp-ep-pp-dp) and :301-315 (MoE order tp-ep)
    if pp > 1 and dp > 1:
        order.append("its dense ranks are tp, then pp, then dp outermost (here pp is outermost: pp-dp-cp-tp)")
    if 1 < ep < tp * dp:
        order.append(f"its expert groups are strided by tp*dp/ep={tp * dp // ep} (here: {ep} consecutive ranks)")
    if order:
        warnings.warn("MANUAL_PARALLEL rank order: " + "; ".join(order) + ". The same math; other ranks share a "
                      "group, which matters only for device placement", ConfigWarning, stacklevel=6)


def _fold_accumulation(rc: dict, reason: str) -> None:
    """base_trainer.py:289 (batch_size x gradient_accumulation_steps per card) and :320-326 (accumulation off)."""
    gas, bs = rc.get("gradient_accumulation_steps"), rc.get("batch_size", 1)
    if not (_is_int(gas) and gas > 1 and _is_int(bs) and bs >= 1):
        return
    warnings.warn(f"{reason}: MindFormers' trainer does not accumulate gradients outside semi_auto / auto parallel: "
                  f"runner_config.gradient_accumulation_steps={gas} is reset to 1 and the per-card batch_size becomes "
                  f"{bs} x {gas} = {bs * gas} (trainer/base_trainer.py:289, :320-326; the global batch is unchanged)",
                  ConfigWarning, stacklevel=6)
    rc["batch_size"], rc["gradient_accumulation_steps"] = bs * gas, 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
