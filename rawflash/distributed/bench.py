"""The ring benchmark: time per step on 1 GPU and on P GPUs, scaling efficiency, and how much transfer is hidden.

For a sequence of length N (one step = one forward, or one forward plus backward, of the whole sequence):

- ``single_*_ms``: :func:`rawflash.forward` / ``backward`` of the whole sequence on one GPU;
- ``ring_*_ms``: the ring on P GPUs over NCCL (the slowest rank's time, median over repeats);
- ``efficiency_*`` = single / (P * ring): 1.0 is perfect scaling;
- ``compute_*_ms``: the same ring with the transfers skipped (:class:`~rawflash.distributed.ComputeOnly`),
  ``comm_*_ms``: the ring's transfers alone, in the ring's order; ``hidden_*`` = 1 - (ring - compute) / comm,
  the fraction of the transfer time that overlapped with compute (1.0: all of it).

How ``rawflash bench --ring`` calls it (the CLI's process never touches a GPU; every measurement runs in a
subprocess, the ring ones under ``python -m rawflash.distributed.run``)::

    from rawflash.distributed import bench as ring_bench
    rows = ring_bench.bench_ring(gpus=(2, 4, 8), seqlens=(131072, 524288), heads=16, kv_heads=16,
                                 head_dim=128, dtype="bfloat16", causal=True, layout="zigzag", repeats=10)
    click.echo(report.table(ring_bench.summary_columns(rows)))      # and json.dumps(rows) for --json

Each rank can also be run by hand: ``python -m rawflash.distributed.run --gpus 8 -m rawflash.distributed.bench
--seqlen 131072 --json ring8.json`` (and ``python -m rawflash.distributed.bench --single ...`` for one GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from ..cli import iomodel
from .comm import ComputeOnly, Communicator
from .ring import ring_attention, ring_attention_backward
from .sharding import check_layout, num_chunks

_MODULE = "rawflash.distributed.bench"     # what the measurement subprocesses run (python -m)


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark problem: the whole sequence's shape (every rank holds seqlen / P tokens of it)."""

    seqlen: int
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    causal: bool = True
    layout: str = "zigzag"
    batch: int = 1
    repeats: int = 10
    warmup: int = 2

    def args(self) -> list[str]:
        """The command-line form, for :func:`main`."""
        return ["--seqlen", str(self.seqlen), "--heads", str(self.heads), "--kv-heads", str(self.kv_heads),
                "--head-dim", str(self.head_dim), "--dtype", self.dtype, "--layout", self.layout, "--batch",
                str(self.batch), "--repeats", str(self.repeats), "--warmup", str(self.warmup),
                "--causal" if self.causal else "--no-causal"]

    def flops(self, direction: str) -> float:
        shape = iomodel.Shape(self.batch, self.seqlen, self.seqlen, self.heads, self.kv_heads, self.head_dim, 2,
                              self.causal)
        return float(iomodel.flops(shape, direction))


# ---------------------------------------------------------------- timing (on GPUs)
def time_single(cfg: Config) -> dict:
    """Forward and forward + backward of the whole sequence on the current GPU: ``{'fwd_ms', 'fwdbwd_ms'}``."""
    import rawflash

    q, k, v, dout = _inputs(cfg, cfg.seqlen, seed=0)

    def fwdbwd():
        out, lse = rawflash.forward(q, k, v, causal=cfg.causal)
        rawflash.backward(dout, q, k, v, out, lse, causal=cfg.causal)

    return {"fwd_ms": _median_ms(lambda: rawflash.forward(q, k, v, causal=cfg.causal), cfg),
            "fwdbwd_ms": _median_ms(fwdbwd, cfg)}


