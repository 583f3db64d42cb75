"""The Numba backend: binds arrays to the twins of ``rawflash/numba_kernels`` and runs the plan ``forms.py`` chose.

Plans come from ``forms.forward_plan`` / ``forms.backward_plan`` for the problem as the CUDA C backend prepares it
(head_dim rounded up to a multiple of 8, the problem's arch) with the wgmma forms off, so every launch is an
mma.sync form or a helper that has a twin: the twins run the CUDA C's grids and tile sizes (``Launch.grid``,
``Launch.config``); their CTA sizes and (float32) shared memory come from the twin modules. Each launch runs the
twin its kernel name maps to through the registry's twin names (``TWIN_FACTORIES``), built from its template
arguments (``Launch.template_args``). The same code runs in two places:

- on a GPU, arrays are CuPy arrays (NumPy inputs are copied to the device first) handed to Numba through
  ``__cuda_array_interface__`` without copies, kernels run on CuPy's current stream and results are CuPy arrays.
  bfloat16 is upcast to float32 with CuPy first (``__cuda_array_interface__`` cannot describe it) and the
  results are cast back.
- under ``NUMBA_ENABLE_CUDASIM=1`` (Numba's CPU simulator, read once when numba is imported), arrays are NumPy
  arrays and results are NumPy arrays; no GPU and no CuPy are needed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import sys
import time
import warnings
from typing import Callable

import numpy as np
from numba import config as numba_config

from . import forms, launch, registry
from .cupy_backend import run_head_dim
from .launch import Launch
from ..numba_kernels import Twin, decode as _decode, fa1_fwd, fa2_bwd, fa2_fwd  # noqa: F401  (the numpy shim first)
from ..numba_kernels.params import BwdParams, DecodeParams, FwdParams
from ..problem import Problem
from ..settings import Settings

SIMULATOR = bool(numba_config.ENABLE_CUDASIM)
# The twins favour clarity over occupancy (one thread per row); small test grids would warn on every launch.
numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
LOG2E = 1.0 / math.log(2.0)
STATIC_SMEM_LIMIT = 48 * 1024  # a CTA gets more dynamic shared memory only after raising its limit
NO_WGMMA = Settings(wgmma=False)  # the wgmma forms have no twins: plan the mma.sync forms


def _twin_factories() -> dict[str, tuple[str, str]]:
    """Kernel name -> (twin module, factory name) for every form and helper of the registry that has a twin."""
    table = {}
    for variant in registry.REGISTRY.values():
        for k in (*variant.forms, *variant.helpers):
            if k.twin is not None:
                table[k.kernel] = (k.twin, f"make_{k.kernel}")
    return table


TWIN_FACTORIES: dict[str, tuple[str, str]] = _twin_factories()
"""The one dispatch table: a launch's kernel name -> the twin module and factory that mirror it."""


def _no_twin(kernel: str, api_kernel: str) -> str:
    try:
        reason = registry.form(kernel).no_twin
    except KeyError:
        reason = "the registry lists no twin for it"
    return (f"kernel={api_kernel!r} ({kernel}) has no Numba twin ({reason}); use backend='cupy' for it, or "
            "kernel='fa2' / 'fa1' with backend='numba'")


def twin_of(lau: Launch, api_kernel: str = "fa2") -> Twin:
    """The twin of one launch: its factory called with the launch's template arguments (compiled lazily)."""
    if lau.kernel not in TWIN_FACTORIES:
        raise NotImplementedError(_no_twin(lau.kernel, api_kernel))
    module, factory = TWIN_FACTORIES[lau.kernel]
    return getattr(importlib.import_module(f"rawflash.numba_kernels.{module}"), factory)(*lau.template_args)


def run_problem(p: Problem) -> Problem:
    """The problem as the kernels see it (cupy_backend.prepare's): head_dim rounded up to a multiple of 8, v (MLA's
    narrower head_dim_v) zero-padded to it."""
    return dataclasses.replace(p, head_dim=run_head_dim(p.head_dim), head_dim_v=0)


