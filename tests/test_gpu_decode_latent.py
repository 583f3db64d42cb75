"""decode's latent cache (MLA's absorbed decode: k_cache of 576 columns, the values its first 512; head_dim_v) on a
GPU against the float64 reference by flash-attn's rule: 16 - 128 query heads on one kv head, contiguous and paged
(pages of 64, and of 16 and 40, whose key tiles cross pages), 1 - 4 query rows, appends (across a page edge),
float16 and bfloat16, the split counts and combines each way, a planned step; each in both forms of the split pass
(the warpgroup form, and the mma.sync form that RAWFLASH_WGMMA=0 runs). tests/test_decode_latent.py checks the plans
and the twin without a GPU."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import rawflash
from rawflash import reference
from rawflash.kernels import configs

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
D, DV = configs.LATENT_HEAD_DIM, configs.LATENT_HEAD_DIM_V


@pytest.fixture(autouse=True)
def needs_a_gpu():
    if not cupy.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(autouse=True, params=["wgmma", "mma"])
def form(request, monkeypatch):
    """The split pass's form: the warpgroup one (the default) or the mma.sync one (RAWFLASH_WGMMA=0)."""
    monkeypatch.setenv("RAWFLASH_WGMMA", "1" if request.param == "wgmma" else "0")
    return request.param


def _inputs(batch, sq, h, cap, lens, new, page, dtype, seed=0):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, sq, h, D)).astype(dt)
    kn = rng.standard_normal((batch, new, 1, D)).astype(dt) if new else None
    table = None
    if page:
        per = -(-cap // page)
        table = rng.permutation(batch * per).astype(np.int32).reshape(batch, per)
        kc = rng.standard_normal((batch * per, page, 1, D)).astype(dt)
    else:
        kc = rng.standard_normal((batch, cap, 1, D)).astype(dt)
    return q, kc, np.asarray(lens, np.int32), kn, table


def check_latent(batch, sq, h, cap, lens, new, page, dtype, num_splits=None, planned=False):
    q, kc, lens, kn, table = _inputs(batch, sq, h, cap, lens, new, page, dtype)
    opts = dict(k_new=kn, block_table=table, causal=True, head_dim_v=DV)
    ref, ref_lse = reference.decode(q, kc, None, lens, **opts)
    base, _ = reference.decode(q, kc, None, lens, upcast=False, **opts)
    dev = {n: None if x is None else cupy.asarray(x) for n, x in (("k_new", kn), ("block_table", table))}
    dq, dkc, dlens = cupy.asarray(q), cupy.asarray(kc), cupy.asarray(lens)
    call = dict(cache_seqlens=dlens, k_new=dev["k_new"], block_table=dev["block_table"], causal=True, head_dim_v=DV,
                num_splits=num_splits, return_lse=True)
    if planned:
        plan = rawflash.plan_decode(dq, dkc, **call)
        out, lse = plan.run(dq, dkc, None, dlens, k_new=dev["k_new"], block_table=dev["block_table"])
    else:
        out, lse = rawflash.decode(dq, dkc, **call)
    assert out.shape == (batch, sq, h, DV)
    ok, err, _, bound = reference.error_ratio_ok(cupy.asnumpy(out).astype(np.float64), ref, base, q.dtype, 2.0)
    assert ok, f"out error {err:.3g} > {bound:.3g}"
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=0, atol=2e-3)
    if kn is not None:  # K appended once
        want, _ = reference.append_kv(kc, kc, lens, kn, kn, table)
        np.testing.assert_array_equal(cupy.asnumpy(dkc).view(np.uint16), want.view(np.uint16))


CASES = [pytest.param(b, sq, h, cap, lens, new, page, dtype,
                      id=f"{dtype}-b{b}-sq{sq}-h{h}-{'page' + str(page) if page else 'contiguous'}-new{new}")
         for (b, sq, h, cap, lens, new, page), dtype in itertools.product(
             [(2, 1, 128, 4200, (4000, 63), 1, 64), (3, 4, 128, 2100, (2040, 0, 127), 4, 64),
              (2, 2, 16, 700, (600, 130), 2, 0), (2, 1, 64, 1100, (1023, 64), 2, 64),
              (4, 3, 32, 300, (1, 2, 250, 63), 3, 0),
              (1, 1, 128, 33000, (32767,), 1, 64), (2, 4, 16, 200, (126, 64), 2, 64), (2, 1, 16, 130, (0, 0), 0, 0),
              (2, 2, 128, 900, (700, 300), 2, 16), (2, 1, 64, 500, (450, 77), 1, 40)],
             ("bfloat16", "float16"))]


@pytest.mark.parametrize("batch,sq,h,cap,lens,new,page,dtype", CASES)
def test_latent_decode(batch, sq, h, cap, lens, new, page, dtype):
    check_latent(batch, sq, h, cap, lens, new, page, dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 40, 200])
def test_latent_decode_splits(num_splits):
    """One split, a few, more than the warp combine takes (33+), and more than the keys' tiles."""
    check_latent(2, 1, 128, 5000, (4900, 17), 1, 64, "bfloat16", num_splits=num_splits)


def test_latent_decode_planned():
    check_latent(2, 2, 128, 1000, (900, 64), 2, 64, "bfloat16", planned=True)
