"""tools/tune_record.py, what tools/tune.py and tools/tune_decode.py record of a run, without a GPU: the GPU that
measured, the row a case takes today, which candidate beats it, the configs entry printed for it (parsed back
here) and the JSON; both tools still take their arguments; and tools/tune.py --head-dim-v's DV rows (the
candidates, their shared memory, the override that runs them, the VALUE_ROWS entry and the argument's checks)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rawflash.kernels import configs, forms
from rawflash.kernels.configs import TileConfig
from rawflash.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tune_record", ROOT / "tools" / "tune_record.py")
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)

KEY = ("fa3_fwd_sm90", 128, "bfloat16")
H100 = rec.gpu_record("NVIDIA H100 80GB HBM3", "sm_90", 50 << 20, "h100")


def test_the_record_names_the_gpu_by_its_arch_and_l2():
    assert H100["gpu"] == "h100" and rec.gpu_record("NVIDIA H200", "sm_90", 60 << 20, "h200")["gpu"] == "h200"
    line = rec.header(H100)
    assert line.startswith("NVIDIA H100 80GB HBM3 (sm_90, L2 50 MB): the h100") and "RAWFLASH_TILE_GPU" not in line
    other = rec.header(rec.gpu_record("NVIDIA H100 80GB HBM3", "sm_90", 50 << 20, "h200"))
    assert "rows the h200 takes today (RAWFLASH_TILE_GPU)" in other and "GPU_ROWS['h100']" in other


def test_rows_compare_and_print_without_their_why():
    row = TileConfig(128, 160, 12, stages=2, q_stages=2, why="a reason")
    assert rec.same_tile(row, TileConfig(128, 160, 12, stages=2, q_stages=2)) and not rec.same_tile(row, None)
    assert not rec.same_tile(row, TileConfig(128, 160, 12, stages=3, q_stages=2))
    assert rec.tile_label(row) == "128, 160, 12, stages=2, q_stages=2"
    table = configs.TABLE[("fa2_fwd_sm90", 64, "bfloat16")]  # min_blocks, general_min_blocks
    assert eval(f"TileConfig({rec.tile_label(table)})") == dataclasses.replace(table, why="")


TODAY = configs.TABLE[KEY]
FAST, SLOW = TileConfig(128, 160, 12, stages=2), TileConfig(128, 128, 12, stages=2)


def test_the_fastest_candidate_that_beats_todays_row_is_chosen():
    """The geometric mean of the speed-ups over today's row ranks candidates; one that failed a case, today's own
    tile (why aside), a loser and a run where today's row did not run give nothing; ms count lower as faster."""
    times = {TODAY: {"a": 500.0, "b": 400.0}, FAST: {"a": 540.0, "b": 390.0}, SLOW: {"a": 600.0, "b": None},
             TileConfig(128, 176, 12, stages=2): {"a": 900.0, "b": 900.0}}
    assert rec.best_change(times, TODAY, "TFLOP/s") == FAST
    assert rec.best_change({TODAY: times[TODAY], SLOW: {"a": 400.0, "b": 400.0}}, TODAY, "TFLOP/s") is None
    assert rec.best_change({FAST: times[FAST]}, TODAY, "TFLOP/s") is None, "today's row not timed"
    assert rec.best_change({TODAY: {"a": None, "b": 1.0}, FAST: {"a": 1.0, "b": 1.0}}, TODAY, "TFLOP/s") is None
    ms = {TODAY: {"a": 0.0727}, FAST: {"a": 0.0629}, SLOW: {"a": 0.0800}}
    assert rec.best_change(ms, TODAY, "ms") == FAST


def _parse(entry: str) -> dict:
    """The pasted lines as configs would read them, inside GPU_ROWS['h100']'s braces."""
    body = "\n".join(line for line in entry.splitlines() if not line.startswith("#"))
    return eval("{\n" + body + "\n}", {"TileConfig": TileConfig})


