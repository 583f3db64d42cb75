"""rawflash's forward and backward inside ``jax.jit``: XLA FFI custom calls that launch the planned kernels.

``attention(q, k, v, ...)`` is a ``jax.custom_vjp``: its forward is the custom call ``rawflash_forward`` (results:
out, lse and a 256-byte workspace), its backward ``rawflash_backward`` (results: dq, dk, dv, a workspace sized by
:func:`backward_workspace_bytes` and, with sinks, the per-row terms of their gradient, summed here in JAX). XLA
allocates every buffer; the handlers (:mod:`rawflash.jax.ffi`) zero what the kernels expect zeroed on XLA's stream,
write the buffers' addresses into the call's prepacked launches (``kernels.plans.CallPlan``, made once per
signature from a template bound over stand-in arrays) and launch them on XLA's stream, never synchronising. The
handlers are registered command-buffer compatible: XLA may capture them into a CUDA graph.

Arguments are checked when JAX traces the call, by rawflash's own validation over stand-in CuPy arrays of the same
shapes and dtypes (the same errors as ``rawflash.forward``, before anything runs). Inputs are q, k, v of one
fixed length each (batch, seqlen, heads, head_dim), float16 / bfloat16 / float32; a head_dim that is not a multiple
of 8 is padded here with zeros (and the result cut back).
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from .. import settings, validation
from ..kernels import cupy_backend, forms
from ..kernels.cupy_backend import run_head_dim
from . import ffi

FORWARD, BACKWARD = "rawflash_forward", "rawflash_backward"
FORWARD_WORKSPACE = 256  # bytes: FA3's tile counter (two int32 at 0) and the REF_FIRST flag word (at 128)
_FAKE_BASE = 1 << 40  # stand-in arrays' address (never read: every role gets a real address per call)
_SPAN = 256


def _span(nbytes: int) -> int:
    return -(-nbytes // _SPAN) * _SPAN


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(dtype)


def _stand_in(shape: tuple, dtype, device: int = 0):
    """A CuPy array of ``shape`` and ``dtype`` over an address nothing reads: what validation and binding see."""
    import cupy

    dt = _np_dtype(dtype)
    nbytes = max(1, int(np.prod(shape)) * dt.itemsize)
    memory = cupy.cuda.UnownedMemory(_FAKE_BASE, nbytes, None, device_id=device)
    return cupy.ndarray(tuple(shape), dt, memptr=cupy.cuda.MemoryPointer(memory, 0))


@functools.lru_cache(maxsize=None)
def _features(window: tuple, softcap: float) -> validation.Features:
    return validation.Features(window, softcap, None, None, None, None, None, None, None)


def _check(shapes: tuple, dtypes: tuple, opts: tuple, device: int = 0):
    """rawflash's validation of a forward over stand-ins: shapes, dtypes of q, k, v, alibi_slopes, sinks (None when
    absent) and the options (causal, scale, window, softcap)."""
    causal, scale, window, softcap = opts
    q, k, v, alibi, sinks = (None if s is None else _stand_in(s, d, device) for s, d in zip(shapes, dtypes))
    feats = validation.Features(window, softcap, alibi, sinks, None, None, None, None, None)
    return validation.check_forward(q, k, v, causal, scale, "fa2", "cupy", feats), (q, k, v)


def backward_workspace_bytes(batch: int, seqlen_q: int, heads: int, head_dim: int) -> int:
    """An upper bound of the backward's work buffers (L and D rows, float32 dQ rows, the sinks' per-row terms, the
    ordered dQ's semaphores for query blocks of 16 rows or more: ``launch.dq_semaphores``), each rounded up as
    ``CallBuffers`` lays them out."""
    rows = batch * heads * seqlen_q
    semaphores = -(-rows // 16) + batch * heads
    return (_span(rows * 4) * 3 + _span(rows * run_head_dim(head_dim) * 4) + _span(semaphores * 4)) + _SPAN


class _Planned:
    """One signature's call for the FFI handlers: the planned launches and the order of the frame's buffers."""

    def __init__(self, call, roles_in: tuple, roles_out: tuple, extra=None):
        self.call, self.roles_in, self.roles_out, self.extra = call, roles_in, roles_out, extra
        missing = set(call.plan.roles) - set(roles_in) - set(roles_out) - set(extra or ())
        if missing:
            raise ValueError(f"the planned launches need buffers {sorted(missing)} that the custom call has not")


_PLANS: dict = {}
_LOCK = threading.Lock()


def _planned(key: tuple, build):
    plan = _PLANS.get(key)
    if plan is None:
        with _LOCK:
            plan = _PLANS.get(key)
            if plan is None:
                plan = _PLANS[key] = build()
    return plan


def _forward_plan(device: int, shapes: tuple, dtypes: tuple, opts: tuple) -> _Planned:
    import cupy

    with cupy.cuda.Device(device):
        c, (q, k, v) = _check(shapes, dtypes, opts, device)
        env = settings.load()
        out, lse = _stand_in(q.shape, q.dtype, device), _stand_in((c.problem.batch, c.problem.heads,
                                                                   c.problem.seqlen_q), np.float32, device)
        bound = cupy_backend.bind_forward(c.problem, q, k, v, c.scale, "fa2", forms.Switches(), c.extras, env,
                                          out=out, lse=lse)
        call = cupy_backend.ForwardCall(bound, q, k, v, c.extras, env, out)
    if not call.out_direct or not call.as_is:
        raise ValueError("rawflash.jax: the kernels cannot read or write these buffers in place")
    roles_in = ("q", "k", "v") + tuple(n for n, s in zip(("alibi_slopes", "sinks"), shapes[3:]) if s is not None)
    return _Planned(call, roles_in, ("o", "lse"), extra=("tile_counter", "ref_flag"))


def _backward_plan(device: int, shapes: tuple, dtypes: tuple, opts: tuple, deterministic: bool) -> _Planned:
    import cupy

    with cupy.cuda.Device(device):
        c, (q, k, v) = _check(shapes, dtypes, opts, device)
        env = settings.load()
        p = c.problem
        dout, out = _stand_in(q.shape, q.dtype, device), _stand_in(q.shape, q.dtype, device)
        lse = _stand_in((p.batch, p.heads, p.seqlen_q), np.float32, device)
        grads = tuple(_stand_in(x.shape, x.dtype, device) for x in (q, k, v))
        bound = cupy_backend.bind_backward(p, dout, q, k, v, out, lse, c.scale, deterministic, c.extras, env,
                                           grads=grads)
        call = cupy_backend.BackwardCall(bound, (dout, q, k, v, out, lse), c.extras, env, grads)
    if not all(call.direct) or not call.as_is:
        raise ValueError("rawflash.jax: the kernels cannot read or write these buffers in place")
    need = backward_workspace_bytes(p.batch, p.seqlen_q, p.heads, p.head_dim)
    if call.buffers.work_bytes > need:
        raise ValueError(f"rawflash.jax: the backward needs {call.buffers.work_bytes} B of work buffers, more than "
                         f"the {need} B the custom call has")
    roles_in = ("dout", "q", "k", "v", "out", "lse") + tuple(n for n, s in zip(("alibi_slopes", "sinks"), shapes[3:])
                                                            if s is not None)
    return _Planned(call, roles_in, ("dq", "dk", "dv"), extra=tuple(n for n, _ in call.buffers.work))


def _options(attrs: dict) -> tuple:
    scale = attrs["scale"]
    return (bool(attrs["causal"]), None if scale == 0.0 else float(scale),
            (int(attrs["window_left"]), int(attrs["window_right"])), float(attrs["softcap"]))


def _frame_shapes(frame, first: int, attrs: dict) -> tuple:
    """(shapes, dtypes) of q, k, v, alibi_slopes, sinks from the frame's arguments starting at ``first``."""
    args = frame.args[first:]
    shapes, dtypes = [a.shape for a in args[:3]], [a.dtype for a in args[:3]]
    i = 3
    for name in ("alibi", "sinks"):
        if attrs[name]:
            shapes.append(args[i].shape), dtypes.append(args[i].dtype)
            i += 1
        else:
            shapes.append(None), dtypes.append(None)
    return tuple(shapes), tuple(dtypes)


