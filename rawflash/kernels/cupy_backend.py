"""The CUDA C backend: prepares CuPy arrays, allocates outputs and work buffers, binds them into the parameter
struct and runs the plan ``forms.py`` chose.

Every grid, block and shared-memory size comes from ``launch.py`` (through the plan); every field of the
parameter structs from ``params.py``; this module only binds arrays to them.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np

from ..arrays import kernel_ready, pad_head_dim
from ..problem import Problem
from ..settings import Settings
from . import compile, configs, forms, launch, params, tma
from .launch import Launch

HEAD_DIM_MULTIPLE = 8  # the kernels move head_dim in 16-byte chunks and store pairs: other sizes are zero-padded


def run_head_dim(head_dim: int) -> int:
    """The head_dim the kernels see: the caller's, rounded up to a multiple of 8 (padding copies the inputs)."""
    return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def device_arch(env: Settings = Settings()) -> str:
    """'sm_90' for an H100 / H200, 'sm_80' for an A100, ... (the current CuPy device), which picks the forms and
    tile rows. ``RAWFLASH_TILE_ARCH=sm_80`` (``env.tile_arch``) makes a GPU use another architecture's forms and
    rows (the code is still compiled for the GPU at hand): how the sm_80 rows are tested on an H200."""
    import cupy

    return env.tile_arch or f"sm_{cupy.cuda.Device().compute_capability}"


def device_gpu(env: Settings = Settings()) -> str:
    """The tuned GPU whose rows and gates the current device takes ('h100' or 'h200': configs.gpu_name, from its
    arch and L2 size). ``RAWFLASH_TILE_GPU`` (``env.tile_gpu``) names one instead: how one GPU runs the other's
    choices."""
    if env.tile_gpu:
        if env.tile_gpu not in configs.TUNED_GPUS:
            raise ValueError(f"RAWFLASH_TILE_GPU must be one of {', '.join(configs.TUNED_GPUS)}, "
                             f"got {env.tile_gpu!r}")
        return env.tile_gpu
    import cupy

    return configs.gpu_name(device_arch(env), _l2_bytes(cupy.cuda.runtime.getDevice()))


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_id: int) -> int:
    """The L2 size of a device in bytes (asked once per device)."""
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrL2CacheSize, device_id))


@functools.lru_cache(maxsize=None)
def _smem_optin(device_id: int) -> int:
    """The opt-in shared memory per block of a device (asked once: Device.attributes queries every attribute,
    tens of microseconds that a decode step would otherwise pay per launch)."""
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                    device_id))


def kernel_handle(lau: Launch, env: Settings = Settings()):
    """The compiled kernel of a launch (``cupy.RawKernel``), its dynamic shared-memory limit raised to the launch's;
    a ValueError when the GPU cannot give that much."""
    import cupy

    limit = _smem_optin(cupy.cuda.runtime.getDevice())
    if lau.smem > limit:
        raise ValueError(f"{lau.name_expression} needs {lau.smem} B of shared memory per block and this GPU allows "
                         f"{limit} B: its tile row in rawflash/kernels/configs.py does not fit this GPU")
    fn = compile.get_kernel(lau.source, lau.name_expression, lau.target, env.cuda_dir)
    if lau.smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < lau.smem:
        fn.max_dynamic_shared_size_bytes = lau.smem
    return fn


def run(lau: Launch, args: tuple, env: Settings = Settings()) -> None:
    """Launch one kernel on CuPy's current stream (CuPy packs the arguments)."""
    kernel_handle(lau, env)(lau.grid, lau.block, args, shared_mem=lau.smem)


@dataclasses.dataclass
class Prepared:
    """Inputs ready for the kernels and the problem they run as (head_dim possibly padded, the GPU's arch), with the
    caller's head dims of q and of v (which the results are cut back to)."""

    problem: Problem
    arrays: tuple
    head_dim: int
    extras: dict
    value_head_dim: int  # v's (and out's, dv's): MLA's head_dim_v, or head_dim


def run_problem(p: Problem, env: Settings, value_form: bool = False) -> Problem:
    """The problem as the kernels see it: q's head_dim rounded up to a multiple of 8, the GPU's arch, SMs and gates.
    MLA's narrower v keeps a head_dim_v of its own (rounded likewise) only with ``value_form`` (FA3's DV form reads
    v at it: ``forms.reads_value_head_dim``); otherwise v is zero-padded to q's and head_dim_v is 0."""
    hd_v = run_head_dim(p.head_dim_v) if value_form and p.head_dim_v else 0
    return dataclasses.replace(p, head_dim=run_head_dim(p.head_dim), head_dim_v=hd_v, arch=device_arch(env),
                               sms=_sms(), gpu=device_gpu(env))


