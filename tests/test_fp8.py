"""FP8 forward, without a GPU: the fragment order of P's keys, quantisation, the Hadamard rotation, P's
underflow, the validation of FP8 calls and their plans (the kernels themselves: tests/test_gpu_fp8.py)."""
import dataclasses

import numpy as np
import pytest

import rawflash
from rawflash import fp8
from rawflash.kernels import configs, forms, launch
from rawflash.problem import Problem


def test_sigma_is_a_permutation_of_each_slice():
    assert sorted(fp8.sigma(np.arange(32))) == list(range(32))
    assert list(fp8.sigma(np.arange(8))) == [0, 1, 8, 9, 2, 3, 10, 11]


def test_packed_accumulator_is_an_a_fragment_of_permuted_keys():
    """S's C-layout registers packed in place, read through the 8-bit A layout, times V^T in sigma order = S V."""
    rng = np.random.default_rng(0)
    s = rng.standard_normal((16, 32))
    v = rng.standard_normal((32, 24))
    frag = fp8.packed_fragment(s)
    assert not np.allclose(frag, s)                       # the fragment is not S itself: the order matters
    np.testing.assert_allclose(frag @ fp8.vt_permuted(v).T, s @ v, atol=1e-12)
    with pytest.raises(AssertionError):                   # V^T in natural order would be wrong
        np.testing.assert_allclose(frag @ v, s @ v, atol=1e-6)


def test_layouts_are_bijections():
    c = {fp8.c_layout(lane, e, j) for lane in range(32) for e in range(4) for j in range(4)}
    a = {fp8.a_layout_8bit(lane, r, b) for lane in range(32) for r in range(4) for b in range(4)}
    assert c == a == {(i, j) for i in range(16) for j in range(32)}


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_quantize_round_trip(granularity):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 33, 4, 64)).astype(np.float32)
    x8, descale = fp8.quantize(x, granularity, kv_heads=2)
    assert x8.dtype == fp8.e4m3()
    assert descale.dtype == np.float32 and descale.shape == ((1,) if granularity == "tensor" else (2, 2))
    back = fp8.dequantize(x8, descale)
    assert np.abs(back - x).max() <= 2.0 ** -3 * np.abs(x).max()          # e4m3 keeps 3 mantissa bits
    assert np.abs(x8.astype(np.float32)).max() == pytest.approx(448.0)     # the largest value maps to 448


def test_quantize_errors():
    x = np.zeros((1, 2, 4, 64), np.float32)
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(x, "row")
    with pytest.raises(ValueError, match="kv_heads"):
        fp8.quantize(x, "head", kv_heads=3)
    with pytest.raises(ValueError, match="power of two"):
        fp8.quantize(np.zeros((1, 2, 4, 96), np.float32), incoherent=True)


def test_zero_input_quantizes_to_zero_with_unit_descale():
    x8, d = fp8.quantize(np.zeros((1, 3, 2, 32), np.float32), "head")
    assert not np.any(x8.astype(np.float32)) and np.all(d == 1)


@pytest.mark.parametrize("d", (32, 64, 128, 256))
def test_rotation_is_orthogonal_and_keeps_qk(d):
    r = fp8.rotation(d, seed=3)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-12)
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((5, d)), rng.standard_normal((7, d))
    np.testing.assert_allclose((q @ r) @ (k @ r).T, q @ k.T, atol=1e-10)
    assert not np.allclose(fp8.rotation(d, seed=4), r)


def test_rotation_spreads_outlier_channels():
    """A few channels x 50 dominate each row; after the rotation every column carries a share of them."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 128))
    x[:, :4] *= 50
    y = x @ fp8.rotation(128)
    col = lambda a: np.abs(a).max(axis=0)  # noqa: E731
    assert col(x).max() / np.median(col(x)) > 20 and col(y).max() / np.median(col(y)) < 3


def test_incoherent_quantisation_is_more_accurate_on_outliers():
    """The host model of the FP8 forward's inputs: attention of the dequantised rotated q, k is closer to the
    exact attention than that of plain FP8 when a few channels are outliers (the GPU test checks the kernel)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 256, 2, 128)).astype(np.float32) for _ in range(3))
    q[..., :4] *= 50
    k[..., :4] *= 50
    exact, _ = rawflash.forward(q, k, v, backend="reference")
    errs = {}
    for inc in (False, True):
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, "head", incoherent=inc and x is not v) for x in (q, k, v))
        out, _ = rawflash.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, backend="reference")
        errs[inc] = np.sqrt(np.mean((out.astype(np.float64) - exact) ** 2))
    assert errs[True] < 0.8 * errs[False]


