"""The family adapter's attention in row blocks (what fine_grain_interleave runs per token chunk): query rows
[a, b) against keys [0, b) give the same output and the same q/k/v gradients as the whole sequence's attention,
for sdpa (HF passes no mask: the causal block mask is built) and eager (HF's mask is cut), with and without a
padding mask; cp backends are whole-sequence only. Single process, tiny Llama."""
import pytest

SEQ = 24
BLOCKS = [(0, 6), (6, 12), (12, 18), (18, 24)]


def _layer_inputs(impl, padded):
    """(parts, q, k, v, kw): layer 0's adapter parts, its q/k/v projections of a real hidden state and the
    kwargs HF hands the decoder layer."""
    import torch

    from msparallel_ds.models import adapter_for
    from msparallel_ds.tiny import VOCAB, tiny_llama

    model = tiny_llama(num_hidden_layers=1, attn_implementation=impl)
    seen = {}
    layer = model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda m, a, kw: seen.update(h=a[0] if a else kw["hidden_states"],
                                                                         kw=kw), with_kwargs=True)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if padded:
        mask[1, :5] = 0  # left padding in row 1
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    hook.remove()
    kw = {k: v for k, v in seen["kw"].items() if k != "hidden_states"}
    parts = adapter_for(model).layer_parts(layer)
    x = parts.input_norm(seen["h"]).detach()
    q, k, v = (m(x).detach().requires_grad_() for m in parts.qkv)
    return parts, q, k, v, kw


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
def test_row_blocks_equal_the_whole_attention(impl, padded):
    import torch

    parts, q, k, v, kw = _layer_inputs(impl, padded)
    assert parts.row_blocks()
    assert (kw.get("attention_mask") is None) == (impl == "sdpa" and not padded)  # both mask paths covered
    whole = parts.attend(*parts.heads(q, k, v, kw), kw)
    dout = torch.randn(whole.shape, generator=torch.Generator().manual_seed(2))
    rows = slice(None) if not padded else slice(5, None)
    # padded queries see no key: what attention gives them is arbitrary (HF's eager and sdpa differ too); nothing
    # reaches them from the loss when pad labels are ignored (-100), so no gradient comes back from them either
    dout[1, :rows.start or 0] = 0
    ref = torch.autograd.grad(whole, (q, k, v), dout)
    heads = parts.heads(q, k, v, kw)
    blocks = torch.cat([parts.attend(*heads, kw, rows) for rows in BLOCKS[::-1]][::-1], 1)  # any order
    got = torch.autograd.grad(blocks, (q, k, v), dout)
    torch.testing.assert_close(blocks[0], whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocks[1, rows], whole[1, rows], rtol=1e-5, atol=1e-6)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_a_block_sees_no_later_key():
    """Negative control for the built mask: changing keys after a block's rows leaves its output unchanged."""
    import torch

    parts, q, k, v, kw = _layer_inputs("sdpa", False)
    a, b = BLOCKS[1]
    out = parts.attend(*parts.heads(q, k, v, kw), kw, (a, b))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, b:] += 1.0
    v2[:, b:] -= 1.0
    torch.testing.assert_close(parts.attend(*parts.heads(q, k2, v2, kw), kw, (a, b)), out)
    k2[:, b - 1] += 1.0  # the block's own last key changes its last row
    assert not torch.allclose(parts.attend(*parts.heads(q, k2, v2, kw), kw, (a, b))[:, -1], out[:, -1])


def test_cp_backend_runs_whole_sequences():
    from msparallel_ds.models import adapter_for
    from msparallel_ds.tiny import tiny_llama

    model = tiny_llama(num_hidden_layers=1, attn_implementation="sdpa")
    parts = adapter_for(model).layer_parts(model.model.layers[0])
    model.config._attn_implementation = "msparallel_cp"  # what parallelize sets for cp > 1
    assert not parts.row_blocks()
