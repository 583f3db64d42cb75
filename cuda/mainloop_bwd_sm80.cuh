// mainloop_bwd_sm80: FA2's backward mainloop on mma.sync (Dao 2023, Alg.2 l.6-16) for one key block K_j, V_j,
// for every dtype and GPU. Warps split the keys (16 MTK rows each) and, with WC > 1, the head_dim columns of
// dK_j, dV_j. For each (query head, query block) of the walk: S^T = K_j Q_i^T and dP^T = V_j dO_i^T, then P^T and
// dS^T element by element through the policy (scores, mask on edge blocks, the transform's derivative), dV_j +=
// P^T dO_i, dK_j += dS^T Q_i; with ATOMIC_DQ, dQ_i += dS K_j through shared memory (dS^T) and float32 atomics.
// Q_i, dO_i, L_i, D_i are double-buffered: the next iteration's stream in (cp.async) behind this one's products.
// EARLY_DV (a tile-row switch, configs.TileConfig.early_dv; plain policy only): P^T and dV_j += P^T dO_i come
// before dP^T = V_j dO_i^T, with the block's first query row hidden from the optimiser
// (opaque): fewer registers for the sm_80 rows that set it (ptxas of sm_80; bench/NOTES.md).
#pragma once
#include "bwd.cuh"
#include "epilogue.cuh"
#include "sm80.cuh"

namespace rf {

// Column groups for the dQ product: as many as the warps allow while each stays a multiple of 16 columns.
constexpr int dq_column_groups(int groups, int d) {
  return (d / groups) % 16 == 0 ? groups : dq_column_groups(groups / 2, d);
}

// Q_i, dO_i to shared memory (cp.async) and L_i, D_i beside them; rows past the sequence read L = +inf, D = 0.
template <int NTHREADS, typename T, int BR, int D>
__device__ __forceinline__ void load_query_block(const Tile<T, BR, D>& sQ, const Tile<T, BR, D>& sdO, float* sL,
                                                 float* sDelta, const T* q, long long q_ss, const T* dout,
                                                 long long do_ss, const float* lse2, const float* delta, int q0,
                                                 int seqlen_q, int head_dim) {
  const int nq = min(BR, seqlen_q - q0);
  load_tile<NTHREADS>(sQ, q + q0 * q_ss, q_ss, nq, head_dim);
  load_tile<NTHREADS>(sdO, dout + q0 * do_ss, do_ss, nq, head_dim);
  cp_async_commit();
  for (int r = threadIdx.x; r < BR; r += NTHREADS) {
    sL[r] = r < nq ? lse2[q0 + r] : INFINITY;
    sDelta[r] = r < nq ? delta[q0 + r] : 0.f;
  }
}

template <typename T_, int D, int BR_, int BC_, int NWARPS, int WC, int KUNROLL, bool ATOMIC_DQ, class Pol_,
          bool EARLY_DV_ = false>
struct MainloopBwdSm80 {
  using T = T_;
  using Pol = Pol_;
  static constexpr int BR = BR_, BC = BC_, NTHREADS = NWARPS * 32, WK = NWARPS / WC, MTK = BC_ / (16 * WK);
  static constexpr int NQ = BR_ / 8, DW = D / WC;
  static constexpr bool EARLY_DV = EARLY_DV_ && !Pol_::GENERAL;  // the general policy needs dP^T with P^T
  // dQ_i (BR x D) is split into QROWS x QCOLS warp tiles of 16 x DQW, done DQC columns at a time.
  static constexpr int QROWS = BR_ / 16, QCOLS = dq_column_groups(NWARPS / QROWS, D), DQW = D / QCOLS;
  static constexpr int DQC_MAX = sizeof(T_) == 2 ? 64 : 32;                  // float32 keeps a second sum block live
  static constexpr int DQC = DQW <= DQC_MAX ? DQW : DQW % DQC_MAX == 0 ? DQC_MAX : 16;
  // K_j, V_j; two stages of Q_i, dO_i; dS^T (atomic dQ only); two stages of L_i, D_i (float32).
  static constexpr int SMEM_BYTES = (2 * BC_ + 4 * BR_) * D * (int)sizeof(T_) +
                                    (ATOMIC_DQ ? BC_ * BR_ * (int)sizeof(T_) : 0) + 4 * BR_ * 4;
  static_assert(BC_ % (16 * WK) == 0 && DW % 16 == 0 && NWARPS % QROWS == 0 && DQW % DQC == 0 && DQC % 16 == 0,
                "warp layout");
  struct State {
    Acc<MTK, DW / 8> dk, dv;
  };
  __device__ __forceinline__ static int key_row() { return 16 * MTK * (warp_id() % WK); }
  __device__ __forceinline__ static int col0() { return DW * (warp_id() / WK); }

