"""head_dim 512 (head dims 257 - 512) without a GPU: the calls admitted with no setting, the refusals, one per
refused input, the forms a call lands on and what they need (rows, shared memory, the twins' tiles).

The GPU tests of these forms are tests/test_gpu_hd512.py; the twins at head_dim 512 on the simulator are in
tests/test_numba_sim.py.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import rawflash
from conftest import random_qkv
from rawflash import reference, settings, signature, validation
from rawflash.kernels import configs, cupy_backend, forms, launch
from rawflash.kernels.forms import Switches
from rawflash.problem import Problem

SM80_SMEM, SM90_SMEM = 166912, 232448  # the most dynamic shared memory a CTA may ask for


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel launch was reached")

    for name in ("bind_forward", "bind_forward_fp8", "bind_backward", "bind_decode", "run"):
        monkeypatch.setattr(cupy_backend, name, refuse)


def qkv(d=512, dtype=np.float16, sq=5, sk=7):
    return random_qkv(1, sq, sk, 4, 2, d, dtype)


# ---------------------------------------------------------------- admitted with no setting
def _clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("RAWFLASH_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("d", [257, 300, 512])
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_admitted_with_no_setting(d, backend, monkeypatch):
    """A 16-bit forward and backward above 256 pass validation on the GPU backends with no RAWFLASH_* variable set,
    and plan onto the 512 rows (FA3's column split on sm_90, the mma.sync backward)."""
    _clean_env(monkeypatch)
    q, k, v = qkv(d, np.float16)
    c = validation.check_forward(q, k, v, True, None, backend=backend)
    assert c.problem.head_dim == d and configs.padded_head_dim(d) == 512
    out = np.zeros(q.shape, q.dtype)
    lse = np.zeros((1, 4, 5), np.float32)
    assert validation.check_backward(out, q, k, v, out, lse, True, None, False, backend).problem.head_dim == d
    p = dataclasses.replace(c.problem, arch="sm_90")
    assert forms.forward_plan(p)[0].kernel == "fa3_fwd_sm90"
    assert forms.backward_plan(p)[1].kernel == "fa2_bwd"


def test_256_and_below_unchanged(monkeypatch):
    _clean_env(monkeypatch)
    q, k, v = qkv(256)
    assert validation.check_forward(q, k, v, True, None).problem.head_dim == 256


def test_plan_key_reads_no_head_dim_512_setting(monkeypatch):
    """The plan key holds only the settings that change a plan: a head_dim 512 call plans the same way under any
    environment, so no RAWFLASH_HEAD_DIM_512 or RAWFLASH_MLA_DECODE is read."""
    _clean_env(monkeypatch)
    off = signature.settings_key()
    monkeypatch.setenv("RAWFLASH_HEAD_DIM_512", "1")
    monkeypatch.setenv("RAWFLASH_MLA_DECODE", "1")
    assert signature.settings_key() == off
    assert not {"head_dim_512", "mla_decode"} & {f.name for f in dataclasses.fields(settings.Settings)}


@pytest.mark.parametrize("causal", [False, True])
def test_reference_backend_at_512(causal):
    q, k, v = qkv(512, np.float32)
    out, lse = rawflash.forward(q, k, v, causal=causal, backend="reference")
    ref_out, ref_lse = reference.forward(q, k, v, causal=causal)
    assert np.allclose(out, ref_out) and np.allclose(lse, ref_lse)
    grads = rawflash.backward(q, q, k, v, out, lse, causal=causal, backend="reference")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ---------------------------------------------------------------- refused inputs, one each
def test_float32_refused():
    q, k, v = qkv(512, np.float32)
    with pytest.raises(TypeError, match="head_dim above 256 runs in float16 or bfloat16 only .*got float32"):
        rawflash.forward(q, k, v)


def test_fp8_inputs_refused():
    import ml_dtypes

    q, k, v = (x.astype(ml_dtypes.float8_e4m3fn) for x in qkv(512, np.float32))
    with pytest.raises(ValueError, match="float8_e4m3fn inputs run head_dim up to 256: the FP8 form has no head_dim "
                                         "512 row"):
        rawflash.forward(q, k, v)


def test_fp8_quantised_inside_refused():
    q, k, v = qkv(512, np.float16)
    with pytest.raises(ValueError, match="float8_e4m3fn inputs run head_dim up to 256"):
        rawflash.forward(q, k, v, fp8=True)


def test_fa1_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="kernel='fa1' runs head_dim up to 256"):
        rawflash.forward(q, k, v, kernel="fa1")


