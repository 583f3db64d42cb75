"""Which form runs where (no GPU needed): forms.py chooses FA3's warp-specialised form on sm_90 for 16-bit inputs
(the cp.async wgmma form when warp specialisation is switched off), the mma.sync form everywhere else, refuses
clearly where wgmma is demanded but cannot run, and picks the variant policy (plain or general, the mask mode)
from the call's features. Also: the generated wgmma wrappers are up to date with their generator, and the
registry agrees with the tile table and the sources."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from rawflash.kernels import compile, configs, forms, launch, params, registry, tma
from rawflash.kernels.forms import Switches
from rawflash.problem import Problem
from rawflash.settings import Settings, load

ROOT = Path(__file__).resolve().parents[1]
NO_WGMMA = Settings(wgmma=False)


def _problem(d=128, dtype="bfloat16", arch="sm_90", causal=False, **features):
    return Problem(2, 300, 300, 8, 2, d, dtype, causal, arch, **features)


@pytest.mark.parametrize("d", [40, 59, 64, 100, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_16bit_runs_wgmma(d, dtype):
    lau = forms.fa2_forward(_problem(d, dtype))
    assert lau.kernel == "fa3_fwd_sm90" and lau.target == "sm_90a"
    assert lau.compile_arch("sm_90") == "sm_90a"
    assert lau.threads == 128 * (lau.config.br // 64 + 1), "a warpgroup per 64 query rows and the producer"
    assert lau.template_args[1] % 64 == 0 and lau.template_args[1] >= d, "whole 64-column panels"
    lau = forms.fa2_forward(_problem(d, dtype), Switches(warp_specialize=False))
    assert lau.kernel == "fa2_fwd_sm90" and lau.target == "sm_90a"
    assert lau.threads == 128 * (lau.config.br // 64), "one warpgroup per 64 query rows"


@pytest.mark.parametrize("dtype,features,bounded", [
    ("bfloat16", dict(softcap=30.0), True), ("bfloat16", dict(softcap=forms.BOUNDED_SOFTCAP_MAX), True),
    ("bfloat16", dict(softcap=forms.BOUNDED_SOFTCAP_MAX + 0.5), False),
    ("bfloat16", dict(softcap=30.0, alibi=True), False),
    ("bfloat16", dict(softcap=30.0, window=(64, 0), varlen=True, total_q=300, total_k=300), True),
    ("bfloat16", dict(window=(64, 0)), False), ("bfloat16", {}, False), ("float16", dict(softcap=30.0), False),
    ("float32", dict(softcap=30.0), False), ("bfloat16", dict(softcap=30.0, d=256), False),
    ("bfloat16", dict(softcap=30.0, d=96), True)])
def test_bounded_scores_pick_the_fixed_reference_instantiation(dtype, features, bounded):
    """Soft-capped bfloat16 scores without ALiBi, softcap <= 50, run the FA3 forward's REF_BOUNDED instantiation (a
    softmax without a running max: its range argument holds only there); everything else the running max."""
    p = _problem(features.pop("d", 128), dtype, **features)
    assert forms.bounded_scores(p) == bounded
    lau = forms.fa2_forward(p)
    if lau.kernel == "fa3_fwd_sm90":
        assert (lau.template_args[launch.REF_ARG] == launch.REF_BOUNDED) is bounded, lau.name_expression
    if not p.varlen:  # (packed sequences' one-tile-per-CTA grids compile at their first call)
        assert lau.name_expression in {x.name_expression for x in forms.all_instantiations("sm_90")}, "precompiled"


@pytest.mark.parametrize("dtype,d,features,ref", [
    ("bfloat16", 128, {}, launch.REF_FIRST), ("bfloat16", 64, dict(causal=True), launch.REF_FIRST),
    ("bfloat16", 96, dict(sinks=True), launch.REF_FIRST), ("bfloat16", 256, {}, launch.REF_RUNNING),
    ("float16", 128, {}, launch.REF_RUNNING), ("bfloat16", 128, dict(window=(64, 0)), launch.REF_RUNNING),
    ("bfloat16", 128, dict(alibi=True), launch.REF_FIRST),
    ("bfloat16", 64, dict(alibi=True, softcap=30.0), launch.REF_FIRST),
    ("bfloat16", 128, dict(window=(-1, 8)), launch.REF_FIRST),
    ("bfloat16", 128, dict(varlen=True, causal=True), launch.REF_FIRST),
    ("bfloat16", 64, dict(causal=True, softcap=60.0), launch.REF_FIRST),
    ("bfloat16", 128, dict(softcap=30.0), launch.REF_BOUNDED)])
def test_softmax_reference_and_its_way_back(dtype, d, features, ref):
    """bfloat16 forwards without a left-bounded window (head_dim <= 128; ALiBi too, with or without soft-capping)
    keep each row's first block's reference (REF_FIRST) and are followed by their running-max twin, the way back;
    everything else runs one launch with its reference (soft-capping alone: the fixed one)."""
    causal = features.pop("causal", False)
    p = _problem(d, dtype, causal=causal, **features)
    assert forms.softmax_ref(p) == ref
    plan = forms.forward_plan(p)
    assert plan[0].kernel == "fa3_fwd_sm90" and plan[0].template_args[launch.REF_ARG] == ref
    if ref == launch.REF_FIRST:
        assert len(plan) == 2 and plan[1] == forms.way_back(plan[0])
        assert plan[1].template_args[launch.REF_ARG] == launch.REF_RUNNING
        assert plan[1].template_args[:7] == plan[0].template_args[:7] and plan[1].grid == plan[0].grid
        names = {x.name_expression for x in forms.all_instantiations("sm_90")}
        assert {plan[0].name_expression, plan[1].name_expression} <= names, "both precompiled"
    else:
        assert len(plan) == 1


@pytest.mark.parametrize("d", [32, 80, 96, 112, 160, 224])
def test_head_dims_off_the_64_grid_run_fa3_with_zero_filled_panels(d):
    lau = forms.fa2_forward(_problem(d, "bfloat16"))
    assert lau.kernel == "fa3_fwd_sm90" and lau.template_args[1] == -(-configs.padded_head_dim(d) // 64) * 64


def test_persistent_dynamic_grid_by_default_for_fixed_lengths():
    schedule = lambda p, sw=Switches(): (  # noqa: E731
        forms.fa2_forward(p, sw).template_args[launch.SCHEDULE_ARG["fa3_fwd_sm90"]])
    dynamic, static, none = (launch.SCHEDULES[k] for k in ("persistent, dynamic", "persistent, static",
                                                             "one tile per CTA"))
    assert schedule(_problem()) == static, "equal tiles: the static schedule balances them already"
    assert schedule(_problem(causal=True)) == dynamic, "the dynamic schedule balances causal tiles"
    assert schedule(_problem(window=(8, 8))) == dynamic
    assert schedule(_problem(window=(-1, 8))) == dynamic
    assert schedule(_problem(softcap=5.0)) == static
    packed = Problem(4, 512, 512, 4, 4, 128, "bfloat16", False, "sm_90", varlen=True, total_q=900, total_k=900)
    assert schedule(packed) == none, "packed lengths make tiles unequal"
    assert schedule(packed, Switches(persistent=True)) == static, "only the static schedule walks packed tiles"
    assert schedule(dataclasses.replace(_problem(), seqused_k=True)) == none
    assert schedule(_problem(causal=True), Switches(persistent=False)) == none
    assert schedule(_problem(causal=True), Switches(persistent=True, dynamic=False)) == static
    assert schedule(_problem(), Switches(dynamic=True)) == dynamic
    big = Problem(8, 4096, 4096, 16, 16, 128, "bfloat16", False, "sm_90", sms=132)
    assert forms.fa2_forward(big).grid == (132, 1, 1)
    assert forms.fa2_forward(big, Switches(persistent=False)).grid == (8 * 16 * 4096 // 128, 1, 1)
    d256 = Problem(2, 512, 512, 8, 8, 256, "bfloat16", False, "sm_90")
    assert schedule(d256) == dynamic, "d = 256's long tiles take the counter without a mask too"
    assert schedule(d256, Switches(dynamic=False)) == static


@pytest.mark.parametrize("d, short, table", [(64, (128, 128, 3, 1), (192, 128, 2, 2)),
                                             (128, (128, 128, 2, 2), (128, 176, 2, 1))])
def test_short_causal_calls_take_their_own_rows(d, short, table):
    shape = lambda lau: (lau.config.br, lau.config.bc, lau.config.stages, lau.config.q_stages)  # noqa: E731
    fwd = lambda **kw: forms.fa2_forward(Problem(**{**dict(batch=2, seqlen_q=1024, seqlen_k=1024, heads=4,  # noqa: E731
                                                        kv_heads=4, head_dim=d, dtype="bfloat16", causal=True,
                                                        arch="sm_90"), **kw}))
    assert shape(fwd()) == short and fwd().config == configs.SHORT_CAUSAL_ROWS[("fa3_fwd_sm90", d, "bfloat16")]
    assert shape(fwd(seqlen_q=1, seqlen_k=1024)) == short
    assert shape(fwd(seqlen_q=1024, seqlen_k=1025)) == table, "more keys than SHORT_CAUSAL_SEQLEN"
    assert shape(fwd(causal=False, seqlen_q=1024, seqlen_k=1025)) == table
    assert shape(fwd(softcap=5.0)) == table, "the general policy keeps the table's rows"
    assert fwd().smem == launch.smem_fa3_fwd_sm90(fwd().config, d) <= 232448


@pytest.mark.parametrize("d", [96, 128])
def test_short_calls_without_a_mask_take_their_own_rows(d):
    fwd = lambda **kw: forms.fa2_forward(Problem(**{**dict(batch=2, seqlen_q=1024, seqlen_k=1024, heads=4,  # noqa: E731
                                                        kv_heads=4, head_dim=d, dtype="bfloat16", causal=False,
                                                        arch="sm_90"), **kw}))
    row, table = (configs.SHORT_FULL_ROWS[("fa3_fwd_sm90", d, "bfloat16")],
                  configs.TABLE[("fa3_fwd_sm90", d, "bfloat16")])
    assert fwd().config == row and fwd(seqlen_q=7, seqlen_k=512).config == row
    assert fwd(seqlen_k=1025).config == table, "more keys than SHORT_FULL_SEQLEN"
    assert fwd(causal=True, seqlen_k=2048).config == table
    assert fwd(softcap=5.0).config == table, "the general policy keeps the table's rows"
    assert row.q_stages == 2, "the rows that store O through shared memory and TMA (launch.fa3_fwd_stage_o)"


@pytest.mark.parametrize("d", [96, 128])
def test_short_windows_take_their_own_rows(d):
    fwd = lambda **kw: forms.fa2_forward(  # noqa: E731
        Problem(**{**dict(batch=2, seqlen_q=16384, seqlen_k=16384, heads=4, kv_heads=4, head_dim=d,
                          dtype="bfloat16", causal=True, arch="sm_90"), **kw}))
    row = configs.WINDOW_ROWS[("fa3_fwd_sm90", d, "bfloat16")]
    assert fwd(window=(1024, 0)).config == row, "the measured case: (1024, 0) causal"
    assert fwd(window=(64, 17), causal=False).config == row, "two-sided, 81 keys beside the diagonal"
    assert fwd(window=(1025, 0)).config == configs.TABLE[("fa3_fwd_sm90", d, "bfloat16")], "wider than the span"
    assert fwd(window=(64, -1), causal=False).config != row, "unbounded on the right"
    assert fwd(window=(-1, 0), causal=False).config != row, "unbounded on the left (causal as a window)"
    assert fwd(causal=False).config != row and fwd(softcap=5.0).config != row
    assert fwd(window=(1024, 0)).smem <= 232448
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    assert fwd(window=(8, 0), seqlen_q=1, seqlen_k=1).name_expression in names
    assert fwd(window=(4096, 0)).name_expression in names, "a wide window's table row is instantiated too"


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_fp8_short_windows_take_their_own_row(out_dtype):
    """The FP8 forward at d = 128 under a window of <= SHORT_WINDOW_SPAN keys takes WINDOW_ROWS' FP8 row (the V^T
    pre-pass too: its key tiles follow the row), wider windows and d = 256 the table's; both are instantiated."""
    def problem(d=128, **kw):
        return Problem(**{**dict(batch=2, seqlen_q=16384, seqlen_k=16381, heads=4, kv_heads=4, head_dim=d,
                                 dtype=configs.FP8, causal=True, arch="sm_90", out_dtype=out_dtype), **kw})

    def main(**kw):
        return forms.fp8_forward(problem(**kw))

    row, table = configs.WINDOW_ROWS[("fa3_fwd_sm90_fp8", 128, configs.FP8)], configs.TABLE[("fa3_fwd_sm90_fp8", 128,
                                                                                              configs.FP8)]
    assert main(window=(1024, 0))[1].config == row and main(window=(1025, 0))[1].config == table
    assert main()[1].config == table, "causal without a window keeps the table's row"
    assert main(d=256, window=(1024, 0))[1].config == configs.TABLE[("fa3_fwd_sm90_fp8", 256, configs.FP8)]
    assert main(window=(1024, 0))[0].grid == launch.fp8_vt_permute(problem(window=(1024, 0)), row.bc).grid, (
        "fp8_vt_permute covers the row's key blocks")
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    assert main(window=(8, 0), seqlen_q=1, seqlen_k=1)[1].name_expression in names
    assert main(window=(4096, 0))[1].name_expression in names


