"""Run every kernel once on small ragged shapes, as the workload of compute-sanitizer's memcheck, racecheck and
synccheck. A contributor runs it (through ``tools/gpu_run.sh sanitize``) after any kernel change, before it lands:
an out-of-bounds access, a shared-memory race or a barrier misuse shows there and rarely in a test. CuPy's memory
pool is switched off so that out-of-bounds accesses inside a pooled chunk are seen. Every form runs (the Hopper
forms where the GPU has them, the mma.sync forms through wgmma=False and RAWFLASH_WGMMA=0's backward), with and
without the features (windows, soft-capping, ALiBi, sinks, packed variable lengths, seqused_k); decode with
contiguous and paged caches; the paged forward; MLA's narrower v (padded, and FA3's DV forms); head_dim 512 (the
``wide`` part) and decode's latent cache (``latent``). SANITIZE_ONLY=decode, splitk, fa3, fp8, paged, mla, wide,
latent or feature:NAME (e.g. feature:alibi: that feature in every form) runs that part alone (racecheck is slow);
SANITIZE_SHARD=i/n runs shard i of n of the whole workload (the main loop's cases i, i + n, ...; the other parts in
shard 0), so that n processes side by side cover it. Example:

    SANITIZE_ONLY=fa3 compute-sanitizer --tool racecheck python3 tools/sanitize.py bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import cupy  # noqa: E402

cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)

import numpy as np  # noqa: E402

import rawflash  # noqa: E402
from rawflash import fp8  # noqa: E402
from conftest import random_qkv  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
CASES = [(2, 37, 53, 4, 2, 64), (1, 70, 33, 2, 1, 128), (1, 17, 17, 2, 2, 40), (1, 33, 65, 2, 1, 256)]
FEATURES = [dict(window=(9, 0)), dict(window=(5, 7)), dict(softcap=5.0), dict(alibi=True), dict(sinks=True),
            dict(varlen=True), dict(seqused=True, window=(3, 3), sinks=True, softcap=2.0)]


def _features(opts: dict, b: int, sk: int, h: int):
    out = {n: opts[n] for n in ("window", "softcap") if n in opts}
    if opts.get("alibi"):
        out["alibi_slopes"] = cupy.linspace(0.05, 0.5, h, dtype=cupy.float32)
    if opts.get("sinks"):
        out["sinks"] = cupy.linspace(-1, 1, h, dtype=cupy.float32)
    if opts.get("seqused"):
        out["seqused_k"] = cupy.asarray(np.maximum(0, sk - np.arange(b) * 5).astype(np.int32))
    return out


def _feature_calls(q, k, v, causal: bool, opts: dict) -> None:
    """One feature set (a FEATURES entry) on q, k, v: the forward (default form and mma.sync), the backward (atomic
    and deterministic)."""
    b, sk, h = q.shape[0], k.shape[1], q.shape[2]
    feats = _features(opts, b, sk, h)
    if opts.get("varlen"):
        q, k, v, packed = _varlen(q, k, v)
        feats.update(packed)
    for wgmma in (None, False):
        o, l = rawflash.forward(q, k, v, causal=causal, wgmma=wgmma, **feats)
    for det in (False, True):
        rawflash.backward(cupy.ones_like(q), q, k, v, o, l, causal=causal, deterministic=det, **feats)


def _feature(name: str, dtype: str) -> None:
    """The FEATURES entries that set ``name`` (SANITIZE_ONLY=feature:NAME), with or without others, on CASES, causal
    and not, in every form: the default one, mma.sync (wgmma=False and RAWFLASH_WGMMA=0's backward) and the cp.async
    wgmma backward (RAWFLASH_FA3=0)."""
    for opts in [o for o in FEATURES if name in o]:
        for env in ({}, {"RAWFLASH_FA3": "0"}, {"RAWFLASH_WGMMA": "0"}):
            os.environ.update(env)
            for b, sq, sk, h, hk, d in CASES:
                for causal in (False, True):
                    q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
                    _feature_calls(q, k, v, causal, opts)
            for key in env:
                del os.environ[key]
    cupy.cuda.Device().synchronize()


def _varlen(q, k, v):
    """The batch packed as variable-length sequences (each sequence's first rows, different lengths)."""
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    lq = [max(1, sq - 7 * i) for i in range(b)]
    lk = [max(1, sk - 5 * i) for i in range(b)]
    pq = cupy.concatenate([q[i, : lq[i]] for i in range(b)])
    pk = cupy.concatenate([k[i, : lk[i]] for i in range(b)])
    pv = cupy.concatenate([v[i, : lk[i]] for i in range(b)])
    cu = lambda n: cupy.asarray(np.cumsum([0] + n).astype(np.int32))  # noqa: E731
    return pq, pk, pv, dict(cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk))


def _decode(dtype: str) -> None:
    """decode: contiguous and paged caches (pages of 16 and 3), appends crossing a page, an empty sequence, several
    query rows, the features, one and many splits (the partials merged by decode_split's last CTAs; for MQA 32/1's 32
    packed rows by the warp combine at 40 splits, 10 partials, and by the CTA combine at 160, 40 partials), the
    append in decode_split and (MQA 32/1 with 2 query rows: two row groups of 32) decode_append before it, an
    appended key a window hides from every row, and out-of-range device lengths and pages; for 16-bit q the same
    caches quantised to float8_e4m3fn (per (sequence, kv head) descales) at the head dims with an FP8 row."""
    rng = np.random.default_rng(1)
    dt = random_qkv(1, 1, 1, 1, 1, 8, dtype)[0].dtype
    for d, (h, hk), page, sq in ((64, (4, 2), 0, 1), (128, (4, 1), 16, 3), (256, (2, 2), 3, 1), (96, (8, 2), 0, 2),
                                 (128, (32, 1), 16, 1), (128, (32, 1), 0, 2)):
        lens = np.array([0, 37, 70], np.int32)
        cap = 80
        if page:
            per = -(-cap // page)
            kc = cupy.asarray(rng.standard_normal((3 * per, page, hk, d)).astype(dt))
            table = cupy.asarray(rng.permutation(3 * per).reshape(3, per).astype(np.int32))
        else:
            kc, table = cupy.asarray(rng.standard_normal((3, cap, hk, d)).astype(dt)), None
        vc = kc.copy()
        q = cupy.asarray(rng.standard_normal((3, sq, h, d)).astype(dt))
        kn = cupy.asarray(rng.standard_normal((3, 2, hk, d)).astype(dt))
        for splits in (None, 1, 5, 40, 160):
            rawflash.decode(q, kc, vc, cache_seqlens=cupy.asarray(lens), k_new=kn, v_new=kn.copy(), block_table=table,
                            causal=True, num_splits=splits)
        rawflash.decode(q, kc, vc, cache_seqlens=cupy.asarray(lens), k_new=kn, v_new=kn.copy(), block_table=table,
                        causal=False, window=(0, 0), num_splits=3)  # one query row: key len seen by no row
        rawflash.decode(q, kc, vc, cache_seqlens=5, block_table=table, window=(4, 0), softcap=3.0,
                        alibi_slopes=cupy.full((h,), 0.1, cupy.float32), sinks=cupy.zeros(h, cupy.float32))
        # device values the host never checks: lengths past the capacity and below 0, pages outside the cache
        # (NaN rows; memcheck proves nothing outside the cache is read or written)
        bad_lens = cupy.asarray(np.array([cap + 100, -3, 37], np.int32))
        bad_table = None if table is None else table.copy()
        if bad_table is not None:
            bad_table[2, 1], bad_table[2, 0] = kc.shape[0] + 7, -1
        rawflash.decode(q, kc, vc, cache_seqlens=bad_lens, k_new=kn, v_new=kn.copy(), block_table=bad_table,
                        num_splits=3)
        if dtype == "float32" or d == 96:  # (FP8 caches: 16-bit q, head dims with a row)
            continue
        (k8, kd), (v8, vd) = (fp8.quantize_cache(x, batch=3 if page else None) for x in (kc, vc))
        for splits in (None, 5, 40):
            rawflash.decode(q, k8, v8, cache_seqlens=cupy.asarray(lens), k_new=kn, v_new=kn.copy(), block_table=table,
                            causal=True, num_splits=splits, k_descale=kd, v_descale=vd)
        rawflash.decode(q, k8, v8, cache_seqlens=bad_lens, k_new=kn, v_new=kn.copy(), block_table=bad_table,
                        num_splits=3, k_descale=kd, v_descale=vd)


def _paged(dtype: str) -> None:
    """The paged forward (block_table; 16-bit): packed queries against shuffled pages of 16 and 48 rows (the last page
    partly used), a sequence with no query and one with no key, GQA, causal both ways, a window and soft-capping;
    pages of 16 in FA3's TMA form (its stale V rows zeroed by the producer) and the cp.async form, pages of 48 in
    the cp.async form only; head dims on the wgmma forms' grid (64, 128) and off it (96: mma.sync)."""
    rng = np.random.default_rng(2)
    dt = random_qkv(1, 1, 1, 1, 1, 8, dtype)[0].dtype
    qlens, klens = (3, 0, 70, 33), (20, 5, 90, 0)
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32))
    used = cupy.asarray(np.asarray(klens, np.int32))
    for d in (64, 96, 128):
        for page in (16, 48):
            per = max(-(-n // page) for n in klens)
            pages = len(klens) * per + 1
            q = cupy.asarray(rng.standard_normal((sum(qlens), 4, d)).astype(dt))
            kp, vp = (cupy.asarray(rng.standard_normal((pages, page, 2, d)).astype(dt)) for _ in range(2))
            table = cupy.asarray(rng.permutation(pages)[: len(klens) * per].reshape(len(klens), per).astype(np.int32))
            for causal in (False, True):
                for opts in ({}, {"window": (7, 2)}, {"softcap": 10.0}):
                    copies = {"warp_specialize": False} if d % 64 == 0 else {"wgmma": False}  # (d 96: mma.sync)
                    for form in ({}, copies) if page == 16 else ({},):
                        rawflash.forward(q, kp, vp, cu_seqlens_q=cu, seqused_k=used, block_table=table,
                                         causal=causal, **form, **opts)


def _splitk(dtype: str) -> None:
    """FA1's split-K partition in fa2_fwd (split_q=False) with a serial grid, causal with seqlen_q - seqlen_k >= 32:
    tiles that see no key block, then a tile that does, reuse the Q buffer; fa1 with one query block per split
    (2 heads: 13 splits of 13 blocks), and with several per split and key block (132 heads: 2 splits), so both of
    its prefetch paths (the next Q block of K_j, the first of K_j+1) run."""
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 200, 33, 2, 1, 64, dtype))  # rows < 167 see no key
    rawflash.forward(q, k, v, causal=True, split_q=False, seq_parallel=False, defer_norm=False)
    rawflash.forward(q, k, v, causal=True, kernel="fa1")
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 200, 301, 132, 132, 64, dtype))
    for causal in (False, True):
        rawflash.forward(q, k, v, causal=causal, kernel="fa1")
        rawflash.forward(q, k, v, causal=causal, split_q=False)


