"""rawflash.decode with float8_e4m3fn KV caches: descales per tensor or per (sequence, kv head), appends quantised.

CPU tests check the semantics (the reference reads ``K8 * k_descale`` and quantises appends as
``reference.cache_quantize`` says), ``fp8.quantize_cache``, the validation (one test per refused input) and
``rawflash explain --decode --fp8-cache``. GPU tests check the kernels against the float64 reference of the same FP8
cache by flash-attn's rule (2x the error of a plain implementation that dequantises to q's dtype, plus a floor) over
ragged lengths, page sizes 16 - 256, appends across page boundaries, GQA / MQA, several query rows, both 16-bit
query dtypes, the head dims with a row, every feature, both descale granularities and none; the caches after the call
must hold exactly the quantised appended rows. The accuracy against the 16-bit cache the FP8 one was made from is
what ``tools/fp8_cache_accuracy.py`` reports (README).
"""
from __future__ import annotations

import numpy as np
import pytest

import rawflash
from rawflash import fp8, reference
from rawflash.kernels import configs, forms, launch
from rawflash.problem import Problem
from test_decode import _case

E4M3 = reference.E4M3


def _fp8_case(granularity="head", **kw):
    """_case's arrays with the caches quantised (``granularity`` "head", "tensor" or None: no descales)."""
    args, opts = _case(**kw)
    batch = len(args["cache_seqlens"]) if args["block_table"] is not None else None
    for name, ds in (("k_cache", "k_descale"), ("v_cache", "v_descale")):
        x8, d = fp8.quantize_cache(args[name], granularity or "tensor", batch=batch)
        args[name] = x8
        if granularity is not None:
            opts[ds] = d
    return args, opts


# ---------------------------------------------------------------- CPU: semantics, helpers, validation
def test_cache_quantize_divides_in_float32_rounds_to_nearest_and_saturates():
    x = np.array([1.0, 1.0625, 1.1875, -300.0, 10000.0, -10000.0, 0.0], np.float32).reshape(1, 7, 1, 1)
    got = reference.cache_quantize(x, np.array([2.0], np.float32)).astype(np.float64).ravel()
    # x / 2 = 0.5, 0.53125 (a tie between 0.5 and 0.5625: to even, 0.5), 0.59375 (to 0.5625 or 0.625: 0.625 is
    # even), -150 (between -144 and -160: the nearer), 5000 and -5000 saturate at +-448
    np.testing.assert_array_equal(got, [0.5, 0.5, 0.625, -144.0, 448.0, -448.0, 0.0])
    per = reference.cache_quantize(np.ones((2, 3, 2, 4), np.float32), np.array([[1, 2], [4, 8]], np.float32))
    np.testing.assert_array_equal(per.astype(np.float64)[:, 0, :, 0], [[1, 0.5], [0.25, 0.125]])


