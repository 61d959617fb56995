"""The search: enumerate (space.py), keep what load_config + make_plan accept and what fits in memory, cost
(cost.py), rank. Memory is the plan's own estimate (memory.py: max over pipeline stages) against
device memory x headroom (0.9 by default: the estimate leaves out buffers, fragmentation and communication scratch)."""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ..config.errors import ConfigError
from ..config.mindformers import load_config
from ..memory import estimate_memory
from ..plan import Plan, make_plan
from .cost import Links, step_cost, why
from .model import ModelSpec, read_model
from .space import RECOMPUTE, Kept, Layout, structures, to_yaml, with_knobs, zero_levels

GIB = float(1 << 30)
HEADROOM = 0.9


@dataclass
class Candidate:
    layout: Layout
    step_time: float
    costs: dict[str, float]
    memory_gib: float
    tokens_per_s: float
    why: str
    plan: Optional[Plan] = field(default=None, repr=False)
    spec: Optional[ModelSpec] = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return self.layout.label()

    def yaml(self) -> dict:
        return to_yaml(self.spec, self.layout)

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"layout": self.label, "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s,
                "memory_gib_per_rank": self.memory_gib, "why": self.why, "breakdown_s": self.costs,
                "degrees": {"dp": lay.dp, "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "ep": lay.ep, "vpp": lay.vpp,
                            "sp": lay.sp, "cp_algo": lay.cp_algo, "ulysses": lay.ulysses, "schedule": lay.schedule,
                            "micro_batch_size": lay.micro_batch, "micro_batches": lay.micro_batches,
                            "micro_batch_interleave_num": lay.mbi, "zero": lay.zero, "recompute": lay.recompute}}


@dataclass
class SearchResult:
    candidates: list[Candidate]  # kept, best first
    counts: dict[str, Any]
    spec: ModelSpec
    world_size: int
    device_memory_gib: float


def _reason(exc: ConfigError) -> str:
    i = exc.issues[0]
    return f"{i.key}: {i.rule}"[:110]


def _plan(spec: ModelSpec, lay: Layout, world: int) -> Plan:
    return make_plan(load_config(to_yaml(spec, lay)), world_size=world)


def evaluate(spec: ModelSpec, lay: Layout, world: int, links: Links, budget_gib: float = float("inf"),
             plan: Optional[Plan] = None) -> Candidate:
    """Cost one layout (raises ConfigError when MindFormers' rules reject it)."""
    plan = plan or _plan(spec, lay, world)
    costs = step_cost(spec, lay, plan, links)
    mem = plan.memory.total_gib if plan.memory else float("nan")
    tokens = spec.global_batch * spec.seq_length
    return Candidate(lay, costs["total"], costs, mem, tokens / costs["total"], why(costs), plan, spec)


def search(spec: ModelSpec, world: int, device_memory_bytes: float, links: Links = Links(),
           headroom: float = HEADROOM, keep_all: bool = False, fixed: Optional[Kept] = None) -> SearchResult:
    if not spec.global_batch:
        raise ConfigError([_issue("global_batch_size", None, "is needed (the model file does not give it)",
                                  "pass --global-batch-size")])
    budget = device_memory_bytes * headroom / GIB
    pruned: dict[str, int] = {}
    invalid: Counter = Counter()
    counts = {"structures": 0, "enumerated": 0, "invalid_by_rule": 0, "over_memory": 0, "kept": 0}
    kept: list[Candidate] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for base in structures(spec, world, pruned, max(links.devices_per_node, 1), fixed):
            counts["structures"] += 1
            zs = zero_levels(base)
            for rc in RECOMPUTE:
                lay = with_knobs(base, 0, rc)
                counts["enumerated"] += len(zs)
                try:
                    plan = _plan(spec, lay, world)
                except ConfigError as exc:
                    counts["invalid_by_rule"] += len(zs)
                    invalid[_reason(exc)] += len(zs)
                    continue
                for z in zs:
                    # the optimizer level changes no rule and no other plan field memory.py reads: reuse the plan
                    pz = replace(plan, zero=replace(plan.zero, stage=z))
                    pz = replace(pz, memory=estimate_memory(pz))
                    lz = with_knobs(base, z, rc)
                    if pz.memory is None or pz.memory.total_gib > budget:
                        counts["over_memory"] += 1
                        continue
                    kept.append(evaluate(spec, lz, world, links, budget, pz))
    kept.sort(key=lambda cand: (cand.step_time, cand.memory_gib))
    counts["kept"] = len(kept)
    counts["pruned"] = pruned
    counts["invalid_reasons"] = dict(invalid.most_common(8))
    counts["memory_budget_gib"] = budget
    return SearchResult(kept, counts, spec, world, device_memory_bytes / GIB)


def _issue(key, value, rule, fix):
    from ..config.errors import ConfigIssue

    return ConfigIssue(key, value, rule, fix)


def suggest(model: Any, world_size: int, device_memory_bytes: float, seq_length: Optional[int] = None,
            global_batch_size: Optional[int] = None, links: Links = Links(), headroom: float = HEADROOM,
            top: Optional[int] = None) -> list[Candidate]:
    """The valid layouts that fit, best (lowest predicted step time) first. `model`: an HF config.json or a
    MindFormers YAML (path or dict) or a ModelSpec. Each Candidate has .yaml() (a MindFormers YAML dict)."""
    spec = model if isinstance(model, ModelSpec) else read_model(model, seq_length, global_batch_size)
    res = search(spec, world_size, device_memory_bytes, links, headroom)
    return res.candidates[:top] if top else res.candidates


