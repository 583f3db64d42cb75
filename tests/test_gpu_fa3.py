"""FA3's forms on an sm_90 GPU (fa3_fwd_sm90: TMA producer warpgroup, consumer warpgroups, ping-pong, persistent
tiles; fa3_bwd_sm90: the same split for the backward's main pass, and its column split at head_dim 192 / 256),
by flash-attn's rule against the float64 reference: ragged lengths, seqlen_q != seqlen_k both ways,
MHA / GQA / MQA, causal both ways, head dims that are not a multiple of 64 (zero-filled by the copies), each of
FA3's switches off in turn, grids with more tiles than SMs (the persistent loop), large logits, and agreement
with the cp.async wgmma form. Features (windows, soft-capping, ALiBi, sinks, packed lengths) run through the
default path in tests/test_gpu_features.py, which on an H200 is this form."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import rawflash
from rawflash.kernels import forms, launch
from rawflash.problem import Problem
from conftest import skip_unless_sm90
from test_gpu_kernels import check_backward, check_forward

pytestmark = pytest.mark.gpu

SEQLENS = [(1, 1), (3, 3), (17, 17), (64, 128), (113, 203), (127, 129), (203, 113), (1023, 1024), (128, 128),
           (256, 512), (640, 129), (129, 640)]
HEAD_DIMS = [40, 64, 80, 96, 112, 128, 160, 192, 224, 256]
HEADS = [(4, 4), (4, 2), (4, 1)]
SWITCHES = {"default": {}, "no-pingpong": {"pingpong": False}, "no-overlap": {"overlap": False},
            "persistent": {"persistent": True}, "not-persistent": {"persistent": False},
            "static": {"persistent": True, "dynamic": False}}


@pytest.fixture(autouse=True)
def _needs_sm90():
    skip_unless_sm90("FA3's form")


def _cases():
    out = []
    combos = itertools.product(SEQLENS, ("float16", "bfloat16"), (False, True), SWITCHES)
    for i, (sq, dtype, causal, sw) in enumerate(combos):
        d, (h, hk) = HEAD_DIMS[i % len(HEAD_DIMS)], HEADS[(i // len(HEAD_DIMS)) % len(HEADS)]
        out.append(pytest.param(*sq, h, hk, d, dtype, causal, sw,
                                id=f"{dtype}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}-h{h}/{hk}-{sw}"))
    for d, dtype, causal in itertools.product(HEAD_DIMS, ("float16", "bfloat16"), (False, True)):
        out.append(pytest.param(203, 113, 4, 2, d, dtype, causal, "default",
                                id=f"dims-{dtype}-{'causal' if causal else 'full'}-203x113-d{d}"))
    return out


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal,sw", _cases())
def test_fa3_forward(sq, sk, h, hk, d, dtype, causal, sw):
    check_forward(2, sq, sk, h, hk, d, dtype, causal, "fa2", warp_specialize=True, **SWITCHES[sw])


@pytest.mark.parametrize("sw", list(SWITCHES))
@pytest.mark.parametrize("causal", [False, True])
def test_fa3_more_tiles_than_sms(sw, causal):
    """5 x 12 heads x 9 query tiles = 540 tiles: each persistent CTA walks several, across heads and batches."""
    p = Problem(5, 1100, 1100, 12, 4, 128, "bfloat16", causal, "sm_90")
    persistent = launch.schedule_of(forms.fa2_forward(p, forms.Switches(**SWITCHES[sw]))) != "one tile per CTA"
    assert forms.fa2_forward(p, forms.Switches(**SWITCHES[sw])).ctas == (132 if persistent else 540)
    check_forward(5, 1100, 1100, 12, 4, 128, "bfloat16", causal, "fa2", warp_specialize=True, **SWITCHES[sw])


def test_fa3_dynamic_schedule_counters_return_to_zero():
    """The dynamic persistent grid's counters are zero again after every launch (so the next launch on the stream
    takes every tile from the first): launches of different tile counts in a row, causal and not, each equal
    bitwise to the one-tile-per-CTA grid (the same tiles computed the same way), and the counters read back 0."""
    import cupy

    from rawflash.kernels import cupy_backend
    from conftest import random_qkv

    for i, (b, n, h, causal) in enumerate([(3, 1100, 12, True), (1, 300, 2, False), (5, 2048, 8, True),
                                           (2, 129, 4, False)]):
        q, k, v = (cupy.asarray(x) for x in random_qkv(b, n, n, h, h, 128, "bfloat16", seed=i))
        ref, lref = rawflash.forward(q, k, v, causal=causal, persistent=False)
        for _ in range(2):
            out, lse = rawflash.forward(q, k, v, causal=causal, persistent=True, dynamic=True)
            assert cupy.array_equal(out, ref) and cupy.array_equal(lse, lref), (b, n, h, causal)
        assert cupy_backend.tile_counter().get().tolist() == [0, 0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fa3_large_logits_no_nan(dtype):
    check_forward(1, 127, 129, 2, 2, 64, dtype, True, "fa2", scale=8.0, warp_specialize=True)
    check_forward(1, 300, 1000, 2, 1, 128, dtype, False, "fa2", scale=8.0, warp_specialize=True)


def test_fa3_and_cp_async_form_agree():
    """Same inputs through FA3's form and the cp.async wgmma form: they differ only by rounding."""
    import cupy

    from conftest import random_qkv

    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 777, 1031, 8, 2, 128, "bfloat16", seed=4))
    a, la = rawflash.forward(q, k, v, causal=True, warp_specialize=True)
    b, lb = rawflash.forward(q, k, v, causal=True, warp_specialize=False)
    diff = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
    assert diff < 2e-2, f"the two wgmma forms' outputs differ by {diff}"
    assert float(cupy.abs(la - lb).max()) < 1e-3
    assert np.isfinite(cupy.asnumpy(a.astype(cupy.float32))).all()


