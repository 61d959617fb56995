"""engine.train_batch with already shifted targets (`shift_labels` [rows, S], HF's convention: token t's target, -100
for none), as MindFormers trains rows of seq_length + 1 tokens (input_ids[:, :-1] on input_ids[:, 1:]: S targets a
row, the last position included). dp2 x tp2 with two interleaved copies, dp2 x cp2 ring with gradient accumulation
and pp2 x cp2 ring with two micro-batches, on 4 gloo processes, equal one process's global token mean over 3 AdamW
steps.
"""
import pytest
from engine_cases import BETAS, EPS, LR, SEQ, VOCAB, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 3
LAYOUTS = {  # name -> (tiny_config kwargs, pipeline_stage / micro_batch_num / micro_batch_interleave_num)
    "dp2xtp2_sp_2copies": (dict(dp=2, tp=2, sp=True, bs=2), dict(mbi=2)),
    "dp2xcp2_ring_gas2": (dict(dp=2, cp=2, ring=True, gas=2), {}),
    "pp2xcp2_ring_mbn2": (dict(cp=2, ring=True), dict(pp=2, mbn=2)),
}


def _batch(step, rows):
    """rows of SEQ + 1 tokens -> input_ids [rows, SEQ] and shift_labels [rows, SEQ] (the next tokens), ~30% of the
    targets ignored and row 0's first half wholly, so micro-batches and cp shards hold unequal token counts."""
    import torch

    g = torch.Generator().manual_seed(200 + step)
    row = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    targets = row[:, 1:].clone()
    mask = torch.rand(rows, SEQ, generator=g) < 0.3
    mask[0, : SEQ // 2] = True
    mask[:, -1] = False  # the last position's target: the one an HF-style labels batch cannot express
    targets[mask] = -100
    return row[:, :-1].contiguous(), targets


def _config(yaml, opts):
    c = tiny_config(**yaml)
    c["micro_batch_interleave_num"] = opts.get("mbi", 1)
    c["parallel_config"].update(pipeline_stage=opts.get("pp", 1), micro_batch_num=opts.get("mbn", 1))
    return c


def _train(rank, world_size, _):
    import torch

    import msparallel_ds as msp

    out = {}
    for name, (yaml, opts) in LAYOUTS.items():
        engine = msp.initialize(tiny_model(), msp.load_config(_config(yaml, opts)),
                                optimizer=lambda p: torch.optim.AdamW(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=0))
        lay = engine.layout
        rows = engine.micro_batch_size * engine.gradient_accumulation_steps
        share = slice(lay.rank("dp") * rows, (lay.rank("dp") + 1) * rows)
        losses = []
        for step in range(STEPS):
            ids, targets = _batch(step, rows * lay.size("dp"))
            losses.append(engine.train_batch({"input_ids": ids[share], "shift_labels": targets[share]}).item())
        out[name] = {"losses": losses, "rows": rows * lay.size("dp"), "state": engine.full_state_dict(rank0_only=True)}
    return out


def _reference(rows, with_last=True):
    """One process: the token mean of cross_entropy(logits, shift_labels) over the global batch, AdamW, clipping at
    1.0 (engine_cases.tiny_config's). with_last=False drops each row's last target (what HF labels give)."""
    import torch
    import torch.nn.functional as F

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step, rows)
        if not with_last:
            targets[:, -1] = -100
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_shift_labels_match_single_process():
    results = run_distributed(_train, 4, None, timeout=400)
    for name in LAYOUTS:
        rows = results[0][name]["rows"]
        ref_losses, ref_state = _reference(rows)
        dropped, _ = _reference(rows, with_last=False)
        # the check can fail: dropping the last target (HF labels) changes the losses by more than the tolerance
        assert max(abs(a - b) / b for a, b in zip(dropped, ref_losses)) > 3e-4
        for rank, r in enumerate(results):
            got = r[name]
            assert max(abs(a - b) / b for a, b in zip(got["losses"], ref_losses)) <= 1e-4, (name, rank, got["losses"],
                                                                                          ref_losses)
            if got["state"]:  # rank 0 holds the gathered state
                assert max((got["state"][k] - v).abs().max().item() for k, v in ref_state.items()) <= 5e-5, name


def test_summed_copies_count_shifted_targets_as_they_are():
    """copy_loss_terms (MindSpore's summed copies) weighs each copy by its valid targets: the same whether it gets
    HF labels (shifted there) or the already shifted targets."""
    import torch
    import torch.nn.functional as F

    from msparallel_ds.interleave.multi_copy import copy_loss_terms
    from msparallel_ds.labels import shift_labels

    ids, targets = _batch(0, 4)
    targets[2:, : SEQ // 2] = -100  # copy 1 holds fewer targets than copy 0
    logits = torch.randn(4, SEQ, VOCAB)

    def loss_sum(lg, tg):
        return F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=-100, reduction="sum")

    want = sum(loss_sum(lg, tg) / (tg != -100).sum() for lg, tg in zip(logits.chunk(2), targets.chunk(2)))
    got = copy_loss_terms(loss_sum, logits, targets, targets, 2, shifted=True)
    assert torch.allclose(got, want)
    labels = torch.cat([torch.zeros(4, 1, dtype=torch.long), targets], 1)[:, :SEQ]  # shifts to targets, last lost
    assert torch.equal(shift_labels(labels)[:, :-1], targets[:, :-1])
    assert not torch.allclose(copy_loss_terms(loss_sum, logits, targets, labels, 2), want)


def test_shift_labels_of_another_shape_is_a_clear_error():
    from types import SimpleNamespace

    import torch

    from msparallel_ds.loss import check_batch

    engine = SimpleNamespace(micro_batch_size=2, gradient_accumulation_steps=1, check_batch_agreement=False)
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"shift_labels shape \(2, 7\) != input_ids shape \(2, 8\)"):
        check_batch({"input_ids": ids, "shift_labels": ids[:, 1:]}, engine, "runner_config.gradient_accumulation_steps")
    with pytest.raises(TypeError, match="shift_labels"):
        check_batch({"input_ids": ids, "shift_labels": ids.float()}, engine, "x")
