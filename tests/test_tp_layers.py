"""Tensor/sequence/vocab-parallel layers on 4 gloo processes against the unsharded torch modules (fp32).

Every rank builds the same full modules and data from fixed seeds (data differs per dp rank), shards them with
from_linear / from_embedding, runs forward + backward, and compares the output, the input grad and the weight grads
(shards all-gathered) with the single-process module's. Meshes: tp=4, and tp=2 inside dp2 x tp2.
"""
from types import SimpleNamespace

import pytest

from harness import run_distributed, worst_over_ranks

TOL = 1e-5  # fp32; errors are relative where the reference exceeds 1 (see _err)
DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")
MESHES = {"tp4": (1, 1, 1, 1, 4), "dp2xtp2": (1, 2, 1, 1, 2)}
B, S, H, FFN, V = 2, 8, 16, 32, 64


def _layout(mesh):
    from msparallel_ds.distributed import init_parallel

    return init_parallel(SimpleNamespace(world_size=4, mesh=dict(zip(DIMS, mesh))))


def _randn(*shape, seed):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _err(got, want):
    """Max abs error, relative to the reference's scale when that exceeds 1 (a loss summed over tokens)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _mlp(lay, act, bias, sp, seq_dim=1, variant="", seed=0):
    """Column -> act -> Row vs nn.Linear pair: errors of output, input grad, and the four weight/bias grads."""
    import torch
    from torch import nn

    from msparallel_ds.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from msparallel_ds.distributed.collectives import all_gather_along

    group, n, i = lay.group("tp"), lay.size("tp"), lay.rank("tp")
    torch.manual_seed(seed)  # same weights on every rank
    fc1, fc2 = nn.Linear(H, FFN, bias=bias), nn.Linear(FFN, H, bias=bias)
    shape = (S, B, H) if seq_dim == 0 else (B, S, H)
    data_seed = seed + 100 * lay.rank("dp")  # each dp rank has its own batch
    x, dout = _randn(*shape, seed=data_seed + 1), _randn(*shape, seed=data_seed + 2)
    xr = x.clone().requires_grad_()
    ref = fc2(act(fc1(xr)))
    ref.backward(dout)

    col_kw = {"gather_output": True} if variant == "gathered" else {}
    row_kw = {"input_is_parallel": False} if variant == "gathered" else {}
    col = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sp, seq_dim=seq_dim, **col_kw)
    row = RowParallelLinear.from_linear(fc2, group, sequence_parallel=sp, seq_dim=seq_dim, **row_kw)
    mine = (lambda t: t.chunk(n, seq_dim)[i]) if sp else (lambda t: t)  # SP: this rank's sequence slice
    xl = mine(x).clone().requires_grad_()
    y = row(act(col(xl)))
    y.backward(mine(dout))

    errs = [_err(y, mine(ref)), _err(xl.grad, mine(xr.grad)),
            _err(all_gather_along(col.weight.grad, group, 0), fc1.weight.grad),
            _err(all_gather_along(row.weight.grad, group, 1), fc2.weight.grad)]
    if bias:  # column bias is sharded; row bias is replicated (under SP its partial grads are summed by autograd)
        errs += [_err(all_gather_along(col.bias.grad, group, 0), fc1.bias.grad), _err(row.bias.grad, fc2.bias.grad)]
    return tuple(errs), col, row, fc1


def _check_layer_shapes(col, row, fc1, n, bias):
    import torch

    names = {"weight", "bias"} if bias else {"weight"}
    assert set(col.state_dict()) == names and set(row.state_dict()) == names  # HF keys map back
    assert col.weight.shape == (FFN // n, H) and row.weight.shape == (H, FFN // n)
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0 and row.weight.partition_dim == 1
    if bias:
        assert col.bias.shape == (FFN // n,) and col.bias.tensor_model_parallel
        assert row.bias.shape == (H,) and not hasattr(row.bias, "tensor_model_parallel")  # replicated
    # a clean copy: the shard owns just its own bytes, and does not follow the full weight
    assert col.weight.untyped_storage().nbytes() == col.weight.numel() * 4
    assert row.weight.untyped_storage().nbytes() == row.weight.numel() * 4 and row.weight.is_contiguous()
    before = col.weight.detach().clone()
    with torch.no_grad():
        fc1.weight.add_(1.0)
    assert torch.equal(col.weight.detach(), before)


def _embedding(lay, padding_idx, sp, seed):
    import torch
    from torch import nn

    from msparallel_ds.tensor_parallel import VocabParallelEmbedding
    from msparallel_ds.distributed.collectives import all_gather_along

    group, n, i = lay.group("tp"), lay.size("tp"), lay.rank("tp")
    torch.manual_seed(seed)
    emb = nn.Embedding(V, H, padding_idx=padding_idx)
    g = torch.Generator().manual_seed(seed + lay.rank("dp"))
    ids = torch.randint(0, V, (B, S), generator=g)
    ids[0, :4] = torch.tensor([0, V - 1, V // n, 5 if padding_idx is None else padding_idx % V])  # shard edges, pad
    dout = _randn(B, S, H, seed=seed + 7)
    ref = emb(ids)
    ref.backward(dout)

    pe = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=sp)
    assert set(pe.state_dict()) == {"weight"} and pe.weight.shape == (V // n, H)
    mine = (lambda t: t.chunk(n, 1)[i]) if sp else (lambda t: t)
    out = pe(ids)
    out.backward(mine(dout))
    full_grad = all_gather_along(pe.weight.grad, group, 0)
    if padding_idx is not None:
        assert not full_grad[padding_idx % V].any()  # the padding row gets no gradient, as in nn.Embedding
    return _err(out, mine(ref)), _err(full_grad, emb.weight.grad)


def _cross_entropy(lay, reduction, ignore_index, seed, dtype=None):
    import torch
    import torch.nn.functional as F

    from msparallel_ds.tensor_parallel import vocab_parallel_cross_entropy

    group, n, i = lay.group("tp"), lay.size("tp"), lay.rank("tp")
    g = torch.Generator().manual_seed(seed + lay.rank("dp"))
    full = torch.randn(B, S, V, generator=g) * 3
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, :3] = torch.tensor([0, V - 1, V // n])  # first and last ids of shards
    target[1, :3] = ignore_index  # ignored tokens (with ignore_index=7 they are real ids too)
    upstream = torch.rand(B, S, generator=g) if reduction == "none" else torch.tensor(1.3)
    if dtype is not None:
        full = full.to(dtype).float()  # the reference sees the same (rounded) values
    fr = full.clone().requires_grad_()
    ref = F.cross_entropy(fr.view(-1, V), target.view(-1), ignore_index=ignore_index, reduction=reduction)
    ref = ref.view(B, S) if reduction == "none" else ref
    ref.backward(upstream)

    shard = full.chunk(n, -1)[i].to(dtype or torch.float32).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, group, ignore_index=ignore_index, reduction=reduction)
    loss.backward(upstream)
    assert loss.dtype == torch.float32 and shard.grad.dtype == shard.dtype
    if reduction == "none":
        assert (loss[1, :3] == 0).all()
    return _err(loss, ref), _err(shard.grad.float(), fr.grad.chunk(n, -1)[i])


def _lm_head(lay, sp, seed):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from msparallel_ds.tensor_parallel import ParallelLMHead
    from msparallel_ds.distributed.collectives import all_gather_along

    group, n, i = lay.group("tp"), lay.size("tp"), lay.rank("tp")
    torch.manual_seed(seed)
    lm = nn.Linear(H, V, bias=False)
    g = torch.Generator().manual_seed(seed + lay.rank("dp"))
    h = torch.randn(B, S, H, generator=g)
    target = torch.randint(0, V, (B, S), generator=g)
    target[:, -1] = -100
    hr = h.clone().requires_grad_()
    ref_logits = lm(hr)
    ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1))
    ref.backward()

    head = ParallelLMHead.from_linear(lm, group, sequence_parallel=sp)
    hl = (h.chunk(n, 1)[i] if sp else h).clone().requires_grad_()
    loss = head.loss(hl, target)
    loss.backward()
    with torch.no_grad():
        logits = head.gather_logits(head(hl))
    return (_err(loss, ref), _err(hl.grad, hr.grad.chunk(n, 1)[i] if sp else hr.grad),
            _err(all_gather_along(head.weight.grad, group, 0), lm.weight.grad), _err(logits, ref_logits))


def _errors_are_clear(lay):
    import torch
    from torch import nn

    from msparallel_ds.tensor_parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                               VocabParallelEmbedding, vocab_parallel_cross_entropy)

    group, n = lay.group("tp"), lay.size("tp")
    with pytest.raises(ValueError, match=rf"ColumnParallelLinear: out_features=9 is not divisible by the "
                                         rf"tensor-parallel size tp={n}"):
        ColumnParallelLinear.from_linear(nn.Linear(8, 9), group)
    with pytest.raises(ValueError, match=rf"RowParallelLinear: in_features=9 is not divisible .* tp={n}"):
        RowParallelLinear(9, 8, True, group)
    with pytest.raises(ValueError, match=rf"num_embeddings \(vocab size\)=65 is not divisible .* tp={n}.*"
                                         rf"pad_to_multiple_of=tp.*vocab_emb_dp: true"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(65, 8), group)
    with pytest.raises(ValueError, match=rf"ParallelLMHead: out_features=65 is not divisible .* tp={n}.*"
                                         rf"resize_token_embeddings"):
        ParallelLMHead.from_linear(nn.Linear(8, 65, bias=False), group)
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), group, reduction="avg")
    with pytest.raises(ValueError, match=r"logits shard \(2, 4\) and target \(3,\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), group)
    row = RowParallelLinear(8, 8, False, group, sequence_parallel=True)  # SP needs the sequence divisible by tp
    with pytest.raises(ValueError, match=rf"has size 5, which is not divisible by the group size {n}"):
        row(torch.ones(1, 5, 8 // n))
    # fresh layers draw from nn.Linear's distribution with the FULL fan-in (not the shard's)
    fresh = RowParallelLinear(64, 8, True, group)
    assert fresh.weight.abs().max() <= 64 ** -0.5 and fresh.weight.abs().max() > 0.5 * 64 ** -0.5
    emb = VocabParallelEmbedding(V, 8, group, padding_idx=V - 1)
    assert emb.weight.shape == (V // n, 8) and (emb.weight[-1].any().item() == (lay.rank("tp") != n - 1))


def _cases(rank, world_size):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from msparallel_ds.tensor_parallel import vocab_parallel_cross_entropy

    errors = {}
    for name, mesh in MESHES.items():
        lay = _layout(mesh)
        n = lay.size("tp")
        for sp in (False, True):
            for bias in (False, True):
                for act_name, act in (("gelu", F.gelu), ("silu", F.silu)):
                    errs, col, row, fc1 = _mlp(lay, act, bias, sp, seed=len(errors))
                    errors[(name, "mlp", act_name, f"bias={bias}", f"sp={sp}")] = errs
                    _check_layer_shapes(col, row, fc1, n, bias)
        errors[(name, "mlp", "gelu", "bias=True", "sp=True", "seq_dim=0")] = _mlp(lay, F.gelu, True, True, 0)[0]
        errors[(name, "mlp", "silu", "gather_output+scatter_input")] = _mlp(lay, F.silu, True, False,
                                                                             variant="gathered")[0]
        for padding_idx in (None, 5, -1):
            for sp in (False, True):
                errors[(name, "embedding", f"padding_idx={padding_idx}", f"sp={sp}")] = _embedding(
                    lay, padding_idx, sp, seed=len(errors))
        for reduction in ("mean", "sum", "none"):
            for ignore_index in (-100, 7):
                errors[(name, "ce", reduction, f"ignore_index={ignore_index}")] = _cross_entropy(
                    lay, reduction, ignore_index, seed=len(errors))
        for sp in (False, True):
            errors[(name, "lm_head", f"sp={sp}")] = _lm_head(lay, sp, seed=len(errors))

        # bf16 logits: fp32 math inside, fp32 loss, bf16 grad (rounded once)
        loss_err, grad_err = _cross_entropy(lay, "mean", -100, seed=99, dtype=torch.bfloat16)
        assert loss_err < TOL and grad_err < 1e-3, (loss_err, grad_err)
        # every token ignored: nan like F.cross_entropy's mean; 0 with sum
        t = torch.full((2, 3), -100)
        assert vocab_parallel_cross_entropy(torch.randn(2, 3, V // n), t, lay.group("tp")).isnan()
        assert vocab_parallel_cross_entropy(torch.randn(2, 3, V // n), t, lay.group("tp"), reduction="sum") == 0
        _errors_are_clear(lay)
        dist.barrier()
    return errors


@pytest.mark.distributed
def test_layers_match_unsharded_modules():
    per_rank = run_distributed(_cases, 4, timeout=110)
    worst = worst_over_ranks(per_rank)
    for kind in ("mlp", "embedding", "ce", "lm_head"):
        errs = [e for c, e in worst.items() if c[1] == kind]
        print(f"{kind}: {len(errs)} cases, max abs err {max(max(e) for e in errs):.2e}")
    bad = {c: e for c, e in worst.items() if max(e) > TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    assert len(worst) == 2 * (8 + 2 + 6 + 6 + 2)
