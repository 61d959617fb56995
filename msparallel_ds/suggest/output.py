"""What suggest prints and writes: the ranked table, JSON, and the best layout as a MindFormers YAML with a comment
header (written by suggest, predicted step time and memory)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .cost import Links
from .search import Candidate, SearchResult


def parse_bytes(text: str) -> float:
    """'80GiB', '64GB', '512MiB', '1.5TiB', or a plain number of GiB -> bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9, "mb": 1e6, "kb": 1e3,
             "t": 2**40, "g": 2**30, "m": 2**20, "b": 1}
    s = str(text).strip().lower().replace(" ", "")
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit) and s[:-len(unit)]:
            return float(s[:-len(unit)]) * units[unit]
    return float(s) * 2**30


def table(res: SearchResult, top: int) -> str:
    c = res.counts
    lines = [f"model {res.spec.source}: {res.spec.layers} layers, hidden {res.spec.hidden}, heads {res.spec.heads}/"
             f"{res.spec.kv_heads} kv" + (f", {res.spec.experts} experts top-{res.spec.top_k}" if res.spec.moe else "")
             + f"; seq {res.spec.seq_length}, global batch {res.spec.global_batch}; world {res.world_size}, "
             f"{res.device_memory_gib:.0f} GiB/device (budget {c['memory_budget_gib']:.1f} GiB)",
             f"layouts: {c['enumerated']} enumerated ({c['structures']} structures x recompute x ZeRO), "
             f"{c['invalid_by_rule']} invalid by MindFormers' rules, {c['over_memory']} over memory, {c['kept']} kept"
             f"; pruned before planning: " + (", ".join(f"{k} {v}" for k, v in c["pruned"].items()) or "none")]
    if c["invalid_reasons"]:
        lines.append("invalid, most common: " + "; ".join(f"{n}x {r}" for r, n in c["invalid_reasons"].items()))
    head = f"{'#':>3} {'layout':<58} {'step s':>9} {'tokens/s':>11} {'GiB/rank':>8}  why"
    lines += [head, "-" * len(head)]
    for i, cand in enumerate(res.candidates[:top], 1):
        lines.append(f"{i:>3} {cand.label:<58} {cand.step_time:9.4g} {cand.tokens_per_s:11.4g} "
                     f"{cand.memory_gib:8.2f}  {cand.why}")
    if not res.candidates:
        lines.append("no layout fits: more devices, more memory per device, or a smaller global batch / sequence")
    return "\n".join(lines)


def as_json(res: SearchResult, top: int, links: Links) -> str:
    return json.dumps({"world_size": res.world_size, "device_memory_gib": res.device_memory_gib,
                       "links": links.__dict__, "counts": res.counts,
                       "candidates": [c.as_dict() for c in res.candidates[:top]]}, indent=2, default=str)


def header(cand: Candidate, world: int, links: Links) -> str:
    return (f"# Written by `msparallel-ds suggest` for {world} devices: {cand.label}\n"
            f"# Predicted step time {cand.step_time:.4g} s ({cand.tokens_per_s:.4g} tokens/s), estimated memory "
            f"{cand.memory_gib:.1f} GiB/rank; {cand.why}.\n"
            f"# Cost-model figures: intra {links.intra_bw / 1e9:g} GB/s, inter {links.inter_bw / 1e9:g} GB/s, "
            f"{links.devices_per_node} devices/node, {links.flops / 1e12:g} TFLOP/s x mfu {links.mfu:g}.\n")


def write_yaml(cand: Candidate, path: Any, world: int, links: Links) -> None:
    text = header(cand, world, links) + yaml.safe_dump(cand.yaml(), sort_keys=False, default_flow_style=None)
    Path(path).write_text(text)
