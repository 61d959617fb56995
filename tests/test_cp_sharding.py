"""Context-parallel token order (sharding.py): zigzag over ring, contiguous over Ulysses, single process."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msparallel_ds.context_parallel import sharding as sh


def _all(seq_len, ring, ulysses):
    return [sh.shard_indices(seq_len, ring, ulysses, r, u) for r in range(ring) for u in range(ulysses)]


@settings(max_examples=60, deadline=None)
@given(ring=st.integers(1, 5), ulysses=st.integers(1, 5), mult=st.integers(1, 3))
def test_indices_partition_the_sequence_and_increase_per_chunk(ring, ulysses, mult):
    seq_len = sh.required_multiple(ring, ulysses) * mult
    idx = _all(seq_len, ring, ulysses)
    assert torch.equal(torch.cat(idx).sort().values, torch.arange(seq_len))  # a permutation of range(S)
    assert len({len(i) for i in idx}) == 1  # equal shards
    chunk = seq_len // (2 * ring) if ring > 1 else seq_len // ulysses
    for r in range(ring):
        seg = torch.cat(idx[r * ulysses:(r + 1) * ulysses])  # a ring rank's whole segment (Ulysses gathered)
        assert (seg[1:] > seg[:-1]).all()  # positions inside a rank's segment increase
        if ring > 1:  # ... and it is exactly zigzag chunks r and 2R-1-r
            want = torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                              torch.arange((2 * ring - 1 - r) * chunk, (2 * ring - r) * chunk)])
            assert torch.equal(seg, want)
    for i in idx:  # increasing within each zigzag chunk it touches
        for c in i.div(chunk, rounding_mode="floor").unique():
            part = i[i.div(chunk, rounding_mode="floor") == c]
            assert (part[1:] - part[:-1] == 1).all()


def test_known_layouts():
    # ring 2: chunks of 2; rank 0 -> chunks 0, 3; rank 1 -> chunks 1, 2
    assert sh.shard_indices(8, 2, 1, 0, 0).tolist() == [0, 1, 6, 7]
    assert sh.shard_indices(8, 2, 1, 1, 0).tolist() == [2, 3, 4, 5]
    # pure Ulysses: contiguous
    assert sh.shard_indices(8, 1, 4, 0, 2).tolist() == [4, 5]
    # hybrid ring 2 x ulysses 2: ring rank 0's segment [0, 1, 6, 7] split in two contiguous pieces
    assert sh.shard_indices(16, 2, 2, 0, 0).tolist() == [0, 1, 2, 3]
    assert sh.shard_indices(16, 2, 2, 0, 1).tolist() == [12, 13, 14, 15]
    assert sh.shard_indices(16, 2, 2, 1, 1).tolist() == [8, 9, 10, 11]
    # odd Ulysses degree: a piece may straddle the two zigzag chunks
    assert sh.shard_indices(12, 2, 3, 0, 1).tolist() == [2, 9]
    assert sh.permutation(8, 2, 1).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("ring,ulysses", [(1, 1), (1, 4), (2, 1), (4, 1), (2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("dim", [0, 1, -2])
def test_shard_unshard_round_trip(ring, ulysses, dim):
    seq_len = sh.required_multiple(ring, ulysses) * 2
    shape = [3, 5, 4]
    shape[dim] = seq_len
    x = torch.randn(shape)
    pieces = [sh.shard(x, dim, ring, ulysses, r, u) for r in range(ring) for u in range(ulysses)]
    for (r, u), p in zip([(r, u) for r in range(ring) for u in range(ulysses)], pieces):
        assert torch.equal(p, x.index_select(dim, sh.shard_indices(seq_len, ring, ulysses, r, u)))
    assert torch.equal(sh.unshard(pieces, dim, ring, ulysses), x)
    gathered = torch.cat(pieces, dim)  # what an all-gather along dim returns
    assert torch.equal(sh.unshard(gathered, dim, ring, ulysses), x)
    assert torch.equal(gathered.index_select(dim, sh.inverse_permutation(seq_len, ring, ulysses)), x)
    assert torch.equal(x.index_select(dim, sh.permutation(seq_len, ring, ulysses)), gathered)


def test_shard_keeps_autograd():
    x = torch.randn(2, 16, requires_grad=True)
    sh.shard(x, 1, 4, 1, 1, 0).sum().backward()
    assert x.grad.sum().item() == 8 and x.grad[0, 2:4].tolist() == [1, 1] and x.grad[0, 12:14].tolist() == [1, 1]


def test_not_divisible_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^sequence length 100 is not divisible by 2\*ring\*ulysses = 8 \(zigzag "
                                         r"over 4 context-parallel ranks\); pad to a multiple of 8 or pass pad=True$"):
        sh.check_divisible(100, 4, 1)
    with pytest.raises(ValueError, match=r"not divisible by 2\*ring\*ulysses = 16 \(zigzag over 8 .*multiple of 16"):
        sh.shard(torch.zeros(1, 24), 1, 2, 4, 0, 0)
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by ulysses = 4 \(contiguous split"):
        sh.shard_indices(10, 1, 4, 0, 0)
    with pytest.raises(ValueError, match="out of range"):
        sh.shard_indices(16, 2, 1, 2, 0)
    with pytest.raises(ValueError, match="expected 4 shards"):
        sh.unshard([torch.zeros(4)] * 3, 0, 4, 1)
    with pytest.raises(ValueError, match="positive"):
        sh.check_divisible(8, 0, 1)
    sh.check_divisible(96, 4, 3)  # 96 = 24 * 4


def test_pad_to_multiple():
    ids = torch.arange(10).view(1, 10)
    p = sh.pad_to_multiple(ids, 1, 8, value=-100)
    assert p.shape == (1, 16) and p.dtype == ids.dtype and p[0, 10:].tolist() == [-100] * 6
    assert torch.equal(p[:, :10], ids)
    x = torch.randn(2, 6, 3)
    assert sh.pad_to_multiple(x, 1, 4).shape == (2, 8, 3) and sh.pad_to_multiple(x, -2, 4).shape == (2, 8, 3)
    assert sh.pad_to_multiple(x, 1, 3) is x
    sh.check_divisible(sh.pad_to_multiple(x, 1, sh.required_multiple(2, 1)).shape[1], 2, 1)
