"""MindSpore / MindFormers checkpoint files read (and written) without MindSpore installed.

- proto:     the checkpoint.proto and node_strategy.proto messages, built in code
- ckpt_file: read_ckpt / write_ckpt for MindSpore .ckpt files
- strategy:  parallel strategy files (Layout), slice_of / merge of parameter slices
- sources:   read_mindspore_weights: full weights from a .ckpt, safetensors, or rank_*/ folders + strategy
"""
from __future__ import annotations

from .ckpt_file import read_ckpt, write_ckpt
from .sources import MindSporeWeights, read_mindspore_weights, why_dropped
from .strategy import Layout, make_layout, merge, read_strategies, read_strategy, slice_of, write_strategy

__all__ = ["Layout", "MindSporeWeights", "make_layout", "merge", "read_ckpt", "read_mindspore_weights",
           "read_strategies", "read_strategy", "slice_of", "why_dropped", "write_ckpt",
           "write_strategy"]