def test_p_scale_keeps_the_mass_of_long_flat_rows():
    """Measured here (mainloop_fwd_sm90_fp8.cuh's P_LOG2): unscaled P loses several per cent of a long row's
    mass to e4m3's underflow (values below 2^-10); P x 2^8 loses under 0.5 % of it."""
    rng = np.random.default_rng(4)
    scores = rng.standard_normal((32, 16384)) * 3 / np.log(2)    # natural-unit logits of sd 3, in log2 units
    plain, scaled = fp8.p_underflow(scores, 0), fp8.p_underflow(scores, fp8.P_LOG2)
    assert plain["lost_mean"] > 0.03 and scaled["lost_max"] < 0.005


def _e4m3(shape, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape)).astype(np.float32).astype(fp8.e4m3())


def test_reference_backend_runs_fp8_and_returns_bf16():
    q, k, v = _e4m3((1, 8, 2, 64)), _e4m3((1, 12, 1, 64), 1), _e4m3((1, 12, 1, 64), 2)
    d = np.array([0.5], np.float32)
    out, lse = rawflash.forward(q, k, v, q_descale=d, k_descale=d, v_descale=d, causal=True, backend="reference")
    assert out.dtype.name == "bfloat16" and lse.dtype == np.float32 and out.shape == q.shape
    want, _ = rawflash.forward(*(fp8.dequantize(x, d).astype(np.float32) for x in (q, k, v)), causal=True,
                               backend="reference")
    np.testing.assert_allclose(out.astype(np.float32), want, atol=1e-2, rtol=1e-2)
    out16, _ = rawflash.forward(q, k, v, out_dtype="float16", backend="reference")
    assert out16.dtype == np.float16


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(kernel="fa1"), ValueError, "kernel='fa2'"),
    (dict(backend="numba"), ValueError, "Numba"),
    (dict(alibi_slopes=np.ones(2, np.float32)), ValueError, "alibi_slopes is not supported"),
    (dict(softcap=5.0), ValueError, "softcap is not supported"),
    (dict(incoherent=True), ValueError, "incoherent=True rotates"),
    (dict(out_dtype="float32"), ValueError, "out_dtype"),
    (dict(q_descale=np.ones(1, np.float64)), TypeError, "q_descale must have dtype float32"),
    (dict(k_descale=np.ones((3,), np.float32)), ValueError, "k_descale must have shape"),
    (dict(q_descale=np.ones(1, np.float32), v_descale=np.ones((1, 1), np.float32)), ValueError, "share one shape"),
])
def test_fp8_validation(kwargs, exc, match):
    q, k, v = _e4m3((1, 8, 2, 64)), _e4m3((1, 8, 1, 64)), _e4m3((1, 8, 1, 64))
    with pytest.raises(exc, match=match):
        rawflash.forward(q, k, v, **{"backend": "reference", **kwargs})


def test_fp8_validation_of_inputs():
    q, k = _e4m3((1, 8, 2, 64)), _e4m3((1, 8, 1, 64))
    with pytest.raises(TypeError, match="share one dtype"):
        rawflash.forward(q, k, k.astype(np.float32).astype(np.float16), backend="reference")
    with pytest.raises(ValueError, match="multiple of 16"):
        rawflash.forward(_e4m3((1, 8, 2, 40)), _e4m3((1, 8, 1, 40)), _e4m3((1, 8, 1, 40)), backend="reference")
    with pytest.raises(TypeError, match="forward-only"):
        rawflash.backward(q, q, k, k, q, np.zeros((1, 2, 8), np.float32), backend="reference")
    with pytest.raises(ValueError, match="q_descale goes with float8_e4m3fn"):
        x = np.zeros((1, 8, 2, 64), np.float16)
        rawflash.forward(x, x, x, q_descale=np.ones(1, np.float32), backend="reference")
    with pytest.raises(ValueError, match="out_dtype goes with"):
        x = np.zeros((1, 8, 2, 64), np.float16)
        rawflash.forward(x, x, x, out_dtype="float16", backend="reference")


