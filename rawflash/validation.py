"""Input checking shared by every backend: bad input is refused here, before anything is launched.

Each error is a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value) whose message
names the argument, what was expected and what was given; a combination that is not supported names both
arguments.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from .arrays import array_kind, device_of, dtype_name
from .kernels import configs, forms, registry
from .kernels.launch import MAX_GRID_YZ
from .problem import Problem

BACKENDS = ("cupy", "numba", "reference")
KERNELS = registry.api_kernels()  # the forward's kernel= values
FEATURE_ARGS = ("window", "softcap", "alibi_slopes", "sinks", "cu_seqlens_q", "seqused_k")


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` by default, else a positive finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive finite real number or None, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite real number or None, got {scale!r}")
    return value


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_window(window, name: str = "window") -> tuple[int, int]:
    """A pair of ints >= -1 (-1: unbounded on that side)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{name} must be a pair (left, right) of ints >= -1, got {window!r}")
    for side in window:
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise TypeError(f"{name} must be a pair (left, right) of ints >= -1, got {window!r}")
        if side < -1:
            raise ValueError(f"{name} values must be >= -1 (-1 = unbounded), got {tuple(window)!r}")
    return int(window[0]), int(window[1])


def check_softcap(softcap) -> float:
    """0 (off) or a positive finite real number."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number >= 0 (0 = off), got {type(softcap).__name__} {softcap!r}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be 0 (off) or a positive finite real number, got {softcap!r}")
    return value


def _shape(x, name: str, ndim: int = 4) -> tuple[int, ...]:
    shape = tuple(int(s) for s in x.shape)
    if len(shape) != ndim:
        axes = "(batch, seqlen, heads, head_dim)" if ndim == 4 else "(total, heads, head_dim) (packed sequences)"
        raise ValueError(f"{name} must have {ndim} dimensions {axes}, got shape {shape}")
    return shape


def _dtype(x, name: str, fp8: str = "") -> str:
    """x's dtype name; float8_e4m3fn only where ``fp8`` is 'ok', else refused naming the call (``fp8``)."""
    try:
        dt = dtype_name(x.dtype)
    except TypeError:
        dt = str(x.dtype)
    if dt == configs.FP8 and fp8 == "ok":
        return dt
    if dt == configs.FP8:
        raise TypeError(f"{name} has dtype float8_e4m3fn, which only rawflash.forward / attention take (the FP8 path "
                        f"is forward-only, kernel='fa2' on Hopper); got it in {fp8 or 'this call'}")
    if dt not in configs.DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {dt} (forward also takes "
                        "float8_e4m3fn)")
    return dt


def _host_ints(x) -> np.ndarray:
    """A small integer array's values on the host (a device array is copied: one synchronisation)."""
    return np.asarray(x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x)


@dataclasses.dataclass(frozen=True)
class Checked:
    """The outcome of validation: the problem, the scale, where the arrays live, and the feature arrays."""

    problem: Problem
    scale: float
    kind: str              # 'numpy', 'cupy' or 'foreign' (of q; all inputs share a device)
    device: object
    extras: dict = dataclasses.field(default_factory=dict)  # cu_seqlens_q/_k, seqused_k, alibi_slopes, sinks
    facts: object = None   # a forward's or backward's Facts: what its values are checked against on every call


@dataclasses.dataclass(frozen=True)
class Features:
    """The feature arguments of a call, as given (validated by :func:`check_forward`)."""

    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: object = None
    sinks: object = None
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    max_seqlen_q: object = None
    max_seqlen_k: object = None
    seqused_k: object = None
    block_table: object = None  # a paged forward: k and v are pages (num_pages, page_size, kv_heads, head_dim)
    values: object = None  # read_values' host copies of the four above, where the caller has read them already

    def given(self) -> list[str]:
        """Names of the features that are on."""
        names = []
        if tuple(self.window) != (-1, -1):
            names.append("window")
        if self.softcap:
            names.append("softcap")
        names += [n for n in ("alibi_slopes", "sinks", "cu_seqlens_q", "seqused_k", "block_table")
                  if getattr(self, n) is not None]
        return names


def _feature_array(x, name: str, shapes: list[tuple], dtype: str, device) -> object:
    """A float32 / int32 feature array: its dtype, one of the allowed shapes, and q's device."""
    kind = array_kind(x, name)
    got = dtype_name(x.dtype)
    if got != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {got}")
    shape = tuple(int(s) for s in x.shape)
    if shape not in shapes:
        allowed = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {allowed}, got {shape}")
    if device_of(x, kind) != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {device_of(x, kind)}")
    return x


def _offsets_layout(name: str, cu, device) -> int:
    """A cu_seqlens array's layout by flash-attn's rules (int32, 1-D with batch + 1 >= 2 entries, on q's device);
    its batch. Its values are :func:`check_values`'."""
    kind = array_kind(cu, name)
    if dtype_name(cu.dtype) != "int32":
        raise TypeError(f"{name} must have dtype int32, got {dtype_name(cu.dtype)}")
    if len(cu.shape) != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if device_of(cu, kind) != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {device_of(cu, kind)}")
    return int(cu.shape[0]) - 1


def _check_offsets(name: str, values: np.ndarray, total: int) -> np.ndarray:
    """The sequence lengths a cu_seqlens array's host values give, by flash-attn's rules: starting at 0,
    non-decreasing, ending at the packed length ``total``."""
    lengths = np.diff(values)
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(values[0])}")
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-decreasing, got {values.tolist()}")
    if values[-1] != total:
        what = "q" if name.endswith("_q") else "k"
        raise ValueError(f"{name}[-1] must equal the packed length of {what} ({total}), got {int(values[-1])}")
    return lengths