def test_paged_refused():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((9, 4, 512)).astype(np.float16)
    kp, vp = (rng.standard_normal((4, 16, 2, 512)).astype(np.float16) for _ in range(2))
    with pytest.raises(ValueError, match="a paged forward .block_table. runs head_dim up to 256"):
        rawflash.forward(q, kp, vp, cu_seqlens_q=np.array([0, 4, 9], np.int32), seqused_k=np.array([20, 30], np.int32),
                         block_table=np.array([[0, 1], [2, 3]], np.int32))


def test_decode_refused():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 512)).astype(np.float16)
    kc, vc = (rng.standard_normal((2, 64, 2, 512)).astype(np.float16) for _ in range(2))
    with pytest.raises(ValueError, match="decode runs head_dim up to 256: decode_split has no head_dim 512 row"):
        rawflash.decode(q, kc, vc, cache_seqlens=10)


@pytest.mark.parametrize("switch", ["defer_norm", "seq_parallel", "split_q"])
def test_ablation_switches_refused(switch):
    p = Problem(1, 100, 100, 2, 2, 512, "bfloat16", False, "sm_90")
    with pytest.raises(ValueError, match=rf"{switch}=False \(the ablation\) runs head_dim up to 256"):
        forms.forward_plan(p, switches=Switches(**{switch: False}))


@pytest.mark.parametrize("switches", [Switches(wgmma=True), Switches(warp_specialize=True)])
def test_hopper_forms_refused_when_asked_for(switches):
    """sm_80 has no wgmma form at any head_dim; on sm_90 both switches take FA3's column split."""
    p = Problem(1, 100, 100, 2, 2, 512, "bfloat16", False, "sm_80")
    with pytest.raises(ValueError, match="needs an sm_90 GPU, float16 or bfloat16"):
        forms.forward_plan(p, switches=switches)
    (fwd,) = forms.forward_plan(dataclasses.replace(p, arch="sm_90"), switches=switches)
    assert fwd.kernel == "fa3_fwd_sm90" and fwd.config.wc == 2


def test_cp_async_wgmma_form_refused_at_512():
    """The cp.async wgmma form (warp_specialize=False) has no row at 512: asked for, it is refused by name."""
    p = Problem(1, 100, 100, 2, 2, 512, "bfloat16", False, "sm_90")
    with pytest.raises(ValueError, match=r"cp.async wgmma form, which needs a head_dim that pads to one of "
                                         r"\[64, 128, 192, 256\]; got arch sm_90, bfloat16, head_dim 512"):
        forms.forward_plan(p, switches=Switches(warp_specialize=False))


def test_backward_wgmma_refused_when_asked_for():
    p = Problem(1, 100, 100, 2, 2, 512, "float16", False, "sm_90")
    with pytest.raises(ValueError, match=r"wgmma=True \(backward\) needs"):
        forms.backward_plan(p, wgmma=True)


def test_a_form_without_a_row_names_itself():
    p = Problem(1, 100, 100, 2, 2, 512, "float32", False, "sm_80")
    with pytest.raises(ValueError, match="fa2_fwd has no tile row for head_dim 512 in float32"):
        forms.forward_plan(p)


# ---------------------------------------------------------------- the forms a call lands on
def _problems():
    for arch, dtype, d in ((a, t, d) for a in ("sm_90", "sm_80") for t in ("float16", "bfloat16") for d in (300, 512)):
        base = Problem(2, 300, 200, 4, 2, d, dtype, False, arch)
        for p in (base, dataclasses.replace(base, causal=True), dataclasses.replace(base, window=(40, 0)),
                  dataclasses.replace(base, alibi=True, causal=True)):
            yield p


