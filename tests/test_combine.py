"""The lse combine: equal to attention over the concatenated keys, associative, -inf rows, validation."""
from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from rawflash import reference
from rawflash.combine import combine, lse_from_base2, lse_to_base2, merge
from conftest import random_qkv

TOL = dict(rtol=2e-6, atol=2e-6)   # float32 math on outputs of magnitude <= a few units


def split_attention(q, k, v, bounds):
    """(out, lse) of the float64 reference over each key range [a, b) of ``bounds``, as float32 partials."""
    parts = [reference.forward(q, k[:, a:b], v[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return [o.astype(np.float32) for o, _ in parts], [lse.astype(np.float32) for _, lse in parts]


def masked_attention(q, k, v, visible):
    """float64 attention where query i sees key j iff ``visible[i, j]`` (MHA); out 0 and lse -inf for blind rows."""
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) / math.sqrt(q.shape[-1])
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", e / np.where(den > 0, den, 1), v.astype(np.float64))
    lse = np.where(den[..., 0] > 0, m[..., 0] + np.log(np.where(den[..., 0] > 0, den[..., 0], 1)), -np.inf)
    return out, lse


@pytest.mark.parametrize("bounds", [(0, 11), (0, 4, 11), (0, 1, 5, 6, 11)], ids=["1split", "2splits", "4splits"])
def test_equals_attention_over_concatenated_keys(bounds):
    q, k, v = random_qkv(2, 5, 11, 4, 2, 16, np.float32)          # GQA: 4 query heads on 2 kv heads
    outs, lses = split_attention(q, k, v, bounds)
    out, lse = combine(np.stack(outs), np.stack(lses))
    ref_out, ref_lse = reference.forward(q, k, v)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == q.shape and lse.shape == (2, 4, 5)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


def test_sequence_input_equals_stacked_input():
    q, k, v = random_qkv(1, 3, 9, 2, 2, 8, np.float32)
    outs, lses = split_attention(q, k, v, (0, 2, 9))
    a = combine(outs, lses)
    b = combine(np.stack(outs), np.stack(lses))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_merge_equals_combine_of_two():
    q, k, v = random_qkv(2, 4, 10, 4, 1, 8, np.float32)           # MQA
    (oa, ob), (la, lb) = split_attention(q, k, v, (0, 6, 10))
    out, lse = merge(oa, la, ob, lb)
    cout, clse = combine([oa, ob], [la, lb])
    np.testing.assert_allclose(out, cout, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse, clse, rtol=1e-6, atol=1e-7)


def test_associative_in_any_grouping():
    q, k, v = random_qkv(1, 6, 16, 2, 2, 8, np.float32, seed=3)
    outs, lses = split_attention(q, k, v, (0, 3, 7, 12, 16))
    p = list(zip(outs, lses))
    flat = combine(outs, lses)
    left = merge(*merge(*merge(*p[0], *p[1]), *p[2]), *p[3])
    right = merge(*p[0], *merge(*p[1], *merge(*p[2], *p[3])))
    pairs = merge(*merge(*p[0], *p[1]), *merge(*p[2], *p[3]))
    nested = combine([combine(outs[:3], lses[:3])[0], outs[3]], [combine(outs[:3], lses[:3])[1], lses[3]])
    swapped = combine(outs[::-1], lses[::-1])
    for got in (left, right, pairs, nested, swapped):
        np.testing.assert_allclose(got[0], flat[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[1], flat[1], rtol=1e-6, atol=1e-6)


def test_rows_blind_in_some_splits_and_in_all():
    """Causal keys split in two: early rows see nothing of the second split; a fully masked row sees nothing."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)).astype(np.float32) for _ in range(3))
    visible = np.tril(np.ones((6, 6), bool))
    visible[2] = False                                              # row 2 sees no key at all
    splits = [(0, 3), (3, 6)]
    outs, lses = [], []
    for a, b in splits:
        mask = np.zeros_like(visible)
        mask[:, a:b] = visible[:, a:b]
        o, lse = masked_attention(q, k, v, mask)
        outs.append(o.astype(np.float32))
        lses.append(lse.astype(np.float32))
    assert np.isneginf(lses[1][0, :, :3]).all()                     # rows 0..2 are blind in the second split
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        out, lse = combine(outs, lses)
        mout, mlse = merge(outs[0], lses[0], outs[1], lses[1])
    ref_out, ref_lse = masked_attention(q, k, v, visible)
    for o, l in ((out, lse), (mout, mlse)):
        assert not np.isnan(o).any() and not np.isnan(l).any()
        np.testing.assert_array_equal(o[:, 2], 0.0)
        assert np.isneginf(l[:, :, 2]).all()
        np.testing.assert_allclose(o, ref_out, **TOL)
        np.testing.assert_allclose(l, ref_lse, **TOL)


def test_all_splits_blind_give_zero_and_minus_inf():
    out = np.zeros((3, 1, 2, 2, 4), np.float32)
    lse = np.full((3, 1, 2, 2), -np.inf, np.float32)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        o, l = combine(out, lse)
    np.testing.assert_array_equal(o, 0.0)
    assert np.isneginf(l).all()


def test_low_precision_partials_are_combined_in_float32():
    q, k, v = random_qkv(1, 4, 8, 2, 2, 8, np.float32)
    outs, lses = split_attention(q, k, v, (0, 5, 8))
    half = [o.astype(ml_dtypes.bfloat16) for o in outs]
    out, lse = combine(half, lses)
    assert out.dtype == np.float32
    want, _ = combine([h.astype(np.float32) for h in half], lses)
    np.testing.assert_array_equal(out, want)


def test_base2_conversion():
    lse = np.array([[[-np.inf, 0.0, 1.5, -3.25]]], np.float32)
    lse2 = lse_to_base2(lse)
    assert lse2.dtype == np.float32 and np.isneginf(lse2[0, 0, 0])
    np.testing.assert_allclose(np.exp2(lse2[..., 1:]), np.exp(lse[..., 1:]), rtol=1e-6)   # 2^lse2 = e^lse
    np.testing.assert_allclose(lse_from_base2(lse2), lse, rtol=1e-7)
    assert lse_to_base2(lse.astype(np.float64)).dtype == np.float64


# ---------------------------------------------------------------- validation
def test_refuses_wrong_ndim_naming_the_argument():
    with pytest.raises(ValueError, match=r"out_partials must have 5 dimensions \(num_splits, batch, seqlen_q, "
                                         r"heads, head_dim\), got shape \(2, 3, 4, 5\)"):
        combine(np.zeros((2, 3, 4, 5), np.float32), np.zeros((2, 3, 5, 4), np.float32))


def test_refuses_lse_of_the_wrong_layout():
    out = np.zeros((2, 1, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"lse_partials must have shape \(num_splits, batch, heads, seqlen_q\) "
                                         r"= \(2, 1, 4, 3\).*got \(2, 1, 3, 4\)"):
        combine(out, np.zeros((2, 1, 3, 4), np.float32))


def test_refuses_zero_splits_and_non_arrays_and_bad_dtypes():
    with pytest.raises(ValueError, match="out_partials must hold at least one split"):
        combine([], [])
    with pytest.raises(ValueError, match="out_partials must hold at least one split, got num_splits 0"):
        combine(np.zeros((0, 1, 2, 2, 4), np.float32), np.zeros((0, 1, 2, 2), np.float32))
    with pytest.raises(TypeError, match="lse_partials must be a NumPy or CuPy array, got float"):
        combine(np.zeros((1, 1, 2, 2, 4), np.float32), 3.0)
    with pytest.raises(TypeError, match=r"lse_partials\[0\] must be a NumPy or CuPy array, got list"):
        combine([np.zeros((1, 2, 2, 4), np.float32)], [[[1.0]]])
    with pytest.raises(TypeError, match="out_partials must have dtype float16, bfloat16, float32 or float64, "
                                        "got int32"):
        combine(np.zeros((1, 1, 2, 2, 4), np.int32), np.zeros((1, 1, 2, 2), np.float32))
    with pytest.raises(TypeError, match="lse_partials must be float32 or float64, got float16"):
        combine(np.zeros((1, 1, 2, 2, 4), np.float32), np.zeros((1, 1, 2, 2), np.float16))
    with pytest.raises(TypeError, match="lse must be float32 or float64, got int64"):
        lse_to_base2(np.zeros(3, np.int64))


def test_merge_refuses_mismatched_operands():
    out, lse = np.zeros((1, 3, 2, 4), np.float32), np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match=r"out_b must have out_a's shape \(1, 3, 2, 4\), got \(1, 2, 2, 4\)"):
        merge(out, lse, out[:, :2], lse[:, :, :2])
    with pytest.raises(ValueError, match=r"lse_b must have shape \(batch, heads, seqlen_q\) = \(1, 2, 3\)"):
        merge(out, lse, out, lse.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="out_a must have 4 dimensions"):
        merge(out[0], lse, out, lse)


@pytest.mark.gpu
def test_cupy_equals_numpy():
    import cupy

    q, k, v = random_qkv(2, 7, 13, 4, 2, 16, np.float32)
    outs, lses = split_attention(q, k, v, (0, 5, 13))
    lses[1][:, :, 0] = -np.inf
    want = combine(outs, lses)
    got = combine(cupy.asarray(np.stack(outs)), cupy.asarray(np.stack(lses)))
    got_merge = merge(*(cupy.asarray(x) for x in (outs[0], lses[0], outs[1], lses[1])))
    for g in (got, got_merge):
        assert isinstance(g[0], cupy.ndarray) and g[0].dtype == cupy.float32
        np.testing.assert_allclose(cupy.asnumpy(g[0]), want[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(cupy.asnumpy(g[1]), want[1], rtol=1e-6, atol=1e-6)
