"""FA3's DV forms (MLA's narrower v read at its own head_dim, forward and backward) without a GPU: which calls take
them (both by default, the forward's alone with RAWFLASH_DV_FORM=fwd, neither with =0; elsewhere v runs
zero-padded), their launches' template arguments and shared memory,
and that every DV instantiation is compiled by the offline compile test.

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
from rawflash.settings import DV_BOTH, DV_FORWARD, Settings

DV_ON = Settings(dv_form=DV_BOTH)
DV_OFF = Settings(dv_form=())
DV_FWD = Settings(dv_form=DV_FORWARD)  # RAWFLASH_DV_FORM=fwd: the forward's DV form alone


def _p(d, dv, dtype="bfloat16", causal=True, arch="sm_90", **kw):
    return Problem(2, 4096, 4096, 16, 16, d, dtype, causal, arch, head_dim_v=dv, **kw)


@pytest.mark.parametrize("d, dv, D, DV", [(192, 128, 192, 128), (128, 64, 128, 64), (160, 100, 192, 128),
                                          (128, 32, 128, 64), (120, 40, 128, 64)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_pairs_with_a_row_run_the_dv_form(d, dv, D, DV, dtype):
    assert not forms.reads_value_head_dim(forms.forward_plan(_p(d, dv, dtype), settings=DV_OFF)[0])
    assert forms.forward_plan(_p(d, dv, dtype)) == forms.forward_plan(_p(d, dv, dtype), settings=DV_ON), "the default"
    plan = forms.forward_plan(_p(d, dv, dtype), settings=DV_ON)
    assert all(forms.reads_value_head_dim(lau) for lau in plan)  # (REF_FIRST's way back too)
    lau = plan[0]
    assert lau.template_args[launch.D_ARG] == D and lau.template_args[launch.DV_ARG["fa3_fwd_sm90"]] == DV
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
        if kernel == "decode_split":  # decode's latent cache: tests/test_decode_latent.py lists its instantiations
            continue
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

    assert settings.load({}).dv_form == DV_BOTH == Settings().dv_form
    assert settings.load({"RAWFLASH_DV_FORM": "fwd"}).dv_form == settings.DV_FORWARD
    assert settings.load({"RAWFLASH_DV_FORM": "1"}).dv_form == DV_BOTH
    assert settings.load({"RAWFLASH_DV_FORM": "0"}).dv_form == ()
    with pytest.raises(ValueError, match="RAWFLASH_DV_FORM must be one of 0, fwd, 1; got 'yes'"):
        settings.load({"RAWFLASH_DV_FORM": "yes"})


EXPLAIN = ["explain", "--batch", "1", "--seqlen-q", "4096", "--heads", "128", "--head-dim", "192", "--head-dim-v",
           "128", "--causal", "--gpu", "h200"]


def _explain_both_ways(monkeypatch, *extra) -> tuple:
    """``rawflash explain`` of DeepSeek-V3's shape with RAWFLASH_DV_FORM=0 and =1: for each, (its text, its first
    predicted row)."""
    from click.testing import CliRunner

    runs = []
    for dv_form in ("0", "1"):
        monkeypatch.setenv("RAWFLASH_DV_FORM", dv_form)
        text, js = (CliRunner().invoke(main, [*EXPLAIN, *extra, *json_arg]) for json_arg in ([], ["--json"]))
        assert text.exit_code == 0, text.output
        runs.append((text.output, json.loads(js.output)["predicted"][0]))
    return tuple(runs)


def test_explain_shows_the_padded_path_and_the_dv_form(monkeypatch):
    (padded, before), (dv_form, after) = _explain_both_ways(monkeypatch)
    assert "v[1, 4096, 128, 128]" in padded and "head_dim_v: 128" in padded
    assert "zero-padded to q's head_dim" in padded and "DV form: V_j" not in padded
    assert ", 192, 197728>" in padded  # the d = 192 row, V at 192 columns
    assert "DV form: V_j, P V and O of 128 columns" in dv_form and ", 128, 214112>" in dv_form
    assert after["GFLOP"] == pytest.approx(before["GFLOP"] * (192 + 128) / (192 + 192))  # P V at 128 columns
    assert after["Bc"] == 128 and before["Bc"] == 96 and after["write_MB"] < before["write_MB"]  # O of 128 columns


def test_explain_refuses_a_wider_v_by_name():
    from click.testing import CliRunner

    out = CliRunner().invoke(main, ["explain", "--head-dim", "64", "--head-dim-v", "128", "--gpu", "h200"])
    assert "v's head_dim must be between 1 and q's head_dim 64, got 128" in out.output


# ---------------------------------------------------------------- the backward's DV form
BWD_PAIRS = [(192, 128, 192, 128), (128, 64, 128, 64), (160, 100, 192, 128), (96, 64, 128, 64), (128, 32, 128, 64)]


@pytest.mark.parametrize("d, dv, D, DV", BWD_PAIRS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_pairs_with_a_row_run_the_dv_form(d, dv, D, DV, dtype):
    padded = forms.backward_plan(_p(d, dv, dtype), settings=DV_FWD)
    assert not any(forms.reads_value_head_dim(lau) for lau in padded), "off with RAWFLASH_DV_FORM=fwd"
    plan = forms.backward_plan(_p(d, dv, dtype), settings=DV_ON)
    assert forms.backward_plan(_p(d, dv, dtype)) == plan, "on by default"
    pre, main, convert = plan
    assert [lau.kernel for lau in plan] == ["fa2_bwd_preprocess", "fa3_bwd_sm90", "fa2_bwd_convert_dq"]
    assert forms.reads_value_head_dim(main) and not forms.reads_value_head_dim(pre)
    assert (pre, convert) == (padded[0], padded[2]), "D_i's sum reads BwdParams::head_dim_v at run time"
    assert main.template_args[launch.D_ARG] == D and main.template_args[launch.DV_ARG["fa3_bwd_sm90"]] == DV
    cfg = configs.value_row("fa3_bwd_sm90", D, DV, dtype)
    assert main.config == cfg and main.smem == launch.smem_fa3_bwd_sm90(cfg, D, DV) <= 232448
    assert main.smem < launch.smem_fa3_bwd_sm90(cfg, D), "V's tile and dO's stages hold DV columns, not D"
    if D == 192:  # the d = 192 row: only DV and the bytes differ (at 128 the padded call may take the 80-row tile)
        assert main.template_args[:8] == padded[1].template_args[:8] and main.grid == padded[1].grid
        assert main.cluster == padded[1].cluster == (2, 1, 1)


def test_backward_dv_smem_matches_the_rows_stated_bytes():
    assert launch.smem_fa3_bwd_sm90(configs.value_row("fa3_bwd_sm90", 192, 128, "bfloat16"), 192, 128) == 206936
    assert launch.smem_fa3_bwd_sm90(configs.value_row("fa3_bwd_sm90", 128, 64, "bfloat16"), 128, 64) == 198696
    # the padded rows' bytes as before (DV = D)
    assert launch.smem_fa3_bwd_sm90(configs.value_row("fa3_bwd_sm90", 192, 128, "bfloat16"), 192) == 223320
    assert launch.smem_fa3_bwd_sm90(configs.value_row("fa3_bwd_sm90", 128, 64, "bfloat16"), 128) == 231464


def test_backward_template_arguments_match_the_kernels():
    """launch.D_ARG / DV_ARG name the D and DV template parameters of the FA3 kernels' declarations; SMEM_BYTES is
    the last one without a default (fa3_fwd_sm90's WC after it defaults to 1, left out of the name expressions)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "cuda"
    for kernel, pos in launch.DV_ARG.items():
        text = (root / f"{kernel}.cu").read_text()
        params = re.search(rf"template <([^>]*)>\s*__global__[^;{{]*?\b{kernel}\(", text).group(1)
        names = [x.split("=")[0].split()[-1] for x in params.split(",")]
        required = [n for n, x in zip(names, params.split(",")) if "=" not in x]
        assert names[launch.D_ARG] == "D" and names[pos] == "DV" and required[-1] == "SMEM_BYTES", (kernel, names)


def test_backward_deterministic():
    """The ordered dQ (128 keys a block) has its DV form; the column split's deterministic plan (fa2_bwd +
    fa2_bwd_dq) reads v padded."""
    det = forms.backward_plan(_p(128, 64), deterministic=True, settings=DV_ON)
    assert det[1].kernel == "fa3_bwd_sm90" and det[1].template_args[7] is True and forms.reads_value_head_dim(det[1])
    det = forms.backward_plan(_p(192, 128), deterministic=True, settings=DV_ON)
    assert [lau.kernel for lau in det] == ["fa2_bwd_preprocess", "fa2_bwd", "fa2_bwd_dq"]
    assert not any(forms.reads_value_head_dim(lau) for lau in det)


@pytest.mark.parametrize("case", [
    dict(d=256, dv=128),                      # no row for the pair
    dict(d=192, dv=64),
    dict(d=192, dv=128, dtype="float32"),     # no FA3 form
    dict(d=192, dv=128, arch="sm_80"),
])
def test_backward_other_calls_read_v_padded(case):
    dv = case.pop("dv")
    p = _p(dv=dv, **case)
    assert not any(forms.reads_value_head_dim(lau) for lau in forms.backward_plan(p, settings=DV_ON))
    assert forms.value_form(p, DV_ON, "fa3_bwd_sm90") is False


def test_backward_switches_off_fa3_read_v_padded():
    p = _p(128, 64)
    for wgmma, env in ((False, DV_ON), (None, Settings(dv_form=DV_BOTH, warp_specialize=False))):
        plan = forms.backward_plan(p, settings=env, wgmma=wgmma)
        assert plan[1].kernel != "fa3_bwd_sm90" and not any(forms.reads_value_head_dim(lau) for lau in plan)
    without_tma = forms.backward_plan_without_tma(p, settings=DV_ON)
    assert without_tma[1].kernel == "fa2_bwd_sm90" and not forms.reads_value_head_dim(without_tma[1])
    assert [lau.kernel for lau in forms.backward_plan_without_tma(p, True, DV_ON)][1:] == ["fa2_bwd", "fa2_bwd_dq"]


def test_backward_features_take_the_dv_form_general_policy():
    p = dataclasses.replace(_p(192, 128), window=(100, 0), softcap=20.0, alibi=True, sinks=True)
    lau = forms.backward_plan(p, settings=DV_ON)[1]
    assert forms.reads_value_head_dim(lau) and lau.template_args[launch.MASK_ARG["fa3_bwd_sm90"] + 1] is True
    packed = dataclasses.replace(_p(128, 64), varlen=True, total_q=5000, total_k=5000)
    assert forms.reads_value_head_dim(forms.backward_plan(packed, settings=DV_ON)[1])


def test_long_backward_dv_form_keeps_its_row():
    """A long plain backward at 128 / 64 takes the DV form's row (64 query rows), not LONG_BWD_ROWS' 80."""
    long_p = dataclasses.replace(_p(128, 64, causal=False), seqlen_q=32768, seqlen_k=32768)
    assert forms.backward_plan(long_p, settings=DV_FWD)[1].config.br == launch.FA3_BWD_SWAP_ROWS  # (padded: 80 rows)
    assert forms.backward_plan(long_p, settings=DV_ON)[1].config == configs.value_row("fa3_bwd_sm90", 128, 64,
                                                                                       "bfloat16")


def test_every_backward_dv_launch_is_instantiated():
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    keys = [k for k in configs.VALUE_ROWS if k[0] == "fa3_bwd_sm90"]
    assert {(d, dv) for _, d, dv, _ in keys} == {(192, 128), (128, 64)}
    for (kernel, d, dv, dtype) in keys:
        for causal, det, extra in itertools.product((False, True), (False, True),
                                                    ({}, {"window": (8, 0)}, {"alibi": True})):
            p = dataclasses.replace(_p(d, dv, dtype, causal=causal), **extra)
            for lau in forms.backward_plan(p, det, settings=DV_ON):
                assert lau.name_expression in names, lau.name_expression


def test_backward_bwd_params_carry_v_s_head_dim():
    from rawflash.kernels import params
    from test_params import _Dev

    def rec(p, dv):
        q, k, v = _Dev((2, 64, 4, p.head_dim)), _Dev((2, 64, 4, p.head_dim)), _Dev((2, 64, 4, dv))
        rows = _Dev((2, 4, 64), 4)
        return params.bwd_params(p, q, k, v, v, v, rows, 0.1, dq=q, dk=k, dv=v, lse2=rows, delta=rows)

    p = Problem(2, 64, 64, 4, 4, 192, "bfloat16", False, "sm_90")
    assert rec(dataclasses.replace(p, head_dim_v=128), 128)["head_dim_v"] == 128
    assert rec(p, 192)["head_dim_v"] == 192, "v at q's head_dim (padded, or no narrower v)"


def test_backward_signature_carries_the_setting(monkeypatch):
    """A planned backward made with RAWFLASH_DV_FORM=1 is never served to a call without it (and back)."""
    import numpy as np

    from rawflash import signature

    monkeypatch.setattr(signature, "array", lambda x: (x.shape, x.strides, str(x.dtype)))
    q = np.zeros((1, 8, 2, 192), np.float16)
    v = np.zeros((1, 8, 2, 128), np.float16)
    lse = np.zeros((1, 2, 8), np.float32)

    def key():
        return signature.backward((v, q, q, v, v, lse), (True,), (None,) * 5, (None,) * 3)

    monkeypatch.delenv("RAWFLASH_DV_FORM", raising=False)
    off = key()
    monkeypatch.setenv("RAWFLASH_DV_FORM", "1")
    assert key() != off and off is not None


def test_explain_shows_the_backward_dv_form(monkeypatch):
    (padded, before), (dv_form, after) = _explain_both_ways(monkeypatch, "--direction", "bwd")
    assert "DV form: V_j, dO_i" not in padded and ", 192, 223320>" in padded
    assert "DV form: V_j, dO_i" in dv_form and ", 128, 206936>" in dv_form
    assert after["GFLOP"] == pytest.approx(before["GFLOP"] * (3 * 192 + 2 * 128) / (5 * 192))  # 0.87x
    assert after["read_MB"] < before["read_MB"] and after["write_MB"] < before["write_MB"]


def test_backward_binding_reads_dout_and_out_at_v_s_width(monkeypatch):
    """cupy_backend.prepare (its device look-ups stubbed): in the DV form every array after q and k (v, and the
    backward's dout and out) is made ready at v's run head_dim; otherwise every one at q's."""
    import numpy as np

    from rawflash.kernels import cupy_backend

    monkeypatch.setattr(cupy_backend, "run_problem",
                        lambda p, env, value_form=False: dataclasses.replace(p, head_dim_v=p.head_dim_v * value_form))
    monkeypatch.setattr(cupy_backend, "_ready", lambda x, width, chunk: width)
    arrays = [np.zeros((1, 1, 1, w), np.float16) for w in (192, 192, 128, 128, 128)]  # q, k, v, dout, out
    assert cupy_backend.prepare(_p(192, 128), {}, DV_ON, *arrays, value_form=True).arrays == (192, 192, 128, 128, 128)
    assert cupy_backend.prepare(_p(192, 128), {}, DV_ON, *arrays).arrays == (192,) * 5
