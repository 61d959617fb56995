"""The tensor-core fragment addressing of ops/*.cu against the PTX ISA's layouts, emulated in numpy (CPU only).

ldmatrix.x4: lane L gives the address of row L % 8 of 8x8 matrix L // 8 and receives, from matrix i, register i =
(row L // 4, cols 2(L % 4), +1); with .trans (rows 2(L % 4), +1; col L // 4). mma.m16n8k16: A a0 (g, 2t..),
a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B b0 (k 2t.., n g), b1 (k 2t+8.., n g); C c0,c1 (g, 2t..),
c2,c3 (g+8, 2t..), with g = lane // 4, t = lane % 4. Each pattern below is an address formula copied from the
kernels (keep them in sync); the test proves it yields the operand the kernel means.
"""
import numpy as np
import pytest

LDS = 72  # a padded 64-column shared-memory tile


def _ldmatrix_x4(smem, addr, trans=False):
    mats = [np.array([smem[addr[8 * i + r][0], addr[8 * i + r][1]: addr[8 * i + r][1] + 8] for r in range(8)])
            for i in range(4)]
    regs = np.zeros((32, 4, 2))
    for lane in range(32):
        for i in range(4):
            regs[lane, i] = (mats[i][lane // 4, 2 * (lane % 4): 2 * (lane % 4) + 2] if not trans
                             else mats[i][2 * (lane % 4): 2 * (lane % 4) + 2, lane // 4])
    return regs


def _a_matrix(regs):
    a = np.full((16, 16), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            a[row, col: col + 2] = regs[lane, r]
    return a


def _b_matrix(r0, r1):
    b = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        b[2 * t: 2 * t + 2, g] = r0[lane]
        b[2 * t + 8: 2 * t + 10, g] = r1[lane]
    return b


@pytest.fixture
def smem():
    return np.random.default_rng(0).standard_normal((64, LDS))


@pytest.mark.parametrize("base,k0", [(0, 0), (16, 16), (48, 48)])
def test_a_from_row_major(smem, base, k0):
    """Q (fwd), K / V rows (bwd): row = base + (lane & 15), col = k0 + (lane >> 4) * 8."""
    addr = [(base + (L & 15), k0 + (L >> 4) * 8) for L in range(32)]
    assert np.array_equal(_a_matrix(_ldmatrix_x4(smem, addr)), smem[base: base + 16, k0: k0 + 16])


@pytest.mark.parametrize("n0,k0", [(0, 0), (16, 32), (48, 48)])
def test_b_from_rows_of_n(smem, n0, k0):
    """B[k][n] = tile[n][k] (K for Q K^T; Q / dO for K Q^T, V dO^T): row = n0 + (lane & 7) + (lane >> 4) * 8,
    col = k0 + ((lane >> 3) & 1) * 8; registers 0, 1 -> n-tile n0, 2, 3 -> n-tile n0 + 8."""
    addr = [(n0 + (L & 7) + (L >> 4) * 8, k0 + ((L >> 3) & 1) * 8) for L in range(32)]
    regs = _ldmatrix_x4(smem, addr)
    assert np.array_equal(_b_matrix(regs[:, 0], regs[:, 1]), smem[n0: n0 + 8, k0: k0 + 16].T)
    assert np.array_equal(_b_matrix(regs[:, 2], regs[:, 3]), smem[n0 + 8: n0 + 16, k0: k0 + 16].T)


@pytest.mark.parametrize("k0,n0", [(0, 0), (16, 16), (48, 48)])
def test_b_from_rows_of_k_trans(smem, k0, n0):
    """B[k][n] = tile[k][n] (V for P V; dO / Q for dV, dK; K for dQ), .trans: row = k0 + (lane & 7) +
    ((lane >> 3) & 1) * 8, col = n0 + (lane >> 4) * 8."""
    addr = [(k0 + (L & 7) + ((L >> 3) & 1) * 8, n0 + (L >> 4) * 8) for L in range(32)]
    regs = _ldmatrix_x4(smem, addr, trans=True)
    assert np.array_equal(_b_matrix(regs[:, 0], regs[:, 1]), smem[k0: k0 + 16, n0: n0 + 8])
    assert np.array_equal(_b_matrix(regs[:, 2], regs[:, 3]), smem[k0: k0 + 16, n0 + 8: n0 + 16])


@pytest.mark.parametrize("k0,m0", [(0, 0), (16, 16), (48, 32)])
def test_a_from_transposed_storage(smem, k0, m0):
    """A[m][k] = tile[k][m] (dS for dQ, stored as dS^T [key][query]), .trans: row = k0 + (lane & 7) +
    (lane >> 4) * 8, col = m0 + ((lane >> 3) & 1) * 8."""
    addr = [(k0 + (L & 7) + (L >> 4) * 8, m0 + ((L >> 3) & 1) * 8) for L in range(32)]
    assert np.array_equal(_a_matrix(_ldmatrix_x4(smem, addr, trans=True)), smem[k0: k0 + 16, m0: m0 + 16].T)


def test_accumulator_to_a_fragment():
    """P (fwd) and P^T, dS^T (bwd): the C fragments of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk:
    {c[2kk][0,1], c[2kk][2,3], c[2kk+1][0,1], c[2kk+1][2,3]}."""
    c_full = np.random.default_rng(1).standard_normal((16, 16))
    c = np.zeros((2, 32, 4))
    for nt in range(2):
        for lane in range(32):
            for i in range(4):
                c[nt, lane, i] = c_full[lane // 4 + (8 if i >= 2 else 0), nt * 8 + 2 * (lane % 4) + (i & 1)]
    regs = np.stack([c[0][:, 0:2], c[0][:, 2:4], c[1][:, 0:2], c[1][:, 2:4]], axis=1)
    assert np.array_equal(_a_matrix(regs), c_full)
