// BlockInfo: where one (sequence, head) of a call lives. It turns block coordinates into the sequence's lengths,
// its first rows in the (possibly packed) tensors and typed pointers, so kernels never do (batch, head) pointer
// arithmetic themselves. Variable lengths (cu_seqlens_q / cu_seqlens_k: packed sequences with the batch stride
// 0) and seqused_k (fewer keys used than stored) are read here and nowhere else, in the VARLEN instantiations
// (fixed-length kernels keep the lengths as plain parameters, which costs no registers); a paged K / V cache
// adds its page lookup here too (kv_row).
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
  // Paged K / V (FwdParams::block_table): element offset of key j of this sequence and kv head, the page's
  // index times the batch stride (one page per "batch" entry of the cache) plus the row within the page.
  __device__ __forceinline__ long long kv_row(const FwdParams& p, long long sb, long long ss, long long sh,
                                              int j) const {
    if (!p.block_table) return b * sb + (long long)(k_row0 + j) * ss + hk * sh;
    const int page = p.block_table[b * p.block_table_sb + j / p.page_size];
    return page * sb + (long long)(j % p.page_size) * ss + hk * sh;
  }
};

}  // namespace rf
