"""The Numba backend: the twins of ``rawflash/numba_kernels`` with the CUDA C kernels' grids and tile sizes.

Every grid comes from ``launch.py`` and every tile size from ``configs.py``, exactly as for the CUDA C; the twins'
CTA sizes and shared memory (float32 tiles) come from the twin modules. The same code runs in two places:

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
import math
import time
import warnings
from typing import Callable

import numpy as np
from numba import config as numba_config

from . import launch
from .cupy_backend import run_head_dim
from .launch import Problem
from .numba_kernels import fa1_fwd, fa2_bwd, fa2_fwd  # applies the numpy shim before numba.cuda is imported

SIMULATOR = bool(numba_config.ENABLE_CUDASIM)
# The twins favour clarity over occupancy (one thread per row); small test grids would warn on every launch.
numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
LOG2E = 1.0 / math.log(2.0)
STATIC_SMEM_LIMIT = 48 * 1024  # a CTA gets more dynamic shared memory only after raising its limit
SWITCHES = {"defer_norm": True, "seq_parallel": True, "split_q": True}


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
    """Inputs ready for the twins and the problem they run as (head_dim rounded up as for the CUDA C)."""

    problem: Problem
    arrays: tuple
    head_dim: int


def _require_device() -> None:
    """Refuse clearly, before anything is allocated, when there is neither a GPU nor the simulator."""
    from numba import cuda

    if not SIMULATOR and not cuda.is_available():
        raise RuntimeError("backend='numba' needs a CUDA GPU, or NUMBA_ENABLE_CUDASIM=1 set before numba is first "
                           "imported to run the kernels on Numba's CPU simulator")


def prepare(p: Problem, *arrays) -> Prepared:
    """Inputs on the device (NumPy on the simulator), bfloat16 upcast, head_dim zero-padded as for the CUDA C."""
    _require_device()
    hd = run_head_dim(p.head_dim)
    ready = tuple(_pad(_kernel_dtype(_on_device(x)), hd) for x in arrays)
    return Prepared(dataclasses.replace(p, head_dim=hd), ready, p.head_dim)


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


def _i64(*xs):
    return tuple(int(x) for x in xs)


# ---------------------------------------------------------------- forward
def _dims(pr: Problem) -> tuple[int, ...]:
    return _i64(pr.seqlen_q, pr.seqlen_k, pr.heads, pr.kv_heads, pr.head_dim)


def _fa2_forward(pr: Problem, q, k, v, out, lse, scale_log2, switches: dict) -> None:
    if switches.get("wgmma"):
        raise ValueError("wgmma=True: the warpgroup kernel has no Numba twin (the twin of fa2 is fa2_fwd's mma.sync "
                         "form); use backend='cupy'")
    ideas = {k: v for k, v in switches.items() if k in SWITCHES}
    sw = {**SWITCHES, **ideas}
    lau = launch.fa2_fwd(pr, **ideas, wgmma=False)
    c, d = lau.config, pr.padded_head_dim
    kernel = fa2_fwd.make_fa2_fwd(d, c.br, c.bc, c.warps, pr.causal, **sw)
    run(kernel, lau.grid, fa2_fwd.threads(c.br, c.warps, sw["split_q"]),
        fa2_fwd.smem_bytes(c.br, c.bc, c.warps, d, sw["split_q"]), q, k, v, out, lse, *_dims(pr), scale_log2)


def _fa1_forward(pr: Problem, q, k, v, out, lse, scale_log2) -> None:
    xp = _xp()
    o_ws = xp.zeros((pr.batch, pr.heads, pr.seqlen_q, pr.head_dim), dtype=np.float32)
    m_ws = xp.full((pr.batch, pr.heads, pr.seqlen_q), -np.inf, dtype=np.float32)
    l_ws = xp.zeros((pr.batch, pr.heads, pr.seqlen_q), dtype=np.float32)
    lau = launch.fa1_fwd(pr)
    c, d = lau.config, pr.padded_head_dim
    run(fa1_fwd.make_fa1_fwd(d, c.br, c.bc, c.warps, pr.causal), lau.grid, fa1_fwd.threads(c.br, c.warps),
        fa1_fwd.smem_bytes(c.br, c.bc, c.warps, d), q, k, v, o_ws, m_ws, l_ws, *_dims(pr), scale_log2)
    fin = launch.fa1_finalize(pr)
    run(fa1_fwd.fa1_finalize, fin.grid, fin.block[0], 0, o_ws, m_ws, l_ws, out, lse,
        *_i64(pr.batch, pr.seqlen_q, pr.heads, pr.head_dim))


def forward(p: Problem, q, k, v, scale: float, kernel: str = "fa2", **switches):
    """out (batch, seqlen_q, heads, head_dim) in q's dtype and lse (batch, heads, seqlen_q) float32.

    Same signature and semantics as ``cupy_backend.forward``; ``kernel`` is 'fa2' (with the ablation
    ``switches``) or 'fa1'. There is no Numba 'naive' kernel.
    """
    if kernel == "naive":
        raise NotImplementedError("kernel='naive' has no Numba twin (it is cuBLAS products around a softmax "
                                  "kernel); use backend='cupy' for it, or kernel='fa2' / 'fa1' with backend='numba'")
    if kernel not in ("fa2", "fa1"):
        raise ValueError(f"kernel must be one of 'fa2', 'fa1', 'naive', got {kernel!r}")
    xp = _xp()
    prep = prepare(p, q, k, v)
    pr, (q, k, v) = prep.problem, prep.arrays
    out = xp.empty((pr.batch, pr.seqlen_q, pr.heads, pr.head_dim), dtype=q.dtype)
    lse = xp.empty((pr.batch, pr.heads, pr.seqlen_q), dtype=np.float32)
    scale_log2 = np.float32(scale * LOG2E)
    if kernel == "fa2":
        _fa2_forward(pr, q, k, v, out, lse, scale_log2, switches)
    else:
        _fa1_forward(pr, q, k, v, out, lse, scale_log2)
    return _result(_trim(out, prep.head_dim), p.dtype), lse


# ---------------------------------------------------------------- backward
def _preprocess(p: Problem, pr: Problem, out, dout, lse):
    """lse2 = lse * log2(e) (+inf where lse = -inf) and delta = rowsum(dO * O), (batch, heads, seqlen_q) float32."""
    xp = _xp()
    out, dout = (_kernel_dtype(_on_device(x)) for x in (out, dout))
    lse = _on_device(lse).astype(np.float32)
    lse2 = xp.empty((pr.batch, pr.heads, pr.seqlen_q), dtype=np.float32)
    delta = xp.empty_like(lse2)
    lau = launch.fa2_bwd_preprocess(pr)
    run(fa2_bwd.fa2_bwd_preprocess, lau.grid, lau.block[0], 0, out, dout, lse, lse2, delta,
        *_i64(pr.batch, pr.seqlen_q, pr.heads, p.head_dim))
    return lse2, delta


def _fa2_dq_deterministic(pr: Problem, inputs: tuple, dq, scales: tuple) -> None:
    lau = launch.fa2_bwd_dq(pr)
    c, d = lau.config, pr.padded_head_dim
    run(fa2_bwd.make_fa2_bwd_dq(d, c.br, c.bc, c.warps, pr.causal), lau.grid, fa2_bwd.threads_dq(c.br),
        fa2_bwd.smem_bytes_dq(c.br, c.bc, d), *inputs, dq, *_dims(pr), *scales)


def backward(p: Problem, dout, q, k, v, out, lse, scale: float, deterministic: bool = False):
    """dq, dk, dv with the shapes and dtype of q, k, v (same signature and semantics as ``cupy_backend.backward``)."""
    xp = _xp()
    prep = prepare(p, q, k, v, dout)
    pr, (q, k, v, do) = prep.problem, prep.arrays
    lse2, delta = _preprocess(p, pr, out, dout, lse)
    dq = xp.empty((pr.batch, pr.seqlen_q, pr.heads, pr.head_dim), dtype=q.dtype)
    dk = xp.empty((pr.batch, pr.seqlen_k, pr.kv_heads, pr.head_dim), dtype=q.dtype)
    dv = xp.empty_like(dk)
    inputs = (q, k, v, do, lse2, delta)
    scales = (np.float32(scale), np.float32(scale * LOG2E))
    atomic = not deterministic
    lau = launch.fa2_bwd(pr, atomic_dq=atomic, wgmma=False)  # the twin mirrors fa2_bwd (mma.sync tiles)
    c, d = lau.config, pr.padded_head_dim
    kernel = fa2_bwd.make_fa2_bwd(d, c.br, c.bc, c.warps, pr.causal, atomic_dq=atomic)
    # dq_ws: float32 dQ accumulated with atomic adds; the deterministic pass leaves it alone (any 4-D float32 array)
    shape = (pr.batch, pr.heads, pr.seqlen_q, pr.head_dim) if atomic else (1, 1, 1, 1)
    dq_ws = xp.zeros(shape, dtype=np.float32)
    run(kernel, lau.grid, fa2_bwd.threads(c.bc), fa2_bwd.smem_bytes(c.br, c.bc, d, atomic), *inputs, dk, dv, dq_ws,
        *_dims(pr), *scales)
    if deterministic:
        _fa2_dq_deterministic(pr, inputs, dq, scales)
    else:
        conv = launch.fa2_bwd_convert_dq(pr)
        run(fa2_bwd.fa2_bwd_convert_dq, conv.grid, conv.block[0], 0, dq_ws, dq,
            *_i64(pr.batch, pr.seqlen_q, pr.heads, pr.head_dim))
    return tuple(_result(_trim(g, prep.head_dim), p.dtype) for g in (dq, dk, dv))


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

    from .numba_kernels import common, splitk

    twins = [m.__dict__ for m in (common, splitk, fa1_fwd, fa2_fwd, fa2_bwd)]
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
    """One launch of a Numba twin: grid and tiles from ``launch.py``, CTA size and (float32) shared memory from the
    twin module, exactly as ``forward`` and ``backward`` pass them to ``run``."""

    kernel: str
    grid: tuple[int, int, int]
    threads: int
    smem: int
    config: launch.TileConfig | None = None

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def twin_launches(p: Problem, kernel: str = "fa2", direction: str = "fwd", deterministic: bool = False,
                  **switches) -> list[TwinLaunch]:
    """Every launch ``forward`` (direction 'fwd'), ``backward`` ('bwd') or both ('both') make for the caller's
    problem ``p``, in order; nothing is allocated or run, and no GPU is needed.

    Follows ``prepare`` (head_dim rounded up as for the CUDA C, the problem's arch unchanged) and the launch code
    above; tests/test_simulator.py checks it against the launches the simulator records.
    """
    pr = dataclasses.replace(p, head_dim=run_head_dim(p.head_dim))
    d = pr.padded_head_dim
    out: list[TwinLaunch] = []

    def add(name, lau, threads, smem):
        out.append(TwinLaunch(name, tuple(lau.grid), int(threads), int(smem), lau.config))

    if direction in ("fwd", "both"):
        if kernel == "fa2":
            if switches.get("wgmma"):
                raise ValueError("wgmma=True: the warpgroup kernel has no Numba twin; use backend='cupy'")
            ideas = {k: v for k, v in switches.items() if k in SWITCHES}
            sw = {**SWITCHES, **ideas}
            lau = launch.fa2_fwd(pr, **ideas, wgmma=False)
            c = lau.config
            add("fa2_fwd", lau, fa2_fwd.threads(c.br, c.warps, sw["split_q"]),
                fa2_fwd.smem_bytes(c.br, c.bc, c.warps, d, sw["split_q"]))
        elif kernel == "fa1":
            lau = launch.fa1_fwd(pr)
            c = lau.config
            add("fa1_fwd", lau, fa1_fwd.threads(c.br, c.warps), fa1_fwd.smem_bytes(c.br, c.bc, c.warps, d))
            fin = launch.fa1_finalize(pr)
            add("fa1_finalize", fin, fin.block[0], 0)
        else:
            raise NotImplementedError(f"kernel={kernel!r} has no Numba twin (only 'fa2' and 'fa1' do)")
    if direction in ("bwd", "both"):
        pre = launch.fa2_bwd_preprocess(pr)
        add("fa2_bwd_preprocess", pre, pre.block[0], 0)
        atomic = not deterministic
        lau = launch.fa2_bwd(pr, atomic_dq=atomic, wgmma=False)
        c = lau.config
        add("fa2_bwd", lau, fa2_bwd.threads(c.bc), fa2_bwd.smem_bytes(c.br, c.bc, d, atomic))
        if deterministic:
            dq = launch.fa2_bwd_dq(pr)
            c = dq.config
            add("fa2_bwd_dq", dq, fa2_bwd.threads_dq(c.br), fa2_bwd.smem_bytes_dq(c.br, c.bc, d))
        else:
            conv = launch.fa2_bwd_convert_dq(pr)
            add("fa2_bwd_convert_dq", conv, conv.block[0], 0)
    return out
