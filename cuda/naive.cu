// naive: standard attention, the baseline the FlashAttention papers beat (FA1 paper, Algorithm 0).
// S = Q K^T and O = P V are plain batched matrix products (cuBLAS through CuPy) that write S and read P from
// HBM; this kernel is the softmax between them: it reads a row of S, applies the scale and the policy's mask
// (causal, windows), and writes the row of P (in the input dtype) and its lse. One warp per row of S, three
// passes over the row. S and P are (batch, heads, seqlen_q, seqlen_k), contiguous.
#include "policy.cuh"

template <typename T>
__global__ void naive_softmax(const __grid_constant__ rf::FwdParams p, const T* __restrict__ s, T* __restrict__ prob) {
  using namespace rf;
  // ---- [naive:row] row (b * heads + h) * seqlen_q + i of S; the policy says which keys query i sees ----
  const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) >> 5;
  if (row >= (long long)p.batch * p.heads * p.seqlen_q) return;
  const int i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.heads, b = row / ((long long)p.seqlen_q * p.heads);
  const int lane = lane_id(), sk = p.seqlen_k;
  const Policy<WINDOW, false> pol(p, BlockInfo<false>(p, b, h));
  const T* srow = s + row * sk;
  T* prow = prob + row * sk;
  // ---- [naive:max] m = max_j S_ij (log2 units) ----
  float m = -INFINITY;
  for (int j = lane; j < sk; j += 32)
    if (pol.visible(i, j)) m = fmaxf(m, to_float(srow[j]) * p.scale_log2);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  // ---- [naive:sum] l = sum_j exp2(S_ij - m) ----
  const float m_use = m == -INFINITY ? 0.f : m;
  float l = 0.f;
  for (int j = lane; j < sk; j += 32)
    if (pol.visible(i, j)) l += exp2_<T>(to_float(srow[j]) * p.scale_log2 - m_use);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  // ---- [naive:write] P_ij = exp2(S_ij - m) / l; rows that see nothing get P = 0 and lse = -inf ----
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int j = lane; j < sk; j += 32)
    prow[j] = from_float<T>(pol.visible(i, j) ? exp2_<T>(to_float(srow[j]) * p.scale_log2 - m_use) * inv : 0.f);
  if (lane == 0) p.lse[row] = l > 0.f ? m * LN2 + logf(l) : -INFINITY;
}
