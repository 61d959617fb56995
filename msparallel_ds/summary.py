"""Plan.summary(): a readable two-column table."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan


def _rows(plan: "Plan") -> list[tuple[str, str]]:
    m = plan.mesh
    rows = [
        ("world size", str(plan.world_size)),
        ("mesh (pp, dp, cp_ring, cp_ulysses, tp)", f"{m.pp} x {m.dp} x {m.cp_ring} x {m.cp_ulysses} x {m.tp}"),
        ("context parallel", f"{m.cp} ({plan.cp_algo})" if plan.cp_algo else "off"),
        ("expert parallel (ep, expert dp)", f"ep {plan.expert_parallel}, edp {plan.expert_data_parallel} "
         f"(= dp x cp x tp / ep)" if plan.expert_parallel > 1 or plan.moe is not None else "off"),
        ("sequence parallel", "on" if plan.sequence_parallel else "off"),
        ("vocab parallel", "on" if plan.vocab_parallel else "off"),
        ("global batch size", str(plan.global_batch_size)),
        ("micro batch size (per dp rank)", str(plan.micro_batch_size)),
        ("micro_batch_num (pipeline)", str(plan.micro_batch_num)),
        ("gradient accumulation steps", str(plan.gradient_accumulation_steps)),
        ("micro_batch_interleave_num", str(plan.micro_batch_interleave_num)),
        ("fine_grain_interleave", str(plan.fine_grain_interleave)),
        ("ZeRO stage", f"{plan.zero.stage} over {plan.zero.group_size} ranks (dp x cp)"
         + (f", hpZ {plan.zero.hpz_partition_size}" if plan.zero.hpz_partition_size else "")),
        ("pipeline schedule", f"{plan.pp_schedule} ({plan.pp_virtual_stages} virtual)" if plan.pp_schedule
         else "off"),
    ]
    if plan.layers_per_stage:
        rows.append(("layers per stage", str(plan.layers_per_stage if plan.pp_virtual_stages > 1
                                             else plan.layers_per_stage[0])))
    rc = plan.recompute
    detail = rc.mode
    if rc.layers:
        detail += f" {rc.layers if len(rc.layers) > 1 else rc.layers[0]}"
    if rc.select:
        detail += f", select {len(rc.select)} pattern(s)"
    if rc.select_comm:
        detail += f", comm {len(rc.select_comm)} pattern(s)"
    rows += [
        ("recompute", detail),
        ("precision", f"{plan.compute_dtype} compute, {plan.param_dtype} params"),
        ("loss scale", f"{plan.loss_scale.kind} {plan.loss_scale.initial:g}" if plan.loss_scale.kind else "none"),
        ("gradient clipping", f"{plan.gradient_clipping:g}" if plan.gradient_clipping else "off"),
    ]
    if plan.memory:
        mem = plan.memory
        unit, scale = ("GiB", 1.0) if mem.total_gib >= 0.1 else ("MiB", 1024.0)

        def f(x: float) -> str:
            return f"{x * scale:.1f}"

        transient = (f"activations {f(mem.activations_gib)} + logits {f(mem.logits_gib)} + buffers "
                     f"{f(mem.buffers_gib)}")
        if mem.grad_sync_gib > mem.activations_gib + mem.logits_gib + mem.buffers_gib:  # the later, higher peak
            transient = f"max({transient}, gradient all-reduce copy {f(mem.grad_sync_gib)})"
        rows += [(f"memory / rank ({unit}, est.)",
                  f"{f(mem.total_gib)} = weights {f(mem.weights_gib)} + grads {f(mem.grads_gib)} + optimizer "
                  f"{f(mem.optimizer_gib)} + {transient}"),
                 ("activations without recompute", f"{f(mem.activations_no_recompute_gib)} {unit}")]
        if mem.expert_params_per_rank:
            rows.append(("params / rank (routed experts)", f"{mem.params_per_rank / 1e9:.2f}B "
                         f"({mem.expert_params_per_rank / 1e9:.2f}B)"))
    return rows


def render_summary(plan: "Plan") -> str:
    rows = _rows(plan)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
