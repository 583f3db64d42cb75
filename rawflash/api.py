"""The public API: validation, then dispatch to a kernel and a backend.

Layout is flash-attn's: q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim); with
``cu_seqlens_q`` / ``cu_seqlens_k``, packed sequences q (total_q, heads, head_dim), k, v (total_k, kv_heads,
head_dim). Every public function takes the same options; the environment's settings are read once per call here
(``settings.load()``) and handed down.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from . import arrays, reference, settings, signature, validation
from . import fp8 as quantisation  # (forward's argument fp8 is a flag)
from .kernels import configs, forms, plans
from .validation import Checked, Features

Array = Any  # a CuPy array, a NumPy array, or any object with __dlpack__ / __cuda_array_interface__
SWITCHES = ("defer_norm", "seq_parallel", "split_q", "wgmma", "overlap", "warp_specialize", "pingpong", "persistent",
            "dynamic")


PLANS = plans.PlanCache()  # planned calls by signature (rawflash.signature), every device's


def clear_cache() -> None:
    """Forget every planned call (the next call of each signature validates and plans again). Compiled kernels stay
    in CuPy's caches."""
    PLANS.clear()


def _import(named):
    return [None if x is None else arrays.import_array(x, name) for name, x in named]


def _features(window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              seqused_k, block_table=None, values=None) -> Features:
    alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = _import(
        (("alibi_slopes", alibi_slopes), ("sinks", sinks), ("cu_seqlens_q", cu_seqlens_q),
         ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k), ("block_table", block_table)))
    return Features(window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    seqused_k, block_table, values)


def _values(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table=None):
    """A fast-path call's offsets, lengths and page table on the host (``validation.read_values``: one copy of each
    device array, for the key's maxima and the value checks, planned call or not); None when none is given or
    one is not a CuPy array (that call has no signature and validation reads its own)."""
    if not signature.cupy_arrays(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table):
        return None
    return validation.read_values(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)


def _is_empty(c: Checked) -> bool:
    p = c.problem
    if p.varlen:
        return p.total_q == 0 or p.heads == 0 or p.total_k == 0
    return p.batch == 0 or p.seqlen_q == 0 or p.heads == 0 or p.seqlen_k == 0


def _xp(kind: str, backend: str):
    if kind == "numpy" and backend in ("reference", "numba"):
        return np
    import cupy

    return np if kind == "numpy" else cupy


def _lse_shape(c: Checked) -> tuple[int, ...]:
    p = c.problem
    return (p.heads, p.total_q) if p.varlen else (p.batch, p.heads, p.seqlen_q)