  __device__ __forceinline__ static void run(const BwdParams& p, const typename Pol::Info& bi, Pol& pol, int k0,
                                             const QIter& walk, char* smem, State& st) {
    const int w = warp_id(), kw = key_row(), dc = col0();
    const Tile<T, BC, D> sK{(T*)smem}, sV{(T*)(smem + BC * D * sizeof(T))};
    T* const sQ0 = (T*)(smem + 2 * BC * D * sizeof(T));                     // 2 stages of Q_i, then 2 of dO_i
    T* const sdO0 = sQ0 + 2 * BR * D;
    const Tile<T, BC, BR> sdS{sdO0 + 2 * BR * D};
    float* const sL0 = (float*)(smem + SMEM_BYTES - 4 * BR * 4);             // 2 stages of L_i, then 2 of D_i
    float* const sDelta0 = sL0 + 2 * BR;
    typename Pol::Info bh = bi;                                              // the iteration's query head
    // ---- [mainloop_bwd_sm80:load_kv] Alg.2 l.6-7: K_j, V_j to shared memory once; dK_j = dV_j = 0 ----
    load_key_block<NTHREADS, BC, T>(p, bi, k0, sK, sV);
    zero(st.dk);
    zero(st.dv);
    auto issue = [&](int it) {  // start loading iteration it's Q_i, dO_i, L_i, D_i into stage it % 2
      typename Pol::Info bn = bi;
      bn.set_head(p, walk.head(it));
      const int st_ = it & 1;
      load_query_block<NTHREADS>(Tile<T, BR, D>{sQ0 + st_ * BR * D}, Tile<T, BR, D>{sdO0 + st_ * BR * D},
                                 sL0 + st_ * BR, sDelta0 + st_ * BR, bn.template q<T>(p), p.q_ss,
                                 bn.template q_like<const T>(p.dout, p.do_sb, p.do_ss, p.do_sh), p.do_ss,
                                 p.lse2 + bn.row0, p.delta + bn.row0, walk.block(it) * BR, bn.seqlen_q, p.head_dim);
    };
    if (walk.total > 0) issue(0);
    for (int it = 0; it < walk.total; ++it) {
      const int q0 = EARLY_DV ? opaque(walk.enter<BR>(p, it, bh, pol)) : walk.enter<BR>(p, it, bh, pol);
      const int stage = it & 1;
      const bool edge = walk.edge(it);
      const Tile<T, BR, D> sQ{sQ0 + stage * BR * D}, sdO{sdO0 + stage * BR * D};
      const float *sL = sL0 + stage * BR, *sDelta = sDelta0 + stage * BR;
      // ---- [mainloop_bwd_sm80:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i; the next block's stream in behind them ----
      if (it + 1 < walk.total) {
        issue(it + 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // K_j, V_j and this stage's Q_i, dO_i, L_i, D_i are visible to every warp
      // ---- [mainloop_bwd_sm80:scores] Alg.2 l.9 and l.12: S^T = K_j Q_i^T, dP^T = V_j dO_i^T ----
      Acc<MTK, NQ> pp, ds;
      zero(pp);
      gemm_abt<MTK, NQ, D, KUNROLL>(pp, sK, kw, sQ, 0);
      if constexpr (EARLY_DV) {  // P^T (Alg.2 l.10) and dV_j += P^T dO_i (l.11) before dP^T is formed
        pol.template probs_tile<T, true>(pp, q0, k0 + kw, sL, edge);
        gemm_rb<MTK, DW / 8, NQ / 2>(st.dv, pp, sdO, 0, dc);
      }
      zero(ds);
      gemm_abt<MTK, NQ, D, KUNROLL>(ds, sV, kw, sdO, 0);
      // ---- [mainloop_bwd_sm80:probs] Alg.2 l.10 and l.13: P^T = exp2(S^T - L), dS^T = P^T * (dP^T - D) ----
      if constexpr (EARLY_DV) pol.template dscores_tile<true>(pp, ds, sDelta);
      else pol.template backward_tile<T, true>(pp, ds, q0, k0 + kw, sL, sDelta, edge);
      // ---- [mainloop_bwd_sm80:dkdv] Alg.2 l.11 and l.15: dV_j += P^T dO_i, dK_j += dS^T Q_i (scale at the end) ----
      if constexpr (!EARLY_DV) gemm_rb<MTK, DW / 8, NQ / 2>(st.dv, pp, sdO, 0, dc);
      gemm_rb<MTK, DW / 8, NQ / 2>(st.dk, ds, sQ, 0, dc);
      // ---- [mainloop_bwd_sm80:dq] Alg.2 l.14: dQ_i += scale * dS K_j, through shared memory and float32 atomics ----
      if constexpr (ATOMIC_DQ) {
        if (w < WK) store_acc(sdS, ds, kw, 0);                              // column groups hold identical dS
        __syncthreads();  // all of dS^T is in shared memory
        const int qr = 16 * (w % QROWS), qc = DQW * (w / QROWS);
        float* dq_rows = p.dq_ws + bh.row0 * p.head_dim;
#pragma unroll
        for (int c0 = qc; c0 < qc + DQW && w < QROWS * QCOLS; c0 += DQC) {
          Acc<1, DQC / 8> acc;
          zero(acc);
          gemm_atb<1, DQC / 8, BC>(acc, sdS, qr, sK, c0);
          for_each(acc, [&](float& x, int row, int col) {
            const int r = q0 + qr + row, c = c0 + col;
            if (r < bh.seqlen_q && c < p.head_dim) atomicAdd(dq_rows + (long long)r * p.head_dim + c, p.scale * x);
          });
        }
      }
      __syncthreads();  // every warp is done with this stage and dS before they are refilled
    }
    cp_async_wait<0>();
  }

  __device__ __forceinline__ static void store(const BwdParams& p, const typename Pol::Info& bi, int k0,
                                               const State& st) {
    store_dkdv<T>(p, bi, st.dk, st.dv, k0 + key_row(), col0());
  }
};

}  // namespace rf