def forward_plan(pr: Problem, kernel: str = "fa2", switches: forms.Switches | None = None) -> list[Launch]:
    """The forward's launches for the run problem ``pr``, the wgmma forms off."""
    sw = forms.Switches() if switches is None else switches
    if sw.wgmma:
        raise ValueError("wgmma=True: the warpgroup kernel has no Numba twin (the twin of fa2 is fa2_fwd's mma.sync "
                         "form); use backend='cupy'")
    return forms.forward_plan(pr, kernel, dataclasses.replace(sw, wgmma=False), NO_WGMMA)


def backward_plan(pr: Problem, deterministic: bool = False) -> list[Launch]:
    """The backward's launches for the run problem ``pr``, the wgmma forms off."""
    return forms.backward_plan(pr, deterministic, NO_WGMMA)


def _resolve(plan: list[Launch], api_kernel: str) -> list[tuple[Launch, Twin, int]]:
    """(launch, twin, threads per CTA) for every launch of a plan; refuses before anything is allocated."""
    out = []
    for lau in plan:
        twin = twin_of(lau, api_kernel)
        out.append((lau, twin, lau.block[0] if twin.threads is None else twin.threads))
    return out


# ---------------------------------------------------------------- arrays
def _xp():
    """The array module the kernels' arrays come from: NumPy on the simulator, CuPy on a GPU."""
    if SIMULATOR:
        return np
    import cupy

    return cupy


def _on_device(x):
    """``x`` where the kernels can read it: a CuPy array (no copy if it is one, any strides), or on the simulator
    a C-contiguous NumPy array (the simulator copies arguments as single memory regions)."""
    if SIMULATOR:
        return np.ascontiguousarray(x.get() if not isinstance(x, np.ndarray) and hasattr(x, "get") else x)
    import cupy

    return cupy.asarray(x)


def _is_bfloat16(dtype) -> bool:
    return np.dtype(dtype).itemsize == 2 and np.dtype(dtype) != np.float16


def _kernel_dtype(x):
    """float16 and float32 as they are; bfloat16 upcast to float32 (Numba reads neither it nor its interface)."""
    return x.astype(np.float32) if _is_bfloat16(x.dtype) else x


