"""What a call costs on the host, beside what its kernels cost on the GPU (``rawflash bench --host``).

For each case (forward, backward and decode at shapes a model calls per layer), with CuPy inputs and a warm plan
cache, and PyTorch's SDPA beside it in the same process when PyTorch is importable:

- host: microseconds of Python per public call, a loop of ``calls`` calls queued back to back with one
  synchronisation at the end, timed on the host clock up to the return of the last call (the GPU works behind);
- call: the public call's time on the GPU clock (CUDA events around the same loop, no L2 flush between calls,
  so a host slower than the kernels shows);
- kernels: the same call captured once in a CUDA graph and replayed (the kernels alone, no host in between);
- first: milliseconds of the case's first call (a new signature: validated, planned, its kernels compiled or
  loaded from the disk cache when the process has not loaded them yet, launched), up to its return.

Every rawflash case is first checked against the float64 reference by flash-attn's rule on its own inputs.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from .bench import time_kernels_ms


@dataclasses.dataclass(frozen=True)
class HostCase:
    name: str
    direction: str     # "fwd", "bwd" or "decode"
    batch: int
    seqlen_q: int
    seqlen_k: int      # decode: the keys in each sequence's cache
    heads: int
    kv_heads: int
    head_dim: int = 128
    causal: bool = True


CASES = (
    HostCase("fwd 1x512 h16 causal", "fwd", 1, 512, 512, 16, 16),
    HostCase("fwd 4x1024 h16 causal", "fwd", 4, 1024, 1024, 16, 16),
    HostCase("fwd 8x1024 h16 full", "fwd", 8, 1024, 1024, 16, 16, causal=False),
    HostCase("bwd 1x512 h16 causal", "bwd", 1, 512, 512, 16, 16),
    HostCase("bwd 4x1024 h16 causal", "bwd", 4, 1024, 1024, 16, 16),
    HostCase("decode 16x16384 MQA 32/1", "decode", 16, 1, 16384, 32, 1),
    HostCase("decode 64x1024 GQA 32/8", "decode", 64, 1, 1024, 32, 8),
)


def _inputs(case: HostCase, seed: int = 0):
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    kv_rows = case.seqlen_k + (8 if case.direction == "decode" else 0)
    q = rng.standard_normal((case.batch, case.seqlen_q, case.heads, case.head_dim)).astype(bf16)
    k = rng.standard_normal((case.batch, kv_rows, case.kv_heads, case.head_dim)).astype(bf16)
    v = rng.standard_normal((case.batch, kv_rows, case.kv_heads, case.head_dim)).astype(bf16)
    return [cupy.asarray(x) for x in (q, k, v)]


def rawflash_call(case: HostCase):
    """A closure making one public call of the case, and a check of its result against the reference."""
    import cupy

    import rawflash
    from .. import reference

    q, k, v = _inputs(case)
    if case.direction == "decode":
        lens = cupy.full(case.batch, case.seqlen_k, dtype=cupy.int32)

        def call():
            return rawflash.decode(q, k, v, cache_seqlens=lens)

        def check(out):
            host = int(case.seqlen_k)
            want, _ = reference.forward(q.get()[:, :, :, :], k.get()[:, :host], v.get()[:, :host], causal=True)
            return float(np.max(np.abs(out.get().astype(np.float64) - want)))
        return call, check
    if case.direction == "fwd":
        def call():
            return rawflash.forward(q, k, v, causal=case.causal)

        def check(res):
            want, _ = reference.forward(q.get(), k.get(), v.get(), causal=case.causal)
            return float(np.max(np.abs(res[0].get().astype(np.float64) - want)))
        return call, check
    dout = cupy.asarray(_inputs(case, seed=1)[0])
    out, lse = rawflash.forward(q, k, v, causal=case.causal)

    def call():
        return rawflash.backward(dout, q, k, v, out, lse, causal=case.causal)

    def check(res):
        want = reference.backward(dout.get(), q.get(), k.get(), v.get(), causal=case.causal)
        return max(float(np.max(np.abs(g.get().astype(np.float64) - w))) for g, w in zip(res, want))
    return call, check


def torch_call(case: HostCase):
    """PyTorch SDPA's same call (its default backend choice), or None without PyTorch or a decode it has no
    cache form for (the decode case runs SDPA over the cache's keys: the same bytes)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    q, k, v = (torch.randn(case.batch, case.heads if i == 0 else case.kv_heads,
                           case.seqlen_q if i == 0 else case.seqlen_k, case.head_dim, device="cuda",
                           dtype=torch.bfloat16) for i in range(3))
    gqa = case.heads != case.kv_heads
    causal = case.causal and case.direction != "decode"
    if case.direction in ("fwd", "decode"):
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _sync(torch_side: bool):
    if torch_side:
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.Device().synchronize()


def _host_us(fn, calls: int, torch_side: bool) -> float:
    _sync(torch_side)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    _sync(torch_side)
    return (t1 - t0) / calls * 1e6


def _call_us(fn, calls: int, torch_side: bool) -> float:
    if torch_side:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls * 1e3
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / calls * 1e3


def measure(cases=CASES, calls: int = 100, repeats: int = 5, progress=None) -> list[dict]:
    """One row per case: rawflash's host / call / kernels microseconds (medians of ``repeats``), its check, and
    PyTorch's host / call microseconds where present."""
    rows = []
    for case in cases:
        call, check = rawflash_call(case)
        t0 = time.perf_counter()
        res = call()  # a new signature: validated, planned (its kernels compiled or loaded from disk), launched
        first = (time.perf_counter() - t0) * 1e3
        error = check(res)
        for _ in range(3):
            call()
        host = statistics.median(_host_us(call, calls, False) for _ in range(repeats))
        timed = statistics.median(_call_us(call, calls, False) for _ in range(repeats))
        kernels = time_kernels_ms(call, repeats=repeats) * 1e3
        row = {"case": case.name, "direction": case.direction, "max_abs_error": error, "first_ms": first,
               "host_us": host,
               "call_us": timed, "kernels_us": kernels}
        peer = torch_call(case)
        if peer is not None:
            for _ in range(3):
                peer()
            row["torch_host_us"] = statistics.median(_host_us(peer, calls, True) for _ in range(repeats))
            row["torch_call_us"] = statistics.median(_call_us(peer, calls, True) for _ in range(repeats))
        rows.append(row)
        if progress:
            progress(format_row(row))
    return rows


def format_row(row: dict) -> str:
    torch_part = (f"  torch host {row['torch_host_us']:7.1f}  call {row['torch_call_us']:8.1f}"
                  if "torch_host_us" in row else "")
    return (f"{row['case']:28s} host {row['host_us']:7.1f} us  call {row['call_us']:8.1f}  kernels "
            f"{row['kernels_us']:8.1f}  call/kernels {row['call_us'] / row['kernels_us']:5.2f}{torch_part}  "
            f"first {row.get('first_ms', float('nan')):6.2f} ms"
            f"(max |err| {row['max_abs_error']:.2g})")
