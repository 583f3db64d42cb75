"""Communicators: the ring exchange ring attention is built on, over NCCL or inside one process.

The ring code (:mod:`rawflash.distributed.ring`) asks four things of a communicator, and the same code runs
against every implementation here:

- ``rank``, ``world_size`` (ints);
- ``check(named)``: refuse, naming the argument, arrays it cannot send (called before anything runs);
- ``ring_pass(arrays) -> pending``: start sending ``arrays`` to rank ``rank + 1`` and receiving arrays of the same
  shapes and dtypes from rank ``rank - 1`` (mod ``world_size``); it returns at once, and ``pending.wait()``
  returns the received arrays, ready for any work queued after the call;
- ``all_max(value) -> float``: the largest ``value`` over the ranks; a barrier too (used for timing).

Implementations:

- :class:`NcclComm`: one process per GPU, NCCL point-to-point send / recv through CuPy's bindings
  (``cupy.cuda.nccl``) on a communication stream of its own, ordered against the caller's stream by CUDA events,
  so the next K/V block travels while the current one is computed.
- :class:`LocalRing`: ``world_size`` ranks in one process (a thread each, NumPy or CuPy arrays), ring passes
  done as local copies: the ring algorithm, tested without several GPUs.
- :class:`ComputeOnly`: wraps a communicator and skips the transfers (each rank keeps its own K/V), for timing
  the computation alone; its results are not attention over the whole sequence.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np

from .._xp import Array, array_module

ENV_RANK = "RAWFLASH_RANK"
ENV_WORLD_SIZE = "RAWFLASH_WORLD_SIZE"
ENV_DEVICE = "RAWFLASH_DEVICE"
ENV_NCCL_ID_FILE = "RAWFLASH_NCCL_ID_FILE"
# NVLink SHARP (NVLS) multicast stays off on the machines this is run on; it is set in every rank's environment
# (by the launcher, and again here before NCCL initialises, for ranks started by other means).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}

T = TypeVar("T")


class Pending(Protocol):
    def wait(self) -> list[Array]: ...


class Communicator(Protocol):
    """What :func:`rawflash.distributed.ring_attention` needs of ``comm`` (see the module docstring)."""

    rank: int
    world_size: int

    def check(self, named: Mapping[str, Array]) -> None: ...

    def ring_pass(self, arrays: Sequence[Array]) -> Pending: ...

    def all_max(self, value: float) -> float: ...


class RingAborted(RuntimeError):
    """Raised in a :class:`LocalRing` rank whose peer failed: the peer's own error is what ``run`` re-raises."""