@pytest.mark.parametrize("d,dtype,arch", [(128, "float32", "sm_90"), (128, "bfloat16", "sm_80"),
                                          (128, "bfloat16", "sm_89"), (128, "bfloat16", "sm_100")])
def test_elsewhere_runs_mma_sync(d, dtype, arch):
    lau = forms.fa2_forward(_problem(d, dtype, arch))
    assert lau.kernel == "fa2_fwd" and lau.target is None
    assert lau.compile_arch(arch) == arch


def test_settings_and_switches_force_mma_sync():
    assert forms.fa2_forward(_problem(), Switches(wgmma=False)).kernel == "fa2_fwd"
    assert forms.fa2_forward(_problem(), Switches(defer_norm=False)).kernel == "fa2_fwd", "the switches live there"
    assert forms.fa2_forward(_problem(), settings=NO_WGMMA).kernel == "fa2_fwd"
    assert forms.fa2_forward(_problem(), Switches(wgmma=True), NO_WGMMA).kernel == "fa3_fwd_sm90", "explicit wins"
    assert forms.fa2_forward(_problem(), settings=Settings(warp_specialize=False)).kernel == "fa2_fwd_sm90"


def test_settings_are_read_from_the_environment_only_in_settings():
    assert load({"RAWFLASH_WGMMA": "0"}).wgmma is False and load({}).wgmma is True
    assert load({"RAWFLASH_TILE_ARCH": "sm_80"}).tile_arch == "sm_80"
    assert load({"RAWFLASH_TILE_GPU": "h100"}).tile_gpu == "h100" and load({}).tile_gpu is None
    paths = list((ROOT / "rawflash").rglob("*.py"))
    assert {p.parent.name for p in paths} >= {"rawflash", "kernels", "cli", "numba_kernels", "distributed"}
    for path in paths:
        if path.name == "settings.py":
            continue
        text = path.read_text()
        assert "environ[\"RAWFLASH" not in text and "environ.get(\"RAWFLASH" not in text, f"{path} reads a setting"


