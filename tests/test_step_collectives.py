"""Issue 44 item 12: the step-level collectives of msp.initialize's engine, counted, so the per-step guards cannot
silently add collectives again.

Every torch.distributed call of one train_batch (after a warm-up step) is attributed to the innermost frame of ours
(outside msparallel_ds/distributed/, the helpers) or of DeepSpeed. The step-level ones, made by the engine, the loss
module and the cp attention's peer check, must be exactly two per step where peers are checked or ZeRO is off: one
carrying the global token count (with the tp / cp / pp batch agreement folded in when those peers exist) and one
summing the step's loss (ZeRO-0's finite-gradient check reads the global norm, which at tp 1 needs no collective).
At dp4 under ZeRO-2 the count rides in the loss sum's all-reduce after the warm-up step (msparallel_ds/token_count.py,
tests/test_token_count.py): one. Before that fold it made two, and this test failed there. Before the fold, dp4
ZeRO-0 made 3 (plus the flag's all-reduce), dp2 x tp2 made 3 (a tp all-gather, the dp count, the loss) and dp2 x cp2
made 7 (plus a cp all-gather per attention call, 4 layers); this test failed there. The guards still catch what they
caught (tests/test_hardening_inputs.py); here also a dp rank whose peers agree stops with the one whose peers do
not, and NaN gradients on one rank under ZeRO-0 stop every rank before the update.

Where there are no peers to check (dp only), both step-level collectives are async (issued before the forward and
before the backward, waited after them), so the step never blocks on them. And the layout builds one process
group per distinct rank set (dp, dp_cp and edp share the default group at dp4; all size-1 dims share one group):
every gloo group runs a TCP loop thread that wakes 100 times a second, idle or not, which on 4 processes sharing
2 cores cost more than the two collectives (benchmarks/README.md, issue 44 item 12). Before, DeviceMesh made one
group per name, 12 at dp4 (2 distinct rank sets), and this test failed there.
"""
import os
import sys

import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

STEP_LEVEL = ("msparallel_ds/engine.py", "msparallel_ds/loss.py", "msparallel_ds/context_parallel/api.py")


def _owner() -> str:
    """The innermost caller frame of ours (outside msparallel_ds/distributed/) or of DeepSpeed."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/deepspeed/" in path:
            return "deepspeed"
        at = path.rfind("/msparallel_ds/")
        if at >= 0 and "/msparallel_ds/distributed/" not in path:
            return path[at + 1:]
        frame = frame.f_back
    return "other"


def _counted(step) -> dict:
    """{owner: calls} of torch.distributed collectives made by step() (nested calls count once)."""
    from msparallel_ds.distributed.instruments import tapped_collectives

    counts = {}

    def on_call(op, args, kwargs):
        owner = _owner()
        counts[owner] = counts.get(owner, 0) + 1
        if owner in STEP_LEVEL and not kwargs.get("async_op", False):
            counts["blocking"] = counts.get("blocking", 0) + 1

    with tapped_collectives(on_call):
        step()
    return counts


def _run(rank, world_size):
    import torch

    import msparallel_ds as msp
    from msparallel_ds.distributed.layout import GROUP_NAMES

    out = {}
    for name, yaml in (("dp4", dict(dp=4, zero=2, clip=0.0)), ("dp4_zero0", dict(dp=4, zero=0, clip=0.0)),
                       ("dp2_tp2", dict(dp=2, tp=2, zero=2, clip=0.0)),
                       ("dp2_cp2", dict(dp=2, cp=2, algo="ulysses_cp", clip=0.0))):
        engine = msp.initialize(tiny_model(), msp.load_config(tiny_config(**yaml)),
                                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
        d = engine.layout.rank("dp")
        ids, labels = global_batch(0, engine.layout.size("dp"), ignore_some=True)
        batch = {"input_ids": ids[d:d + 1], "labels": labels[d:d + 1]}
        engine.train_batch(batch)  # warm-up: DeepSpeed's first step sets up its buffers
        counts = _counted(lambda: engine.train_batch(batch))
        out[name] = {k: v for k, v in counts.items() if k in STEP_LEVEL}
        out[name + "_all"] = counts
        groups = {n: engine.layout.group(n) for n in GROUP_NAMES}
        out[name + "_groups"] = (len({id(g) for g in groups.values()}),
                                 len({engine.layout.ranks(n) for n in GROUP_NAMES}),
                                 groups["dp_cp"] is torch.distributed.group.WORLD)
        if name == "dp2_tp2":  # only dp rank 1's tp peers disagree: every rank stops, none waits in a collective
            other = batch["input_ids"].clone()
            other[0, 3] = (other[0, 3] + 1) % 256
            bad = {**batch, "input_ids": other} if d == 1 and engine.layout.rank("tp") == 1 else batch
            try:
                engine.train_batch(bad)
                out["one_block"] = None
            except ValueError as e:
                out["one_block"] = str(e)
            out["after"] = float(engine.train_batch(batch))
        if name == "dp4_zero0":  # a finite loss, NaN gradients on one rank: every rank stops before the update
            weight = engine.model.get_input_embeddings().weight
            hook = weight.register_hook(lambda g: g * float("nan")) if rank == 1 else None
            before = weight.detach().clone()
            try:
                engine.train_batch(batch)
                out["nan_grads"] = None
            except FloatingPointError as e:
                out["nan_grads"] = str(e)
            out["nan_grads_unchanged"] = bool(torch.equal(before, weight.detach()))
            if hook is not None:
                hook.remove()
    return out


@pytest.mark.distributed
def test_step_level_collectives_per_step():
    results = run_distributed(_run, 4, timeout=240)
    for rank, r in enumerate(results):
        for name in ("dp4", "dp4_zero0", "dp2_tp2", "dp2_cp2"):
            # one collective with the token count (+ the batch agreement), one with the loss sum; dp4 ZeRO-2: the count
            # in the loss sum's (deferred: the warm-up step counted the same tokens)
            assert sum(r[name].values()) == (1 if name == "dp4" else 2), (rank, name, r[name], r[name + "_all"])
            assert "msparallel_ds/context_parallel/api.py" not in r[name], (rank, name, r[name])
            groups, rank_sets, _ = r[name + "_groups"]
            assert groups == rank_sets, (rank, name, r[name + "_groups"])  # one group per distinct rank set
        for name in ("dp4", "dp4_zero0"):  # no peers to check: the count and the loss sum are both async
            assert r[name + "_all"].get("blocking", 0) == 0, (rank, name, r[name + "_all"])
            assert r[name + "_groups"] == (2, 2, True), (rank, name, r[name + "_groups"])  # the world's, size 1's
        msg = r["one_block"]
        assert msg and "train_batch: the peers of this dp rank were fed different batches" in msg, (rank, msg)
        if rank // 2 == 1:  # dp rank 1 (ranks 2, 3): its own tp group names the difference
            assert "tp rank 1 (global rank 3)" in msg and "input_ids contents" in msg, (rank, msg)
        else:
            assert "the peers of dp rank(s) 1 disagree" in msg, (rank, msg)
        assert r["after"] > 0, rank
        msg = r["nan_grads"]
        assert msg and "global gradient norm is nan" in msg and "the optimizer step was not taken" in msg, (rank, msg)
        assert r["nan_grads_unchanged"], rank
