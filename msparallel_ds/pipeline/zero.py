"""Optimizer parallel for the pipeline engine when experts are sharded (pipeline + optimizer parallel + ep).

Dense parameters are the same on every dp x cp rank of a stage, expert parameters only on their expert-data-parallel
(edp) ranks (moe.apply flags them `expert_parallel`). One ZeroRedundancyOptimizer over dp x cp would hand an expert
tensor to one owner and broadcast its update over ranks that hold other experts. So each kind gets its own ZeRO-1
over its own group, as DeepSpeed's engine does for expert groups (moe/deepspeed.py): dense states sharded over
dp x cp, expert states over edp (a plain optimizer where edp = 1). Gradients are reduced before the step over the same
groups (engine._sync_and_clip), so each owner updates with the full gradient and broadcasts the result in its group.
"""
from __future__ import annotations

import torch


class SplitZero(torch.optim.Optimizer):
    """Dense and expert ZeRO-1 parts behind one optimizer surface (step, zero_grad, param_groups for LR schedules).
    param_groups are the parts' own dicts, so an LR scheduler's change reaches both."""

    def __init__(self, dense: torch.optim.Optimizer, experts: torch.optim.Optimizer):
        self.parts = [dense, experts]
        self.defaults = dict(dense.defaults)
        self.param_groups = [g for part in self.parts for g in part.param_groups]
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @property
    def state(self):  # this rank's shard of both parts' states (what a rank owns)
        out = {}
        for part in self.parts:
            out.update(getattr(part, "optim", part).state)
        return out

    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise ValueError("optimizer.state_dict() with pipeline_stage > 1 (or Muon), optimizer parallel and "
                         "expert_parallel > 1: the state is sharded over two groups (dense over data_parallel x "
                         "context_parallel, experts over expert data parallel) and no rank holds it whole; checkpoint "
                         "with engine.save / engine.load, which write and read every parameter's state once")

    def load_state_dict(self, state_dict):
        self.state_dict()


def _split(params: list) -> tuple[list, list]:
    """(dense, experts) from parameters or param-group dicts (the YAML's optimizer: MindFormers' weight-decay groups);
    a group's options go with each of its halves."""
    if not params or not isinstance(params[0], dict):
        expert = [getattr(p, "expert_parallel", False) for p in params]
        return [p for p, e in zip(params, expert) if not e], [p for p, e in zip(params, expert) if e]
    dense, experts = [], []
    for group in params:
        options = {k: v for k, v in group.items() if k != "params"}
        for out, want in ((dense, False), (experts, True)):
            ps = [p for p in group["params"] if getattr(p, "expert_parallel", False) == want]
            if ps:
                out.append({**options, "params": ps})
    return dense, experts


def split_zero(params: list, cls, defaults: dict, layout) -> torch.optim.Optimizer:
    """ZeRO-1 over dp x cp for the dense parameters and over edp for the experts (module docstring)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    dense, experts = _split(params)

    def zero(ps, name):
        if layout.size(name) == 1:
            return cls(ps, **defaults)
        return ZeroRedundancyOptimizer(ps, optimizer_class=cls, process_group=layout.group(name), **defaults)

    if not experts:  # a stage without MoE layers
        return zero(dense, "dp_cp")
    return SplitZero(zero(dense, "dp_cp"), zero(experts, "edp"))
