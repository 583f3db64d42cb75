// fa2_fwd_sm90: the fa2_fwd algorithm (FA2 Alg.1: sequence parallelism, split-Q, deferred normalisation) with
// Hopper's warpgroup products, for float16 / bfloat16 and head_dim a multiple of 64 on sm_90a. Its Numba twin is
// fa2_fwd's: the same algorithm and results; the sections differ where the wgmma pipeline orders the steps
// differently (S_{j+1} is computed before P_j V_j, see OVERLAP).
//
// A CTA of BR/64 warpgroups takes query block Q_i; warpgroup w owns rows 64w..64w+63 (split-Q at warpgroup
// grain). S = Q_i K_j^T reads both operands from shared memory; O += P V_j takes P from registers and V_j from
// shared memory read MN-major (no transpose). K_j and V_j are double-buffered and stream in with cp.async one
// block ahead, so one barrier per key block suffices.
// OVERLAP (FA3's intra-warpgroup pipelining, Shah et al. 2024, Alg.1): S_{j+1} = Q K_{j+1}^T and O += P_j V_j
// are issued together, and the softmax of block j+1 runs on the CUDA cores while P_j V_j runs on the tensor cores.
#include "hopper.cuh"

namespace rf {

// Shared memory of one CTA in bytes; rawflash/launch.py computes the same number (checked at compile time).
template <int D, int BR, int BC> struct Fa2FwdSm90Smem {
  static constexpr int ALIGN = 1024;                                     // slack to align the tiles to 1024 B
  static constexpr int Q = BR * D * 2, KV = BC * D * 2;
  static constexpr int BYTES = ALIGN + Q + 4 * KV;                       // Q_i; two stages of K_j and of V_j
};

// Online softmax of one key block (FA2 Alg.1 l.9), S raw (unscaled) in, P = exp2(S scale_log2 - m_new) out in place.
// m is in log2 units; fo receives e^(m_old - m_new), the factor O must be rescaled by.
template <typename T, int NT>
__device__ __forceinline__ void online_softmax(float (&s)[1][NT][4], float (&m)[2], float (&l)[2], float (&fo)[2],
                                               float scale_log2) {
  float mx[2], rs[2];
  row_max(mx, s);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], mx[r] * scale_log2);
    mx[r] = m_new == -INFINITY ? 0.f : m_new;                              // a row with nothing visible keeps P = 0
    fo[r] = exp2_<T>(m[r] - mx[r]);
    m[r] = m_new;
  }
#pragma unroll
  for (int y = 0; y < NT; ++y)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][y][e] = exp2_<T>(fmaf(s[0][y][e], scale_log2, -mx[e >> 1]));
  row_sum(rs, s);
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = fo[r] * l[r] + rs[r];
}

}  // namespace rf

