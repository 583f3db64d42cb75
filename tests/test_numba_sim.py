"""The Numba twins on Numba's CUDA simulator (CPU), against the float64 reference by flash-attn's rule.

Run in a process of its own with the simulator switched on before numba is imported::

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim tests/test_numba_sim.py

Anywhere else the module skips itself. The simulator runs every thread as a Python thread (about 1 us per
multiply-add), so the shapes are small; they still cross ragged lengths, seqlen_q != seqlen_k both ways, MHA / GQA /
MQA, causal on and off, odd and large head dims, float16 / bfloat16 / float32, every kernel and switch.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not SIMULATOR, reason="needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported "
                                             "(run this file in its own process)"),
]

import rawflash  # noqa: E402
from rawflash import reference, validation  # noqa: E402
from conftest import random_qkv  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
MHA_SQUARE = (1, 64, 64, 2, 2, 32)
GQA_SHORT_Q = (1, 17, 40, 4, 2, 40)      # seqlen_q < seqlen_k, odd head_dim (runs as D = 64)
MQA_LONG_Q = (2, 40, 17, 2, 1, 32)       # seqlen_q > seqlen_k: causal hides the first 23 query rows
TINY_ODD = (1, 1, 1, 1, 1, 59)           # head_dim padded to 64 as on the CUDA C path
LARGE_D = (1, 5, 7, 2, 1, 200)           # D = 256
MANY_BLOCKS = (1, 70, 150, 2, 1, 32)     # several key blocks per query block for every tile row


def _problem_id(shape):
    b, sq, sk, h, hk, d = shape
    return f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}"


def _inputs(shape, dtype, seed=0):
    b, sq, sk, h, hk, d = shape
    return random_qkv(b, sq, sk, h, hk, d, dtype, seed=seed)


def _dout(q, seed=1):
    return np.random.default_rng(seed).standard_normal(q.shape).astype(q.dtype)


def _forward(q, k, v, causal, kernel="fa2", **switches):
    """The numba backend; with ablation switches it is called directly (api.forward passes them to CuPy only)."""
    if not switches:
        return rawflash.forward(q, k, v, causal=causal, kernel=kernel, backend="numba")
    from rawflash import numba_backend

    c = validation.check_forward(q, k, v, causal, None, kernel, "numba")
    return numba_backend.forward(c.problem, q, k, v, c.scale, kernel, **switches)


def _assert_forward_ok(q, k, v, causal, out, lse):
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == np.float32
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)
    base_out, base_lse = reference.forward(q, k, v, causal=causal, upcast=False)
    for name, ours, ref, base in (("out", out, ref_out, base_out), ("lse", lse, ref_lse, base_lse)):
        ok, err, base_err, bound = reference.error_ratio_ok(ours, ref, base, q.dtype, 2)
        assert ok, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive {q.dtype} error {base_err:.3g})"


def _assert_backward_ok(dout, q, k, v, causal, grads):
    refs = reference.backward(dout, q, k, v, causal=causal)
    bases = reference.backward(dout, q, k, v, causal=causal, upcast=False)
    for name, ours, ref, base, like in zip(("dq", "dk", "dv"), grads, refs, bases, (q, k, v)):
        assert ours.shape == like.shape and ours.dtype == like.dtype, name
        ok, err, base_err, bound = reference.error_ratio_ok(ours, ref, base, q.dtype, 3)
        assert ok, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive {q.dtype} error {base_err:.3g})"


def _hidden_rows(shape, causal):
    """Query rows that see no key (bottom-right causal alignment with seqlen_q > seqlen_k)."""
    _, sq, sk, _, _, _ = shape
    return max(0, sq - sk) if causal else 0


# ---------------------------------------------------------------- forward
FORWARD_CASES = [
    pytest.param(MHA_SQUARE, "float32", False, "fa2", id="fa2-float32-full-" + _problem_id(MHA_SQUARE)),
    pytest.param(GQA_SHORT_Q, "float16", True, "fa2", id="fa2-float16-causal-" + _problem_id(GQA_SHORT_Q)),
    pytest.param(MQA_LONG_Q, "float32", True, "fa2", id="fa2-float32-causal-" + _problem_id(MQA_LONG_Q)),
    pytest.param(TINY_ODD, "float32", False, "fa2", id="fa2-float32-full-" + _problem_id(TINY_ODD)),
    pytest.param(LARGE_D, "float16", True, "fa2", id="fa2-float16-causal-" + _problem_id(LARGE_D)),
    pytest.param(MANY_BLOCKS, "float16", True, "fa2", id="fa2-float16-causal-" + _problem_id(MANY_BLOCKS)),
    pytest.param((1, 31, 31, 2, 2, 96), "float32", True, "fa2", id="fa2-float32-causal-b1-31x31-h2/2-d96"),
    pytest.param(GQA_SHORT_Q, "float32", True, "fa1", id="fa1-float32-causal-" + _problem_id(GQA_SHORT_Q)),
    pytest.param(MQA_LONG_Q, "float16", False, "fa1", id="fa1-float16-full-" + _problem_id(MQA_LONG_Q)),
    pytest.param(MQA_LONG_Q, "float16", True, "fa1", id="fa1-float16-causal-" + _problem_id(MQA_LONG_Q)),
    pytest.param(MANY_BLOCKS, "float16", True, "fa1", id="fa1-float16-causal-" + _problem_id(MANY_BLOCKS)),
]


@pytest.mark.parametrize("shape, dtype, causal, kernel", FORWARD_CASES)
def test_forward(shape, dtype, causal, kernel):
    q, k, v = _inputs(shape, dtype)
    out, lse = _forward(q, k, v, causal, kernel)
    _assert_forward_ok(q, k, v, causal, out, lse)
    hidden = _hidden_rows(shape, causal)
    assert np.all(out[:, :hidden] == 0) and np.all(lse[:, :, :hidden] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, hidden:]))


ABLATIONS = [
    {"defer_norm": False},
    {"seq_parallel": False},
    {"split_q": False},
    {"defer_norm": False, "seq_parallel": False, "split_q": False},
]


@pytest.mark.parametrize("switches", ABLATIONS, ids=lambda sw: "+".join(f"no-{k}" for k in sw))
def test_forward_ablation(switches):
    shape, dtype = (1, 33, 45, 4, 2, 32), "float16"
    q, k, v = _inputs(shape, dtype, seed=3)
    out, lse = _forward(q, k, v, True, "fa2", **switches)
    _assert_forward_ok(q, k, v, True, out, lse)


def test_bfloat16_upcast_on_host():
    q, k, v = _inputs((1, 17, 23, 2, 1, 32), "bfloat16", seed=4)
    out, lse = _forward(q, k, v, True)
    _assert_forward_ok(q, k, v, True, out, lse)
    dout = _dout(q)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=True, backend="numba")
    _assert_backward_ok(dout, q, k, v, True, grads)


def test_forward_strided_views():
    """q, k, v given as (batch, heads, seqlen, head_dim) arrays viewed through transpose(0, 2, 1, 3)."""
    q, k, v = _inputs((1, 20, 30, 2, 1, 32), "float32", seed=5)
    views = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v)]
    assert not views[0].flags.c_contiguous
    out, lse = _forward(*views, False)
    _assert_forward_ok(q, k, v, False, out, lse)


def test_naive_has_no_numba_twin():
    q, k, v = _inputs((1, 4, 4, 1, 1, 32), "float32")
    with pytest.raises(NotImplementedError, match="naive"):
        rawflash.forward(q, k, v, kernel="naive", backend="numba")


# ---------------------------------------------------------------- backward
BACKWARD_CASES = [
    pytest.param((1, 40, 17, 4, 2, 32), "float32", True, False, id="atomic-float32-causal-b1-40x17-h4/2-d32"),
    pytest.param(GQA_SHORT_Q, "float16", True, True, id="deterministic-float16-causal-" + _problem_id(GQA_SHORT_Q)),
    pytest.param((1, 24, 48, 2, 2, 64), "float32", False, True, id="deterministic-float32-full-b1-24x48-h2/2-d64"),
    pytest.param((1, 33, 33, 2, 1, 32), "float16", False, False, id="atomic-float16-full-b1-33x33-h2/1-d32"),
    pytest.param(LARGE_D, "float32", True, False, id="atomic-float32-causal-" + _problem_id(LARGE_D)),
    pytest.param((1, 70, 100, 2, 1, 32), "float16", True, False, id="atomic-float16-causal-b1-70x100-h2/1-d32"),
    pytest.param((1, 70, 100, 2, 1, 32), "float32", True, True, id="deterministic-float32-causal-b1-70x100-h2/1-d32"),
]


@pytest.mark.parametrize("shape, dtype, causal, deterministic", BACKWARD_CASES)
def test_backward(shape, dtype, causal, deterministic):
    q, k, v = _inputs(shape, dtype, seed=6)
    dout = _dout(q)
    out, lse = _forward(q, k, v, causal)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, backend="numba")
    _assert_backward_ok(dout, q, k, v, causal, grads)
    hidden = _hidden_rows(shape, causal)
    assert np.all(grads[0][:, :hidden] == 0)


def test_backward_atomic_and_deterministic_agree():
    shape, causal = MQA_LONG_Q, True
    q, k, v = _inputs(shape, "float32", seed=7)
    dout = _dout(q)
    out, lse = _forward(q, k, v, causal)
    atomic = rawflash.backward(dout, q, k, v, out, lse, causal=causal, backend="numba")
    deterministic = rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, backend="numba")
    for name, a, d in zip(("dq", "dk", "dv"), atomic, deterministic):
        np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------- the package
def test_numpy_row_stack_shim():
    import numpy

    import rawflash.numba_kernels  # noqa: F401
    from rawflash.numba_kernels import _shim

    assert hasattr(numpy, "row_stack")
    saved = numpy.__dict__.pop("row_stack", None)
    try:
        _shim.apply()                                        # what happens on numpy >= 2.5
        assert numpy.row_stack is numpy.vstack
    finally:
        if saved is not None:
            numpy.row_stack = saved


def test_twin_launch_shapes_fit_an_h200():
    """Every tile row of configs.py gives a twin CTA of at most 1024 threads and 227 KB of shared memory."""
    from rawflash import configs
    from rawflash.numba_kernels import fa1_fwd, fa2_bwd, fa2_fwd

    limit = 232448
    for (kernel, d, _), c in configs.TABLE.items():
        if kernel.endswith("_sm90"):  # the wgmma rows: the twins run fa2_fwd's and fa2_bwd's rows instead
            continue
        if kernel == "fa2_fwd":
            shapes = [(fa2_fwd.threads(c.br, c.warps), fa2_fwd.smem_bytes(c.br, c.bc, c.warps, d))]
        elif kernel == "fa2_fwd_splitk":
            shapes = [(fa2_fwd.threads(c.br, c.warps, False), fa2_fwd.smem_bytes(c.br, c.bc, c.warps, d, False))]
        elif kernel == "fa1_fwd":
            shapes = [(fa1_fwd.threads(c.br, c.warps), fa1_fwd.smem_bytes(c.br, c.bc, c.warps, d))]
        elif kernel == "fa2_bwd":
            shapes = [(fa2_bwd.threads(c.bc), fa2_bwd.smem_bytes(c.br, c.bc, d, atomic)) for atomic in (True, False)]
        elif kernel == "fa2_bwd_dq":
            shapes = [(fa2_bwd.threads_dq(c.br), fa2_bwd.smem_bytes_dq(c.br, c.bc, d))]
        else:
            raise AssertionError(f"no twin launch shape known for the {kernel!r} rows")
        for threads, smem in shapes:
            assert threads <= 1024 and smem <= limit, (kernel, d, c, threads, smem)
