"""CUDA C kernels on a GPU against the float64 reference, by flash-attn's rule.

ours is within ``2 x`` (gradients ``3 x``) the error of the same naive attention done in the input precision,
plus a rounding floor. The grid crosses ragged lengths, seqlen_q != seqlen_k both ways, every head dim (the odd
ones are padded), MHA / GQA / MQA, causal on and off and every dtype.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import rawflash
from rawflash import reference
from conftest import random_qkv

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 1), (3, 3), (17, 17), (64, 128), (113, 203), (127, 129), (203, 113), (1023, 1024)]
HEAD_DIMS = [32, 40, 59, 64, 96, 128, 192, 256]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
DTYPES = ["float16", "bfloat16", "float32"]


def _cycle(i, values):
    return values[i % len(values)]


def _grid(kernels):
    """Every (seqlen pair, dtype, causal, kernel); head_dim and heads rotate so each value appears often."""
    cases = []
    for i, (sq, dt, causal, kern) in enumerate(itertools.product(SEQLENS, DTYPES, (False, True), kernels)):
        d = _cycle(i, HEAD_DIMS)
        h, hk = _cycle(i // len(HEAD_DIMS), HEADS)
        batch = 1 if sq[0] * sq[1] > 100_000 else 2
        cases.append(pytest.param(batch, *sq, h, hk, d, dt, causal, kern,
                                  id=f"{kern}-{dt}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}-h{h}/{hk}"))
    return cases


def _head_dim_grid(kernels):
    cases = []
    for d, dt, causal, kern in itertools.product(HEAD_DIMS, DTYPES, (False, True), kernels):
        for sq in ((113, 203), (203, 113)):
            cases.append(pytest.param(2, *sq, 4, 2, d, dt, causal, kern,
                                      id=f"{kern}-{dt}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}"))
    return cases


def check_forward(batch, sq, sk, h, hk, d, dtype, causal, kernel, seed=0, scale=1.0, **switches):
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype, seed=seed, scale=scale)
    out, lse = rawflash.forward(q, k, v, causal=causal, kernel=kernel, **switches)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == np.float32
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)
    base_out, base_lse = reference.forward(q, k, v, causal=causal, upcast=False)
    ok, err, base_err, bound = reference.error_ratio_ok(out, ref_out, base_out, q.dtype, 2)
    assert ok, f"out: max error {err:.3g} > bound {bound:.3g} (naive {dtype} error {base_err:.3g})"
    ok, err, base_err, bound = reference.error_ratio_ok(lse, ref_lse, base_lse, q.dtype, 2,
                                                        floor=reference.lse_floor(ref_lse))
    assert ok, f"lse: max error {err:.3g} > bound {bound:.3g} (naive {dtype} error {base_err:.3g})"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "rows that see no key must have lse = -inf"
    return q, k, v, out, lse


@pytest.mark.parametrize("batch,sq,sk,h,hk,d,dtype,causal,kernel", _grid(["fa2", "fa1", "naive"]))
def test_forward(batch, sq, sk, h, hk, d, dtype, causal, kernel):
    check_forward(batch, sq, sk, h, hk, d, dtype, causal, kernel)


@pytest.mark.parametrize("batch,sq,sk,h,hk,d,dtype,causal,kernel", _head_dim_grid(["fa2", "fa1"]))
def test_forward_head_dims(batch, sq, sk, h, hk, d, dtype, causal, kernel):
    check_forward(batch, sq, sk, h, hk, d, dtype, causal, kernel)


def check_backward(batch, sq, sk, h, hk, d, dtype, causal, deterministic, seed=1):
    q, k, v = random_qkv(batch, sq, sk, h, hk, d, dtype, seed=seed)
    dout = np.random.default_rng(seed + 7).standard_normal(q.shape).astype(q.dtype)
    out, lse = rawflash.forward(q, k, v, causal=causal)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    refs = reference.backward(dout, q, k, v, causal=causal)
    bases = reference.backward(dout, q, k, v, causal=causal, upcast=False)
    for name, g, ref, base, x in zip(("dq", "dk", "dv"), grads, refs, bases, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        ok, err, base_err, bound = reference.error_ratio_ok(g, ref, base, q.dtype, 3)
        assert ok, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive {dtype} error {base_err:.3g})"
    return grads


@pytest.mark.parametrize("batch,sq,sk,h,hk,d,dtype,causal,deterministic", _grid([False, True]))
def test_backward(batch, sq, sk, h, hk, d, dtype, causal, deterministic):
    check_backward(batch, sq, sk, h, hk, d, dtype, causal, deterministic)


@pytest.mark.parametrize("batch,sq,sk,h,hk,d,dtype,causal,deterministic", _head_dim_grid([False]))
def test_backward_head_dims(batch, sq, sk, h, hk, d, dtype, causal, deterministic):
    check_backward(batch, sq, sk, h, hk, d, dtype, causal, deterministic)


@pytest.mark.parametrize("switch", ["defer_norm", "seq_parallel", "split_q", "all"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_ablation_variants_are_exact(switch, d, causal):
    switches = {"defer_norm": False, "seq_parallel": False, "split_q": False} if switch == "all" else {switch: False}
    check_forward(2, 203, 113, 4, 2, d, "bfloat16", causal, "fa2", **switches)
    check_forward(1, 129, 257, 2, 1, d, "float16", causal, "fa2", **switches)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_split_k_float32(d, causal):
    """The split-K partition (split_q=False) on the float32 FMA path, with and without the other two ideas."""
    check_forward(2, 203, 113, 4, 2, d, "float32", causal, "fa2", split_q=False)
    check_forward(1, 129, 257, 2, 1, d, "float32", causal, "fa2", split_q=False, seq_parallel=False, defer_norm=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,sq,sk,d", [(2, 333, 301, 64), (132, 200, 301, 128), (264, 64, 1030, 128),
                                           (3, 1000, 40, 96)])
def test_fa1_splits(heads, sq, sk, d, dtype, causal):
    """fa1's query blocks dealt to its splits (launch.fa1_splits): one block per split and key block, several, one
    split per head, and causal rows that see no key."""
    from rawflash.kernels import forms, launch
    from rawflash.problem import Problem

    p = Problem(1, sq, sk, heads, heads, d, dtype, causal)
    assert forms.forward_plan(p, "fa1")[0].grid[2] == launch.fa1_splits(p, forms.forward_plan(p, "fa1")[0].config)
    check_forward(1, sq, sk, heads, heads, d, dtype, causal, "fa1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_no_nan(dtype):
    """Inputs scaled by 8 give logits of hundreds: no overflow, no NaN, still within the rule."""
    for kernel in ("fa2", "fa1"):
        check_forward(1, 127, 129, 2, 2, 64, dtype, True, kernel, scale=8.0)
    check_backward(1, 127, 129, 2, 2, 64, dtype, True, False, seed=3)


def test_forward_bitwise_repeatable():
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 300, 301, 4, 2, 128, "bfloat16"))
    first = rawflash.forward(q, k, v, causal=True)
    for _ in range(5):
        again = rawflash.forward(q, k, v, causal=True)
        assert all(bool((a == b).all()) for a, b in zip(first, again))


def test_deterministic_backward_bitwise_equal_20_runs():
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 333, 301, 8, 2, 64, "float16"))
    dout = cupy.asarray(np.random.default_rng(5).standard_normal(q.shape).astype(np.float16))
    out, lse = rawflash.forward(q, k, v, causal=True)
    first = rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(19):
        again = rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("d, dtype, deterministic", [(40, "float16", False), (64, "bfloat16", False),
                                                      (128, "bfloat16", True), (96, "float32", False),
                                                      (256, "float16", False)])
def test_bound_backward_launched_again_gives_the_same_gradients(d, dtype, deterministic):
    """A bound backward's kernels launched twice (as the benchmark times them) give the same gradients (bitwise
    when deterministic; the atomic dQ within float32 rounding): each launch's preprocess kernel zeroes the float32
    dQ rows its main pass adds into (without that the second launch would add dQ onto the first one's)."""
    import cupy

    from rawflash import settings, validation
    from rawflash.kernels import cupy_backend

    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 113, 203, 4, 2, d, dtype, seed=3))
    dout = cupy.asarray(random_qkv(2, 113, 203, 4, 2, d, dtype, seed=4)[0])
    out, lse = rawflash.forward(q, k, v, causal=True)
    c = validation.check_backward(dout, q, k, v, out, lse, True, None, deterministic)
    bound = cupy_backend.bind_backward(c.problem, dout, q, k, v, out, lse, c.scale, deterministic, c.extras,
                                       settings.load())
    bound.launch()
    first = [cupy.asnumpy(g).astype(np.float64) for g in bound.result()]
    bound.launch()
    again = [cupy.asnumpy(g).astype(np.float64) for g in bound.result()]
    for a, b in zip(first, again):
        if deterministic:
            assert a.tobytes() == b.tobytes()
        else:  # float32 atomics add in any order; an unzeroed accumulator would double dQ
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-3 * np.abs(a).max())
    if deterministic:  # ... and the public call's, which binds anew
        want = rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        assert [cupy.asnumpy(g).astype(np.float64).tobytes() for g in want] == [a.tobytes() for a in first]


