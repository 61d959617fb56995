"""Picture of the per-rank memory estimate (msparallel_ds.memory): stacked bars against the device memory.

One bar per pipeline stage (estimate_memory(plan, stage): the embedding on the first stage, the head and logits on
the last, 1F1B's in-flight micro-batches per stage); without a pipeline, the rank as planned and, when recompute
changes it, the same rank without recompute.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from ..memory import max_device_memory_gib

PARTS = (("weights_gib", "parameters", "#3b75af"), ("grads_gib", "gradients", "#6fa8dc"),
         ("optimizer_gib", "optimizer states", "#d9822b"), ("activations_gib", "activations", "#4f9d4f"),
         ("logits_gib", "logits (fp32)", "#9e6fb8"), ("buffers_gib", "comm buffers", "#8c8c8c"))


def device_memory_from_yaml(path: Path | str) -> Optional[float]:
    """context.max_device_memory of a MindFormers YAML file, in GiB (None when absent or unreadable)."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return max_device_memory_gib(raw)


def _no_estimate(plan: Any) -> str:
    why = [n for n in plan.notes if n.startswith("no memory estimate")]
    return why[0] if why else "the model shape (num_layers, hidden_size, num_heads, vocab_size, seq_length) is unknown"


def draw_memory(plan: Any, path: Path | str, device_memory_gib: Optional[float] = None) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import textwrap

    est = plan.memory
    fig, ax = plt.subplots(figsize=(max(8.5, 1.2 + 0.7 * plan.mesh.pp), 6.0), dpi=100)
    if est is None:
        ax.set_axis_off()
        ax.text(0.5, 0.55, "no memory estimate for this plan", ha="center", va="center", fontsize=16, weight="bold")
        ax.text(0.5, 0.4, textwrap.fill(_no_estimate(plan), 70), ha="center", va="top", fontsize=10)
        fig.savefig(path)
        plt.close(fig)
        return {"estimate": False}
    from ..memory import estimate_memory

    d = asdict(est)  # unrounded: as_dict() rounds GiB to 3 decimals, which zeroes tiny models' parts
    m = plan.mesh
    if m.pp > 1:
        bars = [(f"stage {j}", asdict(estimate_memory(plan, j))) for j in range(m.pp)]
    else:
        bars = [("as planned", d)]
        if est.activations_no_recompute_gib > est.activations_gib + 1e-9:
            bars.append(("without recompute", {**d, "activations_gib": est.activations_no_recompute_gib}))
    biggest = max(sum(b[k] for k, _, _ in PARTS) for _, b in bars)
    # tiny demo models: MiB so the bars have readable numbers
    unit, scale = ("GiB", 1.0) if max(biggest, device_memory_gib or 0) >= 1 else ("MiB", 1024.0)
    totals = []
    for x, (label, b) in enumerate(bars):
        bottom = 0.0
        for key, name, colour in PARTS:
            v = b[key] * scale
            ax.bar(x, v, bottom=bottom, color=colour, width=0.55, label=name if x == 0 else None)
            if v > 0.04 * biggest * scale:
                ax.text(x, bottom + v / 2, f"{v:.3g}", ha="center", va="center", fontsize=8, color="white")
            bottom += v
        totals.append(bottom)
        ax.text(x, bottom, f"{bottom:.3g} {unit}", ha="center", va="bottom", fontsize=10, weight="bold")
    top = max(totals)
    if device_memory_gib:
        dev = device_memory_gib * scale
        ax.axhline(dev, color="#c0392b", linestyle="--", linewidth=1.5)
        ax.text(-0.6, dev, f" device memory {dev:.3g} {unit}", color="#c0392b", ha="left", va="bottom", fontsize=9)
        top = max(top, dev)
    ax.set_ylim(0, top * 1.18 or 1)
    ax.set_xlim(-0.6, len(bars) - 0.4)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([label for label, _ in bars])
    ax.set_ylabel(f"per-rank memory ({unit})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)  # outside: never covers a bar
    stage = f"each of {m.pp} pipeline stages (a rank of it)" if m.pp > 1 else "every rank (no pipeline)"
    rc = plan.recompute.mode
    ax.set_title(f"memory estimate for {stage}: up to {est.params_per_rank:,} parameters per rank\n"
                 f"ZeRO-{plan.zero.stage} over dp x cp = {m.dp * m.cp}, tp {m.tp}, {plan.compute_dtype} compute, "
                 f"recompute {rc}; allocator fragmentation not counted", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return {"estimate": True, "unit": unit, "totals": totals, "device_memory_gib": device_memory_gib}