def _pad(x, head_dim: int):
    """Zero-pad the last axis to ``head_dim`` (a copy), as the CUDA C path does."""
    if x.shape[-1] == head_dim:
        return x
    out = _xp().zeros(x.shape[:-1] + (head_dim,), dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def _trim(x, head_dim: int):
    return x if x.shape[-1] == head_dim else _xp().ascontiguousarray(x[..., :head_dim])


def _result(x, dtype: str):
    """Cast a result back to the caller's dtype (only bfloat16 runs in another one)."""
    return x.astype(dtype) if x.dtype != np.dtype(dtype) else x


@dataclasses.dataclass
class Prepared:
    """Inputs ready for the twins and the problem they run as (head_dim rounded up as for the CUDA C), with the
    caller's head dims of q and v (which the results are cut back to).

    ``arrays`` are 4-D: packed sequences (total, heads, d) become (1, total, heads, d). ``features`` are the five
    optional arrays in the kernels' order (cu_q, cu_k, used_k, slopes, sinks), one-element dummies where absent.
    """

    problem: Problem
    arrays: tuple
    head_dim: int
    features: tuple
    extras: dict
    value_head_dim: int  # v's (and out's, dv's): MLA's head_dim_v, or head_dim


def _require_device() -> None:
    """Refuse clearly, before anything is allocated, when there is neither a GPU nor the simulator."""
    from numba import cuda

    if not SIMULATOR and not cuda.is_available():
        raise RuntimeError("backend='numba' needs a CUDA GPU, or NUMBA_ENABLE_CUDASIM=1 set before numba is first "
                           "imported to run the kernels on Numba's CPU simulator")


FEATURES = (("cu_seqlens_q", np.int32), ("cu_seqlens_k", np.int32), ("seqused_k", np.int32),
            ("alibi_slopes", np.float32), ("sinks", np.float32))


def prepare(p: Problem, extras: dict | None, *arrays) -> Prepared:
    """Inputs on the device (NumPy on the simulator), bfloat16 upcast, head_dim zero-padded as for the CUDA C,
    packed sequences as one batch entry; the feature arrays flat (ALiBi's (batch, heads) too) or dummies."""
    _require_device()
    extras = dict(extras or {})
    pr = run_problem(p)
    ready = tuple(_pad(_kernel_dtype(_on_device(x)), pr.head_dim) for x in arrays)
    if p.varlen:
        ready = tuple(x[None] for x in ready)
    xp = _xp()
    feats = tuple(xp.ascontiguousarray(_on_device(extras[name]).astype(dtype).ravel()) if name in extras
                  else xp.zeros(1, dtype) for name, dtype in FEATURES)
    return Prepared(pr, ready, p.head_dim, feats, extras, p.value_head_dim)


def _params(cls, pr: Problem, scale: float, extras: dict, **more):
    """FwdParams / BwdParams of one call (``kernels/params.py``'s fields, as ``numba_kernels/params.py`` keeps
    them)."""
    left, right = pr.window_bounds
    slopes = extras.get("alibi_slopes")
    return cls(batch=pr.batch, seqlen_q=pr.seqlen_q, seqlen_k=pr.seqlen_k, heads=pr.heads, kv_heads=pr.kv_heads,
               head_dim=pr.head_dim, window_left=left, window_right=right, scale=np.float32(scale),
               scale_log2=np.float32(scale * LOG2E), softcap=np.float32(pr.softcap),
               alibi_sb=pr.heads if slopes is not None and len(slopes.shape) == 2 else 0,
               has_cu="cu_seqlens_q" in extras, has_seqused="seqused_k" in extras,
               has_alibi=slopes is not None, has_sinks="sinks" in extras, **more)


def _rows(pr: Problem, *tail):
    """The shape of a per-row float32 buffer: (batch, heads, seqlen_q), or (1, heads, total_q) when packed."""
    b, s = pr.rows
    return (b, pr.heads, s, *tail)


def _unpack(x, pr: Problem):
    """Packed results lose the one batch entry they ran with."""
    return x[0] if pr.varlen else x


# ---------------------------------------------------------------- launching
def _stream():
    """CuPy's current stream as a Numba stream (0: the default stream)."""
    import cupy
    from numba import cuda

    ptr = cupy.cuda.get_current_stream().ptr
    return cuda.external_stream(ptr) if ptr else 0


def _allow_dynamic_shared(kernel, args, smem: int) -> None:
    """Raise the kernel's dynamic shared-memory limit to ``smem`` bytes (CUDA allows 48 KB unless asked)."""
    from numba.cuda.cudadrv.driver import binding, driver

    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    cufunc = compiled._codelibrary.get_cufunc()
    limit = cufunc.device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    if smem > limit:
        raise ValueError(f"the Numba twin needs {smem} bytes of shared memory per CTA (its tiles are float32) and this "
                         f"GPU allows {limit}; use backend='cupy' or a smaller head_dim")
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, smem, cufunc.handle, cufunc.device.id)


def run(kernel, grid, threads: int, smem: int, *args) -> None:
    """Launch one twin: ``grid`` from launch.py, ``threads`` per CTA, ``smem`` bytes of dynamic shared memory."""
    block = (threads, 1, 1)
    if SIMULATOR:
        with _simulated_launch(kernel, grid, threads):
            kernel[grid, block, 0, smem](*args)
        return
    from numba import cuda

    args = tuple(cuda.as_cuda_array(a, sync=False) if hasattr(a, "__cuda_array_interface__") else a for a in args)
    if smem > STATIC_SMEM_LIMIT:
        _allow_dynamic_shared(kernel, args, smem)
    with warnings.catch_warnings():  # small problems have small grids: that is not the caller's mistake
        warnings.filterwarnings("ignore", message="Grid size .* will likely result in GPU under-utilization")
        configured = kernel[grid, block, _stream(), smem]
    configured(*args)


def _run_plan(resolved: list[tuple[Launch, Twin, int]], args: tuple) -> None:
    for lau, twin, threads in resolved:
        run(twin.kernel, lau.grid, threads, twin.smem, *args)


