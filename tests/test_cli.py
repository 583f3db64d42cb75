"""The command line through click's CliRunner: every command's CPU path, --json, refused options, GPU paths.

Numbers printed by the CLI are checked against their one owner (launch, configs, iomodel, occupancy, the
compiler, the API's validation), so a CLI that drifts from the library fails here.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import rawflash
from conftest import gpu_available, random_qkv
from rawflash.cli import accuracy, commands, introspect, iomodel, ncu, occupancy, sysinfo
from rawflash.kernels import compile, configs, forms, launch, registry
from rawflash.problem import Problem

SMALL = ["--batch", "2", "--seqlen-q", "300", "--seqlen-k", "200", "--heads", "8", "--kv-heads", "2",
         "--head-dim", "64", "--dtype", "float16", "--causal"]
SMALL_PROBLEM = Problem(2, 300, 200, 8, 2, 64, "float16", True)
no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")


def invoke(*args, code=0):
    result = CliRunner().invoke(commands.main, [str(a) for a in args])
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    if code:
        assert isinstance(result.exception, SystemExit)
    return result


def invoke_json(*args, code=0):
    return json.loads(invoke(*args, "--json", code=code).stdout)


# ---------------------------------------------------------------- info, list, the registry
def test_info_prints_versions_cache_and_gpus():
    out = invoke("info").output
    for word in ("nvrtc", "driver", "cupy", "numpy", "numba-cuda", "kernel cache", str(compile.cache_dir())):
        assert word in out
    report = invoke_json("info")
    assert report["cuda"]["nvrtc"].count(".") == 1
    assert report["kernel cache"]["path"] == str(compile.cache_dir())
    if gpu_available():
        assert report["gpus"][0]["sms"] > 0
    else:
        assert "none visible" in report["gpus"]


def test_list_shows_every_variant_and_every_tile_row():
    out = invoke("list").output
    for name in ("naive", "fa1_fwd", "fa2_fwd", "fa2_bwd", "split-Q", "split-K", "make_fa2_fwd", "Algorithm 2"):
        assert name in out
    report = invoke_json("list")
    assert set(report["variants"]) == set(registry.REGISTRY)
    covered = {(r["kernel"], int(d), dt) for r in report["tiles"] for d in r["head_dims"].split(",")
               for dt in r["dtypes"].split(",")}
    assert covered == set(configs.TABLE)
    for r in report["tiles"]:
        cfg = configs.TABLE[(r["kernel"], int(r["head_dims"].split(",")[0]), r["dtypes"].split(",")[0])]
        assert (r["Br"], r["Bc"], r["warps"], r["threads"]) == (cfg.br, cfg.bc, cfg.warps, cfg.threads)


def test_registry_names_sources_and_tile_rows():
    for name, v in registry.REGISTRY.items():
        assert v.name == name and v.numba_factory == f"make_{name}"
        assert all((compile.cuda_dir() / src).is_file() for src in v.sources)
        text = "".join((compile.cuda_dir() / src).read_text() for src in v.sources)
        for kernel in (*v.forms, *v.helpers):
            assert f"{kernel.kernel}(" in text
    rows = {r for v in registry.REGISTRY.values() for f in v.forms for r in f.tile_rows}
    assert rows | {"fa2_bwd_dq"} >= set(configs.KERNELS) - {"naive_softmax"}
    assert registry.for_call("fa1", "fwd").name == "fa1_fwd"
    assert registry.for_call("naive", "bwd").name == "fa2_bwd"
    with pytest.raises(ValueError, match="kernel must be one of"):
        registry.for_call("fa3", "fwd")


# ---------------------------------------------------------------- launch-config
def test_launch_config_matches_launch_and_iomodel():
    rows = invoke_json("launch-config", *SMALL, "--direction", "both", "--gpu", "sm_90")["launches"]
    kp = introspect.kernel_problem(SMALL_PROBLEM)
    expected = forms.forward_plan(kp, "fa2") + forms.backward_plan(kp, False)
    assert [r["instantiation"] for r in rows] == [lau.name_expression for lau in expected]
    for row, lau in zip(rows, expected):
        assert row["grid"] == "x".join(map(str, lau.grid)) and row["smem"] == lau.smem and row["ctas"] == lau.ctas
        if lau.config is None:
            assert row["tiles"] is None
            continue
        computed, skipped = iomodel.visible_blocks(300, 200, lau.config.br, lau.config.bc, True)
        assert (row["tiles"], row["skipped"]) == (computed * 16, skipped * 16)
        assert row["skipped"] > 0
        assert row["waves"] == round(lau.ctas / (row["ctas_per_sm"] * 132), 2)


def test_launch_config_deterministic_backward_and_text():
    rows = invoke_json("launch-config", *SMALL, "--direction", "bwd", "--deterministic")["launches"]
    assert [r["kernel"] for r in rows] == ["fa2_bwd_preprocess", "fa3_bwd_sm90", "fa2_bwd_convert_dq"]
    assert rows[1]["instantiation"].endswith(", true, 64, 199720>"), "FA3's form with DETERMINISTIC = true (DV = D)"
    rows = invoke_json("launch-config", *SMALL, "--direction", "bwd", "--deterministic", "--gpu", "sm_80")["launches"]
    assert [r["kernel"] for r in rows] == ["fa2_bwd_preprocess", "fa2_bwd", "fa2_bwd_dq"]
    out = invoke("launch-config", "--kernel", "fa1", "--sms", "108").output
    assert "fa1_fwd<" in out and "fa1_finalize<" in out and "108 SMs" in out


def test_launch_config_reports_the_backward_pairs_clusters():
    for d, paired in ((128, False), (192, True), (256, True)):
        rows = invoke_json("launch-config", "--head-dim", str(d), "--direction", "bwd", "--gpu", "sm_90")["launches"]
        main = next(r for r in rows if r["kernel"] == "fa3_bwd_sm90")
        assert ("clusters of 2 CTAs (2x1x1)" in main.get("note", "")) is paired, (d, main.get("note"))


# ---------------------------------------------------------------- occupancy
@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_occupancy_offline_agrees_with_ptxas_calculator_and_register_cap(arch):
    report = invoke_json("occupancy", *SMALL, "--direction", "both", "--gpu", arch)
    assert arch in report["target"]
    rows = {r["kernel"]: r for r in report["occupancy"]}
    lau = forms.fa2_forward(dataclasses.replace(introspect.kernel_problem(SMALL_PROBLEM), arch=arch))
    assert lau.kernel == ("fa3_fwd_sm90" if arch == "sm_90" else "fa2_fwd"), "the target's own forward kernel"
    row = rows[lau.kernel]
    ptxas = compile.compile_offline(lau.source, lau.name_expression, lau.compile_arch(arch))
    ours = occupancy.occupancy(arch, lau.threads, ptxas.registers, ptxas.static_smem + lau.smem)
    assert row["instantiation"] == lau.name_expression
    assert (row["regs"], row["spills"], row["smem"]) == (ptxas.registers, ptxas.spills, ptxas.static_smem + lau.smem)
    assert (row["ctas_per_sm"], row["warps_per_sm"], row["limiter"]) == (ours.blocks_per_sm, ours.warps_per_sm,
                                                                          ours.limiter)
    assert row["reg_cap"] == launch.register_cap(lau.config) and row["regs"] <= row["reg_cap"]
    assert all(r["regs"] <= r["reg_cap"] for r in report["occupancy"] if r["reg_cap"] is not None)
    assert report["checks"]["above the register cap of launch.register_cap"] == "none"


def test_causal_flag_is_the_mask_mode_template_argument():
    for causal in (False, True):
        for d in (64, 256):
            p = Problem(1, 1, 1, 1, 1, d, "bfloat16", causal)
            for lau in (*forms.forward_plan(p), *forms.forward_plan(p, "fa1"), *forms.backward_plan(p),
                        *forms.backward_plan(p, True), forms.fa2_forward(p, forms.Switches(wgmma=False))):
                if lau.config is not None:
                    assert introspect.causal_flag(lau) is causal, lau.name_expression
    assert introspect.causal_flag(launch.naive_softmax(Problem(1, 1, 1, 1, 1, 64, "bfloat16", True))) is None


def test_instantiations_are_one_dtype_and_causal_slice_of_all():
    every = forms.all_instantiations()
    slices = [introspect.instantiations(dt, c) for dt in configs.DTYPES for c in (False, True)]
    union = {lau.name_expression for s in slices for lau in s}
    assert union == {lau.name_expression for lau in every if not introspect.general_flag(lau)}
    ctype = launch.CUDA_TYPES["float16"]
    typed = set(launch.CUDA_TYPES.values())  # kernels without a dtype argument (fp8_vt_permute) are in every slice
    assert all(lau.template_args[0] in (ctype,) or lau.template_args[0] not in typed
               for lau in introspect.instantiations("float16", True))


@pytest.mark.compile
@pytest.mark.slow
def test_occupancy_all_offline():
    report = invoke_json("occupancy", "--all", "--dtype", "float16", "--no-causal", "--gpu", "sm_90")
    names = [r["instantiation"] for r in report["occupancy"]]
    assert names == [lau.name_expression for lau in introspect.instantiations("float16", False)]
    assert all(r["ctas_per_sm"] >= 1 and r["regs"] <= (r["reg_cap"] or 255) for r in report["occupancy"])


# ---------------------------------------------------------------- io
def test_io_bytes_come_from_iomodel_with_the_launch_tiles():
    report = invoke_json("io", *SMALL, "--gpu", "A100-80GB-SXM")
    rows = {(r["kernel"], r["dir"]): r for r in report["io"]}
    assert set(rows) == {(k, d) for k in iomodel.KERNELS for d in iomodel.DIRECTIONS}
    a100 = dataclasses.replace(SMALL_PROBLEM, arch="sm_80")  # a named A100 reads the sm_80 tile rows
    cfg = forms.fa2_forward(a100).config
    shape = iomodel.Shape(2, 300, 200, 8, 2, 64, 2, True)
    expected = iomodel.io_bytes("fa2", "fwd", shape, Br=cfg.br, Bc=cfg.bc)
    row = rows[("fa2", "fwd")]
    assert (row["Br"], row["Bc"]) == (cfg.br, cfg.bc)
    assert row["read_MB"] * 1e6 == pytest.approx(expected.read_bytes)
    assert row["write_MB"] * 1e6 == pytest.approx(expected.write_bytes)
    assert row["bound_ms"] == pytest.approx(iomodel.roofline(expected, "A100-80GB-SXM", "float16")["bound_ms"])
    assert rows[("fa2", "bwd")]["Br"] == forms.backward_plan(a100)[1].config.br
    assert rows[("fa2", "fwd")]["runs"] == "rawflash fa2_fwd"
    assert rows[("naive", "fwd")]["Br"] is None
    assert rows[("fa2", "fwd")]["read_MB"] < rows[("naive", "fwd")]["read_MB"]
    out = invoke("io", *SMALL, "--breakdown").output
    assert "K,V re-read per Q block" in out and "flop_per_byte" in out


@no_gpu
def test_io_measure_without_gpu_says_so():
    result = invoke("io", "--seqlen-q", "128", "--measure", code=1)
    assert "needs a CUDA GPU" in result.output and "fa2" in result.output


def test_ncu_csv_is_parsed_and_summed_over_kernels():
    text = '\n'.join([
        "==PROF== Connected to process 1",
        '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"',
        '"0","1","fa2_fwd","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"',
        '"0","1","fa2_fwd","Command line profiler metrics","dram__bytes_write.sum","byte","4096"',
        '"1","1","other","Command line profiler metrics","dram__bytes_read.sum","Kbyte","2.5"',
        '"1","1","other","Command line profiler metrics","dram__bytes_write.sum","byte","0"'])
    assert ncu.parse(text) == {"read_bytes": 1048576 + 2500, "write_bytes": 4096, "kernels": 2}
    with pytest.raises(ValueError, match="no metric table"):
        ncu.parse("==PROF== nothing profiled")
    cmd = ncu.command("ncu", "/tmp/log", {"batch": 1}, "fa2", "fwd")
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "dram__bytes_read.sum,dram__bytes_write.sum" in cmd


# ---------------------------------------------------------------- explain
def test_explain_valid_call():
    report = invoke_json("explain", *SMALL, "--kernel", "fa1")
    assert report["valid"] is True
    assert [v["variant"] for v in report["variants"]] == ["fa1_fwd", "fa2_bwd"]
    assert report["launches"][0]["instantiation"] == forms.forward_plan(SMALL_PROBLEM, "fa1")[0].name_expression
    assert report["problem"]["scale"] == pytest.approx(1 / 8)
    assert [r["kernel"] for r in report["predicted"]] == ["fa1", "fa2"]
    assert all(r["bound_ms"] > 0 for r in report["predicted"])
    out = invoke("explain", *SMALL, "--head-dim", "59").output
    assert "valid: yes" in out and "59 runs on the 64 kernel" in out and "skipped" in out


@pytest.mark.parametrize("causal, grid", [(True, "grid: persistent, dynamic"), (False, "grid: persistent, static")])
def test_explain_names_the_fa3_forwards_grid(causal, grid):
    args = ["--gpu", "sm_90", "--batch", "2", "--seqlen-q", "4096", "--heads", "16", "--head-dim", "128"]
    report = invoke_json("explain", *args, *(["--causal"] if causal else []))
    fwd = next(r for r in report["launches"] if r["kernel"] == "fa3_fwd_sm90")
    assert grid in fwd["note"] and "short causal" not in fwd["note"]


@pytest.mark.parametrize("batch, heads, kv, causal, first", [(4, 16, 4, True, True), (4, 16, 16, True, True),
                                                          (4, 32, 32, True, False), (4, 16, 4, False, False)])
def test_explain_says_when_the_backward_takes_its_key_tiles_longest_first(batch, heads, kv, causal, first):
    """Under a right bound with at most half the SMs of (batch, kv head) pairs (64 of 132 here: inclusive)."""
    args = ["--gpu", "sm_90", "--batch", str(batch), "--seqlen-q", "4096", "--heads", str(heads), "--kv-heads",
            str(kv), "--head-dim", "128", "--direction", "bwd"]
    report = invoke_json("explain", *args, *(["--causal"] if causal else []))
    bwd = next(r for r in report["launches"] if r["kernel"] == "fa3_bwd_sm90")
    assert ("longest first" in (bwd.get("note") or "")) is first
    det = invoke_json("explain", *args, "--deterministic", *(["--causal"] if causal else []))
    assert "longest first" not in (next(r for r in det["launches"] if r["kernel"] == "fa3_bwd_sm90").get("note") or "")


@pytest.mark.parametrize("gpu, br, first", [("h200", 64, True), ("h100", 80, False), ("H100-SXM", 80, False)])
def test_explain_takes_the_named_gpus_gates(gpu, br, first):
    """MHA d = 128 causal N = 4096 with 64 (batch, kv head) pairs: the H200 runs 64 rows, key tiles longest first;
    the H100 80 rows in key order. The note names the GPU's gate."""
    args = ["--gpu", gpu, "--batch", "4", "--seqlen-q", "4096", "--heads", "16", "--head-dim", "128", "--direction",
            "bwd", "--causal"]
    bwd = next(r for r in invoke_json("explain", *args)["launches"] if r["kernel"] == "fa3_bwd_sm90")
    assert bwd["Br"] == br and ("longest first" in (bwd.get("note") or "")) is first
    assert ("4096 causal on the h100" in (bwd.get("note") or "")) is (br == 80)


