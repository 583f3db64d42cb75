"""The Numba twins on a GPU: flash-attn's rule against the float64 reference, and agreement with the CUDA C kernels.

In float32 the twins and the CUDA C kernels compute the same thing with different summation orders, so they agree
to about 1e-5 of the largest value (forward) and 2e-5 (gradients, where dP - D cancels). Every feature (windows,
soft-capping, ALiBi, sinks, packed variable lengths, seqused_k) runs forward and backward on the twins too.
"""
from __future__ import annotations

import numpy as np
import pytest

import rawflash
from rawflash import reference
from conftest import random_qkv

gpu = pytest.mark.gpu  # every test but the PTX compile, which needs NVVM only


def _device(*arrays):
    import cupy

    return tuple(cupy.asarray(x) for x in arrays)


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _forward(q, k, v, causal, kernel="fa2", backend="numba", **switches):
    return rawflash.forward(q, k, v, causal=causal, kernel=kernel, backend=backend, **switches)


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


@gpu
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


@gpu
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


@gpu
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


@gpu
@pytest.mark.parametrize("kernel", ["fa2", "fa1"])
@pytest.mark.parametrize("shape, causal", AGREEMENT_SHAPES, ids=lambda x: str(x))
def test_forward_agrees_with_cuda_c_float32(shape, causal, kernel):
    q, k, v = _device(*random_qkv(*shape, "float32", seed=4))
    twin = _forward(q, k, v, causal, kernel, "numba")
    cuda_c = _forward(q, k, v, causal, kernel, "cupy")
    for name, a, b in zip(("out", "lse"), twin, cuda_c):
        gap = _relative_gap(a, b)
        assert gap <= 1e-5, f"{kernel} {name}: twin and CUDA C differ by {gap:.3g} of the largest value"


@gpu
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


@gpu
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


# ---------------------------------------------------------------- features
FEATURES = [
    ("window", dict(window=(64, 17))),
    ("window-causal-blocks", dict(window=(150, 0), causal=True)),
    ("softcap", dict(softcap=5.0, scale=1.0)),
    ("alibi-batch-causal", dict(alibi="batch", causal=True)),
    ("sinks", dict(sinks="random", causal=True)),
    ("varlen-causal", dict(varlen=True, causal=True)),
    ("seqused", dict(seqused=True, causal=True)),
    ("varlen+window+sinks+causal", dict(varlen=True, window=(40, 0), causal=True, sinks="random")),
    ("softcap+alibi+window", dict(softcap=20.0, alibi="heads", window=(32, 32))),
]


def _feature_case(sq, sk, h, hk, d, dtype, opts, seed):
    from test_gpu_features import _inputs

    return _inputs(sq, sk, h, hk, d, dtype, opts, seed)


def _check_features(q, k, v, extra, grads_too=True, deterministic=False):
    from test_gpu_features import _check

    dev = {n: _device(x)[0] if isinstance(x, np.ndarray) else x for n, x in extra.items()}
    out, lse = rawflash.forward(*_device(q, k, v), backend="numba", **dev)
    out, lse = _host(out), _host(lse)
    (ref_out, ref_lse), (base_out, base_lse) = (reference.forward(q, k, v, upcast=u, **extra) for u in (True, False))
    _check(out, ref_out, base_out, q.dtype, 2, "out")
    _check(lse, ref_lse, base_lse, q.dtype, 2, "lse")
    if not grads_too:
        return
    dout = np.random.default_rng(11).standard_normal(q.shape).astype(q.dtype)
    grads = rawflash.backward(*_device(dout, q, k, v, out, lse), backend="numba", deterministic=deterministic, **dev)
    refs = reference.backward(dout, q, k, v, **extra)
    bases = reference.backward_bases(dout, q, k, v, refs, **extra)
    assert len(grads) == len(refs)
    for name, g, ref, base in zip(("dq", "dk", "dv", "dsinks"), grads, refs, bases):
        _check(_host(g), ref, base, q.dtype if name != "dsinks" else np.float32, 3, name)


@gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name,opts", FEATURES, ids=[n for n, _ in FEATURES])
def test_feature_rule(name, opts, dtype, deterministic):
    q, k, v, extra = _feature_case(203, 113, 4, 2, 64, dtype, opts, seed=12)
    _check_features(q, k, v, extra, deterministic=deterministic)


