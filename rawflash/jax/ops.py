"""rawflash on JAX arrays, eagerly and inside ``jax.jit``: ``attention`` (differentiable) and ``decode``.

Each call is an XLA custom call of :mod:`rawflash.jax.targets`, checked by rawflash's own validation when JAX
traces it (the messages of ``rawflash.forward`` / ``rawflash.decode``, before anything runs). ``attention`` is a
``jax.custom_vjp``: its backward is rawflash's, with lse's cotangent (``return_lse=True``) folded into the rows'
D = rowsum(dout * out) through one more head-dim column. Each custom call has a ``jax.custom_batching``
rule: ``jax.vmap`` (and extra leading axes) fold into the batch, one launch for the whole batch.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import validation
from ..kernels.cupy_backend import run_head_dim
from . import targets

MAX_HEAD_DIM = 256


def _attrs(opts: tuple, **flags) -> dict:
    causal, scale, window, softcap, max_q, max_k = opts
    attrs = {"causal": bool(causal), "scale": np.float64(0.0 if scale is None else scale),
             "window_left": np.int64(window[0]), "window_right": np.int64(window[1]), "softcap": np.float64(softcap),
             "max_seqlen_q": np.int64(max_q or 0), "max_seqlen_k": np.int64(max_k or 0)}
    for name, value in flags.items():
        attrs[name] = np.int64(value) if isinstance(value, int) and not isinstance(value, bool) else bool(value)
    return attrs


def _layout(*arrays) -> tuple[tuple, tuple]:
    """Shapes and dtype names of arrays (None where absent), as a custom call's handler sees its buffers."""
    return (tuple(None if x is None else tuple(int(n) for n in x.shape) for x in arrays),
            tuple(None if x is None else np.dtype(x.dtype).name for x in arrays))


def _fold(x, size: int, batched: bool):
    """A vmapped operand with the vmap axis (first, as custom_vmap gives it) folded into its batch axis."""
    import jax.numpy as jnp

    if not batched:
        x = jnp.broadcast_to(x, (size,) + x.shape)
    return x.reshape((size * x.shape[1],) + x.shape[2:])


def _unfold(x, size: int):
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def _refuse_batched(names: tuple, batched: tuple) -> None:
    wrong = [n for n, b in zip(names, batched) if b]
    if wrong:
        raise ValueError(f"rawflash.jax: jax.vmap over {', '.join(wrong)} is not supported (vmap q, k, v and the "
                         "arrays shaped like them; the feature arrays are shared by the whole batch)")


# ---------------------------------------------------------------- the forward and backward custom calls

def _present_names(features: tuple) -> tuple:
    return tuple(n for n, present in zip(targets.FEATURES, features) if present)


def _all(features: tuple, feats: tuple) -> tuple:
    """Every one of targets.FEATURES from the present ones (None where absent), in order."""
    it = iter(feats)
    return tuple(next(it) if present else None for present in features)


def _flag_attrs(features: tuple) -> dict:
    alibi, sinks, cu_q, _, used = features
    return {"alibi": alibi, "sinks": sinks, "varlen": cu_q, "seqused": used}