def _varlen_layout(f: Features, device) -> int:
    """The batch of packed sequences with contiguous keys: both offsets given, laid out alike."""
    if f.cu_seqlens_k is None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together, got cu_seqlens_q without cu_seqlens_k")
    batch = _offsets_layout("cu_seqlens_q", f.cu_seqlens_q, device)
    batch_k = _offsets_layout("cu_seqlens_k", f.cu_seqlens_k, device)
    if batch != batch_k:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{batch + 1} and {batch_k + 1}")
    return batch


def _longest(lengths) -> int:
    return 0 if lengths is None else int(lengths.max(initial=0))


def _max_seqlen(name: str, lengths: np.ndarray, given) -> int:
    """max_seqlen_q / _k: the longest of ``lengths`` when not given, else the given int, which must not be less."""
    longest = _longest(lengths)
    if given is None:
        return longest
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(given).__name__} {given!r}")
    if given < longest:
        raise ValueError(f"{name} must be at least the longest sequence ({longest}), got {given}")
    return int(given)


def _paged_layout(f: Features, page: int, device) -> int:
    """The batch of a paged forward: packed queries (cu_seqlens_q), keys in pages located by block_table
    (int32 (batch, max_pages) on q's device) and counted by seqused_k; no cu_seqlens_k."""
    if f.cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_k does not go with block_table: a paged forward's keys are located by "
                         "block_table and counted by seqused_k")
    if f.seqused_k is None:
        raise ValueError("block_table needs seqused_k: the keys of each sequence in its pages")
    if page < 16:
        raise ValueError(f"a paged forward needs pages of at least 16 rows (k.shape[1]), got {page}")
    batch = _offsets_layout("cu_seqlens_q", f.cu_seqlens_q, device)
    table = f.block_table
    kind = array_kind(table, "block_table")
    if dtype_name(table.dtype) != "int32":
        raise TypeError(f"block_table must have dtype int32, got {dtype_name(table.dtype)}")
    if len(table.shape) != 2 or int(table.shape[0]) != batch or int(table.shape[1]) < 1:
        raise ValueError(f"block_table must have shape (batch, max_pages) = ({batch}, max_pages >= 1), got "
                         f"{tuple(table.shape)}")
    if device_of(table, kind) != device:
        raise ValueError(f"block_table must be on q's device ({device}), got {device_of(table, kind)}")
    return batch


def _seqused_layout(seqused, batch: int, device) -> None:
    """seqused_k's layout: int32 (batch,) on q's device."""
    kind = array_kind(seqused, "seqused_k")
    if dtype_name(seqused.dtype) != "int32":
        raise TypeError(f"seqused_k must have dtype int32, got {dtype_name(seqused.dtype)}")
    if tuple(int(s) for s in seqused.shape) != (batch,):
        raise ValueError(f"seqused_k must have shape (batch,) = ({batch},), got {tuple(seqused.shape)}")
    if device_of(seqused, kind) != device:
        raise ValueError(f"seqused_k must be on q's device ({device}), got {device_of(seqused, kind)}")


def _check_seqused(used: np.ndarray, key_lengths) -> np.ndarray:
    """seqused_k's host values, each within its sequence's keys (``key_lengths``: an array, or one int for all)."""
    if (used < 0).any() or (used > key_lengths).any():
        raise ValueError(f"seqused_k must be between 0 and each sequence's key count "
                         f"{np.broadcast_to(key_lengths, used.shape).tolist()}, got {used.tolist()}")
    return used


