"""tools/tune_record.py, what tools/tune.py and tools/tune_decode.py record of a run, without a GPU: the GPU that
measured, the row a case takes today, which candidate beats it, the configs entry printed for it (parsed back
here) and the JSON; and both tools still take their arguments."""
from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rawflash.kernels import configs
from rawflash.kernels.configs import TileConfig

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


def test_the_entry_is_the_configs_row_with_the_measured_figures():
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
    ("tune.py", ("--seqlen", "--dtype", "--head-dims", "--which", "--features", "--out")),
    ("tune_decode.py", ("--repeats", "--case", "--br", "--splits", "--dtype", "--out"))])
def test_the_tools_import_and_keep_their_arguments(tool, options):
    """Each tool loads without a GPU (its imports, tune_record among them) and takes its arguments and --out."""
    run = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert all(o in run.stdout for o in options)
