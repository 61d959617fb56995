"""Issue 16, items 2, 3 and 7 and the batch messages: ordinary bad input is one clear error, never a silent wrong
result or a backend abort.

- vocab parallel (vocab_emb_dp: false): token ids / labels outside [0, vocab) raise on every tp rank, naming the
  value, its position and the vocab size (labels equal to ignore_index stay allowed);
- tp and cp peers of a dp rank fed different rows (contents, seq length, dtype) raise on every rank of the block
  before the step's first collective; engine.check_batch_agreement = False switches the check off;
- context_parallel_attention with inputs that differ between cp ranks (s_local, dtype, heads, one rank rejecting
  its own inputs) raises on every cp rank instead of aborting in gloo;
- float / list input_ids, float labels and sequence length 0 give one clear message.
All multi-process cases run in ONE spawned 4-process gloo run that builds its engines in turn.
"""
from types import SimpleNamespace

import pytest
from engine_cases import VOCAB, global_batch, tiny_config, tiny_model
from harness import run_distributed


# ---------------------------------------------------------------------------------------------- one process
def _fake_engine():
    layout = SimpleNamespace(size=lambda name: 1)
    return SimpleNamespace(micro_batch_size=1, gradient_accumulation_steps=2, layout=layout,
                           plan=SimpleNamespace(global_batch_size=2))


@pytest.mark.parametrize("batch, exc, match", [
    ({"input_ids": [[1, 2, 3], [4, 5, 6]]}, TypeError,
     r"batch\['input_ids'\] must be an integer torch.Tensor \[rows, seq\] of token ids, got list"),
    ({"input_ids": "float"}, TypeError, r"input_ids'\] must be an integer torch.Tensor .* got a torch.float32 tensor"),
    ({"input_ids": "ids", "labels": "float"}, TypeError, r"batch\['labels'\] must be an integer torch.Tensor"),
    ({"input_ids": "empty"}, ValueError, r"shape \(2, 0\): sequence length 0"),
    ({"input_ids": "1d"}, ValueError, r"input_ids'\] of shape \[rows, seq\].*got shape \(6,\)"),
    ([1, 2], TypeError, r"needs a dict batch"),
])
def test_batch_messages(batch, exc, match):
    import torch

    from msparallel_ds.loss import check_batch

    made = {"float": torch.rand(2, 3), "ids": torch.zeros(2, 3, dtype=torch.long),
            "empty": torch.zeros(2, 0, dtype=torch.long), "1d": torch.zeros(6, dtype=torch.long)}
    if isinstance(batch, dict):
        batch = {k: made.get(v, v) if isinstance(v, str) else v for k, v in batch.items()}
    with pytest.raises(exc, match=match):
        check_batch(batch, _fake_engine(), "runner_config.gradient_accumulation_steps")


def test_check_ids_in_vocab():
    import torch

    from msparallel_ds.tensor_parallel.vocab import check_ids_in_vocab

    ids = torch.tensor([[1, 2, 3], [4, 300, 5]])
    with pytest.raises(ValueError, match=r"token id 300 at position \(1, 1\) .* outside the vocab \[0, 256\)"):
        check_ids_in_vocab(ids, 256, "x")
    with pytest.raises(ValueError, match=r"token id -3 at position \(0, 2\)"):
        check_ids_in_vocab(torch.tensor([[0, 1, -3]]), 256, "x", ignore_index=-100)
    check_ids_in_vocab(torch.tensor([[0, -100, 255]]), 256, "x", ignore_index=-100)  # ignored labels pass


# ---------------------------------------------------------------------------------------------- 4 processes
def _error(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _engine(**yaml):
    import torch

    import msparallel_ds as msp

    return msp.initialize(tiny_model(), msp.load_config(tiny_config(**yaml)),
                          optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))