@pytest.mark.parametrize("sw,problem", [(Switches(wgmma=True), _problem(arch="sm_80")),
                                        (Switches(wgmma=True), _problem(dtype="float32")),
                                        (Switches(wgmma=True, split_q=False), _problem())])
def test_demanding_wgmma_where_it_cannot_run_is_refused(sw, problem):
    with pytest.raises(ValueError, match="wgmma=True needs an sm_90 GPU"):
        forms.fa2_forward(problem, sw)


def test_the_cp_async_wgmma_form_needs_the_64_grid_and_fa3_needs_the_ideas():
    with pytest.raises(ValueError, match="warp_specialize=False on Hopper"):
        forms.fa2_forward(_problem(d=96), Switches(warp_specialize=False))
    with pytest.raises(ValueError, match="warp_specialize=True needs"):
        forms.fa2_forward(_problem(), Switches(warp_specialize=True, split_q=False))


@pytest.mark.parametrize("d", [80, 96])
def test_fa3_off_in_the_settings_falls_back_off_the_64_grid(d):
    """RAWFLASH_FA3=0 (the settings, not the call) at a head_dim the cp.async wgmma form has no row for: the mma.sync
    forward, not an error (without the fallback an H200 refuses the forward); the call's own
    warp_specialize=False or wgmma=True there is still refused."""
    off = Settings(warp_specialize=False)
    assert forms.fa2_forward(_problem(d=d), settings=off).kernel == "fa2_fwd"
    assert forms.forward_plan(_problem(d=d, alibi=True), settings=off)[0].kernel == "fa2_fwd"
    assert forms.fa2_forward(_problem(d=128), settings=off).kernel == "fa2_fwd_sm90"
    with pytest.raises(ValueError, match="warp_specialize=False on Hopper"):
        forms.fa2_forward(_problem(d=d), Switches(warp_specialize=False), off)
    with pytest.raises(ValueError, match="warp_specialize=False on Hopper"):
        forms.fa2_forward(_problem(d=d), Switches(wgmma=True), off)