@pytest.mark.parametrize("gpu, causal_rows, ctas", [("h100", 4096, 8), ("h200", 8192, 2), ("sm_90", 8192, 2)])
def test_list_prints_the_gates_of_the_named_gpu(gpu, causal_rows, ctas):
    report = invoke_json("list", "--gpu", gpu)
    name = "h100" if causal_rows == 4096 else "h200"
    gates = {r["gate"]: r["value"] for r in report[f"gates of the {name}"]}
    assert gates == {"long_bwd_seqlen": 1024, "long_causal_bwd_seqlen": causal_rows, "longest_first_ctas": ctas}
    assert f"({name.upper()} bf16)" in report[f"gates of the {name}, chosen by"]
    assert not any(k.startswith("gates") for k in invoke_json("list", "--gpu", "sm_80"))


def test_list_marks_the_rows_a_gpu_takes_of_its_own(monkeypatch):
    """``list --gpu h100`` prints configs.GPU_ROWS['h100']'s row where the table's stands, from GPU_ROWS and chosen
    on the h100, and its situation rows (GPU_SITUATION_ROWS) apart; ``--gpu h200`` keeps the table's row; the rest
    say the table's GPU (the FP8 decode row at d = 128: configs.TABLE_CHOSEN_ON's)."""
    key = ("fa3_fwd_sm90", 128, "bfloat16")
    own = configs.TileConfig(128, 160, 12, stages=2, why="injected by the test")
    monkeypatch.setitem(configs.GPU_ROWS, "h100", {key: own})
    monkeypatch.setitem(configs.GPU_SITUATION_ROWS, "h100", {"short_causal": {key: own}})

    def row(report, kernel, d, dtype):
        return next(r for r in report["tiles"] if r["kernel"] == kernel and str(d) in r["head_dims"].split(",")
                    and dtype in r["dtypes"].split(","))

    h100, h200 = invoke_json("list", "--gpu", "h100"), invoke_json("list", "--gpu", "h200")
    got = row(h100, *key)
    assert (got["Br"], got["Bc"], got["from"], got["chosen on"], got["why"]) == (128, 160, "GPU_ROWS", "the h100",
                                                                                 own.why)
    assert got["dtypes"] == "bfloat16" and row(h100, "fa3_fwd_sm90", 128, "float16")["from"] == "TABLE"
    table = row(h200, *key)
    assert (table["Bc"], table["from"], table["chosen on"]) == (configs.TABLE[key].bc, "TABLE", "the h200")
    assert row(h100, "decode_split", 128, configs.FP8)["chosen on"] == "the h100"
    assert h100["tiles of the h100"].startswith("2 row(s) of its own")
    assert h200["tiles of the h200"].startswith("0 row(s) of its own")
    assert [(r["situation"], r["Bc"], r["from"]) for r in h100["tiles of situations on the h100"]] == [
        ("short_causal", 160, "GPU_SITUATION_ROWS")]
    assert "tiles of situations on the h200" not in h200
    assert all("chosen on" not in r for r in invoke_json("list", "--gpu", "sm_80")["tiles"])
    text = invoke("list", "--gpu", "h100").output.splitlines()
    assert any("GPU_ROWS" in line and "the h100" in line and own.why in line for line in text)


