"""The pipeline schedule a plan runs, as a table of timed blocks per pipeline rank, and its picture.

The per-rank order of actions is what torch.distributed.pipelining's schedule classes (those of
pipeline/schedule.py) execute: for the multi-stage ones (interleaved 1F1B, looped BFS, ZBV) their own
`pipeline_order` code, evaluated without a process group (a pure function of pp, virtual stages and micro-batches);
for Schedule1F1B / ScheduleGPipe the order of their _step_microbatches loop. Times come from replaying that
order with unit costs (F = B = 1, or F = I = W = 1 for split backward) and the data dependencies between
stages: forward of stage s waits for stage s-1, backward of stage s waits for stage s+1 and its own forward,
the weight gradient W waits for the input gradient I.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

COST = {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
COLOURS = {"F": "#3b75af", "B": "#4f9d4f", "I": "#4f9d4f", "W": "#d9822b"}


@dataclass(frozen=True)
class Block:
    rank: int
    stage: int
    kind: str  # F | B | I | W
    microbatch: int
    start: float
    end: float


@dataclass
class ScheduleTable:
    """Who does what when. actions[rank]: (stage, kind, micro-batch) in execution order (torch's order)."""

    name: str
    pp: int
    n_stages: int
    micro_batches: int
    actions: dict[int, list[tuple[int, str, int]]]
    blocks: dict[int, list[Block]] = field(default_factory=dict)
    makespan: float = 0.0
    bubble: float = 0.0  # idle / (pp x makespan)
    source: str = "torch.distributed.pipelining"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "pp": self.pp, "n_stages": self.n_stages, "micro_batches": self.micro_batches,
                "makespan": self.makespan, "bubble": self.bubble, "source": self.source,
                "actions": {r: [f"{s}{k}{m}" for s, k, m in a] for r, a in self.actions.items()}}