def _rows_shape(q, varlen: bool) -> tuple:
    """lse's shape: (batch, heads, seqlen_q), or (heads, total_q) when packed."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@functools.lru_cache(maxsize=None)
def _forward_op(opts: tuple, features: tuple):
    """``(q, k, v, *features) -> (out, lse)`` for these options, one custom call, batched by folding."""
    import jax

    @jax.custom_batching.custom_vmap
    def op(q, k, v, *feats):
        shapes, dtypes = _layout(q, k, v, *_all(features, feats))
        targets.prepare(*targets.forward_key(targets.gpu_device(), shapes, dtypes, opts))
        results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(_rows_shape(q, features[2]),
                                                                                 np.float32),
                   jax.ShapeDtypeStruct((targets.FORWARD_WORKSPACE,), np.uint8))
        out, lse, _ = jax.ffi.ffi_call(targets.FORWARD, results)(q, k, v, *feats,
                                                                 **_attrs(opts, **_flag_attrs(features)))
        return out, lse

    @op.def_vmap
    def rule(size, batched, q, k, v, *feats):
        _refuse_batched(_present_names(features), batched[3:])
        _refuse_packed(features)
        out, lse = op(*(_fold(x, size, b) for x, b in zip((q, k, v), batched[:3])), *feats)
        return (_unfold(out, size), _unfold(lse, size)), (True, True)

    return op


def _refuse_packed(features: tuple) -> None:
    if features[2]:
        raise ValueError("rawflash.jax: jax.vmap of packed sequences (cu_seqlens) is not supported: pack them into "
                         "one call")


@functools.lru_cache(maxsize=None)
def _backward_op(opts: tuple, features: tuple, deterministic: bool):
    """``(dout, q, k, v, out, lse, *features) -> (dq, dk, dv[, dsink rows])``, batched by folding."""
    import jax

    @jax.custom_batching.custom_vmap
    def op(dout, q, k, v, out, lse, *feats):
        shapes, dtypes = _layout(q, k, v, *_all(features, feats))
        targets.prepare(*targets.backward_key(targets.gpu_device(), shapes, dtypes, opts, deterministic))
        rows = int(np.prod(lse.shape))
        sequences = (feats[len(_present_names(features[:2]))].shape[0] - 1) if features[2] else q.shape[0]
        heads = q.shape[-2]
        results = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((targets.backward_workspace_bytes(rows, sequences * heads, q.shape[-1]),),
                                        np.uint8)]
        if features[1]:
            results.append(jax.ShapeDtypeStruct(lse.shape, np.float32))
        res = jax.ffi.ffi_call(targets.BACKWARD, tuple(results))(
            dout, q, k, v, out, lse, *feats, **_attrs(opts, deterministic=deterministic, **_flag_attrs(features)))
        return (res[0], res[1], res[2]) + ((res[4],) if features[1] else ())

    @op.def_vmap
    def rule(size, batched, dout, q, k, v, out, lse, *feats):
        _refuse_batched(_present_names(features), batched[6:])
        _refuse_packed(features)
        res = op(*(_fold(x, size, b) for x, b in zip((dout, q, k, v, out, lse), batched[:6])), *feats)
        return tuple(_unfold(x, size) for x in res), tuple(True for _ in res)

    return op


def _pad(x, width: int):
    import jax.numpy as jnp

    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


@functools.lru_cache(maxsize=None)
def _differentiable(opts: tuple, features: tuple, deterministic: bool):
    """The custom_vjp over q, k, v, sinks (alibi_slopes get no gradient) for padded inputs."""
    import jax
    import jax.numpy as jnp
    from jax.custom_derivatives import SymbolicZero

    forward = _forward_op(opts, features)

    @jax.custom_vjp
    def core(q, k, v, feats):
        return forward(q, k, v, *feats)

    def core_fwd(q, k, v, feats):
        q, k, v = q.value, k.value, v.value
        feats = tuple(f.value for f in feats)
        out, lse = forward(q, k, v, *feats)
        return (out, lse), (q, k, v, feats, out, lse)

    def core_bwd(saved, cotangents):
        q, k, v, feats, out, lse = saved
        dout, dlse = cotangents
        if isinstance(dout, SymbolicZero):
            dout = jnp.zeros(out.shape, out.dtype)
        dout = dout.astype(q.dtype)
        if isinstance(dlse, SymbolicZero):
            res = _backward_op(opts, features, deterministic)(dout, q, k, v, out, lse, *feats)
            dq, dk, dv = res[:3]
        else:
            # lse's share of dS = P (dP - D) is + P dlse, i.e. D - dlse: one more head-dim column, zero in q, k, v
            # (scores and dP unchanged), 1 in dout and -dlse in out, makes the kernels' rowsum(dout * out) D - dlse
            d = q.shape[-1]
            wide = run_head_dim(d + 1)
            if wide > MAX_HEAD_DIM:
                raise ValueError(f"rawflash.jax: lse's gradient needs head_dim + 1 <= {MAX_HEAD_DIM}, got {d}")
            column = jnp.zeros(q.shape[:-1] + (wide - d,), q.dtype)
            dout_w = jnp.concatenate([dout, column.at[..., 0].set(1)], axis=-1)
            minus = -jnp.moveaxis(dlse, -2, -1).astype(q.dtype)  # (batch, seqlen_q, heads) / (total_q, heads)
            out_w = jnp.concatenate([out, column.at[..., 0].set(minus)], axis=-1)
            res = _backward_op(opts, features, deterministic)(dout_w, _pad(q, wide), _pad(k, wide), _pad(v, wide),
                                                              out_w, lse, *feats)
            dq, dk, dv = (x[..., :d] for x in res[:3])
        dfeats = []
        for name, x in zip(_present_names(features), feats):
            if name == "sinks":
                rows = res[3]
                dfeats.append(-rows.sum(axis=1) if features[2] else -rows.sum(axis=(0, 2)))
            elif name == "alibi_slopes":
                dfeats.append(jnp.zeros_like(x))  # ALiBi slopes are not differentiated
            else:
                dfeats.append(np.zeros(x.shape, jax.dtypes.float0))  # integer offsets and lengths
        return dq, dk, dv, tuple(dfeats)

    core.defvjp(core_fwd, core_bwd, symbolic_zeros=True)
    return core


def _lead(x, rank: int):
    """x with every axis before its last ``rank`` folded into the first of them, and the folded axes."""
    lead = tuple(x.shape[:-rank])
    if not lead:
        return x, lead
    return x.reshape((-1,) + tuple(x.shape[-rank + 1:])), lead


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, window: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, alibi_slopes=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, seqused_k=None,
              deterministic: bool = False, return_lse: bool = False):
    """Exact attention on JAX arrays, eagerly or under ``jax.jit``; differentiable (``jax.grad``, ``jax.vjp``)
    with rawflash's backward, and batched by ``jax.vmap`` into one launch.

    q (..., batch, seqlen_q, heads, head_dim); k, v (..., batch, seqlen_k, kv_heads, head_dim), the same leading
    axes (folded into batch), float16 / bfloat16 / float32 on a CUDA device. Packed sequences: q (total_q, heads,
    head_dim), k, v (total_k, kv_heads, head_dim) with int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` and the Python ints
    ``max_seqlen_q`` / ``max_seqlen_k`` (required: the offsets are device values, read by the kernels only; offsets
    that break flash-attn's rules give undefined results, as in flash-attn). ``seqused_k`` likewise. The other
    options are ``rawflash.forward``'s (``deterministic``: the backward's). Returns out like q, and with
    ``return_lse`` also lse ((..., batch, heads, seqlen_q), or (heads, total_q)) float32, whose cotangent enters
    the backward. ``sinks`` get their gradient, ``alibi_slopes`` none. v may have a head_dim below q's (MLA's
    head_dim_v): out then has it; v runs zero-padded to q's head_dim inside the jitted computation (the pad's
    gradient cuts dv back).
    """
    validation.check_flag(deterministic, "deterministic")
    validation.check_flag(return_lse, "return_lse")
    window = tuple(window) if isinstance(window, list) else window
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    lead = ()
    q4, k4, v4 = q, k, v
    if not varlen:
        q4, lead = _lead(q, 4)
        k4, lead_k = _lead(k, 4)
        v4, lead_v = _lead(v, 4)
        if lead_k != lead or lead_v != lead:
            raise ValueError(f"q, k and v must have the same leading axes, got {lead}, {lead_k}, {lead_v}")
    arrays = (alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seqused_k)
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer))):
            raise TypeError(f"{name} must be a Python int (a static value under jax.jit), got {type(x).__name__}")
    maxima = (None if max_seqlen_q is None else int(max_seqlen_q), None if max_seqlen_k is None else int(max_seqlen_k))
    shapes, dtypes = _layout(q4, k4, v4, *arrays)
    c = targets.check_forward(shapes, dtypes, (causal, scale, window, softcap) + maxima)
    targets.register()
    import jax.numpy as jnp

    hd, dv = run_head_dim(q.shape[-1]), v.shape[-1]
    opts = (bool(causal), float(c.scale), tuple(int(w) for w in window), float(softcap)) + maxima
    features = tuple(x is not None for x in arrays)
    feats = tuple(jnp.asarray(x, jnp.float32 if i < 2 else jnp.int32) for i, x in enumerate(arrays) if x is not None)
    out, lse = _differentiable(opts, features, bool(deterministic))(_pad(q4, hd), _pad(k4, hd), _pad(v4, hd), feats)
    out = out[..., :dv].reshape(q.shape[:-1] + (dv,))
    if return_lse:
        return out, (lse.reshape(tuple(lead) + (q.shape[-4],) + tuple(lse.shape[1:])) if lead else lse)
    return out


# ---------------------------------------------------------------- decode

@functools.lru_cache(maxsize=None)
def _decode_op(opts: tuple, present: tuple, splits: int, partials: int, row_groups: int):
    """``(q, k_cache, v_cache, cache_seqlens, *optional) -> (out, lse, k_cache, v_cache)``; the caches alias."""
    import jax

    def op(q, k_cache, v_cache, lens, *more):
        b, sq, h, _ = q.shape
        results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), np.float32),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
                   jax.ShapeDtypeStruct((partials,) + tuple(q.shape), np.float32),
                   jax.ShapeDtypeStruct((partials, b, h, sq), np.float32),
                   jax.ShapeDtypeStruct((max(1, row_groups),), np.int32))
        new, paged, alibi, sinks = present
        res = jax.ffi.ffi_call(targets.DECODE, results, input_output_aliases={1: 2, 2: 3})(
            q, k_cache, v_cache, lens, *more,
            **_attrs(opts, appends=new, paged=paged, alibi=alibi, sinks=sinks, num_splits=splits))
        return res[:4]

    return op


def decode(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None, causal: bool = True,
           scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
           alibi_slopes=None, sinks=None, num_splits: int | None = None, return_lse: bool = False):
    """``rawflash.decode`` on JAX arrays: attention of a few new query rows against a KV cache.

    ``cache_seqlens`` is an int32 array (batch,) (a traced value: the kernels check it on the device; a sequence
    out of range gets NaN). With ``k_new`` / ``v_new`` they are appended to the caches, which come back updated:
    returns ``(out, k_cache, v_cache)`` (``(out, lse, k_cache, v_cache)`` with ``return_lse``), written in place
    when the caller donates the caches to the jitted function (``donate_argnums``), else into XLA's copies.
    Without new keys: ``out`` (or ``(out, lse)``). The other arguments are ``rawflash.decode``'s.
    """
    import jax.numpy as jnp

    validation.check_flag(return_lse, "return_lse")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = jnp.full((q.shape[0],), cache_seqlens, jnp.int32)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise ValueError(f"num_splits must be None or an int, got {num_splits!r}")
    window = tuple(window) if isinstance(window, list) else window
    arrays = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, alibi_slopes, sinks)
    shapes, dtypes = _layout(*arrays)
    opts_in = (causal, scale, window, softcap)
    device = targets.gpu_device()
    c, plan = targets.decode_plan(shapes, dtypes, opts_in, num_splits, device)
    targets.register()
    opts = (bool(causal), float(c.scale), tuple(int(w) for w in window), float(softcap), None, None)
    targets.prepare(*targets.decode_key(device, shapes, dtypes, opts, num_splits))
    present = (k_new is not None, block_table is not None, alibi_slopes is not None, sinks is not None)
    more = [x for x in (k_new, v_new, block_table) if x is not None]
    more += [jnp.asarray(x, jnp.float32) for x in (alibi_slopes, sinks) if x is not None]
    op = _decode_op(opts, present, int(num_splits or 0), plan.partials, plan.row_groups if plan.fused else 0)
    out, lse, k_cache, v_cache = op(q, k_cache, v_cache, cache_seqlens, *more)
    head = (out, lse) if return_lse else (out,)
    if k_new is not None:
        return head + (k_cache, v_cache)
    return head if return_lse else out


__all__ = ["attention", "decode"]
