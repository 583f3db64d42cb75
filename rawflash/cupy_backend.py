"""The CUDA C backend: prepares CuPy arrays, allocates outputs and work buffers, and launches the kernels.

Every grid, block and shared-memory size comes from ``launch.py``; this module only binds arrays to arguments.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from . import _compile, launch
from .arrays import element_strides, kernel_ready, pad_head_dim
from .launch import Launch, Problem

LOG2E = 1.0 / math.log(2.0)
HEAD_DIM_MULTIPLE = 8  # the kernels move head_dim in 16-byte chunks and store pairs: other sizes are zero-padded


def run_head_dim(head_dim: int) -> int:
    """The head_dim the kernels see: the caller's, rounded up to a multiple of 8 (padding copies the inputs)."""
    return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def device_arch() -> str:
    """'sm_90' for an H100 / H200, 'sm_80' for an A100, ... (the current CuPy device), which picks the tile rows.

    ``RAWFLASH_TILE_ARCH=sm_80`` makes a GPU use another architecture's rows (the code is still compiled for the
    GPU at hand): how the sm_80 rows are tested on an H200.
    """
    import cupy

    return os.environ.get("RAWFLASH_TILE_ARCH") or f"sm_{cupy.cuda.Device().compute_capability}"


def run(lau: Launch, args: tuple) -> None:
    """Launch one kernel on CuPy's current stream, raising its dynamic shared-memory limit when needed."""
    import cupy

    limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    if lau.smem > limit:
        raise ValueError(f"{lau.name_expression} needs {lau.smem} B of shared memory per block and this GPU allows "
                         f"{limit} B: its tile row in rawflash/configs.py does not fit this GPU")
    fn = _compile.get_kernel(lau.source, lau.name_expression, lau.target)
    if lau.smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < lau.smem:
        fn.max_dynamic_shared_size_bytes = lau.smem
    fn(lau.grid, lau.block, args, shared_mem=lau.smem)


def _i32(*xs):
    return tuple(np.int32(x) for x in xs)


def _bsh(x):
    """(batch, seq, head) strides in elements: the order every kernel takes them in."""
    s = element_strides(x)
    return tuple(np.int64(v) for v in s[:3])


@dataclasses.dataclass
class Prepared:
    """Inputs ready for the kernels and the problem they run as (head_dim possibly padded)."""

    problem: Problem
    arrays: tuple
    head_dim: int


def prepare(p: Problem, *arrays) -> Prepared:
    import cupy

    hd = run_head_dim(p.head_dim)
    chunk = 16 // np.dtype(arrays[0].dtype).itemsize
    ready = tuple(kernel_ready(pad_head_dim(cupy.asarray(x), hd), chunk) for x in arrays)
    return Prepared(dataclasses.replace(p, head_dim=hd, arch=device_arch()), ready, p.head_dim)


def _trim(x, head_dim: int):
    import cupy

    return x if x.shape[-1] == head_dim else cupy.ascontiguousarray(x[..., :head_dim])


def forward(p: Problem, q, k, v, scale: float, kernel: str = "fa2", **switches):
    """out (batch, seqlen_q, heads, head_dim) in q's dtype and lse (batch, heads, seqlen_q) float32."""
    import cupy

    prep = prepare(p, q, k, v)
    pr, (q, k, v) = prep.problem, prep.arrays
    out = cupy.empty((pr.batch, pr.seqlen_q, pr.heads, pr.head_dim), dtype=q.dtype)
    lse = cupy.empty((pr.batch, pr.heads, pr.seqlen_q), dtype=cupy.float32)
    dims = _i32(pr.seqlen_q, pr.seqlen_k, pr.heads, pr.kv_heads, pr.head_dim)
    if kernel == "fa2":
        run(launch.fa2_fwd(pr, **switches),
            (q, k, v, out, lse, *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(out), *dims, np.float32(scale * LOG2E)))
    elif kernel == "fa1":
        o_ws = cupy.zeros((pr.batch, pr.heads, pr.seqlen_q, pr.head_dim), dtype=cupy.float32)
        m_ws = cupy.full((pr.batch, pr.heads, pr.seqlen_q), -np.inf, dtype=cupy.float32)
        l_ws = cupy.zeros((pr.batch, pr.heads, pr.seqlen_q), dtype=cupy.float32)
        run(launch.fa1_fwd(pr), (q, k, v, o_ws, m_ws, l_ws, *_bsh(q), *_bsh(k), *_bsh(v), *dims,
                                 np.float32(scale * LOG2E)))
        run(launch.fa1_finalize(pr), (o_ws, m_ws, l_ws, out, lse, *_bsh(out),
                                      *_i32(pr.batch, pr.seqlen_q, pr.heads, pr.head_dim)))
    else:
        out = _naive_forward(pr, q, k, v, scale, lse)
    return _trim(out, prep.head_dim), lse


