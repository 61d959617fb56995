"""The search space: every layout MindFormers' rules accept for a model on N devices, each as a MindFormers YAML dict.

Structure (enumerated, then checked by load_config + make_plan, so "valid" is what `msparallel-ds validate`
accepts): dp x tp x cp x pp = world (degrees are divisors of the world size); use_seq_parallel on/off (tp > 1);
context_parallel_algo colossalai_cp with use_ring_attention (ring), ulysses_cp, hybrid_cp with every proper
ulysses_degree_in_cp; pipeline (pp > 1) as 1F1B or GPipe with pp_interleave_num 1 (and 1F1B with 2 and 4 virtual
chunks), or zero_bubble_v (2 chunks); micro-batch size 1, 2, 4 (micro_batch_num = rows per dp rank / size, pp > 1)
or gradient accumulation (pp = 1, micro-batch size up to 8); micro_batch_interleave_num 1 or 2; expert_parallel
(MoE only) over the divisors of dp x cp x tp that divide the expert count. Per structure the knobs that MindFormers'
rules do not constrain are costed without another make_plan: the parallel optimizer level (off, level1..3 ->
ZeRO 0..3; what the engine runs: see zero_levels) through the plan's memory estimate, and recompute (off, the
first half of each stage's layers, all).

Cheap pruning before make_plan (counted under `pruned`): heads % tp (kv heads split or replicated evenly), layers
>= pp x vpp, seq % (2 x cp), global batch % (dp x micro_batch_interleave_num). seqpipe/seqvpp run as 1F1B here
(same math), so they are not enumerated; select_recompute is not either (the memory estimate does not credit it, so
it could only ever cost time).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Iterator, Optional

from .model import ModelSpec

SCHEDULES = ((1, "1f1b"), (1, "gpipe"), (2, "1f1b"), (4, "1f1b"), (2, "zero_bubble_v"))  # (vpp, scheduler)
RECOMPUTE = ("none", "half", "full")
ZERO_LEVELS = {1: "level1", 2: "level2", 3: "level3"}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    cp: int
    pp: int
    sp: bool = False
    cp_algo: Optional[str] = None    # ring | ulysses | hybrid (cp > 1)
    ulysses: int = 1                 # Ulysses part of cp
    vpp: int = 1
    schedule: Optional[str] = None   # 1f1b | gpipe | zero_bubble_v (pp > 1)
    micro_batch: int = 1             # runner_config.batch_size
    micro_batches: int = 1           # micro_batch_num (pp > 1) or gradient_accumulation_steps (pp = 1)
    mbi: int = 1                     # micro_batch_interleave_num
    ep: int = 1
    zero: int = 0
    recompute: str = "none"          # none | half | full

    def label(self) -> str:
        pp = f"pp{self.pp}({'v%d,' % self.vpp if self.vpp > 1 else ''}{self.schedule})" if self.pp > 1 else "pp1"
        cp = f"cp{self.cp}" + (f"({self.cp_algo}{self.ulysses if self.cp_algo == 'hybrid' else ''})"
                               if self.cp > 1 else "")
        parts = [pp, f"dp{self.dp}", cp, f"tp{self.tp}" + ("+SP" if self.sp else "")]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"ZeRO{self.zero}")
        parts.append({"none": "", "half": "rc-half", "full": "rc"}[self.recompute])
        parts.append(f"mb{self.micro_batch}x{self.micro_batches}" + (f" mbi{self.mbi}" if self.mbi > 1 else ""))
        return " ".join(p for p in parts if p)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _meshes(spec: ModelSpec, world: int, pruned: dict, max_tp: int) -> Iterator[tuple[int, int, int, int]]:
    degs = divisors(world)
    if len(degs) > 24:  # keep a huge or odd world size bounded: powers of two and the world's own factors
        degs = [d for d in degs if _pow2(d)] or degs[:24]
    for tp in degs:
        if tp > max_tp:  # tensor parallel across nodes: never competitive, and it bounds a large search
            pruned["tp > devices per node"] = pruned.get("tp > devices per node", 0) + 1
            continue
        if spec.heads % tp or (spec.kv_heads % tp and tp % spec.kv_heads):
            pruned["heads % tp"] = pruned.get("heads % tp", 0) + 1
            continue
        for cp in degs:
            if world % (tp * cp):
                continue
            if cp > 1 and spec.seq_length % (2 * cp):
                pruned["seq % 2cp"] = pruned.get("seq % 2cp", 0) + 1
                continue
            for pp in degs:
                if world % (tp * cp * pp):
                    continue
                if spec.layers < pp:
                    pruned["layers < pp"] = pruned.get("layers < pp", 0) + 1
                    continue
                yield world // (tp * cp * pp), tp, cp, pp


def _cp_options(spec: ModelSpec, tp: int, cp: int) -> list[tuple[Optional[str], int]]:
    if cp == 1:
        return [(None, 1)]
    out = [("ring", 1)]
    for u in divisors(cp)[1:]:
        shards = tp * u
        if spec.heads % shards or (spec.kv_heads % shards and shards % spec.kv_heads):
            continue
        out.append(("ulysses", u) if u == cp else ("hybrid", u))
    return out


def _batches(spec: ModelSpec, dp: int, pp: int, mbi: int) -> list[tuple[int, int]]:
    """(micro-batch size, micro_batch_num or gradient accumulation steps) that make the global batch exactly."""
    rows, rem = divmod(spec.global_batch, dp * mbi)
    if rem or rows == 0:
        return []
    sizes = (1, 2, 4) if pp > 1 else (1, 2, 4, 8)
    return [(b, rows // b) for b in sizes if rows % b == 0 and (pp == 1 or rows // b >= pp)]


@dataclass(frozen=True)
class Kept:
    """What MindSpore's auto_parallel (parallel_mode 2) does not search, so the YAML's values stay: the pipeline
    (pipeline_stage, virtual chunks, scheduler), micro_batch_num (pp > 1) or gradient_accumulation_steps (pp = 1),
    and micro_batch_interleave_num; with the global batch they fix the micro-batch size for each dp."""

    pp: int
    vpp: int
    schedule: Optional[str]
    micro_batches: int
    mbi: int


def _kept_batches(spec: ModelSpec, dp: int, kept: Kept) -> list[tuple[int, int]]:
    rows, rem = divmod(spec.global_batch, dp * kept.mbi * kept.micro_batches)
    return [] if rem or rows == 0 else [(rows, kept.micro_batches)]


def structures(spec: ModelSpec, world: int, pruned: dict, max_tp: int = 8,
               kept: Optional[Kept] = None) -> Iterator[Layout]:
    """Every structural layout (ZeRO 0, no recompute) that passes the cheap checks (only those with `kept`'s
    pipeline and batch split when given)."""
    for dp, tp, cp, pp in _meshes(spec, world, pruned, max_tp):
        if kept is not None and pp != kept.pp:
            continue
        eps = [1]
        if spec.moe:
            eps = [e for e in divisors(dp * cp * tp) if spec.experts % e == 0 and _pow2(e)] or [1]
        scheds = [(1, None)] if pp == 1 else [(v, s) for v, s in SCHEDULES if spec.layers >= pp * v]
        if kept is not None:
            scheds = [(1, None)] if pp == 1 else [(kept.vpp, kept.schedule)]
        elif pp > 1 and len(scheds) < len(SCHEDULES):
            pruned["layers < pp x vpp"] = pruned.get("layers < pp x vpp", 0) + len(SCHEDULES) - len(scheds)
        for sp in ((False, True) if tp > 1 else (False,)):
            for algo, u in _cp_options(spec, tp, cp):
                for vpp, sched in scheds:
                    for mbi in ((1, 2) if kept is None else (kept.mbi,)):
                        batches = _batches(spec, dp, pp, mbi) if kept is None else _kept_batches(spec, dp, kept)
                        if not batches:
                            pruned["global batch % (dp x mbi)"] = pruned.get("global batch % (dp x mbi)", 0) + 1
                        for b, m in batches:
                            for ep in eps:
                                yield Layout(dp=dp, tp=tp, cp=cp, pp=pp, sp=sp, cp_algo=algo, ulysses=u, vpp=vpp,
                                             schedule=sched, micro_batch=b, micro_batches=m, mbi=mbi, ep=ep)


def zero_levels(lay: Layout) -> tuple[int, ...]:
    """Optimizer levels worth trying; level3 (ZeRO-3) only where the engine runs it (runtime.py refuses it with
    tp, cp or ep > 1), level2/3 not with pp > 1, so nothing suggested fails or silently changes at initialize."""
    if lay.dp * lay.cp == 1:
        return (0,)
    if lay.pp > 1:  # the pipeline engine runs level2/3 as level1 (pipeline/engine.py): the estimate would lie
        return (0, 1)
    return (0, 1, 2, 3) if lay.tp == lay.cp == lay.ep == 1 else (0, 1, 2)


def _offset(layers: int, pp: int, vpp: int):
    """MindFormers' offset that spreads layers % (pp x vpp) over the middle stages (the first stage holds the
    embedding, the last the head), one extra layer each; 0 when the split is even."""
    rem = layers % (pp * vpp)
    if rem == 0:
        return 0
    grid = [[0] * pp for _ in range(vpp)]
    order = [(i, j) for j in list(range(1, pp)) + [0] for i in range(vpp)]
    for i, j in order[:rem]:
        grid[i][j] += 1
    return grid[0] if vpp == 1 else grid


def to_yaml(spec: ModelSpec, lay: Layout) -> dict:
    """The candidate as a MindFormers YAML dict: the model's base YAML with the parallel keys replaced."""
    y = copy.deepcopy(spec.base)
    y.pop("parallelism", None)  # it would win over parallel_config
    y.pop("swap_config", None)
    pc = {"data_parallel": lay.dp, "model_parallel": lay.tp, "context_parallel": lay.cp, "pipeline_stage": lay.pp,
          "expert_parallel": lay.ep, "use_seq_parallel": lay.sp, "micro_batch_num": lay.micro_batches if lay.pp > 1
          else 1, "vocab_emb_dp": lay.tp == 1}  # vocab-parallel embedding and head when tp > 1
    old = spec.base.get("parallel_config") or {}
    if isinstance(old, dict) and old.get("gradient_aggregation_group"):
        pc["gradient_aggregation_group"] = old["gradient_aggregation_group"]
    if lay.cp > 1:
        pc["context_parallel_algo"] = {"ring": "colossalai_cp", "ulysses": "ulysses_cp", "hybrid": "hybrid_cp"}[
            lay.cp_algo]
        if lay.cp_algo == "hybrid":
            pc["ulysses_degree_in_cp"] = lay.ulysses
    y["parallel_config"] = pc
    par = {k: v for k, v in (y.get("parallel") or {}).items() if k not in (
        "parallel_mode", "enable_parallel_optimizer", "parallel_optimizer_config", "pipeline_config")}
    par["parallel_mode"] = 1
    par["enable_parallel_optimizer"] = lay.zero > 0
    if lay.zero:
        par["parallel_optimizer_config"] = {"optimizer_level": ZERO_LEVELS[lay.zero]}
    if lay.pp > 1:
        par["pipeline_config"] = {"pipeline_interleave": lay.vpp > 1, "pipeline_scheduler": lay.schedule}
    y["parallel"] = par
    y["micro_batch_interleave_num"] = lay.mbi
    y["recompute_config"] = {"recompute": _recompute_value(spec, lay), "select_recompute": False,
                             "select_comm_recompute": False}
    rc = dict(y.get("runner_config") or {})
    rc.update(batch_size=lay.micro_batch, gradient_accumulation_steps=lay.micro_batches if lay.pp == 1 else 1)
    y["runner_config"] = rc
    mc = y.setdefault("model", {}).setdefault("model_config", {})
    mc.update(pp_interleave_num=lay.vpp, offset=_offset(spec.layers, lay.pp, lay.vpp), fine_grain_interleave=1,
              use_ring_attention=lay.cp_algo == "ring", seq_length=spec.seq_length)
    if lay.cp > 1:
        mc["use_flash_attention"] = True
    return y


def _recompute_value(spec: ModelSpec, lay: Layout):
    if lay.recompute == "full":
        return True
    if lay.recompute == "half":
        return [max(spec.layers // lay.pp // 2, 1)] * lay.pp  # first half of each stage's layers
    return False


def with_knobs(lay: Layout, zero: int, recompute: str) -> Layout:
    return replace(lay, zero=zero, recompute=recompute)
