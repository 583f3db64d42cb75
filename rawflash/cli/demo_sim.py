"""The Numba twins on Numba's CUDA simulator: tiny forwards and a backward graded against the float64 reference.

Run as ``NUMBA_ENABLE_CUDASIM=1 python -m rawflash.cli.demo_sim`` (``rawflash demo`` does so on a machine without a
GPU). The simulator is chosen when numba is first imported, so this must run in a process of its own.
Exit status: 0 every grade passed, 1 a grade failed or the run raised, 3 the Numba backend is not installed.
The last line of output is ``RESULT <json>`` with the grades, for the parent process.
"""
from __future__ import annotations

import json
import os
import sys

EXIT_MISSING = 3
SHAPE = dict(batch=1, seqlen_q=24, seqlen_k=40, heads=2, kv_heads=1, head_dim=32, dtype="float16", causal=True)
"""Ragged, seqlen_q != seqlen_k, GQA, causal; float16 (bfloat16 is upcast on the host on the simulator)."""
RUNS = (("fa2", True), ("fa1", False))
"""(forward kernel, with the backward): fa2 forward and backward, fa1 forward (naive has no Numba twin)."""


def main() -> int:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # before numba is imported anywhere in this process
    from rawflash.cli import accuracy
    from rawflash.problem import Problem

    p = Problem(**SHAPE)
    print(f"simulator: fa2 forward and backward, fa1 forward, on {SHAPE}", flush=True)
    try:
        accuracy.prepare_backend("numba")
        import rawflash.kernels.numba_backend  # noqa: F401  (a missing twin shows up here, before any work)
    except (ImportError, accuracy.Unavailable) as err:
        print(f"the Numba backend is not available: {err}", flush=True)
        _result({"status": "missing", "why": str(err)})
        return EXIT_MISSING
    import rawflash.kernels.numba_backend as nb

    nb.simulator_progress = _progress
    rows = []
    for kernel, backward in RUNS:
        try:
            graded = accuracy.check(p, kernel=kernel, backend="numba", backward=backward,
                                    step=lambda s: print(f"  {s}", flush=True))
        except Exception as err:  # report what failed, as one line, to the parent
            print(f"the simulator run failed: {type(err).__name__}: {err}", flush=True)
            _result({"status": "failed", "why": f"{kernel}: {type(err).__name__}: {err}"})
            return 1
        rows += [{"kernel": kernel, **r} for r in graded]
        print("  " + ", ".join(f"{r['quantity']} {r['result']}" for r in graded), flush=True)
    ok = all(r["ok"] for r in rows)
    _result({"status": "passed" if ok else "failed", "shape": SHAPE, "grades": rows})
    return 0 if ok else 1


def _progress(event: str, info: dict) -> None:
    if event == "done":
        print(f"    simulated {info['kernel']} in {info['elapsed_s']:.1f} s", flush=True)


def _result(payload: dict) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


if __name__ == "__main__":
    sys.exit(main())
