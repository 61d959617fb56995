"""Pictures of a Plan: the device mesh, the pipeline schedule and the per-rank memory estimate (PNG files).

matplotlib is optional (`pip install msparallel-ds[plot]`): it is imported only when a picture is drawn, with the
Agg backend, so the package and `plan` without --draw work without it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .schedule import ScheduleTable, schedule_table

__all__ = ["draw_plan", "schedule_table", "ScheduleTable", "Drawn", "require_matplotlib"]

INSTALL_HINT = "pip install msparallel-ds[plot] (from a checkout: pip install -e .[plot])"


class Drawn(dict):
    """{"mesh": Path, "schedule": Path, "memory": Path}, with the timed schedule behind schedule.png."""

    schedule: Optional[ScheduleTable] = None


def require_matplotlib() -> None:
    import importlib

    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(f"pictures need matplotlib: {INSTALL_HINT}") from None


def draw_plan(plan: Any, out_dir: Path | str, *, device_memory_gib: Optional[float] = None) -> Drawn:
    """Write mesh.png, schedule.png and memory.png for `plan` into out_dir (created if needed); return their paths."""
    require_matplotlib()
    from .memory import draw_memory
    from .mesh import draw_mesh
    from .schedule import draw_schedule

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = Drawn(mesh=out / "mesh.png", schedule=out / "schedule.png", memory=out / "memory.png")
    draw_mesh(plan, paths["mesh"])
    paths.schedule = draw_schedule(plan, paths["schedule"])
    draw_memory(plan, paths["memory"], device_memory_gib)
    return paths