# ---------------------------------------------------------------- forward
def forward(p: Problem, q, k, v, scale: float, kernel: str = "fa2", sw: forms.Switches | None = None,
            extras: dict | None = None):
    """out like q in q's dtype and lse (batch, heads, seqlen_q) float32, or (heads, total_q) when packed.

    The semantics of ``rawflash.forward`` on the CUDA C kernels: ``sw`` the forward's switches (the ablation; wgmma
    must not be True), ``extras`` the feature arrays (cu_seqlens_q / _k, seqused_k, alibi_slopes, sinks).
    kernel='naive' has no twin (NotImplementedError).
    """
    if kernel not in registry.api_kernels():
        raise ValueError(f"kernel must be one of {', '.join(map(repr, registry.api_kernels()))}, got {kernel!r}")
    pr = run_problem(p)
    resolved = _resolve(forward_plan(pr, kernel, sw), kernel)
    xp = _xp()
    prep = prepare(p, extras, q, k, v)
    q, k, v = prep.arrays
    out = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty(_rows(pr), dtype=np.float32)
    if any(lau.kernel == "fa1_fwd" for lau, _, _ in resolved):  # fa1's running state in HBM
        ws = (xp.zeros(_rows(pr, pr.head_dim), np.float32), xp.full(_rows(pr), -np.inf, np.float32),
              xp.zeros(_rows(pr), np.float32))
    else:
        ws = (xp.zeros((1, 1, 1, 1), np.float32), xp.zeros((1, 1, 1), np.float32), xp.zeros((1, 1, 1), np.float32))
    params = _params(FwdParams, pr, scale, prep.extras)
    _run_plan(resolved, (params, q, k, v, out, lse, *prep.features, *ws))
    return _unpack(_result(_trim(out, prep.value_head_dim), p.dtype), pr), _unpack(lse, pr)


# ---------------------------------------------------------------- backward
def backward(p: Problem, dout, q, k, v, out, lse, scale: float, deterministic: bool = False,
             extras: dict | None = None):
    """dq, dk, dv with the shapes and dtype of q, k, v, and dsinks (heads,) float32 when sinks are given (the
    semantics of ``rawflash.backward`` on the CUDA C kernels)."""
    pr = run_problem(p)
    resolved = _resolve(backward_plan(pr, deterministic), "fa2")
    xp = _xp()
    prep = prepare(p, extras, q, k, v, dout, out)  # out too: D reads it at the kernels' head_dim
    q, k, v, do, out = prep.arrays
    lse = xp.ascontiguousarray(_on_device(lse).astype(np.float32).reshape(_rows(pr)))
    lse2, delta = xp.empty(_rows(pr), np.float32), xp.empty(_rows(pr), np.float32)
    dq = xp.empty(q.shape, dtype=q.dtype)
    # keys past seqused_k are never written by a kernel: their gradients start (and stay) zero
    alloc = xp.zeros if pr.seqused_k else xp.empty
    dk, dv = alloc(k.shape, dtype=q.dtype), alloc(v.shape, dtype=q.dtype)
    # dq_ws: float32 dQ accumulated with atomic adds (zeroed by the preprocess kernel, as in the CUDA C); the
    # deterministic pass leaves it alone (a dummy)
    dq_ws = xp.empty(_rows(pr, pr.head_dim) if not deterministic else (1, 1, 1, 1), np.float32)
    sinks = "sinks" in prep.extras
    dsink_ws = xp.zeros(_rows(pr) if sinks else (1, 1, 1), np.float32)
    params = _params(BwdParams, pr, scale, prep.extras, rows_batch=pr.rows[0], rows_seqlen=pr.rows[1])
    _run_plan(resolved, (params, q, k, v, out, do, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, *prep.features))
    grads = tuple(_unpack(_result(_trim(x, d), p.dtype), pr)
                  for x, d in ((dq, prep.head_dim), (dk, prep.head_dim), (dv, prep.value_head_dim)))
    if not sinks:
        return grads
    return (*grads, (-dsink_ws.sum(axis=(0, 2), dtype=np.float64)).astype(np.float32))


# ---------------------------------------------------------------- decode
def copies_caches(k_cache) -> bool:
    """Whether ``decode`` runs on copies of the caller's caches (the simulator, NumPy caches on a GPU, bfloat16
    upcast), so that the caller's caches need the append done again by the API."""
    return SIMULATOR or isinstance(k_cache, np.ndarray) or _is_bfloat16(k_cache.dtype)