# ---------------------------------------------------------------- in one process
class LocalRing:
    """``world_size`` ranks in one process: each runs in a thread, ring passes are local copies.

    ``LocalRing(4).run(fn)`` calls ``fn(comm)`` once per rank, each in a thread, with ``comm`` that rank's
    communicator, and returns the results in rank order. The ranks take turns: one runs at a time and hands over
    when it waits for a peer, so backends that are not thread-safe (Numba's CUDA simulator) work too. NumPy
    arrays are copied on the host; CuPy arrays on the device, on the sender's current stream, with an event the
    receiver's current stream waits on.

    Parameters
    ----------
    world_size : int >= 1
    timeout : float
        Seconds a rank waits for a peer before raising ``TimeoutError`` (a peer that never sends is a bug).
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self._cv = threading.Condition(threading.RLock())    # re-entrant: ranks hold it while they run
        self._reset()

    def run(self, fn: Callable[[LocalComm], T]) -> list[T]:
        """``[fn(comm_0), ..., fn(comm_{P-1})]``, each in its own thread; a rank's error is re-raised here."""
        self._reset()
        results: list = [None] * self.world_size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            with self._cv:      # held while the rank runs; released only while it waits for a peer
                try:
                    results[rank] = fn(LocalComm(self, rank))
                except BaseException as err:  # noqa: BLE001 (re-raised in the caller's thread)
                    errors.append((rank, err))
                    self._aborted = True
                    self._cv.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"rawflash-rank{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = [e for e in sorted(errors, key=lambda x: x[0]) if not isinstance(e[1], RingAborted)] or errors
            raise first[0][1]
        return results

    def _reset(self) -> None:
        self._mail: dict[tuple[int, int], tuple[list, object]] = {}
        self._maxima: dict[int, list[float]] = {}
        self._aborted = False

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding the condition) until ``ready()``; raise if a peer failed or the timeout passed."""
        if not self._cv.wait_for(lambda: self._aborted or ready(), self.timeout):
            raise TimeoutError(f"{what}: no peer answered within {self.timeout:g} s")
        if self._aborted and not ready():
            raise RingAborted(f"{what}: another rank failed")


class LocalComm:
    """One rank of a :class:`LocalRing` (what ``fn`` receives in ``LocalRing.run``)."""

    def __init__(self, ring: LocalRing, rank: int):
        self._ring = ring
        self.rank = rank
        self.world_size = ring.world_size
        self._passes = 0
        self._maxes = 0

    def check(self, named: Mapping[str, Array]) -> None:
        """Any NumPy or CuPy array can be passed (the caller's validation has already checked the kinds)."""

    def ring_pass(self, arrays: Sequence[Array]) -> _LocalPending:
        copies = [a.copy() for a in arrays]                 # the transfer: a copy the receiver owns
        ready = _record_event(copies)
        ring = self._ring
        dst = (self.rank + 1) % self.world_size
        with ring._cv:
            ring._mail[(dst, self._passes)] = (copies, ready)
            ring._cv.notify_all()
        pending = _LocalPending(ring, (self.rank, self._passes), f"rank {self.rank}, ring pass {self._passes}")
        self._passes += 1
        return pending

    def all_max(self, value: float) -> float:
        ring, key = self._ring, self._maxes
        self._maxes += 1
        with ring._cv:
            values = ring._maxima.setdefault(key, [])
            values.append(float(value))
            ring._cv.notify_all()
            ring._wait_for(lambda: len(values) >= self.world_size, f"rank {self.rank}, all_max {key}")
            return max(values)


class _LocalPending:
    def __init__(self, ring: LocalRing, key: tuple[int, int], what: str):
        self._ring, self._key, self._what = ring, key, what
        self._received = None

    def wait(self) -> list[Array]:
        if self._received is None:
            ring = self._ring
            with ring._cv:
                ring._wait_for(lambda: self._key in ring._mail, self._what)
                arrays, ready = ring._mail.pop(self._key)
            if ready is not None:
                import cupy

                cupy.cuda.get_current_stream().wait_event(ready)
            self._received = arrays
        return self._received


def _record_event(arrays):
    """An event after the copies of CuPy arrays (on the current stream); None for NumPy arrays."""
    if all(array_module(a) is np for a in arrays):
        return None
    import cupy

    return cupy.cuda.get_current_stream().record()


# ---------------------------------------------------------------- compute only (timing)
class ComputeOnly:
    """``comm`` without the ring transfers: ``ring_pass`` hands back the arrays it was given.

    Every rank then runs the same schedule of blocks as in the real ring (the block shapes depend only on the
    ranks, not on the data), so timing a ring call through it times the computation and merges alone. Its
    results are not attention over the whole sequence. ``check`` and ``all_max`` are ``comm``'s.
    """

    def __init__(self, comm: Communicator):
        self._comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size

    def check(self, named: Mapping[str, Array]) -> None:
        self._comm.check(named)

    def ring_pass(self, arrays: Sequence[Array]) -> _Ready:
        return _Ready(list(arrays))

    def all_max(self, value: float) -> float:
        return self._comm.all_max(value)


class _Ready:
    def __init__(self, arrays: list):
        self._arrays = arrays

    def wait(self) -> list[Array]:
        return self._arrays


# ---------------------------------------------------------------- NCCL
class NcclComm:
    """One rank of a ring over NCCL: one process per GPU, CuPy arrays on this rank's device.

    Transfers run on ``self.stream``, a non-blocking stream of this communicator's own: ``ring_pass`` makes it
    wait (a CUDA event) for the work queued so far on the caller's current stream, runs NCCL send / recv there,
    and ``wait()`` makes the caller's stream wait for the transfer. Work the caller queues between the two
    overlaps with the transfer. Arrays travel as bytes (``NCCL_UINT8``), so every dtype, bfloat16 included,
    goes unchanged.

    Build one with :meth:`from_env` in a process started by ``python -m rawflash.distributed.run``, or from an
    existing ``cupy.cuda.nccl.NcclCommunicator``. ``close()`` (or a ``with`` block) destroys the NCCL
    communicator.

    Parameters
    ----------
    nccl_comm : cupy.cuda.nccl.NcclCommunicator
        Created on the current device, which becomes this communicator's device.
    rank, world_size : int
    """

    def __init__(self, nccl_comm, rank: int, world_size: int):
        import cupy

        self._comm = nccl_comm
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.device = cupy.cuda.Device().id
        self.stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, timeout: float = 300.0) -> NcclComm:
        """The communicator of a rank started by ``python -m rawflash.distributed.run`` (or any launcher that
        sets the same variables).

        Reads ``RAWFLASH_RANK``, ``RAWFLASH_WORLD_SIZE``, ``RAWFLASH_DEVICE`` (CUDA device index, default the
        rank) and ``RAWFLASH_NCCL_ID_FILE`` (a path every rank can read, not existing yet: rank 0 writes the NCCL
        unique id there, the others wait up to ``timeout`` seconds for it), selects the device, sets
        ``NCCL_NVLS_ENABLE=0`` and initialises NCCL (``ncclCommInitRank``; blocks until every rank has joined).
        """
        env = os.environ if environ is None else environ
        rank = _env_int(env, ENV_RANK)
        world_size = _env_int(env, ENV_WORLD_SIZE)
        if not 0 <= rank < world_size:
            raise ValueError(f"{ENV_RANK} must be in [0, {ENV_WORLD_SIZE}) = [0, {world_size}), got {rank}")
        device = _env_int(env, ENV_DEVICE) if ENV_DEVICE in env else rank
        if ENV_NCCL_ID_FILE not in env:
            raise RuntimeError(f"{ENV_NCCL_ID_FILE} is not set: start the ranks with "
                               "'python -m rawflash.distributed.run --gpus N script.py'")
        os.environ.update(NCCL_ENV)
        import cupy
        from cupy.cuda import nccl

        if not nccl.available:
            raise RuntimeError("NCCL cannot be loaded by CuPy: pip install 'rawflash[nccl13]' (or nccl12 with "
                               "cupy-cuda12x), i.e. the nvidia-nccl-cu13 / -cu12 wheel")
        cupy.cuda.Device(device).use()
        unique_id = exchange_unique_id(rank, env[ENV_NCCL_ID_FILE], nccl.get_unique_id, timeout=timeout)
        return cls(nccl.NcclCommunicator(world_size, unique_id, rank), rank, world_size)

    def check(self, named: Mapping[str, Array]) -> None:
        """Every array must be a CuPy array on this communicator's device."""
        for name, x in named.items():
            if not type(x).__module__.startswith("cupy"):
                raise TypeError(f"{name} must be a CuPy array on device {self.device} to travel over NCCL, got "
                                f"{type(x).__name__}")
            if x.device.id != self.device:
                raise ValueError(f"{name} must be on this rank's device {self.device}, got device {x.device.id}")

    def ring_pass(self, arrays: Sequence[Array]) -> _NcclPending:
        import cupy
        from cupy.cuda import nccl

        compute = cupy.cuda.get_current_stream()
        sends = [cupy.ascontiguousarray(a) for a in arrays]
        recvs = [cupy.empty(a.shape, dtype=a.dtype) for a in arrays]
        # NCCL may read the sends and write the receive buffers only after the caller's stream has produced the
        # former and finished its earlier uses of the memory of the latter.
        self.stream.wait_event(compute.record())
        nxt, prev = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        nccl.groupStart()           # one group: every rank's send and recv progress together (no deadlock)
        try:
            for s, r in zip(sends, recvs):
                self._comm.send(s.data.ptr, s.nbytes, nccl.NCCL_UINT8, nxt, self.stream.ptr)
                self._comm.recv(r.data.ptr, r.nbytes, nccl.NCCL_UINT8, prev, self.stream.ptr)
        finally:
            nccl.groupEnd()
        return _NcclPending(sends, recvs, self.stream.record(), compute)

    def all_max(self, value: float) -> float:
        import cupy
        from cupy.cuda import nccl

        buf = cupy.asarray([value], dtype=cupy.float64)
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        self._comm.allReduce(buf.data.ptr, buf.data.ptr, 1, nccl.NCCL_FLOAT64, nccl.NCCL_MAX, self.stream.ptr)
        self.stream.synchronize()
        return float(buf.get()[0])

    def close(self) -> None:
        """Destroy the NCCL communicator (after finishing the work queued on it)."""
        if self._comm is not None:
            self.stream.synchronize()
            self._comm.destroy()
            self._comm = None

    def __enter__(self) -> NcclComm:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