def _check_table(entries: np.ndarray, used: np.ndarray, pages: int, page: int) -> None:
    """A paged forward's table: the entries its sequences' keys use (seqused_k's) name pages of k (one pass over
    the table, not a loop over its rows: a planned call runs this every time)."""
    n = -(-used // page)  # the pages each sequence uses
    bad = (np.arange(entries.shape[1]) < n[:, None]) & ((entries < 0) | (entries >= pages))
    if bad.any():
        b = int(bad.any(axis=1).argmax())
        raise ValueError(f"block_table[{b}] must name pages of k (0 .. {pages - 1}) for its {int(n[b])} used pages, "
                         f"got {int(entries[b][bad[b]][0])}")


@dataclasses.dataclass(frozen=True)
class Values:
    """The host values of a call's small int32 arrays (int64 copies): cu_seqlens_q / _k, seqused_k and a paged
    forward's block_table, None where not given. :func:`read_values` reads each once per call; validation checks
    them (:func:`check_values`) on every call, planned or not, and the plan-cache key holds the maxima they give
    (:func:`maxima`), not the values."""

    cu_seqlens_q: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    seqused_k: np.ndarray | None = None
    block_table: np.ndarray | None = None


def read_values(cu_seqlens_q, cu_seqlens_k, seqused_k, block_table=None) -> Values | None:
    """The host copies of the given arrays (a device array is copied: one synchronisation each); None when none is
    given."""
    if cu_seqlens_q is None and cu_seqlens_k is None and seqused_k is None and block_table is None:
        return None
    return Values(*[None if x is None else _host_ints(x).astype(np.int64)
                    for x in (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)])


def maxima(values: Values | None, max_seqlen_q, max_seqlen_k) -> tuple | None:
    """The max_seqlen_q / _k a packed call runs with (its Problem's seqlen_q / seqlen_k, which pick tile rows and
    grids), by :func:`check_values`' rule: the given ones, else the longest sequence of cu_seqlens_q and of
    cu_seqlens_k (seqused_k for paged keys). Computed from values not yet checked, for the plan-cache key (a call
    whose values check_values refuses runs nothing); None for fixed lengths, whose shapes fix them."""
    if values is None or values.cu_seqlens_q is None:
        return None
    keys = values.seqused_k if values.block_table is not None else \
        None if values.cu_seqlens_k is None else np.diff(values.cu_seqlens_k.reshape(-1))
    return (max_seqlen_q if max_seqlen_q is not None else _longest(np.diff(values.cu_seqlens_q.reshape(-1))),
            max_seqlen_k if max_seqlen_k is not None else _longest(keys))


@dataclasses.dataclass(frozen=True)
class Facts:
    """What :func:`check_values` compares a call's host values with, all fixed by its layouts and options (so by
    its signature): the packed rows of q and k, each sequence's keys where no offsets count them (fixed lengths'
    seqlen_k, or a paged table's width times its page), the page pool (pages, rows a page) and the max_seqlen_q /
    _k given (None: the longest)."""

    total_q: int = 0
    total_k: int = 0
    keys: int = 0
    pages: int = 0
    page: int = 0
    max_seqlen_q: object = None
    max_seqlen_k: object = None


def check_values(values: Values | None, facts: Facts) -> tuple:
    """The rules on the values of a call's offsets, seqused_k and page table (host copies, ``values``) against
    what its layouts fix (``facts``): offsets start at 0, never decrease and end at the packed lengths;
    max_seqlen_q / _k are not below the longest sequence; seqused_k is within each sequence's keys; a paged
    table's used entries name pages of k. :func:`check_forward` runs them on a new call, ``rawflash.forward`` /
    ``backward`` before a planned call launches. Returns (max_seqlen_q, max_seqlen_k, query lengths, keys of each
    sequence: seqused_k's values where given, else the offsets'); the first three are None for fixed lengths."""
    v, f = values or Values(), facts
    if v.cu_seqlens_q is None:
        used = v.seqused_k
        return None, None, None, None if used is None else _check_seqused(used, f.keys)
    q_lengths = _check_offsets("cu_seqlens_q", v.cu_seqlens_q, f.total_q)
    if v.block_table is not None:
        used = _check_seqused(v.seqused_k, f.keys)
        _check_table(v.block_table, used, f.pages, f.page)
        key_lengths = used
    else:
        key_lengths = _check_offsets("cu_seqlens_k", v.cu_seqlens_k, f.total_k)
    max_q = _max_seqlen("max_seqlen_q", q_lengths, f.max_seqlen_q)
    max_k = _max_seqlen("max_seqlen_k", key_lengths, f.max_seqlen_k)
    if v.seqused_k is not None and v.block_table is None:
        key_lengths = _check_seqused(v.seqused_k, key_lengths)
    return max_q, max_k, q_lengths, key_lengths


def check_wide_head_dim(d: int, dtype: str, kernel: str, backend: str, paged: bool = False) -> None:
    """The rules of head dims above configs.COMMON_MAX_HEAD_DIM, which run on the head_dim 512 rows
    (configs.WIDE_HEAD_DIM): on the cupy and numba backends float16 / bfloat16 with kernel='fa2' or 'naive', keys
    not paged. The reference backend computes any head_dim."""
    if d <= configs.COMMON_MAX_HEAD_DIM or backend == "reference":
        return
    most = configs.COMMON_MAX_HEAD_DIM
    if dtype == configs.FP8:
        raise ValueError(f"float8_e4m3fn inputs run head_dim up to {most}: the FP8 form has no head_dim "
                         f"{configs.WIDE_HEAD_DIM} row (O of 64 x 512 per warpgroup is 256 registers a thread); got "
                         f"head_dim {d}")
    if not forms.runs_head_dim(d, dtype):
        raise TypeError(f"head_dim above {most} runs in float16 or bfloat16 only (float32's FMA path has no head_dim "
                        f"{configs.WIDE_HEAD_DIM} row); got {dtype} with head_dim {d}")
    if not forms.runs_head_dim(d, dtype, kernel):
        raise ValueError(f"kernel={kernel!r} runs head_dim up to {most} (FA1's split-K slots of every warp's partial "
                         f"O outgrow shared memory at {configs.WIDE_HEAD_DIM}); got head_dim {d}: use kernel='fa2'")
    if paged:
        raise ValueError(f"a paged forward (block_table) runs head_dim up to {most}: FA3's paged form has no head_dim "
                         f"{configs.WIDE_HEAD_DIM} row and the mma.sync form's page loads are not admitted there; got "
                         f"head_dim {d}")


def check_forward(q, k, v, causal, scale, kernel: str = "fa2", backend: str = "cupy",
                  features: Features = Features(), fp8: str = "ok") -> Checked:
    """Validate a forward call and describe it; raises before anything is launched. ``fp8``: 'ok' where
    float8_e4m3fn inputs are allowed (then :func:`check_fp8` adds their rules), else the caller's name."""
    check_choice(kernel, "kernel", KERNELS)
    check_choice(backend, "backend", BACKENDS)
    causal = check_flag(causal, "causal")
    window = check_window(features.window)
    softcap = check_softcap(features.softcap)
    varlen = features.cu_seqlens_q is not None
    paged = features.block_table is not None
    if not varlen and features.cu_seqlens_k is not None:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together, got cu_seqlens_k without cu_seqlens_q")
    if paged and not varlen:
        raise ValueError("block_table (paged keys) goes with packed queries: give cu_seqlens_q (and seqused_k)")
    if paged and _dtype(q, "q", fp8) == "float32":
        raise TypeError("a paged forward (block_table) takes float16 or bfloat16 q, k, v, got float32")
    if paged and backend == "numba":
        raise ValueError("a paged forward (block_table) has no Numba twin: use backend='cupy' or 'reference'")
    ndim = 3 if varlen else 4
    kdim = 4 if paged else ndim  # paged: (num_pages, page_size, kv_heads, head_dim)
    kinds = {name: array_kind(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    shapes = {"q": _shape(q, "q", ndim), "k": _shape(k, "k", kdim), "v": _shape(v, "v", kdim)}
    dtypes = {"q": _dtype(q, "q", fp8), "k": _dtype(k, "k", fp8), "v": _dtype(v, "v", fp8)}
    if len(set(dtypes.values())) > 1:
        given = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"q, k and v must share one dtype, got {given}")
    devices = {name: device_of(x, kinds[name]) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) > 1:
        given = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"q, k and v must be on the same device, got {given}")
    qs, ks, vs = (shapes[n] if varlen else shapes[n][1:] for n in ("q", "k", "v"))
    if paged:
        if shapes["v"][:3] == shapes["k"][:3] and shapes["v"] != shapes["k"]:
            raise ValueError(f"a paged forward (block_table) reads keys and values of one head_dim, the pages decode "
                             f"reads; got k's {shapes['k'][3]} and v's {shapes['v'][3]} (head_dim_v != head_dim_qk)")
        if shapes["v"] != shapes["k"]:
            raise ValueError(f"k and v must have the same shape (num_pages, page_size, kv_heads, head_dim) with "
                             f"block_table, got k {shapes['k']}, v {shapes['v']}")
        pages, page = shapes["k"][:2]
        ks = vs = (pages * page, *shapes["k"][2:])
    if not varlen:
        b, bk, bv = shapes["q"][0], shapes["k"][0], shapes["v"][0]
        if bk != b or bv != b:
            raise ValueError(f"q, k and v must have the same batch size, got q {b}, k {bk}, v {bv}")
    (nq, h, d), (nk, hk, dk), vshape = qs, ks, vs
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got q {d}, k {dk}")
    if vshape[2] != d:  # MLA's value head dim (head_dim_v != head_dim_qk)
        if not 1 <= vshape[2] <= d:
            raise ValueError(f"v's head_dim must be between 1 and q's head_dim {d}, got {vshape[2]}")
    if vshape[0] != nk:
        what = "packed length" if varlen else "seqlen_k"
        raise ValueError(f"k and v must have the same {what}, got k {nk}, v {vshape[0]}")
    if vshape[1] != hk:
        raise ValueError(f"k and v must have the same number of kv heads, got k {hk}, v {vshape[1]}")
    if hk < 1 or h % hk != 0:
        raise ValueError(f"heads of q must be a multiple of kv_heads of k and v (kv_heads >= 1), got heads {h}, "
                         f"kv_heads {hk}")
    if not 1 <= d <= configs.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {configs.MAX_HEAD_DIM}, got {d}")
    check_wide_head_dim(d, dtypes["q"], kernel, backend, paged)
    device = devices["q"]
    if paged:
        batch = _paged_layout(features, page, device)
        facts = Facts(total_q=nq, keys=int(features.block_table.shape[1]) * page, pages=pages, page=page)
    elif varlen:
        batch = _varlen_layout(features, device)
        facts = Facts(total_q=nq, total_k=nk)
    else:
        batch = shapes["q"][0]
        facts = Facts(keys=nk)
        for name in ("max_seqlen_q", "max_seqlen_k"):
            if getattr(features, name) is not None:
                raise ValueError(f"{name} goes with cu_seqlens_q / cu_seqlens_k (packed sequences); got {name} "
                                 "without them")
    if features.seqused_k is not None:
        _seqused_layout(features.seqused_k, batch, device)
    facts = dataclasses.replace(facts, max_seqlen_q=features.max_seqlen_q, max_seqlen_k=features.max_seqlen_k)
    values = features.values if features.values is not None else \
        read_values(features.cu_seqlens_q, features.cu_seqlens_k, features.seqused_k, features.block_table)
    max_q, max_k, query_lengths, key_lengths = check_values(values, facts)
    if not varlen:
        max_q, max_k = nq, nk
    if h > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"heads and batch must each be at most {MAX_GRID_YZ}, got heads {h}, batch {batch}")
    extras = {}
    if features.alibi_slopes is not None:
        extras["alibi_slopes"] = _feature_array(features.alibi_slopes, "alibi_slopes", [(h,), (batch, h)], "float32",
                                                device)
    if features.sinks is not None:
        extras["sinks"] = _feature_array(features.sinks, "sinks", [(h,)], "float32", device)
    if features.seqused_k is not None:
        extras["seqused_k"] = features.seqused_k
    if varlen:
        extras["cu_seqlens_q"], extras["cu_seqlens_k"] = features.cu_seqlens_q, features.cu_seqlens_k
    if paged:
        del extras["cu_seqlens_k"]
        extras["block_table"] = features.block_table
    variant = registry.for_call(kernel, "fwd")
    given = Features(window=window, softcap=softcap, **{n: getattr(features, n) for n in
                                                       ("alibi_slopes", "sinks", "cu_seqlens_q", "seqused_k",
                                                        "block_table")}).given()
    if given and kernel != "fa2":
        supported = [g for g in given if g in variant.supports]
        unsupported = [g for g in given if g not in supported]
        if unsupported:
            raise ValueError(f"kernel={kernel!r} does not support {unsupported[0]}: only kernel='fa2' runs every "
                             f"feature (got {unsupported[0]} with kernel={kernel!r})")
    lengths = tuple(zip(map(int, query_lengths), map(int, key_lengths))) if varlen else ()
    problem = Problem(batch, max_q, max_k, h, hk, d, dtypes["q"], causal, window=window, softcap=softcap,
                      alibi="alibi_slopes" in extras, sinks="sinks" in extras, varlen=varlen,
                      total_q=nq if varlen else 0, total_k=nk if varlen else 0, seqused_k="seqused_k" in extras,
                      lengths=lengths, page_size=page if paged else 0,
                      head_dim_v=vshape[2] if vshape[2] != d else 0)
    return Checked(problem, check_scale(scale, d), kinds["q"], device, extras, facts)


