"""NumPy reference of exact attention, and the error rule every correctness test uses.

Two precisions share one code path (naive attention: ``S = Q K^T * scale``, ``P = softmax(S)``, ``O = P V``):

- ``upcast=True`` (default): everything in float64. This is ``ref`` in the error rule.
- ``upcast=False``: the same attention done the way a plain GPU implementation (PyTorch or CuPy matmul,
  softmax, matmul) does it in the input precision: every matmul accumulates in float32 and its result is
  rounded to the input dtype; every elementwise step is done in float32 and rounded. This is ``base`` in
  the error rule.

The error rule (flash-attn's tests') is :func:`error_ratio_ok`::

    max|ours - ref| <= factor * max|base - ref| + rounding_floor(dtype)

with ``factor = 2`` for forward outputs and ``3`` for gradients.

Semantics (the API's, flash-attn's): layout ``(batch, seqlen, heads, head_dim)``; GQA/MQA query head ``h``
reads kv head ``h // (heads // kv_heads)``; causal masking is aligned to the bottom-right corner (query ``i``
sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``); a query row that sees no key gets ``out = 0``,
``lse = -inf`` and zero gradients, never NaN and never a NumPy warning.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import ml_dtypes
import numpy as np

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT_DTYPES = (np.dtype(np.float16), _BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
_FLOOR_SAMPLES = np.linspace(-1.0, 1.0, 8193)
_FLOOR_SHIFT = 0.3


class _Attention(NamedTuple):
    """Validated inputs, split by kv head and held in the accumulator dtype (values exact in ``dtype``)."""

    dtype: np.dtype  # every intermediate is rounded to this dtype
    q: np.ndarray  # (batch, kv_heads, group, seqlen_q, head_dim)
    k: np.ndarray  # (batch, kv_heads, 1, seqlen_k, head_dim)
    v: np.ndarray  # (batch, kv_heads, 1, seqlen_k, head_dim)
    scale: np.floating
    visible: np.ndarray | None  # (seqlen_q, seqlen_k) bool; None when no key is masked
    dout: np.ndarray | None  # (batch, kv_heads, group, seqlen_q, head_dim); None in forward
    softcap: float  # 0: off
    bias: np.ndarray | None  # ALiBi, broadcastable to the scores; None: off
    sinks: np.ndarray | None  # (1, kv_heads, group, 1, 1) sink logits; None: off


def forward(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
            cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, upcast=True):
    """Exact attention forward: ``out = softmax(scores) v`` and its log-sum-exp.

    Parameters
    ----------
    q : array_like, shape (batch, seqlen_q, heads, head_dim), or (total_q, heads, head_dim) with cu_seqlens_q
        Queries. Anything ``np.asarray`` accepts; objects with ``.get()`` (CuPy arrays) are copied to the host.
    k, v : array_like, shape (batch, seqlen_k, kv_heads, head_dim), or (total_k, kv_heads, head_dim)
        Keys and values; ``heads % kv_heads == 0`` and query head ``h`` uses kv head ``h // (heads // kv_heads)``.
    causal : bool
        Bottom-right aligned causal mask: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
    scale : float, optional
        Score scale; defaults to ``1 / sqrt(head_dim)``.
    window : (int, int)
        Sliding window ``(left, right)``, -1 = unbounded: query ``i`` sees keys ``j`` with
        ``i + sk - sq - left <= j <= i + sk - sq + right`` (causal sets right to 0).
    softcap : float
        > 0: scores ``s`` become ``softcap * tanh(s / softcap)`` (after the scale, before ALiBi).
    alibi_slopes : array_like (heads,) or (batch, heads), optional
        ALiBi: scores get ``- slope * |i + sk - sq - j|``.
    sinks : array_like (heads,), optional
        One logit per head that joins every row's softmax denominator and has no value.
    cu_seqlens_q, cu_seqlens_k : array_like (batch + 1,) int, optional
        Packed variable lengths (both or neither): sequence b is rows ``cu[b]:cu[b+1]``.
    seqused_k : array_like (batch,) int, optional
        Keys actually used per sequence (the first ``seqused_k[b]``); the rest are ignored.
    upcast : bool
        True: compute in float64 (any real dtype accepted). False: compute as a plain GPU implementation does in
        the input precision (float16, bfloat16, float32 or float64; q, k, v of one dtype), see the module docstring.

    Returns
    -------
    out : ndarray like q
        float64 when ``upcast``, else the input dtype. Rows that see no key are exactly 0.
    lse : ndarray, shape (batch, heads, seqlen_q), or (heads, total_q) when packed
        ``log`` of the softmax denominator (natural log, the sink included); ``-inf`` for rows that see no key and
        have no sink. float64 when ``upcast``, else float32 (float64 for float64 inputs).
    """
    opts = _Options(causal, scale, window, softcap, alibi_slopes, sinks)
    if cu_seqlens_q is not None or seqused_k is not None:
        return _per_sequence(_forward_dense, {"q": q, "k": k, "v": v}, opts, cu_seqlens_q, cu_seqlens_k, seqused_k,
                             upcast)
    return _forward_dense({"q": q, "k": k, "v": v}, opts, upcast)


def _forward_dense(named, opts, upcast):
    att = _prepare(named, opts, upcast)
    probs, lse = _probabilities(att)
    out = _matmul_rounded(probs, att.v, att.dtype)
    return _merge_heads(out).astype(att.dtype), _merge_heads_lse(lse)


def backward(dout, q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None,
             sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, upcast=True, out=None, lse=None):
    """Gradients of ``sum(out * dout)`` with respect to q, k, v (and the sinks), where ``out = forward(...)[0]``.

    Parameters
    ----------
    dout : array_like like q
        Gradient of the loss with respect to ``out``; with ``upcast=False`` it must have q's dtype.
    q, k, v, causal, scale, window, softcap, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k, upcast
        As in :func:`forward`. With ``upcast=False`` the steps are rounded as PyTorch autograd rounds the naive
        attention: ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dP * P))`` (float32, rounded), then
        through the soft-cap's derivative and ``dS * scale`` (rounded), ``dQ = dS K``, ``dK = dS^T Q``; each matmul
        rounded per query head, and dK / dV summed over the query heads of a GQA group in float32, then rounded.
    out, lse : array_like, optional
        Given together: the forward's result to differentiate through, as FlashAttention's backward uses them:
        ``P = exp(scores - lse)`` and ``D = rowsum(dout * out)`` (so a block of keys with the whole row's lse and out
        gives that block's share of the gradients, as ring attention needs). Default: computed here.

    Returns
    -------
    dq : ndarray like q
    dk, dv : ndarray like k
        Summed over the query heads that share each kv head. float64 when ``upcast``, else the input dtype.
        Rows of dq that see no key are exactly 0.
    dsinks : ndarray (heads,), only when ``sinks`` is given
        ``-sum_i exp(sink - lse_i) D_i`` over every row of every sequence (float64, or float32 when not upcast;
        then each row's sink probability and its share are rounded to the input dtype first, as autograd rounds
        the sink's column of a naive implementation that concatenates the sink to the scores).
    """
    opts = _Options(causal, scale, window, softcap, alibi_slopes, sinks)
    named = {"q": q, "k": k, "v": v, "dout": dout}
    if (out is None) != (lse is None):
        raise ValueError("out and lse must be given together (or neither)")
    if out is not None:
        named.update(out=out, lse=lse)
    if cu_seqlens_q is not None or seqused_k is not None:
        grads = _per_sequence(_backward_dense, named, opts, cu_seqlens_q, cu_seqlens_k, seqused_k, upcast)
    else:
        grads = _backward_dense(named, opts, upcast)
    return grads if sinks is not None else grads[:3]


def _backward_dense(named, opts, upcast):
    given = {name: named.pop(name) for name in ("out", "lse") if name in named}
    att = _prepare(named, opts, upcast)
    dtype, dout = att.dtype, att.dout
    if given:
        lse = _split_lse(_host(given["lse"]).astype(_accumulator(dtype)), att.q.shape[1])
        probs = _round(_exp_shifted(_scores(att), lse), dtype)
        out_s = _split_heads(_host(given["out"]).astype(_accumulator(dtype)), att.k.shape[1])
        delta = np.sum(dout * out_s, axis=-1, keepdims=True)
    else:
        probs, lse = _probabilities(att)
        delta = None
    dv = _group_sum(_matmul_rounded(_t(probs), dout, dtype), dtype)
    dprobs = _matmul_rounded(dout, _t(att.v), dtype)
    if delta is None:
        delta = np.sum(dprobs * probs, axis=-1, keepdims=True)
    dscores = _round(probs * (dprobs - delta), dtype)
    if att.softcap > 0:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
        raw = _round(_matmul_rounded(att.q, _t(att.k), dtype) * att.scale, dtype)
        dscores = _round(dscores * (1 - np.tanh(raw / att.softcap) ** 2), dtype)
    dscores = _round(dscores * att.scale, dtype)
    dq = _matmul_rounded(dscores, att.k, dtype)
    dk = _group_sum(_matmul_rounded(_t(dscores), att.q, dtype), dtype)
    grads = tuple(_merge_heads(grad).astype(dtype) for grad in (dq, dk, dv))
    if att.sinks is None:
        return grads
    with np.errstate(invalid="ignore"):  # rows with lse = +-inf contribute 0
        sink_probs = np.where(np.isfinite(lse[..., None]), np.exp(att.sinks - lse[..., None]), 0.0)
    # The sink is one more column of the scores (as gpt-oss's reference concatenates it): its probability and its
    # gradient P_sink * (0 - D) are elements of the probability and score-gradient tensors, rounded to the input
    # dtype like the rest of them, before the sum over rows in the accumulator dtype (a no-op when upcast).
    share = _round(_round(sink_probs, dtype) * delta, dtype)
    dsinks = -np.sum(share, axis=(0, 3, 4)).reshape(-1)
    return (*grads, dsinks.astype(np.float64 if upcast else _accumulator(dtype)))


class _Options(NamedTuple):
    """The variant of a call (everything but the arrays it attends over)."""

    causal: bool
    scale: float | None
    window: tuple
    softcap: float
    alibi_slopes: object
    sinks: object


def _per_sequence(fn, named, opts, cu_q, cu_k, seqused_k, upcast):
    """Run ``fn`` on every sequence of a packed (or seqused_k-trimmed) batch and put the results back together.

    Packed inputs are (total, heads, d) with cu_seqlens offsets; without them the batch axis gives the sequences.
    Keys past ``seqused_k[b]`` take no part; their gradients are 0.
    """
    arrays = {name: _host(x) for name, x in named.items()}
    packed = cu_q is not None
    if packed and cu_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if packed:
        cq, ck = (np.asarray(_host(c)).astype(np.int64) for c in (cu_q, cu_k))
    else:
        nq, nk = arrays["q"].shape[1], arrays["k"].shape[1]
        cq, ck = np.arange(arrays["q"].shape[0] + 1) * nq, np.arange(arrays["q"].shape[0] + 1) * nk
    used = None if seqused_k is None else np.asarray(_host(seqused_k)).astype(np.int64)
    slopes = None if opts.alibi_slopes is None else np.asarray(_host(opts.alibi_slopes), dtype=np.float64)

    def rows_of(name, x, b):  # sequence b of one input, as a batch of one
        if name == "lse":
            return x[:, cq[b]:cq[b + 1]][None] if packed else x[b:b + 1]
        lo, hi = (ck[b], ck[b + 1]) if name in ("k", "v") else (cq[b], cq[b + 1])
        part = x[lo:hi][None] if packed else x[b:b + 1]
        return part[:, : used[b]] if used is not None and name in ("k", "v") else part

    results = []
    for b in range(len(cq) - 1):
        part = {name: rows_of(name, x, b) for name, x in arrays.items()}
        sl = slopes if slopes is None or slopes.ndim == 1 else slopes[b: b + 1]
        results.append(fn(part, opts._replace(alibi_slopes=sl), upcast))
    roles = ("q", "lse") if len(results[0]) == 2 else ("q", "k", "k", "sum")[: len(results[0])]
    out = []
    for index, role in enumerate(roles):
        parts = [r[index] for r in results]
        if role == "sum":
            out.append(np.sum(parts, axis=0))
            continue
        if role == "k":  # keys past seqused_k (or past the used part of a packed sequence) get zero gradients
            parts = [_pad_rows(x, int(ck[b + 1] - ck[b])) for b, x in enumerate(parts)]
        if packed:
            out.append(np.concatenate([x[0] for x in parts], axis=1 if role == "lse" else 0))
        else:
            out.append(np.concatenate(parts, axis=0))
    return tuple(out)


def _pad_rows(x, n):
    """``x`` (1, rows, heads, d) zero-padded to ``n`` rows."""
    if x.shape[1] >= n:
        return x
    pad = np.zeros((x.shape[0], n - x.shape[1]) + x.shape[2:], dtype=x.dtype)
    return np.concatenate([x, pad], axis=1)


def rounding_floor(dtype):
    """Absolute floor of the error rule for ``dtype``: the rounding noise of one add and one subtract.

    Returns ``max |((x + 0.3) - 0.3) - x|`` over 8193 evenly spaced values ``x`` in ``[-1, 1]``, where ``x``,
    ``0.3`` and every intermediate are held in ``dtype`` (each operation rounds once to ``dtype``) and the final
    difference is taken in float64. flash-attn's tests use the same expression on their reference outputs as an
    absolute tolerance; a fixed sample set makes the floor a constant of the dtype. Its value is ``eps / 2``
    (half the spacing of values in ``[1, 2)``, where attention outputs of unit-scale inputs live): float16
    ~4.9e-4, bfloat16 ~3.9e-3, float32 ~6.0e-8.

    Parameters
    ----------
    dtype : dtype-like
        float16, ``ml_dtypes.bfloat16``, float32 or float64.

    Returns
    -------
    float
        The floor, > 0.
    """
    return _rounding_floor(_float_dtype(dtype, "dtype"))


LSE_ULPS = 4  # roundings of a base-2 lse beyond the naive one, each up to one ulp of |lse|


def lse_floor(ref_lse) -> float:
    """The floor of the rule for a float32 lse: ``LSE_ULPS`` ulps of the largest finite |lse|.

    A FlashAttention kernel keeps scores in log2 units and returns ``lse = m * ln 2 + log(l)``: ``scale * log2(e)``
    is rounded, the scaled score is rounded, ``ln 2`` and the product are rounded, and the sum once more, each up to
    an ulp of |lse| where l = 1 (a row that sees one key, whose lse is its scaled score). The naive float32
    reference rounds ``scale * s`` once, so for such a row twice its error is below what any base-2 kernel can
    reach; with many keys log(l) and the accumulation dominate and this floor is far below the bound.
    """
    r = np.abs(_host(ref_lse).astype(np.float64))
    r = r[np.isfinite(r)]
    if r.size == 0:
        return 0.0
    return float(LSE_ULPS * np.spacing(np.float32(r.max())))


def data_floor(ref, dtype):
    """flash-attn's absolute tolerance: ``2 * max |((r + 0.3) - 0.3) - r|`` over the finite values ``r`` of ``ref``.

    ``r`` is ``ref`` rounded to ``dtype`` and both operations round to ``dtype``: twice the rounding noise of one
    add and one subtract at the magnitude the result actually has (flash-attn's tests add this to their bound).
    """
    r = _host(ref).astype(np.float64)
    r = r[np.isfinite(r)].astype(_float_dtype(dtype, "dtype"))
    if r.size == 0:
        return 0.0
    shift = r.dtype.type(_FLOOR_SHIFT)
    return 2.0 * float(np.max(np.abs(((r + shift) - shift).astype(np.float64) - r.astype(np.float64))))


def backward_bases(dout, q, k, v, exact, **options):
    """The ``base`` of the error rule for each gradient :func:`backward` returns: the naive backward in the input
    precision (``upcast=False``), except for ``dsinks``, whose base is whichever is further from ``exact`` (the
    float64 gradients): the naive one, or FlashAttention's own floor, the float64 backward given the exact output
    rounded to the input dtype (what a perfect kernel stores) and the exact lse.

    Why dsinks alone: it is ``-sum_i P_sink,i D_i`` over every row, and FlashAttention takes D_i = rowsum(dO * O)
    from the stored 16-bit O where the naive backward sums its 16-bit P and dP. Both are errors of the input
    precision, by different methods, summed over the rows into only ``heads`` values, so the largest of either is
    a noisy estimate: on tests/test_numba_gpu.py's float16 sinks case the floor alone is 3.1x the naive error
    (0.00164 against 0.00052 before the naive rounded its shares: test_reference.py). ``options`` as
    :func:`backward` takes them (``out`` / ``lse`` given or not)."""
    bases = list(backward(dout, q, k, v, upcast=False, **options))
    if options.get("sinks") is None or np.dtype(_host(q).dtype) == np.float64:
        return tuple(bases)
    semantics = {name: x for name, x in options.items() if name not in ("out", "lse")}  # the floor's own O, lse
    out, lse = forward(q, k, v, **semantics)
    floor = backward(dout, q, k, v, out=out.astype(_host(q).dtype), lse=lse, **semantics)[3]
    exact_sinks = np.asarray(exact[3], np.float64)
    if np.max(np.abs(floor - exact_sinks), initial=0.0) > np.max(np.abs(bases[3] - exact_sinks), initial=0.0):
        bases[3] = floor.astype(bases[3].dtype)
    return tuple(bases)


def error_ratio_ok(ours, ref, base, dtype, factor, floor: float = 0.0):
    """flash-attn's correctness rule: is ``ours`` at most ``factor`` times as wrong as the naive baseline?

    Parameters
    ----------
    ours : array_like
        Result under test (any dtype; objects with ``.get()`` are copied to the host).
    ref : array_like, same shape
        The float64 reference (``upcast=True``).
    base : array_like, same shape
        The same quantity computed naively in the input precision (``upcast=False``).
    dtype : dtype-like
        The input precision, which sets the floor (``rounding_floor(dtype)``); e.g. bfloat16 when checking an
        lse that is float32 but computed from bfloat16 inputs.
    factor : float
        2 for forward outputs, 3 for gradients (flash-attn's factors).
    floor : float
        An absolute floor of the quantity's own (e.g. :func:`lse_floor` for a float32 lse), raising the others.

    Returns
    -------
    ok : bool
        ``max_err_ours <= bound`` and ``ours`` holds no NaN. A NaN in ``ref`` or ``base`` also fails.
    max_err_ours : float
        ``max |ours - ref|`` in float64; entries equal in both (e.g. both ``-inf``) count as 0; 0.0 when empty.
    max_err_base : float
        ``max |base - ref|``, same conventions.
    bound : float
        ``factor * max_err_base + max(data_floor(ref, dtype), rounding_floor(dtype), floor)``.

    Raises
    ------
    ValueError
        If the three shapes differ (no broadcasting).
    """
    ours, ref, base = (_host(x).astype(np.float64) for x in (ours, ref, base))
    if not ours.shape == ref.shape == base.shape:
        raise ValueError(f"ours, ref and base must have one shape; got {ours.shape}, {ref.shape}, {base.shape}")
    max_err_ours = _max_abs_error(ours, ref)
    max_err_base = _max_abs_error(base, ref)
    bound = float(factor) * max_err_base + max(data_floor(ref, dtype), rounding_floor(dtype), floor)
    ok = bool(not np.isnan(ours).any() and max_err_ours <= bound)
    return ok, max_err_ours, max_err_base, bound


def _prepare(named, opts, upcast):
    """Validate q, k, v (and dout when given) and split them by kv head into an ``_Attention``."""
    arrays = {name: _host(x) for name, x in named.items()}
    dtype = _compute_dtype(arrays, upcast)
    q, k, v, dout = arrays["q"], arrays["k"], arrays["v"], arrays.get("dout")
    _check_shapes(q, k, v, dout)
    batch, seqlen_q, heads = q.shape[:3]
    seqlen_k, kv_heads, head_dim = k.shape[1], k.shape[2], k.shape[3]
    acc = _accumulator(dtype)
    scale = 1.0 / np.sqrt(head_dim) if opts.scale is None else float(opts.scale)
    return _Attention(
        dtype=dtype,
        q=_split_heads(q.astype(acc), kv_heads),
        k=_split_heads(k.astype(acc), kv_heads),
        v=_split_heads(v.astype(acc), kv_heads),
        scale=acc.type(scale),
        visible=_visibility(seqlen_q, seqlen_k, opts.causal, opts.window),
        dout=None if dout is None else _split_heads(dout.astype(acc), kv_heads),
        softcap=float(opts.softcap or 0.0),
        bias=_alibi(opts.alibi_slopes, batch, heads, kv_heads, seqlen_q, seqlen_k, acc),
        sinks=None if opts.sinks is None else
        np.asarray(_host(opts.sinks), dtype=acc).reshape(1, kv_heads, heads // kv_heads, 1, 1),
    )


def _alibi(slopes, batch, heads, kv_heads, seqlen_q, seqlen_k, acc):
    """ALiBi's bias ``-slope * |i + sk - sq - j|`` shaped like the split scores, or None."""
    if slopes is None:
        return None
    s = np.asarray(_host(slopes), dtype=np.float64)
    s = np.broadcast_to(s.reshape(-1 if s.ndim == 1 else s.shape[0], heads) if s.ndim == 2 else s[None], (batch, heads))
    dist = np.abs(np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q) - np.arange(seqlen_k)[None, :])
    bias = -s.reshape(batch, kv_heads, heads // kv_heads, 1, 1) * dist
    return bias.astype(acc)


def _scores(att):
    """Rounded scores: scale, soft-cap, ALiBi, mask (-inf where hidden), as the kernels apply them."""
    scores = _matmul_rounded(att.q, _t(att.k), att.dtype)
    scores = _round(scores * att.scale, att.dtype)
    if att.softcap > 0:
        scores = _round(att.softcap * np.tanh(scores / att.softcap), att.dtype)
    if att.bias is not None:
        scores = _round(scores + att.bias, att.dtype)
    if att.visible is not None:
        scores = np.where(att.visible, scores, -np.inf)
    return scores


def _probabilities(att):
    """Rounded softmax probabilities ``(batch, kv_heads, group, seqlen_q, seqlen_k)`` and lse ``(..., seqlen_q)``."""
    probs, lse = _softmax(_scores(att), att.sinks)
    return _round(probs, att.dtype), lse


def _exp_shifted(scores, lse):
    """``exp(scores - lse)`` with rows of lse = -inf (nothing visible) giving 0."""
    shift = np.where(np.isfinite(lse), lse, 0.0)[..., None]
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(lse)[..., None], np.exp(scores - shift), 0.0)


def _split_lse(lse, kv_heads):
    """lse (batch, heads, seqlen_q) -> (batch, kv_heads, group, seqlen_q)."""
    batch, heads, seqlen = lse.shape
    return lse.reshape(batch, kv_heads, heads // kv_heads, seqlen)


def _softmax(scores, sinks=None):
    """Row softmax and log-sum-exp of ``scores`` (-inf = masked), with an optional sink logit per row that joins the
    denominator; a row with no finite score gives 0 and -inf (or the sink's logit as its lse)."""
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    if sinks is not None:
        row_max = np.maximum(row_max, sinks)
    shift = np.where(np.isfinite(row_max), row_max, 0)
    expo = np.exp(scores - shift)
    denom = np.sum(expo, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sinks - shift)
    probs = expo / np.where(denom > 0, denom, 1)
    log_denom = np.log(denom, out=np.full_like(denom, -np.inf), where=denom > 0)
    return probs, (shift + log_denom)[..., 0]


def _matmul_rounded(a, b, dtype):
    """``a @ b`` accumulated in float32 (float64 for float64) and rounded to ``dtype``: a plain GPU matmul.

    ``a`` and ``b`` are in the accumulator dtype; the result is too, holding values exactly representable in
    ``dtype``. This is the single owner of the matmul rounding rule.
    """
    return _round(np.matmul(a, b), dtype)


def _round(x, dtype):
    """Round ``x`` to ``dtype`` (nearest even) and hold the result, exactly, in the accumulator dtype."""
    return x.astype(dtype, copy=False).astype(_accumulator(dtype), copy=False)


def _group_sum(per_head, dtype):
    """Sum per-query-head dK or dV ``(b, kv_heads, group, seqlen_k, d)`` over the group, in the accumulator dtype."""
    return _round(np.sum(per_head, axis=2, keepdims=True), dtype)


def _accumulator(dtype):
    """float64 for float64 work, float32 for everything else."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _t(x):
    """Swap the last two axes."""
    return np.swapaxes(x, -1, -2)


def _split_heads(x, kv_heads):
    """``(b, s, heads, d)`` -> ``(b, kv_heads, heads // kv_heads, s, d)``; query head h = kv_head * group + g."""
    batch, seqlen, heads, head_dim = x.shape
    return x.reshape(batch, seqlen, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)


def _merge_heads(x):
    """Inverse of :func:`_split_heads`: ``(b, kv_heads, group, s, d)`` -> ``(b, s, kv_heads * group, d)``."""
    batch, kv_heads, group, seqlen, head_dim = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen, kv_heads * group, head_dim)


def _merge_heads_lse(lse):
    """``(b, kv_heads, group, seqlen_q)`` -> ``(b, heads, seqlen_q)``."""
    batch, kv_heads, group, seqlen = lse.shape
    return lse.reshape(batch, kv_heads * group, seqlen)


def _visibility(seqlen_q, seqlen_k, causal, window=(-1, -1)):
    """``(seqlen_q, seqlen_k)`` bool, or None when every key is visible: query i sees key j iff
    ``i + sk - sq - left <= j <= i + sk - sq + right`` (bottom-right aligned; -1 = unbounded; causal: right = 0)."""
    left, right = (int(window[0]), int(window[1])) if window is not None else (-1, -1)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    diag = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    cols = np.arange(seqlen_k)[None, :]
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        visible &= cols <= diag + right
    if left >= 0:
        visible &= cols >= diag - left
    return visible


def _host(x):
    """``x`` as a NumPy array; objects with a ``.get()`` method (CuPy arrays) are copied to the host first."""
    if not isinstance(x, (np.ndarray, Mapping)) and callable(getattr(x, "get", None)):
        x = x.get()
    return np.asarray(x)


def _compute_dtype(arrays, upcast):
    """The dtype intermediates are rounded to: float64 when ``upcast``, else the one dtype all arrays share."""
    if upcast:
        for name, x in arrays.items():
            if not (x.dtype.kind in "fiu" or x.dtype == _BFLOAT16):
                raise TypeError(f"{name} must hold real numbers; got dtype {x.dtype}")
        return np.dtype(np.float64)
    dtype = _float_dtype(arrays["q"].dtype, "q")
    for name, x in arrays.items():
        if x.dtype != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype} when upcast=False; got {x.dtype}")
    return dtype


def _float_dtype(dtype, name):
    """``np.dtype(dtype)`` if it is float16, bfloat16, float32 or float64, else ``TypeError`` naming ``name``."""
    dtype = np.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {dtype}")
    return dtype


def _check_shapes(q, k, v, dout):
    """Raise ``ValueError`` naming the argument unless q, k, v (and dout) have consistent attention shapes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim); got shape {x.shape}")
    if v.shape[:3] != k.shape[:3] or v.shape[3] < 1:
        raise ValueError(f"v must have k's (batch, seqlen, kv_heads) {k.shape[:3]} and head_dim >= 1; got {v.shape}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must have q's batch {q.shape[0]} and head_dim {q.shape[3]}; got shape {k.shape}")
    if q.shape[3] < 1:
        raise ValueError(f"q must have head_dim >= 1; got shape {q.shape}")
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        raise ValueError(f"k's kv_heads must be >= 1 and divide q's heads {q.shape[2]}; got {k.shape[2]}")
    if dout is not None and dout.shape != (*q.shape[:3], v.shape[3]):
        raise ValueError(f"dout must have q's shape with v's head_dim {(*q.shape[:3], v.shape[3])}; got {dout.shape}")


@functools.lru_cache(maxsize=None)
def _rounding_floor(dtype):
    """Cached body of :func:`rounding_floor` for a validated ``np.dtype``."""
    x = _FLOOR_SAMPLES.astype(dtype)
    shift = dtype.type(_FLOOR_SHIFT)
    return float(np.max(np.abs(((x + shift) - shift).astype(np.float64) - x.astype(np.float64))))


def _max_abs_error(x, ref):
    """``max |x - ref|`` in float64, equal entries (both -inf included) counting 0; NaN propagates; 0.0 if empty."""
    with np.errstate(invalid="ignore"):
        diff = np.where(x == ref, 0.0, np.abs(x - ref))
    return float(np.max(diff, initial=0.0))


def append_slots(cache_seqlens, new_keys: int, page_size: int, block_table=None):
    """Where a decode step's appended keys go: (slots, rows), each (batch, new_keys) int64, so that key
    ``cache_seqlens[b] + t`` of sequence b is ``cache[slots[b, t], rows[b, t]]`` (slot: the sequence of a contiguous
    cache, the page ``block_table[b, j // page_size]`` of a paged one)."""
    lens = np.asarray(_host(cache_seqlens)).astype(np.int64).reshape(-1)
    j = lens[:, None] + np.arange(new_keys)[None, :]
    if block_table is None:
        return np.broadcast_to(np.arange(len(lens))[:, None], j.shape), j
    table = np.asarray(_host(block_table)).astype(np.int64)
    return np.take_along_axis(table, j // page_size, axis=1), j % page_size


def append_kv(k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None):
    """The caches after a decode step's append: copies of ``k_cache`` / ``v_cache`` (host arrays, their dtype) with
    ``k_new[b, t]`` / ``v_new[b, t]`` written as key ``cache_seqlens[b] + t`` of sequence b.

    Contiguous caches are (batch, capacity, kv_heads, head_dim); paged ones (num_pages, page_size, kv_heads,
    head_dim) with ``block_table[b, j // page_size]`` the page of key j of sequence b.
    """
    kc, vc = _host(k_cache).copy(), _host(v_cache).copy()
    if k_new is None:
        return kc, vc
    kn, vn = _host(k_new), _host(v_new)
    slots, rows = append_slots(cache_seqlens, kn.shape[1], kc.shape[1], block_table)
    kc[slots, rows], vc[slots, rows] = kn, vn
    return kc, vc


def gather_kv(k_cache, v_cache, lengths, block_table=None):
    """Dense (batch, max(lengths), kv_heads, head_dim) keys and values of every sequence (zero past its length),
    from a contiguous or a paged cache."""
    kc, vc = _host(k_cache), _host(v_cache)
    lengths = np.asarray(lengths).astype(np.int64).reshape(-1)
    if block_table is None:
        n = int(lengths.max(initial=0))
        return kc[: len(lengths), :n], vc[: len(lengths), :n]
    table = np.asarray(_host(block_table)).astype(np.int64)
    page = kc.shape[1]
    n = max(1, int(lengths.max(initial=0)))
    k = np.zeros((len(lengths), n) + kc.shape[2:], dtype=kc.dtype)
    v = np.zeros_like(k)
    for b, length in enumerate(lengths):
        for j0 in range(0, int(length), page):
            rows = min(page, int(length) - j0)
            k[b, j0:j0 + rows] = kc[table[b, j0 // page], :rows]
            v[b, j0:j0 + rows] = vc[table[b, j0 // page], :rows]
    return k, v


E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _descale_bshd(descale) -> np.ndarray:
    """An FP8 cache's descale (None: 1; (1,) per tensor; (batch, kv_heads)) shaped to multiply (batch, s, kv, d)."""
    if descale is None:
        return np.ones((1, 1, 1, 1), np.float32)
    d = np.asarray(_host(descale), dtype=np.float32)
    return d.reshape(1, 1, 1, 1) if d.size == 1 else d[:, None, :, None]


def cache_quantize(x, descale) -> np.ndarray:
    """New keys or values (batch, seqlen_new, kv_heads, head_dim) as an FP8 cache stores them (``decode``'s
    appends): ``x / descale`` in float32 (descale None, (1,) or (batch, kv_heads)) rounded to the nearest e4m3,
    saturating at +-448; float8_e4m3fn on the host."""
    scaled = np.asarray(_host(x), dtype=np.float32) / _descale_bshd(descale)
    return np.clip(scaled, -448.0, 448.0).astype(E4M3)


def decode(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None, causal=True,
           scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, k_descale=None, v_descale=None,
           upcast=True, head_dim_v=None):
    """Attention of q (batch, seqlen_q, heads, head_dim) against a KV cache after appending k_new / v_new: what
    ``rawflash.decode`` computes (sequence b has ``cache_seqlens[b] + seqlen_new`` keys, causal aligned to its
    last key). A float8_e4m3fn cache holds K / k_descale and V / v_descale: the appends are quantised so
    (:func:`cache_quantize`) and the attention reads ``K8 * k_descale``, ``V8 * v_descale`` (in float64, or rounded
    to q's dtype with ``upcast=False``: what a plain implementation dequantises to). ``head_dim_v`` (the latent
    cache, MLA's absorbed decode; v_cache and v_new None): the values are the first head_dim_v columns of the keys
    (k_cache after k_new's append), and out has head_dim_v columns. The caches are not modified; returns (out, lse)
    as :func:`forward` does."""
    if head_dim_v is not None:
        v_cache, v_new = k_cache, k_new
    lens = np.asarray(_host(cache_seqlens)).astype(np.int64).reshape(-1)
    lens = np.broadcast_to(lens, (_host(q).shape[0],))
    fp8 = _host(k_cache).dtype == E4M3
    if fp8 and k_new is not None:
        k_new, v_new = cache_quantize(k_new, k_descale), cache_quantize(v_new, v_descale)
    kc, vc = append_kv(k_cache, v_cache, lens, k_new, v_new, block_table)
    used = lens + (0 if k_new is None else _host(k_new).shape[1])
    k, v = gather_kv(kc, vc, used, block_table)
    if head_dim_v is not None:
        v = v[..., :head_dim_v]
    if k.shape[1] == 0:  # no sequence has a key: keep one zero key, used by none
        k, v = np.zeros((k.shape[0], 1) + k.shape[2:], k.dtype), np.zeros((v.shape[0], 1) + v.shape[2:], v.dtype)
    if fp8:
        k = k.astype(np.float64) * _descale_bshd(k_descale)
        v = v.astype(np.float64) * _descale_bshd(v_descale)
        if not upcast:
            k, v = k.astype(_host(q).dtype), v.astype(_host(q).dtype)
    return forward(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                   sinks=sinks, seqused_k=used.astype(np.int32), upcast=upcast)