def _fa3_forms(q, k, v, causal: bool) -> None:
    """On an H200: the cp.async wgmma forward, and FA3's with each of its switches flipped."""
    from rawflash.kernels import cupy_backend, forms
    from rawflash.problem import Problem

    arch = cupy_backend.device_arch()
    if arch != "sm_90":
        return
    p = Problem(1, 1, 1, 1, 1, q.shape[-1], str(q.dtype), causal, arch)
    if forms.hopper_form_fits("fa2_fwd_sm90", p):  # the cp.async form has rows for head dims on the 64 grid only
        rawflash.forward(q, k, v, causal=causal, warp_specialize=False)
    for sw in ({"pingpong": False}, {"persistent": not causal}, {"overlap": False, "persistent": True}):
        rawflash.forward(q, k, v, causal=causal, warp_specialize=True, **sw)


def _fa3(dtype: str) -> None:
    """FA3's forms alone (racecheck and synccheck of the whole workload are slow): forward with every switch,
    backward (atomic and deterministic, whose dQ writer orders the reduce-adds), over ragged shapes, GQA and a grid
    with more tiles than SMs; the deterministic backward also with a two-sided window on packed sequences. At
    head_dim 192 / 256 the atomic backward is the column split (mainloop_bwd_sm90_ws_split_d: its P^T, dS^T
    buffers shared by two warpgroups), at head_dim 64 it takes 128 query rows a step (one dQ_i buffer, the rows
    split between the warpgroups); both also on packed sequences with a window and soft-capping. Plain attention
    without a mask over >= 1024 query rows takes 80 rows a step at head_dim 96 / 128 (dQ_i^T, one dQ_i buffer);
    the deterministic backward without a mask walks the rotated order (every case above without one too)."""
    if dtype == "float32":
        return
    for b, sq, sk, h, hk, d in ((1, 203, 300, 4, 2, 64), (2, 300, 1029, 4, 1, 128), (5, 700, 700, 12, 4, 96),
                                (1, 129, 257, 2, 2, 256), (2, 203, 330, 4, 2, 192), (1, 600, 450, 4, 1, 256)):
        for causal in (False, True):
            q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
            out, lse = rawflash.forward(q, k, v, causal=causal)
            _fa3_forms(q, k, v, causal)
            for det in (False, True):
                rawflash.backward(cupy.ones_like(q), q, k, v, out, lse, causal=causal, deterministic=det)
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 2085, 300, 2, 1, 128, dtype))  # the 80-row tile, and the
    out, lse = rawflash.forward(q, k, v)  # deterministic backward's rotated order (more query blocks than key ones)
    for det in (False, True):
        rawflash.backward(cupy.ones_like(q), q, k, v, out, lse, deterministic=det)
    q, k, v = (cupy.asarray(x) for x in random_qkv(3, 300, 200, 4, 2, 128, dtype))
    qq, kk, vv, packed = _varlen(q, k, v)
    o, l = rawflash.forward(qq, kk, vv, window=(100, 30), **packed)
    rawflash.backward(cupy.ones_like(qq), qq, kk, vv, o, l, window=(100, 30), deterministic=True, **packed)
    # 128 query rows a step (d = 64) and the column split's pairs (d = 192, 256), packed, general policy; 150 keys:
    # three key tiles a sequence, so each sequence's last pair has a partner past its keys
    for d, sk in ((64, 200), (192, 150), (256, 150)):
        q, k, v = (cupy.asarray(x) for x in random_qkv(3, 300, sk, 4, 2, d, dtype))
        qq, kk, vv, packed = _varlen(q, k, v)
        o, l = rawflash.forward(qq, kk, vv, window=(100, 30), softcap=20.0, **packed)
        rawflash.backward(cupy.ones_like(qq), qq, kk, vv, o, l, window=(100, 30), softcap=20.0, **packed)