def test_fa3_strided_views():
    """q, k, v as views into one packed qkv tensor (row stride 3 h d): the tensor maps take the strides as given."""
    import cupy

    from conftest import random_qkv

    q, k, v = random_qkv(2, 300, 300, 4, 4, 128, "bfloat16", seed=6)
    qkv = cupy.asarray(np.stack([q, k, v], axis=2))  # (b, s, 3, h, d)
    qv, kv_, vv = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, lse = rawflash.forward(qv, kv_, vv, causal=True, warp_specialize=True)
    ref, _ = rawflash.forward(q, k, v, causal=True, warp_specialize=False)
    assert float(cupy.abs(out.astype(cupy.float32) - cupy.asarray(ref).astype(cupy.float32)).max()) < 2e-2


def _bwd_cases():
    out = []
    for i, (sq, dtype, causal) in enumerate(itertools.product(SEQLENS, ("float16", "bfloat16"), (False, True))):
        d, (h, hk) = (40, 64, 80, 96, 128)[i % 5], HEADS[(i // 5) % len(HEADS)]
        out.append(pytest.param(*sq, h, hk, d, dtype, causal,
                                id=f"{dtype}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}-h{h}/{hk}"))
    return out


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", _bwd_cases())
def test_fa3_backward(sq, sk, h, hk, d, dtype, causal):
    from rawflash.kernels import cupy_backend

    p = Problem(2, sq, sk, h, hk, d, dtype, causal, cupy_backend.device_arch())
    assert forms.backward_plan(p)[1].kernel == "fa3_bwd_sm90"
    check_backward(2, sq, sk, h, hk, d, dtype, causal, False)


@pytest.mark.parametrize("d", [64, 128])
def test_fa3_backward_long_gqa_causal(d):
    """Many query blocks per key block and 4 query heads per kv head: a long walk through the stages."""
    check_backward(1, 1000, 1500, 8, 2, d, "bfloat16", True, False, seed=3)


ROWS_80_CASES = [(1024, 1024, 4, 4, 128, "bfloat16", False), (1085, 131, 4, 1, 96, "float16", False),
                 (2111, 1000, 4, 2, 128, "float16", False), (1090, 2500, 2, 2, 112, "bfloat16", False),
                 (8192, 8192, 2, 1, 128, "bfloat16", True), (8230, 8000, 2, 2, 96, "float16", True)]


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", ROWS_80_CASES,
                         ids=[f"{c[5]}-{'causal' if c[6] else 'full'}-{c[0]}x{c[1]}-d{c[4]}-h{c[2]}/{c[3]}"
                              for c in ROWS_80_CASES])
def test_fa3_backward_80_rows(sq, sk, h, hk, d, dtype, causal):
    """The 80-row tile (plain, >= the GPU's long_bwd_seqlen query rows, long_causal_bwd_seqlen causal: dQ_i^T by
    the warpgroups, dS_i stored untransposed by stmatrix .trans): last query blocks of 64, 45, 31, 50, 32 and 70
    rows, short and long key ranges, seqlen_q != seqlen_k both ways under the mask, GQA / MQA."""
    from rawflash.kernels import cupy_backend

    p = Problem(1, sq, sk, h, hk, d, dtype, causal, cupy_backend.device_arch(), gpu=cupy_backend.device_gpu())
    assert forms.backward_plan(p)[1].config.br == 80
    check_backward(1, sq, sk, h, hk, d, dtype, causal, False, seed=8)


H100_GATE_CASES = [(4100, 4096, 2, 1, 128, "bfloat16", 1), (4096, 4200, 2, 2, 96, "float16", 1),
                   (300, 333, 2, 1, 128, "bfloat16", 17), (700, 640, 4, 4, 64, "bfloat16", 4)]


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,batch", H100_GATE_CASES,
                         ids=[f"{c[5]}-{c[0]}x{c[1]}-d{c[4]}-h{c[2]}/{c[3]}-b{c[6]}" for c in H100_GATE_CASES])
