// The split-K warp partition of FlashAttention-1 (FA2 paper, section 3.3): every warp of the CTA sees all BR query
// rows and a slice of BC / NWARPS keys of a block. Each warp writes its partial row max, row sum and P~ V for its
// keys to its own slot of shared memory (plain stores, no atomics); after one barrier every warp merges, for
// D / NWARPS columns of all BR rows, the slots of all warps into the running state it holds in registers. That is
// the shared-memory traffic split-K must pay (NWARPS partial O of BR x D float32 per block, written once and read
// once) and nothing more. fa1_fwd uses it with its state in HBM, and so does fa2_fwd with SPLIT_Q off (the
// ablation of FA2's split-Q) with its state in registers.
#pragma once
#include "policy.cuh"
#include "sm80.cuh"
#include "softmax.cuh"

namespace rf {

// The slots of one split-K step. A warp's partial O is stored in mma.sync's C-fragment order (tile (i, jd), lane,
// element: one 16-byte store or load per lane and 16 x 8 tile, conflict-free), so the warp that merges columns
// jd reads the values its own lanes hold in the same C layout.
template <int BR, int D, int NWARPS> struct SplitK {
  static constexpr int MT = BR / 16, ND = D / 8, OWN = ND / NWARPS;  // OWN: n-tiles of O each warp merges
  static constexpr int SLOT = BR * D;                                  // float32 words of one warp's partial O
  static constexpr int BYTES = (NWARPS * SLOT + 2 * NWARPS * BR) * 4;
  static_assert(BR % 16 == 0 && ND % NWARPS == 0, "whole m-tiles; the warps merge equal column slices of O");
  float* o;    // [NWARPS][MT][ND][32][4]  P~ V over each warp's keys
  float* mx;   // [NWARPS][BR]             row max (log2 units) over each warp's keys
  float* sum;  // [NWARPS][BR]             row sum of exp2(S - mx) over each warp's keys
  __device__ explicit SplitK(char* base) : o((float*)base), mx(o + NWARPS * SLOT), sum(mx + NWARPS * BR) {}
  __device__ __forceinline__ float4* frag(int w, int i, int jd) const {
    return reinterpret_cast<float4*>(o + w * SLOT) + (i * ND + jd) * 32 + lane_id();
  }
};

// The running state one warp merges into: O of its columns [8 OWN w, 8 OWN (w + 1)) of all BR rows (C layout) and
// m (log2 units), l of the rows its lanes hold (every warp holds every row's m and l).
template <int BR, int D, int NWARPS> struct SplitKState {
  Acc<BR / 16, SplitK<BR, D, NWARPS>::OWN> o;
  float m[2 * (BR / 16)], l[2 * (BR / 16)];
  __device__ __forceinline__ void init() {
    zero(o);
#pragma unroll
    for (int r = 0; r < 2 * (BR / 16); ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  }
  __device__ __forceinline__ static int col0() { return 8 * SplitK<BR, D, NWARPS>::OWN * warp_id(); }
};

// One block step (FA1 Alg.1 l.9-10 within a CTA) for this warp's keys [k0 + kw, k0 + kw + BC / NWARPS): S = Q K^T
// (through the policy's transform and, on edge blocks, its mask), the warp's own row max m_w, P~ = exp2(S - m_w),
// its row sum l_w and P~ V, all into the warp's slot. No barrier: the caller's next __syncthreads() publishes it.
template <int BR, int BC, int D, int NWARPS, typename T, class Pol>
__device__ __forceinline__ void splitk_block(const SplitK<BR, D, NWARPS>& sk, const Tile<T, BR, D>& sQ,
                                             const Tile<T, BC, D>& sK, const Tile<T, BC, D>& sV, const Pol& pol,
                                             int q0, int k0, bool edge) {
  constexpr int MT = BR / 16, KEYS = BC / NWARPS, NT = KEYS / 8, DC = D % 64 == 0 ? 64 : 32;
  static_assert(KEYS % 16 == 0 && D % DC == 0, "each warp takes whole 16-key slices");
  const int w = warp_id(), g = lane_id() >> 2, t = lane_id() & 3, kw = w * KEYS;
  Acc<MT, NT> s;
  zero(s);
  gemm_abt<MT, NT, D, 1>(s, sQ, 0, sK, kw);                                     // FA1 Alg.1 l.9: S_ij slice
  pol.template scores<T>(s, q0, k0 + kw, edge);
  pol.template prescale<T>(s);
  float mx[2 * MT], base[2 * MT], sum[2 * MT];
  row_max(mx, s);                                                              // FA1 Alg.1 l.10: m~ of this slice
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // a hidden row keeps P~ = 0
  for_each_row(s, [&](float& x, int r) { x = exp2_<T>(x - base[r]); });
  row_sum(sum, s);
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r)
    if (t == 0) {
      sk.mx[w * BR + 16 * (r / 2) + g + 8 * (r % 2)] = mx[r];
      sk.sum[w * BR + 16 * (r / 2) + g + 8 * (r % 2)] = sum[r];
    }
#pragma unroll
  for (int dc = 0; dc < D; dc += DC) {                                         // P~ V over this warp's keys
    Acc<MT, DC / 8> pv;
    zero(pv);
    gemm_rb<MT, DC / 8, NT / 2>(pv, s, sV, kw, dc);
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < DC / 8; ++j)
        *sk.frag(w, i, dc / 8 + j) = make_float4(pv.v[i][j][0], pv.v[i][j][1], pv.v[i][j][2], pv.v[i][j][3]);
  }
}