@gpu
@pytest.mark.parametrize("name,opts", FEATURES, ids=[n for n, _ in FEATURES])
def test_feature_agrees_with_cuda_c_float32(name, opts):
    """The twins and the CUDA C kernels on the same feature call, float32: equal up to summation order."""
    q, k, v, extra = _feature_case(113, 203, 4, 1, 96, "float32", opts, seed=13)
    dev = {n: _device(x)[0] if isinstance(x, np.ndarray) else x for n, x in extra.items()}
    q, k, v = _device(q, k, v)
    twin = rawflash.forward(q, k, v, backend="numba", **dev)
    cuda_c = rawflash.forward(q, k, v, backend="cupy", wgmma=False, **dev)
    for what, a, b in zip(("out", "lse"), twin, cuda_c):
        gap = _relative_gap(a, b)
        assert gap <= 1e-5, f"{name} {what}: twin and CUDA C differ by {gap:.3g} of the largest value"


# ---------------------------------------------------------------- the twins compile (NVVM, no GPU)
PTX_CHECK = r"""
import dataclasses, itertools, json, sys
import numpy as np
from numba import cuda, typeof, types
from numba.cuda.cudadrv import nvvm
if not nvvm.is_available():
    print(json.dumps({"skip": "NVVM (libNVVM) is not available"}))
    sys.exit(0)
import numba.cuda.compiler as compiler, numba.cuda.dispatcher as dispatcher

class Device:  # device functions compile for the current device; without a GPU: sm_90, as the kernels do
    compute_capability = (9, 0)
if not cuda.is_available():
    dispatcher.get_current_device = compiler.get_current_device = lambda: Device()
from rawflash.kernels import forms, numba_backend as nb
from rawflash.problem import Problem
from rawflash.numba_kernels.params import BwdParams, FwdParams

def arr(dtype, ndim):
    return types.Array(typeof(np.zeros(1, dtype)).dtype, ndim, "A")

def signature(direction, dtype):
    p = Problem(1, 4, 4, 1, 1, 8, "float32", False)
    params = (nb._params(FwdParams, p, 0.5, {}) if direction == "fwd" else
              nb._params(BwdParams, p, 0.5, {}, rows_batch=1, rows_seqlen=4))
    x, r3, i1, f1 = arr(dtype, 4), arr(np.float32, 3), arr(np.int32, 1), arr(np.float32, 1)
    if direction == "fwd":  # q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws
        return (typeof(params), x, x, x, x, r3, i1, i1, i1, f1, f1, arr(np.float32, 4), r3, r3)
    # q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k, slopes, sinks
    return (typeof(params), x, x, x, x, x, x, x, x, r3, r3, r3, arr(np.float32, 4), r3, i1, i1, i1, f1, f1)

done, failed = set(), []
for dtype, feature in itertools.product(("float16", "float32"), ("plain", "causal", "general")):
    base = Problem(1, 100, 100, 2, 1, 64, dtype, feature == "causal")
    p = dataclasses.replace(base, window=(8, 3)) if feature == "general" else base
    plans = [("fwd", nb.forward_plan(p, "fa2")), ("bwd", nb.backward_plan(p, False)),
             ("bwd", nb.backward_plan(p, True))]
    if not p.general:
        off = forms.Switches(defer_norm=False, seq_parallel=False, split_q=False)
        plans += [("fwd", nb.forward_plan(p, "fa1")), ("fwd", nb.forward_plan(p, "fa2", off))]
    for direction, plan in plans:
        for lau in plan:
            if (lau.name_expression, dtype) in done:
                continue
            done.add((lau.name_expression, dtype))
            try:
                cuda.compile_ptx(nb.twin_of(lau).kernel.py_func, signature(direction, np.dtype(dtype)), cc=(9, 0))
            except Exception as err:
                failed.append(f"{lau.name_expression} ({dtype} arrays): {type(err).__name__}: {err}"[:2000])
print(json.dumps({"compiled": len(done), "failed": failed}))
"""


@pytest.mark.compile
@pytest.mark.slow
def test_twins_compile_to_ptx():
    """The simulator runs the twins as Python and types nothing; here every kernel the backend plans (fa2 forward
    with and without the ablation switches, fa1, both backwards; plain, causal and general policies; float16 and
    float32 arrays) goes through Numba's nopython typing and NVVM to PTX for sm_90, with the argument types the
    backend passes, in a child process (numba without its simulator), on a machine without a GPU too."""
    import json
    import subprocess
    import sys

    from rawflash.cli import sysinfo

    env = sysinfo.child_env()
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, "-c", PTX_CHECK], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    assert not got["failed"], "\n".join(got["failed"])
    assert got["compiled"] >= 20
