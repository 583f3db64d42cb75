"""The benchmark's case lists and ratio pairing (no GPU needed: nothing here times anything)."""
from __future__ import annotations

from rawflash.cli import bench, iomodel
from rawflash.kernels import forms


def test_feature_cases_are_the_targets_cases():
    cases = bench.feature_cases()
    names = [(c.name, c.direction) for c in cases]
    assert len(set(names)) == len(names), "one row per (case, direction): the ratios look cases up by name"
    window = next(c for c in cases if c.name == "window (1024, 0), N 16384")
    persistent = next(c for c in cases if c.name.endswith("persistent"))
    assert persistent.opts == window.opts and forms.Switches(**dict(persistent.switches)).persistent is True
    assert all(not c.switches for c in cases if c is not persistent), "every other case runs the defaults"


def test_feature_flops_count_visible_pairs_only():
    window = next(c for c in bench.feature_cases() if c.name == "window (1024, 0), N 16384")
    n, h, d = window.seqlen, window.heads, window.head_dim
    visible = sum(min(i + 1, 1025) for i in range(n))  # query i sees keys i - 1024 .. i
    assert window.flops == 4 * h * d * visible
    dense = iomodel.flops(iomodel.Shape(1, n, n, h, h, d, 2, True), "fwd")
    assert window.flops < dense / 7, "a 1024-key window over 16384 keys is about a sixteenth of causal's pairs"


def test_varlen_lengths_are_fixed_and_in_range():
    lengths = bench.varlen_lengths()
    assert lengths == bench.varlen_lengths() and len(lengths) == 16
    assert all(256 <= n <= 8192 for n in lengths) and len(set(lengths)) > 8


def test_feature_ratios_pair_each_case_with_its_target():
    rows = [{"case": c.name, "direction": c.direction, "dtype": c.dtype, "kernel_tflops": 100.0 + i}
            for i, c in enumerate(bench.feature_cases())]
    out = {(r["case"], r["direction"]): r for r in bench._feature_ratios(rows)}
    assert out[("window (1024, 0), N 16384, persistent", "fwd")]["vs"] == "dense causal, N 2048"
    assert out[("varlen x16 causal", "fwd")]["vs"].endswith("causal")
    assert out[("varlen x16", "bwd")]["vs"] == out[("varlen x16", "fwd")]["vs"]  # (each direction its own row)
    assert out[("varlen x16", "bwd")]["kernel_tflops"] != out[("varlen x16", "fwd")]["kernel_tflops"]
    varlen_bwd = out[("varlen x16", "bwd")]
    equal_bwd = out[(varlen_bwd["vs"], "bwd")]
    assert varlen_bwd["ratio (kernels)"] == varlen_bwd["kernel_tflops"] / equal_bwd["kernel_tflops"]
    assert out[("window (1024, 0), N 16384", "bwd")]["ratio (kernels)"] == (
        out[("window (1024, 0), N 16384", "bwd")]["kernel_tflops"]
        / out[("dense causal, N 2048", "bwd")]["kernel_tflops"])
    assert out[("softcap 30, N 4096", "bwd")]["vs"] == "plain, N 4096"
    assert "vs" not in out[("plain, N 4096", "fwd")]


def test_fp8_feature_cases_are_the_forwards_it_supports():
    bf16 = {c.name: c for c in bench.feature_cases() if c.direction == "fwd"}
    fp8 = bench.feature_cases(dtype=bench.FP8)
    assert fp8 and all(c.dtype == bench.FP8 and c.direction == "fwd" and not c.switches for c in fp8)
    names = {c.name for c in fp8}
    assert not any(n.startswith(("softcap", "alibi")) for n in names), "the FP8 forward refuses those"
    assert names == {n for n, c in bf16.items() if not c.switches and not n.startswith(("softcap", "alibi"))}
    for c in fp8:  # the same shapes and options as bf16's row of that name
        assert bench.dataclasses.replace(c, dtype="bfloat16") == bf16[c.name]