def _fp8(dtype: str) -> None:
    """The FP8 forward (sm_90 only): quantised inside (fp8=True, incoherent=True) and from e4m3 inputs with per-head
    descales, ragged shapes, GQA, causal both ways, every FA3 switch; windows, packed sequences, seqused_k."""
    from rawflash import fp8
    from rawflash.kernels import cupy_backend

    if dtype == "float32" or cupy_backend.device_arch() != "sm_90":
        return
    for b, sq, sk, h, hk, d in ((1, 203, 113, 4, 2, 64), (2, 300, 1029, 4, 1, 128), (1, 129, 257, 2, 2, 256)):
        for causal in (False, True):
            q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
            rawflash.forward(q, k, v, causal=causal, fp8=True)
            rawflash.forward(q, k, v, causal=causal, incoherent=True)
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, "head", kv_heads=hk) for x in (q, k, v))
            for sw in ({}, {"pingpong": False}, {"overlap": False}, {"persistent": not causal}):
                rawflash.forward(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, **sw)
            rawflash.forward(q8, k8, v8, causal=causal, window=(37, -1 if causal else 5), q_descale=qd,
                             k_descale=kd, v_descale=vd)
        # packed sequences (one V^T row per kv head from 128-key boundaries), a keyless one, seqused_k, a window
        lq, lk = (37, 1, 130), (53, 0, 300)
        cu_q, cu_k = (cupy.asarray([0, *np.cumsum(x)], dtype=cupy.int32) for x in (lq, lk))
        q, k, v = (cupy.asarray(random_qkv(1, n, n, hh, hh, d, dtype)[0][0]) for n, hh in
                   ((sum(lq), h), (sum(lk), hk), (sum(lk), hk)))
        (q8, _), (k8, _), (v8, _) = (fp8.quantize(x, "tensor") for x in (q, k, v))
        ds = cupy.full((3, hk), 0.75, cupy.float32)
        for causal, window, used in ((False, (-1, -1), None), (True, (40, -1), None), (True, (-1, -1), (50, 0, 9))):
            rawflash.forward(q8, k8, v8, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                             max_seqlen_k=max(lk), causal=causal, window=window, q_descale=ds, k_descale=ds,
                             v_descale=ds, seqused_k=None if used is None else cupy.asarray(used, cupy.int32))