def test_reference_reads_the_dequantised_cache_and_quantised_appends():
    """decode on an FP8 cache equals decode on the float64 cache K8 * k_descale with the appended rows quantised
    then dequantised the same way."""
    args, opts = _fp8_case(d=64, page=16, new=3, lens=(40, 0, 17))
    kd, vd = opts.pop("k_descale"), opts.pop("v_descale")
    got = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], k_new=args["k_new"],
                           v_new=args["v_new"], block_table=args["block_table"], k_descale=kd, v_descale=vd)
    kd_row = kd[:1][:, None, :, None]  # (paged "head": one value per kv head, equal rows)
    vd_row = vd[:1][:, None, :, None]
    want = reference.decode(args["q"], args["k_cache"].astype(np.float64) * kd_row,
                            args["v_cache"].astype(np.float64) * vd_row, args["cache_seqlens"],
                            k_new=reference.cache_quantize(args["k_new"], kd).astype(np.float64) * kd_row,
                            v_new=reference.cache_quantize(args["v_new"], vd).astype(np.float64) * vd_row,
                            block_table=args["block_table"])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_api_reference_appends_quantised_rows_in_place():
    args, opts = _fp8_case(d=128, new=2, lens=(5, 0, 30))
    before = args["k_cache"].copy()
    rawflash.decode(**args, **opts, backend="reference")
    kc, _ = reference.append_kv(before, before, args["cache_seqlens"],
                                reference.cache_quantize(args["k_new"], opts["k_descale"]),
                                reference.cache_quantize(args["v_new"], opts["v_descale"]))
    np.testing.assert_array_equal(args["k_cache"].view(np.uint8), kc.view(np.uint8))
    assert not np.array_equal(args["k_cache"].view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("granularity, shape", [("head", (3, 2)), ("tensor", (1,))])
def test_quantize_cache_contiguous(granularity, shape):
    args, _ = _case(d=64, dtype="bfloat16")
    x8, d = fp8.quantize_cache(args["k_cache"], granularity)
    assert x8.dtype == E4M3 and x8.shape == args["k_cache"].shape and d.shape == shape and d.dtype == np.float32
    mags = np.abs(x8.astype(np.float32))
    amax = mags.max(axis=(1, 3)) if granularity == "head" else mags.max()
    np.testing.assert_array_equal(amax, 448.0)  # each granule's largest magnitude becomes 448
    err = np.abs(fp8.dequantize(x8, d) - args["k_cache"].astype(np.float64)).max()
    assert err <= np.abs(args["k_cache"].astype(np.float64)).max() / 16  # e4m3: 3 mantissa bits


def test_quantize_cache_paged_takes_one_descale_per_kv_head_for_every_sequence():
    args, _ = _case(d=64, dtype="float16", page=16)
    x8, d = fp8.quantize_cache(args["k_cache"], "head", batch=3)
    assert d.shape == (3, 2) and np.all(d == d[:1])
    amax = np.abs(args["k_cache"].astype(np.float64)).max(axis=(0, 1, 3))
    np.testing.assert_allclose(d[0], amax / 448.0, rtol=1e-6)
    for bad, match in ((dict(granularity="row"), "granularity must be one of"), (dict(batch=0), "batch must be"),
                       (dict(batch=True), "batch must be")):
        with pytest.raises(ValueError, match=match):
            fp8.quantize_cache(args["k_cache"], **{"granularity": "head", **bad})


def _refused(change, error, match):
    args, opts = _fp8_case(d=128)
    change(args, opts)
    with pytest.raises(error, match=match):
        rawflash.decode(**args, **opts, backend="reference")


BAD = [
    (lambda a, o: a.update(q=a["q"].astype(np.float32), k_new=None, v_new=None), TypeError,
     "a float8_e4m3fn cache goes with float16 or bfloat16 q"),
    (lambda a, o: a.update(v_cache=a["v_cache"].astype(np.float16)), TypeError,
     "v_cache must have k_cache's dtype float8_e4m3fn"),
    (lambda a, o: a.update(k_new=a["k_new"].astype(np.float32)), TypeError, "k_new must have q's dtype"),
    (lambda a, o: o.update(k_descale=o["k_descale"][:1]), ValueError, r"k_descale must have shape \(1,\) or \(3, 2\)"),
    (lambda a, o: o.update(v_descale=o["v_descale"].astype(np.float16)), TypeError,
     "v_descale must have dtype float32"),
    (lambda a, o: o.update(v_descale=np.ones(1, np.float32)), ValueError,
     "k_descale and v_descale must share one shape"),
    (lambda a, o: a.update(q=a["q"][..., :96], k_cache=a["k_cache"][..., :96], v_cache=a["v_cache"][..., :96],
                           k_new=a["k_new"][..., :96], v_new=a["v_new"][..., :96]), ValueError,
     "a float8_e4m3fn cache needs head_dim a multiple of 16 in 48 - 64 or 112 - 256"),
    (lambda a, o: a.update(q=a["q"][..., :120], k_cache=a["k_cache"][..., :120], v_cache=a["v_cache"][..., :120],
                           k_new=a["k_new"][..., :120], v_new=a["v_new"][..., :120]), ValueError,
     "got 120"),
]


@pytest.mark.parametrize("change,error,match", BAD, ids=[m[:40] for _, _, m in BAD])
def test_fp8_decode_refuses(change, error, match):
    _refused(change, error, match)


def test_descales_with_a_16bit_cache_and_the_numba_backend_are_refused():
    args, opts = _case(d=128)
    with pytest.raises(ValueError, match="k_descale goes with a float8_e4m3fn cache"):
        rawflash.decode(**args, k_descale=np.ones(1, np.float32), backend="reference")
    args, opts = _fp8_case(d=128)
    with pytest.raises(ValueError, match="float8_e4m3fn caches have no Numba twin"):
        rawflash.decode(**args, **opts, backend="numba")


def test_rawflash_jax_refuses_an_fp8_cache():
    pytest.importorskip("jax")
    from rawflash.jax import targets

    shapes = ((2, 1, 8, 128), (2, 64, 2, 128), (2, 64, 2, 128), (2,), None, None, None, None, None)
    dtypes = ("bfloat16", "float8_e4m3fn", "float8_e4m3fn", "int32", None, None, None, None, None)
    with pytest.raises(TypeError, match="rawflash.jax.decode reads 16-bit and float32 caches"):
        targets.check_decode(shapes, dtypes, (True, None, (-1, -1), 0.0))


@pytest.mark.parametrize("d, heads, br, bc, stages", [(64, 32, 16, 32, 4), (128, 32, 16, 16, 3), (192, 32, 16, 16, 4),
                                                     (256, 32, 16, 16, 3), (128, 256, 32, 16, 4)])
def test_fp8_rows_and_shared_memory(d, heads, br, bc, stages):
    """The FP8 rows keep as many bytes in flight per warp as the 16-bit ones or more (more stages); shared memory is
    the Q tile, one 128-byte line of row maxima and the e4m3 ring (mainloop_decode.cuh's SMEM_BYTES). 32 query
    heads per kv head take the many-rows row."""
    p = Problem(4, 1, 8192, heads, 8, d, "bfloat16", False, "sm_90", new_keys=1, kv_dtype=configs.FP8)
    lau = forms.decode_plan(p).split
    cfg = lau.config
    assert (cfg.br, cfg.bc, cfg.stages, cfg.warps) == (br, bc, stages, 4)
    assert lau.template_args[:2] == ("__nv_bfloat16", "rf::e4m3")
    assert lau.smem == br * d * 2 + 128 + 4 * stages * 2 * bc * d <= 232448
    assert launch.decode_append(p).template_args == ("__nv_bfloat16", "rf::e4m3")
    names = {x.name_expression for x in forms.all_instantiations("sm_90")}
    assert lau.name_expression in names and launch.decode_append(p).name_expression in names


def test_explain_decode_fp8_cache(tmp_path):
    from click.testing import CliRunner

    from rawflash.cli.commands import main

    args = ["explain", "--decode", "--fp8-cache", "--batch", "8", "--seqlen-k", "8192", "--heads", "32",
            "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    import json

    report = json.loads(res.output)
    split = next(r for r in report["launches"] if r["kernel"] == "decode_split")
    assert "rf::e4m3" in split["instantiation"] and "float8_e4m3fn cache" in report["problem"]["layout"]
    assert abs(report["split plan"]["cache MB read"] - 2 * 8 * 8193 * 8 * 128 / 1e6) < 0.1
    res = CliRunner().invoke(main, ["explain", "--fp8-cache", "--head-dim", "128"])
    assert res.exit_code == 2 and "--fp8-cache go with --decode" in res.output


# ---------------------------------------------------------------- GPU: the kernels against the reference
GPU_CASES = [
    ("gqa-d128", dict(d=128), {}),
    ("tensor-descale", dict(d=128), dict(granularity="tensor")),
    ("no-descale", dict(d=128), dict(granularity=None)),
    ("mha-d64", dict(h=4, hk=4, d=64), {}),
    ("mqa-d256", dict(h=8, hk=1, d=256), {}),
    ("d112", dict(d=112), {}),
    ("d192", dict(d=192, h=4, hk=4), {}),
    ("append-4-causal-sq4", dict(new=4, sq=4, d=128), dict(causal=True)),
    ("long", dict(lens=(4000, 17, 2500), d=128), {}),
    ("splits-33", dict(lens=(700, 1, 300), new=2, d=128), dict(num_splits=33)),
    ("page-16-crosses", dict(page=16, new=3, lens=(14, 0, 46), d=128), dict(num_splits=3)),
    ("page-64", dict(page=64, d=128, new=5, lens=(126, 60, 300)), dict(causal=True)),
    ("page-256-long", dict(page=256, d=128, lens=(3000, 255, 1)), {}),
    ("row-groups-append-kernel", dict(h=32, hk=1, d=128, new=2, page=16), {}),
    ("all-features-paged", dict(feats=("window", "softcap", "alibi", "sinks"), page=16, sq=2, new=2, d=128),
     dict(causal=True)),
]


def _run_gpu(args, opts, extra):
    import cupy

    dev = {n: None if x is None else (cupy.asarray(x.view(np.uint8)).view(x.dtype) if x.dtype == E4M3
                                      else cupy.asarray(x)) for n, x in args.items()}
    dev_opts = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
    out, lse = rawflash.decode(**dev, **dev_opts, **{"causal": False, **extra}, return_lse=True)
    return dev, cupy.asnumpy(out), cupy.asnumpy(lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,kw,extra", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_fp8_decode_gpu(name, kw, extra, dtype):
    import cupy

    extra = dict(extra)
    args, opts = _fp8_case(extra.pop("granularity", "head"), dtype=dtype, **kw)
    lens = args["cache_seqlens"]
    ref_args = dict(k_new=args["k_new"], v_new=args["v_new"], block_table=args["block_table"], **opts,
                    causal=extra.get("causal", False))
    ref_out, ref_lse = reference.decode(args["q"], args["k_cache"], args["v_cache"], lens, **ref_args)
    base_out, _ = reference.decode(args["q"], args["k_cache"], args["v_cache"], lens, upcast=False, **ref_args)
    dev, out, lse = _run_gpu(args, opts, extra)
    assert np.all(np.isfinite(out.astype(np.float64)))
    ok, err, base, bound = reference.error_ratio_ok(out, ref_out, base_out, dtype, 2.0)
    assert ok, f"max error {err:.3g} > {bound:.3g} (plain dequantised {dtype}: {base:.3g})"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=2e-3)
    new = [None, None] if args["k_new"] is None else [
        reference.cache_quantize(args[n], opts.get(d)) for n, d in (("k_new", "k_descale"), ("v_new", "v_descale"))]
    kc, vc = reference.append_kv(args["k_cache"], args["v_cache"], lens, *new, args["block_table"])
    np.testing.assert_array_equal(cupy.asnumpy(dev["k_cache"].view(cupy.uint8)), kc.view(np.uint8))
    np.testing.assert_array_equal(cupy.asnumpy(dev["v_cache"].view(cupy.uint8)), vc.view(np.uint8))


@pytest.mark.gpu
def test_fp8_decode_gpu_planned_calls_read_new_descales():
    """Calls of one signature hit the plan; new descale arrays (other addresses, other values) are read."""
    import cupy

    args, opts = _fp8_case(d=128, dtype="bfloat16", new=0)
    dev = {n: None if x is None else (cupy.asarray(x.view(np.uint8)).view(x.dtype) if x.dtype == E4M3
                                      else cupy.asarray(x)) for n, x in args.items()}
    for scale in (1.0, 0.5, 3.0):
        ds = {n: cupy.asarray(x * np.float32(scale)) for n, x in opts.items()}
        out = cupy.asnumpy(rawflash.decode(**dev, **ds, causal=False))
        ref, _ = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], causal=False,
                                  **{n: x * np.float32(scale) for n, x in opts.items()})
        base, _ = reference.decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], causal=False,
                                   upcast=False, **{n: x * np.float32(scale) for n, x in opts.items()})
        assert reference.error_ratio_ok(out, ref, base, "bfloat16", 2.0)[0], scale


def test_fp8_cache_needs_hopper():
    """An FP8 cache's rows and conversions are Hopper's: a plan for another GPU is refused by name, and no other
    arch instantiates the FP8 decode kernels (sm_80 has no e4m3 conversion)."""
    p = Problem(4, 1, 8192, 32, 8, 128, "bfloat16", False, "sm_80", new_keys=1, kv_dtype=configs.FP8)
    with pytest.raises(ValueError, match=r"float8_e4m3fn caches \(k_cache, v_cache\) need an sm_90 GPU"):
        forms.decode_plan(p)
    assert not any("e4m3" in x.name_expression for x in forms.all_instantiations("sm_80"))