@pytest.mark.parametrize("n, causal, rotated", [(4096, False, True), (4096, True, False), (16384, False, False)])
def test_explain_says_when_the_deterministic_backward_rotates(n, causal, rotated):
    """The rotated order runs without a mask where a sequence has at most half as many key blocks as SMs; the
    80-row tile of the default backward is named by its situation."""
    args = ["--gpu", "sm_90", "--batch", "1", "--seqlen-q", str(n), "--heads", "4", "--head-dim", "64"]
    report = invoke_json("explain", *args, "--deterministic", *(["--causal"] if causal else []))
    bwd = next(r for r in report["launches"] if r["kernel"] == "fa3_bwd_sm90")
    assert "fixed order" in bwd["note"] and ("rotated order" in bwd["note"]) is rotated
    args[-1] = "128"
    bwd = next(r for r in invoke_json("explain", *args, *(["--causal"] if causal else []))["launches"]
               if r["kernel"] == "fa3_bwd_sm90")
    assert bwd["Br"] == (64 if causal and n < 8192 else 80)
    assert ("long backward row" in bwd.get("note", "")) is (bwd["Br"] == 80)


@pytest.mark.parametrize("d, q_buffers", [(64, False), (128, True)])
def test_explain_names_the_short_causal_row_and_q_buffers(d, q_buffers):
    args = ["--gpu", "sm_90", "--batch", "2", "--seqlen-q", "1024", "--heads", "16", "--head-dim", str(d), "--causal"]
    fwd = next(r for r in invoke_json("explain", *args)["launches"] if r["kernel"] == "fa3_fwd_sm90")
    assert "the short causal row (<= 1024 keys" in fwd["note"]
    assert ("2 Q_i buffers" in fwd["note"]) is q_buffers