def _run(rank, world_size):
    import torch

    out = {}
    # ---- dp2 x tp2, vocab parallel embedding and cross entropy
    engine = _engine(dp=2, tp=2, vocab_dp=False)
    lay = engine.layout
    d, t = lay.rank("dp"), lay.rank("tp")
    ids, labels = global_batch(0, 2, ignore_some=True)  # some labels are -100: allowed
    ids, labels = ids[d:d + 1], labels[d:d + 1]

    def step(i=ids, lab=labels):
        return engine.train_batch({"input_ids": i, "labels": lab})

    out["ok_loss"] = float(step())
    big = ids.clone()
    big[0, 5] = VOCAB + 44
    out["big_id"] = _error(lambda: step(big, labels))
    neg = ids.clone()
    neg[0, 7] = -1
    out["neg_id"] = _error(lambda: step(neg, labels))
    bad_label = labels.clone()
    bad_label[0, 9] = VOCAB
    out["bad_label"] = _error(lambda: step(ids, bad_label))
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % VOCAB
    out["tp_contents"] = _error(lambda: step(other if t == 1 else ids, labels))
    out["tp_seq"] = _error(lambda: step(ids[:, :16] if t == 1 else ids, labels[:, :16] if t == 1 else labels))
    out["tp_dtype"] = _error(lambda: step(ids.int() if t == 1 else ids, labels))
    out["float_ids"] = _error(lambda: step(ids.float(), labels))
    out["tp_rows_one_rank"] = _error(lambda: step(torch.cat([ids, ids]) if t == 1 else ids, labels))
    out["after_errors_loss"] = float(step())  # the engine still trains
    engine.check_batch_agreement = False  # switched off: a mixture trains (the user's choice)
    out["unchecked"] = _error(lambda: step(other if t == 1 else ids, labels))
    # ---- dp2 x cp2 Ulysses
    engine = _engine(dp=2, cp=2, algo="ulysses_cp")
    lay = engine.layout
    c = lay.rank("cp")
    out["cp_contents"] = _error(lambda: engine.train_batch({"input_ids": other if c == 1 else ids}))
    out["cp_ok_loss"] = float(engine.train_batch({"input_ids": ids}))
    # ---- context_parallel_attention on the cp2 layout: inputs that differ between cp ranks
    from msparallel_ds.context_parallel.api import context_parallel_attention

    def attn(s=8, h=4, dtype=torch.float32, dim=4):
        q = torch.randn(1, s, h, 8, dtype=dtype)
        kv = torch.randn(1, s, 2, 8, dtype=dtype)
        return context_parallel_attention(q if dim == 4 else q[0], kv, kv, lay, algo="ulysses")

    out["attn_ok"] = _error(attn)
    out["attn_s_local"] = _error(lambda: attn(s=16 if c == 1 else 8))
    out["attn_dtype"] = _error(lambda: attn(dtype=torch.float64 if c == 1 else torch.float32))
    out["attn_heads"] = _error(lambda: attn(h=8 if c == 1 else 4))
    out["attn_reject"] = _error(lambda: attn(dim=3 if c == 1 else 4))
    out["attn_after"] = _error(attn)
    return {"tp": t, "cp": c, **out}


@pytest.mark.distributed
def test_hardening_four_ranks():
    results = run_distributed(_run, 4, timeout=240)
    for rank, r in enumerate(results):
        where = (rank, r)
        assert r["ok_loss"] > 0 and r["after_errors_loss"] > 0 and r["cp_ok_loss"] > 0, where
        assert r["big_id"] and "token id 300 at position (0, 5)" in r["big_id"] and "[0, 256)" in r["big_id"], where
        assert "VocabParallelEmbedding" in r["big_id"], where
        assert r["neg_id"] and "token id -1 at position (0, 7)" in r["neg_id"], where
        assert r["bad_label"] and "token id 256 at position (0, 8)" in r["bad_label"], where
        assert "vocab_parallel_cross_entropy" in r["bad_label"] and "ignore_index=-100" in r["bad_label"], where
        for key, what in (("tp_contents", "input_ids contents"), ("tp_seq", "input_ids shape (1, 16) vs (1, 32)"),
                          ("tp_dtype", "input_ids dtype torch.int32 vs torch.int64")):
            assert r[key] and "tp rank 1 (global rank" in r[key] and what in r[key], (key, where)
            assert "DistributedSampler" in r[key] and "check_batch_agreement = False" in r[key], (key, where)
        assert r["float_ids"].startswith("TypeError") and "got a torch.float32 tensor" in r["float_ids"], where
        if r["tp"] == 1:  # the rank with the wrong row count says so; its peer names it
            assert "train_batch got 2 rows" in r["tp_rows_one_rank"], where
        else:
            assert "tp rank 1 (global rank" in r["tp_rows_one_rank"] and "rejected" in r["tp_rows_one_rank"], where
        assert r["unchecked"] is None, where
        assert r["cp_contents"] and "cp rank 1 (global rank" in r["cp_contents"], where
        assert "input_ids contents" in r["cp_contents"], where
        assert r["attn_ok"] is None and r["attn_after"] is None, where
        assert "s_local=16 where cp rank 0 has 8" in r["attn_s_local"], where
        assert "dtype=torch.float64 where cp rank 0 has torch.float32" in r["attn_dtype"], where
        assert "num_heads=8 where cp rank 0 has 4" in r["attn_heads"], where
        if r["cp"] == 1:
            assert "q must be 4-D" in r["attn_reject"], where
        else:
            assert "cp rank 1 (global rank" in r["attn_reject"] and "rejected" in r["attn_reject"], where