def test_fa3_backward_under_the_h100s_gates(sq, sk, h, hk, d, dtype, batch, monkeypatch):
    """The H100's choices on any Hopper GPU (RAWFLASH_TILE_GPU=h100): the causal 80-row tile from 4096 query rows
    (last query blocks of 20 and 16 rows, MQA), key order where the H200 takes tiles longest first (17 pairs), and
    longest first at 16 pairs (both GPUs)."""
    from rawflash.kernels import cupy_backend
    from rawflash.settings import Settings

    monkeypatch.setenv("RAWFLASH_TILE_GPU", "h100")
    assert cupy_backend.device_gpu(Settings(tile_gpu="h100")) == "h100"
    p = Problem(batch, sq, sk, h, hk, d, dtype, True, cupy_backend.device_arch(), gpu="h100")
    cfg = forms.backward_plan(p)[1].config
    assert cfg.br == (80 if sq >= 4096 else 128 if d == 64 else 64)
    assert launch.fa3_bwd_longest_first(p, cfg, 132) is (batch * hk <= 16)
    check_backward(batch, sq, sk, h, hk, d, dtype, True, False, seed=9)


# ---------------------------------------------------------------- head_dim 192 / 256: the column split
SPLIT_D_DIMS = [160, 192, 224, 256]  # (160 and 224 run as 192 and 256, their extra columns zero-filled)


def _split_d_plan(sq, sk, h, hk, d, dtype, causal, **features):
    from rawflash.kernels import cupy_backend

    p = Problem(2, sq, sk, h, hk, d, dtype, causal, cupy_backend.device_arch(), **features)
    main = forms.backward_plan(p)[1]
    assert main.kernel == "fa3_bwd_sm90" and launch.fa3_bwd_split_d(main.config), main.name_expression
    return main