def test_strided_bhsd_view_is_read_in_place():
    """A (batch, heads, seqlen, head_dim) tensor passed through .transpose(0, 2, 1, 3) needs no copy."""
    import cupy

    qh, kh, vh = (cupy.asarray(x.transpose(0, 2, 1, 3).copy()) for x in random_qkv(2, 100, 90, 4, 2, 64, "float16"))
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (qh, kh, vh))
    assert not q.flags.c_contiguous
    from rawflash.arrays import kernel_ready

    assert kernel_ready(q, 8) is q
    out, _ = rawflash.forward(q, k, v)
    ref, _ = reference.forward(q.get(), k.get(), v.get())
    base, _ = reference.forward(q.get(), k.get(), v.get(), upcast=False)
    assert reference.error_ratio_ok(out, ref, base, np.float16, 2)[0]


def test_numpy_in_numpy_out_and_cupy_in_cupy_out():
    import cupy

    q, k, v = random_qkv(1, 20, 30, 2, 1, 32, "float16")
    out, lse = rawflash.forward(q, k, v)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    out_d, lse_d = rawflash.forward(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v))
    assert isinstance(out_d, cupy.ndarray) and np.array_equal(out_d.get(), out)


def test_torch_tensors_without_copies():
    torch = pytest.importorskip("torch")
    import cupy

    q, k, v = (torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = rawflash.forward(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray)
    assert cupy.from_dlpack(q).data.ptr == q.data_ptr()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=True)
    err = (torch.from_dlpack(out).float() - ref.transpose(1, 2)).abs().max().item()
    assert err < 2e-2