def time_ring(comm: Communicator, cfg: Config) -> dict:
    """Ring forward and forward + backward on every rank of ``comm`` (all ranks call it); the same dict on each.

    Keys: ``ring_fwd_ms``, ``ring_fwdbwd_ms`` (with transfers), ``compute_fwd_ms``, ``compute_fwdbwd_ms``
    (without), ``comm_fwd_ms``, ``comm_fwdbwd_ms`` (transfers alone); each the slowest rank's, median of repeats.
    """
    import cupy

    world = comm.world_size
    q, k, v, dout = _inputs(cfg, cfg.seqlen // world, seed=1 + comm.rank)   # timing does not depend on values
    opts = dict(causal=cfg.causal, layout=cfg.layout)

    def fwd(c):
        return lambda: ring_attention(q, k, v, c, **opts)

    def fwdbwd(c):
        def step():
            out, lse = ring_attention(q, k, v, c, **opts)
            ring_attention_backward(dout, q, k, v, out, lse, c, **opts)
        return step

    def transfers(backward: bool):
        def step():
            kv = [k, v]
            for _ in range(world - 1):                       # forward: the K/V block travels P-1 times
                kv = comm.ring_pass(kv).wait()
            if backward:                                     # backward: K/V again, and float32 dK, dV P times
                kv, dkv = [k, v], [cupy.zeros(k.shape, cupy.float32), cupy.zeros(v.shape, cupy.float32)]
                for s in range(world):
                    pending = comm.ring_pass(kv) if s + 1 < world else None
                    dkv = comm.ring_pass(dkv).wait()
                    if pending is not None:
                        kv = pending.wait()
        return step

    return {"ring_fwd_ms": _median_ms(fwd(comm), cfg, comm), "ring_fwdbwd_ms": _median_ms(fwdbwd(comm), cfg, comm),
            "compute_fwd_ms": _median_ms(fwd(ComputeOnly(comm)), cfg, comm),
            "compute_fwdbwd_ms": _median_ms(fwdbwd(ComputeOnly(comm)), cfg, comm),
            "comm_fwd_ms": _median_ms(transfers(False), cfg, comm),
            "comm_fwdbwd_ms": _median_ms(transfers(True), cfg, comm)}


def _inputs(cfg: Config, seqlen: int, seed: int):
    import cupy

    dt = np.dtype(ml_dtypes.bfloat16) if cfg.dtype == "bfloat16" else np.dtype(cfg.dtype)
    rng = cupy.random.default_rng(seed)
    shape_q = (cfg.batch, seqlen, cfg.heads, cfg.head_dim)
    shape_k = (cfg.batch, seqlen, cfg.kv_heads, cfg.head_dim)
    return tuple(rng.standard_normal(s, dtype=cupy.float32).astype(dt) for s in (shape_q, shape_k, shape_k, shape_q))


def _median_ms(fn: Callable[[], object], cfg: Config, comm: Communicator | None = None) -> float:
    """Median CUDA-event time of ``fn`` over ``cfg.repeats`` (after ``cfg.warmup`` calls); with ``comm``, every
    repeat starts together on all ranks (a barrier) and counts as long as its slowest rank."""
    import cupy

    for _ in range(cfg.warmup):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(cfg.repeats):
        if comm is not None:
            comm.all_max(0.0)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, stop)
        times.append(comm.all_max(ms) if comm is not None else ms)
    return statistics.median(times)