def prepare(p: Problem, extras: dict, env: Settings, *arrays, value_form: bool = False) -> Prepared:
    """The arrays (q, k, then v and in the backward dout and out) at the kernels' head dims: every array zero-padded
    to q's run head_dim (v, dout and out of MLA's narrower head_dim_v too: zero columns of V give zero columns of O
    and dV and add nothing to dP or D, so the padded problem's results, cut back, are the call's), except, with
    ``value_form``, the arrays after q and k, which the DV form reads at v's own run head_dim."""
    pr = run_problem(p, env, value_form)
    widths = [pr.head_dim] * len(arrays)
    if pr.head_dim_v:
        widths[2:] = [pr.head_dim_v] * (len(arrays) - 2)
    ready = tuple(_ready(x, w, 16 // np.dtype(x.dtype).itemsize) for x, w in zip(arrays, widths))
    return Prepared(pr, ready, p.head_dim, _feature_arrays(extras), p.value_head_dim)


def _feature_arrays(extras: dict) -> dict:
    """The call's feature arrays on the device, contiguous, as the kernels read them: float32 ALiBi slopes and
    sinks, int32 for the rest (cu_seqlens_q / _k, seqused_k, ...)."""
    import cupy

    dtypes = {"alibi_slopes": np.float32, "sinks": np.float32, "k_descale": np.float32, "v_descale": np.float32}
    return {name: cupy.ascontiguousarray(cupy.asarray(x), dtype=dtypes.get(name, np.int32))
            for name, x in extras.items()}


def _trim(x, head_dim: int):
    import cupy

    return x if x.shape[-1] == head_dim else cupy.ascontiguousarray(x[..., :head_dim])


def _rows(pr: Problem, *tail):
    """The shape of a per-row float32 buffer (lse, L, D; with tail, e.g. dQ's float32 accumulator)."""
    b, s = pr.rows
    return (pr.heads, s, *tail) if pr.varlen else (b, pr.heads, s, *tail)


@dataclasses.dataclass
class Bound:
    """A call bound to its buffers: ``launch()`` queues the plan's kernels (nothing else: no allocation, no copy),
    ``result()`` returns what the call returns. The public functions are bind, launch, result; the benchmark
    times ``launch`` alone as the kernels' own time."""

    plan: list
    launches: list  # (Launch, args) in order
    outputs: tuple
    env: Settings
    reset: list = dataclasses.field(default_factory=list)  # buffers a launch expects zeroed
    problem: Problem | None = None  # as the kernels see it (head_dim padded, the GPU's arch)

    def launch(self) -> None:
        for x in self.reset:
            x.fill(0)
        for lau, args in self.launches:
            run(lau, args, self.env)

    def result(self):
        return _results(self.outputs)


def _ready(x, hd: int, chunk: int):
    """An input as the kernels read it: head_dim padded to ``hd`` and a kernel-ready layout (a copy only if needed)."""
    import cupy

    return kernel_ready(pad_head_dim(cupy.asarray(x), hd), chunk)


def forward_buffers(pr: Problem, first: Launch, q, out=None, lse=None) -> dict:
    """A forward call's per-call buffers, by the parameter struct's field names: its outputs ``o`` (the caller's
    ``out`` when given; v's run head_dim, q's unless the DV form) and ``lse`` (likewise), fa1's work rows, FA3's
    tile counter and the REF_FIRST flag word with this call's number (``ref_gen``). The template (``bind_forward``)
    makes them here; its planned calls replay their layout (:class:`CallBuffers`)."""
    import cupy

    o_shape = (*q.shape[:-1], pr.value_head_dim)
    bufs = {"o": cupy.empty(o_shape, dtype=q.dtype) if out is None else out,
            "lse": cupy.empty(_rows(pr), dtype=cupy.float32) if lse is None else lse}
    if first.kernel == "fa1_fwd":
        bufs.update(o_ws=cupy.zeros(_rows(pr, pr.head_dim), dtype=cupy.float32),
                    m_ws=cupy.full(_rows(pr), -np.inf, dtype=cupy.float32),
                    l_ws=cupy.zeros(_rows(pr), dtype=cupy.float32))
    if first.kernel == "fa3_fwd_sm90":
        bufs["tile_counter"] = tile_counter()
    if forms.checks_ref(first):  # the first block's reference, checked; the plan's next launch is its way back
        bufs["ref_flag"], bufs["ref_gen"] = ref_flag(), next_ref_gen()
    return bufs


def _writes_in_place(out, run_dim: int, chunk: int) -> bool:
    """Whether the kernels can write the caller's ``out`` directly: its head_dim is the one they run (nothing to cut
    back) and its layout is kernel-ready."""
    return out is not None and out.shape[-1] == run_dim and kernel_ready(out, chunk) is out


def bind_forward(p: Problem, q, k, v, scale: float, kernel: str = "fa2", switches: forms.Switches = forms.Switches(),
                 extras: dict | None = None, env: Settings = Settings(), override: forms.Override | None = None,
                 out=None, lse=None) -> Bound:
    """Allocate the forward's outputs (or take ``out`` / ``lse``) and bind them; ``override`` (tools/tune.py)
    replaces tile rows. The plan comes first: it decides whether v is read at its own head_dim (FA3's DV form) or
    zero-padded to q's."""
    extras = extras or {}
    plan = forms.forward_plan(run_problem(p, env, value_form=True), kernel, switches, env, override)
    try:
        return _bind_forward_plan(p, plan, q, k, v, scale, extras, env, out, lse)
    except tma.TmaUnavailable:  # e.g. a stride TMA cannot express: every thread copies instead
        if switches.warp_specialize:
            raise
        plan = forms.forward_plan_without_tma(run_problem(p, env), kernel, switches, env, override)
        return _bind_forward_plan(p, plan, q, k, v, scale, extras, env, out, lse)


def _bind_forward_plan(p: Problem, plan: list, q, k, v, scale: float, extras: dict, env: Settings, out,
                       lse) -> Bound:
    """bind_forward for a chosen plan (TmaUnavailable where FA3's maps cannot describe the arrays)."""
    prep = prepare(p, extras, env, q, k, v, value_form=forms.reads_value_head_dim(plan[0]))
    pr, (q, k, v) = prep.problem, prep.arrays
    if plan[0].kernel == "naive_softmax":
        import cupy

        return _bind_naive(pr, q, k, v, scale, cupy.empty(_rows(pr), dtype=cupy.float32), plan, prep, env)
    direct = _writes_in_place(out, pr.value_head_dim, 16 // q.dtype.itemsize)
    first = plan[0]
    bufs = forward_buffers(pr, first, q, out if direct else None, lse)
    rec = params.fwd_params(pr, q, k, v, bufs["o"], bufs["lse"], scale, **prep.extras,
                            **{n: x for n, x in bufs.items() if n not in ("o", "lse")})
    args = (rec,)
    if first.kernel == "fa3_fwd_sm90":
        args = (rec, tma.fwd_maps(q, k, v, bufs["o"], first.config.br, first.config.bc, pr.varlen, pr.page_size))
    bound = Bound(plan, [(lau, args) for lau in plan], (_Trimmed(bufs["o"], prep.value_head_dim), bufs["lse"]),
                  env, problem=pr)
    bound.roles = _roles(dict(q=q, k=k, v=v), prep.extras, bufs)
    bound.keep = (q, k, v, prep.extras, bufs)  # the parameter struct holds their addresses
    bound.bufs = bufs
    bound.widths = tuple(int(x.shape[-1]) for x in (q, k, v))  # the head dims the kernels read q, k, v at
    return bound


def _roles(*named: dict) -> dict:
    """The arrays of a bound call by the parameter fields that hold their addresses (ints left out)."""
    return {n: x for d in named for n, x in d.items() if x is not None and x.__class__ is not int}


CAPTURED: list = []  # the buffers of every planned call made while its stream captured a CUDA graph
_CHUNK = 256  # bytes: each buffer cut from a call's allocation starts on a multiple (CuPy's own granularity)


def _span(nbytes: int) -> int:
    return -(-nbytes // _CHUNK) * _CHUNK


class CallBuffers:
    """How every call of a plan makes its buffers, laid out once from its template's (``forward_buffers``,
    ``backward_buffers`` and ``decode_buffers`` decide which buffers a call has and their sizes). Per call: the
    outputs the caller did not give are cut from one allocation (they are freed together, when the last of them
    is), the work buffers from one more, zeroed where a kernel expects zeros (one ``memsetAsync`` each); the
    buffers kept per stream (tile counters, the REF_FIRST flag, decode's partials) are looked up once per stream.
    Memory comes from CuPy's pool on the current stream, so a buffer freed after the call is reused only by work
    queued after the call's kernels."""

    def __init__(self, bufs: dict, outputs: tuple, per_stream, zeroed: tuple = (), views: tuple = ()):
        self.outputs = [(n, tuple(bufs[n].shape), bufs[n].dtype, _span(bufs[n].nbytes)) for n in outputs]
        self.per_stream = per_stream  # () -> {name: array} of the current stream
        self.stream_names = tuple(per_stream()) if per_stream is not None else ()
        work = [n for n in bufs if n not in outputs and n not in self.stream_names]
        self.work, offset = [], 0
        for n in work:
            self.work.append((n, offset))
            offset += _span(bufs[n].nbytes)
        self.work_bytes = offset
        offsets = dict(self.work)
        self.zero = [(offsets[n], bufs[n].nbytes) for n in zeroed if n in offsets]
        self.views = [(n, offsets[n], tuple(bufs[n].shape), bufs[n].dtype) for n in views if n in offsets]
        self._streams: dict = {}

    def _stream(self, stream: int) -> tuple:
        fixed = self._streams.get(stream)
        if fixed is None:
            arrays = self.per_stream() if self.per_stream is not None else {}
            fixed = self._streams[stream] = ({n: x.data.ptr for n, x in arrays.items()}, arrays)
        return fixed

    def make(self, ptrs: dict, stream: int, given: dict) -> tuple[dict, tuple]:
        """Adds the call's buffer addresses to ``ptrs``; returns its outputs by name (the given ones as given, the
        others new) and what must stay alive while its kernels run."""
        import cupy

        ptrs.update(self._stream(stream)[0])
        made = {}
        need = 0
        for n, _, _, span in self.outputs:
            x = given.get(n)
            if x is None:
                need += span
            else:
                made[n] = x
        out_mem = work_mem = None
        if need:
            out_mem = cupy.cuda.alloc(need)
            offset = 0
            for n, shape, dtype, span in self.outputs:
                if n not in made:
                    made[n] = cupy.ndarray(shape, dtype, memptr=out_mem + offset)
                    offset += span
        for n, x in made.items():
            ptrs[n] = x.data.ptr
        if self.work_bytes:
            work_mem = cupy.cuda.alloc(self.work_bytes)
            self.place(ptrs, work_mem.ptr, stream)
            for n, offset, shape, dtype in self.views:
                made[n] = cupy.ndarray(shape, dtype, memptr=work_mem + offset)
        return made, (out_mem, work_mem)

    def place(self, ptrs: dict, base: int, stream: int) -> None:
        """The work buffers' addresses in ``work_bytes`` of device memory at ``base`` into ``ptrs``, zeroed on
        ``stream`` where a kernel expects zeros (memory the caller owns: CuPy's pool, or XLA's)."""
        import cupy

        for n, offset in self.work:
            ptrs[n] = base + offset
        for offset, nbytes in self.zero:
            cupy.cuda.runtime.memsetAsync(base + offset, 0, nbytes, stream)


def _launch_planned(plan, ptrs: dict, ints: dict, stream, keep) -> None:
    """Run a planned call's launches on ``stream`` (CuPy's current one). While that stream captures a CUDA graph,
    the call's arrays (inputs as the kernels read them, outputs, work buffers: ``keep``) are kept for the life of
    the process: the graph replays into them after the call has returned, so the memory pool must never hand them
    to anything else."""
    plan.run(ptrs, ints, stream.ptr)
    if stream.is_capturing():
        CAPTURED.append(keep)


def _feature_ptrs(extras: dict, as_is: dict, ptrs: dict) -> list:
    """The feature arrays' addresses into ``ptrs`` (an array not read as it is converted first, as the template's
    was); returns the converted ones, to be kept alive."""
    made = []
    for name, x in extras.items():
        if not as_is.get(name, False):
            x = _feature_arrays({name: x})[name]
            made.append(x)
        ptrs[name] = x.data.ptr
    return made


def _features_as_is(extras: dict) -> dict:
    """Which feature arrays of a template the kernels read as they are (the signature fixes their layouts)."""
    ready = _feature_arrays(extras)
    return {n: ready[n] is x for n, x in extras.items()}


class ForwardCall:
    """A planned forward: the template's launches prepacked (:class:`plans.CallPlan`), its buffers laid out
    (:class:`CallBuffers`), and what a call needs besides its arrays (whether each input is read as it is).
    ``facts``: what the values of a call's offsets, lengths and page table are checked against before it runs
    (``validation.Facts``, the template's; the caller checks them: the plan's key holds their layouts only)."""

    def __init__(self, bound: Bound, q, k, v, extras: dict, env: Settings, out=None, facts=None):
        from . import plans

        self.facts = facts
        self.problem = bound.problem
        self.head_dim = int(v.shape[-1])  # out's (MLA: v's head_dim, below q's)
        self.widths = bound.widths
        self.chunk = 16 // np.dtype(q.dtype).itemsize
        self.as_is = all(_ready(x, w, self.chunk) is x for x, w in zip((q, k, v), self.widths))
        self.features = _features_as_is(extras)
        self.out_direct = out is not None and bound.outputs[0].x is out
        self.checks_ref = "ref_gen" in bound.bufs
        others = set(bound.bufs) - {"o", "lse", "tile_counter", "ref_flag", "ref_gen"}
        if others:  # (fa1's work rows start at -inf and 0: no plan sets them)
            raise plans.NotPackable(f"forward buffers {sorted(others)}")
        bufs = {n: x for n, x in bound.bufs.items() if n != "ref_gen"}
        names = [n for n in ("tile_counter", "ref_flag") if n in bufs]
        self.buffers = CallBuffers(bufs, ("o", "lse"), _per_stream(names) if names else None)
        self.plan = plans.CallPlan(bound.launches, bound.roles, lambda lau: kernel_handle(lau, env))

    def run(self, q, k, v, extras: dict, out=None, lse=None):
        import cupy

        if not self.as_is:
            q, k, v = (_ready(x, w, self.chunk) for x, w in zip((q, k, v), self.widths))
        stream = cupy.cuda.get_current_stream()
        ptrs = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr}
        made, keep = self.buffers.make(ptrs, stream.ptr, {"o": out if self.out_direct else None, "lse": lse})
        feats = _feature_ptrs(extras, self.features, ptrs) if extras else ()
        ints = {"ref_gen": next_ref_gen()} if self.checks_ref else {}
        _launch_planned(self.plan, ptrs, ints, stream, (q, k, v, made, keep, feats, extras))
        o = made["o"]
        if o.shape[-1] != self.head_dim:
            o = _trim(o, self.head_dim)
        if out is not None and o is not out:
            out[...] = o
            o = out
        return o, made["lse"]


def _per_stream(names: list):
    """The current stream's buffers of ``names`` (tile_counter, ref_flag), for CallBuffers."""
    makers = {"tile_counter": tile_counter, "ref_flag": ref_flag}
    return lambda: {n: makers[n]() for n in names}


def _bytes(x):
    """An e4m3 array (CuPy, or NumPy copied to the device) as a kernel-ready uint8 CuPy array."""
    import cupy

    u8 = cupy.asarray(x.view(np.uint8)) if isinstance(x, np.ndarray) else x.view(cupy.uint8)
    return kernel_ready(u8, 16)


def bind_forward_fp8(p: Problem, q, k, v, scale: float, descales: tuple, switches: forms.Switches = forms.Switches(),
                     extras: dict | None = None, env: Settings = Settings(),
                     override: forms.Override | None = None) -> Bound:
    """The FP8 forward (float8_e4m3fn q, k, v): V^T written by fp8_vt_permute, then FA3's FP8 form; out in
    ``p.out_dtype``, lse float32."""
    import cupy


    pr = dataclasses.replace(p, arch=device_arch(env), sms=_sms(), gpu=device_gpu(env))
    plan = forms.forward_plan(pr, "fa2", switches, env, override)
    q8, k8, v8 = (_bytes(x) for x in (q, k, v))
    feats = _feature_arrays(extras or {})
    ds = tuple(None if x is None else cupy.ascontiguousarray(cupy.asarray(x), dtype=cupy.float32) for x in descales)
    cfg = plan[1].config
    nk = launch.vt_keys(pr, cfg.bc)
    # packed sequences: one row of keys per kv head, zero where no sequence's tile writes (launch.vt_keys)
    vt = (cupy.zeros((1, pr.kv_heads, pr.head_dim, nk), dtype=cupy.uint8) if pr.varlen
          else cupy.empty((pr.batch, pr.kv_heads, pr.head_dim, nk), dtype=cupy.uint8))
    out = cupy.empty(tuple(q.shape), dtype=np.dtype(pr.out_dtype) if pr.out_dtype != "bfloat16"
                     else cupy.dtype("bfloat16"))
    lse = cupy.empty(_rows(pr), dtype=cupy.float32)
    shape = next((x.shape for x in ds if x is not None), (1,))  # a missing descale is 1 in the others' layout
    named = [x if x is not None else cupy.ones(shape, cupy.float32) for x in ds]
    rec = params.fwd_params(pr, q8, k8, v8, out, lse, scale, descales=tuple(named), tile_counter=tile_counter(),
                            **feats)
    maps = tma.fwd_maps_fp8(q8, k8, vt, cfg.br, cfg.bc, launch.fp8_head_dim(pr), pr.varlen)
    sv = [np.int64(s) for s in ((0, *v8.strides[:2]) if pr.varlen else v8.strides[:3])]  # (batch, row, head)
    cu_k = feats["cu_seqlens_k"] if pr.varlen else np.uint64(0)  # (null: fixed lengths)
    vt_args = (v8, *sv, np.int32(pr.seqlen_k), np.int32(pr.head_dim), np.int32(pr.kv_heads), vt, np.int32(nk),
               cu_k)
    bound = Bound(plan, [(plan[0], vt_args), (plan[1], (rec, maps))], (out, lse), env)
    bound.keep = (q8, k8, v8, vt, feats, named)  # the parameter struct and the maps hold their addresses
    return bound


class _Trimmed:
    """An output to be cut back to the caller's head_dim when the call returns."""

    def __init__(self, x, head_dim: int):
        self.x, self.head_dim = x, head_dim


def _results(outputs: tuple) -> tuple:
    return tuple(_trim(o.x, o.head_dim) if isinstance(o, _Trimmed) else o for o in outputs)


def _bind_naive(p: Problem, q, k, v, scale: float, lse, plan: list, prep: Prepared, env: Settings) -> Bound:
    """Standard attention: S = Q K^T and O = P V by cuBLAS, S and P in HBM, the softmax kernel between."""
    import cupy

    g = p.heads // p.kv_heads
    qh = q.transpose(0, 2, 1, 3).reshape(p.batch, p.kv_heads, g, p.seqlen_q, p.head_dim)
    kt = k.transpose(0, 2, 3, 1)[:, :, None]                               # (b, kv_heads, 1, d, seqlen_k)
    vt = v.transpose(0, 2, 1, 3)[:, :, None]
    s = cupy.empty((p.batch, p.kv_heads, g, p.seqlen_q, p.seqlen_k), dtype=q.dtype)
    prob = cupy.empty_like(s)
    out = cupy.empty((p.batch, p.kv_heads, g, p.seqlen_q, p.head_dim), dtype=q.dtype)
    rec = params.fwd_params(p, q, k, v, q, lse, scale, **prep.extras)

    class NaiveBound(Bound):
        def launch(self):
            _matmul(qh, kt, s)
            run(plan[0], (rec, s, prob), env)
            _matmul(prob, vt, out)

        def result(self):
            o = out.reshape(p.batch, p.heads, p.seqlen_q, p.head_dim).transpose(0, 2, 1, 3)
            return (_trim(cupy.ascontiguousarray(o), prep.value_head_dim), lse)

    return NaiveBound(plan, [], (), env)


def _matmul(a, b, out):
    """cuBLAS product into ``out`` in the input dtype; CuPy has no bfloat16 matmul, so bfloat16 goes through
    float32 (and a copy)."""
    import cupy

    if a.dtype.itemsize == 2 and a.dtype != np.float16:
        out[...] = cupy.matmul(a.astype(cupy.float32), b.astype(cupy.float32)).astype(a.dtype)
    else:
        cupy.matmul(a, b, out=out)


def backward_buffers(pr: Problem, main: Launch, deterministic: bool, q, k, v, dq=None, dk=None, dv=None) -> dict:
    """A backward call's per-call buffers, by the parameter struct's field names: the gradients (the caller's
    ``dq`` / ``dk`` / ``dv`` when given), L and D rows, the float32 dQ rows, the sinks' per-row terms and the ordered
    dQ's semaphores. ``main`` is the plan's main launch (what decides the work buffers). The template
    (``bind_backward``) makes them here; its planned calls replay their layout (:class:`CallBuffers`)."""
    import cupy

    f32 = cupy.float32
    # keys past seqused_k are never written by a kernel: their gradients start (and stay) zero
    alloc = cupy.zeros if pr.seqused_k else cupy.empty
    bufs = {"lse2": cupy.empty(_rows(pr), dtype=f32), "delta": cupy.empty(_rows(pr), dtype=f32),
            "dq": cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq}
    for name, x, given in (("dk", k, dk), ("dv", v, dv)):
        if given is not None and pr.seqused_k:
            given.fill(0)
        bufs[name] = alloc(x.shape, dtype=x.dtype) if given is None else given
    if pr.sinks:
        bufs["dsink_ws"] = cupy.empty(_rows(pr), dtype=f32)
    # FA3's deterministic form adds into the float32 dQ rows like the default one, in an order its int32
    # semaphores keep (one per query block of every (sequence, head)). The preprocess kernel zeroes the dQ rows
    # (it reads the same rows of O and dO); the launches are preceded by a reset of the semaphores.
    ordered = deterministic and main.kernel == "fa3_bwd_sm90"
    if not deterministic or ordered:
        bufs["dq_ws"] = cupy.empty(_rows(pr, pr.head_dim), dtype=f32)
    if ordered:
        bufs["dq_semaphore"] = cupy.empty(launch.dq_semaphores(pr, main.config.br), dtype=cupy.int32)
    return bufs


def _lse_f32(lse):
    import cupy

    return cupy.ascontiguousarray(cupy.asarray(lse), dtype=cupy.float32)


def bind_backward(p: Problem, dout, q, k, v, out, lse, scale: float, deterministic: bool = False,
                  extras: dict | None = None, env: Settings = Settings(), override: forms.Override | None = None,
                  grads: tuple = (None, None, None)) -> Bound:
    """Allocate the backward's outputs (or take ``grads``: the caller's dq, dk, dv, each possibly None) and work
    buffers and bind them. The plan comes first: it decides whether v, dout and out are read (and dv written) at
    v's own head_dim (FA3's DV form) or zero-padded to q's."""
    extras = extras or {}
    plan = forms.backward_plan(run_problem(p, env, value_form=True), deterministic, env, override)
    try:
        return _bind_backward_plan(p, plan, dout, q, k, v, out, lse, scale, deterministic, extras, env, grads)
    except tma.TmaUnavailable:  # e.g. a stride TMA cannot express: a form whose threads all copy (v padded)
        plan = forms.backward_plan_without_tma(run_problem(p, env), deterministic, env, override)
        return _bind_backward_plan(p, plan, dout, q, k, v, out, lse, scale, deterministic, extras, env, grads)


def _bind_backward_plan(p: Problem, plan: list, dout, q, k, v, out, lse, scale: float, deterministic: bool,
                        extras: dict, env: Settings, grads: tuple) -> Bound:
    """bind_backward for a chosen plan (TmaUnavailable where FA3's maps cannot describe the arrays). dout and out
    are read at v's width, as v is (out too: D reads it)."""
    value_form = any(forms.reads_value_head_dim(lau) for lau in plan)
    prep = prepare(p, extras, env, q, k, v, dout, out, value_form=value_form)
    pr, (q, k, v, do, out) = prep.problem, prep.arrays
    lse = _lse_f32(lse)
    main = plan[1]
    chunk = 16 // q.dtype.itemsize
    direct = [g if _writes_in_place(g, w, chunk) else None
              for g, w in zip(grads, (pr.head_dim, pr.head_dim, pr.value_head_dim))]
    bufs = backward_buffers(pr, main, deterministic, q, k, v, *direct)
    ordered = "dq_semaphore" in bufs
    rec = params.bwd_params(pr, q, k, v, out, do, lse, scale, **bufs,
                            dq_rotate=ordered and launch.fa3_bwd_dq_rotates(pr, main.config, _sms()),
                            longest_first=(main.kernel == "fa3_bwd_sm90" and not ordered
                                           and launch.fa3_bwd_longest_first(pr, main.config, _sms())),
                            **prep.extras)
    outputs = tuple(_Trimmed(bufs[n], d) for n, d in zip(("dq", "dk", "dv"), _grad_dims(prep.head_dim,
                                                                                         prep.value_head_dim)))
    launches = [(lau, (rec,)) for lau in plan]
    reset = [bufs["dq_semaphore"]] if ordered else []
    if main.kernel == "fa3_bwd_sm90":
        maps = tma.bwd_maps(q, k, v, do, bufs.get("dq_ws"), main.config.br, main.config.bc, pr.varlen)
        launches[1] = (main, (rec, maps))
    bound = Bound(plan, launches, outputs, env, reset=reset, problem=pr)
    bound.roles = _roles(dict(q=q, k=k, v=v, out=out, dout=do, lse=lse), prep.extras, bufs)
    bound.keep = (q, k, v, do, out, lse, bufs, prep.extras)  # alive while the kernels run
    bound.bufs = bufs
    bound.widths = tuple(int(x.shape[-1]) for x in (do, q, k, v, out))  # the head dims the kernels read them at
    if pr.sinks:
        bound.sinks = lambda: dsinks(pr, bufs["dsink_ws"])
    return bound


def _grad_dims(head_dim: int, head_dim_v: int) -> tuple[int, int, int]:
    """The caller's head dims of dq, dk and dv (dv: v's)."""
    return head_dim, head_dim, head_dim_v


def dsinks(pr: Problem, dsink_ws):
    """The sinks' gradient (heads,) float32 from the backward's per-row terms."""
    import cupy

    axes = (1,) if pr.varlen else (0, 2)
    return (-dsink_ws.sum(axis=axes, dtype=cupy.float64)).astype(cupy.float32)


class BackwardCall:
    """A planned backward (see :class:`ForwardCall`)."""

    def __init__(self, bound: Bound, arrays: tuple, extras: dict, env: Settings, grads: tuple, facts=None):
        from . import plans

        self.facts = facts
        self.problem = bound.problem
        q = arrays[1]
        self.dims = _grad_dims(int(q.shape[-1]), int(arrays[3].shape[-1]))
        self.widths = bound.widths  # dout's, q's, k's, v's and out's, as the kernels read them
        self.chunk = 16 // np.dtype(q.dtype).itemsize
        self.as_is = all(_ready(x, w, self.chunk) is x for x, w in zip(arrays[:5], self.widths)) and \
            _lse_f32(arrays[5]) is arrays[5]
        self.features = _features_as_is(extras)
        self.direct = tuple(g is not None and g is o.x for g, o in zip(grads, bound.outputs))
        # keys past seqused_k are never written by a kernel: their gradients start (and stay) zero
        self.zero_kv = self.problem.seqused_k
        zeroed = ("dq_semaphore",) if bound.reset else ()
        self.buffers = CallBuffers(bound.bufs, ("dq", "dk", "dv"), None, zeroed, views=("dsink_ws",))
        self.plan = plans.CallPlan(bound.launches, bound.roles, lambda lau: kernel_handle(lau, env))

    def run(self, dout, q, k, v, out, lse, extras: dict, grads: tuple = (None, None, None)):
        import cupy

        if not self.as_is:
            dout, q, k, v, out = (_ready(x, w, self.chunk) for x, w in zip((dout, q, k, v, out), self.widths))
            lse = _lse_f32(lse)
        stream = cupy.cuda.get_current_stream()
        ptrs = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "out": out.data.ptr, "dout": dout.data.ptr,
                "lse": lse.data.ptr}
        given = {n: g if d else None for n, g, d in zip(("dq", "dk", "dv"), grads, self.direct)}
        made, keep = self.buffers.make(ptrs, stream.ptr, given)
        if self.zero_kv:
            for n in ("dk", "dv"):
                x = made[n]
                cupy.cuda.runtime.memsetAsync(x.data.ptr, 0, x.nbytes, stream.ptr)
        feats = _feature_ptrs(extras, self.features, ptrs) if extras else ()
        _launch_planned(self.plan, ptrs, {}, stream, (dout, q, k, v, out, lse, made, keep, feats, extras))
        result = []
        for name, g, dim in zip(("dq", "dk", "dv"), grads, self.dims):
            x = made[name]
            if x.shape[-1] != dim:
                x = _trim(x, dim)
            if g is not None and x is not g:
                g[...] = x
                x = g
            result.append(x)
        if self.problem.sinks:
            result.append(dsinks(self.problem, made["dsink_ws"]))
        return tuple(result)


def _cache_ready(x, name: str, chunk: int, in_place: bool):
    """A cache the kernels read (and append to) in place: the caller's array, or a copy when it cannot be read as it
    is and nothing is appended to it (an append must land in the caller's memory)."""
    ready = kernel_ready(x, chunk)
    if ready is not x and in_place:
        raise ValueError(f"{name} must have a last stride of 1, a 16-byte aligned base and strides that are multiples "
                         f"of {chunk} elements for an in-place append (k_new / v_new given), got strides "
                         f"{tuple(x.strides)} bytes")
    return ready


_tile_counters: dict = {}


def tile_counter():
    """FA3's dynamic persistent grid's two int32 counters {next tile, CTAs done} (scheduler.cuh's
    DynamicTileScheduler), one pair per (device, stream): zero when allocated, and the last CTA of every launch
    puts them back to zero, so the launches of one stream (which run one after another) share a pair and pay for
    no reset. A launch that faults leaves them set, but its context is then lost with them."""
    return _stream_zeros(_tile_counters, 2)


def _stream_zeros(cache: dict, n: int):
    """``n`` int32 zeros cached in ``cache`` per (device, stream), allocated at the first call."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr)
    words = cache.get(key)
    if words is None:
        words = cache[key] = cupy.zeros(n, dtype=cupy.int32)
    return words


_ref_flags: dict = {}
_ref_gen = [0]


def ref_flag():
    """The FA3 forward's REF_FIRST flag word, one int32 per (device, stream): a launch whose check fails writes its
    call's number there (FwdParams::ref_gen), and the REF_RUNNING launch after it recomputes the call only when the
    word holds that number, so the word never needs a reset. (A CUDA graph replays one number: after one failed
    check, every later replay of it recomputes, correct but slower.)"""
    return _stream_zeros(_ref_flags, 1)


def next_ref_gen() -> int:
    """A new call number for ref_flag: 1, 2, ... 2^31 - 1, then 1 again (never 0, the word's initial value)."""
    _ref_gen[0] = _ref_gen[0] % (2**31 - 1) + 1
    return _ref_gen[0]


WORKSPACES = 8  # decode's cached (o_ws, m_ws, counters) triples, the least recently used dropped first
_workspaces: collections.OrderedDict = collections.OrderedDict()


def decode_workspace(partials: int, q_shape: tuple, lse_shape: tuple, row_groups: int = 0):
    """decode's work buffers: float32 partial O (partials x q's shape) and lse (partials x lse's shape), and
    ``row_groups`` int32 counters for the fused combine (one per (batch, kv head, row group): zero when made, and
    decode_split's last CTA puts its count back to zero, so no call resets them), cached per (device, stream,
    shape): a decode step of a serving loop allocates nothing. A triple is shared only by calls on one stream,
    which run one after another, so no call sees another's partials or counts."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    key = (cupy.cuda.runtime.getDevice(), stream.ptr, partials, tuple(q_shape), tuple(lse_shape), row_groups)
    ws = _workspaces.get(key)
    if ws is None:
        ws = (cupy.empty((partials,) + tuple(q_shape), dtype=cupy.float32),
              cupy.empty((partials,) + tuple(lse_shape), dtype=cupy.float32),
              cupy.zeros(max(1, row_groups), dtype=cupy.int32))
        _workspaces[key] = ws
        while len(_workspaces) > WORKSPACES:
            _workspaces.popitem(last=False)
    else:
        _workspaces.move_to_end(key)
    return ws


def decode_buffers(pr: Problem, plan: forms.DecodePlan, q, out=None, lse=None) -> dict:
    """A decode call's buffers, by the parameter struct's field names: its outputs (the caller's ``out`` / ``lse``
    when given) and the split pass's work buffers of this stream (``decode_workspace``). The template
    (``bind_decode``) makes them here; its planned calls replay their layout (:class:`CallBuffers`)."""
    import cupy

    lse_shape, out_shape = (pr.batch, pr.heads, pr.seqlen_q), decode_out_shape(pr, q)
    o_ws, m_ws, counters = decode_workspace(plan.partials, out_shape, lse_shape, plan.row_groups if plan.fused else 0)
    bufs = {"o": cupy.empty(out_shape, dtype=q.dtype) if out is None else out,
            "lse": cupy.empty(lse_shape, dtype=cupy.float32) if lse is None else lse, "o_ws": o_ws, "m_ws": m_ws}
    if plan.fused:
        bufs["decode_counters"] = counters
    return bufs


def decode_out_shape(pr: Problem, q) -> tuple:
    """decode's out: q's shape with the values' head_dim (a latent cache's head_dim_v)."""
    return (*q.shape[:3], pr.value_head_dim)


def _decode_inputs(q, k_cache, v_cache, k_new, v_new, hd: int):
    """decode's arrays as its kernels read them: q kernel-ready, the caches in place (or read-only copies), the new
    keys and values kernel-ready (or None). A latent cache (v_cache None) stands in v's place too (its kernels
    never read v), and k_new in v_new's."""
    if v_cache is None:
        v_cache, v_new = k_cache, k_new
    import cupy

    chunk = 16 // q.dtype.itemsize
    appends = k_new is not None
    q = _ready(q, hd, chunk)
    if isinstance(k_cache, np.ndarray) and k_cache.dtype.itemsize == 1:  # an FP8 cache of NumPy's: as bytes
        k_cache, v_cache = (cupy.asarray(x.view(np.uint8)) for x in (k_cache, v_cache))
    k_cache, v_cache = cupy.asarray(k_cache), cupy.asarray(v_cache)
    kv_chunk = 16 // k_cache.dtype.itemsize  # (an FP8 cache: 16 elements)
    same = v_cache is k_cache
    k_cache = _cache_ready(k_cache, "k_cache", kv_chunk, appends)
    v_cache = k_cache if same else _cache_ready(v_cache, "v_cache", kv_chunk, appends)
    new = tuple(kernel_ready(cupy.asarray(x), chunk) for x in (k_new, v_new)) if appends else (None, None)
    return q, k_cache, v_cache, *new


def bind_decode(p: Problem, q, k_cache, v_cache, k_new, v_new, scale: float, num_splits: int | None = None,
                extras: dict | None = None, env: Settings = Settings(), override: forms.Override | None = None,
                out=None, lse=None) -> Bound:
    """Bind a decode call: the append (k_new / v_new into the caches, in place: by decode_split itself, or by
    decode_append before it: ``forms.decode_split_appends``), the split-KV pass into float32 work buffers (one
    partial per CTA of it: plan.partials x the output, cached per shape and stream) and the combine into out and
    lse (batch, heads, seqlen_q), by decode_split's last CTAs (``forms.decode_fuses_combine``) or a launch of its
    own. Nothing here reads a device value: the plan comes from the shapes (``forms.decode_plan``)."""
    extras = dict(extras or {})
    cache_len = extras.pop("cache_len", 0)
    # head_dim is a multiple of 8 (checked): nothing is padded; a latent cache keeps its head_dim_v (its values)
    prep = prepare(p, extras, env, value_form=launch.latent_decode(p))
    pr = prep.problem
    q, k_cache, v_cache, k_new, v_new = _decode_inputs(q, k_cache, v_cache, k_new, v_new, pr.head_dim)
    plan = forms.decode_plan(pr, num_splits, _sms(), override, env.wgmma)
    direct = _writes_in_place(out, pr.value_head_dim, 16 // q.dtype.itemsize)
    bufs = decode_buffers(pr, plan, q, out if direct else None, lse)
    rec = params.fwd_params(pr, q, k_cache, v_cache, bufs["o"], bufs["lse"], scale, o_ws=bufs["o_ws"],
                            m_ws=bufs["m_ws"], num_splits=plan.num_splits, k_new=k_new, v_new=v_new, decode=True,
                            cache_len=cache_len, split_appends=plan.split_appends, num_partials=plan.partials,
                            decode_counters=bufs.get("decode_counters"), **prep.extras)
    launches = plan.launches
    bound = Bound(list(launches), [(lau, (rec,)) for lau in launches], (bufs["o"], bufs["lse"]), env, problem=pr)
    bound.roles = _roles(dict(q=q, k=k_cache, v=v_cache, k_new=k_new, v_new=v_new), prep.extras, bufs)
    bound.keep = (q, k_cache, v_cache, k_new, v_new, bufs, prep.extras)
    bound.bufs = bufs
    bound.plan_info = plan
    return bound


class DecodeCall:
    """A planned decode step (see :class:`ForwardCall`); ``cache_len`` (an int cache_seqlens) is a per-call word."""

    def __init__(self, bound: Bound, arrays: tuple, extras: dict, env: Settings, out=None):
        from . import plans

        self.problem, self.decode_plan = bound.problem, bound.plan_info
        hd = self.problem.head_dim
        ready = _decode_inputs(*arrays, hd)
        self.as_is = all(r is x or x is None for r, x in zip(ready, arrays))  # (a latent cache's None v stands)
        self.features = _features_as_is({n: x for n, x in extras.items() if n != "cache_len"})
        self.out_direct = out is not None and bound.outputs[0] is out
        plan, q = self.decode_plan, arrays[0]
        lse_shape = (self.problem.batch, self.problem.heads, self.problem.seqlen_q)
        rows = plan.row_groups if plan.fused else 0

        def per_stream():
            o_ws, m_ws, counters = decode_workspace(plan.partials, decode_out_shape(self.problem, q), lse_shape, rows)
            return {"o_ws": o_ws, "m_ws": m_ws, **({"decode_counters": counters} if plan.fused else {})}

        self.buffers = CallBuffers(bound.bufs, ("o", "lse"), per_stream)
        self.plan = plans.CallPlan(bound.launches, bound.roles, lambda lau: kernel_handle(lau, env))

    def takes_cache_len(self, cache_seqlens) -> bool:
        """Whether an int cache_seqlens is within the cache with this call's appends (else the call takes the full
        path, which refuses it by name); arrays are checked by the kernels."""
        p = self.problem
        return not isinstance(cache_seqlens, int) or 0 <= cache_seqlens <= p.seqlen_k - p.new_keys

    def run(self, q, k_cache, v_cache, k_new, v_new, extras: dict, out=None, lse=None):
        import cupy

        if not self.as_is or v_cache is None:
            q, k_cache, v_cache, k_new, v_new = _decode_inputs(q, k_cache, v_cache, k_new, v_new,
                                                               self.problem.head_dim)
        cache_len = extras.get("cache_len")
        ints = {"cache_len": cache_len} if cache_len is not None else {}
        stream = cupy.cuda.get_current_stream()
        ptrs = {"q": q.data.ptr, "k": k_cache.data.ptr, "v": v_cache.data.ptr}
        if k_new is not None:
            ptrs["k_new"], ptrs["v_new"] = k_new.data.ptr, v_new.data.ptr
        made, keep = self.buffers.make(ptrs, stream.ptr, {"o": out if self.out_direct else None, "lse": lse})
        feats = _feature_ptrs({n: x for n, x in extras.items() if n != "cache_len"}, self.features, ptrs)
        _launch_planned(self.plan, ptrs, ints, stream, (q, k_cache, v_cache, k_new, v_new, made, keep, feats,
                                                        extras))
        o = made["o"]
        if out is not None and o is not out:
            out[...] = o
            o = out
        return o, made["lse"]


def _sms() -> int:
    """The current device's multiprocessors (asked once per device, like _smem_optin)."""
    import cupy

    return _sm_count(cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    """Multiprocessors of a device (asked once: Device.attributes queries every attribute)."""
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id))

