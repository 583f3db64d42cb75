"""One vocabulary across the command line: --gpu (an arch or a model) wherever a target matters, the same shape
options, --causal/--no-causal, --json on every command (errors too), exit status 2 for every invalid input, and a
reason beside every '-' in a table. Plus the target resolution itself and what follows the target.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from conftest import gpu_available
from rawflash.cli import commands, introspect, iomodel, occupancy, sysinfo
from rawflash.kernels import configs, forms
from rawflash.problem import Problem

no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")
TARGETED = ("launch-config", "occupancy", "io", "explain", "list", "demo")
SHAPED = ("launch-config", "occupancy", "io", "explain", "check")
SHAPE_OPTIONS = ("--batch", "--seqlen-q", "--seqlen-k", "--heads", "--kv-heads", "--head-dim", "--dtype", "--causal")
TINY = ["--batch", "1", "--seqlen-q", "40", "--seqlen-k", "70", "--heads", "4", "--kv-heads", "2", "--head-dim",
        "64", "--dtype", "float16", "--causal"]


def run(*args):
    return CliRunner().invoke(commands.main, [str(a) for a in args])


def run_json(*args, code=0):
    result = run(*args, "--json")
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def options_of(name: str) -> dict[str, click.Parameter]:
    command = commands.main.commands[name]
    return {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts)}


# ---------------------------------------------------------------- the options
def test_every_command_takes_json():
    for name, command in commands.main.commands.items():
        assert "--json" in options_of(name), name
        assert "--json" in run(name, "--help").output


def test_one_target_option_with_the_same_choices():
    choices = introspect.target_names()
    for name in TARGETED:
        opt = options_of(name)["--gpu"]
        assert list(opt.type.choices) == choices, name
        assert options_of(name)["--arch"].hidden, f"{name}: --arch is a hidden deprecated alias"
    for name in set(commands.main.commands) - set(TARGETED):
        assert "--gpu" not in options_of(name) and "--arch" not in options_of(name), name


def test_same_shape_options_and_causal_flag_everywhere():
    for name in SHAPED:
        have = options_of(name)
        assert all(o in have for o in SHAPE_OPTIONS), name
    for name in commands.main.commands:
        have = options_of(name)
        if "--causal" in have:
            assert have["--causal"].is_flag and "--no-causal" in have, f"{name}: --causal/--no-causal"


def test_bench_causal_defaults_to_both():
    assert commands._causal_modes(None) == [False, True]
    assert commands._causal_modes(True) == [True] and commands._causal_modes(False) == [False]
    assert options_of("bench")["--causal"].default is None


def test_bench_feature_head_dim_goes_with_features_and_sets_every_case():
    result = run("bench", "--feature-head-dim", "256")
    assert result.exit_code == commands.EXIT_INVALID and "--feature-head-dim goes with --features" in result.output
    from rawflash.cli import bench as bench_mod

    cases = bench_mod.feature_cases(256)
    assert {c.head_dim for c in cases} == {256} and {c.heads for c in cases} == {8}


# ---------------------------------------------------------------- exit status
@pytest.mark.parametrize("name", SHAPED)
def test_an_invalid_call_exits_2_from_every_command(name):
    bad = ["--heads", "6", "--kv-heads", "4", "--head-dim", "32", "--backend" if name == "check" else None,
           "reference" if name == "check" else None]
    result = run(name, *[a for a in bad if a])
    assert result.exit_code == commands.EXIT_INVALID, result.output
    assert "heads of q must be a multiple of kv_heads" in result.output


@pytest.mark.parametrize("name", sorted(commands.main.commands))
def test_a_bad_option_value_exits_2_from_every_command(name):
    opts = options_of(name)
    bad = (["--gpu", "B200"] if "--gpu" in opts else ["--dtype", "float64"] if "--dtype" in opts else
           ["--no-such-option"])
    result = run(name, *bad)
    assert result.exit_code == commands.EXIT_INVALID, result.output
    report = run_json(name, *bad, code=commands.EXIT_INVALID)
    assert report["exit_code"] == commands.EXIT_INVALID and report["command"] == name


def test_errors_are_json_with_json():
    report = run_json("launch-config", "--dtype", "float64", code=2)
    assert "Invalid value for '--dtype'" in report["error"] and report["exit_code"] == 2
    assert report["command"] == "launch-config"
    report = run_json("io", "--heads", "6", "--kv-heads", "4", code=2)
    assert "heads of q must be a multiple of kv_heads" in report["error"]
    report = run_json("explain", "--heads", "6", "--kv-heads", "4", code=2)  # explain's report is the error
    assert report["valid"] is False and "kv_heads" in report["error"]


@no_gpu
@pytest.mark.parametrize("args", [["ablate"], ["bench"], ["check"], ["io", "--seqlen-q", "64", "--measure"]])
def test_no_gpu_errors_are_json_and_exit_1(args):
    report = run_json(*args, code=1)
    text = report.get("error") or report.get("measure")
    assert "needs a CUDA GPU" in text


def test_deprecated_arch_still_works_and_says_so():
    result = CliRunner().invoke(commands.main, ["launch-config", *TINY, "--arch", "sm_80", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["target"].startswith("sm_80")
    assert "--arch is deprecated" in result.stderr
    result = run("launch-config", "--arch", "sm_80", "--gpu", "H200")
    assert result.exit_code == 2 and "disagree" in result.output


# ---------------------------------------------------------------- the target
def test_targets_resolve_in_one_place():
    a100 = introspect.target("A100-80GB-SXM")
    assert (a100.arch, a100.sms, a100.peaks, a100.on_gpu) == ("sm_80", 108, iomodel.GPUS["A100-80GB-SXM"], False)
    assert a100.limits is occupancy.ARCHS["sm_80"]
    assert introspect.target("h200") == introspect.target("H200")
    assert introspect.target("H200").sms == 132
    sm86 = introspect.target("sm_86")
    assert (sm86.arch, sm86.sms, sm86.name) == ("sm_86", 72, "A10") and "A10" in sm86.description
    assert introspect.target("sm_86", sms=84).sms == 84
    with pytest.raises(ValueError, match="gpu must be one of"):
        introspect.target("B200")


def test_models_cover_iomodel_and_the_occupancy_archs():
    for key, peaks in iomodel.GPUS.items():
        assert introspect.MODELS[key].peaks == peaks
    for m in introspect.MODELS.values():
        assert m.arch in occupancy.ARCHS and m.sms > 0 and m.peaks.tensor_tflops > m.peaks.fp32_tflops > 0
    assert set(introspect.ARCH_MODELS) == set(occupancy.ARCHS)
    assert all(introspect.MODELS[m].arch == a for a, m in introspect.ARCH_MODELS.items())
    assert introspect.model_of_device("NVIDIA A100-SXM4-40GB").name == "A100-40GB-SXM"
    assert introspect.model_of_device("NVIDIA A10").name == "A10"
    assert introspect.model_of_device("NVIDIA L40S").name == "L40S"
    assert introspect.model_of_device("NVIDIA H200").name == "H200"
    assert introspect.model_of_device("Tesla T4") is None


@no_gpu
def test_the_default_target_is_an_h200_offline():
    report = run_json("launch-config", *TINY)
    assert report["target"].startswith("no GPU here and no --gpu: H200 (sm_90)") and "132 SMs" in report["target"]


@pytest.mark.compile
def test_a_named_a100_shows_the_sm80_forms_and_tiles_everywhere():
    a100 = dataclasses.replace(introspect.kernel_problem(Problem(1, 40, 70, 4, 2, 64, "float16", True)), arch="sm_80")
    want = [lau.name_expression for lau in forms.forward_plan(a100) + forms.backward_plan(a100)]
    rows = run_json("launch-config", *TINY, "--direction", "both", "--gpu", "A100-80GB-SXM")["launches"]
    assert [r["instantiation"] for r in rows] == want
    assert all(r["waves"] == round(r["ctas"] / (r["ctas_per_sm"] * 108), 2) for r in rows)
    occ = run_json("occupancy", *TINY, "--direction", "both", "--gpu", "A100-80GB-SXM")
    assert [r["instantiation"] for r in occ["occupancy"]] == want
    explained = run_json("explain", *TINY, "--gpu", "A100-80GB-SXM")
    assert [r["instantiation"] for r in explained["launches"]] == want
    assert not any("sm90" in r["kernel"] for r in explained["launches"])
    assert [r["runs"] for r in explained["predicted"]] == ["rawflash fa2_fwd", "rawflash fa2_bwd"]
    io = {(r["kernel"], r["dir"]): r for r in run_json("io", *TINY, "--gpu", "A100-80GB-SXM")["io"]}
    cfg = forms.fa2_forward(a100).config
    assert (io[("fa2", "fwd")]["Br"], io[("fa2", "fwd")]["Bc"]) == (cfg.br, cfg.bc)
    # and the H200 shows the wgmma forms of the same call
    h200 = run_json("explain", *TINY, "--gpu", "H200")
    assert [r["kernel"] for r in h200["launches"]][::2] == ["fa3_fwd_sm90", "fa3_bwd_sm90"]


def test_list_shows_the_target_rows_and_what_does_not_fit():
    rows = run_json("list", "--gpu", "A100-80GB-SXM")["tiles"]
    assert not any(r["kernel"].endswith("_sm90") for r in rows)
    fwd = next(r for r in rows if r["kernel"] == "fa2_fwd" and "128" in r["head_dims"].split(",")
               and "bfloat16" in r["dtypes"])
    assert (fwd["Br"], fwd["Bc"]) == (configs.ARCH_ROWS["sm_80"][("fa2_fwd", 128, "bfloat16")].br,
                                      configs.ARCH_ROWS["sm_80"][("fa2_fwd", 128, "bfloat16")].bc)
    report = run_json("list", "--gpu", "sm_86")
    assert report["no tile fits sm_86's shared memory for"] == introspect.unfit_summary("sm_86")
    assert "backward: 16-bit d = " in introspect.unfit_summary("sm_86") and "256" in introspect.unfit_summary("sm_89")
    assert introspect.unfit_summary("sm_90") == introspect.unfit_summary("sm_80") == "nothing"


def test_fit_rows_agree_with_launch_py():
    for arch, limits in occupancy.ARCHS.items():
        for r in introspect.fit_rows(arch):
            p = Problem(1, 1, 1, 1, 1, r["head_dim"], r["dtype"], False, arch)
            kernel = "fa1" if r["call"] == "forward fa1" else "fa2"
            direction = "fwd" if r["call"].startswith("forward") else "bwd"
            det = r["call"] == "deterministic backward"
            every = [lau for _, lau in introspect.launches(p, kernel, direction, det)]
            assert r["fits"] == all(lau.smem <= limits.smem_per_block_optin for lau in every)


@pytest.mark.compile
def test_a_launch_that_does_not_fit_says_why():
    rows = run_json("launch-config", "--head-dim", "256", "--direction", "bwd", "--gpu", "RTX-3090")["launches"]
    main = next(r for r in rows if r["kernel"] == "fa2_bwd")
    assert main["ctas_per_sm"] is None and main["waves"] is None
    assert main["note"].startswith("does not fit: ") and "sm_86 allows 99 KB" in main["note"]
    text = run("launch-config", "--head-dim", "256", "--direction", "bwd", "--gpu", "RTX-3090").output
    assert "does not fit" in text


def test_explain_reference_launches_nothing():
    report = run_json("explain", *TINY, "--backend", "reference")
    assert report["valid"] and "nothing" in report["launched"] and "launches" not in report


def test_io_without_peaks_is_explained():
    tgt = dataclasses.replace(introspect.target("H200"), peaks=None, name="Tesla T4")
    rows = introspect.io_rows(dataclasses.replace(Problem(1, 64, 64, 2, 2, 64, "float16", False), arch="sm_90"), tgt)
    assert all(r["bound_ms"] is None and "no peak numbers for Tesla T4" in r["note"] for r in rows)
    assert "no peak numbers for Tesla T4" in introspect.roofline_note(tgt)


# ---------------------------------------------------------------- every '-' has its reason
def _tables(report, path=""):
    if isinstance(report, dict):
        for k, v in report.items():
            yield from _tables(v, f"{path}/{k}")
    elif isinstance(report, list) and report and all(isinstance(r, dict) for r in report):
        yield path, report


@pytest.mark.compile
@pytest.mark.parametrize("args", [
    ["launch-config", *TINY, "--direction", "both", "--kernel", "fa1"],
    ["launch-config", "--head-dim", "256", "--direction", "bwd", "--deterministic", "--gpu", "L4"],
    ["occupancy", *TINY, "--direction", "both", "--gpu", "sm_89", "--head-dim", "256"],
    ["io", *TINY, "--gpu", "A10"],
    ["explain", *TINY, "--kernel", "naive", "--gpu", "A100-40GB-SXM"],
    ["explain", *TINY, "--head-dim", "200", "--gpu", "sm_86"],
    ["list", "--gpu", "sm_89"],
    ["check", "--backend", "reference", "--seqlen-q", "16", "--head-dim", "16"],
])
def test_every_dash_in_a_table_has_a_reason(args):
    report = run_json(*args)
    for path, rows in _tables(report):
        for r in rows:
            empty = [k for k, v in r.items() if v is None]
            if empty:
                assert r.get("note"), f"{args[0]} {path}: {empty} are '-' without a note in {r}"


# ---------------------------------------------------------------- the Numba backend, in child processes
def _child_cli(*args, sim=True, timeout=300):
    env = sysinfo.child_env(**({"NUMBA_ENABLE_CUDASIM": "1"} if sim else {}))
    return subprocess.run([sys.executable, "-m", "rawflash", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_explain_numba_shows_the_twins_launches():
    code = ("import json, dataclasses; from rawflash.kernels import launch, numba_backend; "
            "from rawflash.cli import introspect; "
            "from rawflash.problem import Problem; p = Problem(1, 40, 70, 4, 2, 64, 'float16', True); "
            "print(json.dumps([[t.kernel, 'x'.join(map(str, t.grid)), str(t.threads), t.smem] "
            "for t in numba_backend.twin_launches(p, 'fa2', 'both', False)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=sysinfo.child_env())
    assert done.returncode == 0, done.stderr
    twins = json.loads(done.stdout)
    shown = _child_cli("explain", *TINY, "--backend", "numba", "--json", sim=False)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    rows = json.loads(shown.stdout)["launches"]
    assert [[r["kernel"], r["grid"], r["block"], r["smem"]] for r in rows] == twins
    assert rows[0]["block"] == str(forms.fa2_forward(Problem(1, 40, 70, 4, 2, 64, "float16", True),
                                                     forms.Switches(wgmma=False)).config.br)


@no_gpu
@pytest.mark.slow
def test_check_numba_on_the_simulator_defaults_to_seconds_and_shows_progress():
    done = _child_cli("check", "--backend", "numba", "--json", sim=False)  # the command switches the simulator on
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    shape = commands.SIMULATOR_SHAPE
    assert report["shape"].startswith(f"batch {shape['batch']}, seqlen_q {shape['seqlen_q']}")
    assert report["verdict"] == "passed" and float(report["simulator estimate"].split()[0]) < commands.SIMULATOR_WARN_S
    assert "simulating fa2_fwd" in done.stderr and "simulating fa2_bwd" in done.stderr
    assert "warning" not in done.stderr


@no_gpu
def test_check_numba_warns_with_an_estimate_for_a_large_shape():
    code = ("import sys; from rawflash.cli import commands, introspect; real = introspect.simulator_seconds; "
            "introspect.simulator_seconds = lambda p, *a, **k: 5400.0 if p.seqlen_q == 40 else real(p, *a, **k); "
            "commands.main(['check', '--backend', 'numba', '--seqlen-q', '40', '--heads', '1', '--head-dim', '16'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=sysinfo.child_env(),
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warning: Numba's CPU simulator needs about 1.5 h for this shape" in done.stderr
    assert "the default --backend numba shape takes about" in done.stderr


def test_simulator_estimates_order_the_shapes():
    code = ("import json; from rawflash.cli import commands, introspect; from rawflash.problem import Problem; "
            "s = commands.SIMULATOR_SHAPE; small = Problem(s['batch'], s['seqlen_q'], s['seqlen_q'], s['heads'], "
            "s['heads'], s['head_dim'], 'bfloat16', False); old = Problem(1, 256, 256, 4, 4, 64, 'bfloat16', False); "
            "print(json.dumps([introspect.simulator_seconds(small), introspect.simulator_seconds(old)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=sysinfo.child_env())
    assert done.returncode == 0, done.stderr
    small, old = json.loads(done.stdout)
    assert small < 10 and old > commands.SIMULATOR_WARN_S  # old: a shape over the warning, 41-45 s on 2 cores


def test_python_m_rawflash_runs_the_command_line():
    done = _child_cli("--help", sim=False)
    assert done.returncode == 0 and "Usage: rawflash" in done.stdout and "launch-config" in done.stdout
    done = _child_cli("explain", "--heads", "6", "--kv-heads", "4", sim=False)
    assert done.returncode == 2


def test_check_numba_without_numba_says_how_to_install_it():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'numba' or name.startswith('numba.'):\n"
            "            raise ModuleNotFoundError(\"No module named 'numba'\")\n"
            "sys.meta_path.insert(0, Block())\n"
            "from rawflash.cli import commands\n"
            "commands.main(['check', '--backend', 'numba', '--json'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=sysinfo.child_env(),
                          timeout=120)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["exit_code"] == 1, done.stdout + done.stderr
    assert "No module named 'numba'" in report["error"] and "pip install 'rawflash[numba]'" in report["error"]
