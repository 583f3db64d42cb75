"""The kernels' parameter structs (cuda/params.cuh) as NumPy structured scalars, built in one function per direction.

A CuPy kernel argument that is a one-element NumPy array is passed by value, its bytes as they are: that is how
``FwdParams`` / ``BwdParams`` reach a ``const __grid_constant__`` parameter. The field lists below are the
structs' fields in order; tests/test_params.py checks them against cuda/params.cuh, and 8-byte fields come first
in both so neither side pads. Pointers are CuPy arrays' device addresses (0 for absent inputs).
"""
from __future__ import annotations

import math

import numpy as np

from ..problem import Problem

LOG2E = 1.0 / math.log(2.0)
_CTYPES = {"ptr": np.uint64, "i64": np.int64, "i32": np.int32, "f32": np.float32}


def _strides(prefix: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}_{s}", "i64") for s in ("sb", "ss", "sh"))


FWD_FIELDS: tuple[tuple[str, str], ...] = (
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "ptr"), ("lse", "ptr"),
    *_strides("q"), *_strides("k"), *_strides("v"), *_strides("o"), ("lse_sb", "i64"), ("lse_sh", "i64"),
    ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"), ("seqused_k", "ptr"), ("block_table", "ptr"),
    ("block_table_sb", "i64"), ("alibi_slopes", "ptr"), ("alibi_sb", "i64"), ("sinks", "ptr"),
    ("o_ws", "ptr"), ("m_ws", "ptr"), ("l_ws", "ptr"), ("k_new", "ptr"), ("v_new", "ptr"),
    *_strides("kn"), *_strides("vn"), ("ws_split", "i64"),
    ("q_descale", "ptr"), ("k_descale", "ptr"), ("v_descale", "ptr"), ("descale_sb", "i64"), ("descale_sh", "i64"),
    ("tile_counter", "ptr"), ("decode_counters", "ptr"), ("ref_flag", "ptr"),
    ("batch", "i32"), ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("heads", "i32"), ("kv_heads", "i32"),
    ("head_dim", "i32"), ("window_left", "i32"), ("window_right", "i32"), ("page_size", "i32"),
    ("num_splits", "i32"), ("scale", "f32"), ("scale_log2", "f32"), ("softcap", "f32"), ("new_keys", "i32"),
    ("cache_capacity", "i32"), ("num_pages", "i32"), ("cache_len", "i32"), ("split_appends", "i32"),
    ("num_partials", "i32"), ("ref_gen", "i32"), ("head_dim_v", "i32"), ("pad_", "i32"),
)
BWD_FIELDS: tuple[tuple[str, str], ...] = (
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("out", "ptr"), ("dout", "ptr"), ("dq", "ptr"), ("dk", "ptr"),
    ("dv", "ptr"), ("lse", "ptr"), ("lse2", "ptr"), ("delta", "ptr"), ("dq_ws", "ptr"), ("dsink_ws", "ptr"),
    ("dq_semaphore", "ptr"), *_strides("q"), *_strides("k"), *_strides("v"), *_strides("o"), *_strides("do"),
    *_strides("dq"), *_strides("dk"), *_strides("dv"), ("lse_sb", "i64"), ("lse_sh", "i64"),
    ("cu_seqlens_q", "ptr"), ("cu_seqlens_k", "ptr"), ("seqused_k", "ptr"), ("alibi_slopes", "ptr"),
    ("alibi_sb", "i64"), ("sinks", "ptr"),
    ("batch", "i32"), ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("heads", "i32"), ("kv_heads", "i32"),
    ("head_dim", "i32"), ("rows_batch", "i32"), ("rows_seqlen", "i32"), ("window_left", "i32"),
    ("window_right", "i32"), ("scale", "f32"), ("scale_log2", "f32"), ("softcap", "f32"), ("dq_rotate", "i32"),
    ("longest_first", "i32"), ("head_dim_v", "i32"),
)


def _dtype(fields) -> np.dtype:
    return np.dtype([(name, _CTYPES[kind]) for name, kind in fields], align=True)


