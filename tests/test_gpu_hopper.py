"""The cp.async wgmma forward kernel (fa2_fwd_sm90, warp_specialize=False) on an sm_90 GPU, by flash-attn's rule
against the float64 reference, with and without FA3's softmax / P V overlap, over ragged lengths, seqlen_q !=
seqlen_k both ways, GQA / MQA and causal both ways, and the wgmma backward. (tests/test_gpu_fa3.py tests FA3's
form, the default forward on an H200; tests/test_gpu_kernels.py runs the default path; tools/gpu_run.sh runs that
file once more with RAWFLASH_WGMMA=0 so the mma.sync kernel stays covered.)"""
from __future__ import annotations

import itertools

import pytest

import rawflash
from rawflash.kernels import forms
from rawflash.problem import Problem
from conftest import skip_unless_sm90
from test_gpu_kernels import check_backward, check_forward

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 1), (3, 3), (17, 17), (64, 128), (113, 203), (127, 129), (203, 113), (1023, 1024), (128, 128),
           (256, 512), (640, 129)]
HEAD_DIMS = [40, 64, 128, 192, 256]
HEADS = [(4, 4), (4, 2), (4, 1)]


@pytest.fixture(autouse=True)
def _needs_sm90():
    skip_unless_sm90("the wgmma kernel")


def _cases():
    out = []
    for i, (sq, dtype, causal, overlap) in enumerate(itertools.product(SEQLENS, ("float16", "bfloat16"),
                                                                         (False, True), (True, False))):
        d, (h, hk) = HEAD_DIMS[i % len(HEAD_DIMS)], HEADS[(i // len(HEAD_DIMS)) % len(HEADS)]
        out.append(pytest.param(*sq, h, hk, d, dtype, causal, overlap,
                                id=f"{dtype}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}-h{h}/{hk}"
                                   f"-{'overlap' if overlap else 'serial'}"))
    for d, dtype, causal, sq in itertools.product(HEAD_DIMS, ("float16", "bfloat16"), (False, True),
                                                  ((113, 203), (203, 113), (300, 300))):
        out.append(pytest.param(*sq, 4, 2, d, dtype, causal, True,
                                id=f"dims-{dtype}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}"))
    return out


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal,overlap", _cases())
def test_wgmma_forward(sq, sk, h, hk, d, dtype, causal, overlap):
    check_forward(2, sq, sk, h, hk, d, dtype, causal, "fa2", wgmma=True, warp_specialize=False, overlap=overlap)


def test_default_path_on_h200_is_fa3():
    from rawflash.kernels import cupy_backend

    p = Problem(1, 1, 1, 1, 1, 128, "bfloat16", False, cupy_backend.device_arch())
    assert forms.fa2_forward(p).kernel == "fa3_fwd_sm90"
    assert forms.fa2_forward(p, forms.Switches(warp_specialize=False)).kernel == "fa2_fwd_sm90"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_large_logits_no_nan(dtype):
    check_forward(1, 127, 129, 2, 2, 64, dtype, True, "fa2", scale=8.0, wgmma=True, warp_specialize=False)
    check_forward(1, 300, 1000, 2, 1, 128, dtype, False, "fa2", scale=8.0, wgmma=True, warp_specialize=False)


def test_wgmma_and_mma_sync_agree():
    """Same inputs through both kernels: both obey the rule, and they differ only by rounding."""
    import cupy
    import numpy as np

    from conftest import random_qkv

    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 777, 1031, 8, 2, 128, "bfloat16", seed=4))
    a, la = rawflash.forward(q, k, v, causal=True, wgmma=True, warp_specialize=False)
    b, lb = rawflash.forward(q, k, v, causal=True, wgmma=False)
    diff = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
    assert diff < 2e-2, f"wgmma and mma.sync outputs differ by {diff}"
    assert float(cupy.abs(la - lb).max()) < 1e-3
    assert np.isfinite(cupy.asnumpy(a.astype(cupy.float32))).all()


def _bwd_cases():
    out = []
    for i, (sq, dtype, causal) in enumerate(itertools.product(SEQLENS, ("float16", "bfloat16"), (False, True))):
        d, (h, hk) = (40, 64, 128, 256)[i % 4], HEADS[(i // 4) % len(HEADS)]
        out.append(pytest.param(*sq, h, hk, d, dtype, causal,
                                id=f"{dtype}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}-h{h}/{hk}"))
    return out


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", _bwd_cases())
def test_wgmma_backward(sq, sk, h, hk, d, dtype, causal):
    from rawflash.kernels import cupy_backend

    p = Problem(2, sq, sk, h, hk, d, dtype, causal, cupy_backend.device_arch())
    assert forms.backward_plan(p)[1].kernel in ("fa2_bwd_sm90", "fa3_bwd_sm90")
    check_backward(2, sq, sk, h, hk, d, dtype, causal, False)


@pytest.mark.parametrize("d", [128, 256])
def test_wgmma_backward_long_gqa_causal(d):
    """Many query blocks per key block and 4 query heads per kv head: the CTA's longest loop."""
    check_backward(1, 1000, 1500, 8, 2, d, "bfloat16", True, False, seed=3)


@pytest.mark.parametrize("d", [200, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_backward_split_d(d, dtype, causal):
    """The SPLIT_D form (warpgroups split dK, dV's columns) on ragged shapes both ways."""
    check_backward(2, 203, 113, 4, 2, d, dtype, causal, False)
    check_backward(1, 113, 203, 2, 1, d, dtype, causal, False)