def _naive_forward(p: Problem, q, k, v, scale: float, lse):
    """Standard attention: S = Q K^T and O = P V by cuBLAS, S and P in HBM, the softmax kernel between."""
    import cupy

    g = p.heads // p.kv_heads
    qh = q.transpose(0, 2, 1, 3).reshape(p.batch, p.kv_heads, g, p.seqlen_q, p.head_dim)
    kt = k.transpose(0, 2, 3, 1)[:, :, None]                               # (b, kv_heads, 1, d, seqlen_k)
    s = _matmul(qh, kt)                                                     # (b, kv_heads, group, seqlen_q, seqlen_k)
    prob = cupy.empty_like(s)
    run(launch.naive_softmax(p), (s, prob, lse, np.int64(p.batch * p.heads * p.seqlen_q),
                                  *_i32(p.seqlen_q, p.seqlen_k), np.float32(scale * LOG2E), np.bool_(p.causal)))
    o = _matmul(prob, v.transpose(0, 2, 1, 3)[:, :, None])                 # (b, kv_heads, group, seqlen_q, d)
    return cupy.ascontiguousarray(o.reshape(p.batch, p.heads, p.seqlen_q, p.head_dim).transpose(0, 2, 1, 3))


def _matmul(a, b):
    """cuBLAS product in the input dtype; CuPy has no bfloat16 matmul, so bfloat16 goes through float32."""
    import cupy

    if a.dtype.itemsize == 2 and a.dtype != np.float16:
        return cupy.matmul(a.astype(cupy.float32), b.astype(cupy.float32)).astype(a.dtype)
    return cupy.matmul(a, b)


def backward(p: Problem, dout, q, k, v, out, lse, scale: float, deterministic: bool = False):
    """dq, dk, dv with the shapes and dtype of q, k, v."""
    import cupy

    prep = prepare(p, q, k, v, dout)
    pr, (q, k, v, do) = prep.problem, prep.arrays
    f32 = cupy.float32
    lse2 = cupy.empty((pr.batch, pr.heads, pr.seqlen_q), dtype=f32)
    delta = cupy.empty_like(lse2)
    out, dout = cupy.asarray(out), cupy.asarray(dout)
    run(launch.fa2_bwd_preprocess(pr), (out, dout, cupy.ascontiguousarray(cupy.asarray(lse), dtype=f32), lse2, delta,
                                        *_bsh(out), *_bsh(dout), *_i32(pr.batch, pr.seqlen_q, pr.heads, p.head_dim)))
    dq = cupy.empty((pr.batch, pr.seqlen_q, pr.heads, pr.head_dim), dtype=q.dtype)
    dk = cupy.empty((pr.batch, pr.seqlen_k, pr.kv_heads, pr.head_dim), dtype=q.dtype)
    dv = cupy.empty_like(dk)
    dims = _i32(pr.seqlen_q, pr.seqlen_k, pr.heads, pr.kv_heads, pr.head_dim)
    scales = (np.float32(scale), np.float32(scale * LOG2E))
    common = (*_bsh(q), *_bsh(k), *_bsh(v), *_bsh(do))
    if deterministic:
        run(launch.fa2_bwd(pr, atomic_dq=False), (q, k, v, do, lse2, delta, dk, dv, lse2, *common, *_bsh(dk),
                                                  *_bsh(dv), *dims, *scales))
        run(launch.fa2_bwd_dq(pr), (q, k, v, do, lse2, delta, dq, *common, *_bsh(dq), *dims, *scales))
    else:
        dq_ws = cupy.zeros((pr.batch, pr.heads, pr.seqlen_q, pr.head_dim), dtype=f32)
        run(launch.fa2_bwd(pr, atomic_dq=True), (q, k, v, do, lse2, delta, dk, dv, dq_ws, *common, *_bsh(dk),
                                                 *_bsh(dv), *dims, *scales))
        run(launch.fa2_bwd_convert_dq(pr), (dq_ws, dq, *_bsh(dq), *_i32(pr.batch, pr.seqlen_q, pr.heads, pr.head_dim)))
    hd = prep.head_dim
    return _trim(dq, hd), _trim(dk, hd), _trim(dv, hd)
