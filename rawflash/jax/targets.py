"""The GPU side of rawflash under JAX: the XLA FFI targets and the planned calls they launch.

Three custom calls: ``rawflash_forward`` (results: out, lse and a 256-byte workspace), ``rawflash_backward``
(results: dq, dk, dv, a workspace of :func:`backward_workspace_bytes` and, with sinks, the per-row terms of their
gradient) and ``rawflash_decode`` (results: out, lse, the caches aliased to the inputs, decode's partials and
counters). XLA allocates every buffer; a handler (:mod:`rawflash.jax.ffi`) zeroes what the kernels expect zeroed
on XLA's stream, writes the buffers' addresses into the call's prepacked launches (``kernels.plans.CallPlan``,
made once per signature from a template bound over stand-in arrays: :func:`plan`) and launches them on XLA's
stream, never synchronising. The handlers are registered command-buffer compatible: XLA may capture them into a
CUDA graph, where the launches are recorded once and replayed.

A plan is made when JAX traces the call on a machine with a GPU (templates bound with CuPy's memory pool off, so
their few buffers go back to the device at once), or else at the handler's first call. Its key holds the device,
the buffers' shapes and dtypes and the options, so a call that XLA lowered elsewhere finds or makes its own.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np

from .. import settings, validation
from ..kernels import configs, cupy_backend, forms
from ..kernels.cupy_backend import run_head_dim
from . import ffi

FORWARD, BACKWARD, DECODE = "rawflash_forward", "rawflash_backward", "rawflash_decode"
FORWARD_WORKSPACE = 256  # bytes: FA3's tile counter (two int32 at 0) and the REF_FIRST flag word (at 128)
_FAKE_BASE = 1 << 40  # the stand-ins' address (never read: every role gets a real address per call)
_SPAN = 256
DEFAULT_SMS = 132  # multiprocessors assumed for a decode plan made where no GPU is visible (an H100 SXM)


def _span(nbytes: int) -> int:
    return -(-nbytes // _SPAN) * _SPAN


def stand_in(shape: tuple, dtype, device: int = 0):
    """A CuPy array of ``shape`` and ``dtype`` over an address nothing reads: what validation and binding see."""
    import cupy

    dt = _dtype(dtype)
    nbytes = max(1, int(np.prod(shape)) * dt.itemsize)
    memory = cupy.cuda.UnownedMemory(_FAKE_BASE, nbytes, None, device_id=device)
    return cupy.ndarray(tuple(shape), dt, memptr=cupy.cuda.MemoryPointer(memory, 0))


def _dtype(dtype) -> np.dtype:
    """A NumPy dtype from a dtype or its name ('bfloat16' and the float8 names through ml_dtypes)."""
    if isinstance(dtype, str):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    return np.dtype(dtype)


def _stand_ins(shapes: tuple, dtypes: tuple, device: int) -> list:
    return [None if sh is None else stand_in(sh, dt, device) for sh, dt in zip(shapes, dtypes)]


FEATURES = ("alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k", "seqused_k")  # a forward's optional arrays
_VALUES = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")  # those whose values validation reads on the host


def _host_stand_in(shape: tuple, dtype):
    """A NumPy array of ``shape`` and ``dtype`` over one element (zero strides): what validation reads layouts of."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, _dtype(dtype)), tuple(shape), (0,) * len(shape))


def _offsets(shape: tuple, dtype, total: int, longest, name: str):
    """Offsets of ``shape[0] - 1`` packed sequences of at most ``longest`` rows and ``total`` in all, filled in
    order: values validation can read where the call's own are on the device (their values decide no launch)."""
    if longest is None:
        raise ValueError(f"rawflash.jax: {name} needs max_seqlen_{name[-1]} (the offsets are not read on the host)")
    if len(shape) != 1 or shape[0] < 2:
        return np.zeros(shape, _dtype(dtype))  # (validation names the shape)
    lengths, left = [], total
    for _ in range(shape[0] - 1):
        lengths.append(min(int(longest), left))
        left -= lengths[-1]
    if left:
        raise ValueError(f"{name}: {shape[0] - 1} sequences of at most {longest} rows cannot hold the {total} packed "
                         "rows")
    return np.concatenate([[0], np.cumsum(lengths)]).astype(_dtype(dtype))