def cost_of_yaml(source: Any, links: Links = Links(), world_size: Optional[int] = None,
                 seq_length: Optional[int] = None) -> Candidate:
    """Cost a hand-written MindFormers YAML with the same model (for comparing suggest's choice against it)."""
    from .model import _read

    data, _ = _read(source)
    spec = read_model(data, seq_length)
    if seq_length:
        data.setdefault("model", {}).setdefault("model_config", {})["seq_length"] = seq_length
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(load_config(data), world_size=world_size)
    m = plan.mesh
    lay = Layout(dp=m.dp, tp=m.tp, cp=m.cp, pp=m.pp, sp=plan.sequence_parallel,
                 cp_algo={"allgather": "ring"}.get(plan.cp_algo, plan.cp_algo), ulysses=m.cp_ulysses,
                 vpp=plan.pp_virtual_stages, schedule=plan.pp_schedule and plan.config.parallel.pipeline_config.
                 pipeline_scheduler, micro_batch=plan.micro_batch_size,
                 micro_batches=plan.micro_batch_num if m.pp > 1 else plan.gradient_accumulation_steps,
                 mbi=plan.micro_batch_interleave_num, ep=plan.expert_parallel, zero=plan.zero.stage,
                 recompute={"full": "full", "layers": "half"}.get(plan.recompute.mode, "none"))
    spec = replace(spec, global_batch=plan.global_batch_size)
    return evaluate(spec, lay, plan.world_size, links, plan=plan)


def resolve_auto_parallel(cfg_or_yaml: Any, world_size: Optional[int] = None, device_memory_bytes: float = 80 * GIB,
                          links: Links = Links()) -> tuple[dict, str]:
    """MindFormers' parallel_mode: 2 (auto_parallel): MindSpore searches operator sharding only (mindspore
    auto_parallel with its sharding propagation / recursive programming), and the pipeline comes from the
    parallel context as written. So the YAML's pipeline_stage, pipeline schedule (pp_interleave_num,
    pipeline_scheduler, offset), micro_batch_num / gradient_accumulation_steps, micro_batch_interleave_num and global
    batch stay, and suggest searches the rest (dp, tp, cp, SP, ep, ZeRO level, recompute). Returns (the chosen
    MindFormers YAML dict, a one-line note). The world size defaults to the YAML's degrees' product."""
    from .model import _read, hand_written_world

    if hasattr(cfg_or_yaml, "source") and hasattr(cfg_or_yaml, "parallel_config"):
        raise TypeError("resolve_auto_parallel needs the YAML (path or dict), not a loaded ParallelConfig: "
                        "it rewrites the YAML's parallel keys")
    data, _ = _read(cfg_or_yaml)
    world = world_size or hand_written_world(data)
    spec = read_model(data)
    kept = _kept(data)
    res = search(spec, world, device_memory_bytes, links, fixed=kept)
    what = (f"pipeline_stage={kept.pp}" + (f", {kept.schedule} x{kept.vpp}, micro_batch_num={kept.micro_batches}"
                                           if kept.pp > 1 else f", gradient_accumulation_steps={kept.micro_batches}")
            + f", micro_batch_interleave_num={kept.mbi}, global batch {spec.global_batch}")
    if not res.candidates:
        raise ConfigError([_issue("parallel.parallel_mode", "auto_parallel", f"no layout of {world} devices with the "
                                  f"YAML's {what} (kept: MindSpore's auto_parallel searches operator sharding only) "
                                  f"fits {device_memory_bytes / GIB:.0f} GiB",
                                  "use more devices, another pipeline_stage / micro_batch_num, or a smaller batch")])
    best = res.candidates[0]
    chosen = best.yaml()
    if kept.pp > 1:  # the YAML's own pipeline section and layer offsets, as MindSpore keeps them
        pipeline = (data.get("parallel") or {}).get("pipeline_config")
        offset = ((data.get("model") or {}).get("model_config") or {}).get("offset")
        if pipeline is not None:
            chosen["parallel"]["pipeline_config"] = pipeline
        if offset is not None:
            chosen["model"]["model_config"]["offset"] = offset
    note = (f"parallel_mode auto_parallel: suggest chose {best.label} out of {res.counts['kept']} layouts that fit "
            f"(predicted {best.step_time:.3g} s/step, {best.memory_gib:.1f} GiB/rank), keeping the YAML's {what}")
    return chosen, note


def _kept(data: dict) -> Kept:
    """The YAML's pipeline and batch split (read through load_config, degrees as written)."""
    from ..config.rules import virtual_stages

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(data)
    pp = cfg.pp
    return Kept(pp=pp, vpp=virtual_stages(cfg) if pp > 1 else 1,
                schedule=cfg.parallel.pipeline_config.pipeline_scheduler if pp > 1 else None,
                micro_batches=cfg.parallel_config.micro_batch_num if pp > 1 else
                cfg.runner_config.gradient_accumulation_steps, mbi=cfg.micro_batch_interleave_num)
