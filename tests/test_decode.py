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
from rawflash import reference
from rawflash.kernels import configs, forms, launch
from rawflash.kernels.configs import TileConfig, tile_config
from rawflash.problem import Problem
from conftest import DTYPES
from test_numba_gpu import PTX_CHECK as _FWD_PTX_CHECK

RNG_SCALE = 1.0


def _case(batch=3, sq=1, h=8, hk=2, d=64, dtype="float16", lens=(37, 0, 300), new=1, page=0, seed=0, feats=(),
          window=(50, 0)):
    """Host arrays of one decode call: q, the caches (paged when page > 0: pages in a shuffled order), k_new, v_new,
    cache_seqlens, block_table and the feature arguments ("window" in feats: ``window``)."""
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
        opts["window"] = window
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
    p = Problem(2, sq, seqlen, 8 * group, 8, 128, "bfloat16", False, seqused_k=True, new_keys=1)
    cfg = tile_config("decode_split", 128, "bfloat16", "sm_90")
    n = forms.decode_splits(p, cfg)
    tiles = -(-seqlen // cfg.bc)
    assert 1 <= n <= min(forms.MAX_SPLITS, tiles)
    best = min(forms.decode_split_cost(p, cfg, s) for s in range(1, min(forms.MAX_SPLITS, tiles) + 1))
    assert forms.decode_split_cost(p, cfg, n) <= 1.02 * best


def _sweep_problem(batch, cache, heads=32, kv_heads=8, sq=1):
    return Problem(batch, sq, cache + 1, heads, kv_heads, 128, "bfloat16", sq > 1, seqused_k=True, new_keys=1)


@pytest.mark.parametrize("batch,cache", [(8, 32768), (64, 4096), (64, 8192), (8, 131072)])
def test_split_heuristic_fills_whole_waves(batch, cache):
    """Large caches: waves of CTAs come out nearly whole (50 splits at b8 N32768 would make 2.1 waves, 0.7 of the
    bandwidth's time wasted in the last one), with full CTAs."""
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
    """GQA 32/8 with one new key: decode_split appends it itself (one row group), merges each CTA's 4 splits into
    one partial and its last CTAs merge the partials (no combine launch); MQA 32/1 over many partials takes a
    combine launch (the warp one up to 32 partials, the CTA one above); no new keys, no append either way."""
    p = Problem(2, 1, 4096, 32, 8, 128, "float16", False, seqused_k=True, new_keys=1)
    plan = forms.decode_plan(p, 16)
    cfg = tile_config("decode_split", 128, "float16", "sm_90")
    assert [lau.kernel for lau in plan.launches] == ["decode_split"]
    assert plan.num_splits == 16 and plan.split_appends and plan.fused and plan.partials == -(-16 // cfg.warps)
    assert plan.launches[0].grid == (-(-16 // cfg.warps), 8 * -(-4 // cfg.br), 2)
    assert forms.decode_plan(p, 256).fused, "4 rows of 128 columns: one chunk a thread, 8 round trips at 64 partials"
    mqa = Problem(2, 1, 4096, 32, 1, 128, "float16", False, seqused_k=True)
    rows = 2 * 32
    for splits, kernel in ((128, "decode_combine_warp"), (256, "decode_combine")):
        plan = forms.decode_plan(mqa, splits)
        cfg = plan.launches[0].config
        assert not plan.fused and plan.partials == splits // cfg.warps
        assert [lau.kernel for lau in plan.launches] == ["decode_split", kernel]
    warp = forms.decode_plan(mqa, 128).launches[1]
    assert warp.grid == (-(-rows // launch.DECODE_COMBINE_WARP_ROWS), 1, 1) and warp.smem == 0
    assert warp.block == (32 * launch.DECODE_COMBINE_WARP_ROWS, 1, 1)
    combine = forms.decode_plan(mqa, 256).launches[1]
    assert combine.grid == (rows, 1, 1) and combine.block == (launch.DECODE_COMBINE_THREADS, 1, 1)
    assert combine.template_args[2] == forms.MAX_SPLITS and combine.smem == combine.template_args[3]
    assert forms.decode_plan(mqa, 32).fused, "32 rows x 8 partials: 8 round trips a thread"
    no_new = forms.decode_plan(Problem(2, 1, 4096, 32, 8, 128, "float16", False, seqused_k=True), 16)
    assert [lau.kernel for lau in no_new.launches] == ["decode_split"] and not no_new.split_appends


@pytest.mark.parametrize("rows,d,partials,fused", [(4, 128, 64, True), (16, 128, 16, True), (16, 128, 24, False),
                                                    (32, 128, 8, True), (32, 128, 9, False), (4, 256, 32, True),
                                                    (4, 256, 40, False), (1, 64, 64, True), (1, 64, 72, False)])
def test_decode_fuses_combine_by_its_round_trips(rows, d, partials, fused):
    """A thread of the last CTA makes cdiv(rows x d / 4, threads) x cdiv(partials, 8) round trips to L2; fused up to
    DECODE_FUSE_ROUND_TRIPS."""
    p = Problem(1, 1, 4096, rows, 1, d, "bfloat16", False, seqused_k=True)
    cfg = TileConfig(32, 16, 4, stages=2)
    assert forms.decode_fuses_combine(p, cfg, partials) is fused


def test_decode_split_max_splits_is_launch_s():
    """decode.cu sizes the fused combine's shared weights for launch.DECODE_MAX_SPLITS partials."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[1] / "cuda" / "decode.cu").read_text()
    assert f"constexpr int DECODE_MAX_SPLITS = {launch.DECODE_MAX_SPLITS};" in src


# (heads, kv_heads, seqlen_q, head_dim, dtype): the packed rows of one kv head against the tile's br rows
APPEND_RULE = [(32, 8, 1, 128, "bfloat16"), (32, 8, 4, 128, "bfloat16"), (64, 8, 2, 128, "bfloat16"),
               (32, 1, 1, 128, "bfloat16"), (16, 1, 2, 128, "float16"), (8, 8, 1, 64, "float32"),
               (32, 8, 5, 128, "bfloat16"), (64, 2, 1, 32, "float16"), (16, 2, 4, 32, "bfloat16")]


@pytest.mark.parametrize("heads,kv_heads,sq,d,dtype", APPEND_RULE)
@pytest.mark.parametrize("window", [(-1, -1), (1, 0), (0, 0)])
def test_decode_append_is_folded_iff_one_row_group(heads, kv_heads, sq, d, dtype, window):
    """decode_split writes the new keys itself iff one row group holds the packed rows (group x seqlen_q <= br);
    else decode_append runs first. Windows (even ones that hide appended keys from every row) change nothing: the
    splits' key ranges do not depend on the mask."""
    p = Problem(3, sq, 4096, heads, kv_heads, d, dtype, sq > 1, seqused_k=True, new_keys=sq,
                       window=window)
    plan = forms.decode_plan(p, 8)
    cfg = next(lau.config for lau in plan.launches if lau.kernel == "decode_split")
    one_group = (heads // kv_heads) * sq <= cfg.br
    assert plan.split_appends == one_group == forms.decode_split_appends(p, cfg)
    kernels = [lau.kernel for lau in plan.launches]
    combine = [] if plan.fused else ["decode_combine_warp"]
    assert kernels == (["decode_split"] if one_group else ["decode_append", "decode_split"]) + combine


def _split_ranges(keys, splits, bc):
    """decode_split's key ranges of one sequence ([decode:split_append]: the s-th run of cdiv(tiles, splits) tiles)."""
    per = -(-(-(-keys // bc)) // splits) * bc
    return [(s * per, min(keys, s * per + per)) for s in range(splits)]


@pytest.mark.parametrize("bc", [16, 32])
def test_split_ranges_give_every_new_key_one_writer(bc):
    """The argument the fold rests on, on the host: for any length, append and split count, the splits' ranges
    are disjoint and cover [0, keys), so every new key len .. len + new - 1 has exactly one writing split."""
    rng = np.random.default_rng(3)
    for _ in range(2000):
        length, new, splits = int(rng.integers(0, 3000)), int(rng.integers(0, 9)), int(rng.integers(1, 257))
        keys = length + new
        ranges = _split_ranges(keys, splits, bc)
        for a, b in ranges:
            assert a % bc == 0 and (b == keys or b % bc == 0)  # whole tiles: a split's tiles never reach the next
        writers = [[s for s, (a, b) in enumerate(ranges) if a <= j < b] for j in range(length, keys)]
        assert all(len(w) == 1 for w in writers), (length, new, splits)
        assert sum(max(0, b - a) for a, b in ranges) == keys


@pytest.mark.parametrize("partials,kernel", [(1, "decode_combine_warp"), (32, "decode_combine_warp"),
                                             (33, "decode_combine"), (64, "decode_combine")])
def test_decode_combine_form(partials, kernel):
    p = Problem(2, 3, 4096, 8, 2, 64, "bfloat16", True, seqused_k=True)
    assert forms.decode_combine(p, partials).kernel == kernel
    plan = forms.decode_plan(p, 4 * partials)  # (4 warps a CTA: one partial per 4 splits)
    assert plan.partials == partials
    assert [lau.kernel for lau in plan.launches][1:] == ([] if plan.fused else [kernel])
    assert plan.fused == (partials <= 32), "12 rows x 64 columns: 2 chunks a thread, 4 round trips of 8 partials"


def _combine_warp_reads(head_dim, splits, batch=16):
    """decode_combine_warp's index arithmetic on the host, lane by lane: {(split, 4-column chunk): how often read
    into an output lane's sum} after the lanes' groups are added into group 0 (cuda/decode.cu,
    [decode:combine_warp])."""
    chunks = head_dim // 4
    groups = 1 if chunks >= 32 else 32 // chunks
    summed = {}
    for c0 in range(0, chunks, 32):
        reads = {}  # lane -> the (split, chunk) pairs its acc holds
        for lane in range(32):
            sg, c = lane // chunks, lane % chunks
            c4 = c0 + c
            mine = sg < groups and c4 < chunks
            got = []
            for s0 in range(0, splits, batch * groups):
                for u in range(batch):
                    s = s0 + u * groups + sg
                    if mine and s < splits:
                        got.append((s, c4))
            reads[lane] = got
        for lane in range(32):
            sg, c = lane // chunks, lane % chunks
            if sg == 0 and c0 + c < chunks:
                pairs = list(reads[lane]) + [x for gg in range(1, groups) for x in reads[(gg * chunks + c) & 31]]
                for x in pairs:
                    summed[x] = summed.get(x, 0) + 1
    return summed


@pytest.mark.parametrize("head_dim", range(8, 257, 8))
def test_combine_warp_lanes_read_every_split_and_column_once(head_dim):
    """Without a GPU: every (split, 4-column chunk) of a row reaches exactly one output lane's sum, once, for every
    head dim (lane groups below 128 columns, two passes above) and split count up to 32."""
    for splits in (1, 2, 3, 12, 16, 17, 24, 31, 32):
        summed = _combine_warp_reads(head_dim, splits)
        want = {(s, c) for s in range(splits) for c in range(head_dim // 4)}
        assert set(summed) == want and set(summed.values()) == {1}, (head_dim, splits)


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


def _explain(*args, code=0):
    import json

    from click.testing import CliRunner

    from rawflash.cli import commands

    result = CliRunner().invoke(commands.main, ["explain", "--decode", *map(str, args), "--json"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_explain_decode_shows_the_split_plan():
    got = _explain("--batch", 8, "--seqlen-q", 1, "--seqlen-k", 32768, "--heads", 32, "--kv-heads", 8,
                   "--page-size", 64)
    assert got["valid"] and [r["kernel"] for r in got["launches"]] == ["decode_split"]
    plan = got["split plan"]
    assert plan["append"].startswith("in decode_split") and plan["combine"].startswith("in decode_split")
    want = forms.decode_plan(Problem(8, 1, got["problem"]["cache capacity per sequence"], 32, 8, 128,
                                            "bfloat16", False, seqused_k=True, new_keys=1, page_size=64))
    assert plan["num_splits"] == want.num_splits
    split = next(r for r in got["launches"] if r["kernel"] == "decode_split")
    assert split["grid"] == "x".join(map(str, want.launches[0].grid))
    asked = _explain("--batch", 2, "--seqlen-q", 4, "--seqlen-k", 1000, "--num-splits", 7)
    assert asked["split plan"]["num_splits"] == 7 and "you" in asked["split plan"]["chosen by"]
    mqa = _explain("--batch", 2, "--seqlen-q", 2, "--seqlen-k", 1000, "--heads", 32, "--kv-heads", 1,
                   "--num-splits", 40)
    assert [r["kernel"] for r in mqa["launches"]] == ["decode_append", "decode_split", "decode_combine_warp"]
    assert mqa["split plan"]["combine"].startswith("decode_combine_warp (one warp per row): 10 partials")
    assert mqa["split plan"]["append"].startswith("decode_append first: 2 row groups")
    assert "many packed rows" in next(r for r in mqa["launches"] if r["kernel"] == "decode_split")["note"]
    one = _explain("--batch", 2, "--seqlen-q", 1, "--seqlen-k", 1000, "--heads", 32, "--kv-heads", 1)
    assert [r["kernel"] for r in one["launches"]][0] == "decode_split", "MQA 32 / 1: one row group of 32"


def test_explain_decode_refuses_what_decode_refuses():
    got = _explain("--batch", 2, "--seqlen-q", 1, "--seqlen-k", 100, "--head-dim", 60, code=2)
    assert not got["valid"] and "head_dim a multiple of 8" in got["error"]


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
    # the append folded into decode_split (d = 128: 16-key tiles in every dtype): new keys across split edges (34
    # keys in 3 splits of 16), page edges (page 5), both (page 16: keys 14, 15 | 16, 17); several query rows
    ("fold-crosses-splits-sq4", dict(lens=(30, 0, 13), new=4, sq=4, d=128), dict(causal=True, num_splits=3)),
    ("fold-crosses-pages", dict(page=5, lens=(13, 0, 29), new=3, d=128), dict(num_splits=2)),
    ("fold-crosses-split-and-page", dict(page=16, lens=(14, 0, 46), new=4, sq=2, d=128),
     dict(causal=True, num_splits=3)),
    # appended keys no row sees, in a split that loads no tile (window (1, 0): keys 14, 15 of 18 in split 0)
    ("window-hides-appends", dict(lens=(14, 3, 30), new=4, d=128, feats=("window",), window=(1, 0)),
     dict(num_splits=2)),
    ("window-hides-appends-paged", dict(lens=(30, 0, 7), new=4, page=3, d=128, feats=("window",), window=(0, 0)),
     dict(num_splits=2)),
    # several row groups (32 packed rows of MQA 32/1 > 16): decode_append runs before the split pass
    ("row-groups-append-kernel", dict(h=32, hk=1, d=128, new=2, page=16), {}),
    # the combine's two forms at their edge (32: one warp per row; 33: a CTA per row), and head dims whose 4-column
    # chunks split a warp's lanes into groups over the splits (d = 16: 8 groups, 40: 3 of 10 lanes, 72: 1 of 18)
    ("splits-32", dict(lens=(700, 1, 300), new=2), dict(num_splits=32)),
    ("splits-33", dict(lens=(700, 1, 300), new=2), dict(num_splits=33)),
    ("d16-splits-5", dict(d=16, lens=(200, 0, 90), new=2), dict(num_splits=5)),
    ("d40-splits-7", dict(d=40, lens=(300, 5, 90)), dict(num_splits=7)),
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


@pytest.mark.gpu
def test_decode_gpu_device_lengths_out_of_range_give_nan_rows():
    """Device cache_seqlens are never read by the host: an out-of-range one makes that sequence's out and lse NaN
    and skips its append; the other sequences are right and nothing outside the cache changes."""
    import cupy

    args, _ = _case(batch=3, dtype="float16", lens=(10, 0, 20), new=1, d=128)
    cap = args["k_cache"].shape[1]
    dev = {n: (None if x is None else cupy.asarray(x)) for n, x in args.items()}
    dev["cache_seqlens"] = cupy.asarray(np.array([10, cap, -1], np.int32))
    out, lse = rawflash.decode(**dev, return_lse=True, causal=False)
    out, lse = out.get().astype(np.float64), lse.get()
    assert np.isnan(out[1:]).all() and np.isnan(lse[1:]).all()
    ref, _ = reference.decode(args["q"][:1], args["k_cache"][:1], args["v_cache"][:1], np.array([10], np.int32),
                              k_new=args["k_new"][:1], v_new=args["v_new"][:1], causal=False)
    assert np.abs(out[:1] - ref).max() < 2e-3
    kc = reference.append_kv(args["k_cache"][:1], args["v_cache"][:1], np.array([10]), args["k_new"][:1],
                             args["v_new"][:1])[0]
    np.testing.assert_array_equal(dev["k_cache"].get()[:1], kc)
    np.testing.assert_array_equal(dev["k_cache"].get()[1:], args["k_cache"][1:])  # no append for bad lengths


@pytest.mark.gpu
def test_decode_gpu_device_pages_outside_the_cache_give_nan_rows():
    import cupy

    args, _ = _case(batch=2, dtype="bfloat16", lens=(10, 40), new=1, page=16, d=128)
    table = args["block_table"].copy()
    table[1, 1] = args["k_cache"].shape[0]  # a page sequence 1 reads lies past the cache
    table[0, 2] = -7                         # an entry sequence 0 never uses
    dev = {n: (None if x is None else cupy.asarray(x)) for n, x in dict(args, block_table=table).items()}
    out, lse = rawflash.decode(**dev, return_lse=True, causal=False)
    out, lse = out.get().astype(np.float64), lse.get()
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all() and np.isfinite(out[0]).all()
    # appends land wherever their own page is inside the cache (sequence 1's key 40 is on page 2): as before the fold
    kc, vc = reference.append_kv(args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                 args["v_new"], table)
    np.testing.assert_array_equal(dev["k_cache"].get(), kc)
    np.testing.assert_array_equal(dev["v_cache"].get(), vc)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kw,extra", [(dict(lens=(30, 0, 13), new=4, sq=4, d=128, page=5), dict(num_splits=3)),
                                      (dict(lens=(700, 1, 300), new=2, d=64), dict(num_splits=32)),
                                      (dict(lens=(14, 3, 30), new=4, d=128, feats=("window", "sinks"),
                                            window=(1, 0)), dict(num_splits=2))],
                         ids=["pages-sq4", "splits-32", "window-sinks"])
def test_decode_gpu_fold_and_fused_combine_match_the_separate_kernels(dtype, kw, extra, monkeypatch):
    """The same call four ways: as planned (the append in decode_split, the partials merged by its last CTAs),
    with decode_append launched first (identical out, lse and caches: the same split pass reads the same keys),
    and with the partials merged by a launch of its own, the warp combine and the CTA combine (the same lse to the
    bit at <= 32 partials: the same shuffle tree; out to rounding: another order of the float32 sum)."""
    args, opts = _case(dtype=dtype, **kw)
    extra = {**extra, "causal": kw.get("sq", 1) > 1}

    def run():
        forms._decode_plan.cache_clear()
        try:
            return _gpu_decode(args, opts, extra, dtype)
        finally:
            forms._decode_plan.cache_clear()

    dev, out, lse = run()
    plan = forms.decode_plan(dev_problem(args, extra), extra["num_splits"])
    assert plan.split_appends and plan.fused
    monkeypatch.setattr(forms, "decode_split_appends", lambda p, cfg: False)
    dev2, out2, lse2 = run()
    np.testing.assert_array_equal(out2.view(np.uint8), out.view(np.uint8))
    np.testing.assert_array_equal(lse2, lse)
    np.testing.assert_array_equal(dev2["k_cache"].get(), dev["k_cache"].get())
    np.testing.assert_array_equal(dev2["v_cache"].get(), dev["v_cache"].get())
    monkeypatch.setattr(forms, "decode_fuses_combine", lambda p, cfg, partials: False)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for max_warp in (launch.DECODE_COMBINE_WARP_MAX_SPLITS, 0):  # the warp combine, then the CTA one
        monkeypatch.setattr(launch, "DECODE_COMBINE_WARP_MAX_SPLITS", max_warp)
        _, out3, lse3 = run()
        np.testing.assert_array_equal(lse3, lse)
        np.testing.assert_allclose(out3.astype(np.float64), out.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_decode_gpu_fused_combine_puts_its_counters_back():
    """The fused combine's counters (one per (batch, kv head, row group), cached with the work buffers per stream)
    are zero again after every call, so repeated calls on one stream find the last CTA each time: bit-identical
    results, on the default stream and on a stream of its own (a buffer triple of its own)."""
    import cupy

    from rawflash.kernels import cupy_backend

    args, opts = _case(batch=3, dtype="bfloat16", lens=(700, 1, 300), new=0, d=128)
    extra = {"num_splits": 24}
    first = _gpu_decode(args, opts, extra, "bfloat16")
    assert forms.decode_plan(dev_problem(args, extra), 24).fused
    with cupy.cuda.Stream(non_blocking=True):
        for _ in range(3):
            _, out, lse = _gpu_decode(args, opts, extra, "bfloat16")
            np.testing.assert_array_equal(out.view(np.uint8), first[1].view(np.uint8))
            np.testing.assert_array_equal(lse, first[2])
    for _ in range(2):
        _, out, lse = _gpu_decode(args, opts, extra, "bfloat16")
        np.testing.assert_array_equal(out.view(np.uint8), first[1].view(np.uint8))
    cupy.cuda.Device().synchronize()
    counters = [ws[2] for ws in cupy_backend._workspaces.values()]
    assert counters and all(int(c.sum()) == 0 for c in counters)


def dev_problem(args, extra):
    """The kernel problem of a _case call (as validation makes it), for its plan."""
    from rawflash import validation

    c = validation.check_decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                args["v_new"], args["block_table"], extra.get("causal", False), None, "cupy",
                                validation.Features())
    return c.problem


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""


@pytest.mark.gpu
def test_decode_gpu_public_call_does_not_synchronise():
    """With device cache_seqlens and block_table, the call returns while earlier work on the stream still runs
    (a spin kernel of 10^9 cycles queued first): nothing is copied to the host."""
    import time

    import cupy

    args, _ = _case(batch=4, dtype="bfloat16", lens=(100, 7, 300, 64), new=1, page=16, d=128)
    dev = {n: (None if x is None else cupy.asarray(x)) for n, x in args.items()}
    rawflash.decode(**dev)  # compile and plan first
    cupy.cuda.get_current_stream().synchronize()
    spin = cupy.RawKernel(_SPIN, "spin")
    spin((1,), (1,), (np.int64(10 ** 9),))  # about 0.5 s at the H200's 1.98 GHz
    t0 = time.perf_counter()
    rawflash.decode(**dev)
    host = time.perf_counter() - t0
    cupy.cuda.get_current_stream().synchronize()
    assert host < 0.2, f"the call took {host:.3f} s of host time behind a long kernel: it synchronised"


@pytest.mark.gpu
def test_decode_gpu_work_buffers_are_reused():
    import cupy

    from rawflash.kernels import cupy_backend

    a = cupy_backend.decode_workspace(5, (2, 1, 8, 64), (2, 8, 1))
    assert cupy_backend.decode_workspace(5, (2, 1, 8, 64), (2, 8, 1))[0] is a[0]
    with cupy.cuda.Stream():
        assert cupy_backend.decode_workspace(5, (2, 1, 8, 64), (2, 8, 1))[0] is not a[0]  # another stream: its own


# ---------------------------------------------------------------- the Numba twins on the simulator (CPU)
# Run with the simulator switched on before numba is imported (tools/test.sh does):
#     NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim tests/test_decode.py
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
sim = [pytest.mark.sim, pytest.mark.skipif(not SIMULATOR, reason="needs NUMBA_ENABLE_CUDASIM=1 set before numba is "
                                                                  "imported (a process of its own)")]

SIM_CASES = [
    # (id, case kwargs, decode kwargs): tiny shapes (d = 32 or 40, a few tiles per sequence)
    ("gqa-f32", dict(batch=2, h=4, hk=2, d=32, lens=(37, 0), new=1), {}),
    ("gqa-f32-splits-3-causal-sq2", dict(batch=2, h=4, hk=2, d=32, lens=(70, 5), new=2, sq=2),
     dict(num_splits=3, causal=True)),
    ("splits-many-past-the-keys", dict(batch=2, h=2, hk=1, d=32, lens=(40, 3), new=1), dict(num_splits=40)),
    ("splits-1", dict(batch=2, h=2, hk=2, d=32, lens=(60, 17), new=0), dict(num_splits=1)),
    ("mqa-sq3-causal", dict(batch=1, h=4, hk=1, d=32, lens=(45,), new=3, sq=3), dict(causal=True, num_splits=2)),
    ("page-16-append-crosses", dict(batch=3, h=2, hk=1, d=32, lens=(15, 0, 31), new=2, page=16), dict(num_splits=2)),
    ("page-3", dict(batch=2, h=2, hk=1, d=32, lens=(20, 7), new=2, page=3), dict(num_splits=3)),
    ("page-1", dict(batch=2, h=2, hk=2, d=32, lens=(9, 0), new=1, page=1), {}),
    ("d40-padded", dict(batch=1, h=2, hk=1, d=40, lens=(33,), new=1), dict(num_splits=2)),
    ("features-paged", dict(batch=2, h=4, hk=2, d=32, lens=(60, 2), new=2, sq=2, page=16,
                            feats=("window", "softcap", "alibi", "sinks")), dict(causal=True, num_splits=3)),
    ("sinks-empty", dict(batch=2, h=2, hk=1, d=32, lens=(0, 5), new=0, feats=("sinks",)), dict(num_splits=2)),
    # the append folded into decode_split (one row group): new keys across split edges (16-key tiles; 34 keys in 3
    # splits of 16: keys 30, 31 | 32, 33), across page edges, and both at once (page 16: 14, 15 | 16, 17)
    ("fold-crosses-splits-sq4", dict(batch=3, h=2, hk=1, d=32, lens=(30, 0, 13), new=4, sq=4),
     dict(causal=True, num_splits=3)),
    ("fold-crosses-pages", dict(batch=2, h=2, hk=1, d=32, lens=(13, 29), new=3, page=5), dict(num_splits=2)),
    ("fold-crosses-split-and-page", dict(batch=2, h=4, hk=2, d=32, lens=(14, 0), new=4, sq=2, page=16),
     dict(causal=True, num_splits=2)),
    ("fold-one-split", dict(batch=2, h=2, hk=1, d=32, lens=(45, 0), new=2, sq=2), dict(causal=True, num_splits=1)),
    ("fold-many-splits", dict(batch=2, h=2, hk=1, d=32, lens=(40, 3), new=3, sq=3, page=16),
     dict(causal=True, num_splits=40)),
    ("splits-32", dict(batch=1, h=2, hk=1, d=32, lens=(500,), new=1), dict(num_splits=32)),
    ("splits-33", dict(batch=1, h=2, hk=1, d=32, lens=(520,), new=1), dict(num_splits=33)),
    # a window (1, 0) with one query row sees the last two keys: appended keys 14, 15 of sequence 0 are seen by no
    # row and lie in split 0 (keys [0, 16)), which therefore loads no tile at all, yet must write them; (0, 0)
    # likewise with keys 30, 31 of 34 in split 0 (keys [0, 32)) of a paged cache
    ("window-hides-appends", dict(batch=2, h=2, hk=1, d=32, lens=(14, 3), new=4, feats=("window",), window=(1, 0)),
     dict(num_splits=2)),
    ("window-hides-appends-paged", dict(batch=2, h=2, hk=1, d=32, lens=(30, 0), new=4, sq=1, page=3,
                                        feats=("window",), window=(0, 0)), dict(num_splits=2)),
    # several row groups (MQA 8 heads x 3 query rows = 24 packed rows > 16): decode_append runs first
    ("row-groups-append-kernel", dict(batch=2, h=8, hk=1, d=32, lens=(25, 0), new=3, sq=3, page=16),
     dict(causal=True, num_splits=3)),
]


def _sim_check(kw, extra, dtype):
    args, opts = _case(dtype=dtype, **kw)
    lens = args["cache_seqlens"].copy()
    ref_args = dict(k_new=args["k_new"], v_new=args["v_new"], block_table=args["block_table"], **opts,
                    causal=extra.get("causal", False))
    ref_out, ref_lse = reference.decode(args["q"], args["k_cache"], args["v_cache"], lens, **ref_args)
    base_out, _ = reference.decode(args["q"], args["k_cache"], args["v_cache"], lens, upcast=False, **ref_args)
    kc, vc = reference.append_kv(args["k_cache"], args["v_cache"], lens, args["k_new"], args["v_new"],
                                 args["block_table"])
    out, lse = rawflash.decode(**args, **opts, **{"causal": False, **extra}, return_lse=True, backend="numba")
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype
    ok, err, base, bound = reference.error_ratio_ok(out, ref_out, base_out, dtype, 2.0)
    assert ok, f"max error {err:.3g} > {bound:.3g} (naive {base:.3g})"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=2e-3 if dtype != "float32" else 2e-5)
    np.testing.assert_array_equal(args["k_cache"], kc)  # exactly the appended rows changed
    np.testing.assert_array_equal(args["v_cache"], vc)


@pytest.mark.parametrize("name,kw,extra", SIM_CASES, ids=[c[0] for c in SIM_CASES])
@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_decode_twin_float32(name, kw, extra):
    _sim_check(kw, extra, "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_decode_twin_16bit(dtype):
    _sim_check(dict(batch=2, h=4, hk=2, d=32, lens=(50, 1), new=2, sq=2, page=16), dict(causal=True, num_splits=2),
               dtype)


def _sim_plan(kw, extra):
    """The plan backend='numba' runs for a SIM_CASES case (the problem as the validation makes it)."""
    from rawflash import validation
    from rawflash.kernels import numba_backend

    args, _ = _case(dtype="float32", **kw)
    c = validation.check_decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                args["v_new"], args["block_table"], extra.get("causal", False), None, "numba",
                                validation.Features())
    return forms.decode_plan(numba_backend.run_problem(c.problem), extra.get("num_splits"), 132)


def test_sim_cases_run_both_appends_and_the_fused_combine():
    """The twin cases above take each append path (the fold and decode_append) and, being tiny, the fused combine
    (test_decode_twin_combine_launches runs the combine launches on them)."""
    plans = {name: _sim_plan(kw, extra) for name, kw, extra in SIM_CASES}
    appends = {name: p.split_appends for name, p in plans.items() if dict(SIM_CASES_KW[name]).get("new", 1)}
    assert not appends["row-groups-append-kernel"] and appends["fold-crosses-splits-sq4"]
    assert all(v for n, v in appends.items() if n.startswith(("fold", "window")))
    assert all(p.fused and [lau.kernel for lau in p.launches][-1] == "decode_split" for p in plans.values())
    assert plans["splits-33"].partials == 9 and plans["fold-many-splits"].partials == 10


UNFUSED_SIM_CASES = ["splits-33", "fold-many-splits", "row-groups-append-kernel", "sinks-empty"]


@pytest.mark.parametrize("form", ["decode_combine_warp", "decode_combine"])
@pytest.mark.parametrize("name", UNFUSED_SIM_CASES)
@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_decode_twin_combine_launches(name, form, monkeypatch):
    """The partials merged by a launch of its own (decode_fuses_combine off): the warp combine, and the CTA one
    (its threshold moved to 0 partials) on the same cases."""
    monkeypatch.setattr(forms, "decode_fuses_combine", lambda p, cfg, partials: False)
    if form == "decode_combine":
        monkeypatch.setattr(launch, "DECODE_COMBINE_WARP_MAX_SPLITS", 0)
    kw, extra = next((kw, extra) for n, kw, extra in SIM_CASES if n == name)
    forms._decode_plan.cache_clear()
    try:
        assert _sim_plan(kw, extra).launches[-1].kernel == form
        _sim_check(kw, extra, "float32")
    finally:
        forms._decode_plan.cache_clear()


SIM_CASES_KW = {name: kw for name, kw, _ in SIM_CASES}


@pytest.mark.parametrize("name,kw,extra", [c for c in SIM_CASES if c[1].get("new", 1)],
                         ids=[c[0] for c in SIM_CASES if c[1].get("new", 1)])
@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_decode_twin_appends_on_its_own(name, kw, extra):
    """The twins' own writes, without the API's host append (which repairs the caller's caches when the twins ran
    on copies): float32 NumPy caches reach the simulated kernels unchanged, so after numba_backend.decode they must
    hold exactly the appended keys, including keys no query row sees (a split that loads no tile still writes the
    new keys of its range)."""
    from rawflash import validation
    from rawflash.kernels import numba_backend

    args, opts = _case(dtype="float32", **kw)
    kc, vc = args["k_cache"].copy(), args["v_cache"].copy()
    causal = extra.get("causal", False)
    feats = validation.Features(window=opts.get("window", (-1, -1)), softcap=opts.get("softcap", 0.0),
                                alibi_slopes=opts.get("alibi_slopes"), sinks=opts.get("sinks"))
    c = validation.check_decode(args["q"], kc, vc, args["cache_seqlens"], args["k_new"], args["v_new"],
                                args["block_table"], causal, None, "numba", feats)
    out, _ = numba_backend.decode(c.problem, args["q"], kc, vc, args["k_new"], args["v_new"], c.scale,
                                  extra.get("num_splits"), c.extras)
    want_k, want_v = reference.append_kv(args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                         args["v_new"], args["block_table"])
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    ref, _ = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], k_new=args["k_new"],
                              v_new=args["v_new"], block_table=args["block_table"], causal=causal, **opts)
    assert np.abs(out - ref).max() < 1e-4


def _twin_call(args, lens, table=None, splits=2):
    """The twin backend called past the validation (which would refuse these lengths and tables)."""
    from rawflash import validation
    from rawflash.kernels import numba_backend

    ok_lens = np.zeros_like(lens)
    c = validation.check_decode(args["q"], args["k_cache"], args["v_cache"], ok_lens, args["k_new"], args["v_new"],
                                args["block_table"], False, None, "numba", validation.Features())
    extras = dict(c.extras, seqused_k=lens, **({} if table is None else {"block_table": table}))
    return numba_backend.decode(c.problem, args["q"], args["k_cache"], args["v_cache"], args["k_new"], args["v_new"],
                                c.scale, splits, extras)


@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_decode_twin_out_of_range_lengths_give_nan_rows():
    """cache_seqlens outside [0, capacity - new] (device values the host never reads): that sequence's out and lse
    are NaN, the others are right; nothing is appended for it."""
    args, _ = _case(batch=3, h=2, hk=1, d=32, dtype="float32", lens=(10, 0, 20), new=1)
    cap = args["k_cache"].shape[1]
    lens = np.array([10, cap, -1], np.int32)  # cap: one past the last slot for the new key; -1: negative
    out, lse = _twin_call(args, lens)
    assert np.isnan(out[1:]).all() and np.isnan(lse[1:]).all()
    ref, _ = reference.decode(args["q"][:1], args["k_cache"][:1], args["v_cache"][:1], lens[:1],
                              k_new=args["k_new"][:1], v_new=args["v_new"][:1], causal=False)
    assert np.abs(out[:1] - ref).max() < 1e-5


@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_decode_twin_pages_outside_the_cache_give_nan_rows():
    args, _ = _case(batch=2, h=2, hk=1, d=32, dtype="float32", lens=(10, 20), new=0, page=16)
    table = args["block_table"].copy()
    table[1, 1] = args["k_cache"].shape[0]  # the second page of sequence 1 is past the cache
    table[0, 1] = -5                         # an entry sequence 0 never uses: ignored
    out, lse = _twin_call(args, args["cache_seqlens"], table)
    assert np.isnan(out[1]).all() and np.isnan(lse[1]).all() and np.isfinite(out[0]).all()


# the forward twins' check up to their signature: NVVM present, no GPU needed (sm_90), arr()
DECODE_PTX_CHECK = _FWD_PTX_CHECK[:_FWD_PTX_CHECK.index("def signature")] + r"""
from rawflash.kernels import launch
from rawflash.numba_kernels.params import DecodeParams

def signature(dtype):  # p, q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws,
    # counters
    p = Problem(1, 1, 64, 2, 1, 32, "float32", False, seqused_k=True, new_keys=1, page_size=16)
    params = nb._params(DecodeParams, p, 0.5, {}, has_table=True, page_size=16, num_splits=2, new_keys=1,
                        cache_capacity=64, num_pages=4, cache_len=0, split_appends=True, num_partials=1,
                        has_counters=True)
    x, i1, f1 = arr(dtype, 4), arr(np.int32, 1), arr(np.float32, 1)
    return (typeof(params), x, x, x, x, x, x, arr(np.float32, 3), i1, i1, i1, f1, f1, arr(np.int32, 2),
            arr(np.float32, 5), arr(np.float32, 4), i1)

failed, done = [], 0
for dtype in ("float16", "float32"):
    for d in (32, 64, 128, 256):
        p = Problem(2, 1, 4096, 8, 2, d, dtype, False, seqused_k=True, new_keys=1)
        for lau in (*forms.decode_plan(p, 8).launches, launch.decode_append(p), launch.decode_combine_warp(p),
                    launch.decode_combine(p)):
            try:
                cuda.compile_ptx(nb.twin_of(lau, "decode").kernel.py_func, signature(np.dtype(dtype)), cc=(9, 0))
                done += 1
            except Exception as err:
                failed.append(f"{lau.name_expression} ({dtype} arrays): {type(err).__name__}: {err}"[:2000])
print(json.dumps({"compiled": done, "failed": failed}))
"""


@pytest.mark.compile
@pytest.mark.slow
def test_decode_twins_compile_to_ptx():
    """The simulator types nothing: the decode twins (append, split at four head dims, both combine launches;
    float16 and float32 arrays) go through Numba's nopython typing and NVVM to PTX for sm_90 in a child process
    without the simulator, with the argument types numba_backend.decode passes."""
    import json
    import subprocess
    import sys

    from rawflash.cli import sysinfo

    env = sysinfo.child_env()
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, "-c", DECODE_PTX_CHECK], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(got["skip"])
    assert not got["failed"], "\n".join(got["failed"])
    assert got["compiled"] == 32


@pytest.mark.parametrize("heads,kv_heads,sq,dtype,wide", [(32, 1, 1, "bfloat16", True), (32, 8, 4, "float16", False),
                                                        (32, 8, 8, "bfloat16", True), (16, 1, 1, "bfloat16", False)])
def test_many_packed_rows_take_the_32_row_tile(heads, kv_heads, sq, dtype, wide):
    """More than 16 packed rows per kv head at d = 128 (MQA 32 / 1, long speculative chunks): 32-row tiles
    (configs.MANY_ROWS_DECODE), so each row group reads the cache once per 32 rows and MQA 32 / 1 is one row group
    (the append folded into decode_split); 16 rows or fewer keep the table's row. Other head dims keep theirs."""
    p = Problem(8, sq, 32768, heads, kv_heads, 128, dtype, sq > 1, seqused_k=True, new_keys=sq)
    cfg = next(lau.config for lau in forms.decode_plan(p).launches if lau.kernel == "decode_split")
    assert cfg == (configs.MANY_ROWS_DECODE[("decode_split", 128, dtype)] if wide else
                   tile_config("decode_split", 128, dtype, "sm_90"))
    assert forms.decode_split_appends(p, cfg) == ((heads // kv_heads) * sq <= cfg.br)
    d64 = dataclasses.replace(p, head_dim=64)
    assert next(lau.config for lau in forms.decode_plan(d64).launches if lau.kernel == "decode_split") == \
        tile_config("decode_split", 64, dtype, "sm_90")
