"""rawflash bench --jax and rawflash.jax.timing: the sweep's cases and FLOPs, the ratios, validation (JAX's xla
implementation on the CPU), the command line without a GPU, the child process's options and environment, the
marks' CUDA lowering and their order through XLA on the CPU; the GPU tests time a jitted program and run a small
sweep."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import gpu_available
from rawflash.cli import bench_jax, commands, iomodel, sysinfo

jax = pytest.importorskip("jax")
jnp = jax.numpy

from rawflash.jax import ffi, timing  # noqa: E402

no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")


def invoke(*args, code=0):
    result = CliRunner().invoke(commands.main, [str(a) for a in args])
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    return result


# ---------------------------------------------------------------- the sweep
def test_sweep_is_the_fa2_papers_with_xla_up_to_4096():
    cases = bench_jax.sweep_cases()
    for c in cases:
        assert (c.batch, c.heads, c.kv_heads) == (16384 // c.seqlen, 2048 // c.head_dim, 2048 // c.head_dim)
        assert c.dtype == "bfloat16" and c.direction in ("fwd", "fwd+bwd")
    kinds = {(d, n, causal, direction) for d in (64, 128) for n in (512, 1024, 2048, 4096, 8192, 16384)
             for causal in (False, True) for direction in ("fwd", "fwd+bwd")}
    for impl in ("rawflash", "cudnn"):
        assert {(c.head_dim, c.seqlen, c.causal, c.direction) for c in cases if c.impl == impl} == kinds
    assert {(c.head_dim, c.seqlen, c.causal, c.direction) for c in cases if c.impl == "xla"} == {
        k for k in kinds if k[1] <= bench_jax.XLA_MAX_SEQLEN}
    assert len(cases) == len(set(cases)) == 48 + 48 + 32
    gqa = bench_jax.sweep_cases(head_dims=[64], seqlens=[1024], kv_ratio=4)
    assert {(c.heads, c.kv_heads, c.batch) for c in gqa} == {(32, 8, 16)}


def test_flops_are_bench_conventions():
    b, h, n, d = 4, 16, 4096, 128
    fwd = bench_jax.JaxCase("rawflash", "fwd", b, h, h, n, d, False)
    assert fwd.flops == 4 * b * h * n * n * d
    causal = bench_jax.JaxCase("rawflash", "fwd", b, h, h, n, d, True)
    assert causal.flops == fwd.flops / 2
    both = bench_jax.JaxCase("cudnn", "fwd+bwd", b, h, h, n, d, True)
    assert both.flops == 3.5 * causal.flops
    assert both.flops == iomodel.flops(both.shape, "fwd") + iomodel.flops(both.shape, "bwd")


def _row(impl, ms, direction="fwd", seqlen=1024, causal=False, kernel_ms=None, status="ok"):
    case = bench_jax.JaxCase(impl, direction, 16, 32, 32, seqlen, 64, causal)
    row = bench_jax.record(case, ms, status, kernel_ms)
    return row


def test_ratios_pair_rawflash_with_each_peer_and_its_kernels():
    rows = [_row("rawflash", 1.0, kernel_ms=0.8), _row("cudnn", 1.25), _row("xla", 4.0),
            _row("rawflash", 2.0, seqlen=8192, kernel_ms=2.0), _row("cudnn", None, seqlen=8192, status="failed: x"),
            _row("rawflash", 3.0, direction="fwd+bwd")]
    out = bench_jax.ratios(rows)
    assert [(r["seqlen"], r["direction"]) for r in out] == [(1024, "fwd"), (8192, "fwd"), (1024, "fwd+bwd")]
    first = out[0]
    assert first["x cudnn"] == pytest.approx(1.25) and first["x xla"] == pytest.approx(4.0)
    assert first["cudnn tflops"] == pytest.approx(rows[1]["tflops"])
    assert first["jit / kernels"] == pytest.approx(1.25)
    assert first["kernel_tflops"] == pytest.approx(first["tflops"] / 0.8)
    assert out[1]["x cudnn"] is None and out[1]["x xla"] is None and out[1]["jit / kernels"] == 1.0
    assert out[2]["x cudnn"] is None  # no peer row of that direction


def test_programs_compute_the_forward_and_the_three_gradients():
    a = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)
    fwd = jax.eval_shape(bench_jax.program(bench_jax.JaxCase("xla", "fwd", 2, 4, 4, 64, 32, True)), a, a, a)
    assert fwd.shape == a.shape and fwd.dtype == a.dtype
    grads = jax.eval_shape(bench_jax.program(bench_jax.JaxCase("xla", "fwd+bwd", 2, 4, 4, 64, 32, True)), a, a, a)
    assert [g.shape for g in grads] == [a.shape] * 3


@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
def test_xla_implementation_passes_validation_on_the_cpu(direction):
    case = bench_jax.JaxCase("xla", direction, 32, 32, 32, 512, 64, True)
    assert bench_jax.validate(case) == (True, "ok")


def test_a_wrong_implementation_fails_validation(monkeypatch):
    right = bench_jax.attention_fn("xla")
    monkeypatch.setattr(bench_jax, "attention_fn", lambda impl: lambda q, k, v, causal: right(q, k, v, causal) * 1.05)
    ok, why = bench_jax.validate(bench_jax.JaxCase("xla", "fwd", 32, 32, 32, 512, 64, False))
    assert not ok and why.startswith("out error")


def test_run_validates_once_per_kind_and_reports_failures_by_their_first_line(monkeypatch):
    checked, timed = [], []

    def validate(case):
        checked.append(case)
        if case.impl == "cudnn":
            raise NotImplementedError("no cuDNN kernel for this\nsecond line")
        return (False, "out error 1 > 0.5") if case.impl == "xla" else (True, "ok")

    def time_jit(case, inputs, repeats):
        timed.append(case)
        if case.seqlen == 1024:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\ndetails")
        return 2.0

    def kernels(case, host, repeats):
        if case.direction == "fwd+bwd":
            raise ValueError("no plan")
        return 1.0

    monkeypatch.setattr(bench_jax, "validate", validate)
    monkeypatch.setattr(bench_jax, "time_jit_ms", time_jit)
    monkeypatch.setattr(bench_jax, "time_kernels_ms", kernels)
    monkeypatch.setattr(bench_jax, "host_inputs", lambda *shape: [np.zeros(1)] * 3)
    cases = bench_jax.sweep_cases(head_dims=[64], seqlens=[512, 1024], causals=[True], tokens=1024, hidden=128)
    lines = []
    rows = {(r["impl"], r["direction"], r["seqlen"]): r for r in bench_jax.run(cases, 3, progress=lines.append)}
    assert len(checked) == 6 and len(lines) == len(cases) == 12
    assert rows[("cudnn", "fwd", 512)]["status"] == "failed: NotImplementedError: no cuDNN kernel for this"
    assert rows[("xla", "fwd+bwd", 1024)]["status"] == "invalid: out error 1 > 0.5"
    assert {c.impl for c in timed} == {"rawflash"}
    assert rows[("rawflash", "fwd", 1024)]["status"] == "failed: RuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert rows[("rawflash", "fwd", 512)]["kernel_ms"] == 1.0 and rows[("rawflash", "fwd", 512)]["status"] == "ok"
    both = rows[("rawflash", "fwd+bwd", 512)]
    assert both["ms"] == 2.0 and both["status"] == "kernels failed: ValueError: no plan"


# ---------------------------------------------------------------- the command line
@no_gpu
def test_bench_jax_refuses_cleanly_without_a_gpu():
    out = invoke("bench", "--jax", code=1).output
    assert "needs a CUDA GPU" in out and len(out.strip().splitlines()) == 1
    report = json.loads(invoke("bench", "--jax", "--json", code=1).stdout)
    assert report["exit_code"] == 1 and "needs a CUDA GPU" in report["error"]


@no_gpu
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_the_child_refuses_cleanly_without_a_gpu(extra):
    proc = subprocess.run([sys.executable, "-m", bench_jax.MODULE, "--seqlens", "512", *extra], capture_output=True,
                          text=True, env=bench_jax.child_env(), timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    if extra:
        assert "needs a CUDA GPU" in json.loads(proc.stdout)["error"]
    else:
        assert proc.stderr.strip().startswith("Error: bench --jax needs a CUDA GPU")
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [(["--host"], "--host"), (["--impl", "rawflash-fa2"], "--impl"),
                                           (["--decode"], "--decode"), (["--dtype", "float16"], "bfloat16 only")])
def test_bench_jax_refuses_options_of_other_sweeps(args, message):
    assert message in invoke("bench", "--jax", *args, code=2).output


def test_bench_jax_without_jax_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(sysinfo, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_jax, "have_jax", lambda: False)
    out = invoke("bench", "--jax", code=1).output
    assert "needs JAX" in out and "jax[cuda" in out and len(out.strip().splitlines()) == 1


def test_bench_jax_starts_its_child_with_the_options(monkeypatch):
    calls = []

    def spawn(args):
        calls.append(args)
        return (0, "the child's report\n") if len(calls) == 1 else (3, "")

    monkeypatch.setattr(sysinfo, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_jax, "spawn", spawn)
    result = invoke("bench", "--jax", "--seqlens", "512,1024", "--direction", "bwd", "--causal", "--repeats", "5",
                    "--out", "somewhere", "--tag", "h100")
    assert result.output == "the child's report\n"
    assert calls[0] == ["--head-dims", "64,128", "--seqlens", "512,1024", "--causal", "--direction", "fwd+bwd",
                        "--tokens", "16384", "--hidden", "2048", "--kv-ratio", "1", "--repeats", "5", "--out",
                        "somewhere", "--tag", "h100"]
    invoke("bench", "--jax", "--head-dims", "256", "--json", code=3)  # the child's exit status is the command's
    args = calls[1]
    assert args[args.index("--head-dims") + 1] == "256" and args[-1] == "--json"
    assert args.count("--direction") == 2 and "--causal" not in args and "--no-causal" not in args


def test_child_environment_turns_preallocation_off_and_finds_this_rawflash():
    env = bench_jax.child_env()
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert str(Path(bench_jax.__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)


def test_child_options_parse_in_the_child():
    args = bench_jax.child_args([64], [512], False, ("fwd", "bwd"), 1024, 256, 2, 3, "out", "", True)
    ctx = bench_jax.main.make_context("bench_jax", list(args))
    p = ctx.params
    assert (p["head_dims"], p["seqlens"], p["causal"], p["directions"]) == ([64], [512], False, ("fwd", "fwd+bwd"))
    assert (p["tokens"], p["hidden"], p["kv_ratio"], p["repeats"], p["as_json"]) == (1024, 256, 2, 3, True)


def test_the_child_prints_and_writes_its_report(monkeypatch, tmp_path):
    about = {"device": "a GPU", "jax": "0.0 (jaxlib 0.0)"}
    rows = [_row("rawflash", 1.0, kernel_ms=0.9), _row("cudnn", 1.1), _row("xla", None, status="failed: OOM")]
    seen = []
    monkeypatch.setattr(bench_jax, "_require_gpu", lambda: about)
    monkeypatch.setattr(bench_jax, "run", lambda cases, repeats, progress=None: seen.append((cases, repeats)) or rows)
    args = ["--head-dims", "64", "--seqlens", "1024", "--no-causal", "--direction", "fwd", "--repeats", "4", "--out",
            str(tmp_path), "--tag", "t"]
    text = CliRunner().invoke(bench_jax.main, args)
    assert text.exit_code == 0, text.output
    cases, repeats = seen[0]
    assert repeats == 4 and {(c.impl, c.seqlen, c.causal, c.direction) for c in cases} == {
        (i, 1024, False, "fwd") for i in bench_jax.IMPLS}
    for word in ("device: a GPU", "failed: OOM", "x cudnn", "jit / kernels", "bench-jax-t.json"):
        assert word in text.stdout
    written = json.loads((tmp_path / "bench-jax-t.json").read_text())
    assert written["device"] == "a GPU" and written["cases"] == rows and written["ratios"] == bench_jax.ratios(rows)
    report = json.loads(CliRunner().invoke(bench_jax.main, args + ["--json"]).stdout)
    assert report["ratios"][0]["x cudnn"] == pytest.approx(1.1) and report["not timed"][0]["impl"] == "xla"


# ---------------------------------------------------------------- the marks
BF16 = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)


def _custom_calls(fn, *avals) -> list[str]:
    text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    return [line.strip() for line in text.splitlines() if "stablehlo.custom_call" in line or "return" in line]


def _target(line: str) -> str:
    return line.split("@")[1].split("(")[0] if "@" in line else "return"


def _results(line: str) -> str:
    return line.split("=")[0].strip().split(":")[0]


def _aliases(line: str) -> list[tuple[str, int]]:
    """(result index, operand index) of each output_operand_alias; the result index is '' for a single result."""
    found = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d*)\], operand_index = (\d+)", line)
    return [(out, int(operand)) for out, operand in found]


def test_marks_lower_around_the_forward():
    from rawflash.jax import attention

    t = timing.timed(lambda q, k, v: attention(q, k, v, causal=True))
    calls = _custom_calls(t, BF16, BF16, BF16)
    assert [_target(c) for c in calls] == ["rawflash_mark", "rawflash_forward", "rawflash_mark", "return"]
    start, forward, end, ret = calls
    assert f"slot = {t.start} : i64" in start and f"slot = {t.end} : i64" in end and t.start != t.end
    assert "has_side_effect = true" in start and "has_side_effect = true" in end
    s = _results(start)
    assert f"@rawflash_forward({s}#0, {s}#1, {s}#2)" in forward  # the work reads the start mark's results
    assert _aliases(start) == [("0", 0), ("1", 1), ("2", 2)]
    assert f"@rawflash_mark({_results(forward)}#0)" in end  # the end mark holds the output (one array, aliased)
    assert _aliases(end) == [("", 0)]
    assert ret == f"return {_results(end)} : tensor<2x128x4x64xbf16>"


def test_marks_lower_around_forward_and_backward():
    from rawflash.jax import attention

    def loss(q, k, v):
        return attention(q, k, v, causal=True).astype(jnp.float32).sum()

    t = timing.timed(jax.grad(loss, argnums=(0, 1, 2)))
    calls = _custom_calls(t, BF16, BF16, BF16)
    assert [_target(c) for c in calls] == ["rawflash_mark", "rawflash_forward", "rawflash_backward",
                                           "rawflash_mark", "return"]
    backward, end, ret = calls[2:]
    b = _results(backward)
    assert f"@rawflash_mark({b}#0, {b}#1, {b}#2)" in end  # dq, dk, dv all held by the end mark
    assert f"slot = {t.end} : i64" in end and _aliases(end) == [("0", 0), ("1", 1), ("2", 2)]
    e = _results(end)
    assert ret.startswith(f"return {e}#0, {e}#1, {e}#2 :")


def test_mark_leaves_what_is_not_an_array():
    seen = []

    def fn(x):
        marked = timing.mark({"x": x, "n": 3, "none": None}, 7)
        seen.append(marked)
        return marked["x"]

    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((4,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@rawflash_mark(") == 1 and "slot = 7 : i64" in text
    assert seen[0]["n"] == 3 and seen[0]["none"] is None
    assert timing.mark((1, None), 7) == (1, None)


LOG: list = []


def _cpu_mark(frame):
    assert [a.ptr for a in frame.args] == [r.ptr for r in frame.rets], "each result is its operand's buffer"
    LOG.append(("mark", frame.attrs["slot"]))


def _cpu_work(frame):
    """A stand-in for fn's kernels: out = 2 * x, logged when it runs."""
    import ctypes

    x, out = frame.args[0], frame.rets[0]
    n = int(np.prod(x.shape))
    src = np.ctypeslib.as_array((ctypes.c_float * n).from_address(x.ptr))
    np.ctypeslib.as_array((ctypes.c_float * n).from_address(out.ptr))[:] = 2 * src
    LOG.append(("work", None))