@pytest.mark.parametrize("p", list(_problems()), ids=lambda p: f"{p.arch}-{p.dtype}-d{p.head_dim}-{p.general}")
def test_forms_at_512(p):
    """The forward takes FA3's column split on sm_90 and the mma.sync form elsewhere (and on sm_90 with
    wgmma=False); the backward takes the mma.sync forms with their column splits everywhere, as two passes (dQ
    apart, no atomics) whether deterministic or not. Each fits the arch's shared memory and names WC as its last
    template argument."""
    limit = SM90_SMEM if p.arch == "sm_90" else SM80_SMEM
    (fwd,) = forms.forward_plan(p, switches=Switches(wgmma=False)) if p.arch == "sm_90" else forms.forward_plan(p)
    assert fwd.kernel == "fa2_fwd" and fwd.template_args[1] == 512 and fwd.template_args[-1] == fwd.config.wc == 2
    assert fwd.config.br == 32 and fwd.smem == launch.smem_fa2_fwd(fwd.config, 512, 2) == 98304 <= limit
    if p.arch == "sm_90":
        (fa3,) = forms.forward_plan(p)
        assert fa3.kernel == "fa3_fwd_sm90" and fa3.template_args[1] == 512 and fa3.template_args[-1] == 2
        assert fa3.smem == launch.smem_fa3_fwd_sm90(fa3.config, 512) == 197728 <= limit
    for deterministic in (False, True):  # (the two-pass plan either way: no dQ atomics at 512)
        pre, main, dq = forms.backward_plan(p, deterministic=deterministic)
        assert (pre.kernel, main.kernel, dq.kernel) == ("fa2_bwd_preprocess", "fa2_bwd", "fa2_bwd_dq")
        assert main.template_args[10] is False and main.config.wc == 4 and main.template_args[5] == 4
        assert main.smem <= limit
        assert dq.template_args[-1] == dq.config.wc == 2 and dq.smem == 98560 <= limit


def test_column_split_only_where_a_row_has_one():
    """WC = 1 is the templates' default and stays out of the name expressions: the other head dims' names are the
    ones they always had (FA3's forward: 15 arguments, SMEM_BYTES last)."""
    for d in configs.SPECIALISED_HEAD_DIMS[:-1]:
        p = Problem(1, 100, 100, 2, 2, d, "bfloat16", False, "sm_80")
        (fwd,) = forms.forward_plan(p)
        assert len(fwd.template_args) == 14 and fwd.config.wc == 1
        assert len(forms.backward_plan(p, deterministic=True)[2].template_args) == 10
        fa3 = forms.forward_plan(dataclasses.replace(p, arch="sm_90"))[0]  # (REF_FIRST: its way back after it)
        assert fa3.kernel == "fa3_fwd_sm90" and fa3.config.wc == 1
        assert len(fa3.template_args) == 15 and fa3.template_args[-1] == fa3.smem


# ---------------------------------------------------------------- FA3's forward at 512 (sm_90)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [300, 512])
def test_fa3_plan_at_512(dtype, d):
    """A 512 forward on sm_90: FA3's column split, 64 x 32 with two stages of K_j, V_j, two consumer warpgroups
    and a producer (384 threads), the running max (no P above 1 at this head_dim), O from registers (the two
    warpgroups share Q_i's buffer), the dynamic persistent grid; 197,728 B of shared memory."""
    p = Problem(2, 8192, 8192, 16, 8, d, dtype, False, "sm_90", sms=132)
    (fwd,) = forms.forward_plan(p)
    cfg = fwd.config
    assert fwd.kernel == "fa3_fwd_sm90" and fwd.target == "sm_90a"
    assert (cfg.br, cfg.bc, cfg.warps, cfg.wc, cfg.stages, cfg.q_stages) == (64, 32, 12, 2, 2, 1)
    ct = "__half" if dtype == "float16" else "__nv_bfloat16"
    assert fwd.template_args == (ct, 512, 64, 32, 2, launch.NO_MASK, False, launch.REF_RUNNING, True, True,
                                 launch.SCHEDULES["persistent, dynamic"], 1, False, 512, 197728, 2)
    assert fwd.smem == 1024 + 64 * 512 * 2 + 2 * 32 * 1024 * 2 + 8 * (2 + 8) + 16 == 197728 <= SM90_SMEM
    assert fwd.block == (384, 1, 1) and fwd.grid == (132, 1, 1) and launch.register_cap(cfg) == 168
    assert not launch.stages_o(fwd)


