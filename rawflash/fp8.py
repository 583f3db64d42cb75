"""FP8 (e4m3) helpers: quantisation with descales, the Hadamard rotation of incoherent processing, and the host
models the FP8 forward's design rests on (the fragment order of P's keys, the underflow of P).

The FP8 forward (``rawflash.forward`` on ``float8_e4m3fn`` q, k, v) computes
``softmax(q_descale * k_descale * scale * Q8 K8^T) (v_descale * V8)``, each descale a float32 array of shape (1,)
(per tensor) or (batch, kv_heads) (per head; a query head uses its kv head's). :func:`quantize` produces such
pairs: ``x ~= dequantize(*quantize(x))``.

Incoherent processing (FlashAttention-3, section 3.3): ``Q R`` and ``K R`` with R = diag(signs) H / sqrt(d), H the
Sylvester Hadamard matrix, an orthogonal R, so ``(Q R)(K R)^T = Q K^T`` exactly while outlier channels spread over
all columns before the cast; V is not rotated (the output would be rotated too).
"""
from __future__ import annotations

import numpy as np

E4M3 = "float8_e4m3fn"
E4M3_MAX = 448.0                    # largest finite e4m3 value
GRANULARITIES = ("tensor", "head")
P_LOG2 = 8                          # mainloop_fwd_sm90_fp8.cuh: P is scaled by 2^8 before its cast


def e4m3() -> np.dtype:
    """NumPy's float8_e4m3fn dtype (ml_dtypes)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


def is_fp8(dtype) -> bool:
    try:
        return np.dtype(dtype).name == E4M3
    except TypeError:
        return str(dtype) == E4M3


# ---------------------------------------------------------------- the fragment order of P's keys
def sigma(p):
    """The key at k column p (0..31) of the 8-bit A fragment when S's accumulator registers are packed in place
    (mainloop_fwd_sm90_fp8.cuh): 16 (p / 16) + 8 ((p % 4) / 2) + 2 ((p % 16) / 4) + p % 2."""
    p = np.asarray(p)
    return 16 * (p // 16) + 8 * ((p % 4) // 2) + 2 * ((p % 16) // 4) + p % 2


def c_layout(lane: int, reg: int, j: int) -> tuple[int, int]:
    """(row, column) of a wgmma accumulator element: lane, element e = reg (0..3) of column tile j (PTX ISA,
    m64nNk* D fragments; warp 0)."""
    return lane // 4 + 8 * (reg // 2), 8 * j + 2 * (lane % 4) + reg % 2


def a_layout_8bit(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """(row, k column) of byte ``byte`` of A register ``reg`` of the 8-bit m64nNk32 fragment (warp 0)."""
    return lane // 4 + 8 * (reg % 2), 4 * (lane % 4) + byte + 16 * (reg // 2)


def packed_fragment(s: np.ndarray) -> np.ndarray:
    """A model of ``to_a_operand_e4m3``: S (16 x 32, one warp's rows of one 32-key slice) through the kernel's
    register packing, read back through the A layout: element (row, k) of the fragment the product sees."""
    frag = np.zeros((16, 32), s.dtype)
    for lane in range(32):
        acc = {(j, e): s[c_layout(lane, e, j)] for j in range(4) for e in range(4)}
        regs = [[acc[0, 0], acc[0, 1], acc[1, 0], acc[1, 1]], [acc[0, 2], acc[0, 3], acc[1, 2], acc[1, 3]],
                [acc[2, 0], acc[2, 1], acc[3, 0], acc[3, 1]], [acc[2, 2], acc[2, 3], acc[3, 2], acc[3, 3]]]
        for r in range(4):
            for b in range(4):
                frag[a_layout_8bit(lane, r, b)] = regs[r][b]
    return frag


def vt_permuted(v: np.ndarray) -> np.ndarray:
    """A model of fp8_vt_permute: V (keys, d), keys a multiple of 32 -> V^T (d, keys), slice column p = key sigma(p)."""
    keys = v.shape[0]
    order = (32 * (np.arange(keys) // 32) + sigma(np.arange(keys) % 32))
    return v[order].T


# ---------------------------------------------------------------- e4m3 rounding and P's underflow
def round_e4m3(x) -> np.ndarray:
    """x rounded to the nearest e4m3 value as the kernels' cvt.rn.satfinite does (saturating at +-448), as float64."""
    x = np.clip(np.asarray(x, dtype=np.float32), -E4M3_MAX, E4M3_MAX)
    return x.astype(e4m3()).astype(np.float64)


def p_underflow(scores: np.ndarray, p_log2: int = P_LOG2) -> dict:
    """How much of each row's probability mass the cast of P to e4m3 loses or distorts, modelled on the host.

    scores: (rows, keys) logits in log2 units (what the softmax exponentiates). The kernel casts
    2^(s - max + p_log2) to e4m3 and divides by the float32 sum of the unrounded values. Returns the mean and max
    over rows of the mass that became zero (``lost``) and of the relative error of the row's rounded mass
    (``mass_error``).
    """
    s = np.asarray(scores, dtype=np.float64)
    p = np.exp2(s - s.max(axis=1, keepdims=True) + p_log2)
    p8 = round_e4m3(p)
    total = p.sum(axis=1)
    lost = np.where(p8 == 0, p, 0).sum(axis=1) / total
    err = np.abs(p8.sum(axis=1) - total) / total
    return {"lost_mean": float(lost.mean()), "lost_max": float(lost.max()), "mass_error_mean": float(err.mean()),
            "mass_error_max": float(err.max())}


# ---------------------------------------------------------------- the Hadamard rotation
def hadamard_signs(head_dim: int, seed: int = 0) -> np.ndarray:
    """The random +-1 diagonal of the rotation (float32, head_dim), from ``seed``."""
    check_rotatable(head_dim)
    return np.random.default_rng(seed).choice(np.array([-1.0, 1.0], dtype=np.float32), size=head_dim)


def check_rotatable(head_dim: int) -> None:
    if head_dim < 32 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"incoherent=True needs a head_dim that is a power of two between 32 and 256 (the "
                         f"Walsh-Hadamard transform), got {head_dim}")


