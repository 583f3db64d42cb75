"""Calls planned once per signature: the launches of a call prepacked, so that a later call with the same signature
only writes its addresses into them and queues the kernels.

A call's *signature* (``rawflash.signature``) is everything that decides its launches: shapes, strides, dtypes,
the device, the options, the feature arrays' layouts and packed sequences' maxima. The first call of a
signature validates, chooses the forms and binds a template (``cupy_backend.bind_forward`` / ``bind_backward`` /
``bind_decode``: the parameter structs and TMA descriptors as that call's arrays fill them); :class:`CallPlan`
copies the template's argument bytes once and remembers which words of them are addresses of which buffer (the
*roles*: a parameter struct's pointer field is named after its role, e.g. ``q``, ``o``, ``cu_seqlens_k``). Every
call of the signature then

1. makes its per-call buffers (outputs, work buffers) and gathers the address of every role,
2. writes them into the packed bytes (one NumPy store per struct; a TMA descriptor's address through the driver's
   ``cuTensorMapReplaceAddress``, only when it changed),
3. launches each kernel with ``cuLaunchKernel`` on CuPy's current stream (the driver copies the parameters at
   launch, so the packed bytes can be rewritten by the next call at once).

Nothing else runs per call: no validation that the signature already proved (the public call checks the values
of the offsets, lengths and page table, which the signature holds by layout, before it runs the plan), no form
choice, no compile lookup, no argument packing by CuPy. :class:`PlanCache` keeps the plans, least recently used
first out, behind a lock.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import threading

import numpy as np

from . import params, tma

PLAN_CACHE_SIZE = 256  # plans kept per process (a plan is a few KB of packed bytes and no device memory)
_ALIGN = 128           # packed arguments are 128-byte aligned: a TMA descriptor must be (64 at least)
# The TMA descriptors of each direction and the role whose address each one holds.
TMA_ROLES = {tma.FWD_DTYPE: {"q": "q", "k": "k", "v": "v", "o": "o"},
             tma.BWD_DTYPE: {"q": "q", "k": "k", "v": "v", "dout": "dout", "dq": "dq_ws"}}
# The per-call int32 fields of the parameter structs (the rest is fixed by the signature).
CALL_INTS = {params.FWD_DTYPE: ("ref_gen", "cache_len"), params.BWD_DTYPE: ()}


class NotPackable(ValueError):
    """A template whose arguments :class:`CallPlan` cannot prepack (it runs through ``Bound.launch`` instead)."""


@functools.lru_cache(maxsize=1)
def _replace_address():
    """The driver's ``cuTensorMapReplaceAddress`` (through ctypes, as ``tma`` encodes)."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapReplaceAddress
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return fn


def _aligned_copy(record: np.ndarray) -> np.ndarray:
    """The bytes of a one-element structured array in a new 128-byte aligned uint8 buffer."""
    raw = record.view(np.uint8).reshape(-1)
    base = np.zeros(raw.size + _ALIGN, dtype=np.uint8)
    start = -base.ctypes.data % _ALIGN
    buf = base[start:start + raw.size]
    buf[:] = raw
    return buf


