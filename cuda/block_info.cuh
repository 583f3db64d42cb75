// BlockInfo: where one (sequence, head) of a call lives. It turns block coordinates into the sequence's lengths,
// its first rows in the (possibly packed) tensors and typed pointers, so kernels never do (batch, head) pointer
// arithmetic themselves. Variable lengths (cu_seqlens_q / cu_seqlens_k: packed sequences with the batch stride
// 0) and seqused_k (fewer keys used than stored) are read here and nowhere else, in the VARLEN instantiations
// (fixed-length kernels keep the lengths as plain parameters, which costs no registers); decode's KV cache,
// contiguous or paged, is located here too: page_pos, page_slot and key_offsets read the page table, and
// pages_inside checks it; a paged forward's keys through paged_key.
#pragma once
#include "core.cuh"
#include "params.cuh"

namespace rf {

template <bool VARLEN> struct BlockInfo {
  int b, h, hk;            // sequence (batch index), query head, and the kv head it reads (GQA: h / group)
  int seqlen_q, seqlen_k;  // this sequence's lengths, seqused_k applied
  int q_row0, k_row0;      // the sequence's first row in q / k: cu_seqlens for packed sequences, else 0
  long long row0;          // per-row float32 buffers (lse, L, D, dQ rows): query row i is [row0 + i]

  template <class P> __device__ __forceinline__ BlockInfo(const P& p, int b_, int h_) : b(b_) {
    if constexpr (VARLEN) {  // lengths from the batch's offsets (the Python side passes them whenever one is set)
      q_row0 = p.cu_seqlens_q ? p.cu_seqlens_q[b] : 0;
      k_row0 = p.cu_seqlens_k ? p.cu_seqlens_k[b] : 0;
      seqlen_q = p.cu_seqlens_q ? p.cu_seqlens_q[b + 1] - q_row0 : p.seqlen_q;
      seqlen_k = p.cu_seqlens_k ? p.cu_seqlens_k[b + 1] - k_row0 : p.seqlen_k;
      if (p.seqused_k) seqlen_k = p.seqused_k[b];
    } else {                 // fixed lengths: plain parameters (they stay in the constant bank)
      q_row0 = k_row0 = 0;
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
    }
    hk = h_ / (p.heads / p.kv_heads);
    set_head(p, h_);
  }
  // The same sequence, query head h of the same GQA group (the backward walks the query heads of one kv head).
  template <class P> __device__ __forceinline__ void set_head(const P& p, int h_) {
    h = h_;
    row0 = b * p.lse_sb + h * p.lse_sh + q_row0;
  }

  // Row 0 of this (sequence, head) in a tensor laid out like q (query rows, query heads) or like k (kv heads).
  template <typename T> __device__ __forceinline__ T* q_like(const void* base, long long sb, long long ss,
                                                             long long sh) const {
    return (T*)base + b * sb + q_row0 * ss + h * sh;
  }
  template <typename T> __device__ __forceinline__ T* k_like(const void* base, long long sb, long long ss,
                                                             long long sh) const {
    return (T*)base + b * sb + k_row0 * ss + hk * sh;
  }
  template <typename T, class P> __device__ __forceinline__ const T* q(const P& p) const {
    return q_like<const T>(p.q, p.q_sb, p.q_ss, p.q_sh);
  }
  template <typename T, class P> __device__ __forceinline__ const T* k(const P& p) const {
    return k_like<const T>(p.k, p.k_sb, p.k_ss, p.k_sh);
  }
  template <typename T, class P> __device__ __forceinline__ const T* v(const P& p) const {
    return k_like<const T>(p.v, p.v_sb, p.v_ss, p.v_sh);
  }
  // ---- KV caches (decode): key j of the sequence is row `row` of its page `page`, the page being the cache's
  // "batch" entry block_table[b][page] (one page per batch entry of the cache); a contiguous cache is one page
  // of cache_capacity rows, the sequence's own batch entry. Keys are located once per tile: page_pos divides
  // (once), key_offsets walks on from there with a carry (no division), so a tile costs one division.
  struct PagePos {
    int page, row;
  };
  // Where key j0 of this sequence is: (page, row in it); a contiguous cache: (0, k_row0 + j0).
  __device__ __forceinline__ PagePos page_pos(const FwdParams& p, int j0) const {
    if (!p.block_table) return {0, k_row0 + j0};
    const int page = j0 / p.page_size;
    return {page, j0 - page * p.page_size};
  }
  // The cache entry of page `page` of this sequence (block_table's value; a contiguous cache: the sequence).
  __device__ __forceinline__ long long page_slot(const FwdParams& p, int page) const {
    return p.block_table ? p.block_table[b * p.block_table_sb + page] : b;
  }
  // Whether a cache entry is one of the cache's pages (a page table's value is the caller's).
  __device__ __forceinline__ static bool slot_inside(const FwdParams& p, long long slot) {
    return !p.block_table || (slot >= 0 && slot < p.num_pages);
  }
  // Whether every page holding keys [j0, j1) of this sequence is inside the cache: checked once per split by the
  // calling warp's lanes together (all 32 must call it), so the key loop itself reads the table unchecked.
  __device__ __forceinline__ bool pages_inside(const FwdParams& p, int j0, int j1) const {
    bool bad = false;
    if (p.block_table && j1 > j0)
      for (int page = j0 / p.page_size + lane_id(); page <= (j1 - 1) / p.page_size; page += 32)
        bad |= !slot_inside(p, page_slot(p, page));
    return !__any_sync(0xffffffffu, bad);
  }
  // A paged forward's keys (block_table set, no cu_seqlens_k): the element offset of key j of this sequence and kv
  // head, row j % page_size of page block_table[b][j / page_size], in a tensor of page stride sb, row stride ss
  // and head stride sh (the host checked the table's used entries).
  // Pages of a power-of-two size (16, 64, 256: the usual ones) take a shift and a mask instead of the division.
  __device__ __forceinline__ long long paged_key(const FwdParams& p, int j, long long sb, long long ss,
                                                 long long sh) const {
    const int ps = p.page_size;
    const bool pow2 = (ps & (ps - 1)) == 0;  // (uniform)
    const int page = pow2 ? j >> (__ffs(ps) - 1) : j / ps, row = pow2 ? j & (ps - 1) : j - page * ps;
    return page_slot(p, page) * sb + (long long)row * ss + hk * sh;
  }
  // Element offsets into k and v (strides of FwdParams) of key pos + r of this sequence and kv head hk, r >= 0.
  __device__ __forceinline__ void key_offsets(const FwdParams& p, PagePos pos, int r, long long& ko,
                                              long long& vo) const {
    int page = pos.page, row = pos.row + r;
    if (p.block_table)
      while (row >= p.page_size) row -= p.page_size, ++page;  // the carry into the next pages
    const long long slot = page_slot(p, page);
    ko = slot * p.k_sb + (long long)row * p.k_ss + hk * p.k_sh;
    vo = slot * p.v_sb + (long long)row * p.v_ss + hk * p.v_sh;
  }
};

}  // namespace rf