FWD_DTYPE = _dtype(FWD_FIELDS)
BWD_DTYPE = _dtype(BWD_FIELDS)


def ptr(x) -> int:
    """The device address of a CuPy array (or 0 for None)."""
    return 0 if x is None else int(x.data.ptr)


def strides_bsh(x, packed: bool) -> tuple[int, int, int]:
    """(batch, sequence, head) strides in elements of a (batch, seq, heads, d) array, or of a packed (total, heads,
    d) one (batch stride 0)."""
    s = tuple(v // x.dtype.itemsize for v in x.strides)
    return (0, s[0], s[1]) if packed else (s[0], s[1], s[2])


def _set_strides(rec, prefix: str, x, packed: bool) -> None:
    rec[f"{prefix}_sb"], rec[f"{prefix}_ss"], rec[f"{prefix}_sh"] = strides_bsh(x, packed)


def _common(rec, p: Problem, scale: float, extras: dict) -> None:
    """The fields both directions share: lengths, heads, the variant and the packed / per-row layout."""
    rec["batch"], rec["seqlen_q"], rec["seqlen_k"] = p.batch, p.seqlen_q, p.seqlen_k
    rec["heads"], rec["kv_heads"], rec["head_dim"] = p.heads, p.kv_heads, p.head_dim
    rec["window_left"], rec["window_right"] = p.window_bounds
    rec["scale"], rec["scale_log2"], rec["softcap"] = scale, scale * LOG2E, p.softcap
    rows_b, rows_s = p.rows  # packed sequences: rows are addressed by the sequence's first row, not its index
    rec["lse_sb"], rec["lse_sh"] = 0 if p.varlen else p.heads * rows_s, rows_s
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sinks"):
        rec[name] = ptr(extras.get(name))
    slopes = extras.get("alibi_slopes")
    rec["alibi_slopes"] = ptr(slopes)
    rec["alibi_sb"] = p.heads if slopes is not None and slopes.ndim == 2 else 0


def fwd_params(p: Problem, q, k, v, o, lse, scale: float, *, k_new=None, v_new=None, decode: bool = False,
               cache_len: int = 0, split_appends: bool = False, num_partials: int = 1, decode_counters=None,
               descales: tuple = (), **extras) -> np.ndarray:
    """FwdParams for one forward (or decode) call. ``extras``: cu_seqlens_q / _k, seqused_k, alibi_slopes, sinks (CuPy
    arrays or None), block_table (its page size is ``p.page_size``), o_ws / m_ws / l_ws (float32 work buffers),
    num_splits, tile_counter (two int32 zeros: FA3's dynamic persistent grid), ref_flag and ref_gen (the FA3 forward's
    REF_FIRST check: an int32 word and this call's nonzero number); ``descales`` (FP8) the (q, k, v) descale arrays;
    k_descale / v_descale (decode's FP8 cache). ``decode``: k_new / v_new (appended, ``p.new_keys`` rows each), the
    cache's capacity per sequence (``p.seqlen_k``) and pages (k's first axis when paged), cache_len (every sequence's
    cache_seqlens when seqused_k is None), split_appends (decode_split writes k_new / v_new itself: the plan's
    ``DecodePlan.split_appends``), num_partials (one per CTA of decode_split: ``DecodePlan.partials``) and
    decode_counters (int32 zeros, one per (batch, kv head, row group), when decode_split merges the partials itself:
    ``DecodePlan.fused``); a partial O is o's size apart in o_ws."""
    rec = np.zeros(1, FWD_DTYPE)
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o)):
        rec[name] = ptr(x)
        _set_strides(rec, name, x, p.varlen and len(x.shape) == 3)  # (a paged forward's k, v: pages, 4 axes)
    rec["lse"] = ptr(lse)
    _common(rec, p, scale, extras)
    rec["head_dim_v"] = p.value_head_dim  # o's columns (FA3's DV form reads v at its own head_dim)
    rec["block_table"] = ptr(extras.get("block_table"))
    if extras.get("block_table") is not None:
        rec["block_table_sb"] = extras["block_table"].shape[1]
        rec["page_size"] = p.page_size
        rec["num_pages"] = k.shape[0]  # pages of k: decode checks entries against it; a paged forward's
        # TMA boxes past the keys name this page (zeros)
    for name in ("o_ws", "m_ws", "l_ws"):
        rec[name] = ptr(extras.get(name))
    rec["num_splits"] = extras.get("num_splits", 1)
    rec["tile_counter"] = ptr(extras.get("tile_counter"))
    if extras.get("ref_flag") is not None:  # the FA3 forward's REF_FIRST check and its REF_RUNNING way back
        rec["ref_flag"], rec["ref_gen"] = ptr(extras["ref_flag"]), extras["ref_gen"]
    if descales:  # FP8: (q, k, v) float32 descales, each (1,) or (batch, kv_heads)
        for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
            rec[name] = ptr(x)
        per_head = descales[0].size > 1
        rec["descale_sb"], rec["descale_sh"] = (p.kv_heads, 1) if per_head else (0, 0)
    cache_descales = [x for x in (extras.get("k_descale"), extras.get("v_descale")) if x is not None]
    if cache_descales:  # decode's FP8 cache: k_descale / v_descale, (1,) or (batch, kv_heads), the same shape
        rec["k_descale"], rec["v_descale"] = ptr(extras.get("k_descale")), ptr(extras.get("v_descale"))
        rec["descale_sb"], rec["descale_sh"] = (p.kv_heads, 1) if cache_descales[0].size > 1 else (0, 0)
    for name, prefix, x in (("k_new", "kn", k_new), ("v_new", "vn", v_new)):
        rec[name] = ptr(x)
        if x is not None:
            _set_strides(rec, prefix, x, False)
    if decode:
        rec["new_keys"], rec["cache_capacity"], rec["cache_len"] = p.new_keys, p.seqlen_k, cache_len
        rec["split_appends"] = int(split_appends)
        rec["num_partials"] = num_partials
        rec["decode_counters"] = ptr(decode_counters)
        rec["ws_split"] = o.size
    return rec


