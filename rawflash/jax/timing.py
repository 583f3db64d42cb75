"""The GPU time of a region inside a jitted function, taken by CUDA events on XLA's own stream: no host clock.

The method: a custom call ``rawflash_mark`` (an FFI target of :mod:`rawflash.jax.ffi`, registered for CUDA and
not command-buffer compatible, so XLA never captures it into a CUDA graph and its handler runs at every
execution) takes one or more arrays and returns each of them aliased to itself (``input_output_aliases``), with
``has_side_effect`` and an int64 attribute ``slot``. Its handler records a new CUDA event on the stream XLA runs
the call on and appends it to the slot's list. :func:`timed` wraps ``fn`` as ``mark(fn(*mark(args, start)),
end)``: one start mark over every array leaf of the arguments and one end mark over every array leaf of the
results, so that XLA orders start mark -> fn's work -> end mark by data dependence. The side effect keeps XLA from
removing a mark or reordering it against other side-effecting calls; the aliasing makes each mark's results the
same buffers as its operands, so no copy follows it and every use of an argument reads the start mark's result
(after it), every result of ``fn`` is an operand of the end mark (before it). After ``jax.block_until_ready``,
:meth:`Timed.times_ms` pairs the start and end events of each execution and returns
``cupy.cuda.get_elapsed_time`` of each pair, in milliseconds.

Limits:

- The events bound the work on XLA's compute stream, the one stream XLA:GPU runs a program's kernels on; work
  XLA puts on another stream (collectives, host offloading) is not bounded by them.
- One device; executions of one :class:`Timed` from several threads at once would interleave its events.
- XLA copies each argument that is not donated before the start mark (the mark "writes" its operands in place
  and an argument's buffer belongs to the caller): outside the region, but GPU work between executions. Work
  that depends on no argument may run before the start mark, outside the region: XLA fuses such work (a
  constant, a mask's iota) into its consumers where it can, but materialises it for a custom call (e.g. the
  cotangent of ones that ``jax.grad`` of a sum passes to a custom backward, one fill of the output's size).
- The marks add two tiny custom calls, one at each end of the region: on the GPU only the event records, on the
  host some microseconds of Python each. Where the host queues the region's work more slowly than the GPU runs
  it, the GPU idles inside the region and the time shows it; executions queued back to back (:func:`measure_ms`)
  keep the GPU busy wherever its work takes longer than the host's.
- The events of every execution stay in the table until :meth:`Timed.times_ms` (or :meth:`Timed.clear`) takes
  them.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from . import ffi

MARK = "rawflash_mark"
_SLOTS = itertools.count()
_EVENTS: dict[int, list] = {}  # slot -> the CUDA events recorded there, oldest first
_LOCK = threading.Lock()


def _record(frame) -> None:
    """The handler of ``rawflash_mark``: a new CUDA event recorded on XLA's stream, appended to the slot's list."""
    import cupy

    for arg, ret in zip(frame.args, frame.rets):
        if arg.ptr != ret.ptr:
            raise RuntimeError(f"{MARK}: result at {ret.ptr:#x} is not its operand at {arg.ptr:#x} (no aliasing)")
    slot = int(frame.attrs["slot"])
    with cupy.cuda.Device(max(frame.device, 0)):
        event = cupy.cuda.Event()
        cupy.cuda.runtime.eventRecord(event.ptr, frame.stream)
    with _LOCK:
        _EVENTS.setdefault(slot, []).append(event)


def register() -> None:
    """Registers the ``rawflash_mark`` target for CUDA (once per process)."""
    ffi.register(MARK, _record, platform="CUDA", command_buffer=False)


def new_slot() -> int:
    """A slot number no other caller of this function gets."""
    return next(_SLOTS)


def take(slot: int) -> list:
    """The CUDA events recorded at ``slot`` so far, oldest first; the slot's list is empty afterwards."""
    with _LOCK:
        return _EVENTS.pop(slot, [])


def _is_array(leaf) -> bool:
    import jax

    return isinstance(leaf, jax.Array)


def mark(tree, slot: int):
    """``tree`` with every array leaf passed through one ``rawflash_mark`` custom call of ``slot`` (each result
    aliased to its operand); other leaves are left as they are. A tree without array leaves comes back unchanged,
    and then nothing is recorded."""
    import jax

    register()
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    if not where:
        return tree
    arrays = [leaves[i] for i in where]
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays)
    marked = jax.ffi.ffi_call(MARK, results, has_side_effect=True, vmap_method="sequential",
                              input_output_aliases={i: i for i in range(len(arrays))})(*arrays, slot=np.int64(slot))
    for i, x in zip(where, marked):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


class Timed:
    """``fn`` between a start mark on its arguments and an end mark on its results (trace it under ``jax.jit``);
    :meth:`times_ms` gives the GPU time of each execution since it was last called."""

    def __init__(self, fn):
        self.fn = fn
        self.start, self.end = new_slot(), new_slot()
        self.__name__ = getattr(fn, "__name__", "timed")

    def __call__(self, *args, **kwargs):
        args, kwargs = mark((args, kwargs), self.start)
        return mark(self.fn(*args, **kwargs), self.end)

    def times_ms(self) -> list[float]:
        """Milliseconds between the start and end events of each execution recorded so far, oldest first; waits
        for the last end event. Call it after ``jax.block_until_ready`` of the last execution's results."""
        import cupy

        starts, ends = take(self.start), take(self.end)
        if len(starts) != len(ends):
            raise RuntimeError(f"{len(starts)} start marks and {len(ends)} end marks recorded: an execution is "
                               "still being queued, or one failed between its marks")
        if ends:
            ends[-1].synchronize()
        return [cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)]

    def clear(self) -> None:
        """Drops the events recorded so far."""
        take(self.start), take(self.end)


def timed(fn) -> Timed:
    """``fn`` as a :class:`Timed`: ``jax.jit(timed(fn))`` runs ``fn``'s work between two marks."""
    return Timed(fn)


def measure_ms(fn, *args, repeats: int = 20, warmup: int = 3, budget_ms: float = 3000.0) -> list[float]:
    """GPU times in ms of ``jax.jit(timed(fn))(*args)``: ``warmup`` executions (the first compiles), then
    ``repeats`` executions queued back to back with one wait at the end, each timed by its own marks. Slow
    programs get fewer repeats (at least 3), so that the timed executions take about ``budget_ms``."""
    import jax

    t = timed(fn)
    run = jax.jit(t)
    for _ in range(max(1, warmup)):
        jax.block_until_ready(run(*args))
    once = min(t.times_ms())  # the first execution's time holds its compile and first-call work
    repeats = max(3, min(repeats, int(budget_ms / max(once, 1e-3))))
    out = None
    for _ in range(repeats):
        out = run(*args)
    jax.block_until_ready(out)
    return t.times_ms()


__all__ = ["MARK", "mark", "timed", "Timed", "measure_ms", "register", "new_slot", "take"]