def test_fp8_feature_rows_are_compared_within_fp8_and_with_bfloat16():
    cases = bench.feature_cases() + bench.feature_cases(dtype=bench.FP8)
    rows = [{"case": c.name, "direction": c.direction, "dtype": c.dtype,
             "kernel_tflops": (200.0 if c.dtype == bench.FP8 else 100.0) + i} for i, c in enumerate(cases)]
    out = {(r["case"], r["direction"], r["dtype"]): r for r in bench._feature_ratios(rows)}
    w8, d8 = out[("window (1024, 0), N 16384", "fwd", bench.FP8)], out[("dense causal, N 2048", "fwd", bench.FP8)]
    assert w8["ratio (kernels)"] == w8["kernel_tflops"] / d8["kernel_tflops"], "FP8 against FP8's own dense row"
    wb = out[("window (1024, 0), N 16384", "fwd", "bfloat16")]
    assert w8["x bfloat16 (kernels)"] == w8["kernel_tflops"] / wb["kernel_tflops"]
    assert "x bfloat16 (kernels)" not in wb
    s8 = out[("sinks, N 4096", "fwd", bench.FP8)]
    assert s8["vs"] == "plain, N 4096" and s8["ratio (kernels)"] == s8["kernel_tflops"] / out[
        ("plain, N 4096", "fwd", bench.FP8)]["kernel_tflops"]


def test_fp8_cases_are_rawflash_forwards_only():
    cases = bench.sweep_cases(bench.IMPLS, ("fwd", "bwd"), ("bfloat16", bench.FP8), (128,), (4096,), (False,))
    fp8 = [c for c in cases if c.dtype == bench.FP8]
    assert [(c.impl, c.direction) for c in fp8] == [("rawflash-fa2", "fwd")]
    assert any(c.dtype == "bfloat16" and c.impl == "rawflash-fa2" and c.direction == "fwd" for c in cases)


def test_fp8_rows_are_compared_with_bfloat16():
    shape = dict(direction="fwd", batch=4, heads=16, kv_heads=16, seqlen=4096, head_dim=128, causal=False)
    bf = bench.Record(impl="rawflash-fa2", dtype="bfloat16", ms=2.0, tflops=600.0, kernel_ms=2.0, **shape)
    f8 = bench.Record(impl="rawflash-fa2", dtype=bench.FP8, ms=1.0, tflops=900.0, kernel_ms=1.0, **shape)
    row = next(r for r in bench.ratios([bf, f8]) if r["dtype"] == bench.FP8)
    assert row["x rawflash-fa2 bfloat16"] == 1.5 and row["kernels x rawflash-fa2 bfloat16"] == 2.0


def test_bench_takes_the_fp8_dtype():
    from click.testing import CliRunner

    from rawflash.cli import commands, sysinfo

    result = CliRunner().invoke(commands.main, ["bench", "--dtype", "float8_e4m3fn", "--head-dims", "128"])
    if not sysinfo.gpu_available():
        assert result.exit_code != 2 or "Invalid value" not in result.output, result.output
        assert "GPU" in result.output


def test_deterministic_backward_rows_only_when_asked():
    """rawflash-fa2-det (the backward with deterministic=True) is opt-in: --deterministic adds it beside the
    default rows, backward only, on the same shapes, and its ratio row reads deterministic over default."""
    available = list(bench.IMPLS)
    assert "rawflash-fa2-det" not in bench.default_impls(available)
    with_det = bench.default_impls(available, deterministic=True)
    assert "rawflash-fa2-det" in with_det and (set(with_det) - {"rawflash-fa2-det"}
                                               == set(bench.default_impls(available)))
    cases = bench.sweep_cases(["rawflash-fa2", "rawflash-fa2-det"], ("fwd", "bwd"), ("bfloat16",), (64, 128),
                              (2048, 4096), (False, True))
    det = [c for c in cases if c.impl == "rawflash-fa2-det"]
    default_bwd = [c for c in cases if c.impl == "rawflash-fa2" and c.direction == "bwd"]
    assert det and all(c.direction == "bwd" for c in det)
    strip = lambda c: (c.dtype, c.batch, c.heads, c.kv_heads, c.seqlen, c.head_dim, c.causal)  # noqa: E731
    assert [strip(c) for c in det] == [strip(c) for c in default_bwd]
    records = [bench.Record.of(c, 2.0 if c.impl == "rawflash-fa2-det" else 1.6) for c in default_bwd + det]
    rows = bench.ratios(records, "rawflash-fa2-det")
    assert len(rows) == len(det) and all(abs(r["x rawflash-fa2"] - 0.8) < 1e-12 for r in rows)