def check_forward(shapes: tuple, dtypes: tuple, opts: tuple, device: int = 0):
    """rawflash's validation of a forward over stand-ins. ``shapes`` / ``dtypes``: q, k, v and the arrays of
    FEATURES (None when absent); ``opts``: causal, scale, window, softcap, max_seqlen_q, max_seqlen_k. Packed
    offsets and ``seqused_k`` are validated with values made from the shapes and the maxima (their own stay on
    the device, unread). Returns the checked call."""
    causal, scale, window, softcap, max_q, max_k = opts
    arrays = [None if sh is None else _host_stand_in(sh, dt) for sh, dt in zip(shapes[:5], dtypes[:5])]
    q, k, v, alibi, sinks = arrays
    cu_q = cu_k = used = None
    if shapes[5] is not None:
        cu_q = _offsets(shapes[5], dtypes[5], int(shapes[0][0]), max_q, "cu_seqlens_q")
    if shapes[6] is not None:
        cu_k = _offsets(shapes[6], dtypes[6], int(shapes[1][0]), max_k, "cu_seqlens_k")
    if shapes[7] is not None:
        keys = np.diff(cu_k) if cu_k is not None and len(shapes[7]) == 1 and shapes[7][0] == len(cu_k) - 1 \
            else np.full(shapes[7], shapes[1][1] if len(shapes[1]) == 4 else 0)
        used = np.asarray(keys).astype(_dtype(dtypes[7]))
    feats = validation.Features(window, softcap, alibi, sinks, cu_q, cu_k, max_q, max_k, used)
    return validation.check_forward(q, k, v, causal, scale, "fa2", "cupy", feats)


def _device_arrays(c, shapes: tuple, dtypes: tuple, device: int):
    """q, k, v as CuPy stand-ins and the checked call's feature arrays for binding: stand-ins, and the offsets
    and lengths validation saw copied to the device (a few int32)."""
    import cupy

    q, k, v = _stand_ins(shapes[:3], dtypes[:3], device)
    extras = {}
    for name, x in c.extras.items():
        extras[name] = cupy.asarray(x) if name in _VALUES else stand_in(x.shape, np.float32, device)
    return q, k, v, extras


def check_decode(shapes: tuple, dtypes: tuple, opts: tuple, device: int = 0):
    """rawflash's validation of a decode step over stand-ins. ``shapes`` / ``dtypes``: q, k_cache, v_cache,
    cache_seqlens, k_new, v_new, block_table, alibi_slopes, sinks; ``opts``: causal, scale, window, softcap (and
    the forward's maxima, unused here)."""
    causal, scale, window, softcap = opts[:4]
    q, kc, vc, lens, kn, vn, table, alibi, sinks = _stand_ins(shapes, dtypes, device)
    feats = validation.Features(window, softcap, alibi, sinks, None, None, None, None, None)
    c = validation.check_decode(q, kc, vc, lens, kn, vn, table, causal, scale, "cupy", feats)
    if c.problem.kv_dtype:
        raise TypeError("rawflash.jax.decode reads 16-bit and float32 caches; a float8_e4m3fn cache runs through "
                        "rawflash.decode (CuPy) only")
    return c, (q, kc, vc, kn, vn)


