"""rawflash.forward with paged keys (``block_table``): packed queries against the pages a decode step reads.

CPU tests check the semantics (the reference gathers the pages into packed sequences: the same answer as the
packed call on those keys), the plan (FA3's TMA form for pages of a power of two rows, the cp.async forms for
the rest) and the validation, one test per refused input. GPU tests check both forms against the float64 reference
by flash-attn's rule (2x the error of a plain implementation in the inputs' dtype, out and lse) over ragged lengths
(a sequence with no query, one with no key), page sizes 16 - 256 in a shuffled page order, GQA / MQA, causal both
ways and the features; that NaN in a page's rows past a sequence's keys and in pages no sequence names leaves the
results finite; that repeated calls run their plan (the plan cache) with the new arrays' addresses, that new
lengths and tables of the same layouts and maxima run that plan too, each checked before it launches; and that
a paged prefill followed by decode steps on the same pages equals the same steps on contiguous keys.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rawflash
from conftest import DTYPES
from rawflash import reference
from rawflash.kernels import forms
from rawflash.problem import Problem


def _case(qlens=(5, 0, 33, 70), klens=(40, 7, 33, 200), heads=4, kv_heads=2, d=64, page=16, dtype="bfloat16",
          seed=0, spare_pages=3, table=None):
    """Packed q, the pages of k and v (shuffled order, spare pages never named), block_table (``table`` in place
    of the shuffled one when given), seqused_k and cu_seqlens_q (host arrays), with the same keys packed (k, v,
    cu_seqlens_k) for the reference."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    cu_q = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    per = max(1, max(-(-n // page) for n in klens))
    pages = len(klens) * per + spare_pages
    q = rng.standard_normal((int(cu_q[-1]), heads, d)).astype(dt)
    kp, vp = (rng.standard_normal((pages, page, kv_heads, d)).astype(dt) for _ in range(2))
    shuffled = rng.permutation(pages)[: len(klens) * per].reshape(len(klens), per).astype(np.int32)
    table = shuffled if table is None else table
    used = np.asarray(klens, np.int32)
    rows = [(table[b, j // page], j % page) for b, n in enumerate(klens) for j in range(n)]
    k = np.stack([kp[s, r] for s, r in rows]) if rows else np.zeros((0, kv_heads, d), dt)
    v = np.stack([vp[s, r] for s, r in rows]) if rows else np.zeros((0, kv_heads, d), dt)
    cu_k = np.concatenate([[0], np.cumsum(klens)]).astype(np.int32)
    return dict(q=q, k=kp, v=vp, cu_seqlens_q=cu_q, seqused_k=used, block_table=table), (k, v, cu_k)


# ---------------------------------------------------------------- CPU: semantics, plan
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("features", [{}, {"window": (20, 3)}, {"softcap": 5.0}, {"sinks": "sinks"}])
def test_reference_reads_the_pages_as_the_packed_keys(causal, features):
    args, (k, v, cu_k) = _case()
    feats = {n: (np.linspace(-1, 1, 4).astype(np.float32) if x == "sinks" else x) for n, x in features.items()}
    out, lse = rawflash.forward(**args, causal=causal, backend="reference", **feats)
    want, want_lse = rawflash.forward(args["q"], k, v, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=cu_k,
                                      causal=causal, backend="reference", **feats)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_paged_forward_plans():
    """Pages of a power of two rows run FA3's TMA form (boxes of gcd(key block, page) rows, one page each); other
    page sizes the cp.async wgmma form (the mma.sync form at head dims it has no row for), where
    warp_specialize=True is refused by name; warp_specialize=False picks the cp.async form; any GPU but Hopper is
    refused."""
    from rawflash.kernels import tma

    p = Problem(4, 512, 4096, 32, 8, 128, "bfloat16", True, "sm_90", varlen=True, total_q=2048, total_k=8192,
                seqused_k=True, page_size=64)
    for page in (16, 64, 256):
        assert [lau.kernel for lau in forms.forward_plan(dataclasses.replace(p, page_size=page))][0] == "fa3_fwd_sm90"
    assert [tma.paged_box_rows(176, n) for n in (16, 64, 256)] == [16, 16, 16]
    assert [tma.paged_box_rows(128, n) for n in (16, 64, 256)] == [16, 64, 128]
    odd = dataclasses.replace(p, page_size=48)
    assert [lau.kernel for lau in forms.forward_plan(odd)] == ["fa2_fwd_sm90"]
    assert [lau.kernel for lau in forms.forward_plan(p, switches=forms.Switches(warp_specialize=False))] == [
        "fa2_fwd_sm90"]
    assert [lau.kernel for lau in forms.forward_plan(dataclasses.replace(odd, head_dim=96))] == ["fa2_fwd"]
    with pytest.raises(ValueError, match="a paged forward \\(block_table\\) needs an sm_90 GPU"):
        forms.forward_plan(dataclasses.replace(p, arch="sm_80"))
    with pytest.raises(ValueError, match="reads paged keys in pages of a power of two rows; got page_size 48"):
        forms.forward_plan(odd, switches=forms.Switches(warp_specialize=True))


def test_explain_paged_forward():
    """rawflash explain --varlen ... --page-size: the paged forward's plan (FA3's form) without a GPU; with
    the backward it is refused (backward takes no paged keys)."""
    import json

    from click.testing import CliRunner

    from rawflash.cli.commands import main

    base = ["explain", "--varlen", "100,700,30", "--page-size", "64", "--heads", "32", "--kv-heads", "8",
            "--head-dim", "128", "--dtype", "bfloat16", "--causal", "--gpu", "H100"]
    res = CliRunner().invoke(main, base + ["--direction", "fwd", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["valid"] and "block_table=table" in report["call"][0]
    assert [row["kernel"] for row in report["launches"]][0] == "fa3_fwd_sm90"
    assert "paged keys read by TMA in boxes of 64 rows" in report["launches"][0]["note"]
    small = CliRunner().invoke(main, [*base[:4], "16", *base[5:], "--direction", "fwd", "--json"])
    assert "paged keys read by TMA in boxes of 16 rows" in json.loads(small.output)["launches"][0]["note"]
    assert report["problem"]["paged"].startswith("keys in pages of 64 rows")
    res = CliRunner().invoke(main, base + ["--direction", "both"])
    assert res.exit_code == 2 and "backward takes no paged keys" in res.output


# ---------------------------------------------------------------- CPU: validation, one test per refused input
def _refused():
    def q4(a):  # fixed-length q: no packed queries
        a["q"] = a["q"][None]
        del a["cu_seqlens_q"]

    return [
        ("no cu_seqlens_q", q4, ValueError, "block_table \\(paged keys\\) goes with packed queries"),
        ("cu_seqlens_k", lambda a: a.update(cu_seqlens_k=np.array([0, 1, 2, 3, 4], np.int32)), ValueError,
         "cu_seqlens_k does not go with block_table"),
        ("no seqused_k", lambda a: a.update(seqused_k=None), ValueError, "block_table needs seqused_k"),
        ("table dtype", lambda a: a.update(block_table=a["block_table"].astype(np.int64)), TypeError,
         "block_table must have dtype int32"),
        ("table rows", lambda a: a.update(block_table=a["block_table"][:2]), ValueError,
         "block_table must have shape \\(batch, max_pages\\)"),
        ("page outside k", lambda a: a["block_table"].__setitem__((3, 0), 10_000), ValueError,
         "block_table\\[3\\] must name pages of k"),
        ("negative page", lambda a: a["block_table"].__setitem__((0, 1), -1), ValueError,
         "block_table\\[0\\] must name pages of k"),
        ("seqused_k past the pages", lambda a: a["seqused_k"].__setitem__(1, 10_000), ValueError,
         "seqused_k must be between 0 and each sequence's key count"),
        ("small pages", lambda a: a.update(k=a["k"][:, :8], v=a["v"][:, :8]), ValueError,
         "pages of at least 16 rows"),
        ("k and v shapes", lambda a: a.update(v=a["v"][:-1]), ValueError, "k and v must have the same shape"),
        ("k packed", lambda a: a.update(k=a["k"][0], v=a["v"][0]), ValueError, "k must have 4 dimensions"),
        ("numba", lambda a: a.update(backend="numba"), ValueError,
         "a paged forward \\(block_table\\) has no Numba twin"),
        ("fa1", lambda a: a.update(kernel="fa1"), ValueError, "kernel='fa1' does not support"),
        ("float32", lambda a: a.update(q=a["q"].astype(np.float32), k=a["k"].astype(np.float32),
                                       v=a["v"].astype(np.float32)), TypeError, "takes float16 or bfloat16"),
    ]


@pytest.mark.parametrize("name, edit, err, match", _refused(), ids=[r[0] for r in _refused()])
def test_refused_inputs(name, edit, err, match):
    args, _ = _case()
    args["backend"] = "reference"
    edit(args)
    with pytest.raises(err, match=match):
        rawflash.forward(**args, causal=True)


# ---------------------------------------------------------------- GPU: the kernels against the reference
def _gpu_check(args, packed, causal, dtype, feats=None, form="tma"):
    """The cupy call on ``args`` (host arrays) against the float64 reference on the packed keys: out and lse by
    flash-attn's rule. ``form``: "tma" the default form (FA3's for pages of a power of two rows), "cp_async" the
    threads' copies (the cp.async wgmma form; mma.sync at head dims it has no row for)."""
    import cupy

    feats = feats or {}
    dev = {n: cupy.asarray(x) for n, x in {**args, **feats}.items() if isinstance(x, np.ndarray)}
    out, lse = rawflash.forward(**{**args, **feats, **dev}, causal=causal, **_switches(form, args["q"].shape[-1]))
    _check_reference(args, packed, causal, dtype, out, lse, feats)


def _switches(form: str, d: int) -> dict:
    """The switches of a form (``_gpu_check``'s ``form``) at head_dim d."""
    return {} if form == "tma" else {"warp_specialize": False} if d % 64 == 0 else {"wgmma": False}


def _check_reference(args, packed, causal, dtype, out, lse, feats=None):
    """A paged call's out and lse (device arrays) against the float64 reference on its keys packed (``packed``)
    by flash-attn's rule."""
    feats = feats or {}
    k, v, cu_k = packed
    ref_args = dict(cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=cu_k, causal=causal, **feats)
    ref_out, ref_lse = reference.forward(args["q"], k, v, **ref_args)
    base_out, base_lse = reference.forward(args["q"], k, v, upcast=False, **ref_args)
    for what, got, ref, base_ in (("out", out, ref_out, base_out), ("lse", lse, ref_lse, base_lse)):
        ok, err, base, bound = reference.error_ratio_ok(got.get(), ref, base_, DTYPES[dtype], 2)
        assert ok, f"{what} error {err} > {bound} (plain {base})"


FORMS = ["tma", "cp_async"]  # FA3's TMA form (the default for these pages), the threads' copies


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d, heads, kv_heads", [(64, 4, 2), (128, 8, 1), (96, 4, 4), (256, 4, 2)])
def test_paged_forward_matches_the_reference(page, dtype, causal, d, heads, kv_heads, form):
    args, packed = _case(d=d, heads=heads, kv_heads=kv_heads, page=page, dtype=dtype, klens=(40, 7, 300, 257),
                         qlens=(5, 0, 133, 257))
    _gpu_check(args, packed, causal, dtype, form=form)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [48, 80])
def test_paged_forward_other_page_sizes(page):
    """Pages that are no power of two rows: the cp.async form, chosen by default."""
    args, packed = _case(d=128, heads=8, kv_heads=2, page=page, klens=(40, 7, 300, 257), qlens=(5, 0, 133, 257))
    _gpu_check(args, packed, True, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page", [16, 64])
def test_paged_forward_ignores_nan_past_the_keys(page, causal, form):
    """A cache's rows past each sequence's keys (the rest of its last page) and pages no sequence names hold NaN,
    as a cache may before anything is written there: the results equal the reference on the keys alone."""
    args, packed = _case(d=128, heads=8, kv_heads=2, page=page, klens=(40, 7, 300, 257), qlens=(5, 3, 133, 257),
                         spare_pages=4)
    table, used = args["block_table"], args["seqused_k"]
    for name in ("k", "v"):
        x = args[name]
        named = np.zeros(x.shape[0], bool)
        for b, n in enumerate(used):
            pages = -(-int(n) // page)
            named[table[b, :pages]] = True
            if n % page:
                x[table[b, pages - 1], n % page:] = np.nan
            x[table[b, pages:]] = np.nan
        x[~named] = np.nan
    _gpu_check(args, packed, causal, "bfloat16", form=form)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "alibi"])
def test_paged_forward_features(feature, causal):
    args, packed = _case(d=128, heads=8, kv_heads=2, page=64, dtype="bfloat16", klens=(100, 1, 513, 64),
                         qlens=(30, 1, 200, 64))
    feats = {"window": {"window": (64, 8)}, "softcap": {"softcap": 20.0},
             "sinks": {"sinks": np.linspace(-2, 2, 8).astype(np.float32)},
             "alibi": {"alibi_slopes": (2.0 ** -np.arange(1, 9)).astype(np.float32)}}[feature]
    _gpu_check(args, packed, causal, "bfloat16", feats)
    _gpu_check(args, packed, causal, "bfloat16", feats, form="cp_async")


# ---------------------------------------------------------------- GPU: the plan cache
PLANNED = dict(d=128, heads=8, kv_heads=2, klens=(40, 7, 300, 257), qlens=(5, 0, 133, 257))
PLANNED_FORMS = [(64, "fa3_fwd_sm90"), (48, "fa2_fwd_sm90")]  # FA3's TMA form, the cp.async form (by default)


def _on_device(args: dict) -> dict:
    import cupy

    return {n: cupy.asarray(x) for n, x in args.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("page, kernel", PLANNED_FORMS)
def test_repeated_paged_calls_run_their_plan(page, kernel):
    """The first paged call plans; a call with the same table, lengths and offsets in new arrays (other q, k, v
    values) runs that plan, and reads the new arrays: the first call's are overwritten before it (NaN queries and
    keys, a table of page 0, no keys, empty sequences), so an address the plan did not rewrite gives a wrong
    answer."""
    from rawflash import api

    args, packed = _case(**PLANNED, page=page)
    again, packed_again = _case(**PLANNED, page=page, seed=1, table=args["block_table"])
    rawflash.clear_cache()
    first = _on_device(args)
    out, lse = rawflash.forward(**first, causal=True)
    _check_reference(args, packed, True, "bfloat16", out, lse)
    assert (len(api.PLANS), api.PLANS.hits) == (1, 0)
    (call, _), = api.PLANS._plans.values()
    assert any(launch.name.startswith(kernel + "<") for launch in call.plan.launches)
    for name, value in (("q", np.nan), ("k", np.nan), ("v", np.nan), ("block_table", 0), ("seqused_k", 0),
                        ("cu_seqlens_q", 0)):
        first[name].set(np.full(first[name].shape, value, args[name].dtype))
    out, lse = rawflash.forward(**_on_device(again), causal=True)
    assert (len(api.PLANS), api.PLANS.hits) == (1, 1)
    _check_reference(again, packed_again, True, "bfloat16", out, lse)


@pytest.mark.gpu
def test_a_bad_table_after_a_planned_one_is_refused():
    """A planned call's table given again with a used entry outside the pool (the same array, changed in place:
    the same key) hits the plan and is refused by the value checks before anything is launched (``out`` keeps
    what it held); the good values then run the plan again."""
    import cupy

    from rawflash import api

    args, packed = _case(**PLANNED, page=64)
    rawflash.clear_cache()
    dev = _on_device(args)
    out = cupy.empty(args["q"].shape, args["q"].dtype)
    rawflash.forward(**dev, causal=True, out=out)
    sentinel = cupy.asarray(np.full(args["q"].shape, 7, args["q"].dtype))
    out[...] = sentinel
    dev["block_table"][2, 1] = args["k"].shape[0]  # one past the pool; sequence 2's 300 keys use 5 pages of 64
    with pytest.raises(ValueError, match=r"block_table\[2\] must name pages of k"):
        rawflash.forward(**dev, causal=True, out=out)
    assert (len(api.PLANS), api.PLANS.hits) == (1, 1), "the refused call was a hit"
    cupy.cuda.get_current_stream().synchronize()
    assert bool(cupy.all(out.view(cupy.uint16) == sentinel.view(cupy.uint16))), "nothing launched"
    dev["block_table"][2, 1] = int(args["block_table"][2, 1])
    res, lse = rawflash.forward(**dev, causal=True, out=out)
    assert (len(api.PLANS), api.PLANS.hits) == (1, 2)
    _check_reference(args, packed, True, "bfloat16", res, lse)


# Each call's lengths (queries, keys) in a chunked-prefill loop: new values, the same totals of queries (the
# packed q's rows) and the same longest sequences (257 queries, 300 keys), so the same maxima and page tables of
# one width.
NEW_LENGTHS = [((5, 0, 133, 257), (40, 7, 300, 257)), ((257, 133, 5, 0), (300, 1, 64, 299)),
               ((100, 38, 257, 0), (0, 128, 300, 17)), ((0, 257, 1, 137), (300, 300, 2, 250))]


def test_new_lengths_cases_share_layouts_and_maxima():
    """NEW_LENGTHS' calls differ in their values only: the same array shapes and maxima (so one plan key)."""
    from rawflash import validation

    for page, _ in PLANNED_FORMS:
        seen = set()
        for qlens, klens in NEW_LENGTHS:
            args, _ = _case(d=128, heads=8, kv_heads=2, qlens=qlens, klens=klens, page=page)
            values = validation.read_values(args["cu_seqlens_q"], None, args["seqused_k"], args["block_table"])
            seen.add((tuple((n, x.shape) for n, x in args.items()), validation.maxima(values, None, None)))
        assert len(seen) == 1, seen


@pytest.mark.gpu
@pytest.mark.parametrize("page, kernel", PLANNED_FORMS)
def test_new_lengths_each_call_run_one_plan(page, kernel):
    """A loop of paged calls with new seqused_k, cu_seqlens_q and page tables every call (same layouts, same
    maxima) makes one plan: the first call plans, every later one hits it, and each result is its own lengths'
    (the float64 reference on its keys, by flash-attn's rule)."""
    from rawflash import api

    rawflash.clear_cache()
    for i, (qlens, klens) in enumerate(NEW_LENGTHS):
        args, packed = _case(d=128, heads=8, kv_heads=2, qlens=qlens, klens=klens, page=page, seed=10 + i)
        out, lse = rawflash.forward(**_on_device(args), causal=True)
        assert (len(api.PLANS), api.PLANS.hits) == (1, i), "one plan, every later call a hit"
        _check_reference(args, packed, True, "bfloat16", out, lse)
    (call, _), = api.PLANS._plans.values()
    assert any(launch.name.startswith(kernel + "<") for launch in call.plan.launches)


@pytest.mark.gpu
def test_paged_prefill_then_decode_equals_contiguous():
    """Chunked prefill into a paged cache, then decode steps appending to the same pages: the outputs equal the
    same steps on a contiguous cache (both through rawflash; the prefill's keys are already in the pages)."""
    import cupy

    rng = np.random.default_rng(5)
    b, hq, hk, d, page, cap = 3, 8, 2, 128, 16, 96
    lens = np.array([40, 17, 64], np.int32)
    bf16 = DTYPES["bfloat16"]
    kc = rng.standard_normal((b, cap, hk, d)).astype(bf16)
    vc = rng.standard_normal((b, cap, hk, d)).astype(bf16)
    per = cap // page
    table = rng.permutation(b * per).reshape(b, per).astype(np.int32)
    kp, vp = np.zeros((b * per, page, hk, d), bf16), np.zeros((b * per, page, hk, d), bf16)
    for s in range(b):
        for j in range(per):
            kp[table[s, j]], vp[table[s, j]] = kc[s, j * page:(j + 1) * page], vc[s, j * page:(j + 1) * page]
    cu_q = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(bf16)
    host = dict(q=q, kp=kp, vp=vp, kc=kc, vc=vc, table=table, cu_q=cu_q, lens=lens)
    g = {n: cupy.asarray(x) for n, x in host.items()}
    paged, _ = rawflash.forward(g["q"], g["kp"], g["vp"], cu_seqlens_q=g["cu_q"], seqused_k=g["lens"],
                                block_table=g["table"], causal=True)
    dense_k = cupy.concatenate([g["kc"][s, :int(lens[s])] for s in range(b)])
    dense_v = cupy.concatenate([g["vc"][s, :int(lens[s])] for s in range(b)])
    contiguous, _ = rawflash.forward(g["q"], dense_k, dense_v, cu_seqlens_q=g["cu_q"], cu_seqlens_k=g["cu_q"],
                                     causal=True, warp_specialize=False)
    np.testing.assert_allclose(paged.get().astype(np.float32), contiguous.get().astype(np.float32), rtol=0,
                               atol=1e-2)
    seq = cupy.asarray(lens)
    for step in range(3):
        q1 = cupy.asarray(rng.standard_normal((b, 1, hq, d)).astype(bf16))
        k1, v1 = (cupy.asarray(rng.standard_normal((b, 1, hk, d)).astype(bf16)) for _ in range(2))
        o_paged = rawflash.decode(q1, g["kp"], g["vp"], cache_seqlens=seq, k_new=k1, v_new=v1, block_table=g["table"])
        o_cont = rawflash.decode(q1, g["kc"], g["vc"], cache_seqlens=seq, k_new=k1, v_new=v1)
        np.testing.assert_allclose(o_paged.get().astype(np.float32), o_cont.get().astype(np.float32), rtol=0,
                                   atol=1e-2)
        seq += 1


def test_bench_paged_cases():
    """rawflash bench --paged: the issue's shape (16 sequences of 256 - 8192 tokens, GQA 32/8, d = 128) in pages of
    64 and of 16; without a GPU the command says so and exits 1."""
    from click.testing import CliRunner

    from conftest import gpu_available
    from rawflash.cli import bench_paged
    from rawflash.cli.commands import main

    cases = bench_paged.paged_cases()
    assert [c.page for c in cases] == [64, 16]
    for c in cases:
        assert len(c.lengths) == 16 and min(c.lengths) == 256 and max(c.lengths) == 8192
        assert all(n % 64 == 0 for n in c.lengths) and list(c.lengths) == sorted(c.lengths)
    assert (bench_paged.HEADS, bench_paged.KV_HEADS, bench_paged.HEAD_DIM) == (32, 8, 128)
    if not gpu_available():
        res = CliRunner().invoke(main, ["bench", "--paged"])
        assert res.exit_code == 1 and "needs a CUDA GPU" in res.output


def test_bench_paged_new_lengths_each_call():
    """The new-lengths rows' seqused_k: no two calls alike and none the full lengths (which the repeated rows
    plan), the longest sequence whole (so every call has the maxima of the first, whose plan it runs, its values
    checked); each sequence keeps all but fewer than MAX_TRIM of its keys, and none goes below 0 (the reduced
    validation case has a one-key sequence)."""
    import itertools

    from rawflash.cli import bench_paged

    lengths = np.asarray(bench_paged.paged_cases()[0].lengths)
    calls = [tuple(u) for u in itertools.islice(bench_paged.lengths_each_call(lengths), 5000)]
    assert len(set(calls)) == len(calls) and tuple(lengths) not in calls
    used = np.asarray(calls)
    assert (used <= lengths).all() and (used > lengths - bench_paged.MAX_TRIM).all()
    assert (used.max(axis=1) == lengths.max()).all()
    reduced = list(itertools.islice(bench_paged.lengths_each_call(bench_paged.REDUCED), 3))
    assert len({tuple(u) for u in reduced}) == 3 and all((u >= 0).all() and u.dtype == np.int32 for u in reduced)


def test_bench_paged_compares_rows_of_a_kind():
    """A paged row's "x contiguous" is against the contiguous row of its kind (repeated or new lengths); a
    new-lengths row gets its ms over the repeated-lengths row of the same call; invalid rows get nothing."""
    from rawflash.cli import bench_paged

    new = bench_paged.NEW_LENGTHS
    by = {"rawflash paged 64": 2.5, "rawflash paged 64 cp.async": 4.0, "rawflash contiguous": 2.4,
          "rawflash contiguous cp.async": 3.6, "rawflash paged 64" + new: 3.0, "rawflash contiguous" + new: 2.8}
    rows = [{"impl": impl} for impl in by] + [{"impl": "rawflash paged 16" + new, "status": "invalid: ..."}]
    bench_paged.compare(rows, by)
    got = {r["impl"]: {n: x for n, x in r.items() if n != "impl"} for r in rows}
    assert got["rawflash paged 64"] == {"x contiguous": 0.96, "x contiguous cp.async": 1.44}
    assert got["rawflash paged 64" + new] == {"x contiguous": 0.933, "ms over repeated lengths": 0.5}
    assert got["rawflash contiguous" + new] == {"ms over repeated lengths": 0.4}
    assert got["rawflash contiguous"] == {} and got["rawflash paged 16" + new] == {"status": "invalid: ..."}


def test_tune_paged_times_the_paged_row():
    """tools/tune_paged.py, which measures configs.PAGED_ROWS, has that row and the table's among its candidates."""
    import importlib.util
    from pathlib import Path

    from rawflash.kernels import configs

    path = Path(__file__).resolve().parents[1] / "tools" / "tune_paged.py"
    spec = importlib.util.spec_from_file_location("tune_paged", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = [(r.br, r.bc, r.stages, r.q_stages) for r in tool.CANDIDATES.values()]
    paged = configs.PAGED_ROWS[tool.KEY]
    table = configs.TABLE[tool.KEY]
    assert (paged.br, paged.bc, paged.stages, paged.q_stages) in rows
    assert (table.br, table.bc, table.stages, table.q_stages) in rows
