"""The Numba twins on a GPU: flash-attn's rule against the float64 reference, and agreement with the CUDA C kernels.

In float32 the twins and the CUDA C kernels compute the same thing with different summation orders, so they agree
to about 1e-5 of the largest value (forward) and 2e-5 (gradients, where dP - D cancels).
"""
from __future__ import annotations

import numpy as np
import pytest

import rawflash
from rawflash import reference, validation
from conftest import random_qkv

pytestmark = pytest.mark.gpu


def _device(*arrays):
    import cupy

    return tuple(cupy.asarray(x) for x in arrays)


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _forward(q, k, v, causal, kernel="fa2", backend="numba", **switches):
    """api.forward, or numba_backend.forward directly for the ablation switches (api passes them to CuPy only)."""
    if not switches or backend != "numba":
        return rawflash.forward(q, k, v, causal=causal, kernel=kernel, backend=backend, **switches)
    from rawflash import numba_backend

    c = validation.check_forward(q, k, v, causal, None, kernel, "numba")
    return numba_backend.forward(c.problem, q, k, v, c.scale, kernel, **switches)


def _check_rule(name, ours, ref, base, dtype, factor):
    ok, err, base_err, bound = reference.error_ratio_ok(_host(ours), ref, base, dtype, factor)
    assert ok, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive {np.dtype(dtype)} error {base_err:.3g})"


FORWARD_CASES = [
    ((2, 113, 203, 4, 2, 64), "float16", True, "fa2"),
    ((2, 203, 113, 4, 1, 128), "bfloat16", True, "fa2"),
    ((2, 127, 129, 4, 4, 40), "float32", False, "fa2"),
    ((1, 64, 128, 2, 1, 256), "float16", False, "fa2"),
    ((2, 113, 203, 4, 2, 64), "float16", True, "fa1"),
    ((1, 203, 113, 2, 2, 96), "float32", True, "fa1"),
]


@pytest.mark.parametrize("shape, dtype, causal, kernel", FORWARD_CASES,
                         ids=[f"{c[3]}-{c[1]}-{'causal' if c[2] else 'full'}-{c[0][1]}x{c[0][2]}-d{c[0][5]}"
                              for c in FORWARD_CASES])
def test_forward_rule(shape, dtype, causal, kernel):
    q, k, v = random_qkv(*shape, dtype, seed=0)
    out, lse = _forward(*_device(q, k, v), causal, kernel)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == np.float32
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)
    base_out, base_lse = reference.forward(q, k, v, causal=causal, upcast=False)
    _check_rule("out", out, ref_out, base_out, q.dtype, 2)
    _check_rule("lse", lse, ref_lse, base_lse, q.dtype, 2)


@pytest.mark.parametrize("switches", [{"defer_norm": False}, {"seq_parallel": False}, {"split_q": False},
                                      {"defer_norm": False, "seq_parallel": False, "split_q": False}],
                         ids=lambda sw: "+".join(f"no-{k}" for k in sw))
def test_forward_ablation_rule(switches):
    q, k, v = random_qkv(2, 113, 203, 4, 2, 64, "float16", seed=1)
    out, lse = _forward(*_device(q, k, v), True, **switches)
    _check_rule("out", out, *(reference.forward(q, k, v, causal=True, upcast=u)[0] for u in (True, False)), q.dtype, 2)


BACKWARD_CASES = [
    ((2, 113, 203, 4, 2, 64), "float16", True, False),
    ((2, 203, 113, 4, 1, 128), "bfloat16", False, True),
    ((1, 127, 129, 2, 2, 96), "float32", True, True),
    ((1, 64, 128, 2, 1, 256), "float16", True, False),
]


@pytest.mark.parametrize("shape, dtype, causal, deterministic", BACKWARD_CASES,
                         ids=[f"{'deterministic' if c[3] else 'atomic'}-{c[1]}-{'causal' if c[2] else 'full'}-"
                              f"{c[0][1]}x{c[0][2]}-d{c[0][5]}" for c in BACKWARD_CASES])
