// fa2_bwd_sm90: the fa2_bwd main pass (FA2 Alg.2, atomic dQ) with Hopper's warpgroup products, for float16 /
// bfloat16 and head_dim 64, 128 (warpgroups split the keys) or 256 (SPLIT_D: they split the columns) on sm_90a. fa2_bwd_preprocess (D and L in log2 units) runs before it and
// fa2_bwd_convert_dq after it, as for fa2_bwd; its Numba twin is fa2_bwd's.
//
// Grid (Tc, kv_heads, batch): one CTA per key block K_j, V_j (BC = 64 keys per warpgroup), which stay in shared
// memory while the CTA walks every query head of its GQA group and every query block Q_i (BR rows) that sees K_j.
// Warpgroup w owns keys 64w..64w+63: S^T = K_w Q_i^T and dP^T = V_w dO_i^T read both operands from shared
// memory; dV_w += P^T dO_i and dK_w += dS^T Q_i take P^T and dS^T from registers, dO_i and Q_i read MN-major.
// dQ_i += dS K_j needs every warpgroup's dS: dS^T goes to shared memory and warpgroup w computes columns
// w*D/NWG.. of dQ_i from it (both operands MN-major), added to a float32 buffer with vector reductions.
// SPLIT_D (large head_dim, where dK and dV of 64 keys x D do not fit one warpgroup's registers): two warpgroups
// share the CTA's 64 keys. Warpgroup 0 computes S^T, warpgroup 1 dP^T (handed over through shared memory);
// warpgroup 0 forms P^T and dS^T and stores both to shared memory; then each warpgroup accumulates dK, dV for its
// half of the columns, with P^T and dS^T read from shared memory (K-major), and half of dQ_i's columns.
#include "hopper.cuh"

namespace rf {

// Shared memory of one CTA in bytes; rawflash/launch.py computes the same number (checked at compile time).
// K_j, V_j; 2 x (Q_i, dO_i); dS^T; with SPLIT_D also P^T (16-bit) and dP^T (float32); 2 x (L_i, D_i).
template <int D, int BR, int BC, bool SPLIT_D> struct Fa2BwdSm90Smem {
  static constexpr int ALIGN = 1024;
  static constexpr int KV = BC * D * 2, QB = BR * D * 2, DS = BC * BR * 2, DP = SPLIT_D ? BC * BR * 4 : 0;
  static constexpr int BYTES = ALIGN + 2 * KV + 4 * QB + DS * (SPLIT_D ? 2 : 1) + DP + 4 * BR * 4;
};

}  // namespace rf