def out_shape(q, v) -> tuple[int, ...]:
    """The shape of attention's output (and of dout): q's, with v's head_dim (MLA's head_dim_v)."""
    return (*(int(s) for s in q.shape[:-1]), int(v.shape[-1]))


def check_backward(dout, q, k, v, out, lse, causal, scale, deterministic, backend: str = "cupy",
                   features: Features = Features()) -> Checked:
    """Validate a backward call: the forward checks plus dout, out and lse against q."""
    checked = check_forward(q, k, v, causal, scale, "fa2", backend, features, fp8="rawflash.backward")
    check_flag(deterministic, "deterministic")
    p = checked.problem
    want = out_shape(q, v)
    for name, x in (("dout", dout), ("out", out)):
        kind = array_kind(x, name)
        if tuple(int(s) for s in x.shape) != want:
            what = "q's shape" if want == tuple(q.shape) else "q's shape with v's head_dim"
            raise ValueError(f"{name} must have {what} {want}, got {tuple(x.shape)}")
        if _dtype(x, name) != p.dtype:
            raise TypeError(f"{name} must have q's dtype {p.dtype}, got {dtype_name(x.dtype)}")
        if device_of(x, kind) != checked.device:
            raise ValueError(f"{name} must be on q's device ({checked.device}), got {device_of(x, kind)}")
    kind = array_kind(lse, "lse")
    want = (p.heads, p.total_q) if p.varlen else (p.batch, p.heads, p.seqlen_q)
    if tuple(int(s) for s in lse.shape) != want:
        axes = "(heads, total_q)" if p.varlen else "(batch, heads, seqlen_q)"
        raise ValueError(f"lse must have shape {axes} = {want}, got {tuple(lse.shape)}")
    if dtype_name(lse.dtype) not in ("float32", "float64"):
        raise TypeError(f"lse must be float32 (as forward returns it), got {dtype_name(lse.dtype)}")
    if device_of(lse, kind) != checked.device:
        raise ValueError(f"lse must be on q's device ({checked.device}), got {device_of(lse, kind)}")
    return checked


