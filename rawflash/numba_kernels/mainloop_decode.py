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


def smem_bytes(D: int, ROWS: int, BCW: int, WARPS: int, latent: bool = False) -> int:
    """The packed Q tile and one K_j, V_j tile per split, float32 (the CUDA C: STAGES of each per warp, dtype T);
    the latent cache: one K tile (the CTA's one split)."""
    return (ROWS + (1 if latent else 2 * WARPS) * BCW) * D * 4


@cuda.jit(device=True)
def tile_range(pol, group, r0, nrows, k_begin, k_end, bcw):
    """(lo, hi, n): the split's key tiles start at lo, n of them, keys [lo, hi) seen by some row of the tile."""
    i_first = r0 // group
    i_last = (r0 + nrows - 1) // group
    lo = max(k_begin, row_start(pol, i_first)) // bcw * bcw
    hi = min(k_end, row_end(pol, i_last))
    n = cdiv(hi - lo, bcw) if hi > lo else 0
    return lo, hi, n


@cuda.jit(device=True)
def row_setup(p, g, bi, pol, group, r, real):
    """Packed row r's query, its policy (head hk * group + r % group: its ALiBi slope) and visible keys [lo, hi)
    (a padding row, not ``real``, sees none)."""
    qi = r // group
    rpol = policy_set_head(pol, p, g, set_head(bi, bi.hk * group + r % group))
    return qi, rpol, row_start(pol, qi) if real else NOTHING, row_end(pol, qi) if real else 0


@cuda.jit(device=True)
def copy_tile(p, g, bi, row, rows, sK, sV, k0, nk, values):
    """Keys k0 .. k0 + nk - 1 into sK (and sV with ``values``; the latent cache's V is sK's first columns), zero
    past the last key and past head_dim: the split's ``rows`` threads one key row each in turn."""
    bcw = sK.shape[0]
    page, prow = page_pos(p, bi, k0)
    for y in range(row, bcw, rows):
        slot, at = key_index(p, g, bi, page, prow, y) if y < nk else (0, 0)
        for c in range(sK.shape[1]):
            inside = y < nk and c < p.head_dim
            sK[y, c] = float32(g.k[slot, at, bi.hk, c]) if inside else ZERO
            if values:
                sV[y, c] = float32(g.v[slot, at, bi.hk, c]) if inside else ZERO


@cuda.jit(device=True)
def row_scores(rpol, sQ, row, sK, s, k0, qi, row_lo, row_hi):
    """The row's scores of the tile's keys through the transform, -inf where the row does not see the key."""
    # MIRROR: every tile is masked; the CUDA C masks edge tiles only (interior ones see every key).
    for y in range(s.shape[0]):
        j = k0 + y
        x = score(rpol, dot_rows(sQ, row, sK, y), qi, j)[0]
        s[y] = NEG_INF if j < row_lo or j >= row_hi else x


@cuda.jit(device=True)
def add_pv(st, s, sV, dv, fo, m):
    """O = fo O + P V over O's first dv columns (V: sV's first dv columns)."""
    # MIRROR: the rescale is skipped per row; the CUDA C skips it for a warp whose rows all kept theirs.
    if fo != ONE and m != NEG_INF:  # (a row that has seen nothing has O = 0)
        for c in range(dv):
            st[c] *= fo
    for c in range(dv):
        st[c] += dot_vec_col(s, sV, 0, c)


