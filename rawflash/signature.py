"""A call's signature: everything that decides its launches, as a hashable key, computed without validating.

Two calls with equal signatures pass or fail validation alike and run the same launches with other addresses, so
the public functions look a signature up in their plan cache before anything else and validate only on a miss.
A signature holds, for each array, its shape, strides, dtype, device and whether its address is 16-byte aligned
(the kernels' and TMA's requirement; other addresses take another plan); for each option, its type beside its
value (``causal=1`` is refused where ``causal=True`` is not, and ``1 == True`` in Python); and, for packed
sequences, the max_seqlen_q / max_seqlen_k the call runs with (``validation.maxima``: they pick tile rows and
grids). The offsets, ``seqused_k`` and a paged forward's ``block_table`` enter by their layouts only: no launch
depends on their values but through those maxima, and validation checks the values on every call, planned or not
(``validation.check_values``), so new lengths with the same layouts and maxima run one plan. A call that is not
on the fast path (NumPy inputs, another backend, the FP8 forward, zero-size arrays, anything unhashable) has no
signature (``None``) and takes the full path every time.
"""
from __future__ import annotations

import os

from .arrays import is_cupy_array

_SETTINGS = ("RAWFLASH_WGMMA", "RAWFLASH_FA3", "RAWFLASH_TILE_ARCH", "RAWFLASH_TILE_GPU", "RAWFLASH_CUDA_DIR",
             "RAWFLASH_DV_FORM")
# os.environ's own dict of encoded names and values (POSIX CPython): a lookup there skips os.environ's per-call
# encoding of the name, a few microseconds a call over the names
_ENVIRON = getattr(os.environ, "_data", None)
_ENCODED = tuple(name.encode() for name in _SETTINGS)


class NoSignature(Exception):
    """Raised inside the key builders for a call that takes the full path."""


def array(x):
    """A CuPy array's layout (the only arrays a signature describes): shape, strides, dtype, device and whether its
    address is 16-byte aligned."""
    if not is_cupy_array(x) or x.size == 0:
        raise NoSignature
    data = x.data
    return x.shape, x.strides, x.dtype, data.device_id, data.ptr % 16 == 0


def optional(x):
    return None if x is None else array(x)


def cupy_arrays(*xs) -> bool:
    """Whether each of ``xs`` is None or a CuPy array (the only arrays a signature describes): a call reads its
    offsets', lengths' and page table's values for the key's maxima only then."""
    return all(x is None or is_cupy_array(x) for x in xs)


def options(values: tuple) -> tuple:
    """The options' values with their types, and the items' types of a tuple option (``window``): equal keys are
    equal values of equal types, so ``causal=1`` and ``causal=True`` never share a plan."""
    return (values, tuple(map(type, values)),
            tuple([tuple(map(type, v)) for v in values if v.__class__ is tuple or v.__class__ is list]))


def _hashable(key: tuple):
    """``key``, or None where an option cannot be hashed (that call takes the full path, which refuses it)."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def settings_key() -> tuple:
    """The ``RAWFLASH_*`` variables that change a plan (``settings.load`` reads them on a miss)."""
    if _ENVIRON is not None:
        return tuple([_ENVIRON.get(name) for name in _ENCODED])
    return tuple([os.environ.get(name) for name in _SETTINGS])


def forward(q, k, v, opts: tuple, features: tuple, out, lse, block_table=None, maxima=None):
    """The signature of a forward call (``opts``: the options' values; ``features``: alibi_slopes, sinks,
    cu_seqlens_q, cu_seqlens_k, seqused_k, as given; ``block_table``: a paged forward's page table; ``maxima``:
    packed sequences' max_seqlen_q / _k, ``validation.maxima``'s); None where it takes the full path."""
    alibi, sinks, cu_q, cu_k, used = features
    try:
        return _hashable(("forward", array(q), array(k), array(v), options(opts), optional(alibi),
                          optional(sinks), optional(cu_q), optional(cu_k), optional(used), optional(block_table),
                          maxima, optional(out), optional(lse), settings_key()))
    except (NoSignature, TypeError):
        return None


def backward(arrays: tuple, opts: tuple, features: tuple, grads: tuple, maxima=None):
    """The signature of a backward call (``arrays``: dout, q, k, v, out, lse; ``grads``: the caller's dq, dk, dv;
    ``maxima`` as the forward's)."""
    alibi, sinks, cu_q, cu_k, used = features
    try:
        return _hashable(("backward", *[array(x) for x in arrays], options(opts), optional(alibi),
                          optional(sinks), optional(cu_q), optional(cu_k), optional(used), maxima,
                          *[optional(g) for g in grads], settings_key()))
    except (NoSignature, TypeError):
        return None


def decode(arrays: tuple, cache_seqlens, opts: tuple, features: tuple, outputs: tuple):
    """The signature of a decode call (``arrays``: q, k_cache, v_cache, k_new, v_new, block_table). An int
    cache_seqlens enters by its type only: its value is a per-call word, checked on every call."""
    q, k_cache, v_cache, k_new, v_new, table = arrays
    try:
        lens = ("int", type(cache_seqlens)) if isinstance(cache_seqlens, int) else array(cache_seqlens)
        return _hashable(("decode", array(q), array(k_cache), optional(v_cache), optional(k_new), optional(v_new),
                           optional(table), lens, options(opts), *[optional(f) for f in features],
                           *[optional(o) for o in outputs], settings_key()))
    except (NoSignature, TypeError):
        return None
