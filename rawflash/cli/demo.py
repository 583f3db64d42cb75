"""``rawflash demo``: the library's main job, on whatever this machine has.

With a GPU: forward and backward on a realistic shape through the CUDA C kernels, graded against the float64
reference on a slice of the heads (the full float64 reference of that shape would take minutes and gigabytes; every
(batch, head) is computed independently, so a slice of the output is graded exactly), then timed beside plain
CuPy attention. Without a GPU: the Numba twins on the CPU simulator (in a child process, see ``demo_sim``), then
the launch and occupancy report of the realistic shape from an offline NVRTC compile for the target (``--gpu``,
default an H200, sm_90).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Callable

from ..problem import Problem
from . import accuracy, bench, introspect, iomodel, sysinfo

SHAPE = Problem(batch=4, seqlen_q=2048, seqlen_k=2048, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16",
                causal=True)
GRADED_HEADS = 2


def gpu_demo(step: Callable[[str], None]) -> tuple[dict, bool]:
    """Run, grade on a slice and time the realistic shape on the current GPU."""
    import cupy

    import rawflash

    p = SHAPE
    host = accuracy.random_inputs(p)
    q, k, v, dout = (cupy.asarray(host[n]) for n in ("q", "k", "v", "dout"))  # MHA: _grade_slice slices k, v heads too
    step(f"forward and backward on {_shape_text(p)}")
    out, lse = rawflash.forward(q, k, v, causal=p.causal)
    grads = rawflash.backward(dout, q, k, v, out, lse, causal=p.causal)
    step(f"grading batch 0, heads 0..{GRADED_HEADS - 1} against the float64 reference")
    grades = _grade_slice(host, out, lse, grads, p.causal)
    step("timing (CUDA events, L2 flushed, median)")
    timings = _timings(p, host, q, k, v, dout, out, lse)
    ok = all(r["ok"] for r in grades)
    gpu = sysinfo.current_gpu()
    return {"ran": f"CUDA C kernels on {gpu.name}", "shape": _shape_text(p),
            "graded": f"batch 0, heads 0..{GRADED_HEADS - 1} of the full run (the float64 reference of the whole "
                      "shape is too slow); every (batch, head) is independent, so the slice is graded exactly",
            "grades": grades, "timings": timings, "verdict": "passed" if ok else "FAILED"}, ok


def _grade_slice(host: dict, out, lse, grads, causal: bool) -> list[dict]:
    sl = (slice(0, 1), slice(None), slice(0, GRADED_HEADS))
    x = {n: host[n][sl] for n in ("q", "k", "v", "dout")}
    dq, dk, dv = (g[sl].get() for g in grads)
    rows = accuracy.grade_forward(x, out[sl].get(), lse[:1, :GRADED_HEADS].get(), causal, None)
    return rows + accuracy.grade_backward(x, (dq, dk, dv), causal, None)


def _timings(p: Problem, host: dict, q, k, v, dout, out, lse) -> list[dict]:
    import cupy
    import numpy as np

    import rawflash

    shape = introspect.io_shape(p)
    q16, k16, v16 = (cupy.asarray(host[n].astype(np.float16)) for n in ("q", "k", "v"))
    runs = [("rawflash fa2 forward", "fwd", lambda: rawflash.forward(q, k, v, causal=p.causal)),
            ("rawflash fa2 backward", "bwd", lambda: rawflash.backward(dout, q, k, v, out, lse, causal=p.causal)),
            ("plain CuPy attention forward (fp16: CuPy has no bf16 matmul)", "fwd",
             lambda: bench.cupy_naive(q16, k16, v16, p.causal))]
    rows = []
    for name, direction, fn in runs:
        ms = bench.time_ms(fn)
        rows.append({"what": name, "ms": ms, "tflops": iomodel.flops(shape, direction) / (ms * 1e-3) / 1e12})
    rows[0]["speedup_vs_cupy"] = rows[2]["ms"] / rows[0]["ms"]
    return rows


def simulator_demo(step: Callable[[str], None]) -> dict:
    """The Numba twins on the CUDA simulator, in a child process; its status and grades."""
    env = sysinfo.child_env(NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.Popen([sys.executable, "-m", "rawflash.cli.demo_sim"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    result = {"status": "failed", "why": "the simulator process printed no result"}
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        else:
            step(line.rstrip())
    code = proc.wait()
    if code != 0 and result["status"] == "passed":
        result = {"status": "failed", "why": f"the simulator process exited with status {code}"}
    return result


def offline_report(step: Callable[[str], None], tgt: introspect.Target | None = None) -> dict:
    """Launches and occupancy of the realistic shape from an offline compile for the target (default: an H200,
    sm_90); nothing runs."""
    tgt = tgt or introspect.target(introspect.DEFAULT_GPU)
    shape = dataclasses.replace(SHAPE, arch=tgt.arch)
    step(f"compiling the launches of {_shape_text(shape)} for {tgt.arch} with NVRTC (offline)")
    launches = introspect.launches(shape, "fa2", "both")
    return {"target": tgt.description,
            "launches": introspect.launch_config_rows(shape, "fa2", "both", False, tgt),
            "occupancy": [introspect.occupancy_row(lau, tgt) for _, lau in launches]}


INSTALL_NUMBA = ("pip install 'rawflash[numba]' (from a clone: pip install -e '.[numba]'), or pip install "
                 "'numba>=0.61' 'numba-cuda>=0.20'")


def cpu_demo(step: Callable[[str], None], tgt: introspect.Target | None = None) -> tuple[dict, bool]:
    """Without a GPU: the simulator run, then the offline report, and a plain statement of what ran where."""
    tgt = tgt or introspect.target(introspect.DEFAULT_GPU)
    sim = simulator_demo(step)
    report = {"ran": "", "shape": _shape_text(SHAPE), "simulator": {k: v for k, v in sim.items() if k != "grades"}}
    if sim.get("grades"):
        report["simulator grades"] = sim["grades"]
    report.update(offline_report(step, tgt))
    compiled = f"no GPU: the CUDA C kernels were compiled for {tgt.arch} but not run (target: {tgt.name})"
    if sim["status"] == "missing":
        report["simulator"]["install"] = INSTALL_NUMBA
        ran = (f"{compiled}; nothing ran on the CPU simulator ({sim.get('why', 'the Numba backend is missing')}); "
               f"to run the Numba twins there: {INSTALL_NUMBA}")
    else:
        ran = f"{compiled}; the Numba twins ran on the CPU simulator ({sim['status']})"
    report["ran"] = ran
    return report, sim["status"] != "failed"


def _shape_text(p: Problem) -> str:
    return (f"batch {p.batch}, seqlen {p.seqlen_q}x{p.seqlen_k}, heads {p.heads}/{p.kv_heads}, d {p.head_dim}, "
            f"{p.dtype}, {'causal' if p.causal else 'non-causal'}")
