"""pipeline.zero.split_zero with the YAML's optimizer, whose parameters come as MindFormers' weight-decay groups: the
expert parameters must still go to the expert-data-parallel part (the old code looked for the `expert_parallel` flag
on the group dicts, found none, and handed experts to the dense ZeRO over dp x cp, whose owner broadcast overwrites
other ranks' experts). One process: the parts are plain optimizers (every group size 1)."""
import torch
from torch import nn

from msparallel_ds.pipeline.zero import SplitZero, split_zero


class _OneRank:
    @staticmethod
    def size(name):
        return 1


def _param(expert: bool) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    if expert:
        p.expert_parallel = True
    return p


def test_groups_split_into_dense_and_expert_parts_keeping_their_options():
    dense_w, dense_b, expert_w, expert_b = _param(False), _param(False), _param(True), _param(True)
    groups = [{"params": [dense_w, expert_w], "weight_decay": 0.1},
              {"params": [dense_b, expert_b], "weight_decay": 0.0}]
    opt = split_zero(groups, torch.optim.AdamW, {"lr": 1e-3}, _OneRank())
    assert isinstance(opt, SplitZero)
    dense, experts = opt.parts
    assert [([id(p) for p in g["params"]], g["weight_decay"]) for g in dense.param_groups] == \
        [([id(dense_w)], 0.1), ([id(dense_b)], 0.0)]
    assert [([id(p) for p in g["params"]], g["weight_decay"]) for g in experts.param_groups] == \
        [([id(expert_w)], 0.1), ([id(expert_b)], 0.0)]
    plain = split_zero([dense_w, expert_w], torch.optim.AdamW, {"lr": 1e-3}, _OneRank())  # a callable's flat list
    assert [[id(p) for p in part.param_groups[0]["params"]] for part in plain.parts] == [[id(dense_w)], [id(expert_w)]]
