"""Picture of the device mesh: every rank a cell, one panel per pipeline stage, dp rows x (cp x tp) columns.

The rank of each coordinate is torch.arange(world).view(pp, dp, cp_ring, cp_ulysses, tp), exactly the tensor
init_device_mesh builds for ParallelLayout's DeviceMesh (dims distributed.layout.MESH_DIMS, outermost first).
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

MAX_STAGES = 4  # panels drawn before a large world is cut to a representative slice
MAX_ROWS = 4
MAX_COLS = 16
TP_COLOURS = ["#cfe3f7", "#fbd9b5", "#cdebc5", "#f4c7d0", "#e0d4f0", "#f7efb2", "#cfeeee", "#e6d2c3"]


def rank_grid(plan: Any):
    """Global ranks as a (pp, dp, cp_ring, cp_ulysses, tp) tensor, in ParallelLayout's DeviceMesh order."""
    import torch

    from ..distributed.layout import MESH_DIMS

    shape = tuple(getattr(plan.mesh, d) for d in MESH_DIMS)
    return torch.arange(math.prod(shape)).view(shape)  # what init_device_mesh(device, shape) lays out


def _pick(n: int, keep: int) -> list[int]:
    """All of range(n), or its first keep-1 and its last, for a slice of a large world."""
    return list(range(n)) if n <= keep else list(range(keep - 1)) + [n - 1]


def draw_mesh(plan: Any, path: Path | str) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    m = plan.mesh
    grid = rank_grid(plan)
    cp, tp = m.cp_ring * m.cp_ulysses, m.tp
    world = grid.numel()
    sliced = world > 64
    stages = _pick(m.pp, MAX_STAGES) if sliced else list(range(m.pp))
    rows = _pick(m.dp, MAX_ROWS) if sliced else list(range(m.dp))
    n_cp_shown = max(1, min(cp, MAX_COLS // tp)) if sliced else cp
    cols = [(c, t) for c in range(n_cp_shown) for t in range(min(tp, MAX_COLS))]
    n_panels = len(stages)
    per_row = min(n_panels, max(1, 4 if len(cols) <= 4 else 2 if len(cols) <= 8 else 1))
    panel_rows = math.ceil(n_panels / per_row)
    cw, ch = 1.05, 0.62  # inches per cell
    fig_w = max(8.0, per_row * (len(cols) * cw + 1.2))
    fig_h = 1.0 + panel_rows * (len(rows) * ch + 0.8)
    fig, axes = plt.subplots(panel_rows, per_row, figsize=(fig_w, fig_h), dpi=100, squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if k >= n_panels:
            continue
        s = stages[k]
        for i, d in enumerate(rows):
            y = len(rows) - 1 - i
            for j, (c, t) in enumerate(cols):
                r, u = divmod(c, m.cp_ulysses)
                rank = int(grid[s, d, r, u, t])
                ax.add_patch(Rectangle((j, y), 1, 1, facecolor=TP_COLOURS[t % len(TP_COLOURS)], edgecolor="white",
                                       linewidth=1.5))
                coord = f"dp{d} cp{c} tp{t}" if cp > 1 else f"dp{d} tp{t}"
                ax.text(j + 0.5, y + 0.62, f"r{rank}", ha="center", va="center", fontsize=9, weight="bold")
                ax.text(j + 0.5, y + 0.27, coord, ha="center", va="center", fontsize=6.5)
            # one tp group = one outlined run of consecutive ranks in a row
            shown_tp = min(tp, MAX_COLS)
            for g in range(n_cp_shown):
                ax.add_patch(Rectangle((g * shown_tp + 0.04, y + 0.04), shown_tp - 0.08, 0.92, fill=False,
                                       edgecolor="#1f3b73", linewidth=2.2))
            ax.text(-0.15, y + 0.5, f"dp {d}", ha="right", va="center", fontsize=8)
        if cp > 1:  # cp groups: same tp column in each cp block of a row; label the blocks
            for g in range(n_cp_shown):
                r, u = divmod(g, m.cp_ulysses)
                what = f"cp {g}" + (f" (ring {r}, ulysses {u})" if m.cp_ring > 1 and m.cp_ulysses > 1 else "")
                ax.text(g * min(tp, MAX_COLS) + min(tp, MAX_COLS) / 2, len(rows) + 0.12, what, ha="center",
                        va="bottom", fontsize=7.5, color="#7a3b00")
        lo, hi = int(grid[s].min()), int(grid[s].max())
        ax.set_title(f"pp stage {s}: ranks {lo}-{hi}", fontsize=9.5, pad=14 if cp > 1 else 6)
        ax.set_xlim(-0.9, len(cols) + 0.1)
        ax.set_ylim(-0.1, len(rows) + (0.5 if cp > 1 else 0.1))  # room for the cp block labels
        ax.set_aspect("auto")
    sizes = f"pp {m.pp} x dp {m.dp} x cp {cp}"
    if cp > 1 and m.cp_ring > 1 and m.cp_ulysses > 1:
        sizes += f" (ring {m.cp_ring} x ulysses {m.cp_ulysses})"
    sizes += f" x tp {tp} = {world} ranks"
    title = f"device mesh {sizes}\nrank = (((pp*dp + d)*cp_ring + r)*cp_ulysses + u)*tp + t (tp innermost)"
    if sliced:
        title += (f"\nshowing a slice of {world} ranks: pp stages {stages}, dp rows {rows}, "
                  f"cp blocks 0-{n_cp_shown - 1} of {cp}")
    groups = ["blue box: a tp group (consecutive ranks)"]
    if cp > 1:
        groups.append("cp group: the same tp column in every cp block of a row")
    if m.dp > 1:
        groups.append("dp group: one column (same cp, tp)")
    if m.pp > 1:
        groups.append("pp group: the same cell in every stage panel")
    width_chars = int(fig_w * 13)  # about 13 characters per inch at fontsize 10
    lines = [textwrap.fill(line, width_chars) for line in title.split("\n") + ["; ".join(groups)]]
    n_lines = sum(line.count("\n") + 1 for line in lines)
    fig.set_figheight(fig_h + 0.2 * n_lines)
    fig.suptitle("\n".join(lines), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return {"world": world, "sliced": sliced, "stages": stages, "rows": rows}