def _sm_count() -> int:
    """Multiprocessors the split heuristic plans for: the GPU's, or an H200's (132) on the simulator."""
    if SIMULATOR:
        return 132
    from numba import cuda

    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def decode(p: Problem, q, k_cache, v_cache, k_new, v_new, scale: float, num_splits: int | None = None,
           extras: dict | None = None):
    """out like q (a latent cache's: head_dim_v columns) and lse (batch, heads, seqlen_q) float32 through the decode
    twins (the semantics of ``rawflash.decode`` on the CUDA C kernels; the caches receive the append unless
    ``copies_caches``). A latent cache (``p.head_dim_v``; v_cache and v_new None): the twins get k_cache (and
    k_new) in v's place too, and read its first head_dim_v columns as the values."""
    extras = dict(extras or {})
    cache_len = int(extras.pop("cache_len", 0))
    table = extras.pop("block_table", None)
    pr = dataclasses.replace(run_problem(p), head_dim_v=p.head_dim_v)  # (decode's head_dim_v: the latent cache)
    plan = forms.decode_plan(pr, num_splits, _sm_count(), wgmma=False)  # (the twins mirror the mma.sync forms)
    resolved = _resolve(list(plan.launches), "decode")
    xp = _xp()
    prep = prepare(p, extras, q, k_cache)
    q, kc = prep.arrays
    vc = kc if v_cache is None else prepare(p, {}, v_cache).arrays[0]
    if p.new_keys:
        kn = _kernel_dtype(_on_device(k_new))
        vn = kn if v_new is None else _kernel_dtype(_on_device(v_new))
    else:
        kn = vn = xp.zeros((1, 1, 1, 1), kc.dtype)
    tab = xp.ascontiguousarray(_on_device(table).astype(np.int32)) if table is not None else xp.zeros((1, 1), np.int32)
    out = xp.empty((*q.shape[:3], pr.value_head_dim), dtype=q.dtype)
    lse = xp.empty((pr.batch, pr.heads, pr.seqlen_q), dtype=np.float32)
    o_ws = xp.zeros((plan.partials,) + out.shape, np.float32)
    m_ws = xp.zeros((plan.partials, pr.batch, pr.heads, pr.seqlen_q), np.float32)
    counters = xp.zeros(plan.row_groups, np.int32)  # (zeroed per call: the twins cache nothing)
    params = _params(DecodeParams, pr, scale, extras, has_table=table is not None, page_size=pr.page_size,
                     num_splits=plan.num_splits, new_keys=pr.new_keys, cache_capacity=pr.seqlen_k,
                     num_pages=int(kc.shape[0]) if table is not None else 0, cache_len=cache_len,
                     split_appends=plan.split_appends, num_partials=plan.partials, has_counters=plan.fused,
                     head_dim_v=pr.value_head_dim)
    cu_q, cu_k, used_k, slopes, sinks = prep.features
    _run_plan(resolved, (params, q, kc, vc, kn, vn, out, lse, cu_q, cu_k, used_k, slopes, sinks, tab, o_ws, m_ws,
                         counters))
    return _result(out, p.dtype), lse


# ---------------------------------------------------------------- the simulator: one launch at a time
SimulatorProgress = Callable[[str, dict], None]
simulator_progress: SimulatorProgress | None = None
"""Called on the simulator as ``simulator_progress(event, info)`` with event 'start' (info: kernel, grid,
threads, ctas), 'cta' (info: done, ctas, elapsed_s) after every CTA, and 'done' (info: elapsed_s); None: silent."""


_NO_SWAP = contextlib.nullcontext()


def _simulator_internals():
    """numba-cuda's simulator kernel module, or None when it lacks what ``_simulated_launch`` replaces."""
    try:
        from numba.cuda.simulator import kernel as sim
    except ImportError:
        return None
    needed = ("swapped_cuda_module", "BlockManager", "FakeCUDAKernel")
    return sim if all(hasattr(sim, name) for name in needed) else None


def _twin_modules() -> list[dict]:
    """The globals of every twin module imported so far (``rawflash.numba_kernels.*``)."""
    prefix = "rawflash.numba_kernels."
    return [m.__dict__ for name, m in list(sys.modules.items()) if name.startswith(prefix) and m is not None]


