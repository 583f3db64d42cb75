"""rawflash.decode: attention against a KV cache (contiguous or paged), with the in-place append.

CPU tests check the validation and the reference's decode against the forward reference; GPU tests check the kernels
(append, split-KV pass, combine) against the float64 reference by flash-attn's rule (2x the same-precision naive
error plus a floor) over ragged cache lengths (0 included), appends that cross pages, page sizes from 1 to 256,
several query rows with the causal mask, MHA / GQA / MQA, every dtype, several head dims, forced split counts, and
every feature alone and combined; the caches after the call must hold exactly the appended rows.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import rawflash
from rawflash import forms, launch, reference
from rawflash.configs import tile_config
from conftest import DTYPES

RNG_SCALE = 1.0


def _case(batch=3, sq=1, h=8, hk=2, d=64, dtype="float16", lens=(37, 0, 300), new=1, page=0, seed=0, feats=()):
    """Host arrays of one decode call: q, the caches (paged when page > 0: pages in a shuffled order), k_new, v_new,
    cache_seqlens, block_table and the feature arguments."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    cap = max(lens) + new + 5
    q = (rng.standard_normal((batch, sq, h, d)) * (4.0 if "softcap" in feats else 1.0)).astype(dt)
    k_new = rng.standard_normal((batch, new, hk, d)).astype(dt) if new else None
    v_new = rng.standard_normal((batch, new, hk, d)).astype(dt) if new else None
    if page:
        per = -(-cap // page)
        pages = batch * per + 3
        kc = rng.standard_normal((pages, page, hk, d)).astype(dt)
        vc = rng.standard_normal((pages, page, hk, d)).astype(dt)
        table = rng.permutation(pages)[: batch * per].reshape(batch, per).astype(np.int32)
    else:
        kc = rng.standard_normal((batch, cap, hk, d)).astype(dt)
        vc = rng.standard_normal((batch, cap, hk, d)).astype(dt)
        table = None
    opts = {}
    if "window" in feats:
        opts["window"] = (50, 0)
    if "softcap" in feats:
        opts["softcap"] = 15.0
    if "alibi" in feats:
        opts["alibi_slopes"] = rng.uniform(0.01, 0.3, (batch, h)).astype(np.float32)
    if "sinks" in feats:
        opts["sinks"] = rng.uniform(-2, 3, h).astype(np.float32)
    return dict(q=q, k_cache=kc, v_cache=vc, k_new=k_new, v_new=v_new, cache_seqlens=np.array(lens, np.int32),
                block_table=table), opts


# ---------------------------------------------------------------- CPU: the reference and the validation


def test_reference_decode_is_forward_on_the_appended_keys():
    args, _ = _case(dtype="float32", lens=(37, 0, 30), new=2, sq=2)
    out, lse = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"],
                                k_new=args["k_new"], v_new=args["v_new"], causal=True)
    for b, n in enumerate(args["cache_seqlens"]):
        k = np.concatenate([args["k_cache"][b, :n], args["k_new"][b]])[None]
        v = np.concatenate([args["v_cache"][b, :n], args["v_new"][b]])[None]
        o, l = reference.forward(args["q"][b:b + 1], k, v, causal=True)
        np.testing.assert_allclose(out[b:b + 1], o, rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], l, rtol=0, atol=1e-12)