def test_fp8_plan_on_hopper_and_refusals():
    p = Problem(2, 4096, 4096, 16, 4, 128, configs.FP8, True, "sm_90", out_dtype="float16")
    plan = forms.forward_plan(p)
    assert [lau.kernel for lau in plan] == ["fp8_vt_permute", "fa3_fwd_sm90_fp8"]
    # V^T holds the keys padded to the key block (4096 -> 4224 with 192 keys), in CTAs of VT_KEYS keys
    assert plan[0].grid == (launch.vt_keys(p, plan[1].config.bc) // launch.VT_KEYS, 4, 2)
    assert launch.vt_keys(p, 192) == 4224 and launch.vt_keys(p, 128) == 4096
    assert plan[1].template_args[0] == "__half" and plan[1].template_args[5] == launch.CAUSAL
    assert plan[1].smem == launch.smem_fa3_fwd_sm90_fp8(plan[1].config, 128) <= 232448
    p256 = Problem(1, 1000, 1000, 8, 8, 256, configs.FP8, False, "sm_90")
    assert forms.forward_plan(p256)[1].template_args[:2] == ("__nv_bfloat16", 256)
    with pytest.raises(ValueError, match="sm_90"):
        forms.forward_plan(Problem(1, 8, 8, 1, 1, 64, configs.FP8, False, "sm_80"))
    with pytest.raises(ValueError, match="warp_specialize=False has no FP8 form"):
        forms.forward_plan(p, switches=forms.Switches(warp_specialize=False))


def test_fp8_instantiations_are_compiled_by_the_compile_tests():
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    assert {lau.name_expression for lau in forms.fp8_instantiations()} <= names
    assert not any(lau.kernel.startswith("fp8") or lau.kernel.endswith("_fp8")
                   for lau in forms.all_instantiations("sm_80"))


def test_reference_backend_runs_fp8_windows_and_packed_sequences():
    """Windows, packed sequences (per-(sequence, kv head) descales) and seqused_k on FP8 inputs: the reference
    backend dequantises each row by its own sequence's descale and runs the 16-bit rules."""
    cu_q, cu_k = np.array([0, 5, 14], np.int32), np.array([0, 12, 19], np.int32)  # lengths 5, 9 and 12, 7
    q, k, v = _e4m3((14, 4, 64)), _e4m3((19, 2, 64), 1), _e4m3((19, 2, 64), 2)
    d = np.random.default_rng(3).uniform(0.5, 2, (2, 2)).astype(np.float32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9, max_seqlen_k=12, causal=True, window=(3, -1),
              seqused_k=np.array([10, 7], np.int32))
    out, lse = rawflash.forward(q, k, v, q_descale=d, k_descale=d, v_descale=d, backend="reference", **kw)
    assert out.dtype.name == "bfloat16" and out.shape == q.shape and lse.shape == (4, 14)
    for b in range(2):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b] + kw["seqused_k"][b])
        one = [fp8.dequantize(x[r][None], d[b:b + 1]).astype(np.float32) for x, r in ((q, rq), (k, rk), (v, rk))]
        want, want_lse = rawflash.forward(*one, causal=True, window=(3, -1), backend="reference")
        np.testing.assert_allclose(out[rq].astype(np.float32), want[0], atol=1e-2, rtol=1e-2)
        np.testing.assert_allclose(lse[:, rq], want_lse[0], rtol=1e-5)


def test_fp8_plan_for_packed_sequences_and_windows():
    """The general policy's FP8 form: the GENERAL bool after the mask, V^T in one row per kv head whose sequences
    start on 128-key boundaries far enough apart (vt_key0), the pre-pass a CTA per 64 keys of the longest one."""
    p = Problem(3, 700, 900, 8, 2, 128, configs.FP8, True, "sm_90", varlen=True, total_q=1000, total_k=1500,
                out_dtype="bfloat16")
    plan = forms.forward_plan(p)
    assert [lau.kernel for lau in plan] == ["fp8_vt_permute", "fa3_fwd_sm90_fp8"]
    assert plan[1].template_args[5:7] == (launch.WINDOW, True)  # (causal is the window (-1, 0) there)
    assert plan[0].grid == (15, 2, 3) and launch.vt_keys(p, 192) == 128 * (12 + 3)
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(0, 400, rng.integers(1, 9))
        cu = np.concatenate([[0], np.cumsum(lens)])
        starts = [launch.vt_key0(int(cu[b]), b) for b in range(len(lens))]
        ends = [s0 + -(-int(n) // 64) * 64 for s0, n in zip(starts, lens)]  # the pre-pass's 64-key tiles
        assert all(s0 % 128 == 0 for s0 in starts)
        assert all(e <= s1 for e, s1 in zip(ends, starts[1:])), (lens, starts, ends)
        pp = dataclasses.replace(p, batch=len(lens), total_k=int(cu[-1]))
        assert ends[-1] <= launch.vt_keys(pp, 192)
    pw = Problem(1, 64, 64, 1, 1, 256, configs.FP8, False, "sm_90", window=(8, 8))
    assert forms.forward_plan(pw)[1].template_args[5:7] == (launch.WINDOW, True)


def test_quantize_packed_sequences_per_tensor():
    x = np.random.default_rng(1).standard_normal((30, 4, 64)).astype(np.float32)
    x8, d = fp8.quantize(x, "tensor")
    assert x8.shape == x.shape and d.shape == (1,)
    np.testing.assert_allclose(fp8.dequantize(x8, d), x, atol=np.abs(x).max() / 8)
    with pytest.raises(ValueError, match="granularity='tensor'"):
        fp8.quantize(x, "head")
