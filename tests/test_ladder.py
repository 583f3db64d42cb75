"""The ladder (``rawflash ablate --ladder``, ``rawflash.cli.ablation.LADDER``) and fa1's splits, without a GPU: the rung
table, the bytes each rung is predicted to move (checked against iomodel with the rung's own plan), the speedup
over the rung below, the chart, and the command's no-GPU path. The GPU test at the end runs the climb for real."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import gpu_available
from rawflash import api
from rawflash.cli import ablation, commands, iomodel
from rawflash.kernels import forms, launch
from rawflash.problem import Problem, cdiv

FA3_SWITCHES = {"warp_specialize", "pingpong", "persistent"}  # FA3's switches (overlap is the wgmma form's too)
no_gpu = pytest.mark.skipif(gpu_available(), reason="checks the path taken without a GPU")
SHAPE = Problem(4, 4096, 4096, 16, 16, 128, "bfloat16", False)


def _invoke(*args, code=0):
    result = CliRunner().invoke(commands.main, [str(a) for a in args])
    assert "Traceback" not in result.output
    assert result.exit_code == code, result.output
    return result


# ---------------------------------------------------------------- the rung table
def test_ladder_climbs_from_naive_through_fa1_fa2_wgmma_to_fa3():
    names = [r.name for r in ablation.LADDER]
    assert len(set(names)) == len(names)
    assert [r.kernel for r in ablation.LADDER[:2]] == ["naive", "fa1"]
    assert all(r.kernel == "fa2" for r in ablation.LADDER[2:])
    # FA2's three ideas come in one at a time, on the mma.sync form, ending at full fa2
    fa2 = [r.kwargs for r in ablation.LADDER[2:6]]
    assert fa2[0] == {"defer_norm": False, "seq_parallel": False, "split_q": False, "wgmma": False}
    assert fa2[-1] == {"wgmma": False}
    for before, after in zip(fa2, fa2[1:]):
        assert len(set(before.items()) - set(after.items())) == 1  # exactly one idea switched on
    # then wgmma, and every FA3 rung keeps everything below it
    hopper = [r.kwargs for r in ablation.LADDER[6:]]
    assert hopper[0] == {"wgmma": True, "warp_specialize": False, "overlap": False}
    for before, after in zip(hopper, hopper[1:]):
        assert set(before) <= set(after) and before != after
    assert set().union(*hopper) - set(api.SWITCHES) <= FA3_SWITCHES
    assert FA3_SWITCHES <= set().union(*hopper)
    for r in ablation.LADDER:
        assert r.changes.strip() and r.claim.strip() and r.call.startswith(f"forward(kernel={r.kernel!r}")


def test_rungs_with_switches_forward_does_not_take_are_not_built():
    for row in ablation.rung_table(SHAPE):
        r = ablation.rung(row["rung"])
        missing = set(r.kwargs) - set(api.SWITCHES)
        if missing:
            assert row["status"].startswith("not built") and row["kernel"] is None
            assert all(name in row["status"] for name in missing)
        else:
            assert row["status"] == "ok", row
            assert row["kernel"] == forms.forward_plan(SHAPE, r.kernel, forms.Switches(**r.kwargs))[0].kernel
    with pytest.raises(ValueError, match="no rung"):
        ablation.rung("fa4")


def test_wgmma_rungs_cannot_run_off_hopper():
    p = Problem(4, 4096, 4096, 16, 16, 128, "bfloat16", False, arch="sm_80")
    plan, why = ablation.plan_of(ablation.rung("wgmma"), p)
    assert plan is None and why.startswith("not run") and "sm_90" in why


def test_predicted_bytes_are_rawflash_io_for_each_rungs_own_tiles():
    shape = iomodel.Shape(4, 4096, 4096, 16, 16, 128, 2, False)
    assert (ablation.predicted_bytes(ablation.rung("naive"), SHAPE)
            == iomodel.io_bytes("naive", "fwd", shape).total_bytes)
    fa1 = forms.forward_plan(SHAPE, "fa1")[0]
    assert ablation.predicted_bytes(ablation.rung("fa1"), SHAPE) == iomodel.io_bytes(
        "fa1", "fwd", shape, Br=fa1.config.br, Bc=fa1.config.bc, splits=fa1.grid[2]).total_bytes
    splitk = forms.forward_plan(SHAPE, "fa2", forms.Switches(split_q=False, wgmma=False))[0]
    fa2 = forms.forward_plan(SHAPE, "fa2", forms.Switches(wgmma=False))[0]
    assert ablation.predicted_bytes(ablation.rung("+ sequence parallelism"), SHAPE) == iomodel.io_bytes(
        "fa2", "fwd", shape, Br=splitk.config.br, Bc=splitk.config.bc).total_bytes
    # split-K's query blocks are smaller, so it re-reads K and V more often than split-Q
    assert ablation.predicted_bytes(ablation.rung("+ split-Q = fa2"), SHAPE) == iomodel.io_bytes(
        "fa2", "fwd", shape, Br=fa2.config.br, Bc=fa2.config.bc).total_bytes < \
        ablation.predicted_bytes(ablation.rung("+ sequence parallelism"), SHAPE)
    fa3 = forms.forward_plan(SHAPE, "fa2", forms.Switches(**ablation.rung("+ persistent").kwargs))[0]
    assert fa3.kernel == "fa3_fwd_sm90"
    assert ablation.predicted_bytes(ablation.rung("+ persistent"), SHAPE) == iomodel.io_bytes(
        "fa2", "fwd", shape, Br=fa3.config.br, Bc=fa3.config.bc).total_bytes


# ---------------------------------------------------------------- run_ladder with a stand-in timer
def test_run_ladder_speedup_is_over_the_nearest_timed_rung_below(monkeypatch):
    speed = {"naive": 10.0, "fa1": 40.0, "fa2: loop order": 20.0, "+ deferred normalisation": 22.0,
             "+ sequence parallelism": 110.0, "+ split-Q = fa2": 220.0, "wgmma": 330.0,
             "+ TMA and warp specialisation": 495.0, "+ ping-pong": 495.0, "+ persistent": 500.0}  # TFLOP/s
    case0 = ablation.ladder_cases("bfloat16", [64], [1024], False)[0]
    flop_ms = ablation.tflops(case0, 1.0)  # TFLOP/s at 1 ms

    def fake_validate(case):
        if case.variant == "+ intra-warpgroup overlap":
            return False, "out error 1 > 0.1"
        return True, "ok"

    monkeypatch.setattr(ablation, "validate_rung", fake_validate)
    def fake_time(case, repeats):
        if case.seqlen == 2048 and case.variant == "naive":
            raise MemoryError("does not fit in memory")
        return flop_ms / speed[case.variant] * case.seqlen / 1024  # same TFLOP/s at both lengths (B = 16384 / N)

    monkeypatch.setattr(ablation, "time_rung", fake_time)
    rows = ablation.run_ladder(ablation.ladder_cases("bfloat16", [64], [1024, 2048], False), repeats=3)
    longer = {r["rung"]: r for r in rows if r["seqlen"] == 2048}
    assert longer["naive"]["ms"] is None and longer["naive"]["status"] == "not timed: does not fit in memory"
    assert longer["fa1"]["x_below"] is None and longer["fa2: loop order"]["vs"] == "fa1"
    rows = [r for r in rows if r["seqlen"] == 1024]
    by = {r["rung"]: r for r in rows}
    assert [r["rung"] for r in rows] == [r.name for r in ablation.LADDER]
    assert by["naive"]["x_below"] is None
    assert by["fa1"]["x_below"] == pytest.approx(4.0) and by["fa1"]["vs"] == "naive"
    assert by["fa2: loop order"]["x_below"] == pytest.approx(0.5)
    assert by["wgmma"]["x_below"] == pytest.approx(1.5)
    assert by["+ intra-warpgroup overlap"]["tflops"] is None and "error" in by["+ intra-warpgroup overlap"]["status"]
    ws = by["+ TMA and warp specialisation"]
    assert ws["vs"] == "wgmma" and ws["x_below"] == pytest.approx(1.5), "over the nearest timed rung below"
    assert by["fa1"]["hbm_MB"] > 0


def test_plot_ladder_draws_one_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = ablation.run_ladder(ablation.ladder_cases("bfloat16", [64, 128], [1024], False), None)
    assert ablation.plot_ladder(rows, tmp_path / "none.png") is None  # nothing timed: no chart
    for i, r in enumerate(rows):
        if r["kernel"]:
            r["tflops"] = 10.0 * (1 + i % 12)
    path = ablation.plot_ladder(rows, tmp_path / "ladder.png")
    assert path == tmp_path / "ladder.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the command without a GPU
@no_gpu
def test_ablate_ladder_without_gpu_prints_the_rungs_and_predictions(tmp_path):
    out = _invoke("ablate", "--ladder", "--head-dims", "64", "--seqlens", "2048", "--out", tmp_path, code=1).output
    for r in ablation.LADDER:
        assert r.name in out and r.claim in out
    assert "not timed: needs a CUDA GPU" in out
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


@no_gpu
def test_ablate_ladder_json_without_gpu(tmp_path):
    result = _invoke("ablate", "--ladder", "--head-dims", "64,128", "--seqlens", "1024", "--causal", "--json",
                     "--out", tmp_path, code=1)
    report = json.loads(result.stdout)
    assert list(report["rungs"]) == [r.name for r in ablation.LADDER]
    rows = report["ladder"]
    assert len(rows) == 2 * len(ablation.LADDER) and all(r["causal"] and r["ms"] is None for r in rows)
    fa1 = next(r for r in rows if r["rung"] == "fa1" and r["head_dim"] == 128)
    p = Problem(16, 1024, 1024, 16, 16, 128, "bfloat16", True)
    assert fa1["hbm_MB"] * 1e6 == pytest.approx(ablation.predicted_bytes(ablation.rung("fa1"), p))
    assert "needs a CUDA GPU" in report["timing"]


# ---------------------------------------------------------------- fa1's splits (flash-attn 1.x's num_splits)
@pytest.mark.parametrize("batch,heads,seqlen,want", [(16, 16, 1024, 1), (1, 16, 16384, 16), (1, 32, 16384, 8),
                                                     (1, 1, 100, 7)])
def test_fa1_splits_fill_the_waves(batch, heads, seqlen, want):
    p = Problem(batch, seqlen, seqlen, heads, heads, 128, "bfloat16", False)
    cfg = forms.forward_plan(p, "fa1")[0].config
    splits = launch.fa1_splits(p, cfg)
    assert splits == want and 1 <= splits <= min(launch.FA1_MAX_SPLITS, cdiv(seqlen, cfg.br))
    assert forms.forward_plan(p, "fa1")[0].grid == (heads, batch, splits)


def test_fa1_kv_bytes_grow_with_the_splits_that_see_each_block():
    shape = iomodel.Shape(1, 1000, 1000, 4, 4, 64, 2, True)
    one = iomodel.io_bytes("fa1", "fwd", shape, Br=16, Bc=256).breakdown
    four = iomodel.io_bytes("fa1", "fwd", shape, Br=16, Bc=256, splits=4).breakdown
    kv = "K_j,V_j read once per K block and split"
    t = iomodel.tile_counts(1000, 1000, 16, 256, True)
    assert one[kv] == 4 * 2 * t.k_rows_loaded * 64 * 2 == 4 * 2 * t.k_rows_split_loads * 64 * 2
    per_k = iomodel.visited_q_blocks(1000, 1000, 16, 256, True)
    rows = [min(256, 1000 - 256 * j) for j in range(len(per_k))]
    assert four[kv] == 4 * 2 * 64 * 2 * sum(min(4, len(r)) * n for r, n in zip(per_k, rows))
    assert {k: v for k, v in one.items() if k != kv} == {k: v for k, v in four.items() if k != kv}
    assert iomodel.io_bytes("fa2", "fwd", shape, Br=16, Bc=256, splits=4).total_bytes == \
        iomodel.io_bytes("fa2", "fwd", shape, Br=16, Bc=256).total_bytes  # splits are fa1's alone


# ---------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_ablate_ladder_small(tmp_path):
    result = _invoke("ablate", "--ladder", "--head-dims", "64", "--seqlens", "1024", "--repeats", "3", "--json",
                     "--out", tmp_path)
    rows = json.loads(result.stdout)["ladder"]
    built = [r for r in rows if not r["status"].startswith(("not built", "not run"))]
    assert {r["rung"] for r in built} >= {"naive", "fa1", "+ split-Q = fa2"}
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in built)
    assert (tmp_path / "ladder.json").is_file()
