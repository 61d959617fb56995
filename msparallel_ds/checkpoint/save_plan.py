"""What a sharded engine.save would write and hold on every rank, from a Plan alone (`msparallel-ds plan`).

The rule is the save's own: the parameters of each pipeline stage, in the HF model's order (the embedding; per layer
the attention projections, the feed-forward or the router, routed and shared experts, two norms; norm; the head),
each with the Shard the tensor-parallel plan gives it (tp-split, vocab-split when vocab parallel, expert: whole
experts on their ep rank, replicated), and the writer of each chunk chosen by checkpoint.sharded.writes (a chunk
is written once over its data-parallel replicas; the pipeline engine's ZeRO-1 writes by the owner of the optimizer
state, which torch's ZeroRedundancyOptimizer assigns greedily per param group, largest first, to the least-loaded
rank; the groups build_optimizer makes from the YAML: weight decay, then no decay for 1-D tensors). Sizes come
from model_params (the YAML's model shape). A rank writes fp32 weights and the optimizer moments of its chunks into
one DCP file (so the largest file is the largest rank's bytes); during the save it holds a CPU copy of them (the
staged state, until written) plus, in the DeepSpeed engine with ZeRO 1/2, the snapshot of its flat ZeRO partition
and one parameter's tp-local weight and moments rebuilt over dp at a time (checkpoint.zero_stage; an upper bound),
plus two MIRROR_BLOCKs with replicas=1. Exact for Llama-family models (tested against the bytes an actual save
writes, one and two param groups); MoE expert tensors are counted per expert (gate/up/down), their exact
split into files depends on the HF class.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["save_report", "format_save_report"]

_REPLICATED, _TP, _EP, _VEC = "rep", "tp", "ep", "vec"  # _VEC: a replicated 1-D tensor (no weight decay)


class _Shard:  # what writes() reads of a tensor_parallel.spec.Shard
    def __init__(self, group: Optional[str]):
        self.is_split, self.group = group is not None, group or "tp"


class _RankLayout:  # what writes() reads of a ParallelLayout, for one rank of a stage
    def __init__(self, sizes: dict, ranks: dict):
        self.sizes, self.ranks = sizes, ranks

    def size(self, name: str) -> int:
        return self.sizes[name]

    def rank(self, name: str) -> int:
        return self.ranks[name]


def _linear(out: int, inp: int, group: Optional[str]) -> tuple[int, Optional[str]]:
    return out * inp, group


def _layer(plan: "Plan", moe: bool) -> list[tuple[int, Optional[str]]]:
    """(full numel, split group, None or _VEC) of one decoder layer's tensors, in HF order; routed experts: this ep
    rank's."""
    from ..model_params import ffn_size, mla_dims

    cfg, tp = plan.config, plan.mesh.tp
    m = cfg.model
    h, n = m.hidden_size, m.num_heads
    d = mla_dims(m)
    if d:
        q_heads = n * (d["nope"] + d["rope"])
        attn = ([(h * d["q_lora"], None), (d["q_lora"], _VEC), (d["q_lora"] * q_heads, _TP)] if d["q_lora"] else
                [(h * q_heads, _TP)])
        attn += [(h * (d["kv_lora"] + d["rope"]), None), (d["kv_lora"], _VEC),
                 (d["kv_lora"] * n * (d["nope"] + d["v"]), _TP), (n * d["v"] * h, _TP)]
    else:
        kv = m.kv_heads * (h // n)
        kv_group = _TP if m.kv_heads % tp == 0 else None  # fewer kv heads than tp ranks: k/v replicated
        attn = [(h * h, _TP), (kv * h, kv_group), (kv * h, kv_group), (h * h, _TP)]
    ffn = ffn_size(cfg)
    s = plan.moe
    if moe:
        e, size = s.num_experts, s.expert_size(ffn)
        ffn_part = [(h * size, _EP)] * (3 * (e // plan.expert_parallel))
        ffn_part += [(e * h, None)] + ([(e, _VEC)] if s.expert_bias else [])
        shared = s.shared_size(ffn)
        ffn_part += [(h * shared, _TP)] * 3 if shared else []
    else:
        ffn_part = [(h * ffn, _TP)] * 3
    return attn + ffn_part + [(h, _VEC), (h, _VEC)]


def _stage_tensors(plan: "Plan", stage: int) -> tuple[list[tuple[int, Optional[str]]], set[int]]:
    """(full numel, split group or None) of the stage's tensors in HF order, and the indices of the 1-D ones."""
    from ..moe.plan import stage_layer_kinds

    cfg = plan.config
    h, vocab = cfg.model.hidden_size, cfg.model.vocab_size
    dense, moe, mtp = stage_layer_kinds(plan)[stage]
    vocab_group = _TP if plan.vocab_parallel else None
    first, last = stage == 0, stage == plan.mesh.pp - 1
    out = [(vocab * h, vocab_group)] if first else []
    for k in range(dense + moe):
        out += _layer(plan, moe=k >= dense)
    last_moe = plan.moe is not None and bool(plan.moe.num_experts) and cfg.model.num_layers > plan.moe.dense_layers
    for _ in range(mtp):
        out += _layer(plan, moe=last_moe) + [(2 * h * h, _TP)] + [(h, _VEC)] * 3
    if last:
        out += [(h, _VEC), (vocab * h, vocab_group)]
    return [(n, None if g == _VEC else g) for n, g in out], {i for i, (_, g) in enumerate(out) if g == _VEC}


def _owners(local: list[int], ranks: int, groups: list[list[int]]) -> list[int]:
    """torch ZeroRedundancyOptimizer's assignment (_partition_parameters): param group by param group, each
    group's tensors largest first (a stable sort: ties in the group's order) to the least-loaded rank so far (the
    first such), the loads carried over from group to group. `groups`: indices into `local`, in group order."""
    sizes, owner = [0] * ranks, [0] * len(local)
    for group in groups:
        for i in sorted(group, key=lambda i: -local[i]):
            r = sizes.index(min(sizes))
            owner[i], sizes[r] = r, sizes[r] + local[i]
    return owner


def _decay_groups(idx: list[int], one_d: list[bool]) -> list[list[int]]:
    """build_optimizer's groups (optim.groups.param_groups: 1-D tensors without weight decay, the rest with), in
    the order of their first tensor."""
    groups: dict = {}
    for i in idx:
        groups.setdefault(one_d[i], []).append(i)
    return list(groups.values())


def save_report(plan: "Plan", *, moments: int = 2, replicas: int = 0, bytes_per_value: int = 4) -> Optional[dict]:
    """Per rank (global rank order): bytes of fp32 weights and optimizer moments it writes, and the extra memory it
    holds during the save; None when the YAML has no model shape."""
    from .writers import writes

    cfg, mesh = plan.config, plan.mesh
    if cfg.model.hidden_size is None or cfg.model.vocab_size is None or cfg.model.num_heads is None:
        return None
    dpc, tp, ep = mesh.dp * mesh.cp, mesh.tp, plan.expert_parallel
    sizes = {"dp_cp": dpc, "tp": tp, "ep": ep, "edp": dpc * tp // ep}
    zero, pipeline = plan.zero.stage > 0 and dpc > 1, mesh.pp > 1
    ranks = []
    for stage in range(mesh.pp):
        tensors, flat = _stage_tensors(plan, stage)
        local = [n // tp if g == _TP else n for n, g in tensors]  # experts: whole, E/ep of them listed
        one_d = [i in flat for i in range(len(tensors))]
        owners = {}
        if pipeline and zero:  # dense over dp x cp, experts over edp (pipeline.zero), each in decay groups
            for group in (_REPLICATED, _EP):
                idx = [i for i, (_, g) in enumerate(tensors) if (g == _EP) == (group == _EP)]
                owned = _owners(local, sizes["edp" if group == _EP else "dp_cp"], _decay_groups(idx, one_d))
                owners.update((i, owned[i]) for i in idx)
        for j in range(dpc * tp):
            at = {"dp_cp": j // tp, "tp": j % tp, "ep": j % ep, "edp": j // ep}
            lay = _RankLayout(sizes, at)
            wrote = [i for i, (_, g) in enumerate(tensors) if writes(lay, _Shard(g), i, owners.get(i))]
            weights = sum(local[i] for i in wrote) * bytes_per_value
            peak = weights * (1 + moments)
            if zero and not pipeline:  # the snapshot of its ZeRO partition (checkpoint.zero_stage), one rebuilt
                peak += (-(-sum(local) // dpc) + max(local)) * bytes_per_value * (1 + moments)
            ranks.append({"stage": stage, "weights": weights, "optimizer": weights * moments,
                          "peak_extra": peak + (2 * _mirror_block() if replicas else 0)})
    for r in ranks:
        r["file"] = r["weights"] + r["optimizer"]
    total = sum(r["file"] for r in ranks)
    return {"ranks": ranks, "total": total * (1 + replicas), "largest_file": max(r["file"] for r in ranks),
            "replicas": replicas, "moments": moments}


def _mirror_block() -> int:
    from .replicas import MIRROR_BLOCK

    return MIRROR_BLOCK


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def format_save_report(plan: "Plan", report: Optional[dict]) -> str:
    if report is None:
        return "checkpoint save (engine.save, sharded)  unknown: the YAML gives no model shape"
    rows = report["ranks"]
    note = []
    out = [f"checkpoint save (engine.save, sharded; fp32 weights + {report['moments']} optimizer moments)",
           f"  whole state on disk                   {_gib(report['total'])}"]
    for key, label in (("weights", "weights written / rank"), ("optimizer", "optimizer written / rank"),
                       ("peak_extra", "peak extra memory / rank")):
        vals = [r[key] for r in rows]
        big = max(range(len(vals)), key=vals.__getitem__)
        out.append(f"  {label:37} min {_gib(min(vals))}, max {_gib(vals[big])} (rank {big}, stage {rows[big]['stage']})")
    out.append(f"  largest file                          {_gib(report['largest_file'])} (one per rank)")
    return "\n".join(out + note)
