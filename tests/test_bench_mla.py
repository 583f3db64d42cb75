"""``rawflash bench --mla`` without a GPU: its cases, its FLOP counts against a hand count, the shared rule that
validates it (and that it fails a wrong result), the summary's pairing, and the command's wiring. Its speed is the
bench's to show on a GPU, not a test's."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import rawflash
from conftest import gpu_available
from rawflash import reference
from rawflash.cli import bench, bench_mla, commands, iomodel

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_cases_are_deepseek_v3_prefill():
    cases = bench_mla.mla_cases()
    assert len(cases) == len(set(cases)) == 2 * 2 * 3 * 2  # impl x direction x N x causal
    assert {c.impl for c in cases} == {"rawflash-fa2", "torch-cudnn"}
    for c in cases:
        assert (c.heads, c.kv_heads, c.head_dim, c.dv, c.dtype) == (128, 128, 192, 128, "bfloat16")
        assert c.batch == max(1, 16384 // c.seqlen) and c.batch * c.seqlen == 16384
    assert sorted({(c.seqlen, c.batch) for c in cases}) == [(4096, 4), (8192, 2), (16384, 1)]
    assert {(c.direction, c.causal) for c in cases} == {("fwd", False), ("fwd", True), ("bwd", False), ("bwd", True)}


def test_reduced_cases_keep_the_kind_and_shrink_the_shape():
    case = bench_mla.mla_cases()[-1]
    small = bench_mla.reduced_cases(case)
    assert [c.seqlen for c in small] == [512, 700]
    for c in small:
        assert (c.batch, c.heads, c.kv_heads) == (1, 8, 8)
        assert (c.impl, c.direction, c.causal, c.head_dim, c.dv) == (case.impl, case.direction, case.causal, 192, 128)


@pytest.mark.parametrize("causal", [False, True])
def test_flops_hand_count(causal):
    b, h, n, dqk, dv = 4, 128, 4096, 192, 128
    half = 2 if causal else 1
    per_head = {"fwd": 2 * n * n * dqk + 2 * n * n * dv,  # S = QK^T, then PV
                "bwd": 2 * n * n * dqk + 2 * n * n * dv + 2 * n * n * dv + 2 * n * n * dqk + 2 * n * n * dqk}
    for direction, count in per_head.items():
        case = bench.Case("rawflash-fa2", direction, "bfloat16", b, h, h, n, dqk, causal, head_dim_v=dv)
        assert case.flops == b * h * count / half
        rec = bench.Record.of(case, 2.0, kernel_ms=2.0)
        assert rec.tflops == rec.kernel_tflops == case.flops / 2e-3 / 1e12, "the kernels' figure counts dv too"


@pytest.mark.parametrize("causal", [False, True])
def test_equal_head_dims_give_the_standard_counts(causal):
    """With dv = dqk: 4 N^2 d forward, 2.5x that backward (the FA2 paper's convention), as without head_dim_v."""
    n, d = 1000, 128
    same = iomodel.Shape(2, n, n, 3, 3, d, causal=causal, head_dim_v=d)
    plain = iomodel.Shape(2, n, n, 3, 3, d, causal=causal)
    forward = 4 * 2 * 3 * n * n * d // (2 if causal else 1)
    assert iomodel.flops(same, "fwd") == iomodel.flops(plain, "fwd") == forward
    assert iomodel.flops(same, "bwd") == iomodel.flops(plain, "bwd") == forward * 5 // 2
    ragged = iomodel.Shape(1, 300, 500, 2, 2, 64, causal=True, head_dim_v=32)  # the exact visible pairs
    assert iomodel.flops(ragged, "fwd") == 2 * 2 * (64 + 32) * iomodel.visible_pairs(300, 500, True)


def _inputs(n=96, h=2, dqk=24, dv=16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, n, h, d)).astype(BF16) for d in (dqk, dqk, dv, dv))


def test_rule_verdict_is_flash_attns_rule():
    """bench.rule_verdict gives error_ratio_ok's verdict on each tensor (factor 2 forward, 3 backward), names the
    first that fails, and fails a wrong result."""
    q, k, v, dout = _inputs()
    ref = reference.forward(q, k, v, causal=True)[0]
    base = reference.forward(q, k, v, causal=True, upcast=False)[0]
    bad = ref.copy()
    bad[0, 50, 1, 3] += 0.25
    nan = ref.copy()
    nan[0, 0, 0, 0] = np.nan
    verdicts = []
    for got in (ref.astype(BF16), base, bad, nan):
        ok, why = bench.rule_verdict(got, q, k, v, causal=True)
        want, err, _, bound = reference.error_ratio_ok(got, ref, base, q.dtype, 2)
        assert ok == want and (why == "ok" if ok else why == f"out error {err:.3g} > {bound:.3g}")
        verdicts.append(ok)
    assert verdicts == [True, True, False, False]
    refs = reference.backward(dout, q, k, v, causal=False)
    bases = reference.backward(dout, q, k, v, causal=False, upcast=False)
    assert bench.rule_verdict([g.astype(BF16) for g in refs], q, k, v, dout) == (True, "ok")
    wrong = [g.astype(BF16) for g in refs]
    wrong[1] = (refs[1] * 1.05).astype(BF16)
    ok, why = bench.rule_verdict(wrong, q, k, v, dout)
    _, err, _, bound = reference.error_ratio_ok(wrong[1], refs[1], bases[1], q.dtype, 3)
    assert not ok and why == f"dk error {err:.3g} > {bound:.3g}"