def test_vjp_and_attention_agree_with_forward_backward():
    q, k, v = random_qkv(1, 50, 70, 4, 2, 64, "float16")
    dout = np.random.default_rng(2).standard_normal(q.shape).astype(np.float16)
    out, pullback = rawflash.vjp(q, k, v, causal=True)
    assert np.array_equal(out, rawflash.attention(q, k, v, causal=True))
    dq, dk, dv = pullback(dout)
    o2, lse = rawflash.forward(q, k, v, causal=True)
    g2 = rawflash.backward(dout, q, k, v, o2, lse, causal=True, deterministic=False)
    for a, b in zip((dq, dk, dv), g2):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=2e-3)


def test_refused_input_leaves_context_healthy():
    import cupy

    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 16, 16, 2, 2, 64, "float16"))
    with pytest.raises(ValueError, match="head_dim"):
        rawflash.forward(q, k[..., :32], v)
    out, _ = rawflash.forward(q, k, v)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(out).all())


@pytest.mark.slow
def test_single_head_131072_tokens_causal_forward_and_backward_in_linear_memory():
    """N = 131072, d = 128, one head, causal: an O(N^2) buffer would need 64 GiB; rows are checked exactly."""
    import cupy

    n, d = 131072, 128
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, n, n, 1, 1, d, "bfloat16", seed=4))
    dout = cupy.asarray(np.random.default_rng(9).standard_normal(q.shape).astype(q.dtype))
    base = pool.total_bytes()
    out, lse = rawflash.forward(q, k, v, causal=True)
    dq, dk, dv = rawflash.backward(dout, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    assert pool.total_bytes() - base < 64 * n * d * 4, "work buffers must be O(N d), not O(N^2)"
    for x in (out, dq, dk, dv):
        assert bool(cupy.isfinite(x.astype(cupy.float32)).all())
    hq, hk, hv, hdo = (x[0, :, 0].get().astype(np.float64) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(d)
    o_h, dq_h = out[0, :, 0].get().astype(np.float64), dq[0, :, 0].get().astype(np.float64)
    for i in (0, 1, 4097, 65535, n - 1):
        s = hq[i] @ hk[: i + 1].T * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        o_ref = p @ hv[: i + 1]
        dp = hv[: i + 1] @ hdo[i]
        dq_ref = scale * (p * (dp - hdo[i] @ o_ref)) @ hk[: i + 1]
        assert np.abs(o_h[i] - o_ref).max() < 2e-2, f"out row {i}"
        assert abs(float(lse[0, 0, i]) - (s.max() + np.log(np.exp(s - s.max()).sum()))) < 2e-2, f"lse row {i}"
        assert np.abs(dq_h[i] - dq_ref).max() < 5e-2 * max(1.0, np.abs(dq_ref).max()), f"dq row {i}"