// Merge the block in the slots into the running state (FA1 Alg.1 l.11-12), after the barrier that follows
// splitk_block: m_new = max(m, m_w over warps), l_new = e^(m - m_new) l + sum_w e^(m_w - m_new) l_w, and for this
// warp's columns O_new = e^(m - m_new) O + sum_w e^(m_w - m_new) (P~ V)_w. NORMALIZE keeps O divided by l after every
// block (FA1); otherwise O stays unnormalised until the end (FA2's deferred normalisation). Reads the slots only.
template <typename T, bool NORMALIZE, int BR, int D, int NWARPS>
__device__ __forceinline__ void splitk_merge(const SplitK<BR, D, NWARPS>& sk, SplitKState<BR, D, NWARPS>& st) {
  constexpr int MT = BR / 16, OWN = SplitK<BR, D, NWARPS>::OWN;
  const int w = warp_id(), g = lane_id() >> 2;
  float f[NWARPS][2 * MT], alpha[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    const int row = 16 * (r / 2) + g + 8 * (r % 2);
    float mw[NWARPS], m_new = st.m[r];
#pragma unroll
    for (int v = 0; v < NWARPS; ++v) {
      mw[v] = sk.mx[v * BR + row];
      m_new = fmaxf(m_new, mw[v]);
    }
    const float m_use = m_new == -INFINITY ? 0.f : m_new;                      // nothing visible yet: finite factors
    const float a = exp2_<T>(st.m[r] - m_use);
    float l_new = a * st.l[r];
#pragma unroll
    for (int v = 0; v < NWARPS; ++v) {
      f[v][r] = mw[v] == -INFINITY ? 0.f : exp2_<T>(mw[v] - m_use);
      l_new += f[v][r] * sk.sum[v * BR + row];
    }
    const float inv = (NORMALIZE && l_new > 0.f) ? 1.f / l_new : 1.f;
    alpha[r] = NORMALIZE ? a * st.l[r] * inv : a;
#pragma unroll
    for (int v = 0; v < NWARPS; ++v) f[v][r] *= inv;
    st.m[r] = m_new;
    st.l[r] = l_new;
  }
  scale_rows(st.o, alpha);
#pragma unroll
  for (int v = 0; v < NWARPS; ++v)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < OWN; ++j) {
        const float4 x = *sk.frag(v, i, w * OWN + j);
        float(&o)[4] = st.o.v[i][j];
        o[0] = fmaf(f[v][2 * i], x.x, o[0]);
        o[1] = fmaf(f[v][2 * i], x.y, o[1]);
        o[2] = fmaf(f[v][2 * i + 1], x.z, o[2]);
        o[3] = fmaf(f[v][2 * i + 1], x.w, o[3]);
      }
}