def test_overlap_switch_reaches_the_template():
    on, off = (forms.fa2_forward(_problem(), Switches(overlap=True)),
               forms.fa2_forward(_problem(), Switches(overlap=False)))
    assert on.name_expression != off.name_expression
    assert on.template_args[8] is True and off.template_args[8] is False


@pytest.mark.parametrize("features,mask,general", [
    ({}, launch.NO_MASK, False), ({"causal": True}, launch.CAUSAL, False), ({"sinks": True}, launch.NO_MASK, False),
    ({"causal": True, "window": (-1, 5)}, launch.CAUSAL, False), ({"window": (8, 0)}, launch.WINDOW, True),
    ({"window": (-1, 0)}, launch.WINDOW, True), ({"softcap": 30.0}, launch.NO_MASK, True),
    ({"causal": True, "alibi": True}, launch.WINDOW, True), ({"varlen": True, "total_q": 9, "total_k": 9},
                                                             launch.NO_MASK, True)])
def test_features_choose_the_policy(features, mask, general):
    causal = features.pop("causal", False)
    p = _problem(causal=causal, **features)
    assert (launch.mask_mode(p), p.general) == (mask, general)
    for lau in (forms.fa2_forward(p), forms.fa2_forward(p, Switches(wgmma=False)), forms.backward_plan(p)[1],
                forms.backward_plan(p, deterministic=True)[1], forms.deterministic_without_fa3(p)[2]):
        i = launch.MASK_ARG[lau.kernel]
        assert lau.template_args[i] == mask and lau.template_args[i + 1] is general, lau.name_expression


def test_sm90_smem_fits_one_block():
    for d in (64, 128, 192, 256):
        for dtype in ("float16", "bfloat16"):
            lau = forms.fa2_forward(_problem(d, dtype))
            assert lau.smem <= 232448, f"d={d}: {lau.smem} B > 227 KB"


def test_wgmma_ops_header_is_generated_and_current():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py"), "--check"], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr or res.stdout


def test_api_refuses_bad_wgmma_switch_before_launch():
    import numpy as np

    import rawflash

    q = np.ones((1, 4, 2, 64), np.float16)
    with pytest.raises(TypeError, match="wgmma"):
        rawflash.forward(q, q, q, wgmma="yes")
    with pytest.raises(TypeError, match="overlap"):
        rawflash.forward(q, q, q, overlap=1)


@pytest.mark.parametrize("d,dtype,arch,deterministic,expected", [
    (128, "bfloat16", "sm_90", False, "fa3_bwd_sm90"), (40, "float16", "sm_90", False, "fa3_bwd_sm90"),
    (128, "bfloat16", "sm_90", True, "fa3_bwd_sm90"), (64, "float16", "sm_90", True, "fa3_bwd_sm90"),
    (256, "bfloat16", "sm_90", True, "fa2_bwd"), (128, "float32", "sm_90", True, "fa2_bwd"),
    (128, "bfloat16", "sm_80", True, "fa2_bwd"), (256, "bfloat16", "sm_90", False, "fa3_bwd_sm90"),
    (96, "bfloat16", "sm_90", False, "fa3_bwd_sm90"), (32, "float16", "sm_90", False, "fa3_bwd_sm90"),
    (192, "bfloat16", "sm_90", False, "fa3_bwd_sm90"), (224, "float16", "sm_90", False, "fa3_bwd_sm90"),
    (192, "float16", "sm_90", True, "fa2_bwd"),
    (128, "float32", "sm_90", False, "fa2_bwd"), (128, "bfloat16", "sm_80", False, "fa2_bwd")])
def test_backward_form_choice(d, dtype, arch, deterministic, expected):
    assert forms.backward_plan(_problem(d, dtype, arch), deterministic)[1].kernel == expected
    assert forms.backward_plan(_problem(d, dtype, arch), deterministic, NO_WGMMA)[1].kernel == "fa2_bwd"
    no_fa3 = forms.backward_plan(_problem(d, dtype, arch), deterministic, Settings(warp_specialize=False))[1].kernel
    fits = forms.hopper_form_fits("fa2_bwd_sm90", _problem(d, dtype, arch)) and not deterministic
    cp_async = "fa2_bwd_sm90" if fits else "fa2_bwd"
    assert no_fa3 == (cp_async if expected == "fa3_bwd_sm90" else expected)