def test_the_entry_is_the_configs_row_with_the_measured_figures(monkeypatch):
    monkeypatch.setitem(configs.GPU_ROWS, "h100", {})  # the entry against the table's row
    times = {TODAY: {"N=2048 causal=False": 500.0, "N=2048 causal=True": 400.0},
             FAST: {"N=2048 causal=False": 540.0, "N=2048 causal=True": 410.0}}
    today = rec.today(*KEY, (), "h100")
    got = rec.suggestion(KEY, times, today, "TFLOP/s", "h100", "N 2k full/causal")
    assert got["where"] == "GPU_ROWS['h100']" and got["row"] == "128, 160, 12, stages=2"
    assert got["why"] == "N 2k full/causal: 540/410 vs today's 500/400 TFLOP/s (H100 bf16)"
    assert got["entry"].splitlines()[0] == "# configs.GPU_ROWS['h100']:"
    assert _parse(got["entry"]) == {KEY: TileConfig(128, 160, 12, stages=2, why=got["why"])}
    long_why = "x" * 50 + " " + "y" * 150 + " z"
    text = rec.entry(("decode_split", 128, configs.FP8), TileConfig(32, 16, 4, stages=4), long_why, "GPU_ROWS['h100']")
    assert all(len(line) <= 120 for line in text.splitlines())
    assert _parse(text)[("decode_split", 128, configs.FP8)].why == long_why
    assert rec.suggestion(KEY, {TODAY: times[TODAY]}, today, "TFLOP/s", "h100") == {}


def test_more_than_four_cases_give_the_range_of_speed_ups():
    base = {str(i): 1.0 for i in range(6)}
    cand = {str(i): 1.0 / (1 + i / 10) for i in range(6)}
    why = rec.figures_why(cand, base, "ms", "h100", configs.FP8)
    assert why.endswith("x today's row (1.00 - 1.50x) on 6 cases (H100 fp8)") and why.startswith("1.2")


def test_today_names_the_entry_a_gpu_row_would_replace(monkeypatch):
    """A call without a situation takes the GPU's row, else the table's (entry: GPU_ROWS); a short window's call
    WINDOW_ROWS' (entry: GPU_SITUATION_ROWS[gpu]['short_window'])."""
    monkeypatch.setitem(configs.GPU_ROWS, "h100", {})
    assert rec.today(*KEY, (), "h100")["row"] == configs.TABLE[KEY]
    own = TileConfig(128, 160, 12, stages=2, why="measured")
    monkeypatch.setitem(configs.GPU_ROWS, "h100", {KEY: own})
    assert rec.today(*KEY, (), "h100") == {"row": own, "source": "GPU_ROWS", "situation": "",
                                           "entry": "GPU_ROWS['h100']"}
    assert rec.today(*KEY, (), "h200")["row"] == configs.TABLE[KEY]
    window = rec.today(*KEY, ("short_window",), "h100")
    assert window["row"] == configs.WINDOW_ROWS[KEY]
    assert window["entry"] == "GPU_SITUATION_ROWS['h100']['short_window']"


def test_the_json_keeps_the_gpu_the_date_every_row_and_the_entries(tmp_path, capsys):
    """rec.finish prints the entries (or that none beats today's rows) and writes the JSON with --out."""
    rows = [rec.measurement(*KEY, "N=2048 causal=False", FAST, "ok", 540.0, "TFLOP/s", False),
            rec.measurement(*KEY, "N=2048 causal=True", SLOW, "invalid: dq 3e-2 > 1e-2", None, "TFLOP/s", False)]
    out = tmp_path / "tune.json"
    found = {"where": "GPU_ROWS['h100']", "entry": "# configs.GPU_ROWS['h100']:"}
    rec.finish(H100, "tools/tune.py", ["--which", "fwd_fa3"], str(out), rows, [{}, found])
    assert capsys.readouterr().out == found["entry"] + "\n"
    got = json.loads(out.read_text())
    assert got["gpu"] == H100 and got["date"] == datetime.date.today().isoformat()
    assert got["tool"] == "tools/tune.py" and got["argv"] == ["--which", "fwd_fa3"] and got["entries"] == [found]
    assert got["rows"][0] == {"kernel": "fa3_fwd_sm90", "head_dim": 128, "dtype": "bfloat16",
                              "case": "N=2048 causal=False", "row": "128, 160, 12, stages=2", "verdict": "ok",
                              "value": 540.0, "unit": "TFLOP/s", "today": False}
    assert got["rows"][1]["value"] is None and got["rows"][1]["verdict"].startswith("invalid")
    rec.finish(H100, "tools/tune.py", [], None, rows, [{}])
    assert capsys.readouterr().out.startswith("no candidate beats the rows the h100 takes today")