def test_reference_paged_equals_contiguous():
    args, _ = _case(dtype="float32", lens=(37, 0, 30), new=3, page=16)
    paged = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], k_new=args["k_new"],
                             v_new=args["v_new"], block_table=args["block_table"], causal=False)
    kc, vc = reference.append_kv(args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                 args["v_new"], args["block_table"])
    lengths = args["cache_seqlens"] + 3
    k, v = reference.gather_kv(kc, vc, lengths, args["block_table"])
    flat = reference.decode(args["q"], k, v, lengths, causal=False)
    for a, b in zip(paged, flat):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_api_reference_appends_in_place():
    args, _ = _case(dtype="float16", lens=(15, 0, 31), new=2, page=16)
    before = args["k_cache"].copy()
    out = rawflash.decode(**args, backend="reference")
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype
    table = args["block_table"]
    for b, n in enumerate(args["cache_seqlens"]):
        for t in range(2):
            j = n + t
            np.testing.assert_array_equal(args["k_cache"][table[b, j // 16], j % 16], args["k_new"][b, t])
            np.testing.assert_array_equal(args["v_cache"][table[b, j // 16], j % 16], args["v_new"][b, t])
    changed = set(np.flatnonzero(np.any(before != args["k_cache"], axis=(1, 2, 3))))
    landed = {table[b, j // 16] for b, n in enumerate(args["cache_seqlens"]) for j in (n, n + 1)}
    assert changed == landed  # only the pages the appends landed in (15, 16 and 31, 32 cross a page edge)


def test_reference_empty_cache_gives_zero_and_sink():
    args, opts = _case(dtype="float32", lens=(0, 0, 0), new=0, feats=("sinks",))
    out, lse = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], **opts)
    assert np.all(out == 0)
    np.testing.assert_allclose(lse, np.broadcast_to(opts["sinks"][None, :, None], lse.shape))


BAD = [
    (dict(cache_seqlens=np.array([1, 2], np.int32)), ValueError, "cache_seqlens must have shape"),
    (dict(cache_seqlens=np.array([1, 2, 3], np.int64)), TypeError, "cache_seqlens must have dtype int32"),
    (dict(cache_seqlens=np.array([1, 2, 400], np.int32)), ValueError, "capacity"),
    (dict(cache_seqlens=np.array([1, -1, 4], np.int32)), ValueError, "capacity"),
    (dict(cache_seqlens=True), TypeError, "cache_seqlens must be an int"),
    (dict(k_new=None), ValueError, "k_new and v_new must be given together"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=1000), ValueError, "num_splits"),
    (dict(backend="torch"), ValueError, "backend must be one of"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
]


@pytest.mark.parametrize("change,error,message", BAD, ids=[m for _, _, m in BAD])
def test_decode_rejects(change, error, message):
    args, _ = _case(dtype="float32", new=1)
    args.update({"backend": "reference", **change})
    with pytest.raises(error, match=message):
        rawflash.decode(**args)


def test_decode_rejects_shapes():
    args, _ = _case(dtype="float32", d=64)
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        bad = dict(args, q=args["q"][..., :60], k_cache=args["k_cache"][..., :60], v_cache=args["v_cache"][..., :60],
                   k_new=args["k_new"][..., :60], v_new=args["v_new"][..., :60])
        rawflash.decode(**bad, backend="reference")
    with pytest.raises(ValueError, match="k_new must have shape"):
        rawflash.decode(**dict(args, k_new=args["k_new"][:, :, :1], v_new=args["v_new"][:, :, :1]),
                        backend="reference")
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        rawflash.decode(**dict(args, k_cache=args["k_cache"].astype(np.float16)), backend="reference")
    with pytest.raises(ValueError, match="heads of q must be a multiple"):
        rawflash.decode(**dict(args, q=args["q"][:, :, :3]), backend="reference")
    with pytest.raises(ValueError, match="first axis"):
        rawflash.decode(**dict(args, k_cache=args["k_cache"][:2], v_cache=args["v_cache"][:2]), backend="reference")


def test_decode_rejects_bad_pages():
    args, _ = _case(dtype="float32", page=16)
    table = args["block_table"].copy()
    table[2, 0] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match=r"block_table\[2\] must hold page indices"):
        rawflash.decode(**dict(args, block_table=table), backend="reference")
    with pytest.raises(ValueError, match="block_table must have shape"):
        rawflash.decode(**dict(args, block_table=table[:2]), backend="reference")


@pytest.mark.parametrize("seqlen,group,sq", [(1, 1, 1), (100, 4, 1), (5000, 8, 1), (100000, 1, 4), (64, 16, 8)])
def test_split_heuristic(seqlen, group, sq):
    """Between 1 and min(MAX_SPLITS, key tiles of the capacity); the cost model's best within 2 %."""
    p = launch.Problem(2, sq, seqlen, 8 * group, 8, 128, "bfloat16", False, seqused_k=True, new_keys=1)
    cfg = tile_config("decode_split", 128, "bfloat16", "sm_90")
    n = forms.decode_splits(p, cfg)
    tiles = -(-seqlen // cfg.bc)
    assert 1 <= n <= min(forms.MAX_SPLITS, tiles)
    best = min(forms.decode_split_cost(p, cfg, s) for s in range(1, min(forms.MAX_SPLITS, tiles) + 1))
    assert forms.decode_split_cost(p, cfg, n) <= 1.02 * best


def _sweep_problem(batch, cache, heads=32, kv_heads=8, sq=1):
    return launch.Problem(batch, sq, cache + 1, heads, kv_heads, 128, "bfloat16", sq > 1, seqused_k=True, new_keys=1)


@pytest.mark.parametrize("batch,cache", [(8, 32768), (64, 4096), (64, 8192), (8, 131072)])
def test_split_heuristic_fills_whole_waves(batch, cache):
    """Large caches: waves of CTAs come out nearly whole (session 3's 50 splits at b8 N32768 made 2.1 waves, 0.7 of
    the bandwidth's time wasted in the last one), with full CTAs."""
    p = _sweep_problem(batch, cache)
    cfg = tile_config("decode_split", 128, "bfloat16", "sm_90")
    n = forms.decode_splits(p, cfg)
    assert forms.decode_occupancy(p, cfg, n) >= 0.9, n
    assert n % cfg.warps == 0


@pytest.mark.parametrize("batch,cache,kv_heads", [(1, 32768, 8), (1, 131072, 8), (8, 8192, 1)])
def test_split_heuristic_small_grids_split_more(batch, cache, kv_heads):
    """Few (batch, kv head) pairs: enough splits for a hundred CTAs or more, each split several tiles long."""
    p = _sweep_problem(batch, cache, heads=8 * kv_heads if kv_heads == 1 else 32, kv_heads=kv_heads)
    cfg = tile_config("decode_split", 128, "bfloat16", "sm_90")
    n = forms.decode_splits(p, cfg)
    ctas = batch * kv_heads * -(-n // cfg.warps)
    assert ctas >= 100 and -(-p.seqlen_k // cfg.bc) // n >= 4, (n, ctas)


def test_split_plan_is_cached_and_ignores_lengths():
    p = _sweep_problem(8, 4096)
    a = forms.decode_plan(p)
    assert forms.decode_plan(dataclasses.replace(p, lengths=((1, 5),) * 8)) is a  # the plan never sees lengths
    assert forms.decode_plan(p, 7).num_splits == 7


def test_decode_plan_launches():
    p = launch.Problem(2, 1, 4096, 32, 8, 128, "float16", False, seqused_k=True, new_keys=1)
    plan = forms.decode_plan(p, 16)
    assert [lau.kernel for lau in plan.launches] == ["decode_append", "decode_split", "decode_combine"]
    assert plan.num_splits == 16
    split, combine = plan.launches[1], plan.launches[2]
    cfg = tile_config("decode_split", 128, "float16", "sm_90")
    assert split.grid == (-(-16 // cfg.warps), 8 * -(-4 // cfg.br), 2)
    assert combine.grid == (2 * 32, 1, 1) and combine.block == (launch.DECODE_COMBINE_THREADS, 1, 1)
    assert combine.template_args[2] == forms.MAX_SPLITS
    no_new = forms.decode_plan(launch.Problem(2, 1, 4096, 32, 8, 128, "float16", False, seqused_k=True), 16)
    assert [lau.kernel for lau in no_new.launches] == ["decode_split", "decode_combine"]


def test_check_decode_plans_from_the_capacity():
    """seqlen_k is the cache's capacity (what the launch is planned from), whatever cache_seqlens holds; an int
    cache_seqlens travels as cache_len (no array, nothing to copy)."""
    from rawflash import validation

    args, _ = _case(dtype="float32", lens=(37, 0, 300), new=2, page=16)
    c = validation.check_decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                args["v_new"], args["block_table"], True, None, "cupy", validation.Features())
    assert c.problem.seqlen_k == 16 * args["block_table"].shape[1] and c.problem.page_size == 16
    c = validation.check_decode(args["q"], args["k_cache"], args["v_cache"], 40, args["k_new"], args["v_new"],
                                args["block_table"], True, None, "cupy", validation.Features())
    assert "seqused_k" not in c.extras and c.extras["cache_len"] == 40


def test_decode_refuses_appends_larger_than_the_cache():
    args, _ = _case(dtype="float32", lens=(0, 0, 0), new=2)
    small = dict(args, k_cache=args["k_cache"][:, :1], v_cache=args["v_cache"][:, :1])
    with pytest.raises(ValueError, match="seqlen_new"):
        rawflash.decode(**small, backend="reference")


# ---------------------------------------------------------------- GPU: the kernels against the reference

GPU_CASES = [
    # (id, case kwargs, decode kwargs)
    ("mha-d64", dict(h=4, hk=4, d=64), {}),
    ("gqa-d128", dict(d=128), {}),
    ("mqa-d128", dict(h=8, hk=1, d=128), {}),
    ("group16-d128", dict(h=16, hk=1, d=128, sq=2), dict(causal=True)),
    ("d256", dict(d=256), {}),
    ("d32", dict(d=32), {}),
    ("d72", dict(d=72), {}),
    ("d192", dict(d=192, h=4, hk=4), {}),
    ("no-append", dict(new=0), {}),
    ("append-4-causal-sq4", dict(new=4, sq=4), dict(causal=True)),
    ("sq3-non-causal", dict(sq=3, new=3), {}),
    ("all-empty", dict(lens=(0, 0, 0), new=0), {}),
    ("empty-plus-new", dict(lens=(0, 0, 0), new=2), dict(causal=True)),
    ("long", dict(lens=(4000, 17, 2500), d=128), {}),
    ("splits-1", dict(lens=(700, 1, 300)), dict(num_splits=1)),
    ("splits-3", dict(lens=(700, 1, 300)), dict(num_splits=3)),
    ("splits-many", dict(lens=(700, 1, 300)), dict(num_splits=64)),
    ("page-16", dict(page=16, new=3), {}),
    ("page-1", dict(page=1, lens=(20, 0, 9), new=2), {}),
    ("page-3", dict(page=3, lens=(20, 0, 9), new=2), {}),
    ("page-64-d128", dict(page=64, d=128, new=5, lens=(126, 60, 300)), dict(causal=True)),
    ("page-256-long", dict(page=256, d=128, lens=(3000, 255, 1)), {}),
    ("window", dict(new=2, sq=2, feats=("window",)), dict(causal=True)),
    ("softcap", dict(feats=("softcap",)), {}),
    ("alibi", dict(feats=("alibi",), sq=2), dict(causal=True)),
    ("sinks", dict(feats=("sinks",)), {}),
    ("sinks-empty", dict(feats=("sinks",), lens=(0, 5, 0), new=0), {}),
    ("all-features-paged", dict(feats=("window", "softcap", "alibi", "sinks"), page=16, sq=2, new=2),
     dict(causal=True)),
]


def _gpu_decode(args, opts, extra, dtype):
    import cupy

    dev = {n: (None if x is None else cupy.asarray(x)) for n, x in args.items()}
    dev_opts = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    out, lse = rawflash.decode(**dev, **dev_opts, **{"causal": False, **extra}, return_lse=True)
    return dev, cupy.asnumpy(out), cupy.asnumpy(lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,kw,extra", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_decode_gpu(name, kw, extra, dtype):
    args, opts = _case(dtype=dtype, **kw)
    lens = args["cache_seqlens"]
    ref_args = dict(k_new=args["k_new"], v_new=args["v_new"], block_table=args["block_table"], **opts,
                    causal=extra.get("causal", False))
    ref_out, ref_lse = reference.decode(args["q"], args["k_cache"], args["v_cache"], lens, **ref_args)
    base_out, _ = reference.decode(args["q"], args["k_cache"], args["v_cache"], lens, upcast=False, **ref_args)
    dev, out, lse = _gpu_decode(args, opts, extra, dtype)
    assert np.all(np.isfinite(out.astype(np.float64)))
    assert reference.error_ratio_ok(out, ref_out, base_out, dtype, 2.0), (
        f"max error {np.abs(out.astype(np.float64) - ref_out).max()} vs base "
        f"{np.abs(base_out.astype(np.float64) - ref_out).max()}")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=2e-3 if dtype != "float32" else 2e-5)
    kc, vc = reference.append_kv(args["k_cache"], args["v_cache"], lens, args["k_new"], args["v_new"],
                                 args["block_table"])
    np.testing.assert_array_equal(dev["k_cache"].get(), kc)  # exactly the appended rows changed
    np.testing.assert_array_equal(dev["v_cache"].get(), vc)


@pytest.mark.gpu
def test_decode_gpu_numpy_inputs_append_on_host():
    args, _ = _case(dtype="bfloat16", page=16, new=2)
    kc, vc = reference.append_kv(args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                 args["v_new"], args["block_table"])
    out = rawflash.decode(**args)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(args["k_cache"], kc)
    np.testing.assert_array_equal(args["v_cache"], vc)


@pytest.mark.gpu
def test_decode_gpu_int_cache_seqlens_and_repeat_steps():
    """Several decode steps appending one token each give what one call over the final cache gives."""
    import cupy

    args, _ = _case(dtype="float16", lens=(40, 40, 40), new=0, d=128)
    dev = {n: (None if x is None else cupy.asarray(x)) for n, x in args.items()}
    rng = np.random.default_rng(5)
    for step in range(3):
        kn = cupy.asarray(rng.standard_normal((3, 1, 2, 128)).astype(np.float16))
        vn = cupy.asarray(rng.standard_normal((3, 1, 2, 128)).astype(np.float16))
        rawflash.decode(dev["q"], dev["k_cache"], dev["v_cache"], cache_seqlens=40 + step, k_new=kn, v_new=vn)
    final = rawflash.decode(dev["q"], dev["k_cache"], dev["v_cache"], cache_seqlens=43)
    ref, _ = reference.decode(args["q"], dev["k_cache"].get(), dev["v_cache"].get(), np.full(3, 43, np.int32))
    assert np.abs(final.get().astype(np.float64) - ref).max() < 2e-3