@contextlib.contextmanager
def _simulated_launch(kernel, grid, threads: int):
    """One simulated launch without the simulator's per-call module lock, with progress per CTA.

    Numba's simulator runs every CUDA thread as a Python thread, and every call of a device function goes through
    ``swapped_cuda_module``, which takes a lock of the function's module twice to swap that module's ``cuda``
    global for the launch's fake module and back (tens of thousands of times for a tiny backward). With a CTA of
    128 threads calling the verbs of ``numba_kernels.common`` at once, the lock convoys: its holder loses the GIL,
    the others queue on it, and each hand-over waits for the OS to run the next waiter, which on a busy machine is
    milliseconds. Here the twin modules' ``cuda`` global is set to the launch's fake module once, when the kernel
    itself enters, and device calls of twin functions skip the swap (they need nothing swapped: their module
    already sees the fake module); anything else keeps numba's own swap. Restored when the launch returns.
    """
    sim = _simulator_internals()
    if sim is None:
        yield
        return
    import numba.cuda as real_cuda

    twins = _twin_modules()
    twin_ids = {id(g) for g in twins}
    original_swap, original_manager = sim.swapped_cuda_module, sim.BlockManager
    state = {"pinned": False, "done": 0, "t0": time.perf_counter()}
    ctas = int(np.prod(grid)) if not isinstance(grid, int) else int(grid)
    name = getattr(kernel, "__name__", "kernel")
    report = simulator_progress

    @contextlib.contextmanager
    def pin(fake):  # entered once, by FakeCUDAKernel.__call__ for the kernel itself, before any thread starts
        names = [(g, k) for g in twins for k, v in g.items() if v is real_cuda]
        for g, k in names:
            g[k] = fake
        state["pinned"] = True
        try:
            yield
        finally:
            state["pinned"] = False
            for g, k in names:
                g[k] = real_cuda

    def swap(fn, fake):
        module = getattr(fn, "__globals__", None)
        if module is None or id(module) not in twin_ids:
            return original_swap(fn, fake)
        return _NO_SWAP if state["pinned"] else pin(fake)

    class CountingManager(original_manager):
        def run(self, *args, **kwargs):
            out = super().run(*args, **kwargs)
            state["done"] += 1
            if report:
                report("cta", {"kernel": name, "done": state["done"], "ctas": ctas,
                               "elapsed_s": time.perf_counter() - state["t0"]})
            return out

    if report:
        report("start", {"kernel": name, "grid": tuple(grid) if not isinstance(grid, int) else (grid,),
                         "threads": threads, "ctas": ctas})
    sim.swapped_cuda_module, sim.BlockManager = swap, CountingManager
    try:
        yield
    finally:
        sim.swapped_cuda_module, sim.BlockManager = original_swap, original_manager
        if report:
            report("done", {"kernel": name, "elapsed_s": time.perf_counter() - state["t0"]})


# ---------------------------------------------------------------- what the twins launch, without launching
@dataclasses.dataclass(frozen=True)
class TwinLaunch:
    """One launch of a Numba twin: grid and tiles from the plan (``launch.py``), CTA size and (float32) shared
    memory from the twin module, exactly as ``forward`` and ``backward`` pass them to ``run``."""

    kernel: str
    grid: tuple[int, int, int]
    threads: int
    smem: int
    config: launch.TileConfig | None = None

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def twin_launches(p: Problem, kernel: str = "fa2", direction: str = "fwd", deterministic: bool = False,
                  switches: forms.Switches | None = None, **flags: bool) -> list[TwinLaunch]:
    """Every launch ``forward`` (direction 'fwd'), ``backward`` ('bwd') or both ('both') make for the caller's
    problem ``p``, in order; nothing is allocated or run (the twins are built, not compiled), and no GPU is needed.

    ``switches`` (or the same as keyword ``flags``: defer_norm, seq_parallel, split_q) are the forward's. Follows
    ``run_problem`` and the plans above: the same ``_resolve`` gives the threads and shared memory the backend
    launches with; tests/test_simulator.py checks the list against the launches the simulator records.
    """
    pr = run_problem(p)
    sw = switches if switches is not None else forms.Switches(**flags)
    plan: list[Launch] = []
    if direction in ("fwd", "both"):
        plan += forward_plan(pr, kernel, sw)
    if direction in ("bwd", "both"):
        plan += backward_plan(pr, deterministic)
    return [TwinLaunch(lau.kernel, tuple(lau.grid), int(threads), int(twin.smem), lau.config)
            for lau, twin, threads in _resolve(plan, kernel)]
