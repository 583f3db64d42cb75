"""The API contract without a GPU: validation (one test per refused input), empty inputs, NumPy in / NumPy out.

Every refusal must happen before anything is launched: the backends are replaced by a function that fails the
test if it is ever reached.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import rawflash
from rawflash import reference
from rawflash.kernels import cupy_backend
from conftest import gpu_available, random_qkv


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel launch was reached")

    for name in ("bind_forward", "bind_forward_fp8", "bind_backward", "bind_decode", "run"):  # every way to a launch
        monkeypatch.setattr(cupy_backend, name, refuse)


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=16, dtype=np.float16):
    return random_qkv(b, sq, sk, h, hk, d, dtype)


def refused(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        rawflash.forward(*args, **kwargs)


def test_wrong_ndim():
    q, k, v = qkv()
    refused(ValueError, r"q must have 4 dimensions .* got shape \(2, 5, 64\)", q.reshape(2, 5, 64), k, v)
    refused(ValueError, r"k must have 4 dimensions", q, k[0], v)


def test_batch_mismatch():
    q, k, v = qkv()
    refused(ValueError, r"same batch size, got q 2, k 1, v 2", q, k[:1], v)


def test_seqlen_mismatch_between_k_and_v():
    q, k, v = qkv()
    refused(ValueError, r"k and v must have the same seqlen_k, got k 7, v 6", q, k, v[:, :6])


def test_kv_heads_mismatch_between_k_and_v():
    q, k, v = qkv()
    refused(ValueError, r"same number of kv heads, got k 2, v 1", q, k, v[:, :, :1])


def test_head_dim_mismatch():
    q, k, v = qkv()
    refused(ValueError, r"q and k must have the same head_dim, got q 16, k 8", q, k[..., :8], v)
    # v may have a head_dim of its own (MLA), never above q's (tests/test_mla_reference.py: the other refusals)
    refused(ValueError, r"v's head_dim must be between 1 and q's head_dim 16, got 32", q, k,
            np.concatenate([v, v], axis=-1))
    refused(ValueError, r"v's head_dim must be between 1 and q's head_dim 16, got 32", q, k,
            np.concatenate([v, v], axis=-1), backend="reference")


def test_heads_not_a_multiple_of_kv_heads():
    q, k, v = qkv(h=3, hk=2)
    refused(ValueError, r"heads of q must be a multiple of kv_heads .* got heads 3, kv_heads 2", q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    refused(TypeError, r"share one dtype, got q float16, k float32, v float16", q, k.astype(np.float32), v)


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_unsupported_dtype(dtype):
    q, k, v = (x.astype(dtype) for x in qkv())
    refused(TypeError, r"q must have dtype float16, bfloat16 or float32, got", q, k, v)


@pytest.mark.parametrize("d", [0, 513])
def test_head_dim_out_of_range(d):
    q, k, v = (np.ones((1, 3, 2, d), np.float16) for _ in range(3))
    refused(ValueError, rf"head_dim must be between 1 and 512, got {d}", q, k, v)


class _FakeDeviceArray:
    """Looks like a CuPy array on device 0 (module name, .device.id, .data) without needing a GPU."""

    __module__ = "cupy._fake"

    def __init__(self, like):
        self.shape, self.dtype, self.strides = like.shape, like.dtype, like.strides
        self.device = type("Device", (), {"id": 0})()
        self.data = None


def test_arrays_on_different_devices():
    q, k, v = qkv()
    refused(ValueError, r"same device, got q on host, k on 0, v on host", q, _FakeDeviceArray(k), v)


@pytest.mark.parametrize("bad", [[[1.0]], "q", None, 3.0])
def test_non_array_inputs(bad):
    q, k, v = qkv()
    refused(TypeError, r"q must be an array .* got", bad, k, v)


@pytest.mark.parametrize("scale, exc", [(-1.0, ValueError), (0.0, ValueError), (math.nan, ValueError),
                                        (math.inf, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_scale_must_be_positive_finite(scale, exc):
    refused(exc, r"scale must be a positive finite real number or None, got", *qkv(), scale=scale)


def test_unknown_kernel_and_backend():
    refused(ValueError, r"kernel must be one of 'fa2', 'fa1', 'naive', got 'fa3'", *qkv(), kernel="fa3")
    refused(ValueError, r"backend must be one of 'cupy', 'numba', 'reference', got 'torch'", *qkv(), backend="torch")


def test_causal_must_be_bool():
    refused(TypeError, r"causal must be a bool, got int 1", *qkv(), causal=1)


def test_ablation_switches_are_checked():
    refused(TypeError, r"unexpected keyword argument\(s\) \['split_k'\]", *qkv(), split_k=False)
    refused(ValueError, r"apply to kernel='fa2' only", *qkv(), kernel="fa1", split_q=False)


def _backward_args():
    q, k, v = qkv()
    out, lse = rawflash.forward(q, k, v, backend="reference")
    return np.ones_like(q), q, k, v, out, lse


@pytest.mark.parametrize("which, change, exc, match", [
    (0, lambda x: x[:, :4], ValueError, r"dout must have q's shape"),
    (4, lambda x: x[:, :4], ValueError, r"out must have q's shape"),
    (5, lambda x: x[:, :, :4], ValueError, r"lse must have shape \(batch, heads, seqlen_q\)"),
    (0, lambda x: x.astype(np.float32), TypeError, r"dout must have q's dtype float16, got float32"),
    (5, lambda x: x.astype(np.float16), TypeError, r"lse must be float32"),
])
def test_backward_refuses_mismatched_dout_out_lse(which, change, exc, match):
    args = list(_backward_args())
    args[which] = change(args[which])
    with pytest.raises(exc, match=match):
        rawflash.backward(*args)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        rawflash.backward(*_backward_args(), deterministic="yes")


@pytest.mark.parametrize("backend", ["reference", "cupy"])
def test_empty_batch_and_seqlen_q_give_empty_results(backend):
    for shape in ((0, 5, 7), (2, 0, 7)):
        b, sq, sk = shape
        q, k, v = qkv(b=b, sq=sq, sk=sk)
        out, lse = rawflash.forward(q, k, v, backend=backend)
        assert isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (b, 4, sq) and lse.dtype == np.float32


@pytest.mark.parametrize("backend", ["reference", "cupy"])
def test_seqlen_k_zero_gives_zeros_and_minus_inf(backend):
    q, k, v = qkv(sk=0)
    out, lse = rawflash.forward(q, k, v, backend=backend)
    assert np.array_equal(out, np.zeros_like(q)) and np.all(np.isneginf(lse))
    dq, dk, dv = rawflash.backward(np.ones_like(q), q, k, v, out, lse, backend=backend)
    assert not dq.any() and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_numpy_in_numpy_out_with_the_reference_backend(dtype):
    q, k, v = qkv(dtype=dtype)
    out, lse = rawflash.forward(q, k, v, causal=True, backend="reference")
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype) and lse.dtype == np.float32
    ref, ref_lse = reference.forward(q, k, v, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=float(np.finfo(np.float16).eps) * 8
                               if dtype != ml_dtypes.bfloat16 else 2e-2)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    dq, dk, dv = rawflash.backward(np.ones_like(q), q, k, v, out, lse, causal=True, backend="reference")
    assert dq.dtype == q.dtype and dk.shape == k.shape


@pytest.mark.skipif(gpu_available(), reason="checks the message given when no GPU is visible")
def test_cupy_backend_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="backend='cupy' needs a CUDA GPU and none is visible"):
        rawflash.forward(*qkv())