# ---------------------------------------------------------------- the driver (no GPU in this process)
def summarize(cfg: Config, gpus: int, single: dict | None, ring: dict | None, status: str = "ok") -> dict:
    """One result row: the timings, efficiencies, hidden fractions and TFLOP/s per GPU (None where missing)."""
    row = {"seqlen": cfg.seqlen, "gpus": gpus, "layout": cfg.layout, "causal": cfg.causal, "dtype": cfg.dtype,
           "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "batch": cfg.batch}
    single, ring = single or {}, ring or {}
    for d in ("fwd", "fwdbwd"):
        one, many = single.get(f"{d}_ms"), ring.get(f"ring_{d}_ms")
        compute, comm = ring.get(f"compute_{d}_ms"), ring.get(f"comm_{d}_ms")
        flops = cfg.flops("fwd") + (cfg.flops("bwd") if d == "fwdbwd" else 0.0)
        row[f"single_{d}_ms"] = one
        row[f"ring_{d}_ms"] = many
        row[f"efficiency_{d}"] = one / (gpus * many) if one and many else None
        row[f"ring_{d}_tflops_per_gpu"] = flops / (many * 1e-3) / gpus / 1e12 if many else None
        row[f"compute_{d}_ms"], row[f"comm_{d}_ms"] = compute, comm
        row[f"hidden_{d}"] = (min(1.0, max(0.0, 1.0 - (many - compute) / comm))
                              if many and compute is not None and comm else None)
    row["status"] = status
    return row


def summary_columns(rows: Sequence[dict]) -> list[dict]:
    """The columns a text table shows (the JSON keeps every key)."""
    keep = ("seqlen", "gpus", "single_fwd_ms", "ring_fwd_ms", "efficiency_fwd", "hidden_fwd", "single_fwdbwd_ms",
            "ring_fwdbwd_ms", "efficiency_fwdbwd", "hidden_fwdbwd", "ring_fwdbwd_tflops_per_gpu", "status")
    return [{k: r.get(k) for k in keep} for r in rows]


def bench_ring(gpus: Sequence[int] = (2, 4, 8), seqlens: Sequence[int] = (131072,), *, heads: int = 16,
               kv_heads: int | None = None, head_dim: int = 128, dtype: str = "bfloat16", causal: bool = True,
               layout: str = "zigzag", batch: int = 1, repeats: int = 10, warmup: int = 2,
               timeout: float = 1200.0) -> list[dict]:
    """Time every (seqlen, P): a single-GPU baseline per seqlen, then the ring on each P of ``gpus``.

    Each measurement is a subprocess (the single-GPU one with ``--single``, the ring ones under the launcher);
    one that fails, times out (``timeout`` seconds), needs more GPUs than are visible, or whose seqlen does not
    cut evenly, gives a row whose ``status`` says why. Returns the rows of :func:`summarize`.
    """
    check_layout(layout)
    visible = _visible_gpus()
    rows = []
    for n in seqlens:
        cfg = Config(n, heads, heads if kv_heads is None else kv_heads, head_dim, dtype, causal, layout, batch,
                     repeats, warmup)
        single, single_why = (_measure([sys.executable, "-m", _MODULE, "--single", *cfg.args()], timeout)
                              if visible else (None, "skipped: no GPU visible"))
        for p in gpus:
            ring, ring_why = None, None
            if p > visible:
                ring_why = f"skipped: needs {p} GPUs, {visible} visible"
            elif n % num_chunks(layout, p):
                ring_why = f"skipped: seqlen {n} does not cut into {num_chunks(layout, p)} equal chunks"
            else:
                ring, ring_why = _measure([sys.executable, "-m", "rawflash.distributed.run", "--gpus", str(p), "-m",
                                           _MODULE, *cfg.args()], timeout)
            problems = [f"{what}: {why}" for what, why in (("single", single_why), ("ring", ring_why)) if why]
            rows.append(summarize(cfg, p, single, ring, "; ".join(problems) or "ok"))
    return rows


def _visible_gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _measure(command: list[str], timeout: float) -> tuple[dict | None, str | None]:
    """Run ``command --json FILE``; (its JSON, None) or (None, why it failed)."""
    with tempfile.TemporaryDirectory(prefix="rawflash-ring-bench-") as tmp:
        path = os.path.join(tmp, "result.json")
        proc = subprocess.Popen([*command, "--json", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()                  # the launcher stops its ranks on SIGTERM
            proc.communicate()
            return None, f"timed out after {timeout:g} s"
        if proc.returncode != 0 or not os.path.exists(path):
            tail = " | ".join(output.strip().splitlines()[-3:])
            return None, f"exit {proc.returncode}: {tail[-300:]}"
        with open(path) as fh:
            return json.load(fh), None


# ---------------------------------------------------------------- entry point of one measurement
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rawflash.distributed.bench",
                                     description="Time ring attention (under python -m rawflash.distributed.run) "
                                                 "or, with --single, the whole sequence on one GPU.")
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--seqlen", type=int, required=True)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", dest="json_path", help="write the result here (rank 0)")
    a = parser.parse_args(argv)
    cfg = Config(a.seqlen, a.heads, a.kv_heads, a.head_dim, a.dtype, a.causal, a.layout, a.batch, a.repeats,
                 a.warmup)
    if a.single:
        result, rank = time_single(cfg), 0
    else:
        from .comm import NcclComm

        with NcclComm.from_env() as comm:
            result, rank = time_ring(comm, cfg), comm.rank
    if rank == 0:
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if a.json_path:
            with open(a.json_path, "w") as fh:
                fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
