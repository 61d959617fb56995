"""The public context-parallel API: context_parallel_attention and shard_sequence / unshard_sequence.

Layouts come from stand-in plans (SimpleNamespace with mesh and cp_algo) and from real MindFormers configs through
load_config -> init_parallel. Every algorithm is compared with single-process SDPA on the full sequence (output,
dq/dk/dv); validation errors are checked in one process with a layout stand-in (they fail before communicating).
"""
import math
from types import SimpleNamespace

import pytest

from harness import run_distributed, worst_over_ranks

TOL = 1e-4
B, H, D = 2, 8, 16
DIMS = ("pp", "dp", "cp_ring", "cp_ulysses", "tp")


def _config(cp, algo, ulysses=None, ring_attention=False):
    pc = {"data_parallel": 1, "model_parallel": 1, "context_parallel": cp, "context_parallel_algo": algo}
    if ulysses:
        pc["ulysses_degree_in_cp"] = ulysses
    cfg = {"parallel_config": pc}
    if ring_attention:
        cfg["model"] = {"model_config": {"use_ring_attention": True}}
    return cfg


def _stand_in(mesh, cp_algo="absent"):
    ns = SimpleNamespace(world_size=math.prod(mesh), mesh=dict(zip(DIMS, mesh)))
    if cp_algo != "absent":
        ns.cp_algo = cp_algo
    return ns


# (label, how to build the layout, algo passed to the API, algo it must resolve to)
CASES_4 = [
    ("cfg hybrid_cp u2", ("config", _config(4, "hybrid_cp", 2)), None, "hybrid"),
    ("cfg ulysses_cp", ("config", _config(4, "ulysses_cp")), None, "ulysses"),
    ("cfg colossalai_cp", ("config", _config(4, "colossalai_cp")), None, "allgather"),
    ("cfg colossalai_cp+ring", ("config", _config(4, "colossalai_cp", ring_attention=True)), None, "ring"),
    ("plan 2x2 no cp_algo", ("plan", _stand_in((1, 1, 2, 2, 1))), None, "hybrid"),
    ("plan 4x1 cp_algo None", ("plan", _stand_in((1, 1, 4, 1, 1), None)), None, "ring"),
    ("plan 2x2 allgather override", ("plan", _stand_in((1, 1, 2, 2, 1), "hybrid")), "allgather", "allgather"),
    ("plan dp2 x ring2", ("plan", _stand_in((1, 2, 2, 1, 1), "ring")), None, "ring"),
]
CASES_2 = [
    ("cfg hybrid_cp u2", ("config", _config(2, "hybrid_cp", 2)), None, "hybrid"),
    ("cfg ulysses_cp", ("config", _config(2, "ulysses_cp")), None, "ulysses"),
    ("cfg colossalai_cp", ("config", _config(2, "colossalai_cp")), None, "allgather"),
    ("cfg colossalai_cp+ring", ("config", _config(2, "colossalai_cp", ring_attention=True)), None, "ring"),
    ("plan 1x2 ulysses alias", ("plan", _stand_in((1, 1, 1, 2, 1), "ulysses")), "ulysses_cp", "ulysses"),
]


