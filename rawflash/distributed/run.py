"""Start one process per GPU for a script that uses :class:`rawflash.distributed.NcclComm`.

::

    python -m rawflash.distributed.run --gpus 8 script.py [args ...]
    python -m rawflash.distributed.run --gpus 8 -m package.module [args ...]

Rank ``r`` (0 .. N-1) runs the script with, in its environment:

- ``RAWFLASH_RANK=r``, ``RAWFLASH_WORLD_SIZE=N``;
- ``RAWFLASH_DEVICE=r``: the CUDA device index among the visible ones. ``CUDA_VISIBLE_DEVICES`` is left as it is
  (restrict the GPUs with it), so every process sees every GPU and NCCL its NVLink topology;
- ``RAWFLASH_NCCL_ID_FILE``: a new file in a temporary directory; rank 0 writes the NCCL unique id there and the
  others read it (:func:`rawflash.distributed.comm.exchange_unique_id`);
- ``NCCL_NVLS_ENABLE=0`` (NVLink multicast stays off), whatever the launcher's environment says.

In the script, ``comm = NcclComm.from_env()`` joins the ring. Any other launcher (``mpirun``, a scheduler) works
if it sets the same variables, with ``RAWFLASH_NCCL_ID_FILE`` a new path on a file system all ranks share.

The launcher waits for every rank. When one exits with an error the others are terminated (a rank blocked in
NCCL would otherwise wait for its peer forever) and the launcher exits with the failed rank's status.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from .comm import ENV_DEVICE, ENV_NCCL_ID_FILE, ENV_RANK, ENV_WORLD_SIZE, NCCL_ENV


def child_env(rank: int, world_size: int, id_file: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of rank ``rank``: ``base`` (default ``os.environ``) plus the variables above."""
    env = dict(os.environ if base is None else base)
    env.update({ENV_RANK: str(rank), ENV_WORLD_SIZE: str(world_size), ENV_DEVICE: str(rank),
                ENV_NCCL_ID_FILE: id_file})
    env.update(NCCL_ENV)
    return env


def launch(command: Sequence[str], gpus: int, *, env: Mapping[str, str] | None = None, poll: float = 0.05,
           grace: float = 10.0) -> int:
    """Run ``command`` (argv of one rank, e.g. ``[sys.executable, 'script.py']``) as ``gpus`` ranks.

    Returns 0 when every rank succeeded, else the first failing rank's exit status (128 + signal number for a
    rank killed by a signal); the other ranks are then sent SIGTERM, and SIGKILL after ``grace`` seconds.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be an int >= 1, got {gpus!r}")
    if not command:
        raise ValueError("command must name a program to run")
    tmp = tempfile.mkdtemp(prefix="rawflash-ring-")
    id_file = os.path.join(tmp, "nccl_unique_id.json")
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(gpus):
            procs.append(subprocess.Popen(list(command), env=child_env(rank, gpus, id_file, env)))
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs, grace)
                return _status(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    except KeyboardInterrupt:
        _stop(procs, grace)
        return 128 + signal.SIGINT
    finally:
        _stop(procs, grace)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to the ranks still running (ours, by pid), SIGKILL to those alive ``grace`` seconds later."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code     # Popen reports death by signal N as -N


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rawflash.distributed.run",
        description="Run a script as one process per GPU, joined by NCCL (rawflash.distributed.NcclComm.from_env).")
    parser.add_argument("--gpus", type=int, required=True, help="number of ranks (GPUs 0 .. N-1 of the visible ones)")
    parser.add_argument("-m", dest="module", help="run a module (as python -m) instead of a script")
    parser.add_argument("target", nargs=argparse.REMAINDER, help="script.py and its arguments (or the module's)")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.module:
        command = [sys.executable, "-m", args.module, *args.target]
    elif args.target:
        command = [sys.executable, *args.target]
    else:
        parser.error("name a script (or -m module) to run")
    # SIGTERM (e.g. a benchmark driver's timeout) unwinds through launch(), which stops the ranks first
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return launch(command, args.gpus)


if __name__ == "__main__":
    sys.exit(main())
