"""MLA on a GPU: v with a head_dim below q's and k's (head_dim_v < head_dim_qk), against the float64 reference by
flash-attn's rule (forward 2x, gradients 3x the same-precision naive error, plus a floor). Each case runs both
ways: with RAWFLASH_DV_FORM=0, v zero-padded to q's head_dim, and with RAWFLASH_DV_FORM=1, FA3's DV forms (v, and
in the backward dout and out, read at v's own head_dim, dv written at it) where configs.VALUE_ROWS has the pair for
the forward or the backward (other pairs and the other forms pad v either way). The default, the forward's DV form
and the padded backward, is the two halves of these.

Covered: DeepSeek-V3's pair (192 / 128) and others down to head_dim_v = 8 and odd ones, every dtype, ragged
shapes with seqlen_q != seqlen_k both ways, MHA / GQA / MQA, causal both ways, the features alone and combined
(windows, soft-capping, ALiBi, sinks, packed sequences, seqused_k), every form (the Hopper default, mma.sync with
``wgmma=False``, the wgmma form whose threads all copy, fa1, naive, the deterministic and the RAWFLASH_WGMMA=0
backward), caller-provided outputs and planned calls (a repeated call hits the plan cache and equals the first).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import rawflash
from rawflash import api, reference
from test_gpu_features import COMBOS, SINGLE, _check, _device, _inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["padded", "dv-form"], autouse=True)
def dv_form(request, monkeypatch):
    """Every case with v zero-padded and with FA3's DV forms, forward and backward."""
    monkeypatch.setenv("RAWFLASH_DV_FORM", "1" if request.param == "dv-form" else "0")
    return request.param


def _fa3_on() -> bool:
    """Whether the environment leaves FA3's forms on (RAWFLASH_WGMMA=0 or RAWFLASH_FA3=0 turn them off, and with
    them the DV forms)."""
    from rawflash import settings

    env = settings.load()
    return env.wgmma and env.warp_specialize

# (head_dim_qk, head_dim_v): the DV form at (192, 128), (128, 64), (96, 64), (160, 100), (128, 32) (compiled as
# 192 / 128 and 128 / 64, the extra columns zero), v zero-padded at the rest
PAIRS = [(192, 128), (128, 64), (64, 32), (96, 64), (256, 128), (40, 24), (200, 8), (160, 100), (128, 32)]
SHAPES = [(113, 203), (203, 113), (64, 64)]
HEADS = [(4, 4), (4, 2), (4, 1)]
DTYPES = ["float16", "bfloat16", "float32"]


def _narrow(q, k, v, extra, head_dim_v: int, seed: int):
    """v with head_dim_v columns (values of their own, not a slice of v's: a slice would hide a kernel that reads
    v at q's head_dim)."""
    rng = np.random.default_rng(seed + 50)
    v = rng.standard_normal((*v.shape[:-1], head_dim_v)).astype(v.dtype)
    return q, k, v, extra