template <typename T, int D, int BR, int BC, int MIN_BLOCKS, bool CAUSAL, bool OVERLAP, int SMEM_BYTES>
__global__ void __launch_bounds__(BR / 64 * 128, MIN_BLOCKS)
fa2_fwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
             float* __restrict__ lse, long long q_sb, long long q_ss, long long q_sh, long long k_sb, long long k_ss,
             long long k_sh, long long v_sb, long long v_ss, long long v_sh, long long o_sb, long long o_ss,
             long long o_sh, int seqlen_q, int seqlen_k, int heads, int kv_heads, int head_dim, float scale_log2) {
  using namespace rf;
  using Smem = Fa2FwdSm90Smem<D, BR, BC>;
  static_assert(Smem::BYTES == SMEM_BYTES, "rawflash/launch.py and the kernel disagree on shared memory");
  static_assert(BR % 64 == 0 && BC % 16 == 0 && D % 64 == 0, "warpgroups own 64 rows; panels of 64 columns");
  constexpr int NTHREADS = BR / 64 * 128, NT = BC / 8, NO = D / 8;
  // ---- [fa2_fwd_sm90:setup] (batch, head) from the grid; query head h reads kv head h / (heads / kv_heads) ----
  extern __shared__ __align__(1024) char smem[];
  const u32 base = ((u32)__cvta_generic_to_shared(smem) + Smem::ALIGN - 1) & ~(u32)(Smem::ALIGN - 1);
  const Sw128<T, BR, D> sQ{base};
  const u32 k_base = base + Smem::Q, v_base = k_base + 2 * Smem::KV;
  auto sK = [&](int j) { return Sw128<T, BC, D>{k_base + (j & 1) * Smem::KV}; };
  auto sV = [&](int j) { return Sw128<T, BC, D>{v_base + (j & 1) * Smem::KV}; };
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (heads / kv_heads);
  q += b * q_sb + h * q_sh;
  k += b * k_sb + hk * k_sh;
  v += b * v_sb + hk * v_sh;
  const Mask mask{seqlen_q, seqlen_k, CAUSAL};
  // ---- [fa2_fwd_sm90:schedule] sequence parallelism: one query block per CTA, longest causal rows first ----
  const int i = (seqlen_q + BR - 1) / BR - 1 - (int)blockIdx.x;
  const int q0 = i * BR, nrows = min(BR, seqlen_q - q0), wg_row = 64 * warpgroup_id();
  const int wq = wg_row + 16 * warp_in_group();                            // this warp's first row in the block
  const int tc = mask.key_blocks(q0, nrows, BC);                           // key blocks past the diagonal: never loaded
  // ---- [fa2_fwd_sm90:load_q] Alg.1 l.4: Q_i to shared memory, where it stays; K_0, then V_0 behind it ----
  load_tile<NTHREADS>(sQ, q + q0 * q_ss, q_ss, nrows, head_dim);
  if (tc > 0) load_tile<NTHREADS>(sK(0), k, k_ss, min(BC, seqlen_k), head_dim);
  cp_async_commit();
  if (tc > 0) load_tile<NTHREADS>(sV(0), v, v_ss, min(BC, seqlen_k), head_dim);
  cp_async_commit();
  // ---- [fa2_fwd_sm90:init] Alg.1 l.5: O = 0, l = 0, m = -inf ----
  float acc_o[1][NO][4], s[1][NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, fo[2];
  u32 p[NT / 2][4];
  zero(acc_o);
  // ---- [fa2_fwd_sm90:first_scores] S_0 = Q_i K_0^T and its softmax; K_1 streams in meanwhile ----
  cp_async_wait<1>();
  fence_async_smem();
  __syncthreads();  // Q_i and K_0 have landed
  if (tc > 1) load_tile<NTHREADS>(sK(1), k + BC * k_ss, k_ss, min(BC, seqlen_k - BC), head_dim);
  cp_async_commit();
  if (tc > 0) {
    wgmma_fence();
    wg_gemm_abt(s[0], sQ, wg_row, sK(0), 0, false);
    wgmma_commit();
    wgmma_wait<0>();
    if (mask.block_needs_mask(q0, BR, 0, BC)) apply_mask(s, mask, q0 + wq, 0);
    online_softmax<T>(s, m, l, fo, scale_log2);
    to_a_operand<T>(p, s[0]);
  }
  for (int j = 0; j < tc; ++j) {
    const int k0 = j * BC;
    const bool next = j + 1 < tc;
    // ---- [fa2_fwd_sm90:load_kv] V_j and K_{j+1} have landed; V_{j+1} and K_{j+2} start streaming ----
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();  // V_j, K_{j+1} visible to all; every warpgroup is done with V_{j-1} (P_{j-1} V_{j-1} waited) and K_j
    if (next) load_tile<NTHREADS>(sV(j + 1), v + (k0 + BC) * v_ss, v_ss, min(BC, seqlen_k - k0 - BC), head_dim);
    if (j + 2 < tc) load_tile<NTHREADS>(sK(j), k + (k0 + 2 * BC) * k_ss, k_ss, min(BC, seqlen_k - k0 - 2 * BC), head_dim);
    cp_async_commit();
    // ---- [fa2_fwd_sm90:issue] Alg.1 l.8 and l.10: S_{j+1} = Q_i K_{j+1}^T and O += P_j V_j on the tensor cores ----
    // (each branch waits for everything it issued: ptxas serialises every wgmma when a batch may cross a branch)
    fence_operand(acc_o[0]);
    wgmma_fence();
    if (next) {
      if (OVERLAP) {
        wg_gemm_abt(s[0], sQ, wg_row, sK(j + 1), 0, false);
        wgmma_commit();
      }
      wg_gemm_rb(acc_o[0], p, sV(j), 0, 0);
      wgmma_commit();
      if (!OVERLAP) {
        wg_gemm_abt(s[0], sQ, wg_row, sK(j + 1), 0, false);
        wgmma_commit();
      }
      // ---- [fa2_fwd_sm90:softmax] Alg.1 l.9 for block j+1 while P_j V_j runs (OVERLAP), then O *= e^(m_old - m_new) ----
      if (OVERLAP) wgmma_wait<1>();                                       // S_{j+1} is done; P_j V_j may still run
      else wgmma_wait<0>();
      fence_operand(s[0]);
      if (mask.block_needs_mask(q0, BR, k0 + BC, BC)) apply_mask(s, mask, q0 + wq, k0 + BC);
      online_softmax<T>(s, m, l, fo, scale_log2);
      wgmma_wait<0>();
      fence_operand(acc_o[0]);
      scale_rows(acc_o, fo);                                              // Alg.1 l.10: diag(e^(m_old - m_new)) O
      to_a_operand<T>(p, s[0]);
    } else {
      // ---- [fa2_fwd_sm90:last_pv] the last key block: O += P_j V_j alone ----
      wg_gemm_rb(acc_o[0], p, sV(j), 0, 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(acc_o[0]);
    }
  }
  // ---- [fa2_fwd_sm90:epilogue] Alg.1 l.12-13: O_i = diag(l)^-1 O_i, L_i = m_i + log(l_i); hidden rows get 0, -inf ----
  float f[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) f[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  store_rows<T>(o + b * o_sb + h * o_sh, o_ss, acc_o, f, q0 + wq, 0, seqlen_q, head_dim);
  const int g = lane_id() >> 2;
  float* lse_bh = lse + ((long long)b * heads + h) * seqlen_q;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + wq + g + 8 * r;
    if ((lane_id() & 3) == 0 && row < seqlen_q) lse_bh[row] = l[r] > 0.f ? m[r] * LN2 + logf(l[r]) : -INFINITY;
  }
  cp_async_wait<0>();  // no copy may still be writing when the CTA exits
}