def _forward_target(frame) -> None:
    import cupy

    attrs = frame.attrs
    shapes, dtypes = _frame_shapes(frame, 0, attrs)
    opts = _options(attrs)
    device = max(frame.device, 0)
    planned = _planned(("fwd", device, shapes, dtypes, opts), lambda: _forward_plan(device, shapes, dtypes, opts))
    ptrs = {r: b.ptr for r, b in zip(planned.roles_in, frame.args)}
    out, lse, ws = frame.rets
    ptrs["o"], ptrs["lse"] = out.ptr, lse.ptr
    ptrs["tile_counter"], ptrs["ref_flag"] = ws.ptr, ws.ptr + 128
    cupy.cuda.runtime.memsetAsync(ws.ptr, 0, FORWARD_WORKSPACE, frame.stream)
    ints = {"ref_gen": 1} if planned.call.checks_ref else {}  # the flag word is zero at every call
    planned.call.plan.run(ptrs, ints, frame.stream)


def _backward_target(frame) -> None:
    attrs = frame.attrs
    shapes, dtypes = _frame_shapes(frame, 1, {**attrs, "alibi": attrs["alibi"], "sinks": attrs["sinks"]})
    shapes = (shapes[0], shapes[1], shapes[2], shapes[3], shapes[4])
    opts, deterministic = _options(attrs), bool(attrs["deterministic"])
    device = max(frame.device, 0)
    planned = _planned(("bwd", device, shapes, dtypes, opts, deterministic),
                       lambda: _backward_plan(device, shapes, dtypes, opts, deterministic))
    ptrs = {r: b.ptr for r, b in zip(planned.roles_in, frame.args)}
    rets = frame.rets
    ptrs["dq"], ptrs["dk"], ptrs["dv"] = rets[0].ptr, rets[1].ptr, rets[2].ptr
    planned.call.buffers.place(ptrs, rets[3].ptr, frame.stream)
    if attrs["sinks"]:
        ptrs["dsink_ws"] = rets[4].ptr
    planned.call.plan.run(ptrs, {}, frame.stream)