def _split_d_cases():
    out = []
    for i, (sq, dtype, causal) in enumerate(itertools.product(SEQLENS, ("float16", "bfloat16"), (False, True))):
        d, (h, hk) = SPLIT_D_DIMS[i % len(SPLIT_D_DIMS)], HEADS[(i // len(SPLIT_D_DIMS)) % len(HEADS)]
        out.append(pytest.param(*sq, h, hk, d, dtype, causal,
                                id=f"{dtype}-{'causal' if causal else 'full'}-{sq[0]}x{sq[1]}-d{d}-h{h}/{hk}"))
    return out


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", _split_d_cases())
def test_fa3_backward_split_d(sq, sk, h, hk, d, dtype, causal):
    """fa3_bwd_sm90's column split (head_dim 192 / 256: two consumer warpgroups on 64 keys, each with half of dK,
    dV and dQ's columns; dQ by TMA reduce-add) on ragged shapes, seqlen_q != seqlen_k both ways, MHA / GQA / MQA."""
    _split_d_plan(sq, sk, h, hk, d, dtype, causal)
    check_backward(2, sq, sk, h, hk, d, dtype, causal, False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [192, 256])
def test_fa3_backward_split_d_long_gqa_causal(d, dtype):
    """Many query blocks per key block, 4 query heads per kv head: both stages of the ring and both P^T, dS^T
    buffers reused many times over."""
    _split_d_plan(1000, 1500, 8, 2, d, dtype, True)
    check_backward(1, 1000, 1500, 8, 2, d, dtype, True, False, seed=3)


SPLIT_D_FEATURES = [  # the general policy through the column split's policy calls (S^T halves of 32 queries)
    ("window+softcap", dict(window=(64, 17), softcap=20.0)),
    ("softcap+alibi+window", dict(softcap=20.0, alibi="batch", window=(32, 32))),
    ("alibi-batch-causal", dict(alibi="batch", causal=True)),
    ("varlen-causal", dict(varlen=True, causal=True)),
    ("varlen+window+sinks+causal", dict(varlen=True, window=(40, 0), causal=True, sinks="random")),
    ("seqused", dict(seqused=True, causal=True)),
    ("sinks", dict(sinks="random")),
]


# Fails on an H200: dsinks 0.00412 against a bound of 0.00236 (5.2x the naive error), with FA3's
# forward's O and lse; with RAWFLASH_FA3=0 (fa2_fwd_sm90's) it passes. dsinks comes from fa2_bwd_preprocess (O, lse),
# not from the column split. A FlashAttention-2 forward done exactly in float16's precision already misses the rule
# on this case (0.0026: tests/test_reference.py pins it); FA3's lazy rescale at d = 256 adds to it. Strict: a change
# to the forward's P rounding (or to the rule's base for dsinks) would show here.
_SPLIT_D_OPEN = {("sinks", 256, "float16"): "dsinks 0.00412 > 0.00236: FlashAttention's float16 forward alone "
                                            "misses the rule here (0.0026, test_reference.py)"}


def _split_d_feature_params():
    out = []
    for d, dtype in ((192, "bfloat16"), (256, "float16"), (224, "bfloat16")):
        for name, opts in SPLIT_D_FEATURES:
            why = _SPLIT_D_OPEN.get((name, d, dtype))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            out.append(pytest.param(name, opts, d, dtype, id=f"{name}-{d}-{dtype}", marks=marks))
    return out


@pytest.mark.parametrize("name,opts,d,dtype", _split_d_feature_params())
def test_fa3_backward_split_d_features(name, opts, d, dtype):
    from test_gpu_features import check_feature

    opts = dict(opts)
    causal = opts.get("causal", False)
    plan_opts = {k: v for k, v in opts.items() if k in ("window", "softcap")}
    _split_d_plan(203, 113, 4, 2, d, dtype, causal, **plan_opts)
    check_feature(203, 113, 4, 2, d, dtype, opts, seed=5)


def test_fa3_split_d_and_cp_async_form_agree(monkeypatch):
    """d = 256 through the column split and through fa2_bwd_sm90's (cp.async, two warpgroups on 64 keys;
    RAWFLASH_FA3=0): the same gradients up to rounding (the float32 dQ sums in another order)."""
    import cupy

    from conftest import random_qkv

    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 777, 1031, 8, 2, 256, "bfloat16", seed=4))
    dout = cupy.asarray(np.random.default_rng(4).standard_normal(q.shape).astype(q.dtype))
    out, lse = rawflash.forward(q, k, v, causal=True)
    _split_d_plan(777, 1031, 8, 2, 256, "bfloat16", True)
    a = rawflash.backward(dout, q, k, v, out, lse, causal=True)
    monkeypatch.setenv("RAWFLASH_FA3", "0")
    b = rawflash.backward(dout, q, k, v, out, lse, causal=True)
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        x, y = x.astype(cupy.float32), y.astype(cupy.float32)
        diff = float(cupy.abs(x - y).max()) / max(1e-6, float(cupy.abs(y).max()))
        assert diff < 2e-2, f"{name}: the two backward forms differ by {diff} (relative to the largest value)"


# ---------------------------------------------------------------- deterministic=True: FA3's ordered dQ
DET_CASES = [  # (sq, sk, h, hk, d, dtype, causal): ragged, seqlen_q != seqlen_k both ways, MHA / GQA / MQA
    (203, 113, 4, 2, 64, "bfloat16", True), (113, 203, 4, 4, 128, "float16", False),
    (640, 129, 4, 1, 96, "bfloat16", False), (129, 640, 4, 2, 40, "float16", True),
    (1023, 1024, 8, 2, 128, "bfloat16", True), (1, 1, 2, 1, 64, "float16", False),
]