@functools.lru_cache(maxsize=None)
def make_mainloop_decode(T: str, D: int, MT: int, BCW: int, STAGES: int, WARPS: int, DV: int = 0):
    """MainloopDecode<T, D, MT, BCW, STAGES, WARPS>::run as a device function of the twin, or with DV (below D)
    MainloopDecodeLatent<T, D, DV, ...>::run (the latent cache: one split per CTA, V the K tile's first DV
    columns).

    ``run(p, g, bi, pol, group, r0, nrows, k_begin, k_end, steps, w, row, smem, st)``: split w of the CTA, this
    thread's packed row ``row``; ``steps`` is the CTA's longest split (every thread takes part in every barrier).
    The row's O goes to st[0:DV] (DV: D unless given), its max and sum to st[DV], st[DV + 1]; returns the split's
    tile count. The split's pages were checked before (block_info.pages_inside).
    """
    ROWS = 16 * MT
    Q_END = ROWS * D
    LATENT = 0 < DV < D
    DV = DV or D
    KV = 1 if LATENT else 2  # tiles a split's ring holds per stage: K (the latent cache), or K and V

    @cuda.jit(device=True)
    def run(p, g, bi, pol, group, r0, nrows, k_begin, k_end, steps, w, row, smem, st):
        sQ = smem[0:Q_END].reshape((ROWS, D))
        base = Q_END + w * KV * BCW * D
        sK = smem[base:base + BCW * D].reshape((BCW, D))
        sV = smem[base + (KV - 1) * BCW * D:base + KV * BCW * D].reshape((BCW, D))
        lo, hi, n = tile_range(pol, group, r0, nrows, k_begin, k_end, BCW)
        # ---- [mainloop_decode:init] O = 0, l = 0, m = -inf; the row's query, head (its ALiBi slope), visible keys ----
        qi, rpol, row_lo, row_hi = row_setup(p, g, bi, pol, group, r0 + row, row < nrows)
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
                copy_tile(p, g, bi, row, ROWS, sK, sV, k0, min(BCW, hi - k0), not LATENT)
            cuda.syncthreads()  # the tile is visible
            if t < n:
                # ---- [mainloop_decode:scores] S = Q K_j^T for the row, through the transform and the mask ----
                row_scores(rpol, sQ, row, sK, s, k0, qi, row_lo, row_hi)
                # ---- [mainloop_decode:softmax] online softmax of the block; O rescaled unless no row's max moved ----
                m, l, fo = update(s, ONE, m, l, False, STALE_LOG2)
                # ---- [mainloop_decode:pv] O += P V_j ----
                add_pv(st, s, sV, DV, fo, m)
        st[DV] = m
        st[DV + 1] = l
        return n

    @cuda.jit(device=True)
    def run_latent(p, g, bi, pol, group, r0, nrows, k_begin, k_end, steps, w, row, smem, st):
        sQ = smem[0:Q_END].reshape((ROWS, D))
        sK = smem[Q_END:Q_END + BCW * D].reshape((BCW, D))
        lo, hi, n = tile_range(pol, group, r0, nrows, k_begin, k_end, BCW)
        # ---- [mainloop_decode_latent:init] O = 0, l = 0, m = -inf; the row's query, head, visible keys ----
        qi, rpol, row_lo, row_hi = row_setup(p, g, bi, pol, group, r0 + row, row < nrows)
        zero(st)
        m = NEG_INF
        l = ZERO
        s = cuda.local.array(BCW, float32)
        for t in range(n):  # (one split per CTA: n is every thread's)
            k0 = lo + t * BCW
            # ---- [mainloop_decode_latent:wait] tile t (K; V is its first DV columns) in shared memory ----
            # MIRROR: a plain copy by the CTA's threads between two barriers; the CUDA C streams a cp.async ring.
            cuda.syncthreads()
            copy_tile(p, g, bi, row, ROWS, sK, sK, k0, min(BCW, hi - k0), False)
            cuda.syncthreads()
            # ---- [mainloop_decode_latent:scores] S = Q K_j^T for the row over all the tile's keys ----
            # MIRROR: the thread's row covers every key of the tile; the CUDA C's warps take 8 keys each.
            row_scores(rpol, sQ, row, sK, s, k0, qi, row_lo, row_hi)
            # ---- [mainloop_decode_latent:softmax] the tile's row max; P ----
            # MIRROR: the row's own max is the tile's; the CUDA C's warps meet in shared memory, and P goes there.
            m, l, fo = update(s, ONE, m, l, False, STALE_LOG2)
            # ---- [mainloop_decode_latent:pv] O += P V_j (V_j: the K tile's first DV columns) ----
            # MIRROR: the thread holds all DV columns of its row; the CUDA C's warps DV / WARPS each.
            add_pv(st, s, sK, DV, fo, m)
        # ---- [mainloop_decode_latent:sums] l of the whole row ----
        # MIRROR: the thread's l is the row's already; the CUDA C adds its warps' shares.
        st[DV] = m
        st[DV + 1] = l
        return n

    return run_latent if LATENT else run