@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window": (64, 32)}, {"softcap": 5.0},
                                      {"varlen": True, "total_q": 700, "total_k": 500}])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_backward_on_hopper_is_fa3_in_order(d, features):
    """deterministic=True on sm_90, 16-bit, head_dim <= 128: FA3's form with DETERMINISTIC=true and the default
    path's convert pass (no fa2_bwd_dq pass); the same grid, shared memory and tile row as the default form."""
    causal = features.pop("causal", False)
    p = _problem(d, causal=causal, **features)
    default, det = forms.backward_plan(p), forms.backward_plan(p, deterministic=True)
    assert [lau.kernel for lau in det] == ["fa2_bwd_preprocess", "fa3_bwd_sm90", "fa2_bwd_convert_dq"]
    i = launch.MASK_ARG["fa3_bwd_sm90"] + 2  # DETERMINISTIC follows the mask mode and the general policy
    assert det[1].template_args[i] is True and default[1].template_args[i] is False
    assert det[1].template_args[:i] == default[1].template_args[:i]
    assert (det[1].grid, det[1].block, det[1].smem, det[1].config) == \
        (default[1].grid, default[1].block, default[1].smem, default[1].config)
    assert det[1].name_expression in {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    # without warp specialisation (or off Hopper) the deterministic plan keeps its separate dQ pass
    off = forms.backward_plan(p, deterministic=True, settings=Settings(warp_specialize=False))
    assert [lau.kernel for lau in off] == ["fa2_bwd_preprocess", "fa2_bwd", "fa2_bwd_dq"]
    assert [lau.kernel for lau in forms.backward_plan(p, True, NO_WGMMA)] == [lau.kernel for lau in off]


def test_dq_semaphores_cover_every_query_block():
    """mainloop_bwd_sm90_ws.cuh's semaphore(): (row0 + q0) / br + the (sequence, head)'s index is distinct for
    every query block and below launch.dq_semaphores, fixed lengths and packed ones (lengths 0 .. 3 br)."""
    import random

    rng = random.Random(3)
    br = 64
    for trial in range(200):
        batch, heads = rng.randint(1, 5), rng.randint(1, 4)
        if trial % 2:
            lens = [rng.choice([0, 1, br - 1, br, br + 1, rng.randint(0, 3 * br)]) for _ in range(batch)]
            total = sum(lens)
            p = Problem(batch, max(lens), max(lens), heads, 1, 64, "bfloat16", False, varlen=True, total_q=total,
                        total_k=total)
            starts = [sum(lens[:b]) for b in range(batch)]
            row0 = {(b, h): h * total + starts[b] for b in range(batch) for h in range(heads)}
            seq = {(b, h): h * batch + b for b in range(batch) for h in range(heads)}
        else:
            s = rng.randint(1, 3 * br)
            lens = [s] * batch
            p = Problem(batch, s, s, heads, 1, 64, "bfloat16", False)
            row0 = {(b, h): (b * heads + h) * s for b in range(batch) for h in range(heads)}
            seq = {(b, h): b * heads + h for b in range(batch) for h in range(heads)}
        slots = [(row0[b, h] + q0) // br + seq[b, h] for b in range(batch) for h in range(heads)
                 for q0 in range(0, lens[b], br)]
        assert len(set(slots)) == len(slots) and all(0 <= x < launch.dq_semaphores(p, br) for x in slots)


def test_demanding_wgmma_backward_where_it_cannot_run_is_refused():
    with pytest.raises(ValueError, match="wgmma=True \\(backward\\) needs"):
        forms.fa2_backward_main(_problem(dtype="float32"), True, wgmma=True)
    with pytest.raises(ValueError, match="atomic dQ"):
        forms.fa2_backward_main(_problem(), False, wgmma=True)


@pytest.mark.parametrize("d,split", [(64, False), (128, False), (200, True), (256, True)])
def test_backward_split_d_form_for_large_head_dims(d, split):
    lau = forms.fa2_backward_main(_problem(d=d), True, warp_specialize=False)
    assert lau.kernel == "fa2_bwd_sm90" and launch.bwd_sm90_split_d(lau.config) is split
    assert lau.template_args[7] is split and lau.smem <= 232448


@pytest.mark.parametrize("d,split,smem", [(64, False, 199720), (128, False, 231464), (160, True, 182312),
                                          (192, True, 182312), (200, True, 231464), (256, True, 231464)])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window": (64, 32), "softcap": 5.0},
                                      {"varlen": True, "total_q": 700, "total_k": 500}])
def test_fa3_backward_column_split_for_large_head_dims(d, split, smem, features):
    """fa3_bwd_sm90 at d = 192 / 256: the column split (64 keys for two consumer warpgroups and the producer, 384
    threads; key tiles of 64), within 227 KB; deterministic=True there keeps fa2_bwd + fa2_bwd_dq, and the column
    split refuses DETERMINISTIC."""
    features = dict(features)
    p = _problem(d, causal=features.pop("causal", False), **features)
    lau = forms.backward_plan(p)[1]
    assert lau.kernel == "fa3_bwd_sm90" and launch.fa3_bwd_split_d(lau.config) is split
    pair = split  # clusters of two key blocks (launch.fa3_bwd_pair): pairs of key tiles
    tiles = 2 * p.k_tiles(128) if pair else p.k_tiles(64 if split else 128)
    assert lau.block == (384, 1, 1) and lau.grid[0] == tiles and lau.grid[0] % (2 if pair else 1) == 0
    assert launch.fa3_bwd_pair(lau.config, lau.template_args[1]) is pair
    assert lau.cluster == ((2, 1, 1) if pair else (1, 1, 1))  # (fa3_bwd_sm90.cu's __cluster_dims__, reported)
    if pair:  # dO_i in one stage of its own, the partner's dS^T (twice at d = 192), its K_j' columns, the dQ_i tiles
        smem = 231496 if lau.template_args[1] == 256 else 223320
    assert smem is None or lau.smem == smem
    assert lau.smem <= 232448 and lau.name_expression in {x.name_expression for x in forms.all_instantiations("sm_90")}
    det = [x.kernel for x in forms.backward_plan(p, deterministic=True)]
    assert det == (["fa2_bwd_preprocess", "fa2_bwd", "fa2_bwd_dq"] if split else
                   ["fa2_bwd_preprocess", "fa3_bwd_sm90", "fa2_bwd_convert_dq"])
    if split:
        with pytest.raises(ValueError, match="no deterministic form"):
            launch.fa3_bwd_sm90(p, lau.config, deterministic=True)
        with pytest.raises(ValueError, match="runs head_dim 192 and 256"):  # (the mainloop's static_assert)
            launch.fa3_bwd_sm90(dataclasses.replace(p, head_dim=128), lau.config)