def _det_plan(sq, sk, h, hk, d, dtype, causal, **features):
    from rawflash.kernels import cupy_backend

    p = Problem(2, sq, sk, h, hk, d, dtype, causal, cupy_backend.device_arch(), **features)
    main = forms.backward_plan(p, deterministic=True)[1]
    assert main.kernel == "fa3_bwd_sm90" and main.template_args[launch.MASK_ARG[main.kernel] + 2] is True
    return main


@pytest.mark.parametrize("sq,sk,h,hk,d,dtype,causal", DET_CASES,
                         ids=[f"{c[5]}-{'causal' if c[6] else 'full'}-{c[0]}x{c[1]}-d{c[4]}-h{c[2]}/{c[3]}"
                              for c in DET_CASES])
def test_fa3_deterministic_backward(sq, sk, h, hk, d, dtype, causal):
    """deterministic=True on FA3's form, by flash-attn's rule against the float64 reference."""
    _det_plan(sq, sk, h, hk, d, dtype, causal)
    check_backward(2, sq, sk, h, hk, d, dtype, causal, True, seed=11)


DET_FEATURES = [  # the general policy: windows bounded on either side or both, packed lengths, seqused_k
    ("window-two-sided", dict(window=(64, 17)), 128, "bfloat16"),
    ("window-right-only", dict(window=(-1, 40)), 64, "float16"),
    ("window-left-only", dict(window=(70, -1)), 64, "bfloat16"),
    ("varlen-causal", dict(varlen=True, causal=True), 128, "float16"),
    ("varlen+window+sinks+causal", dict(varlen=True, window=(40, 0), causal=True, sinks="random"), 64, "bfloat16"),
    ("seqused", dict(seqused=True, causal=True), 128, "bfloat16"),
    # without a mask bound: the rotated order (BwdParams::dq_rotate), per sequence and with seqused_k's key counts
    ("varlen-full+softcap", dict(varlen=True, softcap=10.0), 64, "bfloat16"),
    ("seqused-full+alibi", dict(seqused=True, alibi="heads"), 128, "float16"),
]


@pytest.mark.parametrize("name,opts,d,dtype", DET_FEATURES, ids=[c[0] for c in DET_FEATURES])
def test_fa3_deterministic_features(name, opts, d, dtype):
    from test_gpu_features import check_feature

    check_feature(203, 113, 4, 2, d, dtype, opts, seed=5, deterministic=True)


def _twenty_runs(dout, q, k, v, out, lse, **kw):
    first = rawflash.backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    for run in range(19):
        again = rawflash.backward(dout, q, k, v, out, lse, deterministic=True, **kw)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert a.tobytes() == b.tobytes(), f"{name} differs in run {run + 2}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_fa3_deterministic_bitwise_equal_20_runs(d, causal):
    """N = 1024: 8 key blocks add into every query block (up to 8 under the mask), with GQA 8 on 2."""
    import cupy

    from conftest import random_qkv

    _det_plan(1024, 1024, 8, 2, d, "bfloat16", causal)
    q, k, v = (cupy.asarray(x) for x in random_qkv(2, 1024, 1024, 8, 2, d, "bfloat16", seed=9))
    dout = cupy.asarray(np.random.default_rng(9).standard_normal(q.shape).astype(q.dtype))
    out, lse = rawflash.forward(q, k, v, causal=causal)
    _twenty_runs(dout, q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("sq,sk,d", [(2048, 4096, 64), (4096, 700, 128), (300, 4000, 96)])
def test_fa3_deterministic_rotated_order_bitwise_equal_20_runs(sq, sk, d):
    """Without a mask the key blocks walk the rotated order (each from its own query block, Policy::dq_start):
    more key blocks than query blocks, fewer, and many of them; flash-attn's rule once, bitwise the same 20 times."""
    import cupy

    from conftest import random_qkv
    from rawflash.kernels import cupy_backend

    p = Problem(1, sq, sk, 4, 2, d, "bfloat16", False, cupy_backend.device_arch())
    assert launch.fa3_bwd_dq_rotates(p, _det_plan(sq, sk, 4, 2, d, "bfloat16", False).config, cupy_backend._sms())
    check_backward(1, sq, sk, 4, 2, d, "bfloat16", False, True, seed=4)
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, sq, sk, 4, 2, d, "bfloat16", seed=5))
    dout = cupy.asarray(np.random.default_rng(5).standard_normal(q.shape).astype(q.dtype))
    out, lse = rawflash.forward(q, k, v)
    _twenty_runs(dout, q, k, v, out, lse)