template <typename T, int D, int BR, int BC, int MIN_BLOCKS, bool CAUSAL, bool SPLIT_D, int SMEM_BYTES>
__global__ void __launch_bounds__((SPLIT_D ? 2 : BC / 64) * 128, MIN_BLOCKS)
fa2_bwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
             const float* __restrict__ lse2, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
             float* __restrict__ dq_ws, long long q_sb, long long q_ss, long long q_sh, long long k_sb,
             long long k_ss, long long k_sh, long long v_sb, long long v_ss, long long v_sh, long long do_sb,
             long long do_ss, long long do_sh, long long dk_sb, long long dk_ss, long long dk_sh, long long dv_sb,
             long long dv_ss, long long dv_sh, int seqlen_q, int seqlen_k, int heads, int kv_heads, int head_dim,
             float scale, float scale_log2) {
  using namespace rf;
  using Smem = Fa2BwdSm90Smem<D, BR, BC, SPLIT_D>;
  constexpr int NWG = SPLIT_D ? 2 : BC / 64, NTHREADS = NWG * 128, NQ = BR / 8, DQN = D / NWG;
  constexpr int DW = SPLIT_D ? D / 2 : D, NO = DW / 8;                      // dK, dV columns of one warpgroup
  static_assert(Smem::BYTES == SMEM_BYTES, "rawflash/launch.py and the kernel disagree on shared memory");
  static_assert(BC % 64 == 0 && BR == 64 && D % 64 == 0 && DQN % 32 == 0, "warpgroup tiles: dQ_i is one 64-row wgmma");
  static_assert(!SPLIT_D || BC == 64, "SPLIT_D: both warpgroups own the same 64 keys");
  // A warpgroup's column slice (dQ_i's, and with SPLIT_D dK_j's and dV_j's) must not straddle two 64-column panels:
  // an MN-major operand may start inside a panel only when it ends there (head_dim 192 would split at 96).
  static_assert((DQN % 64 == 0 || 64 % DQN == 0) && (DW % 64 == 0 || 64 % DW == 0), "column slices within panels");
  // ---- [fa2_bwd_sm90:setup] key block j, kv head hk, batch b; warpgroup w owns keys kw.. ----
  extern __shared__ __align__(1024) char smem[];
  const u32 base = ((u32)__cvta_generic_to_shared(smem) + Smem::ALIGN - 1) & ~(u32)(Smem::ALIGN - 1);
  const Sw128<T, BC, D> sK{base}, sV{base + Smem::KV};
  const u32 q_base = base + 2 * Smem::KV, do_base = q_base + 2 * Smem::QB;
  const Sw128<T, BC, BR> sdS{do_base + 2 * Smem::QB};
  char* const aligned = smem + (base - (u32)__cvta_generic_to_shared(smem));
  const Sw128<T, BC, BR> sP{sdS.base + Smem::DS};                          // SPLIT_D only
  float* const sdP = (float*)(aligned + 2 * Smem::KV + 4 * Smem::QB + 2 * Smem::DS);  // SPLIT_D only
  float* const sL0 = (float*)(aligned + Smem::BYTES - Smem::ALIGN - 4 * BR * 4);  // 2 stages of L_i, then of D_i
  float* const sDelta0 = sL0 + 2 * BR;
  const int j = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, group = heads / kv_heads, k0 = j * BC;
  const int w = warpgroup_id(), kw = SPLIT_D ? 0 : 64 * w, wk = kw + 16 * warp_in_group();  // wk: warp's first key
  const int dc = SPLIT_D ? w * DW : 0;                                     // first dK, dV column of this warpgroup
  const Mask mask{seqlen_q, seqlen_k, CAUSAL};
  const int nk = min(BC, seqlen_k - k0), tr = (seqlen_q + BR - 1) / BR;
  // The CTA visits (h, i) for every query head h of the group and every query block i that sees K_j, in order.
  const int i0 = mask.first_query_block(k0, BR), nqb = max(0, tr - i0), n_iter = group * nqb;
  // ---- [fa2_bwd_sm90:load_kv] Alg.2 l.6-7: K_j, V_j to shared memory once; dK_j = dV_j = 0 ----
  load_tile<NTHREADS>(sK, k + b * k_sb + hk * k_sh + k0 * k_ss, k_ss, nk, head_dim);
  load_tile<NTHREADS>(sV, v + b * v_sb + hk * v_sh + k0 * v_ss, v_ss, nk, head_dim);
  cp_async_commit();
  float dk_acc[NO][4], dv_acc[NO][4];
  zero(reinterpret_cast<float (&)[1][NO][4]>(dk_acc));
  zero(reinterpret_cast<float (&)[1][NO][4]>(dv_acc));
  // Start loading iteration it's Q_i, dO_i, L_i, D_i into stage it % 2, all with cp.async (a plain load would
  // stall its warp, and with it the warpgroup's next wgmma, for a full memory latency every step). Rows past
  // seqlen_q read Q = dO = 0 and L = D = 0: their P is 1 but their dP and dO are 0, so they add nothing to dV_j,
  // dK_j, and their dQ rows are never written.
  auto issue = [&](int it) {
    const int h = hk * group + it / nqb, q0 = (i0 + it % nqb) * BR, st = it & 1, nq = min(BR, seqlen_q - q0);
    const long long bh = (long long)b * heads + h;
    load_tile<NTHREADS>(Sw128<T, BR, D>{q_base + st * Smem::QB}, q + b * q_sb + h * q_sh + q0 * q_ss, q_ss, nq,
                        head_dim);
    load_tile<NTHREADS>(Sw128<T, BR, D>{do_base + st * Smem::QB}, dout + b * do_sb + h * do_sh + q0 * do_ss, do_ss,
                        nq, head_dim);
    for (int r = threadIdx.x; r < 2 * BR; r += NTHREADS) {
      const int row = r % BR;
      const float* src = (r < BR ? lse2 : delta) + bh * seqlen_q + q0 + (row < nq ? row : 0);
      cp_async4((u32)__cvta_generic_to_shared((r < BR ? sL0 : sDelta0) + st * BR + row), src, row < nq);
    }
    cp_async_commit();
  };
  if (n_iter > 0) issue(0);
  for (int it = 0; it < n_iter; ++it) {
    const int h = hk * group + it / nqb, q0 = (i0 + it % nqb) * BR, st = it & 1;
    const long long bh = (long long)b * heads + h;
    const Sw128<T, BR, D> sQ{q_base + st * Smem::QB}, sdO{do_base + st * Smem::QB};
    const float *sL = sL0 + st * BR, *sDelta = sDelta0 + st * BR;
    // ---- [fa2_bwd_sm90:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i have landed; the next block's stream in behind ----
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();  // this stage is visible to all; every warpgroup is done with the other stage and with dS^T
    if (it + 1 < n_iter) issue(it + 1);
    // ---- [fa2_bwd_sm90:scores] Alg.2 l.9-10 and l.12: S^T = K_w Q_i^T and dP^T = V_w dO_i^T ----
    // (SPLIT_D: warpgroup 0 computes S^T, warpgroup 1 dP^T and hands it over through shared memory)
    float s[1][NQ][4], dp[1][NQ][4];
    const int t = lane_id() & 3, tw = threadIdx.x & 127;
    if constexpr (SPLIT_D) {  // one instruction stream for both warpgroups (ptxas serialises wgmma in divergent code)
      const Sw128<T, BC, D> sA{w == 0 ? sK.base : sV.base};
      const Sw128<T, BR, D> sB{w == 0 ? sQ.base : sdO.base};
      wgmma_fence();
      wg_gemm_abt(s[0], sA, 0, sB, 0, false);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(s[0]);
      if (w == 1) {
#pragma unroll
        for (int y = 0; y < NQ; ++y)
#pragma unroll
          for (int e = 0; e < 4; ++e) sdP[(4 * y + e) * 128 + tw] = s[0][y][e];  // same (warp, lane) reads it back
      }
      __syncthreads();  // dP^T is in shared memory
    } else {
      wgmma_fence();
      wg_gemm_abt(s[0], sK, kw, sQ, 0, false);
      wgmma_commit();
      wg_gemm_abt(dp[0], sV, kw, sdO, 0, false);
      wgmma_commit();
      wgmma_wait<1>();
      fence_operand(s[0]);
    }
    // ---- [fa2_bwd_sm90:probs] P^T = exp2(S^T scale_log2 - L_i) while dP^T is still running ----
    if (!SPLIT_D || w == 0) {
      if (mask.block_needs_mask(q0, BR, k0, BC)) apply_mask_t(s, mask, k0 + wk, q0);
#pragma unroll
      for (int y = 0; y < NQ; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][y][e] = exp2_<T>(fmaf(s[0][y][e], scale_log2, -sL[8 * y + 2 * t + (e & 1)]));
    }
    // ---- [fa2_bwd_sm90:ds] Alg.2 l.13: dS^T = P^T * (dP^T - D_i), to registers (A operands) and to shared memory ----
    u32 p_a[NQ / 2][4], ds_a[NQ / 2][4];
    if constexpr (SPLIT_D) {
      if (w == 0) {
#pragma unroll
        for (int y = 0; y < NQ; ++y)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dp[0][y][e] = s[0][y][e] * (sdP[(4 * y + e) * 128 + tw] - sDelta[8 * y + 2 * t + (e & 1)]);
        store_acc(sP, s[0], wk, 0);
        store_acc(sdS, dp[0], wk, 0);
        fence_async_smem();
      }
      __syncthreads();  // P^T and dS^T are in shared memory; every thread is done reading dP^T
    } else {
      wgmma_wait<0>();
      fence_operand(dp[0]);
#pragma unroll
      for (int y = 0; y < NQ; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[0][y][e] = s[0][y][e] * (dp[0][y][e] - sDelta[8 * y + 2 * t + (e & 1)]);
      to_a_operand<T>(p_a, s[0]);
      to_a_operand<T>(ds_a, dp[0]);
      store_acc(sdS, dp[0], wk, 0);
      fence_async_smem();
    }
    // ---- [fa2_bwd_sm90:dkdv] Alg.2 l.11 and l.15: dV_w += P^T dO_i, dK_w += dS^T Q_i (scale applied at the end) ----
    fence_operand(dk_acc);
    fence_operand(dv_acc);
    wgmma_fence();
    if constexpr (SPLIT_D) {                                               // this warpgroup's columns dc..dc+DW
      wg_gemm_ab<BR>(dv_acc, sP, 0, sdO, dc, true);
      wg_gemm_ab<BR>(dk_acc, sdS, 0, sQ, dc, true);
    } else {
      wg_gemm_rb(dv_acc, p_a, sdO, 0, 0);
      wg_gemm_rb(dk_acc, ds_a, sQ, 0, 0);
    }
    wgmma_commit();
    // ---- [fa2_bwd_sm90:dq] Alg.2 l.14: dQ_i += scale * dS K_j, columns w*D/NWG.. from dS^T in shared memory ----
    if constexpr (!SPLIT_D) __syncthreads();  // every warpgroup's dS^T is in shared memory
    float dq[DQN / 8][4];
    wg_gemm_atb<BC>(dq, sdS, 0, sK, w * DQN, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(dq);
    fence_operand(dk_acc);
    fence_operand(dv_acc);
    const int g = lane_id() >> 2, qr = 16 * warp_in_group();
    float* dq_bh = dq_ws + bh * seqlen_q * head_dim;
#pragma unroll
    for (int y = 0; y < DQN / 8; ++y)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = q0 + qr + g + 8 * hh, col = w * DQN + 8 * y + 2 * t;
        if (row < seqlen_q && col < head_dim)
          red_add2(dq_bh + (long long)row * head_dim + col, scale * dq[y][2 * hh], scale * dq[y][2 * hh + 1]);
      }
  }
  // ---- [fa2_bwd_sm90:epilogue] Alg.2 l.17: write dK_j (times scale) and dV_j (zero when no query sees K_j) ----
  cp_async_wait<0>();
  float fk[2] = {scale, scale}, fv[2] = {1.f, 1.f};
  store_rows<T>(dk + b * dk_sb + hk * dk_sh, dk_ss, reinterpret_cast<float (&)[1][NO][4]>(dk_acc), fk, k0 + wk, dc,
                seqlen_k, head_dim);
  store_rows<T>(dv + b * dv_sb + hk * dv_sh, dv_ss, reinterpret_cast<float (&)[1][NO][4]>(dv_acc), fv, k0 + wk, dc,
                seqlen_k, head_dim);
}