def stage_rank(name: str, stage: int, pp: int) -> int:
    """Pipeline rank holding `stage`: looped (stage % pp), or V-shaped for zero_bubble_v."""
    if name == "zero_bubble_v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _single_order(name: str, pp: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """GPipe / 1F1B as their _step_microbatches run them: 1F1B warms up with min(m, pp - rank) forwards, then
    alternates backward, forward, then drains. (torch's descriptive Schedule1F1B._get_pipeline_order table is not
    what runs: it starts the last rank at micro-batch 1 in torch 2.13.)"""
    out = {}
    for r in range(pp):
        if name == "gpipe":
            out[r] = [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)]
            continue
        warm = min(m, pp - r)
        acts = [(r, "F", i) for i in range(warm)]
        for i in range(m):
            acts.append((r, "B", i))
            if warm + i < m:
                acts.append((r, "F", warm + i))
        out[r] = acts
    return out


def _torch_order(name: str, pp: int, vpp: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    from torch.distributed.pipelining import schedules as S

    cls = {"interleaved_1f1b": S.ScheduleInterleaved1F1B, "looped_bfs": S.ScheduleLoopedBFS,
           "zero_bubble_v": S.ScheduleZBVZeroBubble}[name]
    # multi-stage schedules run their pipeline_order table; these are the attributes their __init__ sets before it
    # fills it (none depends on the rank)
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, n_local_stages=vpp, _stages=[None] * vpp,
                           num_stages=pp * vpp, _num_stages=pp * vpp)
    if name == "interleaved_1f1b":
        fake.number_of_rounds = max(1, m // pp)
        fake.microbatches_per_round = m // fake.number_of_rounds
        if m % fake.number_of_rounds:
            raise ValueError(f"interleaved 1F1B needs micro_batch_num ({m}) to be a multiple of "
                             f"{fake.number_of_rounds} (micro_batch_num // pipeline_stage)")
    order = {r: cls._calculate_single_rank_operations(fake, r) for r in range(pp)}
    return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.value in COST] for r, acts in order.items()}


def _deps(stage: int, kind: str, mb: int, n_stages: int) -> list[tuple[int, str, int]]:
    # "G": the input gradient of (stage, mb) exists, whether a full backward B or a split I made it
    if kind == "F":
        return [(stage - 1, "F", mb)] if stage else []
    if kind == "W":
        return [(stage, "G", mb)]
    return [(stage, "F", mb)] + ([(stage + 1, "G", mb)] if stage < n_stages - 1 else [])


def simulate(table: ScheduleTable, costs: Optional[dict[str, float]] = None) -> ScheduleTable:
    """Replay each rank's order: an action starts when the rank is free and its inputs exist (costs: per kind,
    default unit costs)."""
    costs = {**COST, **(costs or {})}
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in table.actions}
    clock = {r: 0.0 for r in table.actions}
    blocks: dict[int, list[Block]] = {r: [] for r in table.actions}
    moved = True
    while moved:
        moved = False
        for r, acts in table.actions.items():
            while pos[r] < len(acts):
                s, k, mb = acts[pos[r]]
                deps = _deps(s, k, mb, table.n_stages)
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                end = start + costs[k]
                done[(s, "G" if k in "BI" else k, mb)] = clock[r] = end
                blocks[r].append(Block(r, s, k, mb, start, end))
                pos[r] += 1
                moved = True
    stuck = {r: table.actions[r][pos[r]] for r in table.actions if pos[r] < len(table.actions[r])}
    if stuck:
        raise RuntimeError(f"schedule {table.name} deadlocks at (stage, kind, micro-batch) {stuck}")
    table.blocks = blocks
    table.makespan = max(clock.values(), default=0.0)
    busy = sum(b.end - b.start for bl in blocks.values() for b in bl)
    table.bubble = 1.0 - busy / (table.pp * table.makespan) if table.makespan else 0.0
    return table


def schedule_table(plan: Any, costs: Optional[dict[str, float]] = None) -> ScheduleTable:
    """The plan's pipeline schedule, timed (unit costs unless `costs` says otherwise, e.g. B = 2 when a backward
    does the input and the weight gradient). pp = 1: one rank doing gradient_accumulation_steps F, B pairs."""
    pp = plan.mesh.pp
    if pp == 1:
        m = plan.gradient_accumulation_steps
        acts = {0: [a for i in range(m) for a in ((0, "F", i), (0, "B", i))]}
        return simulate(ScheduleTable("none", 1, 1, m, acts, source="no pipeline"), costs)
    name, vpp, m = plan.pp_schedule, plan.pp_virtual_stages, plan.micro_batch_num
    if name in ("1f1b", "gpipe"):
        loop = f"torch Schedule{'1F1B' if name == '1f1b' else 'GPipe'}'s loop"
        order, source = _single_order(name, pp, m), loop
    else:
        order, source = _torch_order(name, pp, vpp, m), "torch pipeline_order"
    return simulate(ScheduleTable(name, pp, pp * vpp, m, order, source=source), costs)


def _label_step(n_units: float, width_in: float) -> int:
    """Label every k-th micro-batch so that labels (about 0.22 inch each) do not overlap: a window of k units can
    hold a labelled forward and a labelled backward."""
    per_unit = width_in / max(n_units, 1.0)
    k = 1
    while per_unit * k < (0.22 if k == 1 else 0.5):
        k *= 2
    return k


def _shade(colour: str, chunk: int, n_chunks: int) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    rgb = to_rgb(colour)
    mix = 0.55 * chunk / max(n_chunks - 1, 1)  # later virtual chunks lighter
    return tuple(c + (1 - c) * mix for c in rgb)


def _chunk(name: str, stage: int, pp: int) -> int:
    return int(stage >= pp) if name == "zero_bubble_v" else stage // pp


def draw_blocks(ax, blocks: dict[int, list[Block]], pp: int, makespan: float, *, name: str = "", n_chunks: int = 1,
                label_every: int = 1) -> list:
    """One row per pipeline rank (rank 0 on top), idle time hatched, blocks coloured by kind, later virtual chunks
    lighter, micro-batch numbers (every label_every-th; none for negative ones). Returns the legend handles."""
    from matplotlib.patches import Patch

    for r in range(pp):
        y = pp - 1 - r
        ax.barh(y, makespan, left=0, height=0.8, color="#eeeeee", hatch="///", edgecolor="#c8c8c8", linewidth=0)
        for b in blocks.get(r, []):
            chunk = _chunk(name, b.stage, pp)
            ax.barh(y, b.end - b.start, left=b.start, height=0.8, color=_shade(COLOURS[b.kind], chunk, n_chunks),
                    edgecolor="white", linewidth=0.6)
            if b.microbatch >= 0 and b.microbatch % label_every == 0:
                ax.text((b.start + b.end) / 2, y, str(b.microbatch), ha="center", va="center", fontsize=7,
                        color="white" if chunk == 0 else "black")
    stages = {r: sorted({b.stage for b in blocks.get(r, [])}) for r in range(pp)}
    labels = [f"pp rank {r}" + (f"\nstages {stages[r]}" if n_chunks > 1 else "") for r in range(pp)]
    ax.set_yticks(range(pp))
    ax.set_yticklabels(labels[::-1], fontsize=8)
    ax.set_xlim(0, makespan)
    ax.set_ylim(-0.6, pp - 0.4)
    kinds = sorted({b.kind for bl in blocks.values() for b in bl}, key="FBIW".index)
    handles = [Patch(color=COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    if n_chunks > 1:
        handles.append(Patch(color=_shade("#777777", n_chunks - 1, n_chunks), label="lighter: later virtual chunk"))
    handles.append(Patch(facecolor="#eeeeee", hatch="///", edgecolor="#c8c8c8", label="idle (bubble)"))
    return handles


def draw_schedule(plan: Any, path: Path | str) -> ScheduleTable:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = schedule_table(plan)
    n_chunks = t.n_stages // t.pp
    width = min(24.0, max(9.0, 2.5 + 0.2 * t.makespan))
    height = max(3.2, 1.9 + 0.55 * t.pp)  # pp = 1 still gets a readable strip
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    step = _label_step(t.makespan, width - 2.5)
    handles = draw_blocks(ax, t.blocks, t.pp, t.makespan, name=t.name, n_chunks=n_chunks, label_every=step)
    ax.set_xlabel("time (units: one forward of one micro-batch on one stage)")
    kinds = {b.kind for bl in t.blocks.values() for b in bl}
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.75 / (height - 1.3)), ncol=len(handles),
              fontsize=8, frameon=False)
    costs = "F = I = W = 1" if "W" in kinds else "F = B = 1"
    mb_note = f"numbers: micro-batch{'' if step == 1 else f' (every {step}th labelled)'}"
    if t.pp == 1:
        title = (f"no pipeline (pipeline_stage 1): {t.micro_batches} gradient accumulation step(s), "
                 f"each a forward and a backward; bubble 0\n{mb_note}")
    else:
        chunks = f" x {n_chunks} virtual chunks" if n_chunks > 1 else ""
        title = (f"pipeline schedule {t.name}: pp {t.pp}{chunks}, {t.micro_batches} micro-batches; bubble "
                 f"{t.bubble:.1%} (idle / total rank-time, unit costs {costs})\n{mb_note}; order from {t.source}")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # keeps the legend below the axis in the file
    plt.close(fig)
    return t


def draw_timelines(panels: list[tuple[str, ScheduleTable]], path: Path | str, *, unit: str = "s") -> None:
    """Several schedule tables stacked (e.g. a measured run's timeline above the theory for the same schedule),
    each panel on its own time axis in `unit`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = max(t.pp for _, t in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 0.9 + len(panels) * (0.8 + 0.45 * pp)), dpi=100,
                             squeeze=False)
    handles: dict = {}
    for ax, (title, t) in zip(axes[:, 0], panels):
        for h in draw_blocks(ax, t.blocks, t.pp, t.makespan, name=t.name, n_chunks=max(t.n_stages // t.pp, 1),
                             label_every=10 ** 9):
            handles.setdefault(h.get_label(), h)  # every panel's kinds, once
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlabel(unit, fontsize=8)
    axes[0, 0].legend(handles=list(handles.values()), loc="lower right", bbox_to_anchor=(1.0, 1.02), ncol=len(handles),
                      fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