DECODE_BACKENDS = ("cupy", "numba", "reference")


def _same(x, name: str, dtype: str, device) -> None:
    """x has q's dtype and lives on q's device."""
    if _dtype(x, name) != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {dtype_name(x.dtype)}")
    where = device_of(x, array_kind(x, name))
    if where != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {where}")


def _check_cache_seqlens(cache_seqlens, batch: int, device) -> tuple[object, np.ndarray | None]:
    """(the int32 array, or None for an int; its values when they are on the host, else None) of cache_seqlens: an
    int for every sequence, or an int32 (batch,) array on q's device or the host. A device array's values are never
    copied to the host (decode's kernels check them)."""
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError(f"cache_seqlens must be an int or an int32 array (batch,), got {cache_seqlens!r}")
    if isinstance(cache_seqlens, numbers.Integral):
        return None, np.full(batch, int(cache_seqlens), dtype=np.int64)
    kind = array_kind(cache_seqlens, "cache_seqlens")
    if dtype_name(cache_seqlens.dtype) != "int32":
        raise TypeError(f"cache_seqlens must have dtype int32, got {dtype_name(cache_seqlens.dtype)}")
    if tuple(int(s) for s in cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}")
    if kind != "numpy" and device_of(cache_seqlens, kind) != device:
        raise ValueError(f"cache_seqlens must be on q's device ({device}) or on the host, got "
                         f"{device_of(cache_seqlens, kind)}")
    return cache_seqlens, (np.asarray(cache_seqlens).astype(np.int64) if kind == "numpy" else None)


def _check_latent(q, k_cache, v_cache, v_new, head_dim_v, backend: str, k_descale, v_descale) -> int:
    """The rules of decode's latent cache (``head_dim_v`` given: values are k_cache's first head_dim_v columns), one
    ValueError naming the argument per refused input; its head_dim_v. The reference backend computes any head_dim_v
    in 8 .. head_dim (multiples of 8); the Numba twins and the cupy backend run float16 / bfloat16 caches of q's
    dtype at configs.LATENT_HEAD_DIM / LATENT_HEAD_DIM_V."""
    if isinstance(head_dim_v, (bool, np.bool_)) or not isinstance(head_dim_v, numbers.Integral):
        raise ValueError(f"head_dim_v must be None or an int (the latent cache's value columns), got {head_dim_v!r}")
    head_dim_v = int(head_dim_v)
    if v_cache is not None:
        raise ValueError("v_cache must be None with head_dim_v: the values are k_cache's first head_dim_v columns "
                         "(one latent cache, as FlashMLA takes it)")
    if v_new is not None:
        raise ValueError("v_new must be None with head_dim_v: k_new is appended once and its first head_dim_v "
                         "columns are the new values")
    d = int(q.shape[-1]) if len(q.shape) == 4 else 0
    if not 8 <= head_dim_v <= d or head_dim_v % 8:
        raise ValueError(f"head_dim_v must be a multiple of 8 between 8 and q's head_dim ({d}), got {head_dim_v}")
    if backend == "reference":
        return head_dim_v
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is not None:
            raise ValueError(f"{name}: the latent cache runs 16-bit caches only (a float8_e4m3fn latent cache has no "
                             f"form yet; backend='reference' computes it)")
    if dtype_name(k_cache.dtype) == configs.FP8:
        raise ValueError("k_cache: a float8_e4m3fn latent cache has no form yet (16-bit caches only; "
                         "backend='reference' computes it)")
    if dtype_name(q.dtype) not in OUT_DTYPES:
        raise ValueError(f"q: the latent cache runs float16 or bfloat16, got {dtype_name(q.dtype)} "
                         f"(backend='reference' computes it)")
    pair = (configs.LATENT_HEAD_DIM, configs.LATENT_HEAD_DIM_V)
    if (d, head_dim_v) != pair:
        raise ValueError(f"head_dim_v: the latent cache's form runs head_dim {pair[0]} with head_dim_v {pair[1]} "
                         f"(DeepSeek-V3's 512 latent + 64 rotary columns), got head_dim {d}, head_dim_v {head_dim_v}")
    return head_dim_v