def _packed_with_features(q, k, v, left: int) -> None:
    """q, k, v packed (variable lengths), forward and backward with a (left, 0) window, soft-capping and sinks."""
    qq, kk, vv, packed = _varlen(q, k, v)
    feats = dict(window=(left, 0), softcap=10.0, sinks=cupy.linspace(-1, 1, q.shape[2], dtype=cupy.float32), **packed)
    o, l = rawflash.forward(qq, kk, vv, **feats)
    rawflash.backward(cupy.ones_like(o), qq, kk, vv, o, l, **feats)


def _mla(dtype: str) -> None:
    """MLA's narrower v: the forward and the backward (v zero-padded with RAWFLASH_DV_FORM=0, then with =1 FA3's
    DV forms at 192 / 128 and 128 / 64 and a pair that rounds to them), ragged shapes, GQA, causal both ways,
    packed sequences with a window, soft-capping and sinks."""
    rng = np.random.default_rng(5)
    for d, dv, (b, sq, sk, h, hk) in ((192, 128, (1, 203, 330, 4, 2)), (128, 64, (2, 300, 129, 4, 1)),
                                      (160, 100, (1, 77, 257, 2, 2))):
        q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
        v = cupy.asarray(rng.standard_normal((b, sk, hk, dv)).astype(v.dtype))
        for dv_form in ("0", "1"):
            os.environ["RAWFLASH_DV_FORM"] = dv_form
            for causal in (False, True):
                out, lse = rawflash.forward(q, k, v, causal=causal)
                rawflash.backward(cupy.ones_like(out), q, k, v, out, lse, causal=causal)
            _packed_with_features(q, k, v, 50)
    os.environ.pop("RAWFLASH_DV_FORM", None)


