"""The parameter structs of the twins: the counterpart of ``cuda/params.cuh``.

The CUDA C passes one struct per direction (``FwdParams``, ``BwdParams``) holding pointers, strides and scalars.
The twins split it in two:

- ``p``: the scalars, one namedtuple kernel argument (numba-cuda passes a tuple's fields by value, like the CUDA C's
  ``__grid_constant__`` struct); the fields below, in params.cuh's order, plus one flag per optional array, which
  plays the part of the CUDA C's null pointer.
- ``g``: the arrays, separate kernel arguments (numba-cuda passes arrays one by one) that the kernel gathers into
  a namedtuple (``FwdArrays`` / ``BwdArrays``) to hand down, as the CUDA C hands down ``p``.

Arrays carry their shapes and strides, so no stride fields exist here. An absent optional array arrives as a
one-element dummy with its flag off (a GPU kernel takes no None). Packed variable-length sequences arrive as
4-D arrays (1, total, heads, head_dim) and per-row buffers as (1, heads, total): the CUDA C's batch stride 0.
"""
from __future__ import annotations

import collections

_SHARED = ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim")
_FLAGS = ("has_cu", "has_seqused", "has_alibi", "has_sinks")

# MIRROR: scalars only; has_cu stands for both cu_seqlens pointers (the Python side gives both or neither) and
# makes the arrays' batch index 0 (the CUDA C's batch stride 0 of packed tensors).
FwdParams = collections.namedtuple("FwdParams", (*_SHARED, "window_left", "window_right", "scale", "scale_log2",
                                                 "softcap", "alibi_sb", *_FLAGS))
# decode (cuda/decode.cu): the forward's scalars plus the cache's (has_table stands for block_table's null test;
# head_dim_v: out's columns where the latent cache's values set them, read by its twins only; 0 by default).
DecodeParams = collections.namedtuple("DecodeParams", (*_SHARED, "window_left", "window_right", "scale", "scale_log2",
                                                       "softcap", "alibi_sb", *_FLAGS, "has_table", "page_size",
                                                       "num_splits", "new_keys", "cache_capacity", "num_pages",
                                                       "cache_len", "split_appends", "num_partials",
                                                       "has_counters", "head_dim_v"), defaults=(0,))
BwdParams = collections.namedtuple("BwdParams", (*_SHARED, "rows_batch", "rows_seqlen", "window_left",
                                                 "window_right", "scale", "scale_log2", "softcap", "alibi_sb",
                                                 *_FLAGS))

# MIRROR: every array is an argument, absent ones as one-element dummies with their flag (has_*) off where the CUDA C
# tests a null pointer; packed sequences are (1, total, heads, head_dim) arrays and their per-row buffers (lse, L, D,
# dQ rows, sink terms) (1, heads, total) where the CUDA C has batch stride 0 and lse_sb = 0.
# The arrays, in the kernels' argument order (every kernel of a direction takes all of them, as every CUDA C
# kernel of a direction takes the whole struct).
FwdArrays = collections.namedtuple("FwdArrays", ["q", "k", "v", "o", "lse", "cu_q", "cu_k", "used_k", "slopes",
                                                 "sinks", "o_ws", "m_ws", "l_ws"])
# decode's arrays: q, the caches (k, v: contiguous (batch, capacity, kv_heads, d) or paged (pages, page_size, kv_heads,
# d)), k_new / v_new, out, lse, the feature arrays, block_table (batch, max_pages) and the split buffers o_ws
# (partials, batch, seqlen_q, heads, d) and m_ws (partials, batch, heads, seqlen_q), and the fused combine's int32
# counters (one per (batch, kv head, row group); has_counters stands for decode_counters' null test).
DecodeArrays = collections.namedtuple("DecodeArrays", ["q", "k", "v", "k_new", "v_new", "o", "lse", "cu_q", "cu_k",
                                                       "used_k", "slopes", "sinks", "table", "o_ws", "m_ws",
                                                       "counters"])
BwdArrays = collections.namedtuple("BwdArrays", ["q", "k", "v", "out", "dout", "dq", "dk", "dv", "lse", "lse2",
                                                 "delta", "dq_ws", "dsink_ws", "cu_q", "cu_k", "used_k", "slopes",
                                                 "sinks"])