def check_decode(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, scale, backend: str,
                 features: Features, k_descale=None, v_descale=None, head_dim_v=None) -> Checked:
    """Validate a decode call (``rawflash.decode``); raises before anything is launched or appended.

    With ``head_dim_v`` (the latent cache: ``_check_latent``) v_cache and v_new are None and the values are
    k_cache's (and k_new's) first head_dim_v columns; the problem's head_dim_v is it.

    The problem's seqlen_k is the cache's capacity per sequence (what the launch is planned from), new_keys the
    appended rows, page_size the paged cache's page (0: contiguous), kv_dtype the cache's dtype where it is FP8;
    extras hold cache_seqlens (as seqused_k, or ``cache_len`` for an int), block_table, alibi_slopes, sinks and an
    FP8 cache's k_descale / v_descale. Values on the host (an int, NumPy arrays) are checked here; those of device
    arrays are never copied to the host (no synchronisation): the kernels check them and give an out-of-range
    sequence NaN results without reading or writing outside the cache.
    """
    check_choice(backend, "backend", DECODE_BACKENDS)
    causal = check_flag(causal, "causal")
    window = check_window(features.window)
    softcap = check_softcap(features.softcap)
    latent = head_dim_v is not None
    if not latent and v_cache is None:
        raise ValueError("v_cache must be an array, or None with head_dim_v (a latent cache whose first head_dim_v "
                         "columns are the values)")
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    kinds = {n: array_kind(x, n) for n, x in named[:2]}
    shapes = {n: _shape(x, n) for n, x in named[:2]}
    if latent:
        head_dim_v = _check_latent(q, k_cache, v_cache, v_new, head_dim_v, backend, k_descale, v_descale)
        named = named[:2]
        shapes["v_cache"] = shapes["k_cache"]
    else:
        kinds["v_cache"], shapes["v_cache"] = array_kind(v_cache, "v_cache"), _shape(v_cache, "v_cache")
    dtype = _dtype(q, "q")
    device = device_of(q, kinds["q"])
    kv_dtype = _dtype(k_cache, "k_cache", "ok")
    if kv_dtype == configs.FP8:
        if dtype not in OUT_DTYPES:
            raise TypeError(f"a float8_e4m3fn cache goes with float16 or bfloat16 q (the queries, new keys and "
                            f"output), got q {dtype}")
        if backend == "numba":
            raise ValueError("float8_e4m3fn caches have no Numba twin: use backend='cupy' or 'reference', got "
                             "backend='numba'")
        for n, x in named[1:]:
            if _dtype(x, n, "ok") != kv_dtype:
                raise TypeError(f"{n} must have k_cache's dtype float8_e4m3fn, got {dtype_name(x.dtype)}")
            if device_of(x, array_kind(x, n)) != device:
                raise ValueError(f"{n} must be on q's device ({device}), got {device_of(x, array_kind(x, n))}")
    else:
        for n, x in named[1:]:
            _same(x, n, dtype, device)
        given = [n for n, x in (("k_descale", k_descale), ("v_descale", v_descale)) if x is not None]
        if given:
            raise ValueError(f"{given[0]} goes with a float8_e4m3fn cache (k_cache, v_cache); got it with a "
                             f"{dtype} cache")
    batch, sq, h, d = shapes["q"]
    if shapes["v_cache"][:3] == shapes["k_cache"][:3] and shapes["v_cache"] != shapes["k_cache"]:
        raise ValueError(f"decode reads caches of one head_dim: v_cache's head_dim {shapes['v_cache'][3]} differs "
                         f"from k_cache's {shapes['k_cache'][3]} (head_dim_v != head_dim_qk runs in forward and "
                         f"backward)")
    if shapes["v_cache"] != shapes["k_cache"]:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {shapes['k_cache']} and "
                         f"{shapes['v_cache']}")
    slots, rows, hk, dk = shapes["k_cache"]
    if dk != d:
        raise ValueError(f"q and k_cache must have the same head_dim, got q {d}, k_cache {dk}")
    if h < 1 or hk < 1 or h % hk != 0:
        raise ValueError(f"heads of q must be a multiple of kv_heads of k_cache (kv_heads >= 1), got heads {h}, "
                         f"kv_heads {hk}")
    if backend != "reference" and d > configs.COMMON_MAX_HEAD_DIM and not latent:
        raise ValueError(f"decode runs head_dim up to {configs.COMMON_MAX_HEAD_DIM}: decode_split has no head_dim "
                         f"{configs.WIDE_HEAD_DIM} row (a warp's partial O of 16 x 512 is 256 registers a thread); "
                         f"got head_dim {d}")
    if not 1 <= d <= (configs.LATENT_HEAD_DIM if latent else configs.MAX_HEAD_DIM) or d % 8:
        raise ValueError(f"decode needs head_dim a multiple of 8 between 8 and {configs.MAX_HEAD_DIM} (the cache is "
                         f"read and appended in place, never padded), got {d}")
    if kv_dtype == configs.FP8 and (d % 16 or not configs.has_row("decode_split", d, kv_dtype)):
        raise ValueError(f"a float8_e4m3fn cache needs head_dim a multiple of 16 in 48 - 64 or 112 - "
                         f"{configs.COMMON_MAX_HEAD_DIM} (its tiles' rows are whole 16-byte chunks, 4, 8k or 8k + 4 of "
                         f"them), got {d}")
    if sq < 1 or batch < 1:
        raise ValueError(f"q must have at least one sequence and one query row, got shape {shapes['q']}")
    if (k_new is None) != (v_new is None) and not latent:
        raise ValueError("k_new and v_new must be given together, got "
                         f"{'k_new without v_new' if v_new is None else 'v_new without k_new'}")
    new = 0
    if k_new is not None:
        for n, x in (("k_new", k_new), ("v_new", v_new))[:1 if latent else 2]:
            shape = _shape(x, n)
            _same(x, n, dtype, device)
            if shape[0] != batch or shape[2:] != (hk, d):
                raise ValueError(f"{n} must have shape (batch, seqlen_new, kv_heads, head_dim) = ({batch}, "
                                 f"seqlen_new, {hk}, {d}), got {shape}")
        if not latent and tuple(k_new.shape) != tuple(v_new.shape):
            raise ValueError(f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and "
                             f"{tuple(v_new.shape)}")
        new = int(k_new.shape[1])
    seqlens, lens = _check_cache_seqlens(cache_seqlens, batch, device)
    if block_table is None:
        if slots != batch:
            raise ValueError(f"a contiguous k_cache must have q's batch ({batch}) as its first axis, got {slots} "
                             "(a paged cache needs block_table)")
        capacity, page = rows, 0
    else:
        kind = array_kind(block_table, "block_table")
        if dtype_name(block_table.dtype) != "int32":
            raise TypeError(f"block_table must have dtype int32, got {dtype_name(block_table.dtype)}")
        if len(block_table.shape) != 2 or int(block_table.shape[0]) != batch:
            raise ValueError(f"block_table must have shape (batch, max_pages) = ({batch}, max_pages), got "
                             f"{tuple(block_table.shape)}")
        if device_of(block_table, kind) != device:
            raise ValueError(f"block_table must be on q's device ({device}), got {device_of(block_table, kind)}")
        page = rows
        capacity = page * int(block_table.shape[1])
    if new > capacity:
        where = "k_cache.shape[1]" if block_table is None else "page_size x block_table.shape[1]"
        raise ValueError(f"seqlen_new ({new}) must fit the cache's capacity per sequence ({where} = {capacity})")
    if capacity >= 2 ** 31 or slots >= 2 ** 31:
        raise ValueError(f"the cache's capacity per sequence ({capacity}) and its first axis ({slots}) must be below "
                         "2**31")
    if lens is not None and (np.any(lens < 0) or np.any(lens + new > capacity)):
        where = "k_cache.shape[1]" if block_table is None else "page_size x block_table.shape[1]"
        raise ValueError(f"cache_seqlens + seqlen_new ({new}) must be between 0 and the cache's capacity per sequence "
                         f"({where} = {capacity}), got cache_seqlens {lens.tolist()}")
    if block_table is not None and lens is not None and isinstance(block_table, np.ndarray):
        table = block_table.astype(np.int64)  # host values are free to check; a device table is checked there
        for b in range(batch):
            used = table[b, : -(-int(lens[b] + new) // page)]
            if np.any(used < 0) or np.any(used >= slots):
                raise ValueError(f"block_table[{b}] must hold page indices between 0 and {slots - 1} (k_cache's "
                                 f"pages) for the pages its {int(lens[b] + new)} keys use, got {used.tolist()}")
    extras = {} if seqlens is None else {"seqused_k": seqlens}
    if seqlens is None:
        extras["cache_len"] = int(lens[0])
    if block_table is not None:
        extras["block_table"] = block_table
    if features.alibi_slopes is not None:
        extras["alibi_slopes"] = _feature_array(features.alibi_slopes, "alibi_slopes", [(h,), (batch, h)], "float32",
                                                device)
    if features.sinks is not None:
        extras["sinks"] = _feature_array(features.sinks, "sinks", [(h,)], "float32", device)
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is not None:
            extras[name] = _feature_array(x, name, [(1,), (batch, hk)], "float32", device)
    if k_descale is not None and v_descale is not None and tuple(k_descale.shape) != tuple(v_descale.shape):
        raise ValueError(f"k_descale and v_descale must share one shape ((1,) or (batch, kv_heads)), got "
                         f"{tuple(k_descale.shape)} and {tuple(v_descale.shape)}")
    problem = Problem(batch, sq, capacity, h, hk, d, dtype, causal, window=window, softcap=softcap,
                      alibi="alibi_slopes" in extras, sinks="sinks" in extras, seqused_k=True, new_keys=new,
                      page_size=page, kv_dtype=kv_dtype if kv_dtype == configs.FP8 else "",
                      head_dim_v=head_dim_v if latent else 0)
    return Checked(problem, check_scale(scale, d), kinds["q"], device, extras)


def reference_features(c: Checked, f: Features) -> dict:
    """The keyword arguments of ``reference.forward`` / ``backward`` for a checked call and its features."""
    p = c.problem
    return dict(causal=p.causal, scale=c.scale, window=p.window, softcap=p.softcap, alibi_slopes=f.alibi_slopes,
                sinks=f.sinks, cu_seqlens_q=f.cu_seqlens_q, cu_seqlens_k=f.cu_seqlens_k, seqused_k=f.seqused_k)


OUT_DTYPES = ("bfloat16", "float16")
FP8_REFUSED = ("softcap", "alibi_slopes")  # score transforms (the FP8 form folds the descales into the scale)


def check_fp8(c: Checked, kernel: str, backend: str, features: Features, descales: dict, out_dtype,
              incoherent) -> tuple[Checked, tuple]:
    """The FP8 forward's rules on top of :func:`check_forward` (q, k, v float8_e4m3fn): kernel='fa2' on the cupy or
    reference backend; causal, windows, sinks, packed sequences and seqused_k as in 16-bit (soft-capping and ALiBi
    are refused), head_dim a multiple of 16 (TMA rows of 16-byte chunks), descales float32 of shape (1,) or
    (batch, kv_heads) (batch: the packed sequences' count), all the same shape, on q's device; out_dtype bfloat16
    (default) or float16. Returns the checked call (its problem's out_dtype set) and the descales (None for 1)."""
    p = c.problem
    if kernel != "fa2":
        raise ValueError(f"float8_e4m3fn inputs run kernel='fa2' (FA3's form on Hopper) only, got kernel={kernel!r}")
    if backend == "numba":
        raise ValueError("float8_e4m3fn inputs have no Numba twin: use backend='cupy' or 'reference', got "
                         "backend='numba'")
    if features.block_table is not None:
        raise ValueError("float8_e4m3fn inputs run FA3's TMA form, which reads no paged keys: block_table takes "
                         "16-bit or float32 q, k, v")
    given = [g for g in features.given() if g in FP8_REFUSED]
    if given:
        raise ValueError(f"the FP8 forward runs no score transform (causal, windows, sinks, packed sequences and "
                         f"seqused_k are supported); {given[0]} is not supported with float8_e4m3fn inputs")
    if check_flag(incoherent, "incoherent"):
        raise ValueError("incoherent=True rotates Q and K before they are quantised: give float16 / bfloat16 / "
                         "float32 q, k, v with incoherent=True (rawflash quantises them), or rotate with "
                         "rawflash.fp8.quantize(..., incoherent=True) yourself; got float8_e4m3fn q, k, v")
    if p.head_dim_v:  # the FP8 form transposes V at q's head_dim
        raise ValueError(f"float8_e4m3fn inputs run with v's head_dim equal to q's (the FP8 form transposes V at q's "
                         f"head_dim); got v's head_dim {p.head_dim_v} and q's {p.head_dim} (head_dim_v != "
                         f"head_dim_qk)")
    if p.head_dim % 16:
        raise ValueError(f"float8_e4m3fn inputs need head_dim a multiple of 16 (TMA copies 16-byte chunks), got "
                         f"{p.head_dim}")
    out = "bfloat16" if out_dtype is None else (dtype_name(out_dtype) if not isinstance(out_dtype, str) else out_dtype)
    if out not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be 'bfloat16' or 'float16' for float8_e4m3fn inputs, got {out_dtype!r}")
    shapes = [(1,), (p.batch, p.kv_heads)]
    checked = {name: None if x is None else _feature_array(x, name, shapes, "float32", c.device)
               for name, x in descales.items()}
    got = {tuple(int(n) for n in x.shape) for x in checked.values() if x is not None}
    if len(got) > 1:
        raise ValueError(f"q_descale, k_descale and v_descale must share one shape ((1,) or (batch, kv_heads)), got "
                         f"{sorted(got)}")
    problem = dataclasses.replace(p, out_dtype=out)
    return dataclasses.replace(c, problem=problem), tuple(checked[n] for n in ("q_descale", "k_descale", "v_descale"))


def check_fp8_options(descales: dict, out_dtype, incoherent, fp8) -> None:
    """16-bit / float32 inputs: the FP8 options apply only with fp8=True or incoherent=True (quantised inside)."""
    on = check_flag(fp8, "fp8") or check_flag(incoherent, "incoherent")
    extra = [n for n, x in descales.items() if x is not None]
    if extra:
        raise ValueError(f"{extra[0]} goes with float8_e4m3fn q, k, v (rawflash computes the descales itself with "
                         f"fp8=True / incoherent=True); got {extra[0]} with 16-bit or float32 inputs")
    if out_dtype is not None and not on:
        raise ValueError("out_dtype goes with the FP8 forward (float8_e4m3fn inputs, fp8=True or incoherent=True); "
                         f"got out_dtype={out_dtype!r} without it")


def check_outputs(c: Checked, specs: tuple) -> tuple:
    """The caller's output arrays (``out=``, ``lse=``, ``dq=`` ...), each None or checked against what the call
    returns there: ``specs`` holds (name, array, shape, dtype name, whether it must be C-contiguous). An output
    lives where the results do (q's device, or the host for NumPy inputs) and must not be a read-only view."""
    checked = []
    for name, x, shape, dtype, contiguous in specs:
        if x is None:
            checked.append(None)
            continue
        kind = array_kind(x, name)
        if kind == "foreign":
            raise TypeError(f"{name} must be a CuPy or NumPy array (the result is written into it), got "
                            f"{type(x).__name__}")
        if tuple(int(s) for s in x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
        if dtype_name(x.dtype) != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {dtype_name(x.dtype)}")
        if device_of(x, kind) != c.device:
            raise ValueError(f"{name} must be on q's device ({c.device}), got {device_of(x, kind)}")
        if contiguous and not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous, got strides {tuple(x.strides)}")
        if kind == "numpy" and not x.flags.writeable:
            raise ValueError(f"{name} must be writeable")
        checked.append(x)
    return tuple(checked)
