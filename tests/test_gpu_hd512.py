"""head_dim 512 (and the head dims 257 - 512 that pad to it) on a GPU against the float64 reference by flash-attn's
rule (forward 2x, gradients 3x the same-precision naive error, plus a floor): the forward and the backward (the
default and deterministic=True, both the two-pass plan at 512) in float16 and bfloat16, causal both ways (seqlen_q
above and below seqlen_k), MHA / GQA / MQA, ragged lengths, packed sequences and the features, and standard
attention (kernel='naive').

The forward on Hopper is FA3's column split (two consumer warpgroups on 64 rows, each holding half of O's columns),
elsewhere and with wgmma=False the mma.sync form whose warps split the head columns; the backward runs the
mma.sync forms everywhere, the main pass and then the dQ pass (configs' rows at 512; tests/test_head_dim_512.py
checks the plans without a GPU). test_forward and the features reach FA3's form on Hopper by default;
test_forward_mma_sync runs the mma.sync form there too, and test_forward_fa3_switches FA3's switches and grids with
more tiles than SMs.
"""
from __future__ import annotations

import itertools

import pytest

from conftest import skip_unless_sm90
from test_gpu_features import check_feature
from test_gpu_kernels import check_backward, check_forward

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 1), (17, 17), (64, 128), (113, 203), (203, 113), (127, 129), (300, 300)]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
HEAD_DIMS = [512, 300, 264]  # 300 and 264 pad to 512 (zero columns loaded, never stored)


def _grid():
    cases = []
    for i, ((sq, sk), dtype, causal) in enumerate(itertools.product(SEQLENS, ("float16", "bfloat16"), (False, True))):
        d = HEAD_DIMS[i % len(HEAD_DIMS)]
        h, hk = HEADS[(i // len(HEAD_DIMS)) % len(HEADS)]
        cases.append(pytest.param(sq, sk, h, hk, d, dtype, causal,
                                  id=f"{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-d{d}-h{h}/{hk}"))
    return cases


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", _grid())
def test_forward(sq, sk, h, hk, d, dtype, causal):
    check_forward(2, sq, sk, h, hk, d, dtype, causal, "fa2")


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", _grid()[::3])
def test_forward_mma_sync(sq, sk, h, hk, d, dtype, causal):
    """The mma.sync form (its warps split the head columns), which Hopper runs only when asked (wgmma=False)."""
    check_forward(2, sq, sk, h, hk, d, dtype, causal, "fa2", wgmma=False)


SWITCHES = {"no-pingpong": {"pingpong": False}, "no-overlap": {"overlap": False},
            "not-persistent": {"persistent": False}, "static": {"persistent": True, "dynamic": False}}


@pytest.mark.parametrize("sw", list(SWITCHES))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_fa3_switches(sw, causal):
    """FA3's column split with each switch off in turn; 3 x 4 heads x 6 query tiles of 64 rows = 72 tiles."""
    skip_unless_sm90("FA3's form")
    check_forward(3, 350, 333, 4, 2, 512, "bfloat16", causal, "fa2", warp_specialize=True, **SWITCHES[sw])


@pytest.mark.parametrize("causal", [False, True])
def test_forward_fa3_more_tiles_than_sms(causal):
    """2 x 8 heads x 17 query tiles = 272 tiles: each persistent CTA walks several."""
    skip_unless_sm90("FA3's form")
    check_forward(2, 1050, 1050, 8, 2, 512, "float16", causal, "fa2", warp_specialize=True)


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", _grid())
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward(sq, sk, h, hk, d, dtype, causal, deterministic):
    check_backward(2, sq, sk, h, hk, d, dtype, causal, deterministic)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_naive(dtype, causal):
    check_forward(2, 113, 203, 4, 2, 512, dtype, causal, "naive")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_large_logits_no_nan(dtype):
    check_forward(1, 127, 129, 2, 2, 512, dtype, True, "fa2", scale=8.0)


FEATURES = [
    ("varlen", dict(varlen=True)),
    ("varlen-causal", dict(varlen=True, causal=True)),
    ("varlen+seqused-causal", dict(varlen=True, seqused=True, causal=True)),
    ("window-two-sided", dict(window=(64, 17))),
    ("window-causal", dict(window=(150, 0), causal=True)),
    ("softcap-causal", dict(softcap=30.0, causal=True)),
    ("alibi-causal", dict(alibi="heads", causal=True)),
    ("sinks", dict(sinks="random")),
]


@pytest.mark.parametrize("name,opts", FEATURES, ids=[n for n, _ in FEATURES])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_feature(name, opts, dtype, deterministic):
    check_feature(203, 113, 4, 2, 512, dtype, opts, deterministic=deterministic)
