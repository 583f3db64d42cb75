"""decode twin: KV-cache attention for inference (Flash-Decoding), mirroring ``cuda/decode.cu``.

decode_split runs one split of the keys per "warp" (mainloop_decode.py) for the GQA-packed query rows of one kv head,
merges the CTA's splits into one float32 partial O and lse, and with one row group (p.split_appends) first writes the
new keys of its own range into the cache; with the counters (p.has_counters: ``forms.decode_fuses_combine``) the last
CTA of each (batch, kv head, row group) then merges the partials itself. decode_append writes k_new / v_new into the
cache (contiguous or paged) at cache_seqlens[b] + t before it otherwise; decode_combine_warp (up to 32 partials) and
decode_combine merge the partials by their lse and add the sink when decode_split does not. The launch never
depends on cache_seqlens: sequence b's keys are cut into num_splits runs of cdiv(tiles_b, num_splits) tiles, splits
past its keys are empty. A sequence whose cache_seqlens + new keys lies outside [0, cache_capacity], or whose used
pages lie outside the cache, gets NaN out and lse and no append.

Every kernel takes ``(p, q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws,
counters)``: params.py's DecodeParams and the arrays of DecodeArrays.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from .block_info import BlockInfo, block_info, key_index, page_pos, page_slot, pages_inside, slot_inside
from .common import NEG_INF, ZERO, Twin, cdiv, is_float32
from .mainloop_decode import make_mainloop_decode, smem_bytes, threads, tile_range
from .params import DecodeArrays
from .policy import WINDOW, make_policy
from .softmax import finalize_row

NAN = float32(np.nan)
COMBINE_THREADS = 32


@cuda.jit(device=True)
def cache_len(p, g, b):
    """cache_seqlens[b] as given (used_k; cache_len when an int was given for every sequence)."""
    return g.used_k[b] if p.has_seqused else p.cache_len


@cuda.jit(device=True)
def len_ok(p, n):
    """Whether a sequence's lengths fit its cache: 0 <= cache_seqlens[b] <= capacity - new keys."""
    return n >= 0 and n <= p.cache_capacity - p.new_keys


@cuda.jit(device=True)
def append_chunk(p, g, bi, length, t, c, values):
    """Columns [c, c + 8) of new key t (K and V; K alone without ``values``: the latent cache) of sequence bi.b, kv
    head bi.hk, into the cache as key length + t; nothing where that key's page lies outside the cache (length was
    checked with len_ok)."""
    page, row = page_pos(p, bi, length + t)
    if not slot_inside(p, page_slot(p, g, bi, page)):
        return  # the page lies outside the cache
    slot, at = key_index(p, g, bi, page, row, 0)
    for e in range(8):
        g.k[slot, at, bi.hk, c + e] = g.k_new[bi.b, t, bi.hk, c + e]
        if values:
            g.v[slot, at, bi.hk, c + e] = g.v_new[bi.b, t, bi.hk, c + e]


@cuda.jit(device=True)
def packed_item(x, width, r0, hk, group):
    """Item x of a walk over ``width`` columns of the packed rows from r0 of kv head hk: (row in the tile, column,
    query, head). MIRROR: the CUDA C's items are 4-column chunks."""
    rr = x // width
    r = r0 + rr
    return rr, x % width, r // group, hk * group + r % group