def forward(q: Array, k: Array, v: Array, *, causal: bool = False, scale: float | None = None,
            window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Array | None = None,
            sinks: Array | None = None, cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, seqused_k: Array | None = None,
            block_table: Array | None = None,
            q_descale: Array | None = None, k_descale: Array | None = None, v_descale: Array | None = None,
            out_dtype: str | None = None, fp8: bool = False, incoherent: bool = False,
            kernel: str = "fa2", backend: str = "cupy", out: Array | None = None, lse: Array | None = None,
            **switches: bool) -> tuple[Array, Array]:
    """Exact attention, forward.

    Parameters
    ----------
    q : array (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32
        Packed sequences (with ``cu_seqlens_q``): (total_q, heads, head_dim).
    k, v : arrays (batch, seqlen_k, kv_heads, head_dim), q's dtype; heads % kv_heads == 0 (GQA / MQA)
        Packed: (total_k, kv_heads, head_dim). v may have a head_dim of its own, at most q's (MLA's head_dim_v:
        out, dout and dv then have it), on every backend; not with ``block_table``, FP8 or in ``decode``.
    causal : bool
        Query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned, as flash-attn >= 2.1).
    scale : float, optional
        Softmax scale, default 1/sqrt(head_dim).
    window : (int, int)
        Sliding window (left, right), flash-attn's ``window_size``: query i sees keys j with
        i + sk - sq - left <= j <= i + sk - sq + right; -1 = unbounded; ``causal`` makes right 0.
        Key blocks wholly outside the window are never loaded.
    softcap : float
        0 (off) or c > 0: scores s become c * tanh(s / c) before the softmax (Gemma 2).
    alibi_slopes : array (heads,) or (batch, heads), float32, optional
        ALiBi: scores get -slope * |i + sk - sq - j| (flash-attn's convention).
    sinks : array (heads,), float32, optional
        One learnable logit per head that joins every row's softmax denominator and has no value (gpt-oss).
    cu_seqlens_q, cu_seqlens_k : arrays (batch + 1,), int32, optional
        Offsets of packed variable-length sequences (flash-attn's ``flash_attn_varlen_func``); both or neither.
        Their values are checked on the host on every call (a device array is copied once: one synchronisation);
        the plan cache keys them by their layout and the maxima they give, not by their values.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequences (computed from the offsets when not given; must not be below any length).
    seqused_k : array (batch,), int32, optional
        Keys actually used per sequence (the first seqused_k[b] of its keys); causal alignment uses it.
    block_table : int32 array (batch, max_pages), optional
        Paged keys (chunked prefill against a paged KV cache, the pages ``decode`` reads): k and v are
        (num_pages, page_size, kv_heads, head_dim), page_size >= 16, and key j of sequence b is row
        ``j % page_size`` of page ``block_table[b, j // page_size]``. Needs packed queries (``cu_seqlens_q``) and
        ``seqused_k`` (each sequence's keys), no ``cu_seqlens_k``; the used entries are checked on the host on every
        call. A call whose table, offsets and seqused_k have an earlier call's layouts and maxima (max_seqlen_q /
        _k) runs that call's plan, whatever their values: new lengths each call (chunked prefill) plan once. Pages
        of a power of two rows run FA3's form (its producer reads a key block in TMA boxes of one page each), other
        page sizes the cp.async forms; a page's rows past its sequence's keys are never used, whatever they hold.
        float16 or bfloat16; no FP8, no Numba twin, and ``backward`` takes no paged keys.
    q_descale, k_descale, v_descale : arrays (1,) or (batch, kv_heads), float32, optional
        FP8 (q, k, v float8_e4m3fn, Hopper, FA3's form): the factors the e4m3 values are multiplied by
        (``rawflash.fp8.quantize`` returns them); default 1. Plain or causal attention, GQA and sinks.
    out_dtype : {'bfloat16', 'float16'}, optional
        FP8: the output's dtype (default bfloat16; with ``fp8`` / ``incoherent``, q's 16-bit dtype).
    fp8 : bool
        16-bit or float32 q, k, v: quantise them to e4m3 per (batch, kv head) on the device and run the FP8 form.
    incoherent : bool
        As ``fp8``, with q and k rotated by the same random Hadamard matrix first (FlashAttention-3's incoherent
        processing: Q K^T is unchanged, outlier channels are spread before the cast).
    kernel : {'fa2', 'fa1', 'naive'}
        fa1 and naive run plain attention (naive also windows); every feature needs fa2.
    backend : {'cupy', 'numba', 'reference'}
    out, lse : arrays, optional
        Where to write the results (the cupy backend): ``out`` of q's shape and dtype (any layout the kernels can
        write; otherwise the result is copied in), ``lse`` C-contiguous float32 of lse's shape, on q's device.
        They are returned.
    **switches
        fa2 only, for the ablation (plain attention only): ``defer_norm``, ``seq_parallel``, ``split_q`` (all True
        by default); ``wgmma`` (default: Hopper's warpgroup form where it applies, False forces mma.sync, True
        demands wgmma) and ``overlap`` (wgmma forms: FA3's softmax / P V overlap, default True); on Hopper
        ``warp_specialize`` (default: FA3's form, a TMA producer warpgroup feeding consumer warpgroups, where it
        applies; False: the wgmma form whose threads all copy; True demands FA3's form), and in FA3's form
        ``pingpong`` (consumer warpgroups take turns on the tensor cores, default True), ``persistent`` (one CTA
        per SM walks the tiles; default: fixed sequence lengths) and ``dynamic`` (a persistent grid's CTAs take
        the next tile from a counter; False: the static schedule; default: under a mask).

    Returns
    -------
    out : array like q
    lse : array (batch, heads, seqlen_q), or (heads, total_q) when packed, float32
        Natural log of the softmax denominator (the sink included); -inf for rows that see no key and have no
        sink (their out is 0).

    CuPy and foreign device arrays give CuPy results; NumPy arrays are copied to the device and the results come
    back as NumPy. Work is queued on CuPy's current stream; nothing synchronises the host (except reading
    cu_seqlens / seqused_k / block_table values).
    """
    if backend == "cupy" and kernel == "fa2" and fp8 is False and incoherent is False and out_dtype is None \
            and q_descale is None and k_descale is None and v_descale is None:
        q, k, v = _import((("q", q), ("k", k), ("v", v)))
        values = _values(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
        key = signature.forward(q, k, v, (causal, scale, window, softcap, max_seqlen_q, max_seqlen_k,
                                          tuple([(n, x.__class__, x) for n, x in sorted(switches.items())])),
                                (alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k), out, lse, block_table,
                                validation.maxima(values, max_seqlen_q, max_seqlen_k))
        call = PLANS.get(key) if key is not None else None
        if call is not None:
            if values is not None:  # the key holds their layouts and maxima: their values are checked here
                validation.check_values(values, call.facts)
            given = _hit_features(alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
            return _on(q, call.run, q, k, v, given, out, lse)
    else:
        key = values = None
    env = settings.load()
    (q, k, v), c, feats, ds, sw, outputs = _checked_forward(
        q, k, v, causal, scale, window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, seqused_k, {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale},
        out_dtype, fp8, incoherent, kernel, backend, switches, out, lse, block_table, values)
    p, to_numpy = c.problem, c.kind == "numpy"
    out_dtype = p.out_dtype or p.dtype
    if backend == "reference":
        if ds is not None:  # e4m3 inputs: their values, dequantised, in float64
            q, k, v = (quantisation.dequantize(x, d, cu_seqlens=cu) for x, d, cu in
                       zip((q, k, v), ds, (feats.cu_seqlens_q, feats.cu_seqlens_k, feats.cu_seqlens_k)))
        if feats.block_table is not None:  # paged keys gathered into packed sequences
            k, v, feats = _unpaged(k, v, feats)
        res, res_lse = reference.forward(q, k, v, **validation.reference_features(c, feats))
        res = res.astype(np.float32) if ds is not None else res  # (as the FP8 kernels round: through float32)
        res = _host_result(res.astype(_np_dtype(out_dtype)), to_numpy)
        res = (res, _host_result(res_lse.astype(np.float32), to_numpy))
    elif _is_empty(c):
        xp = _xp(c.kind, backend)
        res = (xp.zeros(validation.out_shape(q, v), dtype=_np_dtype(out_dtype)), _empty_lse(xp, c))
    else:
        _require_gpu(backend)
        with _device(c.device):
            if backend == "numba":
                from .kernels import numba_backend

                res = numba_backend.forward(p, q, k, v, c.scale, kernel, sw, c.extras)
            elif ds is not None:
                from .kernels import cupy_backend

                bound = cupy_backend.bind_forward_fp8(p, q, k, v, c.scale, ds, sw, c.extras, env)
                bound.launch()
                res = bound.result()
            else:
                from .kernels import cupy_backend

                bound = cupy_backend.bind_forward(p, q, k, v, c.scale, kernel, sw, c.extras, env, out=out, lse=lse)
                call = _plan(key, lambda: cupy_backend.ForwardCall(bound, q, k, v, c.extras, env, out, c.facts))
                if call is not None:
                    return call.run(q, k, v, c.extras, out, lse)
                bound.launch()
                res = bound.result()
    return tuple(arrays.export(_into(x, given), to_numpy) for x, given in zip(res, outputs))


def _checked_forward(q, k, v, causal, scale, window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, seqused_k, descales: dict, out_dtype, fp8, incoherent, kernel: str,
                     backend: str, switches: dict, out, lse, block_table=None, values=None):
    """forward's arrays imported (and quantised for fp8=True / incoherent=True) and every argument checked: the
    arrays, the checked call, its features, the FP8 descales (None for 16-bit and float32), the switches and the
    caller's outputs. ``values``: the host values of the offsets, lengths and table where already read."""
    q, k, v = _import((("q", q), ("k", k), ("v", v)))
    feats = _features(window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      seqused_k, block_table, values)
    c = validation.check_forward(q, k, v, causal, scale, kernel, backend, feats)
    ds = None
    if c.problem.dtype == configs.FP8 or fp8 is True or incoherent is True:
        q, k, v, c, ds = _fp8_inputs(q, k, v, c, feats, descales, out_dtype, fp8, incoherent, kernel, backend)
    else:
        validation.check_fp8_options(descales, out_dtype, incoherent, fp8)
    sw = _check_switches(kernel, switches, c)
    outputs = validation.check_outputs(c, (("out", out, validation.out_shape(q, v),
                                            c.problem.out_dtype or c.problem.dtype, False),
                                           ("lse", lse, _lse_shape(c), "float32", True)))
    return (q, k, v), c, feats, ds, sw, outputs


def _fp8_inputs(q, k, v, c: Checked, feats: Features, descales: dict, out_dtype, use_fp8, incoherent, kernel: str,
                backend: str):
    """The FP8 forward's inputs: e4m3 q, k, v as given, or 16-bit / float32 ones quantised per (batch, kv head)
    (q and k rotated first with ``incoherent``); returns them, the call checked with its FP8 rules
    (``validation.check_fp8``) and the descales."""
    p = c.problem
    if p.dtype != configs.FP8:
        validation.check_flag(use_fp8, "fp8")
        validation.check_flag(incoherent, "incoherent")
        given = [n for n, x in descales.items() if x is not None]
        if given:
            raise ValueError(f"{given[0]} goes with float8_e4m3fn q, k, v; with fp8=True / incoherent=True rawflash "
                             f"computes the descales itself (got {given[0]} with {p.dtype} inputs)")
        if p.varlen:
            raise ValueError("fp8=True / incoherent=True takes fixed-length q, k, v; got cu_seqlens_q")
        if incoherent:
            quantisation.check_rotatable(p.head_dim)
        if out_dtype is None:
            out_dtype = p.dtype if p.dtype in validation.OUT_DTYPES else "bfloat16"
        q, qd = quantisation.quantize(q, "head", kv_heads=p.kv_heads, incoherent=incoherent)
        k, kd = quantisation.quantize(k, "head", incoherent=incoherent)
        v, vd = quantisation.quantize(v, "head")
        c = validation.check_forward(q, k, v, p.causal, c.scale, kernel, backend, feats)
        descales, incoherent = {"q_descale": qd, "k_descale": kd, "v_descale": vd}, False
    c, ds = validation.check_fp8(c, kernel, backend, feats, descales, out_dtype, incoherent)
    return q, k, v, c, ds


def _unpaged(k, v, feats: Features):
    """A paged forward's keys as packed sequences (the reference's input): k, v (sum of seqused_k, kv_heads,
    head_dim) with cu_seqlens_k and no seqused_k or block_table."""
    used = reference._host(feats.seqused_k).astype(np.int64)
    dense = reference.gather_kv(k, v, used, feats.block_table)
    k, v = (np.concatenate([x[b, :n] for b, n in enumerate(used)]) for x in dense)
    cu = np.concatenate([[0], np.cumsum(used)]).astype(np.int32)
    return k, v, dataclasses.replace(feats, cu_seqlens_k=cu, seqused_k=None, block_table=None, values=None)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _given(**features) -> dict:
    """The feature arrays a call gave, by name (as ``Checked.extras`` names them)."""
    return {n: arrays.import_array(x, n) for n, x in features.items() if x is not None}


def _hit_features(alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table=None) -> dict:
    """A planned forward's or backward's feature arrays by name (a paged forward's block_table among them): {} at
    once when none is given (most calls)."""
    if alibi_slopes is None and sinks is None and cu_seqlens_q is None and cu_seqlens_k is None and seqused_k is None \
            and block_table is None:
        return {}
    return _given(alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seqused_k=seqused_k, block_table=block_table)


def _plan(key, build):
    """The planned call of a new signature, made by ``build`` and kept in the cache; None when the call has no
    signature or its launches cannot be prepacked (it then runs through its bound launches)."""
    if key is None:
        return None
    try:
        call = build()
    except plans.NotPackable:
        return None
    PLANS.put(key, call)
    return call


def _into(x, given):
    """A result written into the caller's array when one was given (and returned as it)."""
    if given is None or x is given:
        return x
    given[...] = x
    return given


def _empty_lse(xp, c: Checked):
    """lse of an empty call: -inf, or the sink's logit for every row when sinks are given (no key is seen)."""
    shape = _lse_shape(c)
    if "sinks" not in c.extras:
        return xp.full(shape, -np.inf, dtype=np.float32)
    sinks = xp.asarray(c.extras["sinks"], dtype=np.float32)
    return xp.broadcast_to(sinks[:, None] if c.problem.varlen else sinks[None, :, None], shape).copy()


def backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *, causal: bool = False,
             scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
             alibi_slopes: Array | None = None, sinks: Array | None = None, cu_seqlens_q: Array | None = None,
             cu_seqlens_k: Array | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
             seqused_k: Array | None = None, deterministic: bool = False, backend: str = "cupy",
             dq: Array | None = None, dk: Array | None = None, dv: Array | None = None) -> tuple[Array, ...]:
    """Gradients of ``sum(out * dout)`` with respect to q, k, v (FlashAttention-2 Algorithm 2), and the sinks.

    Parameters
    ----------
    dout : array like q
    q, k, v, causal, scale, window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, seqused_k
        As given to ``forward``.
    out, lse : what ``forward`` returned
        The backward recomputes P = exp(scores - lse) and D = rowsum(dout * out) from them (so a block of keys with
        a whole row's out and lse gives that block's share of the gradients).
    deterministic : bool
        False (default): dQ is accumulated with float32 atomicAdd (fastest; equal only up to rounding from run
        to run). True: bitwise repeatable; on Hopper (16-bit, head_dim <= 128) FA3's form adds into dQ in a fixed
        order per query block, elsewhere a separate dQ pass without atomics.
    backend : {'cupy', 'numba', 'reference'}
    dq, dk, dv : arrays, optional
        Where to write the gradients (shapes and dtypes of q, k, v, on their device); they are returned.

    Returns
    -------
    dq : array like q
    dk, dv : arrays like k (summed over the query heads of each GQA group)
    dsinks : array (heads,) float32, only when ``sinks`` is given
    """
    grads_given = (dq, dk, dv)
    options = (causal, scale, window, softcap, max_seqlen_q, max_seqlen_k, deterministic)
    features = (alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k)
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))
    key = None
    if backend == "cupy":
        ins = _import(named)
        values = _values(cu_seqlens_q, cu_seqlens_k, seqused_k)
        key = signature.backward(ins, options, features, grads_given,
                                 validation.maxima(values, max_seqlen_q, max_seqlen_k))
        call = PLANS.get(key) if key is not None else None
        if call is not None:
            if values is not None:  # as the forward's hit
                validation.check_values(values, call.facts)
            return _on(ins[1], call.run, *ins, _hit_features(*features), grads_given)
        named = tuple((n, x) for (n, _), x in zip(named, ins))  # imported once
    else:
        values = None
    env = settings.load()
    dout, q, k, v, out, lse = _import(named)
    feats = _features(window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      seqused_k, None, values)
    c = validation.check_backward(dout, q, k, v, out, lse, causal, scale, deterministic, backend, feats)
    to_numpy = c.kind == "numpy"
    p = c.problem
    given = validation.check_outputs(c, tuple((n, g, tuple(x.shape), p.dtype, False) for n, g, x in
                                              (("dq", dq, q), ("dk", dk, k), ("dv", dv, v))))
    if backend == "reference":
        grads = reference.backward(dout, q, k, v, out=out, lse=lse, **validation.reference_features(c, feats))
        grads = [_host_result(g.astype(q.dtype), to_numpy) for g in grads[:3]] + \
                [_host_result(g.astype(np.float32), to_numpy) for g in grads[3:]]
    elif _is_empty(c):
        xp = _xp(c.kind, backend)
        grads = [xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)]
        if "sinks" in c.extras:
            grads.append(xp.zeros((p.heads,), np.float32))
    else:
        _require_gpu(backend)
        with _device(c.device):
            if backend == "numba":
                from .kernels import numba_backend

                grads = numba_backend.backward(p, dout, q, k, v, out, lse, c.scale, deterministic, c.extras)
            else:
                from .kernels import cupy_backend

                bound = cupy_backend.bind_backward(p, dout, q, k, v, out, lse, c.scale, deterministic, c.extras, env,
                                                   grads=given)
                arrays_in = (dout, q, k, v, out, lse)
                call = _plan(key, lambda: cupy_backend.BackwardCall(bound, arrays_in, c.extras, env, given,
                                                                    c.facts))
                if call is not None:
                    return call.run(*arrays_in, c.extras, given)
                bound.launch()
                grads = bound.result()
                if hasattr(bound, "sinks"):
                    grads = (*grads, bound.sinks())
    return tuple(arrays.export(_into(g, gv), to_numpy) for g, gv in zip(grads, given + (None,)))