// The forward mainloop with FA1's split-K partition (the ablation of FA2's split-Q, fa2_fwd with SPLIT_Q off): all
// warps see all BR rows of Q_i and split the keys of each block; the running O, m, l live in the registers of the
// warps that merge them (SplitKState), and the tile's store writes them out.
template <typename T_, int D, int BR_, int BC, int NWARPS, bool DEFER_NORM, class Pol_> struct MainloopFwdSplitK {
  using T = T_;
  using Pol = Pol_;
  using SK = SplitK<BR_, D, NWARPS>;
  static constexpr int BR = BR_, NTHREADS = NWARPS * 32, TILES = (BR_ + 2 * BC) * D * (int)sizeof(T_);
  static constexpr int SMEM_BYTES = TILES + SK::BYTES;  // Q_i, K_j, V_j, the slots
  using State = SplitKState<BR_, D, NWARPS>;

  __device__ __forceinline__ static void run(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                             char* smem, State& st) {
    const Tile<T, BR, D> sQ{(T*)smem};
    const Tile<T, BC, D> sK{(T*)(smem + BR * D * sizeof(T))}, sV{(T*)(smem + (BR + BC) * D * sizeof(T))};
    const SK sk(smem + TILES);
    const T *q = bi.template q<T>(p), *k = bi.template k<T>(p), *v = bi.template v<T>(p);
    const int nrows = min(BR, bi.seqlen_q - q0);
    const BlockRange kv = pol.kv_blocks(q0, nrows, BC);
    auto load_kv = [&](int s) {
      const int k0 = kv.block(s) * BC;
      load_tile<NTHREADS>(sK, k + k0 * p.k_ss, p.k_ss, min(BC, bi.seqlen_k - k0), p.head_dim);
      load_tile<NTHREADS>(sV, v + k0 * p.v_ss, p.v_ss, min(BC, bi.seqlen_k - k0), p.head_dim);
    };
    // ---- [splitk:init] O = 0, m = -inf, l = 0 in registers; Q_i and the first K_j, V_j to shared memory ----
    st.init();
    load_tile<NTHREADS>(sQ, q + q0 * p.q_ss, p.q_ss, nrows, p.head_dim);
    if (kv.n() > 0) load_kv(0);
    cp_async_commit();
    for (int s = 0; s < kv.n(); ++s) {
      // ---- [splitk:step] every warp takes BC/NWARPS keys into its slot; one barrier; every warp merges ----
      cp_async_wait<0>();
      __syncthreads();  // K_j, V_j (and Q_i) have landed; every warp is done merging the previous block's slots
      splitk_block<BR, BC, D, NWARPS>(sk, sQ, sK, sV, pol, q0, kv.block(s) * BC, kv.is_edge(s));
      __syncthreads();  // every warp's partials are in its slot; K_j, V_j are free
      if (s + 1 < kv.n()) load_kv(s + 1);  // K_{j+1}, V_{j+1} stream in while the warps merge
      cp_async_commit();
      splitk_merge<T, !DEFER_NORM>(sk, st);
    }
    cp_async_wait<0>();
    // every warp is done with the tiles and slots (with SEQ_PARALLEL off the next query tile reuses them)
    __syncthreads();
  }

  // ---- [splitk:store] O_i = diag(l)^-1 O_i (or as kept), L_i = m_i + log(l_i), with the sink in the denominator ----
  __device__ __forceinline__ static void store(const FwdParams& p, const typename Pol::Info& bi, const Pol& pol, int q0,
                                               char*, const State& st) {
    constexpr int MT = BR / 16;
    float f[2 * MT], lse[2 * MT];
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) finalize_row<T, !DEFER_NORM>(st.m[r], st.l[r], pol.sink_log2(p, bi), f[r], lse[r]);
    store_rows<T>(bi.template q_like<T>(p.o, p.o_sb, p.o_ss, p.o_sh), p.o_ss, st.o, f, q0, State::col0(), bi.seqlen_q,
                  p.head_dim);
    if (warp_id() == 0) store_row_values<MT>(p.lse + bi.row0, lse, q0, bi.seqlen_q);
  }
};

}  // namespace rf
