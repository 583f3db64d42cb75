"""decode's latent cache (MLA's absorbed decode: k_cache of 576 columns whose first 512 are the values, head_dim_v):
the refusals (one per input, before any launch), the plan and its launches, shapes and shared memory, the reference,
and the Numba twin on the simulator (tiny shapes; NUMBA_ENABLE_CUDASIM=1, a process of its own) against the float64
reference by flash-attn's rule. The GPU tests are tests/test_gpu_decode_latent.py."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import rawflash
from rawflash import reference, validation
from rawflash.kernels import configs, forms, launch
from rawflash.problem import Problem

D, DV = configs.LATENT_HEAD_DIM, configs.LATENT_HEAD_DIM_V
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
sim = [pytest.mark.sim, pytest.mark.skipif(not SIMULATOR, reason="needs NUMBA_ENABLE_CUDASIM=1 set before numba is "
                                                                  "imported (a process of its own)")]


def _case(batch=2, sq=1, h=16, cap=130, lens=(40, 63), new=2, page=0, dtype="float16", seed=0):
    """q, the latent cache (contiguous, or pages of ``page`` rows in a shuffled pool), cache_seqlens, k_new and the
    block table."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(reference.np_dtype(dtype)) if hasattr(reference, "np_dtype") else np.dtype(dtype)
    q = rng.standard_normal((batch, sq, h, D)).astype(dt)
    k_new = rng.standard_normal((batch, new, 1, D)).astype(dt) if new else None
    table = None
    if page:
        per = -(-cap // page)
        pool = rng.permutation(batch * per)
        table = pool.reshape(batch, per).astype(np.int32)
        k_cache = rng.standard_normal((batch * per, page, 1, D)).astype(dt)
    else:
        k_cache = rng.standard_normal((batch, cap, 1, D)).astype(dt)
    return q, k_cache, np.array(lens, np.int32), k_new, table


def test_reference_is_decode_with_values_cut_from_the_keys():
    q, kc, lens, kn, _ = _case(dtype="float32")
    out, lse = reference.decode(q, kc, None, lens, k_new=kn, head_dim_v=DV)
    pad = ((0, 0), (0, 0), (0, 0), (0, D - DV))
    want = reference.decode(q, kc, np.pad(kc[..., :DV], pad), lens, k_new=kn, v_new=np.pad(kn[..., :DV], pad))
    assert out.shape == (2, 1, 16, DV)
    np.testing.assert_allclose(out, want[0][..., :DV], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want[1], rtol=0, atol=1e-12)


def test_api_reference_appends_k_new_once():
    q, kc, lens, kn, table = _case(page=64, dtype="float32")
    out = rawflash.decode(q, kc, cache_seqlens=lens, k_new=kn, block_table=table, head_dim_v=DV,
                          backend="reference")
    assert out.shape == (2, 1, 16, DV)
    for b in range(2):
        for t in range(2):
            j = lens[b] + t
            np.testing.assert_array_equal(kc[table[b, j // 64], j % 64, 0], kn[b, t, 0])


def _refused(**change):
    q, kc, lens, kn, _ = _case()
    args = dict(q=q, k_cache=kc, v_cache=None, cache_seqlens=lens, k_new=kn, head_dim_v=DV, backend="numba")
    args.update(change)
    return args


REFUSALS = [
    ("v_cache", dict(v_cache="k"), "v_cache must be None with head_dim_v"),
    ("v_new", dict(v_new="kn"), "v_new must be None with head_dim_v"),
    ("head_dim_v-value", dict(head_dim_v=500), "head_dim_v must be a multiple of 8"),
    ("head_dim_v-bool", dict(head_dim_v=True), "head_dim_v must be None or an int"),
    ("head_dim_v-pair", dict(head_dim_v=256), "head_dim_v: the latent cache's form runs head_dim 576"),
    ("q-float32", dict(q="f32"), "q: the latent cache runs float16 or bfloat16"),
    ("k_descale", dict(k_descale=np.ones(1, np.float32)), "k_descale: the latent cache runs 16-bit caches only"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_latent_refusals_name_their_argument(name, change, message):
    args = _refused()
    for k, v in change.items():
        args[k] = {"k": args["k_cache"], "kn": args["k_new"], "f32": args["q"].astype(np.float32)}.get(v, v) \
            if isinstance(v, str) and k != "backend" else v
    k_cache_before = args["k_cache"].copy()
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validation.check_decode(args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"], args["k_new"],
                                args.get("v_new"), None, True, None, args["backend"], validation.Features(),
                                args.get("k_descale"), None, args["head_dim_v"])
    np.testing.assert_array_equal(args["k_cache"], k_cache_before)  # nothing appended


def test_v_cache_none_needs_head_dim_v():
    q, kc, lens, kn, _ = _case()
    with pytest.raises(ValueError, match="v_cache must be an array, or None with head_dim_v"):
        rawflash.decode(q, kc, cache_seqlens=lens, backend="reference")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_admitted_on_the_gpu_backends_with_no_setting(backend, dtype, monkeypatch):
    """With no RAWFLASH_* variable set, a 16-bit latent cache at 576 / 512 passes validation on the cupy and numba
    backends, and its problem plans on sm_90 onto the latent cache's warpgroup form (DV, then True, as the last
    template arguments; compiled for sm_90a)."""
    for name in [n for n in os.environ if n.startswith("RAWFLASH_")]:
        monkeypatch.delenv(name)
    q, kc, lens, kn, _ = _case(dtype=dtype)
    c = validation.check_decode(q, kc, None, lens, kn, None, None, True, None, backend, validation.Features(), None,
                                None, DV)
    assert (c.problem.head_dim, c.problem.head_dim_v, c.problem.value_head_dim) == (D, DV, DV)
    split = forms.decode_plan(dataclasses.replace(c.problem, arch="sm_90")).split
    assert split.kernel == "decode_split" and split.template_args[2] == D and split.template_args[-2:] == (DV, True)
    assert split.compile_arch("sm_90") == "sm_90a"


def _problem(heads=128, sq=1, new=1, page=64, cap=32768, batch=64, dtype="bfloat16"):
    return Problem(batch, sq, cap, heads, 1, D, dtype, True, "sm_90", seqused_k=True, new_keys=new, page_size=page,
                   head_dim_v=DV)


@pytest.mark.parametrize("wgmma", [True, False])
@pytest.mark.parametrize("heads,sq", [(16, 1), (16, 4), (64, 1), (128, 1), (128, 4)])
def test_latent_plan(heads, sq, wgmma):
    p = _problem(heads, sq)
    plan = forms.decode_plan(p, wgmma=wgmma)
    split = plan.split
    cfg = split.config
    form = (DV, True) if wgmma else (DV,)
    assert split.template_args[2] == D and split.template_args[8:] == form and split.block == (cfg.threads, 1, 1)
    assert split.compile_arch("sm_90") == ("sm_90a" if wgmma else "sm_90")
    # sm_90's opt-in shared memory; the warpgroup form: a float per warpgroup and row, 1024 B of alignment slack
    assert split.smem == launch.smem_decode_split(cfg, D, 2, 2, DV, wgmma) <= 232448
    assert split.smem == (230912 if wgmma else 231424)
    groups = -(-heads * sq // cfg.br)
    assert split.grid == (plan.num_splits, groups, p.batch)  # one split per CTA
    assert plan.partials == plan.num_splits and plan.split_appends == (groups == 1)
    kernels = [lau.kernel for lau in plan.launches]
    assert kernels[0] == ("decode_split" if groups == 1 else "decode_append")
    if "decode_append" in kernels:
        assert plan.launches[0].template_args[-1] is False  # K alone
    if not plan.fused:
        assert plan.launches[-1].template_args[-1] is True  # out of head_dim_v columns


@pytest.mark.parametrize("wgmma", [True, False])
def test_latent_merge_fits_the_tiles(wgmma):
    cfg = configs.value_row("decode_split", D, DV, "bfloat16")
    rows, splits = cfg.br, cfg.warps // cfg.wc
    merge = splits * rows * (DV + 4) * 4 + splits * rows * 4
    assert max(merge, rows * (launch.DECODE_MAX_SPLITS + 1) * 4) + 16 <= launch.smem_decode_split(cfg, D, 2, 2, DV,
                                                                                                   wgmma)


def test_warpgroup_form_is_the_latent_caches():
    p = dataclasses.replace(_problem(), head_dim=128, head_dim_v=0)
    cfg = forms.decode_plan(p).split.config
    with pytest.raises(ValueError, match="warpgroup form is the latent cache's"):
        launch.decode_split(p, cfg, 4, wgmma=True)
    assert forms.decode_plan(p, wgmma=True).split.template_args == forms.decode_plan(p, wgmma=False).split.template_args


def test_latent_needs_sm_90():
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        forms.decode_plan(dataclasses.replace(_problem(), arch="sm_80"))


def test_latent_instantiations_are_listed():
    names = {lau.name_expression for lau in forms.all_instantiations("sm_90")}
    for t in ("__half", "__nv_bfloat16"):
        assert f"decode_split<{t}, {t}, 576, 4, 64, 2, 8, 231424, 512>" in names
        assert f"decode_split<{t}, {t}, 576, 4, 64, 2, 8, 230912, 512, true>" in names
        assert f"decode_append<{t}, {t}, false>" in names and f"decode_combine_warp<{t}, 4, true>" in names
    assert not any(", 576, " in lau.name_expression for lau in forms.all_instantiations("sm_80"))


# ---------------------------------------------------------------- the twin on the simulator
SIM_CASES = [
    ("contiguous-sq1", dict(lens=(40, 63), new=2, sq=1), {}),
    ("contiguous-sq2-splits3", dict(lens=(70, 5), new=2, sq=2), dict(num_splits=3)),
    ("page64-appends-cross-a-page", dict(lens=(63, 126), new=2, sq=1, page=64), dict(num_splits=2)),
    ("page64-sq2-no-append", dict(lens=(100, 41), new=0, sq=2, page=64), {}),
]


@pytest.mark.parametrize("name,kw,extra", SIM_CASES, ids=[c[0] for c in SIM_CASES])
@pytest.mark.parametrize("", [pytest.param(marks=sim)])
def test_latent_twin_matches_the_reference(name, kw, extra):
    q, kc, lens, kn, table = _case(cap=130, **kw)
    opts = dict(k_new=kn, block_table=table, causal=True, head_dim_v=DV)
    ref_out, ref_lse = reference.decode(q, kc, None, lens, **opts)
    base_out, _ = reference.decode(q, kc, None, lens, upcast=False, **opts)
    ours = kc.copy()
    out, lse = rawflash.decode(q, ours, cache_seqlens=lens, backend="numba", return_lse=True, **opts, **extra)
    assert out.shape == (2, kw["sq"], 16, DV)
    assert reference.error_ratio_ok(out, ref_out, base_out, q.dtype, 2)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-3)
    want, _ = reference.append_kv(kc, kc, lens, kn, kn, table) if kn is not None else (kc, None)
    np.testing.assert_array_equal(ours, want)  # the append, K once