def test_fa3_grid_and_schedules_at_512():
    """seqused_k (the general policy, causal as a window) runs one tile per CTA as at every head_dim, a query tile
    of 64 rows."""
    p = Problem(2, 300, 200, 4, 2, 512, "bfloat16", True, "sm_90", seqused_k=True)
    (fwd,) = forms.forward_plan(p)
    assert fwd.kernel == "fa3_fwd_sm90" and launch.schedule_of(fwd) == "one tile per CTA"
    assert fwd.grid == (2 * 4 * 5, 1, 1) and fwd.template_args[5:7] == (launch.WINDOW, True)  # the general policy


def test_fa3_falls_back_at_512(monkeypatch):
    """Without FA3 (RAWFLASH_FA3=0) or wgmma (RAWFLASH_WGMMA=0) a 512 forward on sm_90 runs the mma.sync form, as
    other head dims without a cp.async wgmma row do; so does an input TMA cannot describe."""
    p = Problem(1, 100, 100, 2, 2, 512, "float16", True, "sm_90")
    for env in ("RAWFLASH_FA3", "RAWFLASH_WGMMA"):
        (fwd,) = forms.forward_plan(p, settings=settings.load({env: "0"}))
        assert fwd.kernel == "fa2_fwd" and fwd.config.wc == 2
    (fwd,) = forms.forward_plan_without_tma(p)
    assert fwd.kernel == "fa2_fwd"


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_instantiations_at_512(arch):
    """all_instantiations (the compile tests' list) holds the 16-bit fa2 forms at 512 on both archs: plain and
    causal, the general policy without a mask and with a window; on sm_90 also FA3's forward, each policy on its
    persistent grid and the general ones one tile per CTA (packed sequences, seqused_k); no other kernel."""
    wide = [lau for lau in forms.all_instantiations(arch) if lau.config and lau.template_args[1] == 512]
    fa3 = [lau for lau in wide if lau.kernel == "fa3_fwd_sm90"]
    assert {lau.kernel for lau in wide} == {"fa2_fwd", "fa2_bwd", "fa2_bwd_dq"} | ({"fa3_fwd_sm90"} if fa3 else set())
    assert {lau.template_args[0] for lau in wide} == {"__half", "__nv_bfloat16"}
    assert len(wide) - len(fa3) == 32, "2 dtypes x 4 policies x (forward, 2 backwards, the dQ pass)"
    if arch == "sm_80":
        assert not fa3
        return
    candidates = [lau for lau in fa3 if lau.config.bc == 64]  # forms.FA3_TILE_CANDIDATES: bfloat16, plain policy
    assert len(fa3) == 14 and len(candidates) == 2, "2 dtypes x (4 policies persistent + 2 general a tile per CTA)"
    assert all(lau.template_args[-1] == lau.config.wc == 2 and lau.smem <= 197728 for lau in fa3)
    assert {lau.smem for lau in candidates} == {197696} and {lau.config.stages for lau in candidates} == {1}
    assert {launch.schedule_of(lau) for lau in fa3 if lau.template_args[6]} == {"persistent, dynamic",
                                                                              "one tile per CTA"}


def test_runs_head_dim():
    assert forms.runs_head_dim(256, "float32", "fa1") and forms.runs_head_dim(512, "bfloat16")
    assert forms.runs_head_dim(512, "float16", "naive")
    assert not forms.runs_head_dim(512, "float32") and not forms.runs_head_dim(300, "bfloat16", "fa1")


def test_rows_at_512():
    """The table's rows at 512 are the three mma.sync kernels' and FA3's forward in 16-bit, each splitting the head
    columns; no architecture, situation or tuned GPU has another."""
    wide = {(k, dt) for (k, d, dt) in configs.TABLE if d == configs.WIDE_HEAD_DIM}
    kernels = ("fa2_fwd", "fa2_bwd", "fa2_bwd_dq", "fa3_fwd_sm90")
    assert wide == {(k, dt) for k in kernels for dt in ("float16", "bfloat16")}
    assert all(configs.TABLE[(k, 512, dt)].wc > 1 for k, dt in wide)
    others = [*configs.ARCH_ROWS.values(), *configs.SITUATION_ROWS.values(), *configs.GPU_ROWS.values()]
    assert not [key for rows in others for key in rows if key[1] == 512]