def _full(s, h_kv, causal, seed=0):
    """Full [b, s, h, d] tensors and SDPA's out / grads in the same layout (kv repeated for GQA)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, s, n, D, generator=g) for n in (H, h_kv, h_kv))
    dout = torch.randn(B, s, H, D, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    rep = H // h_kv
    out = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2).repeat_interleave(rep, 1),
                                         vr.transpose(1, 2).repeat_interleave(rep, 1), is_causal=causal)
    out = out.transpose(1, 2)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def _run(rank, world_size, cases, seq_len):
    import torch

    import msparallel_ds as msp
    from msparallel_ds.context_parallel.api import (context_parallel_attention, resolve_algo, shard_sequence,
                                                    unshard_sequence)

    results = {}
    for label, (kind, spec), algo, expected in cases:
        lay = msp.init_parallel(msp.load_config(spec) if kind == "config" else spec)
        assert resolve_algo(lay, algo) == expected, (label, resolve_algo(lay, algo))

        for h_kv in (8, 2):
            for causal in (True, False):
                (q, k, v, dout), ref = _full(seq_len, h_kv, causal)
                loc = [shard_sequence(t, lay, dim=1, algo=algo).requires_grad_() for t in (q, k, v)]
                out = context_parallel_attention(*loc, lay, causal=causal, algo=algo)
                assert out.shape == loc[0].shape
                out.backward(shard_sequence(dout, lay, dim=1, algo=algo))
                got = (out.detach(), loc[0].grad, loc[1].grad, loc[2].grad)
                errs = [(a - shard_sequence(r, lay, dim=1, algo=algo)).abs().max().item() for a, r in zip(got, ref)]
                # the whole output, reassembled from every rank
                errs.append((unshard_sequence(out, lay, dim=1, algo=algo) - ref[0]).abs().max().item())
                results[(label, h_kv, causal)] = tuple(errs)

        # shard/unshard round trip: int tokens, another dim, a negative dim
        ids = torch.arange(3 * seq_len).view(3, seq_len)
        part = shard_sequence(ids, lay, algo=algo)
        assert part.shape == (3, seq_len // lay.size("cp"))
        assert torch.equal(unshard_sequence(part, lay, algo=algo), ids)
        x = torch.randn(2, 3, seq_len, 5, generator=torch.Generator().manual_seed(1))  # same on every rank
        assert torch.equal(unshard_sequence(shard_sequence(x, lay, 2, algo), lay, -2, algo), x)
        # a length that does not divide: one clear error, or padding when asked for
        if lay.size("cp") > 1:
            with pytest.raises(ValueError, match="sequence length 31 is not divisible"):
                shard_sequence(torch.zeros(1, 31), lay, algo=algo)
            padded = unshard_sequence(shard_sequence(torch.ones(1, 31), lay, algo=algo, pad=True, pad_value=-1),
                                      lay, algo=algo)
            assert padded.shape[1] % lay.size("cp") == 0 and padded.shape[1] >= 31
            assert torch.equal(padded[:, :31], torch.ones(1, 31)) and bool((padded[:, 31:] == -1).all())
    return results


def _check(per_rank):
    worst = worst_over_ranks(per_rank)
    for case, errs in worst.items():
        print(f"{case}: max abs err out/dq/dk/dv/unsharded-out = " + " / ".join(f"{e:.2e}" for e in errs))
    bad = {c: e for c, e in worst.items() if max(e) > TOL}
    assert not bad, f"errors above {TOL}: {bad}"
    return worst


@pytest.mark.distributed
def test_api_parity_4_ranks():
    assert len(_check(run_distributed(_run, 4, CASES_4, 64, timeout=170))) == 4 * len(CASES_4)


@pytest.mark.distributed
def test_api_parity_2_ranks():
    assert len(_check(run_distributed(_run, 2, CASES_2, 32, timeout=120))) == 4 * len(CASES_2)


# ---------------------------------------------------------------------------------------------- one process
class _Layout:
    """Just enough of a ParallelLayout for checks that fail before any collective (and cp == 1 runs)."""

    def __init__(self, ring=1, uly=1, cp_algo=None):
        self._sizes = {"cp_ring": ring, "cp_ulysses": uly, "cp": ring * uly}
        self.plan = SimpleNamespace(cp_algo=cp_algo)

    def size(self, name):
        return self._sizes[name]

    def rank(self, name):
        return 0

    def group(self, name):
        raise AssertionError("no collective expected")


def _qkv(s=8, h=8, h_kv=2, dtype=None):
    import torch

    dtype = dtype or torch.float32
    return torch.randn(B, s, h, D, dtype=dtype), torch.randn(B, s, h_kv, D, dtype=dtype), \
        torch.randn(B, s, h_kv, D, dtype=dtype)


def test_layout_without_cp_is_an_error():
    from msparallel_ds.context_parallel.api import context_parallel_attention, shard_sequence, unshard_sequence

    lay = _Layout()
    q, k, v = _qkv(s=16)
    with pytest.raises(ValueError, match="needs a layout with context_parallel > 1, this one has cp=1"):
        context_parallel_attention(q, k, v, lay)
    assert shard_sequence(q, lay) is q and unshard_sequence(q, lay) is q


@pytest.mark.parametrize("args, exc, match", [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-D \[batch, s_local, heads, head_dim\]; got shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"q has batch=2, s_local=8 but k/v have batch=1"),
    (lambda q, k, v: (q, k[:, :4], v[:, :4]), ValueError, r"s_local=8 but k/v have batch=2, s_local=4"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, r"head_dim differs: q has 16, k/v have 8"),
    (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, r"k and v must have the same shape"),
    (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)), ValueError,
     r"num_heads=8 must be a multiple of num_kv_heads=3"),
    (lambda q, k, v: (q, k.double(), v), TypeError, r"share one dtype; got q torch.float32, k torch.float64"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, r"floating-point tensor, got torch.int64"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor, got ndarray"),
])
def test_input_validation(args, exc, match):
    from msparallel_ds.context_parallel.api import context_parallel_attention

    with pytest.raises(exc, match=match):
        context_parallel_attention(*args(*_qkv()), _Layout(2, 2))


def test_layout_and_algo_validation():
    from msparallel_ds.context_parallel.api import context_parallel_attention, resolve_algo, shard_sequence

    q, k, v = _qkv()
    with pytest.raises(TypeError, match="layout must be a ParallelLayout.*init_parallel"):
        context_parallel_attention(q, k, v, None)
    with pytest.raises(ValueError, match="unknown context-parallel algo 'zigzag'; use one of allgather, ring"):
        context_parallel_attention(q, k, v, _Layout(2, 2), algo="zigzag")
    with pytest.raises(ValueError, match=r"algo='ring' runs over cp_ring.*cp_ring=2 x cp_ulysses=2.*'hybrid'"):
        context_parallel_attention(q, k, v, _Layout(2, 2), algo="ring")
    with pytest.raises(ValueError, match=r"algo='ulysses' runs over cp_ulysses.*cp_ring=4 x cp_ulysses=1"):
        shard_sequence(q, _Layout(4, 1), algo="ulysses")
    # default: the plan's algo, else ring / hybrid from the mesh; MindFormers spellings accepted
    assert resolve_algo(_Layout(2, 2, "allgather")) == "allgather"
    assert resolve_algo(_Layout(4, 1)) == "ring" and resolve_algo(_Layout(2, 2)) == "hybrid"
    assert resolve_algo(_Layout(2, 2), "hybird_cp") == "hybrid"
    assert resolve_algo(_Layout(4, 1), "colossalai_cp") == "allgather"
    # Ulysses head rule, checked before the all-to-all: numbers and the nearest valid degrees
    with pytest.raises(ValueError, match=r"num_kv_heads=3 and the Ulysses degree 2.*nearest: 1 or 3"):
        context_parallel_attention(*_qkv(h=6, h_kv=3), _Layout(1, 2))
    # an odd local length cannot be a zigzag shard (two chunks per ring rank)
    with pytest.raises(ValueError, match=r"s_local=7 x cp=4 = 28 tokens: sequence length 28 is not divisible by "
                                         r"2\*ring\*ulysses = 8.*shard_sequence"):
        context_parallel_attention(*_qkv(s=7), _Layout(2, 2))
    with pytest.raises(ValueError, match="dim=3 is out of range for a 2-D tensor"):
        shard_sequence(q[:, :, 0, 0], _Layout(2, 1), dim=3)