def _register() -> None:
    ffi.register(FORWARD, _forward_target, platform="CUDA", command_buffer=True)
    ffi.register(BACKWARD, _backward_target, platform="CUDA", command_buffer=True)


# ---------------------------------------------------------------- the JAX side

def _attrs(cfg: tuple) -> dict:
    causal, scale, window, softcap, deterministic, alibi, sinks = cfg
    return {"causal": bool(causal), "scale": np.float64(0.0 if scale is None else scale),
            "window_left": np.int64(window[0]), "window_right": np.int64(window[1]), "softcap": np.float64(softcap),
            "alibi": bool(alibi), "sinks": bool(sinks), "deterministic": bool(deterministic)}


def _pad(x, hd: int):
    import jax.numpy as jnp

    d = x.shape[-1]
    return x if d == hd else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, hd - d)])


def _forward_call(q, k, v, alibi, sinks, cfg):
    import jax

    b, sq, h, _ = q.shape
    operands = [q, k, v] + [x for x in (alibi, sinks) if x is not None]
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), np.float32),
               jax.ShapeDtypeStruct((FORWARD_WORKSPACE,), np.uint8))
    out, lse, _ = jax.ffi.ffi_call(FORWARD, results, vmap_method="sequential")(*operands, **_attrs(cfg))
    return out, lse


