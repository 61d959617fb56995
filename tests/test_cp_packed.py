"""Packed sequences: several documents per row get document-causal attention across the cp split.

One 4-process gloo run covers allgather (zigzag over cp 4), ulysses (contiguous over cp 4, h_kv 8 split and h_kv 2
replicated) and hybrid with cp_ring 1 (routed to Ulysses), causal and not, on rows whose document boundaries fall
inside other ranks' shards: output and dq/dk/dv equal single-process SDPA on the full sequence with an explicit
block-diagonal (causal) boolean mask, fp32. The same run trains a tiny HF Llama on packed rows and compares loss,
logits and weight grads with the unsharded model given the equivalent 4-D block-diagonal mask (itself checked against
separate per-document forward passes). Validation errors are checked in one process (they fail before any
collective).
"""
from types import SimpleNamespace

import pytest

from harness import run_distributed, worst_over_ranks
from models import tiny_llama

TOL = 1e-4
B, H, D, S = 2, 8, 16, 64
# cp 4: allgather chunks of 8 tokens (zigzag), ulysses pieces of 16; every boundary lies inside some rank's shard,
# documents span several ranks, row 1 of "uneven" has a 2-token document; "shared" gives both rows one plan
DOC_LENS = {"uneven": ([5, 30, 29], [23, 2, 39]), "shared": ([20, 44], [20, 44])}
MESHES = {"allgather": (4, 1), "ulysses": (1, 4), "hybrid": (1, 4)}


def _positions(lens):
    import torch

    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])


def _layout(world_size, algo):
    from msparallel_ds.distributed import init_parallel

    ring, uly = MESHES[algo]
    return init_parallel(SimpleNamespace(world_size=world_size, cp_algo=algo,
                                         mesh=dict(pp=1, dp=1, cp_ring=ring, cp_ulysses=uly, tp=1)))


def _allowed(doc, causal):
    """[b, 1, S, S] bool: same document, and key <= query when causal."""
    import torch

    keep = doc[:, None, :, None] == doc[:, None, None, :]
    return keep & torch.ones(S, S, dtype=torch.bool).tril() if causal else keep