def test_backward_rule(shape, dtype, causal, deterministic):
    q, k, v = random_qkv(*shape, dtype, seed=2)
    dout = np.random.default_rng(3).standard_normal(q.shape).astype(q.dtype)
    q_, k_, v_, do_ = _device(q, k, v, dout)
    out, lse = rawflash.forward(q_, k_, v_, causal=causal, backend="numba")
    grads = rawflash.backward(do_, q_, k_, v_, out, lse, causal=causal, deterministic=deterministic, backend="numba")
    refs = reference.backward(dout, q, k, v, causal=causal)
    bases = reference.backward(dout, q, k, v, causal=causal, upcast=False)
    for name, g, ref, base in zip(("dq", "dk", "dv"), grads, refs, bases):
        _check_rule(name, g, ref, base, q.dtype, 3)


def _relative_gap(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs| over finite entries; -inf must sit at the same places in both."""
    ours, theirs = _host(ours).astype(np.float64), _host(theirs).astype(np.float64)
    assert np.array_equal(np.isneginf(ours), np.isneginf(theirs))
    finite = np.isfinite(theirs)
    scale = max(np.max(np.abs(theirs[finite]), initial=0.0), 1e-30)
    return float(np.max(np.abs(ours[finite] - theirs[finite]), initial=0.0)) / scale


AGREEMENT_SHAPES = [((2, 127, 129, 4, 1, 64), True), ((1, 64, 128, 2, 2, 128), False), ((1, 203, 113, 4, 2, 40), True)]


@pytest.mark.parametrize("kernel", ["fa2", "fa1"])
@pytest.mark.parametrize("shape, causal", AGREEMENT_SHAPES, ids=lambda x: str(x))
def test_forward_agrees_with_cuda_c_float32(shape, causal, kernel):
    q, k, v = _device(*random_qkv(*shape, "float32", seed=4))
    twin = _forward(q, k, v, causal, kernel, "numba")
    cuda_c = _forward(q, k, v, causal, kernel, "cupy")
    for name, a, b in zip(("out", "lse"), twin, cuda_c):
        gap = _relative_gap(a, b)
        assert gap <= 1e-5, f"{kernel} {name}: twin and CUDA C differ by {gap:.3g} of the largest value"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("shape, causal", AGREEMENT_SHAPES, ids=lambda x: str(x))
def test_backward_agrees_with_cuda_c_float32(shape, causal, deterministic):
    q, k, v = random_qkv(*shape, "float32", seed=5)
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(np.float32)
    q, k, v, dout = _device(q, k, v, dout)
    out, lse = rawflash.forward(q, k, v, causal=causal, backend="cupy")
    twin = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, backend="numba")
    cuda_c = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, backend="cupy")
    for name, a, b in zip(("dq", "dk", "dv"), twin, cuda_c):
        gap = _relative_gap(a, b)
        assert gap <= 2e-5, f"{name}: twin and CUDA C differ by {gap:.3g} of the largest value"


def test_array_kinds_round_trip():
    """CuPy in, CuPy out; NumPy in, NumPy out; strided views are read in place."""
    import cupy

    q, k, v = random_qkv(1, 50, 70, 2, 1, 64, "float16", seed=8)
    out_np, lse_np = rawflash.forward(q, k, v, backend="numba")
    assert isinstance(out_np, np.ndarray) and isinstance(lse_np, np.ndarray)
    views = [cupy.ascontiguousarray(cupy.asarray(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v)]
    out_cp, lse_cp = rawflash.forward(*views, backend="numba")
    assert isinstance(out_cp, cupy.ndarray) and isinstance(lse_cp, cupy.ndarray)
    np.testing.assert_allclose(out_cp.get().astype(np.float32), out_np.astype(np.float32), rtol=0, atol=2e-3)
    np.testing.assert_allclose(lse_cp.get(), lse_np, rtol=1e-5, atol=1e-5)