def rotation(head_dim: int, seed: int = 0) -> np.ndarray:
    """R = diag(signs) H / sqrt(head_dim) (float64, orthogonal): x -> x R is what fp8_quantize's rotation does."""
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return hadamard_signs(head_dim, seed)[:, None].astype(np.float64) * h / np.sqrt(head_dim)


# ---------------------------------------------------------------- quantisation
def _granules(x, granularity: str, kv_heads: int | None) -> tuple[int, int]:
    """(kv heads, query heads per kv head) of a (batch, seqlen, heads, head_dim) array for per-head descales."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if len(x.shape) != 4:
        also = " (packed sequences, 3 dimensions: granularity='tensor')" if len(x.shape) == 3 else ""
        raise ValueError(f"x must have 4 dimensions (batch, seqlen, heads, head_dim){also}, got shape "
                         f"{tuple(x.shape)}")
    heads = int(x.shape[2])
    kv = heads if kv_heads is None else int(kv_heads)
    if kv < 1 or heads % kv:
        raise ValueError(f"kv_heads must divide x's heads ({heads}), got {kv_heads}")
    return kv, heads // kv


def quantize(x, granularity: str = "head", *, kv_heads: int | None = None, incoherent: bool = False,
             seed: int = 0):
    """x (batch, seqlen, heads, head_dim), float16 / bfloat16 / float32 -> (x8 float8_e4m3fn, descale float32);
    packed sequences (total, heads, head_dim) with granularity "tensor".

    granularity: "tensor" (descale shape (1,)) or "head" (shape (batch, kv_heads): the query heads of one kv head
    share one, which is the FP8 forward's per-head layout; ``kv_heads`` defaults to x's heads). Each granule is
    scaled so that its largest magnitude becomes 448; x ~= x8 * descale. ``incoherent``: rotate by
    :func:`rotation` (``seed``) first, as ``forward(..., incoherent=True)`` does to q and k. NumPy arrays are
    quantised on the host, CuPy arrays on the device (fp8_prep.cu).
    """
    if len(x.shape) == 3 and granularity == "tensor":  # packed sequences (total, heads, head_dim): one granule
        x8, descale = quantize(x[None], "tensor", kv_heads=kv_heads, incoherent=incoherent, seed=seed)
        return x8[0], descale
    kv, group = _granules(x, granularity, kv_heads)
    if incoherent:
        check_rotatable(int(x.shape[3]))
    if isinstance(x, np.ndarray):
        return _quantize_host(x, granularity, kv, group, incoherent, seed)
    return _quantize_device(x, granularity, kv, group, incoherent, seed)


def _quantize_host(x, granularity, kv, group, incoherent, seed):
    b, s, h, d = x.shape
    xf = np.asarray(x, dtype=np.float64)
    if incoherent:
        xf = xf @ rotation(d, seed)
    if granularity == "tensor":
        amax = np.array([np.abs(xf).max(initial=0.0)])
        scaled = xf * (E4M3_MAX / np.where(amax > 0, amax, 1.0))[0]
    else:
        amax = np.abs(xf.reshape(b, s, kv, group, d)).max(axis=(1, 3, 4), initial=0.0)    # (batch, kv)
        f = E4M3_MAX / np.where(amax > 0, amax, 1.0)
        scaled = xf * np.repeat(f, group, axis=1)[:, None, :, None]
    x8 = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(e4m3())
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    return x8, descale


def _quantize_device(x, granularity, kv, group, incoherent, seed):
    import cupy

    from .arrays import dtype_name
    from .kernels import cupy_backend, launch
    from .problem import Problem

    b, s, h, d = (int(n) for n in x.shape)
    dt = dtype_name(x.dtype)
    if dt not in ("float16", "bfloat16", "float32") or x.strides[-1] != x.dtype.itemsize:
        x = cupy.ascontiguousarray(x, dtype=cupy.float32)
        dt = "float32"
    granules = b * kv if granularity == "head" else 1
    amax = cupy.zeros(granules, dtype=cupy.uint32)
    out = cupy.empty((b, s, h, d), dtype=cupy.uint8)
    signs = cupy.asarray(hadamard_signs(d, seed) if incoherent else np.ones(1, np.float32))
    st = [np.int64(v // x.dtype.itemsize) for v in x.strides[:3]]
    args = (x, *st, np.int32(b), np.int32(s), np.int32(h), np.int32(d), np.int32(group),
            np.int32(granularity == "head"), signs, amax, out)
    p = Problem(b, s, s, h, kv, d, dt, False)
    for pass_ in (0, 1):
        cupy_backend.run(launch.fp8_quantize(p, b * s * h, dt, incoherent, pass_), args)
    a = amax.view(cupy.float32)
    descale = cupy.where(a > 0, a / E4M3_MAX, 1.0).astype(cupy.float32)
    return as_e4m3(out), descale.reshape((b, kv) if granularity == "head" else (1,))


def quantize_cache(cache, granularity: str = "head", *, batch: int | None = None):
    """A 16-bit or float32 KV cache as ``rawflash.decode`` reads an FP8 one: (cache8 float8_e4m3fn, descale float32),
    ``cache ~= cache8 * descale``.

    A contiguous cache (batch, capacity, kv_heads, head_dim) takes a descale per (sequence, kv head) ("head",
    shape (batch, kv_heads)) or one for the tensor ("tensor", (1,)). A paged cache (num_pages, page_size,
    kv_heads, head_dim) needs ``batch`` (the page table's rows): pages may be shared between sequences, so "head"
    takes one descale per kv head over all pages, repeated for every sequence ((batch, kv_heads), equal rows).
    Each granule's largest magnitude becomes 448; keys appended later are divided by the same descale and
    saturate at +-448, so a cache that will grow past its largest values needs a larger descale (quantise with
    your own, as ``rawflash.reference.cache_quantize`` defines). NumPy caches are quantised on the host, CuPy
    caches on the device.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if len(cache.shape) != 4:
        raise ValueError(f"cache must have 4 axes (batch or pages, rows, kv_heads, head_dim), got {tuple(cache.shape)}")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError("batch must be None (a contiguous cache) or the page table's rows (an int >= 1), "
                         f"got {batch!r}")
    kv = int(cache.shape[2])
    x = cache if batch is None else cache.reshape((1, -1) + tuple(cache.shape[2:]))  # paged: every page at once
    x8, descale = quantize(x, granularity, kv_heads=kv)
    if batch is not None and granularity == "head":
        descale = descale.repeat(batch, axis=0)
    return x8.reshape(cache.shape), descale


def as_e4m3(x_u8):
    """A uint8 array's bytes as float8_e4m3fn (a view)."""
    return x_u8.view(e4m3())


def as_bytes(x8):
    """A float8_e4m3fn array's bytes as uint8 (a view)."""
    return x8.view(np.uint8)


def dequantize(x8, descale, kv_heads: int | None = None, *, cu_seqlens=None) -> np.ndarray:
    """float64 x8 * descale on the host (the reference backend's view of FP8 inputs); descale (1,) or
    (batch, kv_heads). Packed x8 (total, heads, head_dim) with ``cu_seqlens`` (batch + 1 offsets): row r of
    sequence b takes descale[b]."""
    x8 = x8.get() if hasattr(x8, "get") else np.asarray(x8)
    xf = x8.view(e4m3()).astype(np.float64) if x8.dtype == np.uint8 else x8.astype(np.float64)
    if descale is None:
        return xf
    d = np.asarray(descale.get() if hasattr(descale, "get") else descale, dtype=np.float64)
    if d.size == 1:
        return xf * d.reshape(())
    if xf.ndim == 3:  # packed: each row's sequence
        cu = np.asarray(cu_seqlens.get() if hasattr(cu_seqlens, "get") else cu_seqlens, dtype=np.int64)
        seq = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        return xf * np.repeat(d, xf.shape[1] // d.shape[1], axis=1)[seq][:, :, None]
    heads = xf.shape[2]
    return xf * np.repeat(d, heads // d.shape[1], axis=1)[:, None, :, None]