def _api_error(**shape):
    q, k, v = random_qkv(**shape, dtype="float16")
    with pytest.raises((TypeError, ValueError)) as info:
        rawflash.forward(q, k, v, backend="reference")
    return f"{info.type.__name__}: {info.value}"


@pytest.mark.parametrize("options, shape", [
    (["--heads", "6", "--kv-heads", "4"], dict(heads=6, kv_heads=4, head_dim=64)),
    (["--heads", "2", "--kv-heads", "2", "--head-dim", "513"], dict(heads=2, kv_heads=2, head_dim=513)),
])
def test_explain_invalid_call_shows_the_exact_api_error(options, shape):
    args = ["--batch", "1", "--seqlen-q", "3", "--dtype", "float16", "--backend", "reference", *options]
    expected = _api_error(batch=1, seqlen_q=3, seqlen_k=3, **shape)
    result = invoke("explain", *args, code=2)
    assert expected in result.output and "valid: no" in result.output
    report = invoke_json("explain", *args, code=2)
    assert report["valid"] is False and report["error"] == expected


def test_explain_bad_scale_and_empty_problem():
    report = invoke_json("explain", "--scale", "-1", code=2)
    assert report["error"] == "ValueError: scale must be a positive finite real number or None, got -1.0"
    report = invoke_json("explain", "--batch", "0")
    assert report["valid"] is True and "nothing" in report["launched"]


