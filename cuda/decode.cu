// decode: KV-cache attention for inference (Flash-Decoding): a few query rows per sequence against its cache.
// decode_append: k_new / v_new written into the cache (contiguous or paged) at cache_seqlens[b] + t, before.
// decode_split: grid (cdiv(num_splits, WARPS), kv_heads * row_groups, batch), each warp one split of the keys
//   (mainloop_decode.cuh) for the GQA-packed query rows of one kv head; partial O and lse to float32 buffers.
// decode_combine: one warp per (b, query, head) merges the splits by their lse, adds the sink to the denominator,
//   writes out (input dtype) and lse.
// Keys of sequence b: cache_seqlens[b] + new_keys (FwdParams::seqused_k holds cache_seqlens, as given).
#include "mainloop_decode.cuh"
#include "softmax.cuh"

namespace rf {

// Keys of one sequence after the append.
__device__ __forceinline__ int decode_keys(const FwdParams& p, int b) { return p.seqused_k[b] + p.new_keys; }

}  // namespace rf

template <typename T> __global__ void decode_append(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  // ---- [decode:append] one thread per 8 columns of one new key (K and V): into its row (or page) of the cache ----
  const int c8 = p.head_dim / 8;
  const long long n = (long long)p.batch * p.new_keys * p.kv_heads * c8;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(x % c8) * 8, hk = (x / c8) % p.kv_heads, t = (x / c8 / p.kv_heads) % p.new_keys;
    const int b = x / ((long long)c8 * p.kv_heads * p.new_keys);
    const BlockInfo<true> bi(p, b, hk * (p.heads / p.kv_heads));
    const int j = p.seqused_k[b] + t;
    float kv[8];
    load8(kv, (const T*)p.k_new + b * p.kn_sb + t * p.kn_ss + hk * p.kn_sh + c);
    store8((T*)p.k + bi.kv_row(p, p.k_sb, p.k_ss, p.k_sh, j) + c, kv);
    load8(kv, (const T*)p.v_new + b * p.vn_sb + t * p.vn_ss + hk * p.vn_sh + c);
    store8((T*)p.v + bi.kv_row(p, p.v_sb, p.v_ss, p.v_sh, j) + c, kv);
  }
}

template <typename T, int D, int MT, int BCW, int STAGES, int WARPS, int SMEM_BYTES>
__global__ void __launch_bounds__(WARPS * 32) decode_split(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  using Mainloop = MainloopDecode<T, D, MT, BCW, STAGES, WARPS>;
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES, "rawflash/launch.py and the kernel disagree on shared memory");
  constexpr int ROWS = Mainloop::ROWS;
  extern __shared__ __align__(16) char smem[];
  // ---- [decode:schedule] split s of kv head hk's packed rows [r0, r0 + ROWS) of sequence b ----
  const int group = p.heads / p.kv_heads, m_rows = group * p.seqlen_q, row_groups = cdiv(m_rows, ROWS);
  const int hk = blockIdx.y / row_groups, r0 = (blockIdx.y % row_groups) * ROWS, b = blockIdx.z;
  const int s = blockIdx.x * Mainloop::WARPS + warp_id(), nrows = min(ROWS, m_rows - r0);
  // ---- [decode:setup] the sequence (its keys after the append) and the policy ----
  BlockInfo<true> bi(p, b, hk * group);
  bi.seqlen_q = p.seqlen_q;
  bi.seqlen_k = decode_keys(p, b);
  const Policy<WINDOW, true> pol(p, bi);
  // ---- [decode:load_q] the packed Q tile (row r: query r / group, head hk * group + r % group), shared by the warps ----
  const Tile<T, ROWS, D> sQ{(T*)smem};
  using TQ = Tile<T, ROWS, D>;
  for (int idx = threadIdx.x; idx < ROWS * TQ::C; idx += WARPS * 32) {
    const int row = idx / TQ::C, col = (idx % TQ::C) * TQ::CHUNK, r = r0 + row;
    const bool valid = row < nrows && col < p.head_dim;
    const T* src = (const T*)p.q + (valid ? b * p.q_sb + (r / group) * p.q_ss + (hk * group + r % group) * p.q_sh + col : 0);
    cp_async16(sQ.saddr(row, col), src, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();  // the Q tile is visible to every warp
  if (s >= p.num_splits) return;
  // ---- [decode:mainloop] this warp's split of the keys ----
  Acc<MT, D / 8> o;
  OnlineSoftmax<2 * MT> sm;
  const int k_begin = s * p.split_keys, k_end = min(bi.seqlen_k, k_begin + p.split_keys);
  Mainloop::run(p, bi, pol, group, r0, nrows, k_begin, k_end, sQ,
                smem + Mainloop::Q_BYTES + warp_id() * STAGES * 2 * Mainloop::KV_BYTES, o, sm);
  // ---- [decode:epilogue] partial O (divided by this split's l) and partial lse, float32; empty: 0 and -inf ----
  float f[2 * MT], lse[2 * MT];
  sm.template finalize<T, false>(-INFINITY, f, lse);
  const int g = lane_id() >> 2, t = lane_id() & 3;
  float* ows = p.o_ws + s * p.ws_split;
  float* lws = p.m_ws + s * (p.ws_split / p.head_dim);
  for_each(o, [&](float& x, int row, int col) {
    const int r = r0 + row, c = col;
    if (row < nrows && c < p.head_dim) {
      const int i = r / group, h = hk * group + r % group;
      ows[(((long long)b * p.seqlen_q + i) * p.heads + h) * p.head_dim + c] = x * f[2 * (row / 16) + ((row % 16) >= 8)];
    }
  });
#pragma unroll
  for (int rr = 0; rr < 2 * MT; ++rr) {
    const int row = 16 * (rr / 2) + g + 8 * (rr % 2), r = r0 + row;
    if (t == 0 && row < nrows) lws[((long long)b * p.heads + hk * group + r % group) * p.seqlen_q + r / group] = lse[rr];
  }
}

template <typename T> __global__ void decode_combine(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  // ---- [decode:combine] one warp per (b, i, h): lse = log(sum_s e^lse_s + e^sink), out = sum_s e^(lse_s - lse) O_s ----
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;  // (b * seqlen_q + i) * heads + h
  if (row >= (long long)p.batch * p.seqlen_q * p.heads) return;
  const int h = row % p.heads, i = (row / p.heads) % p.seqlen_q, b = row / ((long long)p.heads * p.seqlen_q);
  const long long lse_row = ((long long)b * p.heads + h) * p.seqlen_q + i, lse_split = p.ws_split / p.head_dim;
  float m = p.sinks ? p.sinks[h] : -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.m_ws[s * lse_split + lse_row]);
  const float m_use = m == -INFINITY ? 0.f : m;
  auto ex = [](float x) { return sizeof(T) == 4 ? expf(x) : __expf(x); };
  float denom = p.sinks ? ex(p.sinks[h] - m_use) : 0.f;
  for (int s = 0; s < p.num_splits; ++s) denom += ex(p.m_ws[s * lse_split + lse_row] - m_use);
  const float lse = denom > 0.f ? m_use + logf(denom) : -INFINITY;
  T* out = (T*)p.o + b * p.o_sb + i * p.o_ss + h * p.o_sh;
  for (int c = lane_id(); c < p.head_dim; c += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = p.m_ws[s * lse_split + lse_row];
      if (w != -INFINITY) acc += ex(w - lse) * p.o_ws[s * p.ws_split + row * p.head_dim + c];
    }
    out[c] = from_float<T>(acc);
  }
  if (lane_id() == 0 && p.lse) p.lse[lse_row] = lse;
}