def _backward_call(dout, q, k, v, out, lse, alibi, sinks, cfg):
    import jax

    b, sq, h, d = q.shape
    operands = [dout, q, k, v, out, lse] + [x for x in (alibi, sinks) if x is not None]
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((backward_workspace_bytes(b, sq, h, d),), np.uint8)]
    if sinks is not None:
        results.append(jax.ShapeDtypeStruct((b, h, sq), np.float32))
    res = jax.ffi.ffi_call(BACKWARD, tuple(results), vmap_method="sequential")(*operands, **_attrs(cfg))
    dsinks = None if sinks is None else -res[4].sum(axis=(0, 2))
    return res[0], res[1], res[2], dsinks


@functools.lru_cache(maxsize=None)
def _vjp_function():
    """The custom_vjp over padded inputs (made once, when JAX is first needed)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
    def core(q, k, v, alibi, sinks, cfg):
        return _forward_call(q, k, v, alibi, sinks, cfg)

    def core_fwd(q, k, v, alibi, sinks, cfg):
        out, lse = _forward_call(q, k, v, alibi, sinks, cfg)
        return (out, lse), (q, k, v, alibi, sinks, out, lse)

    def core_bwd(cfg, saved, cotangents):
        q, k, v, alibi, sinks, out, lse = saved
        dout, _ = cotangents  # lse leaves attention() through stop_gradient: its cotangent is zero
        dq, dk, dv, dsinks = _backward_call(dout.astype(q.dtype), q, k, v, out, lse, alibi, sinks, cfg)
        dalibi = None if alibi is None else jnp.zeros_like(alibi)
        return dq, dk, dv, dalibi, dsinks

    core.defvjp(core_fwd, core_bwd)
    return core


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, window: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, alibi_slopes=None, sinks=None, deterministic: bool = False,
              return_lse: bool = False):
    """Exact attention on JAX arrays, usable eagerly and under ``jax.jit``, differentiable (``jax.grad``,
    ``jax.vjp``) through a ``jax.custom_vjp`` whose backward is rawflash's.

    q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim), float16 / bfloat16 /
    float32 on a CUDA device; the options are ``rawflash.forward``'s (``deterministic``: the backward's). With
    ``return_lse``: (out, lse), lse (batch, heads, seqlen_q) float32 behind ``jax.lax.stop_gradient`` (gradients
    flow through out only). ``sinks`` get their gradient; ``alibi_slopes`` do not (zero).
    Arguments are checked when JAX traces the call, with ``rawflash.forward``'s messages.
    """
    import jax.numpy as jnp

    window = tuple(window) if isinstance(window, list) else window
    shapes = tuple(None if x is None else tuple(x.shape) for x in (q, k, v, alibi_slopes, sinks))
    dtypes = tuple(None if x is None else _np_dtype(x.dtype) for x in (q, k, v, alibi_slopes, sinks))
    validation.check_flag(deterministic, "deterministic")
    validation.check_flag(return_lse, "return_lse")
    c, _ = _check(shapes, dtypes, (causal, scale, window, softcap))
    if c.problem.varlen:
        raise ValueError("rawflash.jax.attention takes fixed-length q, k, v (no cu_seqlens)")
    _register()
    d = q.shape[-1]
    hd = run_head_dim(d)
    cfg = (bool(causal), float(c.scale), tuple(int(w) for w in window), float(softcap), bool(deterministic),
           alibi_slopes is not None, sinks is not None)
    alibi = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
    sink = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    out, lse = _vjp_function()(_pad(q, hd), _pad(k, hd), _pad(v, hd), alibi, sink, cfg)
    out = out if hd == d else out[..., :d]
    if return_lse:
        import jax

        return out, jax.lax.stop_gradient(lse)
    return out


__all__ = ["attention", "backward_workspace_bytes", "FORWARD", "BACKWARD"]