def bwd_params(p: Problem, q, k, v, out, dout, lse, scale: float, *, dq, dk, dv, lse2, delta, dq_ws=None,
               dsink_ws=None, dq_semaphore=None, dq_rotate: bool = False, longest_first: bool = False,
               **extras) -> np.ndarray:
    """BwdParams for one backward call (every pass of it). ``extras`` as for :func:`fwd_params`; ``dq_semaphore``:
    the deterministic FA3 backward's int32 counters (``launch.dq_semaphores`` of them, zeroed); ``dq_rotate``: its
    rotated order (``launch.fa3_bwd_dq_rotates``); ``longest_first``: the default FA3 backward's key tiles longest
    first (``launch.fa3_bwd_longest_first``)."""
    rec = np.zeros(1, BWD_DTYPE)
    named = (("q", q, "q"), ("k", k, "k"), ("v", v, "v"), ("out", out, "o"), ("dout", dout, "do"), ("dq", dq, "dq"),
             ("dk", dk, "dk"), ("dv", dv, "dv"))
    for name, x, prefix in named:
        rec[name] = ptr(x)
        _set_strides(rec, prefix, x, p.varlen)
    for name, x in (("lse", lse), ("lse2", lse2), ("delta", delta), ("dq_ws", dq_ws), ("dsink_ws", dsink_ws),
                    ("dq_semaphore", dq_semaphore)):
        rec[name] = ptr(x)
    _common(rec, p, scale, extras)
    rec["rows_batch"], rec["rows_seqlen"] = p.rows
    rec["dq_rotate"] = int(dq_rotate)
    rec["longest_first"] = int(longest_first)
    rec["head_dim_v"] = p.value_head_dim  # v's, out's, dout's and dv's columns (FA3's DV form: MLA's head_dim_v)
    return rec