@cuda.jit(device=True)
def combine_rows(p, g, smem, b, hk, group, r0, nrows, parts, cols):
    """decode_combine_rows: rows [r0, r0 + nrows) of kv head hk's packed rows of sequence b from the ``parts`` CTA
    partials, decode_combine's math (the sink added, a NaN lse making the row NaN), out and lse written; smem holds
    the rows' weights (rows x parts) and then their lse. math.exp for every dtype, as the combine twins."""
    # MIRROR: the weights flat (row rr's partial c at rr * parts + c), then the rows' lse, as the CUDA C lays them
    rl = nrows * parts
    for rr in range(cuda.threadIdx.x, nrows, cuda.blockDim.x):
        r = r0 + rr
        i = r // group
        h = hk * group + r % group
        w0 = rr * parts
        m = NEG_INF
        nan = False
        for c in range(parts):
            x = g.m_ws[c, b, h, i]
            smem[w0 + c] = x
            nan = nan or math.isnan(x)
            m = max(m, x)
        if p.has_sinks:
            m = max(m, g.sinks[h])
        m_use = ZERO if m == NEG_INF else m
        denom = ZERO
        for c in range(parts):
            denom += float32(math.exp(smem[w0 + c] - m_use))
        if p.has_sinks:
            denom += float32(math.exp(g.sinks[h] - m_use))
        row_lse = NAN if nan else (m_use + float32(math.log(denom)) if denom > ZERO else NEG_INF)
        for c in range(parts):
            x = smem[w0 + c]
            smem[w0 + c] = ZERO if x == NEG_INF or nan else float32(math.exp(x - row_lse))
        smem[rl + rr] = row_lse
        g.lse[b, h, i] = row_lse
    cuda.syncthreads()  # every row's weights and lse
    for x in range(cuda.threadIdx.x, nrows * cols, cuda.blockDim.x):
        rr, c, i, h = packed_item(x, cols, r0, hk, group)
        acc = ZERO
        for cc in range(parts):
            wt = smem[rr * parts + cc]
            if wt != ZERO:  # no O was written for a weight of 0
                acc += wt * g.o_ws[cc, b, i, h, c]
        g.o[b, i, h, c] = NAN if math.isnan(smem[rl + rr]) else acc


@functools.lru_cache(maxsize=None)
def _cache_is_t(T: str, C: str) -> None:
    """The twins read caches of the queries' type only (an FP8 cache, C = rf::e4m3, has no twin)."""
    if C != T:
        raise NotImplementedError(f"the decode twins read caches of q's type; got a {C} cache for {T} queries (FP8 "
                                  "caches run on the CUDA C kernels only)")