def backward_workspace_bytes(rows: int, sequences_heads: int, head_dim: int) -> int:
    """An upper bound of the backward's work buffers for ``rows`` query rows of all heads (batch x heads x seqlen_q,
    or heads x total_q when packed) and ``sequences_heads`` (batch x heads): L and D rows, float32 dQ rows, the
    sinks' per-row terms, the ordered dQ's semaphores for query blocks of 16 rows or more
    (``launch.dq_semaphores``), each rounded up as ``CallBuffers`` lays them out."""
    semaphores = -(-rows // 16) + sequences_heads
    return _span(rows * 4) * 3 + _span(rows * run_head_dim(head_dim) * 4) + _span(semaphores * 4) + _SPAN


def decode_plan(shapes: tuple, dtypes: tuple, opts: tuple, num_splits, device: int | None):
    """The decode launches' plan (splits, partials, fused combine) for a step of these shapes on ``device``'s
    multiprocessors (DEFAULT_SMS where no GPU is visible): it sizes the custom call's work buffers."""
    import cupy

    c, _ = check_decode(shapes, dtypes, opts, device or 0)
    env = settings.load()
    sms, arch, gpu = DEFAULT_SMS, env.tile_arch or "sm_90", env.tile_gpu or configs.DEFAULT_GPU
    if device is not None:
        with cupy.cuda.Device(device):
            sms, arch, gpu = cupy_backend._sms(), cupy_backend.device_arch(env), cupy_backend.device_gpu(env)
    pr = dataclasses.replace(c.problem, head_dim=run_head_dim(c.problem.head_dim), arch=arch, sms=sms, gpu=gpu)
    return c, forms.decode_plan(pr, num_splits, sms, wgmma=env.wgmma)


class Planned:
    """One signature's call for a handler: the planned launches and the roles of the frame's buffers, in order."""

    def __init__(self, call, roles_in: tuple, roles_out: tuple):
        self.call, self.roles_in, self.roles_out = call, roles_in, roles_out
        missing = set(call.plan.roles) - set(roles_in) - set(roles_out)
        if missing:
            raise ValueError(f"the planned launches need buffers {sorted(missing)} that the custom call has not")


_PLANS: dict = {}
_LOCK = threading.Lock()


def plan(key: tuple, build) -> Planned:
    """The planned call of ``key`` (kind, device, shapes, dtypes, options), made by ``build`` once, with CuPy's
    memory pool off: the template's buffers are freed to the device as soon as it is dropped."""
    planned = _PLANS.get(key)
    if planned is None:
        import cupy

        with _LOCK:
            planned = _PLANS.get(key)
            if planned is None:
                with cupy.cuda.using_allocator(None), cupy.cuda.Device(key[1]):
                    planned = _PLANS[key] = build()
    return planned


def _features_present(shapes: tuple) -> tuple:
    return tuple(n for n, s in zip(FEATURES, shapes) if s is not None)


def _forward_plan(device: int, shapes: tuple, dtypes: tuple, opts: tuple) -> Planned:
    c = check_forward(shapes, dtypes, opts, device)
    q, k, v, extras = _device_arrays(c, shapes, dtypes, device)
    env, p = settings.load(), c.problem
    out = stand_in(q.shape, q.dtype, device)
    lse = stand_in(cupy_backend._rows(p), np.float32, device)
    bound = cupy_backend.bind_forward(p, q, k, v, c.scale, "fa2", forms.Switches(), extras, env, out=out, lse=lse)
    call = cupy_backend.ForwardCall(bound, q, k, v, extras, env, out)
    if not call.out_direct or not call.as_is:
        raise ValueError("rawflash.jax: the kernels cannot read or write these buffers in place")
    return Planned(call, ("q", "k", "v") + _features_present(shapes[3:]),
                   ("o", "lse", "tile_counter", "ref_flag"))


def _backward_plan(device: int, shapes: tuple, dtypes: tuple, opts: tuple, deterministic: bool) -> Planned:
    c = check_forward(shapes, dtypes, opts, device)
    q, k, v, extras = _device_arrays(c, shapes, dtypes, device)
    env, p = settings.load(), c.problem
    dout, out = stand_in(q.shape, q.dtype, device), stand_in(q.shape, q.dtype, device)
    lse = stand_in(cupy_backend._rows(p), np.float32, device)
    grads = tuple(stand_in(x.shape, x.dtype, device) for x in (q, k, v))
    if p.seqused_k:  # the template zeroes dk and dv it is given: let it make its own (the handler zeroes XLA's)
        grads = (grads[0], None, None)
    bound = cupy_backend.bind_backward(p, dout, q, k, v, out, lse, c.scale, deterministic, extras, env,
                                       grads=grads)
    call = cupy_backend.BackwardCall(bound, (dout, q, k, v, out, lse), extras, env, grads)
    if not call.direct[0] or not call.as_is:
        raise ValueError("rawflash.jax: the kernels cannot read or write these buffers in place")
    need = backward_workspace_bytes(*row_counts(p), p.head_dim)
    if call.buffers.work_bytes > need:
        raise ValueError(f"rawflash.jax: the backward needs {call.buffers.work_bytes} B of work buffers, more than "
                         f"the {need} B the custom call has")
    return Planned(call, ("dout", "q", "k", "v", "out", "lse") + _features_present(shapes[3:]),
                   ("dq", "dk", "dv") + tuple(n for n, _ in call.buffers.work))


def row_counts(p) -> tuple[int, int]:
    """(query rows of all heads, sequences x heads) of a checked problem."""
    rows = p.heads * p.total_q if p.varlen else p.batch * p.heads * p.seqlen_q
    return rows, p.batch * p.heads


def _decode_plan(device: int, shapes: tuple, dtypes: tuple, opts: tuple, num_splits) -> Planned:
    c, (q, kc, vc, kn, vn) = check_decode(shapes, dtypes, opts, device)
    env, p = settings.load(), c.problem
    out = stand_in(q.shape, q.dtype, device)
    lse = stand_in((p.batch, p.heads, p.seqlen_q), np.float32, device)
    bound = cupy_backend.bind_decode(p, q, kc, vc, kn, vn, c.scale, num_splits, c.extras, env, out=out, lse=lse)
    call = cupy_backend.DecodeCall(bound, (q, kc, vc, kn, vn), c.extras, env, out)
    if not call.out_direct or not call.as_is:
        raise ValueError("rawflash.jax: the kernels cannot read or write these buffers in place")
    roles_in = ("q", "k", "v", "seqused_k") + (("k_new", "v_new") if kn is not None else ()) \
        + (("block_table",) if shapes[6] is not None else ()) + _features_present(shapes[7:])
    return Planned(call, roles_in, ("o", "lse", "o_ws", "m_ws", "decode_counters"))


# ---------------------------------------------------------------- the handlers

def options(attrs: dict) -> tuple:
    """(causal, scale, window, softcap, max_seqlen_q, max_seqlen_k) from a custom call's attributes (scale 0: the
    default; a maximum 0: not given)."""
    scale = attrs["scale"]
    return (bool(attrs["causal"]), None if scale == 0.0 else float(scale),
            (int(attrs["window_left"]), int(attrs["window_right"])), float(attrs["softcap"]),
            int(attrs.get("max_seqlen_q", 0)) or None, int(attrs.get("max_seqlen_k", 0)) or None)


def _flags(attrs: dict) -> tuple:
    """Which of FEATURES a forward or backward call has, from its attributes."""
    return (attrs["alibi"], attrs["sinks"], attrs.get("varlen", False), attrs.get("varlen", False),
            attrs.get("seqused", False))


def _optional(args: list, present: tuple) -> tuple[list, list]:
    """Shapes and dtypes of optional arguments, in order: a present one takes the next of ``args``."""
    shapes, dtypes, i = [], [], 0
    for flag in present:
        if flag:
            shapes.append(args[i].shape), dtypes.append(args[i].dtype)
            i += 1
        else:
            shapes.append(None), dtypes.append(None)
    return shapes, dtypes


def _forward_target(frame) -> None:
    import cupy

    attrs, args = frame.attrs, frame.args
    extra_shapes, extra_dtypes = _optional(args[3:], _flags(attrs))
    shapes = tuple([a.shape for a in args[:3]] + extra_shapes)
    dtypes = tuple([a.dtype for a in args[:3]] + extra_dtypes)
    opts, device = options(attrs), max(frame.device, 0)
    planned = plan(("fwd", device, shapes, dtypes, opts), lambda: _forward_plan(device, shapes, dtypes, opts))
    ptrs = {r: b.ptr for r, b in zip(planned.roles_in, args)}
    out, lse, ws = frame.rets
    ptrs["o"], ptrs["lse"], ptrs["tile_counter"], ptrs["ref_flag"] = out.ptr, lse.ptr, ws.ptr, ws.ptr + 128
    cupy.cuda.runtime.memsetAsync(ws.ptr, 0, FORWARD_WORKSPACE, frame.stream)
    ints = {"ref_gen": 1} if planned.call.checks_ref else {}  # the flag word is zero at every call
    planned.call.plan.run(ptrs, ints, frame.stream)


def _backward_target(frame) -> None:
    attrs, args = frame.attrs, frame.args
    extra_shapes, extra_dtypes = _optional(args[6:], _flags(attrs))
    shapes = tuple([a.shape for a in args[1:4]] + extra_shapes)
    dtypes = tuple([a.dtype for a in args[1:4]] + extra_dtypes)
    opts, deterministic, device = options(attrs), bool(attrs["deterministic"]), max(frame.device, 0)
    planned = plan(("bwd", device, shapes, dtypes, opts, deterministic),
                   lambda: _backward_plan(device, shapes, dtypes, opts, deterministic))
    ptrs = {r: b.ptr for r, b in zip(planned.roles_in, args)}
    rets = frame.rets
    ptrs["dq"], ptrs["dk"], ptrs["dv"] = rets[0].ptr, rets[1].ptr, rets[2].ptr
    planned.call.buffers.place(ptrs, rets[3].ptr, frame.stream)
    if attrs["sinks"]:
        ptrs["dsink_ws"] = rets[4].ptr
    if planned.call.zero_kv:  # keys past seqused_k are never written: their gradients are zero
        import cupy

        for ret in rets[1:3]:
            nbytes = int(np.prod(ret.shape)) * _dtype(ret.dtype).itemsize
            cupy.cuda.runtime.memsetAsync(ret.ptr, 0, nbytes, frame.stream)
    planned.call.plan.run(ptrs, {}, frame.stream)


def _decode_target(frame) -> None:
    import cupy

    attrs, args = frame.attrs, frame.args
    new = bool(attrs["appends"])
    shapes, dtypes = [a.shape for a in args[:4]], [a.dtype for a in args[:4]]
    rest = args[4:]
    more_shapes, more_dtypes = _optional(rest, (new, new, attrs["paged"], attrs["alibi"], attrs["sinks"]))
    shapes, dtypes = tuple(shapes + more_shapes), tuple(dtypes + more_dtypes)
    opts, device = options(attrs), max(frame.device, 0)
    splits = int(attrs["num_splits"]) or None
    planned = plan(("decode", device, shapes, dtypes, opts, splits),
                   lambda: _decode_plan(device, shapes, dtypes, opts, splits))
    ptrs = {r: b.ptr for r, b in zip(planned.roles_in, args)}
    out, lse, _, _, o_ws, m_ws, counters = frame.rets  # (the caches alias k_cache and v_cache)
    fixed = planned.call.decode_plan
    if o_ws.shape[0] < fixed.partials:
        raise ValueError(f"rawflash.jax.decode: the plan has {fixed.partials} partials a row and the custom call "
                         f"room for {o_ws.shape[0]} (traced for another GPU?): trace it again here")
    ptrs.update(o=out.ptr, lse=lse.ptr, o_ws=o_ws.ptr, m_ws=m_ws.ptr, decode_counters=counters.ptr)
    cupy.cuda.runtime.memsetAsync(counters.ptr, 0, 4 * int(np.prod(counters.shape)), frame.stream)
    planned.call.plan.run(ptrs, {}, frame.stream)


def register() -> None:
    """The three targets, registered once per process (command-buffer compatible)."""
    ffi.register(FORWARD, _forward_target, platform="CUDA", command_buffer=True)
    ffi.register(BACKWARD, _backward_target, platform="CUDA", command_buffer=True)
    ffi.register(DECODE, _decode_target, platform="CUDA", command_buffer=True)


def gpu_device() -> int | None:
    """The CUDA device JAX computes on by default, or None where CuPy sees no GPU (plans wait for the handler)."""
    try:
        import cupy

        if not cupy.cuda.is_available():
            return None
        import jax

        device = jax.config.jax_default_device or jax.devices()[0]
        return int(device.id) if device.platform == "gpu" else None
    except Exception:
        return None


def prepare(key: tuple, build) -> None:
    """Makes the plan of ``key`` now when a GPU is visible (at trace time, outside any graph capture)."""
    if key[1] is not None:
        plan(key, build)


def forward_key(device, shapes, dtypes, opts):
    return ("fwd", device, shapes, dtypes, opts), lambda: _forward_plan(device, shapes, dtypes, opts)


def backward_key(device, shapes, dtypes, opts, deterministic):
    return (("bwd", device, shapes, dtypes, opts, deterministic),
            lambda: _backward_plan(device, shapes, dtypes, opts, deterministic))


def decode_key(device, shapes, dtypes, opts, splits):
    return ("decode", device, shapes, dtypes, opts, splits), lambda: _decode_plan(device, shapes, dtypes, opts, splits)