def attention(q: Array, k: Array, v: Array, *, causal: bool = False, scale: float | None = None,
              kernel: str = "fa2", backend: str = "cupy", **options: Any) -> Array:
    """Forward only: ``out`` of :func:`forward` (same arguments, same options and switches)."""
    return forward(q, k, v, causal=causal, scale=scale, kernel=kernel, backend=backend, **options)[0]


def vjp(q: Array, k: Array, v: Array, *, causal: bool = False, scale: float | None = None, deterministic: bool = False,
        kernel: str = "fa2", backend: str = "cupy", **options: Any) -> tuple[Array, Callable[[Array], tuple]]:
    """``out`` and a pullback ``dout -> gradients`` (those of :func:`backward`) that reuses the forward's out, lse.

    Takes :func:`forward`'s arguments (``kernel`` only for the forward pass; the backward is fa2's) plus
    ``deterministic`` for the pullback. Ablation switches are not accepted (they are forward-only).
    """
    unknown = set(options) - set(validation.FEATURE_ARGS) - {"cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    if unknown:
        raise TypeError(f"vjp got unexpected keyword argument(s) {sorted(unknown)}")
    out, lse = forward(q, k, v, causal=causal, scale=scale, kernel=kernel, backend=backend, **options)

    def pullback(dout: Array) -> tuple:
        return backward(dout, q, k, v, out, lse, causal=causal, scale=scale, deterministic=deterministic,
                        backend=backend, **options)

    return out, pullback


def _check_switches(kernel: str, switches: dict, c: Checked) -> forms.Switches:
    unknown = set(switches) - set(SWITCHES)
    if unknown:
        raise TypeError(f"forward got unexpected keyword argument(s) {sorted(unknown)}; the fa2 ablation switches "
                        f"are {sorted(SWITCHES)}")
    if switches and kernel != "fa2":
        raise ValueError(f"the ablation switches {sorted(switches)} apply to kernel='fa2' only, got kernel={kernel!r}")
    for name, value in switches.items():
        if not (name in ("wgmma", "warp_specialize") and value is None):
            validation.check_flag(value, name)
    sw = forms.Switches(**switches)
    if not sw.ideas_on and c.problem.general:
        feature = next(n for n in ("window", "softcap", "alibi_slopes", "cu_seqlens_q", "seqused_k")
                       if _feature_on(c, n))
        off = next(n for n in ("defer_norm", "seq_parallel", "split_q") if switches.get(n) is False)
        raise ValueError(f"the ablation switch {off}=False runs plain attention only; it cannot be combined with "
                         f"{feature}")
    return sw


def _feature_on(c: Checked, name: str) -> bool:
    p = c.problem
    return {"window": p.window_bounds != (-1, -1) and not (p.causal and p.window[0] < 0), "softcap": p.softcap > 0,
            "alibi_slopes": p.alibi, "cu_seqlens_q": p.varlen, "seqused_k": p.seqused_k}[name]


def _require_gpu(backend: str) -> None:
    """A clear error instead of a CUDA runtime failure when no GPU is visible (the simulator serves 'numba')."""
    import os

    if backend == "numba" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    try:
        import cupy

        available = cupy.cuda.is_available()
    except Exception:
        available = False
    if not available:
        raise RuntimeError(f"backend={backend!r} needs a CUDA GPU and none is visible; use backend='reference' "
                           "(NumPy float64), or backend='numba' under NUMBA_ENABLE_CUDASIM=1 (Numba's CPU simulator)")


def _host_result(x, to_numpy: bool):
    """Reference results are NumPy; send them to the device when the caller gave device arrays."""
    if to_numpy:
        return x
    import cupy

    return cupy.asarray(x)


class _device:
    """Run under a CUDA device (and its current stream) when it is not the current one; a no-op for a host call
    (``device`` not an int)."""

    def __init__(self, device):
        self._ctx = None
        if isinstance(device, int):
            import cupy

            if cupy.cuda.runtime.getDevice() != device:
                self._ctx = cupy.cuda.Device(device)

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False


def _on(x, fn, *args):
    """``fn(*args)`` on the device of the CuPy array ``x`` (a planned call): a device switch only when it is not the
    current one."""
    import cupy

    device = x.data.device_id
    if cupy.cuda.runtime.getDevice() == device:
        return fn(*args)
    with cupy.cuda.Device(device):
        return fn(*args)


def decode(q: Array, k_cache: Array, v_cache: Array | None = None, *, cache_seqlens: int | Array,
           k_new: Array | None = None, v_new: Array | None = None, block_table: Array | None = None,
           causal: bool = True, scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
           alibi_slopes: Array | None = None, sinks: Array | None = None, k_descale: Array | None = None,
           v_descale: Array | None = None, num_splits: int | None = None, return_lse: bool = False,
           head_dim_v: int | None = None, backend: str = "cupy", out: Array | None = None,
           lse: Array | None = None) -> Array | tuple[Array, Array]:
    """Attention of a few new query rows against a KV cache, for inference (flash-attn's ``flash_attn_with_kvcache``).

    Sequence b attends to the first ``cache_seqlens[b]`` keys of its cache followed by its ``seqlen_new`` new keys,
    which are first written into the cache (in place) as keys ``cache_seqlens[b] ..``. The keys are split into
    ``num_splits`` chunks read in parallel (Flash-Decoding) and the partial results merged by their lse; the GQA
    group's query heads and the call's query rows share every read of K and V.

    Parameters
    ----------
    q : array (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32; head_dim a multiple of 8
        seqlen_q is usually 1 (one generated token); more rows serve speculative decoding or chunked prefill.
    k_cache, v_cache : arrays, q's dtype or float8_e4m3fn, read and appended in place
        Contiguous: (batch, capacity, kv_heads, head_dim). Paged (with ``block_table``): (num_pages, page_size,
        kv_heads, head_dim), any page_size >= 1. v_cache is None for a latent cache (``head_dim_v``).
        An FP8 cache (float8_e4m3fn, with float16 or bfloat16 q, head_dim
        a multiple of 16 in 48 - 64 or 112 - 256) holds ``K / k_descale`` and ``V / v_descale``: attention reads
        ``K8 * k_descale`` and ``V8 * v_descale``, and k_new / v_new (q's dtype) are divided by the descales and
        rounded to e4m3 as they are appended (saturating at +-448: ``reference.cache_quantize``).
        ``rawflash.fp8.quantize_cache`` makes one from a 16-bit cache.
    cache_seqlens : int or int32 array (batch,)
        Keys already in each sequence's cache, on q's device or the host. It is left as given: after an append the
        caller adds seqlen_new. An int or a host array is checked here (ValueError); a device array is never
        copied to the host, so the call does not synchronise: the kernels check it, and a sequence whose
        cache_seqlens + seqlen_new is outside [0, capacity] (or whose used block_table entries are outside the
        cache's pages) gets NaN out and lse and no append, and nothing outside the cache is read or written.
    k_new, v_new : arrays (batch, seqlen_new, kv_heads, head_dim), optional
        Keys and values appended before attending (both or neither; a latent cache takes k_new alone).
    block_table : int32 array (batch, max_pages), optional
        Paged cache: key j of sequence b is row ``j % page_size`` of page ``block_table[b, j // page_size]``;
        entries past a sequence's keys are never read. Checked like cache_seqlens (on the host when both are host
        values, else on the device). Pages may be shared between sequences (a common prefix) as long as no
        sequence appends into a row that another sequence of the call reads: the split pass writes each new key
        just before the sequence's own split reads it, so no other sequence is ordered after that write.
    causal : bool
        Query i sees key j iff j <= i + keys - seqlen_q (bottom-right, as in the forward): the new rows are the
        sequence's last ones. True by default (what decoding means; flash-attn's ``flash_attn_with_kvcache``
        defaults to False); irrelevant when seqlen_q is 1.
    scale, window, softcap, alibi_slopes, sinks
        As in :func:`forward` (the window and ALiBi distances are measured from each sequence's own last key).
    k_descale, v_descale : float32 arrays (1,) or (batch, kv_heads), optional
        An FP8 cache's factors (None: 1), per tensor or per (sequence, kv head), both of one shape, on q's device;
        refused with a 16-bit or float32 cache.
    num_splits : int, optional
        Chunks each sequence's keys are cut into (whole key tiles each; chunks past a sequence's keys are empty).
        Default: ``forms.decode_splits``, a model of the split pass planned from the cache's capacity and the GPU's
        multiprocessors (full waves of CTAs, enough warps in flight, little partial traffic); ``rawflash explain
        --decode`` shows its choice.
    return_lse : bool
        Also return lse (batch, heads, seqlen_q) float32.
    head_dim_v : int, optional
        A latent cache (MLA's absorbed decode, DeepSeek-V3 / R1; FlashMLA's ``kcache`` with ``head_dim_v``):
        k_cache alone holds the keys, and its first head_dim_v columns are the values; v_cache and v_new are None,
        k_new (appended once) holds the new keys and so the new values, and out has head_dim_v columns. Typically
        q (batch, 1 - 4, 16 - 128 heads, 576) against k_cache (..., 1, 576) with head_dim_v=512 (MQA: one kv head).
        The cupy and numba backends run float16 / bfloat16 at head_dim 576 / head_dim_v 512 (sm_90: the kernel's
        CTA takes 231 KB of shared memory); the reference backend any head_dim_v in 8 .. head_dim. FP8 latent
        caches are refused.
    backend : {'cupy', 'numba', 'reference'}
        'numba': the Numba twins of the kernels (on a GPU, or Numba's CPU simulator; not FP8 caches).
    out, lse : arrays, optional
        Where to write the results: ``out`` of q's shape and dtype, ``lse`` C-contiguous float32 (batch, heads,
        seqlen_q), on q's device (``lse`` is returned only with ``return_lse``).

    Returns
    -------
    out : array like q (head_dim_v columns for a latent cache), and lse when ``return_lse``.
    """
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new),
             ("block_table", block_table))
    key = None
    if backend == "cupy":
        ins = _import(named)
        key = signature.decode(ins, cache_seqlens, (causal, scale, window, softcap, num_splits, head_dim_v,
                                                    return_lse),
                               (alibi_slopes, sinks, k_descale, v_descale), (out, lse))
        call = PLANS.get(key) if key is not None else None
        if call is not None and call.takes_cache_len(cache_seqlens):
            given_any = alibi_slopes is not None or sinks is not None or k_descale is not None or v_descale is not None
            features = _decode_features(_given(alibi_slopes=alibi_slopes, sinks=sinks, k_descale=k_descale,
                                               v_descale=v_descale) if given_any else {}, ins[5], cache_seqlens)
            res = _on(ins[0], call.run, *ins[:5], features, out, lse)
            return res if return_lse else res[0]
        named = tuple((n, x) for (n, _), x in zip(named, ins))  # imported once
    env = settings.load()
    (q, k_cache, v_cache, k_new, v_new, block_table), c, feats, given = _checked_decode(
        named, cache_seqlens, causal, scale, window, softcap, alibi_slopes, sinks, num_splits, return_lse, backend,
        out, lse, k_descale, v_descale, head_dim_v)
    p, to_numpy = c.problem, c.kind == "numpy"
    lens = c.extras.get("seqused_k", c.extras.get("cache_len"))  # an array, or the int of every sequence
    if backend == "reference":
        host_lens = np.broadcast_to(np.asarray(reference._host(lens)).astype(np.int64), (p.batch,))
        res = reference.decode(q, k_cache, v_cache, host_lens, k_new=k_new, v_new=v_new, block_table=block_table,
                               causal=p.causal, scale=c.scale, window=p.window, softcap=p.softcap,
                               alibi_slopes=feats.alibi_slopes, sinks=feats.sinks, k_descale=k_descale,
                               v_descale=v_descale, head_dim_v=p.head_dim_v or None)
        res = _host_result(res[0].astype(q.dtype), to_numpy), _host_result(res[1].astype(np.float32), to_numpy)
        _append_in_place(k_cache, v_cache, host_lens, k_new, v_new, block_table, k_descale, v_descale)
    else:
        _require_gpu(backend)
        with _device(c.device):
            if backend == "numba":
                from .kernels import numba_backend

                res = numba_backend.decode(p, q, k_cache, v_cache, k_new, v_new, c.scale, num_splits, c.extras)
                # (a latent cache: v_cache and v_new are None, the twins read k_cache's first head_dim_v columns)
                if p.new_keys and numba_backend.copies_caches(k_cache):  # the twins appended to copies (16-bit)
                    _append_in_place(k_cache, v_cache,
                                     np.broadcast_to(np.asarray(reference._host(lens)), (p.batch,)), k_new, v_new,
                                     block_table)
            else:
                from .kernels import cupy_backend

                bound = cupy_backend.bind_decode(p, q, k_cache, v_cache, k_new, v_new, c.scale, num_splits, c.extras,
                                                 env, out=out, lse=lse)
                call = _plan(key, lambda: cupy_backend.DecodeCall(bound, (q, k_cache, v_cache, k_new, v_new),
                                                                  c.extras, env, out))
                if call is not None:
                    res = call.run(q, k_cache, v_cache, k_new, v_new, c.extras, out, lse)
                    return res if return_lse else res[0]
                bound.launch()
                res = bound.result()
                if to_numpy and p.new_keys:  # the device appended to copies of NumPy caches: the caller's too
                    _append_in_place(k_cache, v_cache, np.broadcast_to(np.asarray(lens), (p.batch,)), k_new, v_new,
                                     block_table, k_descale, v_descale)
    res = tuple(arrays.export(_into(x, g), to_numpy) for x, g in zip(res, given))
    return res if return_lse else res[0]