# ---------------------------------------------------------------- check
def test_check_reference_backend_passes():
    report = invoke_json("check", "--backend", "reference", "--seqlen-q", "40", "--seqlen-k", "70", "--heads", "4",
                         "--kv-heads", "2", "--head-dim", "32", "--causal")
    assert [r["quantity"] for r in report["grades"]] == ["out", "lse", "dq", "dk", "dv"]
    assert report["verdict"] == "passed" and all(r["ok"] for r in report["grades"])
    assert [r["factor"] for r in report["grades"]] == [2, 2, 3, 3, 3]
    out = invoke("check", "--backend", "reference", "--seqlen-q", "17", "--head-dim", "16").output
    assert "pass" in out and "verdict: passed" in out


def test_check_grades_a_wrong_result_as_failed(monkeypatch):
    real = rawflash.forward

    def wrong(*args, **kw):
        out, lse = real(*args, **kw)
        return (out.astype(np.float32) * 1.1).astype(out.dtype), lse

    monkeypatch.setattr(rawflash, "forward", wrong)
    result = invoke("check", "--backend", "reference", "--seqlen-q", "32", "--head-dim", "16", code=1)
    assert "FAIL" in result.output and "verdict: FAILED" in result.output


@no_gpu
def test_check_cupy_without_gpu_is_a_clear_error():
    result = invoke("check", code=1)
    assert "needs a CUDA GPU" in result.output and "--backend reference" in result.output


