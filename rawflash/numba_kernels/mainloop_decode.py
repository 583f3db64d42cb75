"""mainloop_decode twin: one split of the keys of a KV cache for the GQA-packed query rows of one kv head, mirroring
``cuda/mainloop_decode.cuh``.

Packed row r of the tile is query r // group of head hk * group + r % group, so K_j and V_j are read once for the
whole group (and the call's few query rows). A split is a run of whole key tiles of BCW keys; its result is a
partial O (normalised by its own l) and lse, which decode_combine merges. The policy is the general one at run
time; BlockInfo locates the keys (one page division per tile, then a carry).
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from .block_info import key_index, page_pos, set_head
from .common import NEG_INF, ONE, ZERO, cdiv, dot_rows, dot_vec_col, zero
from .policy import row_end, row_start, score, set_head as policy_set_head
from .softmax import update

STALE_LOG2 = float32(8.0)  # MainloopDecode::STALE_LOG2: the lazy rescale's threshold (P <= 2^8)

NOTHING = 2 ** 30  # row_lo of padding rows: they see no key


def threads(ROWS: int, WARPS: int) -> int:
    """Threads per CTA of the twin: one per packed row for each of the WARPS splits."""
    # MIRROR: ROWS threads per split, one per packed row; the CUDA C has one warp per split whose 32 lanes hold
    # the 16 MT rows in mma fragments.
    return ROWS * WARPS


def smem_bytes(D: int, ROWS: int, BCW: int, WARPS: int) -> int:
    """The packed Q tile and one K_j, V_j tile per split, float32 (the CUDA C: STAGES of each per warp, dtype T)."""
    return (ROWS + 2 * WARPS * BCW) * D * 4


@cuda.jit(device=True)
def tile_range(pol, group, r0, nrows, k_begin, k_end, bcw):
    """(lo, hi, n): the split's key tiles start at lo, n of them, keys [lo, hi) seen by some row of the tile."""
    i_first = r0 // group
    i_last = (r0 + nrows - 1) // group
    lo = max(k_begin, row_start(pol, i_first)) // bcw * bcw
    hi = min(k_end, row_end(pol, i_last))
    n = cdiv(hi - lo, bcw) if hi > lo else 0
    return lo, hi, n


@functools.lru_cache(maxsize=None)
def make_mainloop_decode(T: str, D: int, MT: int, BCW: int, STAGES: int, WARPS: int):
    """MainloopDecode<T, D, MT, BCW, STAGES, WARPS>::run as a device function of the twin.

    ``run(p, g, bi, pol, group, r0, nrows, k_begin, k_end, steps, w, row, smem, st)``: split w of the CTA, this
    thread's packed row ``row``; ``steps`` is the CTA's longest split (every thread takes part in every barrier).
    The row's O goes to st[0:D], its max and sum to st[D], st[D + 1]; returns the split's tile count. The split's
    pages were checked before (block_info.pages_inside).
    """
    ROWS = 16 * MT
    Q_END = ROWS * D

    @cuda.jit(device=True)
    def run(p, g, bi, pol, group, r0, nrows, k_begin, k_end, steps, w, row, smem, st):
        sQ = smem[0:Q_END].reshape((ROWS, D))
        base = Q_END + w * 2 * BCW * D
        sK = smem[base:base + BCW * D].reshape((BCW, D))
        sV = smem[base + BCW * D:base + 2 * BCW * D].reshape((BCW, D))
        lo, hi, n = tile_range(pol, group, r0, nrows, k_begin, k_end, BCW)
        # ---- [mainloop_decode:init] O = 0, l = 0, m = -inf; the row's query, head (its ALiBi slope), visible keys ----
        r = r0 + row
        qi = r // group
        rpol = policy_set_head(pol, p, g, set_head(bi, bi.hk * group + r % group))
        row_lo = row_start(pol, qi) if row < nrows else NOTHING
        row_hi = row_end(pol, qi) if row < nrows else 0
        zero(st)
        m = NEG_INF
        l = ZERO
        s = cuda.local.array(BCW, float32)
        for t in range(steps):
            k0 = lo + t * BCW
            # ---- [mainloop_decode:wait] tile t of the split in shared memory ----
            # MIRROR: a plain copy by the split's ROWS threads (one key row each in turn) between two CTA barriers,
            # for as many steps as the CTA's longest split; the CUDA C streams a STAGES-deep cp.async ring per warp
            # behind __syncwarp only.
            cuda.syncthreads()  # every thread is done with the previous tile
            if t < n:
                nk = min(BCW, hi - k0)
                page, prow = page_pos(p, bi, k0)
                for y in range(row, BCW, ROWS):
                    if y < nk:
                        slot, at = key_index(p, g, bi, page, prow, y)
                        for c in range(D):
                            inside = c < p.head_dim
                            sK[y, c] = float32(g.k[slot, at, bi.hk, c]) if inside else ZERO
                            sV[y, c] = float32(g.v[slot, at, bi.hk, c]) if inside else ZERO
                    else:
                        for c in range(D):
                            sK[y, c] = ZERO
                            sV[y, c] = ZERO
            cuda.syncthreads()  # the tile is visible
            if t < n:
                # ---- [mainloop_decode:scores] S = Q K_j^T for the row, through the transform and the mask ----
                # MIRROR: every tile is masked; the CUDA C masks edge tiles only (interior ones see every key).
                for y in range(BCW):
                    j = k0 + y
                    x = score(rpol, dot_rows(sQ, row, sK, y), qi, j)[0]
                    s[y] = NEG_INF if j < row_lo or j >= row_hi else x
                # ---- [mainloop_decode:softmax] online softmax of the block; O rescaled unless no row's max moved ----
                # MIRROR: the rescale is skipped per row; the CUDA C skips it for a warp whose rows all kept theirs.
                m, l, fo = update(s, ONE, m, l, False, STALE_LOG2)
                if fo != ONE and m != NEG_INF:  # (a row that has seen nothing has O = 0)
                    for c in range(D):
                        st[c] *= fo
                # ---- [mainloop_decode:pv] O += P V_j ----
                for c in range(D):
                    st[c] += dot_vec_col(s, sV, 0, c)
        st[D] = m
        st[D + 1] = l
        return n

    return run