def _reference(doc, h_kv, causal, seed):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, n, D, generator=g) for n in (H, h_kv, h_kv))
    dout = torch.randn(B, S, H, D, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2).repeat_interleave(H // h_kv, 1),
                                         vr.transpose(1, 2).repeat_interleave(H // h_kv, 1),
                                         attn_mask=_allowed(doc, causal)).transpose(1, 2)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def _hf_reference(input_ids, labels, lens):
    """Unsharded model on the packed rows with the 4-D block-diagonal causal mask; checked against one forward per
    document (positions from 0), so the reference is unambiguous."""
    import torch

    from msparallel_ds.context_parallel.batch import doc_ids_from_position_ids

    pos = _positions(lens)
    mask = torch.zeros(B, 1, S, S).masked_fill(~_allowed(doc_ids_from_position_ids(pos), True), float("-inf"))
    ref = tiny_llama()
    out = ref(input_ids=input_ids, labels=labels, position_ids=pos, attention_mask=mask)
    out.loss.backward()
    with torch.no_grad():
        for row, row_lens in enumerate(lens):
            start = 0
            for n in row_lens:
                alone = ref(input_ids=input_ids[row:row + 1, start:start + n]).logits[0]
                assert (alone - out.logits[row, start:start + n]).abs().max().item() < 1e-5
                start += n
    return out, {n: p.grad for n, p in ref.named_parameters()}


def _run(rank, world_size):
    import torch
    import torch.distributed as dist

    from msparallel_ds.context_parallel.api import context_parallel_attention, shard_sequence, unshard_sequence
    from msparallel_ds.context_parallel.batch import (cp_mean_loss, cp_token_loss, doc_ids_from_position_ids,
                                                      shard_batch)
    from msparallel_ds.integrations.hf_attention import use_cp_attention

    errs = {}
    for algo in MESHES:
        lay = _layout(world_size, algo)
        for name, lens in DOC_LENS.items():
            doc = doc_ids_from_position_ids(_positions(lens))
            doc_local = shard_sequence(doc, lay, algo=algo)
            for h_kv in (8, 2):
                for causal in (True, False):
                    (q, k, v, dout), ref = _reference(doc, h_kv, causal, seed=h_kv + causal)
                    loc = [shard_sequence(t, lay, algo=algo).requires_grad_() for t in (q, k, v)]
                    out = context_parallel_attention(*loc, lay, causal=causal, algo=algo, doc_ids=doc_local)
                    out.backward(shard_sequence(dout, lay, algo=algo))
                    got = (out.detach(), loc[0].grad, loc[1].grad, loc[2].grad)
                    e = [(a - shard_sequence(r, lay, algo=algo)).abs().max().item() for a, r in zip(got, ref)]
                    e.append((unshard_sequence(out, lay, algo=algo) - ref[0]).abs().max().item())
                    errs[(algo, name, h_kv, causal)] = e
        # ids that go back down are not contiguous documents: every rank sees the same gathered ids and raises
        bad = shard_sequence(torch.tensor([[0] * 10 + [1] * 20 + [0] * 34] * B), lay, algo=algo)
        q = shard_sequence(torch.randn(B, S, H, D), lay, algo=algo)
        with pytest.raises(ValueError, match=r"doc_ids must be non-decreasing along each row.*row 0 goes from 1 to 0 "
                                             r"at position 30"):
            context_parallel_attention(q, q, q, lay, algo=algo, doc_ids=bad)

    # HF Llama trained on packed rows: labels ignore each document's first token (DataCollatorWithFlattening)
    lens = DOC_LENS["uneven"]
    pos = _positions(lens)
    input_ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    labels = input_ids.masked_fill(pos == 0, -100)
    labels[1, 50] = -100
    ref, ref_grads = _hf_reference(input_ids, labels, lens)
    cu = torch.tensor([0, 5, 35, 64, 87, 89, 128])  # the same documents as flash-attn varlen boundaries
    for algo, docs in (("allgather", {"position_ids": pos}), ("ulysses", {"cu_seqlens": cu})):
        lay = _layout(world_size, algo)
        model = tiny_llama()
        use_cp_attention(model, lay, algo=algo)
        shard = shard_batch({"input_ids": input_ids, "labels": labels, **docs}, lay, algo=algo)
        assert set(shard) == {"input_ids", "position_ids", "shift_labels", "doc_ids"}, set(shard)
        logits = model(**shard).logits  # doc_ids reaches the attention through HF's **kwargs
        share = cp_token_loss(logits, shard["shift_labels"], lay)
        share.backward()
        err_grad = 0.0
        for n, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=lay.group("cp"))
            err_grad = max(err_grad, (grad - ref_grads[n]).abs().max().item())
        errs[("hf", algo)] = [abs(cp_mean_loss(share, lay).item() - ref.loss.item()),
                              (unshard_sequence(logits, lay, algo=algo) - ref.logits.detach()).abs().max().item(),
                              err_grad]
    return errs


@pytest.mark.distributed
def test_packed_sequences_match_block_diagonal_reference():
    worst = worst_over_ranks(run_distributed(_run, 4, timeout=300))
    for case, e in sorted(worst.items(), key=str):
        print(f"{case}: max abs err " + " / ".join(f"{x:.2e}" for x in e))
    assert len(worst) == len(MESHES) * len(DOC_LENS) * 4 + 2
    bad = {c: e for c, e in worst.items() if max(e) > TOL}
    assert not bad, f"errors above {TOL}: {bad}"


