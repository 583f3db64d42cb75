// The parameter structs: everything a kernel reads besides its template arguments, one struct per direction,
// passed by value as `const __grid_constant__` (it lives in the constant bank, like plain kernel arguments).
//
// rawflash/kernels/params.py builds the same layout as a one-element NumPy structured array, field for field
// in this order (tests/test_params.py compares the two); 8-byte fields come first so neither side pads.
// Strides are in elements: batch (sb), sequence (ss), head (sh); head_dim is contiguous.
// Per-row float32 buffers (lse, L, D, dQ's accumulator rows, split-KV partial lse) share one layout:
// row i of query head h of sequence b is at [b * lse_sb + h * lse_sh + q_row0 + i] (BlockInfo::row0), which is
// (batch, heads, seqlen_q) for fixed lengths and (heads, total_q) for packed variable lengths.
#pragma once

namespace rf {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  long long q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
  long long lse_sb, lse_sh;
  const int* cu_seqlens_q;   // (batch + 1) offsets of packed sequences; nullptr: fixed lengths
  const int* cu_seqlens_k;
  const int* seqused_k;      // (batch,) keys actually used per sequence; nullptr: all of them
  const int* block_table;    // paged K / V: (batch, max_pages) page indices; nullptr: contiguous
  long long block_table_sb;
  const float* alibi_slopes; // slope of (b, h) at alibi_slopes[b * alibi_sb + h]; nullptr: no ALiBi
  long long alibi_sb;
  const float* sinks;        // (heads,) sink logits (natural units); nullptr: no sinks
  float* o_ws;               // fa1: running O (float32); split-KV: partial O per split
  float* m_ws;               // fa1: running row max (log2 units); split-KV: partial lse per split
  float* l_ws;               // fa1: running row sum
  const void* k_new;         // decode: keys and values appended to the cache before attending (nullptr: none)
  const void* v_new;
  long long kn_sb, kn_ss, kn_sh, vn_sb, vn_ss, vn_sh;
  long long ws_split;        // split-KV: elements between two splits' partial O (their lse: ws_split / head_dim)
  const float* q_descale;    // FP8: float32 factors of the e4m3 inputs (nullptr: 1), per tensor or per
  const float* k_descale;    // (batch, kv head) at [b * descale_sb + hk * descale_sh]
  const float* v_descale;
  long long descale_sb, descale_sh;
  int* tile_counter;         // FA3's dynamic persistent grid: {next tile, CTAs done}, zero between launches (the
                             // last CTA of a launch puts both back to zero)
  int* decode_counters;      // decode_split's fused combine: CTAs done per (batch, kv head, row group), zero between
                             // launches (the last CTA puts its count back); nullptr: decode_combine merges
  int* ref_flag;             // the FA3 forward's REF_FIRST check: a launch that overflowed writes ref_gen here, and
                             // the REF_RUNNING launch after it runs only then (nullptr: no check, no guard)
  int batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim;
  int window_left, window_right;  // -1: unbounded on that side; causal is (-1, 0)
  int page_size, num_splits;
  float scale, scale_log2;   // softmax scale, and the same times log2(e)
  float softcap;             // 0: off; else scores become softcap * tanh(score / softcap)
  int new_keys;              // decode: rows of k_new / v_new per sequence
  int cache_capacity;        // decode: keys one sequence's cache holds (capacity, or page_size x max_pages)
  int num_pages;             // paged keys (decode, paged forward): pages of k, v (block_table values < num_pages)
  int cache_len;             // decode: cache_seqlens of every sequence when seqused_k is nullptr (one int given)
  int split_appends;         // decode: 1 when decode_split writes k_new / v_new itself (no decode_append launch)
  int num_partials;          // decode: partial results per row, one per CTA of decode_split (cdiv(num_splits, warps))
  int ref_gen;               // this call's number for ref_flag (never 0)
  int head_dim_v;            // v's and o's head_dim (MLA's head_dim_v; head_dim where v has q's): FA3's DV form
  int pad_;                  // (an even count of 4-byte fields: no padding on either side, tests/test_params.py)
};

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  const float* lse;          // the forward's lse (natural log)
  float* lse2;               // L = lse * log2(e) (+inf where lse = -inf, so P = 0)
  float* delta;              // D = rowsum(dO * O)
  float* dq_ws;              // float32 dQ accumulator rows (atomic dQ), already scaled
  float* dsink_ws;           // per-row terms of the sink gradient: exp(sink - lse) * D
  int* dq_semaphore;         // deterministic FA3 backward: per query block, how many key blocks have added into
                             // its dQ rows (zeroed before the launch; launch.dq_semaphores counts them)
  long long q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh, do_sb, do_ss, do_sh;
  long long dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh;
  long long lse_sb, lse_sh;
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_k;
  const float* alibi_slopes;
  long long alibi_sb;
  const float* sinks;
  int batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim;
  int rows_batch, rows_seqlen;    // the per-row buffers' (batch, seqlen): (batch, seqlen_q) or (1, total_q)
  int window_left, window_right;
  float scale, scale_log2, softcap;
  int dq_rotate;                  // deterministic FA3 backward without a mask bound: each key block's walk starts
                                  // at its own query block (Policy::dq_start; launch.fa3_bwd_dq_rotates), 0 or 1
  int longest_first;              // FA3 backward: key tiles dispatched longest first (KTileScheduler;
                                  // launch.fa3_bwd_longest_first), 0 or 1
  int head_dim_v;                 // v's, out's, dout's and dv's head_dim (MLA's head_dim_v in FA3's DV form; else
                                  // head_dim): the columns D_i sums and dV_j is stored with
};

}  // namespace rf