@pytest.mark.parametrize("d,rows,ds_buffers", [(32, 128, 1), (64, 128, 1), (96, 64, 2), (128, 64, 2)])
def test_fa3_backward_query_rows_per_step(d, rows, ds_buffers):
    """fa3_bwd_sm90 takes 128 query rows a step at head_dim <= 64 (its consumers split dQ_i's rows; one dS^T buffer)
    and 64 above (dQ_i's columns; two), default and deterministic alike; the dQ map's box is one warpgroup's 64
    rows either way; rows other than 64 / 128, or 128 on the column split, are refused before launch."""
    p = _problem(d)
    for lau in (forms.backward_plan(p)[1], forms.backward_plan(p, deterministic=True)[1]):
        assert lau.kernel == "fa3_bwd_sm90" and lau.config.br == rows
        assert launch.fa3_bwd_ds_buffers(lau.config) == ds_buffers and lau.template_args[2] == rows
    assert tma.DQ_BOX_ROWS == 64 and tma.dq_box_rows(rows) == 64
    for bad in (dataclasses.replace(lau.config, br=96), configs.TileConfig(128, 64, 12, stages=2)):
        with pytest.raises(ValueError, match="64 query rows"):
            launch.fa3_bwd_sm90(p, bad)


def test_backward_key_tiles_longest_first_under_a_right_bound_and_few_pairs():
    """The default FA3 backward dispatches key tiles longest first (BwdParams::longest_first) under a mask bounded
    on the right, with fixed lengths, outside the column split's pairs, where (batch, kv head) pairs number at most
    half the SMs; the bound is inclusive (64 pairs: MHA d = 128 N = 4096, 1.0x; 128: 0.78 - 0.89x on an H200)."""
    cfg = configs.TileConfig(64, 128, 12, stages=2)
    gqa = Problem(4, 4096, 4096, 16, 4, 128, "bfloat16", True, "sm_90")  # 16 pairs
    assert launch.fa3_bwd_longest_first(gqa, cfg, 132)
    assert launch.fa3_bwd_longest_first(dataclasses.replace(gqa, kv_heads=16), cfg, 132), "MHA, 64 pairs"
    assert not launch.fa3_bwd_longest_first(dataclasses.replace(gqa, kv_heads=32, heads=32), cfg, 132), "128"
    assert not launch.fa3_bwd_longest_first(dataclasses.replace(gqa, batch=17), cfg, 132), "68 pairs"
    assert launch.fa3_bwd_longest_first(dataclasses.replace(gqa, causal=False, window=(100, 0)), cfg, 132)
    for other in (dataclasses.replace(gqa, causal=False), dataclasses.replace(gqa, causal=False, window=(100, -1)),
                  dataclasses.replace(gqa, varlen=True, total_q=4096, total_k=4096)):
        assert not launch.fa3_bwd_longest_first(other, cfg, 132)
    split = configs.TileConfig(64, 64, 12, stages=2)
    assert not launch.fa3_bwd_longest_first(dataclasses.replace(gqa, head_dim=256), split, 132), "the pairs"
    assert "longest_first" in params.BWD_DTYPE.names


def test_backward_key_tiles_longest_first_on_the_h100_only_for_fewer_pairs():
    """The H100's gate: each (batch, kv head) runs at least 8 CTAs at once (16 pairs of 132 SMs: inclusive), where
    the H200 needs 2; at 64 pairs the H100 ran longest first at 0.74 - 0.80x of key order, at 32 pairs 0.88 -
    1.08x."""
    cfg = configs.TileConfig(64, 128, 12, stages=2)
    h100 = Problem(4, 4096, 4096, 16, 4, 128, "bfloat16", True, "sm_90", gpu="h100")  # 16 pairs
    assert launch.fa3_bwd_longest_first(h100, cfg, 132)
    assert not launch.fa3_bwd_longest_first(dataclasses.replace(h100, batch=5), cfg, 132), "20 pairs"
    assert not launch.fa3_bwd_longest_first(dataclasses.replace(h100, kv_heads=16), cfg, 132), "MHA, 64 pairs"
    assert launch.fa3_bwd_longest_first(dataclasses.replace(h100, kv_heads=16, gpu="h200"), cfg, 132)
    assert launch.fa3_bwd_longest_first(dataclasses.replace(h100, batch=1, kv_heads=16), cfg, 132), "MHA, 16 pairs"
    assert not launch.fa3_bwd_longest_first(dataclasses.replace(h100, causal=False), cfg, 132)


@pytest.mark.parametrize("arch, l2_mb, gpu", [("sm_90", 50, "h100"), ("sm_90", 60, "h200"), ("sm_90", 0, "h200"),
                                              ("sm_80", 40, "h200"), ("sm_100", 50, "h100")])
def test_a_gpu_takes_the_gates_of_the_tuned_gpu_its_l2_matches(arch, l2_mb, gpu):
    """An H100 (50 MB of L2) takes the H100's gates; an H200 (60 MB), a Hopper GPU whose L2 is unknown and every
    other architecture the H200's (the rows' own GPU)."""
    assert configs.gpu_name(arch, l2_mb << 20) == gpu
    assert configs.gates(gpu) is configs.GATES[gpu]
    with pytest.raises(ValueError, match="gpu must be one of h200, h100, got 'a100'"):
        configs.gates("a100")


def test_every_tuned_gpu_has_rows_gates_and_keys_the_table_knows():
    """configs.GPU_ROWS, GPU_SITUATION_ROWS and GATES have an entry per tuned GPU; a GPU's row replaces a table row
    (or a situation's, by a situation's name) that exists, so a pasted entry with a typo fails here."""
    assert set(configs.GPU_ROWS) == set(configs.GPU_SITUATION_ROWS) == set(configs.GATES) == set(configs.TUNED_GPUS)
    for gpu in configs.TUNED_GPUS:
        assert set(configs.GPU_ROWS[gpu]) <= set(configs.TABLE), gpu
        for name, rows in configs.GPU_SITUATION_ROWS[gpu].items():
            assert name in configs.SITUATION_ROWS and set(rows) <= set(configs.TABLE), (gpu, name)
    assert set(configs.TABLE_CHOSEN_ON) <= set(configs.TABLE) and set(configs.TABLE_CHOSEN_ON.values()) <= set(
        configs.TUNED_GPUS)


