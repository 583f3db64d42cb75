// Tile schedulers: which tile a CTA works on. One owner for the grid <-> tile mapping of every launch, so a
// kernel body never reads blockIdx itself. launch.py's grid formulas are the other half of each mapping.
#pragma once
#include "core.cuh"
#include "params.cuh"

namespace rf {

// Tile t of packed sequences (cu: batch + 1 offsets) cut into tiles of `rows`: tile i of sequence b, counting
// the tiles of each sequence in turn. Each warp finds (b, i) by itself with a prefix sum over the batch, 32
// sequences at a time (no shared memory, no barrier). False when t is past the last tile (the grid is an upper
// bound: cdiv(total, rows) + batch). Within a sequence the tiles come last-first when `reverse`.
__device__ __forceinline__ bool varlen_tile(const int* cu, int batch, int rows, int t, bool reverse, int& b, int& i) {
  const int lane = lane_id();
  int before = 0;  // tiles of the sequences before this chunk of 32
  for (int b0 = 0; b0 < batch; b0 += 32) {
    const int bb = b0 + lane;
    const int n = bb < batch ? cdiv(cu[bb + 1] - cu[bb], rows) : 0;
    int incl = n;  // inclusive prefix sum over the lanes
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    if (t < before + total) {
      const int owner = __ffs(__ballot_sync(0xffffffffu, before + incl > t)) - 1;  // first lane ending past t
      const int first = before + __shfl_sync(0xffffffffu, incl - n, owner), count = __shfl_sync(0xffffffffu, n, owner);
      b = b0 + owner;
      i = reverse ? first + count - 1 - t : t - first;
      return true;
    }
    before += total;
  }
  return false;
}

// Query tiles of a forward launch. Fixed lengths: grid (Tr, heads, batch). Packed sequences: grid (an upper bound
// on the tiles of all sequences, heads, 1). Within one (b, h) the tiles run last-first: under a causal mask the
// longest rows start first (longest-processing-time first). SERIAL (FA2's sequence parallelism off, the ablation):
// grid (1, heads, batch), one CTA walks every query block of its (b, h) in turn. VARLEN: the packed mapping is
// compiled in (the general policy's kernels).
template <int BR, bool SERIAL, bool VARLEN> struct QTileScheduler {
  int b, h, i, stop;
  template <class P> __device__ __forceinline__ bool start(const P& p) {
    h = blockIdx.y;
    if (VARLEN && p.cu_seqlens_q) {
      stop = 0;
      if (!varlen_tile(p.cu_seqlens_q, p.batch, BR, blockIdx.x, true, b, i)) return false;
      stop = i + 1;
      return true;
    }
    b = blockIdx.z;
    const int tr = cdiv(p.seqlen_q, BR);
    i = SERIAL ? 0 : tr - 1 - (int)blockIdx.x;
    stop = SERIAL ? tr : i + 1;
    return i < stop;
  }
  // One tile per CTA unless SERIAL, said at compile time: the compiler does not fold ++i < i + 1 and would keep
  // the skeleton's tile loop (16 more registers and 200 more instructions at d = 128, offline; bench/NOTES.md).
  __device__ __forceinline__ bool advance() { return SERIAL && ++i < stop; }
};

// Query tiles as one linear index t over a 1-d grid: (b, h) outer, the tile i inner and last-first, so the CTAs
// running at one time share the K and V of a few heads in L2. Fixed lengths: t < Tr * heads * batch. Packed
// sequences: u = t % U over the upper bound U = cdiv(total_q, BR) + batch of tiles of a head (varlen_tile;
// indices past the last real tile are holes, skipped). PERSISTENT: a grid of about one CTA per SM, each CTA
// taking t = blockIdx.x, + gridDim.x, ... (a static schedule); otherwise one tile per CTA.
template <int BR, bool PERSISTENT, bool VARLEN> struct LinearTileScheduler {
  static constexpr bool DYNAMIC = false;
  int b, h, i, t;
  template <class P> __device__ __forceinline__ bool start(const P& p) {
    t = blockIdx.x;
    return find(p);
  }
  template <class P> __device__ __forceinline__ bool advance(const P& p) {
    if (!PERSISTENT) return false;
    t += gridDim.x;
    return find(p);
  }
  template <class P> __device__ __forceinline__ bool find(const P& p) {
    if (VARLEN && p.cu_seqlens_q) {
      const int per_head = cdiv(p.cu_seqlens_q[p.batch], BR) + p.batch;
      for (; t < per_head * p.heads; t += PERSISTENT ? gridDim.x : per_head * p.heads) {
        h = t / per_head;
        if (varlen_tile(p.cu_seqlens_q, p.batch, BR, t % per_head, true, b, i)) return true;
      }
      return false;
    }
    const int tr = cdiv(p.seqlen_q, BR);
    if (t >= tr * p.heads * p.batch) return false;
    const int bh = t / tr;
    i = tr - 1 - (t - bh * tr);
    h = bh % p.heads;
    b = bh / p.heads;
    return true;
  }
};

// LinearTileScheduler's tiles handed out at run time (FA3's dynamic persistent grid): a CTA takes the next index
// from a global counter when it is ready for a tile, so unequal tiles (causal) spread over the CTAs as the
// hardware's dispatch of one CTA per tile spreads them, while each CTA still overlaps one tile's end with the
// next one's copies. The producer warp takes the index (start / advance) and publishes it in shared memory
// before it copies Q_i (Fa3FwdPipeline::produce; -1 when none is left, produce_end); the consumers read it once
// Q_i's barrier has completed (Fa3FwdPipeline::published_tile, then take). The counters {next, done} are zero
// at launch: every CTA takes indices until one is past the last tile, then counts itself done, and the last one
// to do so puts both back to zero for the next launch on the stream (one launch per stream at a time: the backend
// keeps one pair per stream).
template <int BR> struct DynamicTileScheduler : LinearTileScheduler<BR, true, false> {
  static constexpr bool DYNAMIC = true;
  // ---- producer warp (all 32 lanes) ----
  // The next index is taken when the tile ends: taking it a tile ahead, when this tile starts, is 6 % slower
  // (non-causal, d = 128, N = 16384, H200; bench/NOTES.md).
  template <class P> __device__ __forceinline__ bool start(const P& p) { return fetch(p); }
  template <class P> __device__ __forceinline__ bool advance(const P& p) { return fetch(p); }
  template <class P> __device__ __forceinline__ bool fetch(const P& p) {
    int next = 0;
    if (lane_id() == 0) next = atomicAdd(p.tile_counter, 1);
    this->t = __shfl_sync(0xffffffffu, next, 0);
    if (this->find(p)) return true;
    if (lane_id() == 0) {
      __threadfence();  // this CTA's last take is ordered before its count (the reset must follow every take)
      if (atomicAdd(p.tile_counter + 1, 1) == (int)gridDim.x - 1) {
        atomicExch(p.tile_counter, 0);
        atomicExch(p.tile_counter + 1, 0);
      }
    }
    return false;
  }
  // ---- consumers: the index the producer published for the next Q_i (Fa3FwdPipeline::published_tile; -1:
  // none is left) ----
  template <class P> __device__ __forceinline__ bool take(const P& p, int published) {
    if (published < 0) return false;
    this->t = published;
    return this->find(p);
  }
};

// Key tiles of a backward launch: grid (Tc, kv_heads, batch), or for packed sequences (an upper bound on the key
// tiles of all sequences, kv_heads, 1). hk is the kv head; the CTA walks the query heads of its group itself.
// `reverse`: within one (sequence, kv head) the key tiles come last-first (the deterministic backward under a mask
// bounded on the right: the key blocks that reach a query block first are then also dispatched first).
// PAIR: CTAs 2m, 2m + 1 (a cluster of two) take key tiles 2i, 2i + 1 of one sequence: packed sequences are cut
// into pairs of tiles (2 BC keys, an odd count's last tile past the keys) and the pair index mapped as above.
// `longest_first` (fixed lengths, no PAIR; launch.fa3_bwd_longest_first): the grid's CTAs in dispatch
// (block-index) order take key tile 0 of every (batch, kv head), then tile 1 of every one, and so on: under a mask
// bounded on the right tile j's walk is the longest for j = 0 and shortens with j, so the longest walks start first
// everywhere and the last waves hold short ones (longest-processing-time first). In the grid's own order (one
// (batch, kv head)'s tiles after another's) the last one's tile 0, a longest walk, starts in the last waves.
template <int BC, bool VARLEN, bool PAIR = false> struct KTileScheduler {
  int b, hk, j;
  template <class P>
  __device__ __forceinline__ bool start(const P& p, bool reverse = false, bool longest_first = false) {
    if (!PAIR && longest_first && !(VARLEN && p.cu_seqlens_k)) {
      const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), pairs = gridDim.y * gridDim.z;
      j = lin / pairs;
      hk = lin % pairs % gridDim.y;
      b = lin % pairs / gridDim.y;
      return true;
    }
    hk = blockIdx.y;
    if (VARLEN && p.cu_seqlens_k) {
      if constexpr (PAIR) {
        if (!varlen_tile(p.cu_seqlens_k, p.batch, 2 * BC, (int)blockIdx.x >> 1, reverse, b, j)) return false;
        j = 2 * j + (int)(blockIdx.x & 1);
        return true;
      }
      return varlen_tile(p.cu_seqlens_k, p.batch, BC, blockIdx.x, reverse, b, j);
    }
    b = blockIdx.z;
    j = reverse ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    return true;
  }
};

}  // namespace rf