def _wide(dtype: str) -> None:
    """head_dim 512's forms (16-bit): FA3's forward with its column split and the mma.sync
    forward (wgmma=False), the backward atomic and deterministic, at 512 and at 300 (zero-filled columns past it),
    ragged shapes, GQA, causal both ways, and packed sequences with a window, soft-capping and sinks."""
    if dtype == "float32":  # (float32 has no head_dim 512 row)
        return
    for d, (b, sq, sk, h, hk) in ((512, (1, 77, 130, 2, 1)), (300, (2, 33, 65, 2, 2))):
        q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
        dout = cupy.asarray(np.random.default_rng(2).standard_normal(q.shape).astype(q.dtype))
        for causal in (False, True):
            for wgmma in (None, False):
                out, lse = rawflash.forward(q, k, v, causal=causal, wgmma=wgmma)
            for det in (False, True):
                rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
        _packed_with_features(q, k, v, 20)


def _latent(dtype: str) -> None:
    """decode's latent cache (MLA's absorbed decode, 576 / 512, 16-bit): contiguous and in
    pages of 64, 16 and 128 query heads (one row group and two, the latter with decode_append first), 1 and 3 query
    rows, appends across a page edge, an empty sequence, one and many splits, and device lengths past the capacity."""
    if dtype == "float32":  # (the latent form is 16-bit)
        return
    from rawflash.kernels import configs

    d, dv = configs.LATENT_HEAD_DIM, configs.LATENT_HEAD_DIM_V
    rng = np.random.default_rng(3)
    dt = random_qkv(1, 1, 1, 1, 1, 8, dtype)[0].dtype
    lens, cap = np.array([0, 61, 100], np.int32), 130
    for h, sq, page in ((16, 1, 64), (128, 3, 0), (16, 2, 0), (128, 1, 64)):
        if page:
            per = -(-cap // page)
            kc = cupy.asarray(rng.standard_normal((3 * per, page, 1, d)).astype(dt))
            table = cupy.asarray(rng.permutation(3 * per).reshape(3, per).astype(np.int32))
        else:
            kc, table = cupy.asarray(rng.standard_normal((3, cap, 1, d)).astype(dt)), None
        q = cupy.asarray(rng.standard_normal((3, sq, h, d)).astype(dt))
        kn = cupy.asarray(rng.standard_normal((3, 4, 1, d)).astype(dt))
        for splits in (None, 1, 3, 40):
            rawflash.decode(q, kc, cache_seqlens=cupy.asarray(lens), k_new=kn, block_table=table, head_dim_v=dv,
                            num_splits=splits)
        bad = cupy.asarray(np.array([cap + 50, -2, 61], np.int32))
        rawflash.decode(q, kc, cache_seqlens=bad, k_new=kn, block_table=table, head_dim_v=dv, num_splits=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dtypes", nargs="*", metavar="DTYPE", help=f"of {', '.join(DTYPES)} (default: all three)")
    dtypes = ap.parse_args().dtypes or list(DTYPES)
    if set(dtypes) - set(DTYPES):
        ap.error(f"DTYPE is one of {', '.join(DTYPES)}, not {', '.join(sorted(set(dtypes) - set(DTYPES)))}")
    # 'decode', 'splitk', 'fa3', 'fp8', 'paged', 'mla', 'wide', 'latent' or 'feature:NAME' (e.g. feature:alibi):
    # that part alone
    # (racecheck is slow)
    only = os.environ.get("SANITIZE_ONLY")
    if only:
        for dtype in dtypes:
            if only.startswith("feature:"):
                _feature(only.split(":", 1)[1], dtype)
            else:
                {"decode": _decode, "splitk": _splitk, "fa3": _fa3, "fp8": _fp8, "paged": _paged,
                 "mla": _mla, "wide": _wide, "latent": _latent}[only](dtype)
            cupy.cuda.Device().synchronize()
            print(f"sanitize workload done: {only} {dtype}", flush=True)
        return
    shard, shards = (int(x) for x in os.environ.get("SANITIZE_SHARD", "0/1").split("/"))
    for dtype in dtypes:
        for b, sq, sk, h, hk, d in CASES[shard::shards]:
            for causal in (False, True):
                q, k, v = (cupy.asarray(x) for x in random_qkv(b, sq, sk, h, hk, d, dtype))
                for kernel in ("fa2", "fa1", "naive"):
                    out, lse = rawflash.forward(q, k, v, causal=causal, kernel=kernel)
                if dtype != "float32":  # on an H200: the mma.sync forward, and the wgmma ones without their ideas
                    rawflash.forward(q, k, v, causal=causal, wgmma=False)
                    rawflash.forward(q, k, v, causal=causal, overlap=False)
                    _fa3_forms(q, k, v, causal)
                if d in (64, 128):
                    for sw in ({"split_q": False}, {"seq_parallel": False, "defer_norm": False}):
                        rawflash.forward(q, k, v, causal=causal, **sw)
                dout = cupy.asarray(np.random.default_rng(0).standard_normal(q.shape).astype(q.dtype))
                for det in (False, True):
                    rawflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det)
                for opts in FEATURES:
                    _feature_calls(q, k, v, causal, opts)
                cupy.cuda.Device().synchronize()
        if shard == 0:
            _decode(dtype)
            if dtype != "float32":
                _paged(dtype)
            _fp8(dtype)
            _mla(dtype)
            _wide(dtype)
            _latent(dtype)
        print(f"sanitize workload done: {dtype}", flush=True)
    if shard != 0:
        return
    os.environ["RAWFLASH_FA3"] = "0"  # this script's own process: the cp.async wgmma backward too
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 70, 33, 2, 1, 128, "bfloat16"))
    o, l = rawflash.forward(q, k, v, causal=True)
    rawflash.backward(cupy.ones_like(q), q, k, v, o, l, causal=True)
    os.environ["RAWFLASH_WGMMA"] = "0"  # this script's own process: the mma.sync atomic-dQ backward too
    q, k, v = (cupy.asarray(x) for x in random_qkv(1, 70, 33, 2, 1, 128, "bfloat16"))
    o, l = rawflash.forward(q, k, v, causal=True, window=(8, 0), sinks=cupy.zeros(2, cupy.float32))
    rawflash.backward(cupy.ones_like(q), q, k, v, o, l, causal=True, window=(8, 0),
                      sinks=cupy.zeros(2, cupy.float32))
    cupy.cuda.Device().synchronize()
    print("sanitize workload done: mma.sync backward with features", flush=True)


if __name__ == "__main__":
    main()
