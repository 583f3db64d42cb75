"""Which forward kernel runs where (no GPU needed): the wgmma kernel on sm_90 for 16-bit inputs whose head_dim
pads to 64, 128, 192 or 256, the mma.sync kernel everywhere else, and clear errors when wgmma is demanded where
it cannot run. Also: the generated wgmma wrappers are up to date with their generator."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rawflash import launch
from rawflash.launch import Problem

ROOT = Path(__file__).resolve().parents[1]


def _problem(d=128, dtype="bfloat16", arch="sm_90", causal=False):
    return Problem(2, 300, 300, 8, 2, d, dtype, causal, arch)


@pytest.mark.parametrize("d", [40, 59, 64, 100, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_16bit_runs_wgmma(d, dtype, monkeypatch):
    monkeypatch.delenv("RAWFLASH_WGMMA", raising=False)
    lau = launch.fa2_fwd(_problem(d, dtype))
    assert lau.kernel == "fa2_fwd_sm90" and lau.target == "sm_90a"
    assert lau.compile_arch("sm_90") == "sm_90a"
    assert lau.threads == 128 * (lau.config.br // 64), "one warpgroup per 64 query rows"


@pytest.mark.parametrize("d,dtype,arch", [(32, "bfloat16", "sm_90"), (96, "float16", "sm_90"),
                                          (128, "float32", "sm_90"), (128, "bfloat16", "sm_80"),
                                          (128, "bfloat16", "sm_89"), (128, "bfloat16", "sm_100")])
def test_elsewhere_runs_mma_sync(d, dtype, arch):
    lau = launch.fa2_fwd(_problem(d, dtype, arch))
    assert lau.kernel == "fa2_fwd" and lau.target is None
    assert lau.compile_arch(arch) == arch


def test_environment_and_switches_force_mma_sync(monkeypatch):
    assert launch.fa2_fwd(_problem(), wgmma=False).kernel == "fa2_fwd"
    assert launch.fa2_fwd(_problem(), defer_norm=False).kernel == "fa2_fwd", "the ablation switches live in fa2_fwd"
    monkeypatch.setenv("RAWFLASH_WGMMA", "0")
    assert launch.fa2_fwd(_problem()).kernel == "fa2_fwd"
    assert launch.fa2_fwd(_problem(), wgmma=True).kernel == "fa2_fwd_sm90", "an explicit request wins"


@pytest.mark.parametrize("kwargs,problem", [({"wgmma": True}, _problem(arch="sm_80")),
                                            ({"wgmma": True}, _problem(dtype="float32")),
                                            ({"wgmma": True}, _problem(d=96)),
                                            ({"wgmma": True, "split_q": False}, _problem())])
def test_demanding_wgmma_where_it_cannot_run_is_refused(kwargs, problem):
    with pytest.raises(ValueError, match="wgmma=True needs an sm_90 GPU"):
        launch.fa2_fwd(problem, **kwargs)


def test_overlap_switch_reaches_the_template():
    on, off = launch.fa2_fwd(_problem(), overlap=True), launch.fa2_fwd(_problem(), overlap=False)
    assert on.name_expression != off.name_expression
    assert on.template_args[6] is True and off.template_args[6] is False


def test_sm90_smem_fits_one_block():
    for d in (64, 128, 192, 256):
        for dtype in ("float16", "bfloat16"):
            lau = launch.fa2_fwd(_problem(d, dtype))
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
    (128, "bfloat16", "sm_90", False, "fa2_bwd_sm90"), (40, "float16", "sm_90", False, "fa2_bwd_sm90"),
    (128, "bfloat16", "sm_90", True, "fa2_bwd"), (256, "bfloat16", "sm_90", False, "fa2_bwd_sm90"),
    (96, "bfloat16", "sm_90", False, "fa2_bwd"), (32, "float16", "sm_90", False, "fa2_bwd"),
    (192, "bfloat16", "sm_90", False, "fa2_bwd"),
    (128, "float32", "sm_90", False, "fa2_bwd"), (128, "bfloat16", "sm_80", False, "fa2_bwd")])
def test_backward_kernel_choice(d, dtype, arch, deterministic, expected, monkeypatch):
    monkeypatch.delenv("RAWFLASH_WGMMA", raising=False)
    launches = launch.backward_launches(_problem(d, dtype, arch), deterministic=deterministic)
    assert launches[1].kernel == expected
    monkeypatch.setenv("RAWFLASH_WGMMA", "0")
    assert launch.backward_launches(_problem(d, dtype, arch), deterministic=deterministic)[1].kernel == "fa2_bwd"


def test_demanding_wgmma_backward_where_it_cannot_run_is_refused():
    with pytest.raises(ValueError, match="wgmma=True \\(backward\\) needs"):
        launch.fa2_bwd(_problem(dtype="float32"), wgmma=True)
    with pytest.raises(ValueError, match="atomic dQ"):
        launch.fa2_bwd(_problem(), atomic_dq=False, wgmma=True)


@pytest.mark.parametrize("d,split", [(64, False), (128, False), (200, True), (256, True)])
def test_backward_split_d_form_for_large_head_dims(d, split):
    lau = launch.fa2_bwd(_problem(d=d))
    assert lau.kernel == "fa2_bwd_sm90" and launch.bwd_sm90_split_d(lau.config) is split
    assert lau.template_args[6] is split and lau.smem <= 232448
