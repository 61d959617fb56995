"""`msparallel-ds suggest`: MindSpore's auto-parallel idea for MindFormers YAMLs. Enumerate the layouts MindFormers'
rules accept (space.py), drop those over device memory (the plan's estimate), rank the rest with a cost model
(cost.py), write the best as a MindFormers YAML (output.py). `resolve_auto_parallel` picks the strategy of a
`parallel_mode: 2` (auto_parallel) YAML the same way."""
from __future__ import annotations

from .cost import Links, step_cost
from .model import ModelSpec, read_model
from .search import Candidate, SearchResult, cost_of_yaml, resolve_auto_parallel, search, suggest
from .space import Layout

__all__ = ["Candidate", "Layout", "Links", "ModelSpec", "SearchResult", "cost_of_yaml", "read_model",
           "resolve_auto_parallel", "search", "step_cost", "suggest"]
