"""FA3's DV form (MLA's narrower v read at its own head_dim) without a GPU: which calls take it (with
RAWFLASH_DV_FORM=1; by default v runs zero-padded), its launches' template arguments and shared memory, and that
every DV instantiation is compiled by the offline compile test.

The kernels' results are tests/test_gpu_mla.py's (GPU: every case both ways).
"""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from rawflash.cli.commands import main
from rawflash.kernels import configs, forms, launch
from rawflash.problem import Problem
from rawflash.settings import Settings

DV_ON = Settings(dv_form=True)


def _p(d, dv, dtype="bfloat16", causal=True, arch="sm_90", **kw):
    return Problem(2, 4096, 4096, 16, 16, d, dtype, causal, arch, head_dim_v=dv, **kw)


@pytest.mark.parametrize("d, dv, D, DV", [(192, 128, 192, 128), (128, 64, 128, 64), (160, 100, 192, 128),
                                          (128, 32, 128, 64), (120, 40, 128, 64)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pairs_with_a_row_run_the_dv_form(d, dv, D, DV, dtype):
    assert not forms.reads_value_head_dim(forms.forward_plan(_p(d, dv, dtype))[0]), "off by default"
    plan = forms.forward_plan(_p(d, dv, dtype), settings=DV_ON)
    assert all(forms.reads_value_head_dim(lau) for lau in plan)  # (REF_FIRST's way back too)
    lau = plan[0]
    assert lau.template_args[launch.D_ARG] == D and lau.template_args[launch.DV_ARG] == DV
    cfg = configs.value_row("fa3_fwd_sm90", D, DV, dtype)
    assert lau.config == cfg and lau.smem == launch.smem_fa3_fwd_sm90(cfg, D, dv=DV) <= 232448
    assert lau.smem < launch.smem_fa3_fwd_sm90(cfg, D), "V's ring holds DV columns, not D"


def test_dv_smem_matches_the_rows_stated_bytes():
    assert launch.smem_fa3_fwd_sm90(configs.value_row("fa3_fwd_sm90", 192, 128, "bfloat16"), 192, dv=128) == 214112
    assert launch.smem_fa3_fwd_sm90(configs.value_row("fa3_fwd_sm90", 128, 64, "bfloat16"), 128, dv=64) == 169056


@pytest.mark.parametrize("case", [
    dict(d=256, dv=128),                      # no row for the pair: v zero-padded to q's head_dim
    dict(d=192, dv=192),                      # (head_dim_v 0 below: v has q's head_dim)
    dict(d=192, dv=128, dtype="float32"),     # no FA3 form
    dict(d=192, dv=128, arch="sm_80"),
])
def test_other_calls_read_v_padded(case):
    dv = case.pop("dv")
    p = _p(dv=0 if dv == case["d"] else dv, **case)
    plan = forms.forward_plan(p, settings=DV_ON)
    assert not any(forms.reads_value_head_dim(lau) for lau in plan)
    assert forms.value_form(p, DV_ON) is False


def test_switches_off_fa3_read_v_padded():
    p = _p(192, 128)
    for sw in (forms.Switches(wgmma=False), forms.Switches(warp_specialize=False)):
        assert not forms.reads_value_head_dim(forms.forward_plan(p, "fa2", sw, DV_ON)[0])
    assert not forms.reads_value_head_dim(forms.forward_plan(p, "fa1", settings=DV_ON)[0])
    assert forms.reads_value_head_dim(forms.forward_plan(p, "fa2", forms.Switches(persistent=False), DV_ON)[0])


def test_features_take_the_dv_form_general_policy():
    p = dataclasses.replace(_p(192, 128), window=(100, 0), softcap=20.0, alibi=True, sinks=True)
    lau = forms.forward_plan(p, settings=DV_ON)[0]
    assert forms.reads_value_head_dim(lau) and lau.template_args[launch.MASK_ARG["fa3_fwd_sm90"] + 1] is True


def test_every_dv_launch_is_instantiated():
    """The offline compile test (tests/test_compile.py) compiles all_instantiations: the DV launches of fixed-length
    calls are among them (as for the other FA3 forwards, float16's one-tile-per-CTA general launches of packed
    sequences compile at first use)."""
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    for (kernel, d, dv, dtype) in configs.VALUE_ROWS:
        for causal, n, extra in itertools.product((False, True), (1, 4096), ({}, {"window": (8, 0)}, {"alibi": True})):
            p = dataclasses.replace(_p(d, dv, dtype, causal=causal), seqlen_q=n, seqlen_k=n, **extra)
            for lau in forms.forward_plan(p, settings=DV_ON):
                assert lau.name_expression in names, lau.name_expression


def test_list_prints_the_value_rows():
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["list", "--gpu", "h200"])
    assert out.exit_code == 0, out.output
    assert "tiles of MLA's narrower v" in out.output and "192 / 128" in out.output


def test_the_setting_is_part_of_the_signature():
    from rawflash import signature

    assert "RAWFLASH_DV_FORM" in signature._SETTINGS
    from rawflash import settings

    assert settings.load({"RAWFLASH_DV_FORM": "1"}).dv_form and not settings.load({}).dv_form


def test_explain_shows_the_padded_path_and_the_dv_form(monkeypatch):
    from click.testing import CliRunner

    args = ["explain", "--batch", "1", "--seqlen-q", "4096", "--heads", "128", "--head-dim", "192", "--head-dim-v",
            "128", "--causal", "--gpu", "h200"]
    monkeypatch.delenv("RAWFLASH_DV_FORM", raising=False)
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "v[1, 4096, 128, 128]" in out.output and "head_dim_v: 128" in out.output
    assert "zero-padded to q's head_dim" in out.output and "DV form: V_j" not in out.output
    assert ", 192, 197728>" in out.output  # the d = 192 row, V at 192 columns
    padded = CliRunner().invoke(main, args + ["--json"])
    monkeypatch.setenv("RAWFLASH_DV_FORM", "1")
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "DV form: V_j, P V and O of 128 columns" in out.output and ", 128, 214112>" in out.output
    dv_form = CliRunner().invoke(main, args + ["--json"])
    before, after = (json.loads(x.output)["predicted"][0] for x in (padded, dv_form))
    assert after["GFLOP"] == pytest.approx(before["GFLOP"] * (192 + 128) / (192 + 192))  # P V at 128 columns
    assert after["Bc"] == 128 and before["Bc"] == 96 and after["write_MB"] < before["write_MB"]  # O of 128 columns


def test_explain_refuses_a_wider_v_by_name():
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["explain", "--head-dim", "64", "--head-dim-v", "128", "--gpu", "h200"])
    assert "v's head_dim must be between 1 and q's head_dim 64, got 128" in out.output