@pytest.mark.parametrize("tool, options", [
    ("tune.py", ("--seqlen", "--dtype", "--head-dims", "--head-dim-v", "--which", "--features", "--out")),
    ("tune_decode.py", ("--repeats", "--case", "--br", "--splits", "--dtype", "--out"))])
def test_the_tools_import_and_keep_their_arguments(tool, options):
    """Each tool loads without a GPU (its imports, tune_record among them) and takes its arguments and --out."""
    run = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert all(o in run.stdout for o in options)


def _tune():
    """tools/tune.py as a module (its folder on the path for its tune_record import)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("tune_tool", ROOT / "tools" / "tune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tune = _tune()
VALUE_KEYS = [k for k in configs.VALUE_ROWS if k[0] in tune.VALUE_WHICH.values()]


@pytest.mark.parametrize("key", VALUE_KEYS)
def test_the_dv_candidates_fit_and_run_through_the_override(key):
    """VALUE_ROWS' row first, then other rows, each within sm_90's 232,448 B with v at its width and, passed as the
    override under VALUE_ROWS' key, the row the call's DV form launches (the bytes are the launch's)."""
    kernel, d, dv, dtype = key
    cands = tune.value_candidates(key)
    assert cands[0] == configs.VALUE_ROWS[key] and len(cands) > 1 and tune.SMEM_LIMIT == 232448
    assert len({dataclasses.replace(c, why="") for c in cands}) == len(cands)
    p = Problem(1, 1, 1, 1, 1, d, dtype, True, "sm_90", head_dim_v=dv)
    for cfg in cands:
        if kernel == "fa3_fwd_sm90":
            lau = forms.fa2_forward(p, forms.Switches(wgmma=True, warp_specialize=True), forms.DV_FORM, {key: cfg})
        else:
            lau = forms.fa2_backward_main(p, True, True, forms.DV_FORM, {key: cfg}, warp_specialize=True)
        assert lau.kernel == kernel and lau.config == cfg and forms.reads_value_head_dim(lau)
        assert lau.smem == tune.value_smem(kernel, cfg, d, dv) <= tune.SMEM_LIMIT
    assert tune.value_key(kernel, d, dv, dtype) == key


def test_the_dv_candidates_are_the_rows_that_fit(monkeypatch):
    """The forward at 192 / 128 offers 96 and 112 keys (160 does not fit), the column split's backward a third Q_i
    stage in 232,040 B; a row past the limit is left out."""
    bf = "bfloat16"
    fwd = tune.value_candidates(("fa3_fwd_sm90", 192, 128, bf))
    assert {(c.br, c.bc, c.stages, c.q_stages) for c in fwd} == {(128, 128, 2, 1), (128, 96, 2, 1), (128, 112, 2, 1),
                                                                 (128, 96, 2, 2)}
    bwd = tune.value_candidates(("fa3_bwd_sm90", 192, 128, bf))
    assert [(c.br, c.bc, c.stages) for c in bwd] == [(64, 64, 2), (64, 64, 3)]
    assert tune.value_smem("fa3_bwd_sm90", bwd[1], 192, 128) == 232040
    big = TileConfig(128, 160, 12, stages=2)
    assert tune.value_smem("fa3_fwd_sm90", big, 192, 128) == 255072
    pair = ("fa3_fwd_sm90", 192, 128)
    monkeypatch.setitem(tune.VALUE_CANDIDATES, pair, [*tune.VALUE_CANDIDATES[pair], big])
    assert tune.value_candidates((*pair, bf)) == fwd


def test_the_dv_sweep_prints_a_value_rows_entry(monkeypatch, capsys):
    """tune_values on DeepSeek-V3-like cases (B = 16384 / N, H = 2048 / d, v of head_dim_v columns; the kernels
    faked): every candidate validated and timed, the rows recorded with head_dim_v, and the faster candidate's
    configs.VALUE_ROWS entry, which parses back to the row under VALUE_ROWS' key."""
    key = ("fa3_fwd_sm90", 192, 128, "bfloat16")
    fast = tune.value_candidates(key)[2]
    seen = []

    def run_case(case, repeats, validated, override, check=None):
        seen.append(case)
        row = override[key]
        return type("Run", (), {"kernel_tflops": 600.0 if rec.same_tile(row, fast) else 500.0, "status": "ok"})

    monkeypatch.setattr(tune, "valid", lambda case, override: "ok")
    monkeypatch.setattr(tune.bench, "run_case", run_case)
    args = argparse.Namespace(seqlen="4096,8192", head_dim_v=128, which="fwd_fa3", dtype="bfloat16")
    rows, entries = [], []
    tune.tune_values(args, [192], "h100", rows, entries)
    assert {(c.batch, c.heads, c.seqlen, c.head_dim, c.head_dim_v) for c in seen} == {(4, 10, 4096, 192, 128),
                                                                                     (2, 10, 8192, 192, 128)}
    assert len(rows) == 4 * len(tune.value_candidates(key)) and all(r["head_dim_v"] == 128 for r in rows)
    assert sum(r["today"] for r in rows) == 4
    got = entries[0]
    assert got["where"] == "VALUE_ROWS" and got["entry"].splitlines()[0] == "# configs.VALUE_ROWS:"
    assert _parse(got["entry"]) == {key: dataclasses.replace(fast, why=got["why"])}
    assert got["why"] == "N 4k/8k full/causal: 600/600/600/600 vs today's 500/500/500/500 TFLOP/s (H100 bf16)"
    rec.finish(H100, "tools/tune.py", [], None, rows, [{}], "configs.VALUE_ROWS")
    assert capsys.readouterr().out.strip().endswith("configs.VALUE_ROWS keeps what it has")


@pytest.mark.parametrize("which, dims, dv, features, says", [
    ("fwd_fa3", [192], 130, "", "a positive multiple of 8"), ("fwd_fa3", [128], 192, "", "at most each"),
    ("fwd_fa3", [192], 0, "", "positive multiple"), ("fwd,bwd_sm90", [192], 128, "", "--which fwd_fa3, bwd_sm90"),
    ("fwd_fa3", [192], 128, "window", "no --features"), ("bwd_sm90", [256], 128, "", "no fa3_bwd_sm90 row"),
    ("fwd_fa3", [1024], 128, "", "head_dim must be at most")])
def test_head_dim_v_is_checked(which, dims, dv, features, says):
    assert says in tune.value_args_error(which.split(","), dims, dv, "bfloat16", features)


def test_head_dim_v_pairs_with_a_value_row():
    """96 / 64 compiles as 128 / 64 (whole 64-column panels): VALUE_ROWS' row; 192 / 128 both kernels."""
    assert tune.value_args_error(["fwd_fa3", "bwd_sm90"], [192], 128, "bfloat16", "") == ""
    assert tune.value_args_error(["fwd_fa3"], [96, 128], 64, "float16", "") == ""
    assert tune.value_key("fa3_fwd_sm90", 96, 64, "float16") == ("fa3_fwd_sm90", 128, 64, "float16")


def test_a_refused_head_dim_v_exits_before_any_gpu_work():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "tune.py"), "--which", "fwd_fa3", "--head-dims", "128",
                          "--head-dim-v", "100"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--head-dim-v must be a positive multiple of 8" in run.stderr


@pytest.mark.parametrize("d", sorted(forms.FA3_TILE_CANDIDATES))
def test_the_compiled_fa3_candidates_are_tuned(d):
    """Every row forms.FA3_TILE_CANDIDATES compiles for FA3's forward is among tools/tune.py's candidates at its head
    dim (otherwise `tune.py --which fwd_fa3` times today's row alone there)."""
    assert set(forms.FA3_TILE_CANDIDATES[d]) <= set(tune.CANDIDATES[("fa3_fwd_sm90", d)])