def test_check_numba_backend_missing_is_a_clear_error(monkeypatch):
    real = accuracy.importlib.util.find_spec
    monkeypatch.setattr(accuracy.importlib.util, "find_spec",
                        lambda name, *a: None if name == "rawflash.kernels.numba_backend" else real(name, *a))
    result = invoke("check", "--backend", "numba", code=1)
    assert "numba_backend.py is missing" in result.output


# ---------------------------------------------------------------- ablate, demo
@no_gpu
def test_ablate_without_gpu_is_a_clear_error():
    assert "needs a CUDA GPU" in invoke("ablate", code=1).output


@no_gpu
@pytest.mark.slow
def test_demo_without_gpu_runs_what_it_can():
    result = CliRunner().invoke(commands.main, ["demo", "--json"])
    assert "Traceback" not in result.output
    report = json.loads(result.stdout)
    status = report["simulator"]["status"]
    assert status in ("passed", "missing", "failed")
    assert result.exit_code == (1 if status == "failed" else 0), result.output  # exit 0 when all it could do worked
    assert "compiled for sm_90 but not run" in report["ran"]
    if status == "passed":
        assert [r["quantity"] for r in report["simulator grades"]] == ["out", "lse", "dq", "dk", "dv", "out", "lse"]
    assert report["launches"][0]["kernel"] == "fa3_fwd_sm90", "sm_90 runs FA3's forward"
    assert report["occupancy"][0]["regs"] > 0


# ---------------------------------------------------------------- refused options, unexpected errors
@pytest.mark.parametrize("args, message", [
    (["launch-config", "--dtype", "float64"], "Invalid value for '--dtype'"),
    (["launch-config", "--batch", "0"], "Invalid value for '--batch'"),
    (["launch-config", "--heads", "6", "--kv-heads", "4"], "heads of q must be a multiple of kv_heads"),
    (["occupancy", "--head-dim", "513"], "head_dim must be between 1 and 512, got 513"),
    (["occupancy", "--gpu", "sm_70"], "Invalid value for '--gpu'"),
    (["occupancy", "--arch", "sm_70"], "Invalid value for '--arch'"),
    (["io", "--gpu", "B200"], "Invalid value for '--gpu'"),
    (["explain", "--kernel", "fa3"], "Invalid value for '--kernel'"),
    (["check", "--backend", "torch"], "Invalid value for '--backend'"),
    (["check", "--seqlen-q", "-3"], "Invalid value for '--seqlen-q'"),
    (["ablate", "--seqlens", "1024,abc"], "Invalid value for '--seqlens'"),
    (["launch-config", "--direction", "sideways"], "Invalid value for '--direction'"),
])
def test_bad_options_exit_2_with_a_message(args, message):
    result = invoke(*args, code=2)
    assert message in result.output and "Error" in result.output