FA3_KEY = ("fa3_fwd_sm90", 128, "bfloat16")
H100_ROW = configs.TileConfig(128, 160, 12, stages=2, why="injected by the test")


def test_a_gpu_row_is_taken_on_its_gpu_only(monkeypatch):
    """A row of configs.GPU_ROWS['h100'] is what an H100's call runs (forms passes Problem.gpu) and what
    all_instantiations compiles; the H200 keeps the table's row, an override still beats the GPU's row, a situation's
    row beats it too (configs.tile_config says why), and the sm_80 family never takes it."""
    monkeypatch.setitem(configs.GPU_ROWS, "h100", {FA3_KEY: H100_ROW, ("fa2_fwd", 128, "bfloat16"): H100_ROW})
    long = Problem(2, 4096, 4096, 8, 2, 128, "bfloat16", False, "sm_90")
    h100 = dataclasses.replace(long, gpu="h100")
    assert forms.fa2_forward(h100).config == H100_ROW
    assert forms.fa2_forward(long).config == configs.TABLE[FA3_KEY] != H100_ROW
    cand = configs.TileConfig(128, 128, 12, stages=3)
    assert forms.fa2_forward(h100, override={FA3_KEY: cand}).config == cand
    short = dataclasses.replace(h100, seqlen_q=512, seqlen_k=512, causal=True)
    assert "short_causal" in forms.situations(short)
    assert forms.fa2_forward(short).config == configs.SHORT_CAUSAL_ROWS[FA3_KEY]
    assert configs.tile_config(*FA3_KEY, gpu="h100") == H100_ROW
    assert configs.tile_config("fa2_fwd", 128, "bfloat16", "sm_80", gpu="h100") == \
        configs.ARCH_ROWS["sm_80"][("fa2_fwd", 128, "bfloat16")]
    assert configs.tile_source(*FA3_KEY, gpu="h100") == ("GPU_ROWS", "") and configs.tile_source(*FA3_KEY)[0] == "TABLE"
    assert configs.chosen_on(*FA3_KEY, gpu="h100") == "h100" and configs.chosen_on(*FA3_KEY) == "h200"
    assert configs.chosen_on("decode_split", 128, configs.FP8, gpu="h100") == "h100", "TABLE_CHOSEN_ON"
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    assert forms.fa2_forward(h100).name_expression in names
    with pytest.raises(ValueError, match="gpu must be one of h200, h100, got 'a100'"):
        configs.tile_config(*FA3_KEY, gpu="a100")


def test_a_gpu_situation_row_replaces_the_situation_row_on_its_gpu_only(monkeypatch):
    """configs.GPU_SITUATION_ROWS['h100']['short_causal'] is what an H100's short causal call runs; the H200's and the
    H100's long calls keep theirs, and the general policy's min_blocks still applies to a GPU's table row."""
    monkeypatch.setitem(configs.GPU_SITUATION_ROWS, "h100", {"short_causal": {FA3_KEY: H100_ROW}})
    short = Problem(2, 512, 512, 8, 2, 128, "bfloat16", True, "sm_90", gpu="h100")
    assert forms.fa2_forward(short).config == H100_ROW
    assert configs.tile_source(*FA3_KEY, situations=("short_causal",), gpu="h100") == ("GPU_SITUATION_ROWS",
                                                                                        "short_causal")
    assert configs.tile_source(*FA3_KEY, situations=("short_causal",)) == ("SITUATION_ROWS", "short_causal")
    assert forms.fa2_forward(dataclasses.replace(short, gpu="h200")).config == configs.SHORT_CAUSAL_ROWS[FA3_KEY]
    assert forms.fa2_forward(dataclasses.replace(short, seqlen_q=4096, seqlen_k=4096)).config == \
        configs.tile_config(*FA3_KEY, gpu="h100")
    key = ("fa2_fwd_sm90", 64, "bfloat16")
    monkeypatch.setitem(configs.GPU_ROWS, "h100", {key: dataclasses.replace(configs.TABLE[key], why="")})
    assert configs.tile_config(*key, general=True, gpu="h100").min_blocks == configs.TABLE[key].general_min_blocks


def test_rawflash_tile_gpu_names_the_gates_and_is_checked():
    """RAWFLASH_TILE_GPU makes the GPU at hand take another tuned GPU's gates (no GPU needed to read it); a name
    that is not one is refused by name."""
    from rawflash.kernels import cupy_backend

    assert cupy_backend.device_gpu(Settings(tile_gpu="h100")) == "h100"
    with pytest.raises(ValueError, match="RAWFLASH_TILE_GPU must be one of h200, h100, got 'H100'"):
        cupy_backend.device_gpu(Settings(tile_gpu="H100"))


def test_deterministic_rotated_order_only_without_a_mask_and_few_key_blocks():
    """deterministic=True walks the rotated order (BwdParams::dq_rotate) without a mask bound only, and only where a
    (sequence, kv head)'s key blocks number at most half the SMs (a CTA may wait on one dispatched after it)."""
    cfg = configs.TileConfig(64, 128, 12, stages=2)
    p = Problem(2, 4096, 4096, 8, 8, 64, "bfloat16", False, "sm_90")  # 32 key blocks
    assert launch.fa3_bwd_dq_rotates(p, cfg, 132)
    assert not launch.fa3_bwd_dq_rotates(p, cfg, 63)
    assert launch.fa3_bwd_dq_rotates(dataclasses.replace(p, seqlen_k=66 * 128), cfg, 132)
    assert not launch.fa3_bwd_dq_rotates(dataclasses.replace(p, seqlen_k=66 * 128 + 1), cfg, 132)
    for masked in (dataclasses.replace(p, causal=True), dataclasses.replace(p, window=(100, 100)),
                   dataclasses.replace(p, window=(-1, 5))):
        assert not launch.fa3_bwd_dq_rotates(masked, cfg, 132)
    assert "dq_rotate" in params.BWD_DTYPE.names