# ---------------------------------------------------------------------------------------------- one process
class _Layout:
    """Just enough of a ParallelLayout for code that fails (or shards) before any collective."""

    def __init__(self, ring=1, uly=1, cp_algo=None, cp_rank=0):
        self._sizes = {"cp_ring": ring, "cp_ulysses": uly, "cp": ring * uly}
        self._ranks = {"cp_ring": cp_rank // uly, "cp_ulysses": cp_rank % uly, "cp": cp_rank}
        self.plan = SimpleNamespace(cp_algo=cp_algo)

    def size(self, name):
        return self._sizes[name]

    def rank(self, name):
        return self._ranks[name]

    def group(self, name):
        raise AssertionError("no collective expected")


def _qkv(s=16):
    import torch

    return torch.randn(B, s, H, D), torch.randn(B, s, 2, D), torch.randn(B, s, 2, D)


@pytest.mark.parametrize("layout, algo, doc_ids, exc, match", [
    ((4, 1), "ring", lambda t: t.zeros(B, 16, dtype=t.long), ValueError,
     r"packed sequences \(doc_ids\) are not implemented for algo='ring'.*use algo='allgather' or algo='ulysses'"),
    ((2, 2), "hybrid", lambda t: t.zeros(B, 16, dtype=t.long), ValueError,
     r"not implemented for algo='hybrid' \(cp_ring=2\).*'allgather' or algo='ulysses'"),
    ((4, 1), "allgather", lambda t: t.zeros(B, 64, dtype=t.long), ValueError,
     r"doc_ids must have shape \[batch, s_local\] = \(2, 16\) like q, got \(2, 64\).*shard_sequence"),
    ((1, 4), "ulysses", lambda t: t.zeros(B, 16), TypeError,
     r"doc_ids must be an integer tensor \(torch.long\), got torch.float32"),
    ((1, 4), "ulysses", lambda t: [[0] * 16] * B, TypeError, r"doc_ids must be a torch.Tensor"),
])
def test_doc_ids_validation(layout, algo, doc_ids, exc, match):
    from msparallel_ds.context_parallel.api import context_parallel_attention

    import torch

    with pytest.raises(exc, match=match):
        context_parallel_attention(*_qkv(), _Layout(*layout), algo=algo, doc_ids=doc_ids(torch))


@pytest.mark.parametrize("algo, mesh", [("allgather", (4, 1)), ("ulysses", (1, 4))])
def test_shard_batch_doc_ids(algo, mesh):
    """doc_ids come from the FULL row (position_ids, cu_seqlens or given) and are sharded like every other entry."""
    import torch

    from msparallel_ds.context_parallel.api import shard_sequence
    from msparallel_ds.context_parallel.batch import (doc_ids_from_cu_seqlens, doc_ids_from_position_ids,
                                                      positions_from_doc_ids, shard_batch)

    pos = _positions(DOC_LENS["uneven"])
    doc = doc_ids_from_position_ids(pos)
    ids = torch.arange(B * S).view(B, S)
    cu = torch.tensor([0, 5, 35, 64, 87, 89, 128])
    cu_doc = doc_ids_from_cu_seqlens(cu, B, S)
    assert torch.equal(positions_from_doc_ids(cu_doc), pos) and torch.equal(positions_from_doc_ids(doc), pos)
    for rank in range(4):
        lay = _Layout(*mesh, cp_algo=algo, cp_rank=rank)
        want_doc, want_pos = shard_sequence(doc, lay), shard_sequence(pos, lay)
        by_pos = shard_batch({"input_ids": ids, "position_ids": pos}, lay)
        by_cu = shard_batch({"input_ids": ids, "cu_seq_lens_q": cu, "max_length_q": 39}, lay)
        by_ids = shard_batch({"input_ids": ids, "doc_ids": doc + 7}, lay)
        assert torch.equal(by_pos["doc_ids"], want_doc) and torch.equal(by_pos["position_ids"], want_pos)
        assert set(by_cu) == {"input_ids", "position_ids", "doc_ids"}  # varlen metadata is not passed on
        assert torch.equal(by_cu["position_ids"], want_pos)
        assert torch.equal(by_cu["doc_ids"], shard_sequence(cu_doc, lay))
        assert torch.equal(by_ids["position_ids"], want_pos) and torch.equal(by_ids["doc_ids"], want_doc + 7)
        assert "doc_ids" not in shard_batch({"input_ids": ids, "position_ids": torch.arange(S).expand(B, S)}, lay)
    with pytest.raises(ValueError, match=r"cu_seqlens must increase from 0 to batch\*seq_len = 128 and include every "
                                         r"row start \[0, 64, 128\]"):
        shard_batch({"input_ids": ids, "cu_seqlens": torch.tensor([0, 5, 70, 128])}, _Layout(4, 1, "allgather"))
    with pytest.raises(ValueError, match=r"doc_ids must have the batch's shape \[batch, seq\] = \(2, 64\)"):
        shard_batch({"input_ids": ids, "doc_ids": doc[:, :8]}, _Layout(4, 1, "allgather"))


def test_hf_attention_rejects_packed_position_ids_without_doc_ids():
    """Restarting position_ids without doc_ids would silently attend across documents: a clear error instead."""
    import torch

    from msparallel_ds.integrations.hf_attention import make_cp_attention

    fn = make_cp_attention(_Layout(4, 1, "allgather", cp_rank=2), algo="allgather")
    q = torch.randn(B, H, 16, D)
    module = SimpleNamespace(training=True, is_causal=True)
    with pytest.raises(ValueError, match=r"position_ids restart at 0 inside the sequence but no doc_ids.*shard_batch"):
        fn(module, q, q[:, :2], q[:, :2], None, position_ids=torch.arange(16).expand(B, 16))
    fn0 = make_cp_attention(_Layout(4, 1, "allgather", cp_rank=0), algo="allgather")
    with pytest.raises(ValueError, match=r"position_ids restart at 0 inside the sequence"):
        fn0(module, q, q[:, :2], q[:, :2], None, position_ids=torch.tensor([[0, 1, 2, 0] + list(range(12))] * B))
