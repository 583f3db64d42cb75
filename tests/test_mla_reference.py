"""MLA's value head dim (head_dim_v != head_dim_qk) in the float64 reference, through the public API.

The reference (``backend='reference'``) is checked against an independent NumPy computation (einsum over the
repeated kv heads, the mask and softmax written out here) for the forward, and against central differences of that
computation for every gradient; packed sequences, GQA and both causal alignments included. The calls that take
no narrower v (a paged forward, decode, the FP8 forward) refuse it by name, one test each; the kernels' results
are tests/test_gpu_mla.py's (GPU) and tests/test_numba_sim.py's (the twins on the simulator), rawflash.jax's
tests/test_jax_attention.py's.
"""
from __future__ import annotations

import numpy as np
import pytest

import rawflash


def _inputs(b=2, sq=9, sk=13, h=4, hk=2, d=24, dv=16, seed=0):
    rng = np.random.default_rng(seed)
    f = np.float32
    return (rng.standard_normal((b, sq, h, d)).astype(f), rng.standard_normal((b, sk, hk, d)).astype(f),
            rng.standard_normal((b, sk, hk, dv)).astype(f))


def _naive(q, k, v, causal):
    """Softmax(q k^T / sqrt(d)) v in float64 with bottom-right causal alignment and GQA by repetition."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    (_, sq, h, d), (_, sk, hk, _) = q.shape, k.shape
    k, v = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    if causal:
        s = np.where(np.arange(sq)[:, None] + sk - sq >= np.arange(sk)[None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, dv, h, hk", [(24, 16, 4, 2), (32, 8, 3, 1), (16, 16, 2, 2)])
def test_forward_shapes_and_values(causal, d, dv, h, hk):
    q, k, v = _inputs(d=d, dv=dv, h=h, hk=hk)
    out, lse = rawflash.forward(q, k, v, causal=causal, backend="reference")
    assert out.shape == (*q.shape[:3], dv) and lse.shape == (q.shape[0], h, q.shape[1])
    np.testing.assert_allclose(out, _naive(q, k, v, causal), rtol=0, atol=1e-6)
    assert rawflash.attention(q, k, v, causal=causal, backend="reference").shape == out.shape


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_central_differences(causal):
    q, k, v = _inputs(b=1, sq=5, sk=7, h=2, hk=1, d=12, dv=8, seed=1)
    out, pullback = rawflash.vjp(q, k, v, causal=causal, backend="reference")
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    grads = pullback(dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    base = [x.astype(np.float64) for x in (q, k, v)]
    eps = 1e-6
    for which, grad in enumerate(grads):
        for idx in [(0, 0, 0, 0), (0, 3, 0, 5), tuple(s - 1 for s in base[which].shape)]:
            up, down = [x.copy() for x in base], [x.copy() for x in base]
            up[which][idx] += eps
            down[which][idx] -= eps
            fd = (np.sum(_naive(*up, causal) * dout) - np.sum(_naive(*down, causal) * dout)) / (2 * eps)
            assert abs(fd - grad[idx]) <= 1e-5 * max(1.0, abs(fd)), (which, idx, fd, grad[idx])


def test_packed_sequences():
    """Packed sequences give each sequence's own result."""
    rng = np.random.default_rng(3)
    lens_q, lens_k = (3, 6), (5, 9)
    q = rng.standard_normal((sum(lens_q), 4, 16)).astype(np.float32)
    k = rng.standard_normal((sum(lens_k), 2, 16)).astype(np.float32)
    v = rng.standard_normal((sum(lens_k), 2, 8)).astype(np.float32)
    cu_q = np.array([0, 3, 9], np.int32)
    cu_k = np.array([0, 5, 14], np.int32)
    out, _ = rawflash.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, backend="reference")
    assert out.shape == (9, 4, 8)
    for b in range(2):
        want = _naive(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]], v[None, cu_k[b]:cu_k[b + 1]], True)
        np.testing.assert_allclose(out[cu_q[b]:cu_q[b + 1]], want[0], rtol=0, atol=1e-6)


def test_refused_shapes():
    q, k, v = _inputs()
    out, lse = rawflash.forward(q, k, v, backend="reference")
    with pytest.raises(ValueError, match=r"dout must have q's shape with v's head_dim \(2, 9, 4, 16\)"):
        rawflash.backward(np.zeros(q.shape, np.float32), q, k, v, out, lse, backend="reference")
    with pytest.raises(ValueError, match=r"out must have shape \(2, 9, 4, 16\)"):
        rawflash.forward(q, k, v, backend="reference", out=np.zeros(q.shape, np.float32))


def test_paged_forward_refuses_head_dim_v():
    """A paged forward reads the pages decode reads: keys and values of one head_dim."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((6, 4, 32)).astype(np.float16)
    kp = rng.standard_normal((3, 16, 2, 32)).astype(np.float16)
    with pytest.raises(ValueError, match=r"paged forward .* one head_dim, .*; got k.s 32 and v.s 16"):
        rawflash.forward(q, kp, kp[..., :16], cu_seqlens_q=np.array([0, 6], np.int32),
                         seqused_k=np.array([20], np.int32), block_table=np.array([[2, 0]], np.int32),
                         backend="reference")


def test_decode_refuses_head_dim_v():
    q = np.zeros((1, 1, 4, 32), np.float16)
    cache = np.zeros((1, 64, 2, 32), np.float16)
    with pytest.raises(ValueError, match=r"decode reads caches of one head_dim: v_cache's head_dim 16 differs"):
        rawflash.decode(q, cache, cache[..., :16], cache_seqlens=10, backend="reference")


def test_fp8_forward_refuses_head_dim_v():
    from rawflash import fp8

    q, k, v = (x.astype(fp8.e4m3()) for x in _inputs(d=64, dv=32))
    with pytest.raises(ValueError, match=r"float8_e4m3fn inputs run with v's head_dim equal to q's"):
        rawflash.forward(q, k, v, backend="reference")
    with pytest.raises(ValueError, match=r"v's head_dim equal to q's"):
        rawflash.forward(*_inputs(d=64, dv=32), fp8=True, backend="reference")