@pytest.mark.parametrize("gpu", configs.TUNED_GPUS)
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fa3_backward_80_rows_on_long_sequences(d, dtype, gpu):
    """Plain attention over >= the GPU's long_bwd_seqlen query rows without a mask (long_causal_bwd_seqlen causal:
    8192 on the H200, 4096 on the H100) takes the 80-row backward tile (dQ_i^T by the warpgroups, one dQ_i buffer,
    the dQ map's box all 80 rows, 231720 B); shorter sequences, the general policy and the deterministic backward
    keep 64 rows; the 80-row tile is refused where it cannot run."""
    g = configs.gates(gpu)
    n, nc = g.long_bwd_seqlen, g.long_causal_bwd_seqlen
    assert nc == {"h200": 8192, "h100": 4096}[gpu]
    p = Problem(1, n, n, 4, 4, d, dtype, False, "sm_90", gpu=gpu)
    for x in (p, dataclasses.replace(p, seqlen_q=nc, seqlen_k=nc, causal=True)):
        main = forms.backward_plan(x)[1]
        assert main.kernel == "fa3_bwd_sm90" and main.config.br == launch.FA3_BWD_SWAP_ROWS == 80
        assert main.template_args[1:5] == (128, 80, 128, 2) and main.smem == 231720 <= 232448
        assert launch.fa3_bwd_ds_buffers(main.config) == 2 and launch.fa3_bwd_dq_buffers(main.config) == 1
        det = forms.backward_plan(x, deterministic=True)[1]
        assert det.kernel == "fa3_bwd_sm90" and det.config.br == 64 and det.template_args[7] is True
    assert tma.dq_box_rows(80) == 80
    for other in (dataclasses.replace(p, seqlen_q=nc - 1, seqlen_k=nc, causal=True),
                  dataclasses.replace(p, softcap=5.0), dataclasses.replace(p, seqlen_q=n - 1),
                  dataclasses.replace(p, window=(64, 64))):
        assert forms.backward_plan(other)[1].config.br == 64
    with pytest.raises(ValueError, match="80-row tile runs head_dim 128"):
        launch.fa3_bwd_sm90(p, main.config, deterministic=True)
    with pytest.raises(ValueError, match="80-row tile runs head_dim 128"):
        launch.fa3_bwd_sm90(dataclasses.replace(p, head_dim=64), main.config)
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    assert main.name_expression in names


def test_override_replaces_a_tile_row_without_touching_the_table():
    before = dict(configs.TABLE)
    cand = configs.TileConfig(128, 128, 8)
    lau = forms.fa2_forward(_problem(), Switches(warp_specialize=False),
                            override={("fa2_fwd_sm90", 128, "bfloat16"): cand})
    assert lau.config == cand and configs.TABLE == before
    cand = configs.TileConfig(128, 128, 12, stages=3)
    lau = forms.fa2_forward(_problem(), override={("fa3_fwd_sm90", 128, "bfloat16"): cand})
    assert lau.config == cand and lau.template_args[4] == 3 and configs.TABLE == before


def test_registry_names_every_form_row_and_source():
    rows = {k for (k, _, _) in configs.TABLE}
    named = {r for v in registry.REGISTRY.values() for f in v.forms for r in f.tile_rows}
    assert rows <= named | {h.kernel for v in registry.REGISTRY.values() for h in v.helpers}
    kernels = {lau.kernel for arch in ("sm_80", "sm_90") for lau in forms.all_instantiations(arch)}
    assert kernels == set(registry.kernels()), "every instantiated template is in the registry and vice versa"
    for v in registry.REGISTRY.values():
        for f in v.forms:
            assert (ROOT / "cuda" / f.source).is_file()
            assert all(m == "-" or (ROOT / "cuda" / m).is_file() for m in f.mainloops), f.mainloops
            assert (f.twin is None) == bool(f.no_twin), f"{f.kernel}: a twin, or the reason there is none"
            assert f"__global__" in (ROOT / "cuda" / f.source).read_text() and f.kernel in compile.assemble(f.source)


def test_which_fa3_forwards_store_o_through_shared_memory():
    fwd = lambda **kw: forms.fa2_forward(Problem(**{**dict(batch=2, seqlen_q=4096, seqlen_k=4096, heads=4,  # noqa: E731
                                                        kv_heads=4, head_dim=128, dtype="bfloat16", causal=False,
                                                        arch="sm_90"), **kw}))
    assert not launch.stages_o(fwd()), "128 x 176 with one Q_i buffer: from registers"
    assert launch.stages_o(fwd(seqlen_q=512, seqlen_k=512)), "SHORT_FULL_ROWS: two Q_i buffers"
    assert launch.stages_o(fwd(seqlen_q=512, seqlen_k=512, causal=True)), "SHORT_CAUSAL_ROWS"
    assert launch.stages_o(fwd(head_dim=64)), "192 x 128 with two Q_i buffers"
    assert launch.stages_o(fwd(head_dim=256)) and not launch.stages_o(fwd(head_dim=256, softcap=5.0))
    assert not launch.stages_o(fwd(head_dim=192)), "unmeasured: from registers"
    assert not launch.stages_o(forms.fa2_forward(Problem(2, 4096, 4096, 4, 4, 128, "bfloat16", False, "sm_90"),
                                                 forms.Switches(warp_specialize=False)))