def check_mla(sq, sk, h, hk, pair, dtype, opts, seed=0, backward=True, deterministic=False, out=False,
              grads_given=False, **switches):
    d, dv = pair
    q, k, v, extra = _narrow(*_inputs(sq, sk, h, hk, d, dtype, opts, seed), dv, seed)
    dev = {n: _device(x) for n, x in extra.items()}
    given = {}
    if out:
        given["out"] = _device(np.full((*q.shape[:-1], dv), np.nan, q.dtype))
    o, lse = rawflash.forward(_device(q), _device(k), _device(v), **dev, **switches, **given)
    if out:
        assert o is given["out"], "out= is returned"
    o, lse = o.get(), lse.get()
    assert o.shape == (*q.shape[:-1], dv)
    ref_out, ref_lse = reference.forward(q, k, v, **extra)
    base_out, base_lse = reference.forward(q, k, v, upcast=False, **extra)
    _check(o, ref_out, base_out, q.dtype, 2, "out")
    _check(lse, ref_lse, base_lse, q.dtype, 2, "lse")
    assert np.isfinite(o.astype(np.float32)).all(), "no NaN or inf in out"
    if not backward:
        return
    dout = np.random.default_rng(seed + 7).standard_normal(o.shape).astype(q.dtype)
    outs = {}
    if grads_given:
        outs = {n: _device(np.full(x.shape, np.nan, q.dtype)) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    grads = rawflash.backward(_device(dout), _device(q), _device(k), _device(v), _device(o), _device(lse), **dev,
                              deterministic=deterministic, **outs)
    refs = reference.backward(dout, q, k, v, **extra)
    bases = reference.backward_bases(dout, q, k, v, refs, **extra)
    assert len(grads) == len(refs) == (4 if "sinks" in extra else 3)
    for name, g, ref, base, like in zip(("dq", "dk", "dv", "dsinks"), grads, refs, bases, (q, k, v, None)):
        if name in outs:
            assert g is outs[name], f"{name}= is returned"
        g = g.get()
        if like is not None:
            assert g.shape == like.shape, name
        _check(g, ref, base, q.dtype if like is not None else np.float32, 3, name)
        assert np.isfinite(g.astype(np.float32)).all(), f"no NaN or inf in {name}"


def _grid():
    cases = []
    for i, (pair, dtype, causal) in enumerate(itertools.product(PAIRS, DTYPES, (False, True))):
        sq, sk = SHAPES[i % len(SHAPES)]
        h, hk = HEADS[(i // len(SHAPES)) % len(HEADS)]
        cases.append(pytest.param(sq, sk, h, hk, pair, dtype, causal,
                                  id=f"{pair[0]}-{pair[1]}-{dtype}-{'causal' if causal else 'full'}-{sq}x{sk}-"
                                     f"h{h}/{hk}"))
    return cases


@pytest.mark.parametrize("sq,sk,h,hk,pair,dtype,causal", _grid())
def test_mla(sq, sk, h, hk, pair, dtype, causal):
    check_mla(sq, sk, h, hk, pair, dtype, {"causal": causal})


@pytest.mark.parametrize("name,opts", SINGLE + COMBOS, ids=[n for n, _ in SINGLE + COMBOS])
@pytest.mark.parametrize("pair,dtype", [((192, 128), "bfloat16"), ((128, 64), "float16")], ids=["192-128", "128-64"])
def test_mla_features(name, opts, pair, dtype):
    check_mla(203, 113, 4, 2, pair, dtype, opts, seed=1)


FORMS = [
    ("mma-sync", dict(wgmma=False), {}),
    ("wgmma-all-threads-copy", dict(warp_specialize=False), {}),
    ("fa1", dict(kernel="fa1"), {}),
    ("naive", dict(kernel="naive"), {}),
    ("deterministic", {}, dict(deterministic=True)),
]


@pytest.mark.parametrize("form,switches,bwd", FORMS, ids=[f[0] for f in FORMS])
@pytest.mark.parametrize("pair", [(192, 128), (128, 64)], ids=["192-128", "128-64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mla_forms(form, switches, bwd, pair, causal):
    dtype = "float16" if form == "naive" else "bfloat16"
    check_mla(130, 257, 4, 2, pair, dtype, {"causal": causal}, seed=2, **bwd, **switches)


@pytest.mark.parametrize("pair", [(192, 128), (128, 64)], ids=["192-128", "128-64"])
def test_mla_mma_sync_backward(pair, monkeypatch):
    """RAWFLASH_WGMMA=0: the mma.sync forward and atomic-dQ backward."""
    monkeypatch.setenv("RAWFLASH_WGMMA", "0")
    check_mla(257, 130, 4, 1, pair, "bfloat16", {"causal": True}, seed=3)


@pytest.mark.parametrize("pair", [(192, 128), (128, 64), (40, 24)], ids=["192-128", "128-64", "40-24"])
def test_mla_caller_outputs(pair):
    """out= and dq= / dk= / dv= of the caller's shapes (out and dv with v's head_dim) are written and returned."""
    check_mla(113, 203, 4, 2, pair, "bfloat16", {"causal": True}, seed=4, out=True, grads_given=True)


@pytest.mark.parametrize("pair", [(192, 128), (128, 64)], ids=["192-128", "128-64"])
def test_mla_planned_calls_repeat_the_first(pair):
    """A repeated call of one signature hits the plan cache and returns the first call's results bit for bit (the
    deterministic backward: atomic dQ adds in no fixed order)."""
    import cupy

    d, dv = pair
    q, k, v, extra = _narrow(*_inputs(203, 113, 4, 2, d, "bfloat16", {"causal": True}, 5), dv, 5)
    q, k, v = (cupy.asarray(x) for x in (q, k, v))
    rawflash.clear_cache()
    first = rawflash.forward(q, k, v, **extra)
    dout = cupy.asarray(np.random.default_rng(6).standard_normal(first[0].shape).astype(first[0].dtype))
    grads = rawflash.backward(dout, q, k, v, *first, **extra, deterministic=True)
    hits = api.PLANS.hits
    again = rawflash.forward(q, k, v, **extra)
    grads_again = rawflash.backward(dout, q, k, v, *again, **extra, deterministic=True)
    assert api.PLANS.hits == hits + 2, "both calls were served by their plans"
    for a, b in zip((*first, *grads), (*again, *grads_again)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.get(), b.get())


@pytest.mark.parametrize("pair, has_row", [((192, 128), True), ((128, 64), True), ((160, 100), True),
                                           ((256, 128), False)], ids=["192-128", "128-64", "160-100", "256-128"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dv_form_where_it_has_a_row(pair, has_row, dtype, dv_form):
    """With RAWFLASH_DV_FORM=1 the plan reads v at its own head_dim where configs.VALUE_ROWS has the pair and FA3's
    forms are on (the kernels' v is then the caller's width, not padded); with =0 never; the result is right either
    way."""
    import cupy

    from rawflash import settings, validation
    from rawflash.kernels import cupy_backend, forms

    d, dv = pair
    q, k, v, extra = _narrow(*_inputs(257, 300, 4, 2, d, dtype, {"causal": True}, 8), dv, 8)
    c = validation.check_forward(q, k, v, True, None, "fa2", "cupy", validation.Features())
    bound = cupy_backend.bind_forward(c.problem, *(cupy.asarray(x) for x in (q, k, v)), c.scale, env=settings.load())
    on = has_row and dv_form == "dv-form" and _fa3_on()
    assert forms.reads_value_head_dim(bound.plan[0]) is on
    assert bound.widths[2] == cupy_backend.run_head_dim(dv if on else d)
    check_mla(257, 300, 4, 2, pair, dtype, {"causal": True}, seed=8)


@pytest.mark.parametrize("pair, has_row", [((192, 128), True), ((128, 64), True), ((160, 100), True), ((96, 64), True),
                                           ((256, 128), False)],
                         ids=["192-128", "128-64", "160-100", "96-64", "256-128"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_dv_backward_where_it_has_a_row(pair, has_row, dtype, deterministic, dv_form):
    """With RAWFLASH_DV_FORM=1 the backward's plan reads v, dout and out at v's own head_dim (and writes dv at it)
    where configs.VALUE_ROWS has the pair for fa3_bwd_sm90 (the column split's deterministic plan, fa2_bwd +
    fa2_bwd_dq, pads them); without it never. A repeated call hits its plan and matches the first; the gradients
    are right either way."""
    import cupy

    from rawflash import settings, validation
    from rawflash.kernels import cupy_backend, forms

    d, dv = pair
    q, k, v, extra = _narrow(*_inputs(257, 300, 4, 2, d, dtype, {"causal": True}, 9), dv, 9)
    q, k, v = (cupy.asarray(x) for x in (q, k, v))
    out, lse = rawflash.forward(q, k, v, causal=True)
    dout = cupy.asarray(np.random.default_rng(10).standard_normal(out.shape).astype(out.dtype))
    c = validation.check_backward(dout, q, k, v, out, lse, True, None, deterministic, "cupy", validation.Features())
    bound = cupy_backend.bind_backward(c.problem, dout, q, k, v, out, lse, c.scale, deterministic,
                                       env=settings.load())
    on = has_row and dv_form == "dv-form" and not (deterministic and d > 128) and _fa3_on()
    assert any(forms.reads_value_head_dim(lau) for lau in bound.plan) is on
    width_v = cupy_backend.run_head_dim(dv if on else d)
    assert bound.widths == (width_v, *(cupy_backend.run_head_dim(d),) * 2, width_v, width_v)  # dout, q, k, v, out
    assert bound.bufs["dv"].shape[-1] == width_v
    rawflash.clear_cache()
    first = rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    hits = api.PLANS.hits
    again = rawflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    assert api.PLANS.hits == hits + 1, "the repeat was served by its plan"
    for a, b in zip(first, again):
        assert a.shape == b.shape
        if deterministic:
            np.testing.assert_array_equal(a.get(), b.get())
        else:  # (atomic dQ adds in no fixed order)
            np.testing.assert_allclose(a.get().astype(np.float32), b.get().astype(np.float32), rtol=1e-2, atol=1e-2)
    check_mla(257, 300, 4, 2, pair, dtype, {"causal": True}, seed=9, deterministic=deterministic)
