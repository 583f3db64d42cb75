"""BlockInfo of the twins: where one (sequence, head) of a call lives, the counterpart of ``cuda/block_info.cuh``.

It turns block coordinates into the sequence's lengths and first rows in the (possibly packed) tensors. Variable
lengths (cu_seqlens_q / cu_seqlens_k) and seqused_k are read here and nowhere else, when ``varlen`` (the general
policy's kernels, BlockInfo<true> in the CUDA C); fixed-length kernels take the lengths from the parameters.

Decode's KV cache (contiguous or paged) is located here too, as in the CUDA C: ``page_pos`` (the one division of a
tile), ``page_slot`` (the page table's entry), ``key_index`` (a key's cache entry and row, carried on from
``page_pos``) and ``pages_inside`` (a split's pages checked against the cache, once).

The CUDA C's typed pointers ``bi.q<T>(p)``, ``bi.k<T>(p)``, ``bi.q_like`` and per-row ``row0`` become array views
the kernels write inline (``g.q[bi.ab, bi.q_row0:, bi.h]``, ``g.lse[bi.ab, bi.h, bi.q_row0:]``): a device
function returns no views here.
"""
from __future__ import annotations

import collections

from numba import cuda

# b: sequence; ab: its index on the arrays' batch axis (0 for packed sequences, whose arrays have one batch entry);
# h: query head; hk: the kv head it reads (GQA: h / group); seqlen_q / seqlen_k: this sequence's lengths with
# seqused_k applied; q_row0 / k_row0: its first rows in q / k (cu_seqlens for packed sequences, else 0).
BlockInfo = collections.namedtuple("BlockInfo", ["b", "ab", "h", "hk", "seqlen_q", "seqlen_k", "q_row0", "k_row0"])


@cuda.jit(device=True)
def block_info(varlen, p, g, b, h):
    """BlockInfo<varlen>(p, b, h)."""
    if varlen:  # lengths from the batch's offsets (the Python side passes them whenever one is set)
        q_row0 = g.cu_q[b] if p.has_cu else 0
        k_row0 = g.cu_k[b] if p.has_cu else 0
        seqlen_q = g.cu_q[b + 1] - q_row0 if p.has_cu else p.seqlen_q
        seqlen_k = g.cu_k[b + 1] - k_row0 if p.has_cu else p.seqlen_k
        if p.has_seqused:
            seqlen_k = g.used_k[b]
    else:       # fixed lengths: plain parameters
        q_row0 = 0
        k_row0 = 0
        seqlen_q = p.seqlen_q
        seqlen_k = p.seqlen_k
    hk = h // (p.heads // p.kv_heads)
    # MIRROR: the arrays' batch index; the CUDA C multiplies b by a batch stride that is 0 for packed tensors.
    ab = 0 if p.has_cu else b
    return BlockInfo(b, ab, h, hk, seqlen_q, seqlen_k, q_row0, k_row0)


@cuda.jit(device=True)
def set_head(bi, h):
    """The same sequence, query head h of the same GQA group (BlockInfo::set_head)."""
    # MIRROR: a new namedtuple (they are immutable) where the CUDA C assigns h and row0 in place.
    return BlockInfo(bi.b, bi.ab, h, bi.hk, bi.seqlen_q, bi.seqlen_k, bi.q_row0, bi.k_row0)


# ---------------------------------------------------------------- KV caches (decode)
@cuda.jit(device=True)
def page_pos(p, bi, j0):
    """BlockInfo::page_pos -> (page, row): where key j0 of the sequence is; a contiguous cache: (0, k_row0 + j0)."""
    if not p.has_table:
        return 0, bi.k_row0 + j0
    page = j0 // p.page_size
    return page, j0 - page * p.page_size


@cuda.jit(device=True)
def page_slot(p, g, bi, page):
    """BlockInfo::page_slot: the cache entry of the sequence's page (block_table's value; contiguous: the
    sequence)."""
    return g.table[bi.b, page] if p.has_table else bi.b


@cuda.jit(device=True)
def slot_inside(p, slot):
    """BlockInfo::slot_inside: whether a cache entry is one of the cache's pages."""
    return not p.has_table or (slot >= 0 and slot < p.num_pages)


@cuda.jit(device=True)
def pages_inside(p, g, bi, j0, j1):
    """BlockInfo::pages_inside: whether every page holding keys [j0, j1) of the sequence is inside the cache."""
    # MIRROR: each thread checks every page itself; the CUDA C's warp shares them among its lanes (__any_sync).
    if not p.has_table or j1 <= j0:
        return True
    for page in range(j0 // p.page_size, (j1 - 1) // p.page_size + 1):
        if not slot_inside(p, page_slot(p, g, bi, page)):
            return False
    return True


@cuda.jit(device=True)
def key_index(p, g, bi, page, row, r):
    """BlockInfo::key_offsets as array indices -> (cache entry, row) of key (page, row) + r, r >= 0."""
    # MIRROR: indices into the 4-D cache arrays where the CUDA C computes element offsets from the strides.
    row += r
    if p.has_table:
        while row >= p.page_size:  # the carry into the next pages
            row -= p.page_size
            page += 1
    return page_slot(p, g, bi, page), row