class _NcclPending:
    def __init__(self, sends, recvs, done, compute):
        # The sends are held until the caller's stream has waited for the transfer: freed earlier, their memory
        # could be handed to new work on that stream while NCCL still reads it.
        self._sends, self._recvs, self._done, self._compute = sends, recvs, done, compute

    def wait(self) -> list[Array]:
        self._compute.wait_event(self._done)
        self._sends = None
        return self._recvs


def _env_int(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise RuntimeError(f"{name} is not set: start the ranks with 'python -m rawflash.distributed.run --gpus N "
                           "script.py'")
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None


# ---------------------------------------------------------------- the NCCL unique id
def exchange_unique_id(rank: int, path: str | os.PathLike, make_id: Callable[[], object], *,
                       timeout: float = 300.0, poll: float = 0.01):
    """Share one NCCL unique id among the ranks through a file.

    Rank 0 calls ``make_id()`` (``cupy.cuda.nccl.get_unique_id``) and writes the id to ``path`` atomically (a
    temporary file renamed into place); every other rank waits for ``path`` and reads it. The id is returned in
    the form ``make_id`` gave it (``bytes`` in CuPy >= 14, a tuple of 128 ints before), as
    ``NcclCommunicator`` expects it. ``path`` must be new for each launch (the launcher makes a fresh one).
    """
    path = os.fspath(path)
    if rank == 0:
        unique_id = make_id()
        record = {"bytes": unique_id.hex()} if isinstance(unique_id, bytes) else {"ints": [int(b) for b in unique_id]}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)
        return unique_id
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not write the NCCL unique id to {path} within {timeout:g} s")
        time.sleep(poll)
    with open(path) as fh:
        record = json.load(fh)
    return bytes.fromhex(record["bytes"]) if "bytes" in record else tuple(record["ints"])