def _decode_features(features: dict, block_table, cache_seqlens) -> dict:
    """A planned decode step's feature arrays (as ``Checked.extras`` names them): ``features`` (slopes, sinks) with
    the step's block_table and its cache_seqlens, an int (``cache_len``) or an array (``seqused_k``)."""
    if block_table is not None:
        features["block_table"] = block_table
    features["cache_len" if isinstance(cache_seqlens, int) else "seqused_k"] = cache_seqlens
    return features


def _checked_decode(named: tuple, cache_seqlens, causal, scale, window, softcap, alibi_slopes, sinks, num_splits,
                    return_lse, backend: str, out, lse, k_descale=None, v_descale=None, head_dim_v=None):
    """decode's arrays imported and every argument checked (raises before anything is launched or appended)."""
    q, k_cache, v_cache, k_new, v_new, block_table = _import(named)
    if not isinstance(cache_seqlens, (int, np.integer)):
        (cache_seqlens,) = _import((("cache_seqlens", cache_seqlens),))
    descales = _given(k_descale=k_descale, v_descale=v_descale)
    feats = _features(window, softcap, alibi_slopes, sinks, None, None, None, None, None)
    c = validation.check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, backend,
                                feats, descales.get("k_descale"), descales.get("v_descale"), head_dim_v)
    validation.check_flag(return_lse, "return_lse")
    if num_splits is not None and (isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= forms.MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int between 1 and {forms.MAX_SPLITS}, got {num_splits!r}")
    p = c.problem
    out_shape = (*tuple(q.shape)[:3], p.value_head_dim)
    given = validation.check_outputs(c, (("out", out, out_shape, p.dtype, False),
                                         ("lse", lse, (p.batch, p.heads, p.seqlen_q), "float32", True)))
    return (q, k_cache, v_cache, k_new, v_new, block_table), c, feats, given


def _append_in_place(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, k_descale=None,
                     v_descale=None) -> None:
    """k_new / v_new written into the caller's caches (NumPy or CuPy, like k_new) as decode's kernel does on the
    device (an FP8 cache's through ``reference.cache_quantize``); the destinations are reference.append_slots'. A
    latent cache (v_cache None) receives k_new alone."""
    if k_new is None:
        return
    if v_cache is None:
        v_cache, v_new = k_cache, k_new  # (the same rows written twice)
    slots, rows = reference.append_slots(cache_seqlens, int(k_new.shape[1]), int(k_cache.shape[1]), block_table)
    if quantisation.is_fp8(k_cache.dtype):  # written as bytes: e4m3(x / descale)
        k_new, v_new = (reference.cache_quantize(x, d).view(np.uint8) for x, d in ((k_new, k_descale),
                                                                                    (v_new, v_descale)))
        k_cache, v_cache = k_cache.view(np.uint8), v_cache.view(np.uint8)
    if not isinstance(k_cache, np.ndarray):  # device caches: device indices and values
        import cupy

        slots, rows = cupy.asarray(slots), cupy.asarray(rows)
        k_new, v_new = cupy.asarray(k_new), cupy.asarray(v_new)
    k_cache[slots, rows], v_cache[slots, rows] = k_new, v_new


class Plan:
    """A call checked and planned once, for loops that repeat it (a serving loop's decode step, a layer's forward):
    ``run(...)`` takes the arrays of one call, compares their layouts with the plan's (shape, strides, dtype,
    device, 16-byte alignment: a few microseconds), and launches. It reads no device value on the host and
    allocates nothing but its outputs (nothing with ``out=`` / ``lse=``), so every run can be captured in a CUDA
    graph. Made by :func:`plan_forward` and :func:`plan_decode`; the feature arrays given there (slopes, sinks,
    packed offsets) are the ones every run reads, so new values go into them in place."""

    def __init__(self, key, call, options: tuple, features: dict, raw_features: tuple):
        if call is None:
            raise ValueError("this call's launches cannot be planned (they run through rawflash's full path only)")
        self._key, self._call = key, call
        self._options, self._features, self._raw = options, features, raw_features

    def _check(self, key, what: str) -> None:
        if key != self._key:
            raise ValueError(f"the arrays given to run() do not match the plan's ({what}: shapes, strides, dtypes, "
                             "device, 16-byte alignment, and out / lse given or not as when planned): make a plan "
                             "for them")


class ForwardPlan(Plan):
    def run(self, q, k, v, *, out=None, lse=None):
        """``rawflash.forward``'s (out, lse) for new q, k, v of the planned layouts (CuPy arrays)."""
        self._check(signature.forward(q, k, v, self._options, self._raw, out, lse), "q, k, v")
        return _on(q, self._call.run, q, k, v, self._features, out, lse)


class DecodePlan(Plan):
    def run(self, q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None, out=None,
            lse=None):  # (v_cache, v_new None for a latent cache, as planned)
        """``rawflash.decode``'s result for one step: arrays of the planned layouts (CuPy), ``cache_seqlens`` an
        int (checked against the cache here) or the planned int32 device array (checked by the kernels)."""
        ins = (q, k_cache, v_cache, k_new, v_new, block_table)
        self._check(signature.decode(ins, cache_seqlens, self._options, self._raw, (out, lse)),
                    "q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table")
        if not self._call.takes_cache_len(cache_seqlens):
            p = self._call.problem
            raise ValueError(f"cache_seqlens + seqlen_new ({p.new_keys}) must be between 0 and the cache's capacity "
                             f"per sequence ({p.seqlen_k}), got cache_seqlens {cache_seqlens}")
        features = _decode_features(dict(self._features), block_table, cache_seqlens)
        res = _on(q, self._call.run, q, k_cache, v_cache, k_new, v_new, features, out, lse)
        return res if self._options[-1] else res[0]


def plan_forward(q: Array, k: Array, v: Array, *, causal: bool = False, scale: float | None = None,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Array | None = None,
                 sinks: Array | None = None, cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
                 max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, seqused_k: Array | None = None,
                 out: Array | None = None, lse: Array | None = None) -> ForwardPlan:
    """A :class:`Plan` of :func:`forward` (16-bit and float32 CuPy arrays, kernel='fa2', the cupy backend) for
    arrays laid out as ``q``, ``k``, ``v`` (and ``out``, ``lse`` when runs will give them). Every argument is
    checked here, as ``forward`` checks it; nothing is launched."""
    opts = (causal, scale, window, softcap, max_seqlen_q, max_seqlen_k, ())
    raw = (alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k)
    env = settings.load()
    values = _values(cu_seqlens_q, cu_seqlens_k, seqused_k)
    (q, k, v), c, _, ds, sw, _ = _checked_forward(q, k, v, causal, scale, window, softcap, alibi_slopes, sinks,
                                                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                                  {}, None, False, False, "fa2", "cupy", {}, out, lse, None, values)
    key = signature.forward(q, k, v, opts, raw, out, lse, None, validation.maxima(values, max_seqlen_q, max_seqlen_k))
    if key is None:
        raise ValueError("a plan takes non-empty CuPy arrays (q, k, v, the feature arrays and the outputs)")
    call = PLANS.get(key)
    if call is None:
        from .kernels import cupy_backend

        with _device(c.device):
            bound = cupy_backend.bind_forward(c.problem, q, k, v, c.scale, "fa2", sw, c.extras, env, out=out,
                                              lse=lse)
            call = _plan(key, lambda: cupy_backend.ForwardCall(bound, q, k, v, c.extras, env, out, c.facts))
    # a run compares the layouts of its own arrays: the feature arrays are the plan's, never read on the host again
    return ForwardPlan(signature.forward(q, k, v, opts, (None,) * 5, out, lse), call, opts, dict(c.extras),
                       (None,) * 5)


def plan_decode(q: Array, k_cache: Array, v_cache: Array | None = None, *, cache_seqlens: int | Array,
                k_new: Array | None = None, v_new: Array | None = None, block_table: Array | None = None,
                causal: bool = True, scale: float | None = None, window: tuple[int, int] = (-1, -1),
                softcap: float = 0.0, alibi_slopes: Array | None = None, sinks: Array | None = None,
                k_descale: Array | None = None, v_descale: Array | None = None, num_splits: int | None = None,
                return_lse: bool = False, head_dim_v: int | None = None, out: Array | None = None,
                lse: Array | None = None) -> DecodePlan:
    """A :class:`Plan` of :func:`decode` (CuPy arrays, the cupy backend) for one step laid out as the arrays given
    (``cache_seqlens`` an int, or an int32 device array whose values runs may change on the device). Every
    argument is checked here, as ``decode`` checks it; nothing is launched or appended."""
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new),
             ("block_table", block_table))
    opts = (causal, scale, window, softcap, num_splits, head_dim_v, return_lse)
    raw = (alibi_slopes, sinks, k_descale, v_descale)
    env = settings.load()
    ins, c, _, _ = _checked_decode(named, cache_seqlens, causal, scale, window, softcap, alibi_slopes, sinks,
                                   num_splits, return_lse, "cupy", out, lse, k_descale, v_descale, head_dim_v)
    key = signature.decode(ins, cache_seqlens, opts, raw, (out, lse))
    if key is None:
        raise ValueError("a plan takes CuPy arrays (q, the caches, the new keys and values, block_table, "
                         "cache_seqlens unless an int, the feature arrays and the outputs)")
    call = PLANS.get(key)
    if call is None:
        from .kernels import cupy_backend

        with _device(c.device):
            bound = cupy_backend.bind_decode(c.problem, *ins[:5], c.scale, num_splits, c.extras, env, out=out,
                                             lse=lse)
            call = _plan(key, lambda: cupy_backend.DecodeCall(bound, ins[:5], c.extras, env, out))
    features = {n: x for n, x in c.extras.items() if n in ("alibi_slopes", "sinks", "k_descale", "v_descale")}
    return DecodePlan(key, call, opts, features, raw)