def make_decode_append(T: str, C: str, VALUES: bool = True) -> Twin:
    """The twin of ``decode_append<T, C, VALUES>`` (C = T): one thread per 8 columns of one new key, with the
    Launch's grid and block."""
    _cache_is_t(T, C)

    @cuda.jit
    def decode_append(p, q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws, counters):
        g = DecodeArrays(q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws,
                         counters)
        # ---- [decode:append] one thread per 8 columns of one new key (K and V): into its cache row (or page) ----
        c8 = p.head_dim // 8
        n = p.batch * p.new_keys * p.kv_heads * c8
        for x in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n, cuda.gridDim.x * cuda.blockDim.x):
            c = (x % c8) * 8
            hk = (x // c8) % p.kv_heads
            t = (x // c8 // p.kv_heads) % p.new_keys
            b = x // (c8 * p.kv_heads * p.new_keys)
            length = cache_len(p, g, b)
            if not len_ok(p, length):
                continue  # out of the cache: nothing written (decode_split makes b's rows NaN)
            append_chunk(p, g, block_info(True, p, g, b, hk * (p.heads // p.kv_heads)), length, t, c, VALUES)

    return Twin(decode_append, None, 0)


@functools.lru_cache(maxsize=None)
def make_decode_split(T: str, C: str, D: int, MT: int, BCW: int, STAGES: int, WARPS: int, SMEM_BYTES: int,
                      DV: int = 0) -> Twin:
    """The twin of ``decode_split<...>``, taking the CUDA template's arguments in order (``Launch.template_args``;
    the cache's type C is T: FP8 caches have no twin); launched with the Launch's grid, ``Twin.threads`` threads
    (SPLITS splits of 16 MT packed rows: WARPS, or one with DV, the latent cache's value columns) and ``Twin.smem``
    bytes (float32 tiles, one stage)."""
    _cache_is_t(T, C)
    ROWS = 16 * MT
    LATENT = 0 < DV < D
    DV = DV if LATENT else D
    SPLITS = 1 if LATENT else WARPS  # (the CUDA C: WARPS / WC)
    STATE = DV + 2  # the row's O, m, l (the CUDA C's accumulator fragments and OnlineSoftmax)
    EXACT = is_float32(T)
    run = make_mainloop_decode(T, D, MT, BCW, STAGES, WARPS, DV if LATENT else 0)

    @cuda.jit
    def decode_split(p, q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws, counters):
        g = DecodeArrays(q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws,
                         counters)
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem.
        smem = cuda.shared.array(0, float32)
        last = cuda.shared.array(1, int32)
        st = cuda.local.array(STATE, float32)
        # ---- [decode:schedule] split s of kv head hk's packed rows [r0, r0 + ROWS) of sequence b ----
        group = p.heads // p.kv_heads
        m_rows = group * p.seqlen_q
        row_groups = cdiv(m_rows, ROWS)
        hk = cuda.blockIdx.y // row_groups
        r0 = (cuda.blockIdx.y % row_groups) * ROWS
        b = cuda.blockIdx.z
        w = cuda.threadIdx.x // ROWS  # the thread's split in the CTA
        row = cuda.threadIdx.x % ROWS
        s = cuda.blockIdx.x * SPLITS + w
        nrows = min(ROWS, m_rows - r0)
        vcols = p.head_dim_v if LATENT else p.head_dim  # O's columns
        # ---- [decode:setup] the sequence (its keys after the append, checked against the cache) and the policy ----
        length = cache_len(p, g, b)
        ok = len_ok(p, length)
        bi0 = block_info(True, p, g, b, hk * group)
        # MIRROR: a new namedtuple with the decode lengths where the CUDA C assigns bi.seqlen_q / seqlen_k.
        bi = BlockInfo(bi0.b, bi0.ab, bi0.h, bi0.hk, p.seqlen_q, length + p.new_keys if ok else 0, 0, 0)
        pol = make_policy(WINDOW, True, EXACT, p, g, bi)
        # ---- [decode:load_q] the packed Q tile (row r: query r / group, head hk * group + r % group) ----
        sQ = smem[0:ROWS * D].reshape((ROWS, D))
        for idx in range(cuda.threadIdx.x, ROWS * D, cuda.blockDim.x):
            rr = idx // D
            c = idx % D
            r = r0 + rr
            sQ[rr, c] = float32(g.q[b, r // group, hk * group + r % group, c]) if rr < nrows and c < p.head_dim \
                else ZERO
        cuda.syncthreads()  # the Q tile is visible to every thread
        # ---- [decode:q_half] (FP8 caches only, which have no twin: the CUDA C's float16 Q tile) ----
        # ---- [decode:split_append] the split's keys [k_begin, k_end); the new keys among them into the cache ----
        # The s-th run of cdiv(tiles, num_splits) key tiles; the runs cover every key whatever the mask, so each new
        # key has one writer: the split whose range holds it, seen by its rows or not.
        # MIRROR: splits past num_splits stay (as empty splits) where the CUDA C's warps return; the split's ROWS
        # threads share the chunks where the CUDA C's 32 lanes do, and a CTA barrier stands for its __threadfence()
        # and __syncwarp() (every thread of the twin reaches it).
        per = cdiv(cdiv(bi.seqlen_k, BCW), p.num_splits) * BCW
        active = s < p.num_splits
        k_begin = s * per if active else 0
        k_end = min(bi.seqlen_k, k_begin + per) if active else 0
        if p.split_appends and ok:
            j0 = max(k_begin, length)
            j1 = min(k_end, length + p.new_keys)
            c8 = p.head_dim // 8
            for x in range(row, max(0, j1 - j0) * c8, ROWS):
                append_chunk(p, g, bi, length, j0 - length + x // c8, (x % c8) * 8, not LATENT)
        cuda.syncthreads()  # the split's new keys are in the cache before any tile is read
        # ---- [decode:mainloop] this warp's split: its key tiles through the ring (mainloop_decode.py) ----
        # MIRROR: every thread finds the CTA's longest split: the twin's barriers are the whole CTA's.
        steps = 0
        for ww in range(SPLITS):
            sw = cuda.blockIdx.x * SPLITS + ww
            sb = sw * per
            se = min(bi.seqlen_k, sb + per)
            if sw < p.num_splits and pages_inside(p, g, bi, sb, se):
                steps = max(steps, tile_range(pol, group, r0, nrows, sb, se, BCW)[2])
        wrong = not ok or not pages_inside(p, g, bi, k_begin, k_end)  # the split's pages, once
        tiles = run(p, g, bi, pol, group, r0, nrows, k_begin, k_begin if wrong else k_end, steps, w, row, smem, st)
        # ---- [decode:merge] the CTA's splits into one partial O (divided by its l) and lse, float32 ----
        # Each split's O (divided by its own l) and lse into shared memory, then each item of a row merges the
        # WARPS splits by their lse: lse = log sum_w e^lse_w, O = sum_w e^(lse_w - lse) O_w; one partial per CTA.
        # Past num_splits or without a key: lse -inf (weight 0); a sequence outside its cache: NaN; a partial's O
        # only where its lse is finite.
        # MIRROR: the scratch is the twin's float32 tiles (rows D + 1 long: O, then the lse) where the CUDA C carves
        # DecodeMerge's; the merge's items are single columns where the CUDA C's are 4-column chunks.
        cuda.syncthreads()  # every split is done with the tiles
        f, row_lse = finalize_row(st[DV], st[DV + 1], NEG_INF, False)
        scratch = smem[0:SPLITS * ROWS * (DV + 1)].reshape((SPLITS, ROWS, DV + 1))
        for c in range(DV):
            scratch[w, row, c] = st[c] * f if active and tiles > 0 and not wrong else ZERO
        scratch[w, row, DV] = NEG_INF if not active else (NAN if wrong else row_lse)
        cuda.syncthreads()  # every split's O and lse are in shared memory
        cta = cuda.blockIdx.x
        for x in range(cuda.threadIdx.x, nrows * vcols, cuda.blockDim.x):
            rr, c, i, h = packed_item(x, vcols, r0, hk, group)
            m = NEG_INF
            nan = False
            for ww in range(SPLITS):
                nan = nan or math.isnan(scratch[ww, rr, DV])
                m = max(m, scratch[ww, rr, DV])
            m_use = ZERO if m == NEG_INF else m
            denom = ZERO
            for ww in range(SPLITS):
                denom += float32(math.exp(scratch[ww, rr, DV] - m_use))
            lw = NAN if nan else (m_use + float32(math.log(denom)) if denom > ZERO else NEG_INF)
            if c == 0:
                g.m_ws[cta, b, h, i] = lw
            if not nan and lw != NEG_INF:
                acc = ZERO
                for ww in range(SPLITS):
                    if scratch[ww, rr, DV] != NEG_INF:  # no O was written for it
                        acc += float32(math.exp(scratch[ww, rr, DV] - lw)) * scratch[ww, rr, c]
                g.o_ws[cta, b, i, h, c] = acc
        if not p.has_counters:
            return  # decode_combine merges the partials in a launch of its own
        # ---- [decode:fused_combine] the last CTA of (b, hk, row group) to finish merges every CTA's partial ----
        # MIRROR: the count by numba's atomic add after a fence, as the CUDA C's; the combine's lse one thread per row
        # (the CUDA C: a warp per row, lanes over the partials), then single columns summed over the partials in
        # order (the CUDA C: 4-column chunks, BATCH loads in flight).
        cuda.threadfence()
        cuda.syncthreads()
        pair = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
        if cuda.threadIdx.x == 0:
            done = cuda.atomic.add(g.counters, pair, 1)
            last[0] = 1 if done == cuda.gridDim.x - 1 else 0
            if last[0] == 1:
                g.counters[pair] = 0
        cuda.syncthreads()
        if last[0] == 0:
            return
        cuda.threadfence()
        combine_rows(p, g, smem, b, hk, group, r0, nrows, cuda.gridDim.x, vcols)

    return Twin(decode_split, threads(ROWS, SPLITS), smem_bytes(D, ROWS, BCW, SPLITS, LATENT))


@functools.lru_cache(maxsize=None)
def make_decode_combine(T: str, THREADS: int, MAX_SPLITS: int, SMEM_BYTES: int, NARROW_V: bool = False) -> Twin:
    """The twin of ``decode_combine<T, THREADS, MAX_SPLITS, SMEM_BYTES, NARROW_V>``: one CTA per (b, i, h) row,
    COMBINE_THREADS threads."""

    @cuda.jit
    def decode_combine(p, q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws, m_ws,
                       counters):
        # MIRROR: static shared arrays (a weight per split, the row's lse and NaN flag); the CUDA C carves its
        # dynamic shared memory into a partial sum per thread, the weights and a value per warp.
        w = cuda.shared.array(MAX_SPLITS, float32)
        red = cuda.shared.array(2, float32)
        # ---- [decode:combine] row (b, i, h): lse = log(sum_s e^lse_s + e^sink), out = sum_s e^(lse_s - lse) O_s ----
        # MIRROR: thread 0 reduces the lse alone and each thread sums whole columns over every split; the CUDA C
        # reduces over its threads and splits the splits among groups of threads. math.exp for every dtype.
        row = cuda.blockIdx.x
        h = row % p.heads
        i = (row // p.heads) % p.seqlen_q
        b = row // (p.heads * p.seqlen_q)
        splits = min(p.num_partials, MAX_SPLITS)  # (the CTAs' partials)
        for s in range(cuda.threadIdx.x, splits, cuda.blockDim.x):
            w[s] = m_ws[s, b, h, i]
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            m = sinks[h] if p.has_sinks else NEG_INF
            nan = False
            for s in range(splits):
                nan = nan or math.isnan(w[s])
                m = max(m, w[s])
            m_use = ZERO if m == NEG_INF else m
            denom = float32(math.exp(sinks[h] - m_use)) if p.has_sinks else ZERO
            for s in range(splits):
                denom += float32(math.exp(w[s] - m_use))
            red[0] = NAN if nan else (m_use + float32(math.log(denom)) if denom > ZERO else NEG_INF)
            red[1] = float32(1.0) if nan else ZERO
        cuda.syncthreads()
        row_lse = red[0]
        nan = red[1] != ZERO
        for c in range(cuda.threadIdx.x, p.head_dim_v if NARROW_V else p.head_dim, cuda.blockDim.x):
            acc = ZERO
            for s in range(splits):
                if w[s] != NEG_INF and not nan:
                    acc += float32(math.exp(w[s] - row_lse)) * o_ws[s, b, i, h, c]
            o[b, i, h, c] = NAN if nan else acc
        if cuda.threadIdx.x == 0:
            lse[b, h, i] = row_lse

    return Twin(decode_combine, COMBINE_THREADS, 0)


@functools.lru_cache(maxsize=None)
def make_decode_combine_warp(T: str, WARPS: int, NARROW_V: bool = False) -> Twin:
    """The twin of ``decode_combine_warp<T, WARPS, NARROW_V>``: WARPS (b, i, h) rows per CTA (num_splits <= 32), one
    thread per row."""

    @cuda.jit
    def decode_combine_warp(p, q, k, v, k_new, v_new, o, lse, cu_q, cu_k, used_k, slopes, sinks, table, o_ws,
                            m_ws, counters):
        # MIRROR: a per-thread array of the row's split lse where the CUDA C keeps one per lane.
        w = cuda.local.array(32, float32)
        # ---- [decode:combine_warp] row (b, i, h) by one warp (num_splits <= 32), WARPS rows per CTA ----
        # MIRROR: one thread per row does the lanes' work in turn: the max and the sum over the splits in order
        # (the CUDA C: xor-shuffle trees), each column summed over every split in order (the CUDA C's order below
        # 128 columns: groups of lanes over every groups-th split, then the groups in order). math.exp for every
        # dtype.
        row = cuda.blockIdx.x * WARPS + cuda.threadIdx.x
        if row >= p.batch * p.seqlen_q * p.heads:
            return
        h = row % p.heads
        i = (row // p.heads) % p.seqlen_q
        b = row // (p.heads * p.seqlen_q)
        splits = min(p.num_partials, 32)
        nan = False
        m = NEG_INF
        for s in range(splits):
            w[s] = m_ws[s, b, h, i]
            nan = nan or math.isnan(w[s])
            m = max(m, w[s])
        if p.has_sinks:
            m = max(m, sinks[h])
        m_use = ZERO if m == NEG_INF else m
        denom = ZERO
        for s in range(splits):
            denom += float32(math.exp(w[s] - m_use))
        if p.has_sinks:
            denom += float32(math.exp(sinks[h] - m_use))
        row_lse = NAN if nan else (m_use + float32(math.log(denom)) if denom > ZERO else NEG_INF)
        for s in range(splits):
            w[s] = ZERO if w[s] == NEG_INF or nan else float32(math.exp(w[s] - row_lse))
        for c in range(p.head_dim_v if NARROW_V else p.head_dim):
            acc = ZERO
            for s in range(splits):
                if w[s] != ZERO:  # empty splits wrote no O
                    acc += w[s] * o_ws[s, b, i, h, c]
            o[b, i, h, c] = NAN if nan else acc
        lse[b, h, i] = row_lse

    return Twin(decode_combine_warp, WARPS, 0)