def _host_check(wrong_at: int | None):
    """A check as ``bench.check_case`` is on a GPU, run on the host: the reference backend's forward (dv != dqk),
    rounded to bf16 as a kernel stores it, graded by the shared rule; ``wrong_at``: the N whose result is off."""
    def check(small):
        q, k, v, _ = _inputs(small.seqlen, small.heads, small.head_dim, small.dv)
        out = rawflash.forward(q, k, v, causal=small.causal, backend="reference")[0]
        if small.seqlen == wrong_at:
            out = (out.astype(np.float32) * 1.02).astype(BF16)
        return bench.rule_verdict(out, q, k, v, causal=small.causal)

    return check


def test_the_validation_can_fail(monkeypatch):
    monkeypatch.setattr(bench_mla, "REDUCED_HEADS", 1)  # the reduced N (512, 700) and head dims, one head: fast
    case = next(c for c in bench_mla.mla_cases() if c.direction == "fwd" and c.causal)
    assert bench_mla.validate(case, _host_check(None)) == (True, "ok")
    ok, why = bench_mla.validate(case, _host_check(700))
    assert not ok and why.startswith("N 700: out error")
    assert bench_mla.verdict(case, _host_check(512)).startswith("invalid: N 512: out error")

    def raises(_):
        raise RuntimeError("No available kernel. Aborting execution.\nmore")

    assert bench_mla.verdict(case, raises) == "refused: RuntimeError: No available kernel. Aborting execution."


def test_the_peer_is_reported_when_pytorch_is_missing(monkeypatch):
    monkeypatch.setattr(bench, "_torch", lambda: None)
    peer = next(c for c in bench_mla.mla_cases() if c.impl == "torch-cudnn")
    rec = bench_mla.run_case(peer, 3, {})
    assert rec.ms is None and rec.tflops is None
    assert rec.status == "not run: PyTorch with CUDA is not importable here"


def test_summary_pairs_rawflash_with_cudnn():
    cases = [c for c in bench_mla.mla_cases() if c.direction == "bwd" and c.seqlen == 8192]
    ours = {c.causal: c for c in cases if c.impl == "rawflash-fa2"}
    peer = {c.causal: c for c in cases if c.impl == "torch-cudnn"}
    records = [bench.Record.of(ours[False], 4.0, kernel_ms=3.0), bench.Record.of(peer[False], 5.0),
               bench.Record.of(ours[True], None, "refused: ValueError: v's head_dim"),
               bench.Record.of(peer[True], None, "not run: no PyTorch")]
    full, causal = sorted(bench_mla.summary(records), key=lambda r: r["causal"])
    assert (full["N"], full["batch"], full["status"]) == (8192, 2, "ok")
    assert full["x cuDNN"] == 1.25 and full["kernels x cuDNN"] == round(5.0 / 3.0, 3)
    assert full["rawflash TFLOP/s"] == round(ours[False].flops / 4e-3 / 1e12, 1)
    assert causal["rawflash TFLOP/s"] is causal["cuDNN TFLOP/s"] is causal["x cuDNN"] is None
    assert causal["status"] == "rawflash: refused: ValueError: v's head_dim; cuDNN: not run: no PyTorch"


def test_bench_lists_mla_and_refuses_other_modes_with_it():
    runner = CliRunner()
    assert "--mla" in runner.invoke(commands.main, ["bench", "--help"]).output
    res = runner.invoke(commands.main, ["bench", "--mla", "--paged"])
    assert res.exit_code == 2 and "--mla times its own cases" in res.output
    if not gpu_available():  # as bench --paged: it says so and exits 1
        res = runner.invoke(commands.main, ["bench", "--mla"])
        assert res.exit_code == 1 and "bench --mla needs a CUDA GPU" in res.output


def test_bench_mla_writes_its_rows_and_honours_repeats(monkeypatch, tmp_path):
    """The command's wiring with the GPU work replaced: every case run with --repeats, the rows written as JSON
    and CSV under --out with --tag, the summary printed."""
    seen = []

    def fake(case, repeats, verdicts):
        seen.append(repeats)
        return bench.Record.of(case, 2.0 if case.impl == "torch-cudnn" else 1.0,
                               kernel_ms=0.8 if case.impl == "rawflash-fa2" else None)

    monkeypatch.setattr(commands.sysinfo, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_mla, "run_case", fake)
    res = CliRunner().invoke(commands.main, ["bench", "--mla", "--repeats", "3", "--out", str(tmp_path),
                                             "--tag", "t"])
    assert res.exit_code == 0, res.output
    assert seen == [3] * len(bench_mla.mla_cases())
    report = json.loads((tmp_path / "bench-mla-t.json").read_text())
    assert len(report["cases"]) == len(seen) and all(r["head_dim_v"] == 128 for r in report["cases"])
    assert len(report["summary"]) == len(seen) // 2 and {r["x cuDNN"] for r in report["summary"]} == {2.0}
    assert (tmp_path / "bench-mla-t.csv").read_text().count("\n") == len(seen) + 1
    assert "x cuDNN" in res.output and "bench-mla-t.csv" in res.output


def test_gpu_run_has_a_bench_mla_step():
    """tools/gpu_run.sh documents the step in its usage and runs rawflash bench --mla with MLA_REPEATS into its log."""
    import re
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "gpu_run.sh"
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^\s+bench-mla\s+rawflash bench --mla .*MLA_REPEATS, default 10", usage, re.M | re.S)
    step = re.search(r"^\s+bench-mla\)\n(.*?);;", script.read_text(), re.M | re.S)
    assert step and "bench --mla --repeats ${MLA_REPEATS:-10} --out \"$OUT\"" in step.group(1)
    assert "$OUT/bench_mla.log" in step.group(1)