def test_marks_run_before_and_after_the_work_through_xla_on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        _marks_through_xla()


def _marks_through_xla():
    ffi.register(timing.MARK, _cpu_mark, platform="cpu")
    ffi.register("rawflash_test_work", _cpu_work, platform="cpu")

    def fn(x, y):
        doubled = jax.ffi.ffi_call("rawflash_test_work", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        return doubled + y, jnp.sin(y)

    t = timing.timed(fn)
    x, y = jnp.arange(6, dtype=jnp.float32), jnp.ones(6, jnp.float32)
    LOG.clear()
    for _ in range(2):
        a, b = jax.jit(t)(x, y)
    assert LOG == [("mark", t.start), ("work", None), ("mark", t.end)] * 2
    np.testing.assert_allclose(np.asarray(a), 2 * np.arange(6) + 1)
    np.testing.assert_allclose(np.asarray(b), np.sin(np.ones(6)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(x), np.arange(6))  # the argument itself is untouched


class _Event:
    def __init__(self, t):
        self.t, self.waited = t, False

    def synchronize(self):
        self.waited = True


def test_times_pair_each_executions_events(monkeypatch):
    import cupy

    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda s, e: e.t - s.t)
    t = timing.timed(lambda x: x)
    starts, ends = [_Event(0.0), _Event(10.0)], [_Event(1.5), _Event(12.0)]
    timing._EVENTS[t.start], timing._EVENTS[t.end] = list(starts), list(ends)
    assert t.times_ms() == [1.5, 2.0] and ends[-1].waited
    assert t.times_ms() == []  # taken
    timing._EVENTS[t.start] = [_Event(0.0)]
    with pytest.raises(RuntimeError, match="1 start marks and 0 end marks"):
        t.times_ms()


# ---------------------------------------------------------------- on the GPU
def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


needs_jax_gpu = pytest.mark.skipif(not _jax_gpu(), reason="needs JAX's CUDA backend")


@pytest.mark.gpu
@needs_jax_gpu
def test_marks_time_a_jitted_matmul_on_the_gpu():
    x = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32)
    one = timing.measure_ms(lambda a: a @ a, x, repeats=5)
    four = timing.measure_ms(lambda a: ((a @ a) @ a @ a) @ a, x, repeats=5)
    assert len(one) == len(four) == 5 and min(one) > 0
    assert np.median(four) > 2.5 * np.median(one)  # four products against one


@pytest.mark.gpu
@needs_jax_gpu
def test_a_small_sweep_runs_end_to_end(tmp_path):
    code, out = bench_jax.spawn(["--head-dims", "64", "--seqlens", "512", "--causal", "--tokens", "2048",
                                 "--repeats", "3", "--out", str(tmp_path), "--json"])
    report = json.loads(out)
    assert code == 0, report
    assert {r["impl"] for r in report["cases"] if r["status"] == "ok"} >= {"rawflash", "xla"}
    assert all(r["tflops"] > 0 for r in report["ratios"]) and (tmp_path / "bench-jax.json").exists()
