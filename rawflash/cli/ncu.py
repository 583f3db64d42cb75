"""Measured DRAM bytes of one call, through Nsight Compute (``ncu``), to set beside ``iomodel``'s prediction.

``measure`` runs this module as a child process under ``ncu --profile-from-start off``: the child builds the
inputs (and, for a backward, runs the forward) unprofiled, then profiles exactly the launches of one call between
``cudaProfilerStart`` and ``cudaProfilerStop``. ncu flushes the caches before every kernel by default, which is
what the model assumes.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12, "b": 1, "kb": 1e3, "mb": 1e6,
         "gb": 1e9}


class Unavailable(RuntimeError):
    """Measuring is impossible here (no GPU, no ncu); the message says which."""


def ncu_path() -> str | None:
    return shutil.which("ncu")


def command(ncu: str, log: str, problem: dict, kernel: str, direction: str) -> list[str]:
    """The ncu command line that profiles one call of ``kernel`` in ``direction`` on ``problem``."""
    spec = json.dumps({"problem": problem, "kernel": kernel, "direction": direction})
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics", ",".join(METRICS),
            "--csv", "--print-units", "base", "--log-file", log, sys.executable, "-m", "rawflash.cli.ncu", spec]


def parse(text: str) -> dict:
    """Sum each metric over the profiled kernels of ncu's ``--csv`` output; also count the kernels."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Metric Name"' in line and '"Metric Value"' in line), None)
    if start is None:
        raise ValueError("no metric table in ncu's output:\n" + text[-2000:])
    totals = {m: 0.0 for m in METRICS}
    kernels = set()
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        name = row.get("Metric Name")
        if name in totals:
            unit = UNITS.get((row.get("Metric Unit") or "byte").strip().lower(), 1)
            totals[name] += float(row["Metric Value"].replace(",", "")) * unit
            kernels.add(row.get("ID"))
    return {"read_bytes": totals[METRICS[0]], "write_bytes": totals[METRICS[1]], "kernels": len(kernels)}


def require() -> str:
    """The path of ncu; Unavailable (saying what is missing) without a GPU or without ncu on PATH."""
    from . import sysinfo

    if not sysinfo.gpu_available():
        raise Unavailable("measuring DRAM bytes needs a CUDA GPU and none is visible")
    ncu = ncu_path()
    if ncu is None:
        raise Unavailable("measuring DRAM bytes needs Nsight Compute: 'ncu' is not on PATH")
    return ncu


def measure(problem, kernel: str, direction: str, timeout: float = 600) -> dict:
    """Measured DRAM bytes read and written by one call; Unavailable when no GPU or no ncu."""
    from . import sysinfo

    ncu = require()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        done = subprocess.run(command(ncu, log, dataclasses.asdict(problem), kernel, direction), capture_output=True,
                              text=True, timeout=timeout, env=sysinfo.child_env())
        text = open(log).read() if os.path.exists(log) else ""
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed (exit {done.returncode}): {(done.stderr or text or done.stdout)[-1500:]}")
    return parse(text if '"Metric Name"' in text else done.stdout)


def _profiled_call(spec: dict) -> None:
    """The child: inputs and any forward unprofiled, then exactly one call between profiler start and stop."""
    import cupy

    import rawflash
    from rawflash.cli import accuracy
    from rawflash.problem import Problem

    p = Problem(**spec["problem"])
    x = {k: cupy.asarray(v) for k, v in accuracy.random_inputs(p).items()}
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    if spec["direction"] == "fwd":
        def call():
            return rawflash.forward(q, k, v, causal=p.causal, kernel=spec["kernel"])
    else:
        out, lse = rawflash.forward(q, k, v, causal=p.causal)

        def call():
            return rawflash.backward(dout, q, k, v, out, lse, causal=p.causal)
    call()  # compile and warm up outside the profiled range
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    call()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    _profiled_call(json.loads(sys.argv[1]))