class _Struct:
    """One packed parameter struct: its pointer fields (by role) and per-call int32 fields as indices into views of
    the bytes, written with one NumPy store each per call."""

    def __init__(self, record: np.ndarray):
        self.buf = _aligned_copy(record)
        fields = record.dtype.fields
        u64 = [(name, off) for name, (dt, off, *_) in fields.items() if dt == np.uint64]
        # the roles this call must supply: the pointer fields the template set (0 = absent input)
        self.roles = [name for name, _ in u64 if int(record[name][0]) != 0]
        self.ptr_index = np.array([fields[n][1] // 8 for n in self.roles], dtype=np.intp)
        self.ptrs = self.buf.view(np.uint64)
        # per-call int32 words: a call that gives none keeps the template's value
        self.ints = [(name, int(record[name][0])) for name in CALL_INTS[record.dtype]]
        self.int_index = np.array([fields[n][1] // 4 for n, _ in self.ints], dtype=np.intp)
        self.i32 = self.buf.view(np.int32)

    def write(self, ptrs: dict, ints: dict) -> None:
        self.ptrs[self.ptr_index] = [ptrs[r] for r in self.roles]
        if self.ints:
            self.i32[self.int_index] = [ints.get(n, fixed) for n, fixed in self.ints]


class _Maps:
    """A packed TMA parameter (several 128-byte descriptors): each descriptor's address is replaced by the driver
    when its role's address differs from the last call's."""

    def __init__(self, record: np.ndarray, template_roles: dict):
        self.buf = _aligned_copy(record)
        names = TMA_ROLES[record.dtype]
        self.maps = [(self.buf.ctypes.data + record.dtype.fields[n][1], role) for n, role in names.items()
                     if np.any(record[n])]
        self.last = {role: int(template_roles[role].data.ptr) for _, role in self.maps}
        self.roles = [role for _, role in self.maps]

    def write(self, ptrs: dict, ints: dict) -> None:
        for address, role in self.maps:
            ptr = ptrs[role]
            if ptr != self.last[role]:
                rc = _replace_address()(address, ptr)
                if rc != 0:
                    raise RuntimeError(f"cuTensorMapReplaceAddress returned CUresult {rc} for {role}")
                self.last[role] = ptr


class PackedLaunch:
    """One kernel of a plan: its function handle, grid, block, shared memory and packed argument list."""

    def __init__(self, lau, args: tuple, packed: dict, handle):
        self.name = lau.name_expression
        self.func = handle.kernel.ptr
        self.handle = handle  # keeps the module (and so the function) loaded
        self.grid, self.block, self.smem = tuple(lau.grid), tuple(lau.block), int(lau.smem)
        self.args = [packed[id(a)] for a in args]
        self.argv = (ctypes.c_void_p * len(self.args))(*[a.buf.ctypes.data for a in self.args])
        self.argv_ptr = ctypes.addressof(self.argv)
        from cupy.cuda import driver

        self._launch = driver.launchKernel

    def __call__(self, stream: int) -> None:
        self._launch(self.func, *self.grid, *self.block, self.smem, stream, self.argv_ptr, 0)


class CallPlan:
    """The prepacked launches of one signature (see the module's docstring). ``run(ptrs, ints, stream)`` writes a
    call's addresses (role -> int) and per-call words into the packed arguments and launches; ``roles`` names the
    addresses a call must give. A lock serialises calls that share the plan (they share its packed bytes)."""

    def __init__(self, launches: list, template_roles: dict, kernel_handle):
        packed: dict = {}
        for _, args in launches:
            for a in args:
                if id(a) in packed:
                    continue
                if not isinstance(a, np.ndarray) or a.shape != (1,):
                    raise NotPackable(f"an argument of type {type(a).__name__} (only parameter structs and TMA "
                                      "descriptors are prepacked)")
                if a.dtype in CALL_INTS:
                    packed[id(a)] = _Struct(a)
                elif a.dtype in TMA_ROLES:
                    packed[id(a)] = _Maps(a, template_roles)
                else:
                    raise NotPackable(f"an argument of dtype {a.dtype}")
        self.parts = list(packed.values())
        self.roles = sorted({r for part in self.parts for r in part.roles})
        missing = [r for r in self.roles if r not in template_roles]
        if missing:
            raise NotPackable(f"the template's parameters hold addresses of {missing}, which it names no role for")
        self.launches = [PackedLaunch(lau, args, packed, kernel_handle(lau)) for lau, args in launches]
        self.lock = threading.Lock()

    def run(self, ptrs: dict, ints: dict, stream: int) -> None:
        with self.lock:
            for part in self.parts:
                part.write(ptrs, ints)
            for launch in self.launches:
                launch(stream)


class PlanCache:
    """Plans by signature, bounded: when full, the least recently used go first. A hit is one dict lookup and a
    new stamp on the entry (no lock, no reordering: the GIL makes each step atomic); adding a plan, and so evicting
    one, holds a lock. Safe to share between threads."""

    def __init__(self, size: int = PLAN_CACHE_SIZE):
        self.size = size
        self._plans: dict = {}
        self._lock = threading.Lock()
        self._clock = itertools.count()
        self.hits = self.misses = 0

    def get(self, key):
        entry = self._plans.get(key)  # [plan, stamp]
        if entry is None:
            self.misses += 1
            return None
        entry[1] = next(self._clock)
        self.hits += 1
        return entry[0]

    def put(self, key, plan) -> None:
        with self._lock:
            self._plans[key] = [plan, next(self._clock)]
            if len(self._plans) > self.size:
                # the least recently used go, an eighth of the cache at once: one sort per size // 8 new plans
                drop = len(self._plans) - self.size + self.size // 8
                for old in sorted(self._plans, key=lambda k: self._plans[k][1])[:drop]:
                    del self._plans[old]

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._plans)