def test_unexpected_error_is_one_line_not_a_traceback(monkeypatch):
    def boom(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(introspect, "launch_config_row", boom)
    result = invoke("launch-config", code=1)
    assert "RuntimeError: boom" in result.output and "RAWFLASH_DEBUG" in result.output


@pytest.mark.parametrize("args", [["info"], ["list"], ["launch-config", *SMALL], ["io", *SMALL], ["explain", *SMALL],
                                  ["occupancy", *SMALL, "--gpu", "sm_90"],
                                  ["check", "--backend", "reference", "--seqlen-q", "16", "--head-dim", "16"]])
def test_every_json_report_parses(args):
    report = invoke_json(*args)
    assert isinstance(report, dict) and report


def test_shape_defaults_follow_seqlen_q_and_heads():
    report = invoke_json("explain", "--seqlen-q", "77", "--heads", "3", "--dtype", "float32")
    assert report["problem"]["seqlen_k"] == 77 and report["problem"]["kv_heads"] == 3


# ---------------------------------------------------------------- GPU paths (H200)
gpu = pytest.mark.gpu


@gpu
def test_gpu_occupancy_all_agrees_with_driver():
    for dtype in ("bfloat16", "float32"):
        report = invoke_json("occupancy", "--all", "--dtype", dtype, "--causal")
        assert report["checks"]["calculator != driver"] == "none"
        assert all(r["match"] for r in report["occupancy"])


@gpu
def test_gpu_launch_config_and_info():
    report = invoke_json("launch-config", *SMALL, "--direction", "both")
    assert all(r["ctas_per_sm"] >= 1 for r in report["launches"])
    assert invoke_json("info")["gpus"][0]["cc"]


@gpu
def test_gpu_check_cupy_backend():
    for kernel in ("fa2", "fa1", "naive"):
        report = invoke_json("check", *SMALL, "--kernel", kernel, "--backend", "cupy")
        assert report["verdict"] == "passed"


@gpu
def test_gpu_io_measure_or_clear_ncu_message():
    result = CliRunner().invoke(commands.main, ["io", "--batch", "1", "--heads", "2", "--seqlen-q", "512", "--measure",
                                           "--json"])
    report = json.loads(result.stdout)
    if ncu.ncu_path() is None:
        assert result.exit_code == 1 and "not on PATH" in report["measure"]
    else:
        assert result.exit_code == 0, result.output
        fa2 = next(r for r in report["io"] if (r["kernel"], r["dir"]) == ("fa2", "fwd"))
        assert fa2["measured_read_MB"] > 0


@gpu
@pytest.mark.slow
def test_gpu_ablate_small(tmp_path):
    report = invoke_json("ablate", "--head-dims", "64", "--seqlens", "1024", "--repeats", "3", "--out", tmp_path)
    assert {r["variant"] for r in report["ablation"]} == set(forms.ABLATIONS)
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in report["ablation"])
    assert (tmp_path / "ablation.json").is_file()


@gpu
@pytest.mark.slow
def test_gpu_demo():
    report = invoke_json("demo")
    assert report["verdict"] == "passed" and report["timings"][0]["tflops"] > 0
    assert np.isfinite(report["timings"][0]["speedup_vs_cupy"])


def test_accuracy_inputs_are_not_zeros():
    x = accuracy.random_inputs(dataclasses.replace(SMALL_PROBLEM, batch=1))
    assert all(np.abs(a.astype(np.float32)).max() > 0.5 for a in x.values())


def test_info_list_explain_do_not_import_numba():
    """numba must stay unloaded until a command chooses the simulator or not (NUMBA_ENABLE_CUDASIM is read once)."""
    code = ("import sys; from click.testing import CliRunner; from rawflash.cli import commands; "
            "[CliRunner().invoke(commands.main, a, catch_exceptions=False) "
            "for a in (['info'], ['list'], ['explain'])]; "
            "assert 'numba' not in sys.modules, 'numba was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=sysinfo.child_env())
    assert done.returncode == 0, done.stderr