def test_fa3_deterministic_packed_window_bitwise_equal_20_runs():
    """Packed sequences with a two-sided window (the general policy; ranks from each sequence's own window)."""
    import cupy

    from conftest import random_qkv

    lens_q, lens_k = [700, 1, 300, 1024], [900, 64, 1, 1024]
    q, k, v = (cupy.asarray(x[0]) for x in random_qkv(1, sum(lens_q), sum(lens_k), 4, 2, 128, "bfloat16", seed=2))
    feats = dict(cu_seqlens_q=cupy.asarray(np.cumsum([0] + lens_q).astype(np.int32)),
                 cu_seqlens_k=cupy.asarray(np.cumsum([0] + lens_k).astype(np.int32)), window=(300, 100))
    dout = cupy.asarray(np.random.default_rng(2).standard_normal(q.shape).astype(q.dtype))
    out, lse = rawflash.forward(q, k, v, **feats)
    _twenty_runs(dout, q, k, v, out, lse, **feats)


@pytest.mark.parametrize("feature", ["plain", "seqused_k", "softcap", "alibi"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_first_block_reference_and_its_way_back(d, causal, feature):
    """bfloat16 attention on FA3's form without a window's left bound keeps each row's first block's reference
    (REF_FIRST): plain, and the general policy (seqused_k, soft-capping past the bounded range, ALiBi with slopes
    from 0.84 to 1/256, whose reference is the first block's max without the bias). Normal inputs pass its check
    and the REF_RUNNING launch after it returns at once; keys past the first block aligned with every query (scores
    140 - 200 natural units above the first block's, or the cap of 60) fail it: the flag word holds the call's
    number, the way back recomputes the call, and both results keep flash-attn's rule. Keys of the first block
    aligned instead leave every reference high: the rows' sums stay >= 1 but ALiBi's steep heads, whose first
    block lies hundreds of units down its bias, sum to almost nothing (below 2^-60) and fail the check too."""
    import cupy

    from conftest import random_qkv
    from rawflash import reference
    from rawflash.kernels import cupy_backend

    feats = {"plain": {}, "seqused_k": dict(seqused_k=np.array([700, 640], np.int32)),
             "softcap": dict(softcap=2.0 * forms.BOUNDED_SOFTCAP_MAX),
             "alibi": dict(alibi_slopes=np.array([0.84, 0.5, 0.0625, 2.0 ** -8], np.float32))}[feature]
    p = Problem(2, 300, 700, 4, 2, d, "bfloat16", causal, "sm_90", seqused_k="seqused_k" in feats,
                       softcap=feats.get("softcap", 0.0), alibi="alibi_slopes" in feats)
    assert [x.template_args[launch.REF_ARG] for x in forms.forward_plan(p)] == [launch.REF_FIRST, launch.REF_RUNNING]
    dev = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in feats.items()}

    def check(q, k, v):
        out, lse = rawflash.forward(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal, **dev)
        ref_out, ref_lse = reference.forward(q, k, v, causal=causal, **feats)
        base_out, base_lse = reference.forward(q, k, v, causal=causal, upcast=False, **feats)
        for name, got, ref, base in (("out", out, ref_out, base_out), ("lse", lse, ref_lse, base_lse)):
            ok, err, base_err, bound = reference.error_ratio_ok(got.get(), ref, base, q.dtype, 2)
            assert ok, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive error {base_err:.3g})"

    q, k, v = random_qkv(2, 300, 700, 4, 2, d, "bfloat16")
    check(q, k, v)
    assert int(cupy_backend.ref_flag().get()[0]) != cupy_backend._ref_gen[0], "normal inputs pass the check"
    q, k, v = random_qkv(2, 300, 700, 4, 2, d, "bfloat16", seed=4)
    u = np.full(d, 40 / np.sqrt(d))
    q = (0.1 * q.astype(np.float64) + u).astype(q.dtype)
    k64 = k.astype(np.float64)
    k64[:, 400:] += u
    check(q, k64.astype(q.dtype), v)
    assert int(cupy_backend.ref_flag().get()[0]) == cupy_backend._ref_gen[0], "the check failed: the way back ran"
    k64 = k.astype(np.float64)
    k64[:, :64] += u
    check(q, k64.astype(q.dtype), v)
    failed = int(cupy_backend.ref_flag().get()[0]) == cupy_backend._ref_gen[0]
    assert failed == (feature == "alibi"), "only ALiBi's steep heads sum below 2^-60 under a high reference"
