"""Run a pytest selection as N processes side by side (round-robin shards of the collected test ids), so the GPU
suites fit a short device session: most of a GPU test's time is the CPU's float64 reference and the Numba JIT, which
the machine's other cores can share. Each shard logs to LOG_DIR/NAME_<i>.log; the summary lines and the failures
of every shard are printed, and the exit status is nonzero when any shard failed or none ran.

    python3 tools/pytest_shards.py --jobs 4 --name gpu_tests --log-dir "$OUT" -- -m gpu tests/test_gpu_kernels.py
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def collect(args: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids and out.returncode not in (0, 5):
        sys.exit(f"collection failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--name", default="pytest")
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: marker and paths, as for pytest")
    a = ap.parse_args()
    args = [x for x in a.pytest_args if x != "--"]
    # the selection's options (-m, -k) also filter each shard; the paths are replaced by the shard's ids
    opts = [x for i, x in enumerate(args) if x.startswith("-") or (i > 0 and args[i - 1] in ("-m", "-k"))]
    ids = collect(args)
    print(f"{len(ids)} tests in {a.jobs} shards", flush=True)
    if not ids:
        sys.exit(1)
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(min(a.jobs, len(ids))):
        log = open(log_dir / f"{a.name}_{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *opts, *ids[i::a.jobs]]
        procs.append((i, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    status = 0
    for i, proc, log in procs:
        rc = proc.wait()
        log.close()
        lines = (log_dir / f"{a.name}_{i}.log").read_text().splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        print(f"shard {i}: exit {rc}: {lines[-1] if lines else '(no output)'}")
        for line in failed[:20]:
            print("   ", line)
        status |= rc not in (0,)
    sys.exit(status)


if __name__ == "__main__":
    main()
