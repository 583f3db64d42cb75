// fa3_bwd_sm90: the backward skeleton of bwd.cuh split by warpgroup role (FA3's warp specialisation): a producer
// warpgroup copies (TMA), two consumer warpgroups compute (wgmma, 16-bit, sm_90a). BC = 128 (head_dim <= 128):
// mainloop_bwd_sm90_ws.cuh, 64 keys per consumer warpgroup, dQ by TMA reduce-add (DETERMINISTIC: in a fixed order
// per query block, by two warps of the producer warpgroup). BC = 64 (head_dim 192, 256):
// mainloop_bwd_sm90_ws_split_d.cuh, both consumer warpgroups on the same 64 keys, split by queries for the scores
// and by columns for dK, dV and dQ (atomic dQ only), in clusters of two neighbouring key blocks that sum dQ_i
// between them (PAIR). DV: the columns of V, dO and dV (D, or MLA's narrower head_dim_v: the DV form, whose dP^T
// and dV products run over DV columns). fa2_bwd_preprocess runs before it and fa2_bwd_convert_dq after.
#include "mainloop_bwd_sm90_ws.cuh"
#include "mainloop_bwd_sm90_ws_split_d.cuh"

namespace rf {

// Both roles take the same key tile and walk the same (query head, query block) steps, so their ring counters
// stay in step; the policy, BlockInfo and the epilogue are bwd.cuh's. Mainloop::PAIR: the two CTAs of a cluster
// (key blocks 2m, 2m + 1 of one kv head) walk the same steps, the query blocks that see either block, and meet at
// cluster barriers after the barriers' initialisation and before they exit.
template <class Mainloop> __device__ __forceinline__ void bwd_kernel_ws(const BwdParams& p, const TmaBwd& tma) {
  using Pol = typename Mainloop::Pol;
  extern __shared__ __align__(16) char smem[];
  const typename Mainloop::Smem sm(smem);
  // ---- [fa3_bwd_sm90:setup] the barriers; this CTA's key block K_j (kv head hk, batch b); the query blocks seeing it
  if (threadIdx.x == 0) sm.init();
  // the last CTA-wide barrier (PAIR: cluster-wide, so no CTA arrives on or copies into the other's barriers before
  // they are initialised)
  if constexpr (Mainloop::PAIR) cluster_sync();
  else __syncthreads();
  KTileScheduler<Mainloop::BC, Pol::GENERAL, Mainloop::PAIR> tile;
  // DET: see write_dq. PAIR: both CTAs of a cluster return here or neither (packed: the same pair of tiles)
  if (!tile.start(p, Mainloop::DET && Pol::bounded_right(p), !Mainloop::DET && p.longest_first)) return;
  const int group = p.heads / p.kv_heads;
  typename Pol::Info bi(p, tile.b, tile.hk * group);
  const int k0 = tile.j * Mainloop::BC;
  // PAIR: a CTA past the keys (the partner of an odd count's last block) walks with its neighbour, all keys masked
  if (!Mainloop::PAIR && k0 >= bi.seqlen_k) return;
  Pol pol(p, bi);
  constexpr int SPAN = Mainloop::PAIR ? 2 * Mainloop::BC : Mainloop::BC;  // the keys whose query blocks are walked
  const BlockRange qb = pol.q_blocks(k0 / SPAN * SPAN, SPAN, Mainloop::BR, cdiv(bi.seqlen_q, Mainloop::BR));
  const auto walk = [&] {  // DET with p.dq_rotate: each key block starts at its own query block (Policy::dq_start)
    using W = typename Mainloop::Walk;
    if constexpr (Mainloop::DET) {
      const int nk = cdiv(bi.seqlen_k, Mainloop::BC);
      return W(qb, tile.hk, group, pol.dq_rotates(p) && qb.n() > 0 ? Pol::dq_start(tile.j, qb.n(), nk) : 0);
    } else {
      return W(qb, tile.hk, group);
    }
  }();
  if (Mainloop::is_producer()) {
    // ---- [fa3_bwd_sm90:producer] K_j, V_j, then Q_i, dO_i, L_i, D_i of every step ----
    if (Mainloop::producer_start(tma)) {
      Mainloop::produce(p, tma, bi, k0, walk, sm);
      if constexpr (Mainloop::PAIR) cluster_sync();  // (the other warps of the producer warpgroup have exited)
    }
    // ---- [fa3_bwd_sm90:dq_writer] DETERMINISTIC: dQ_i of every step into the float32 rows, in rank order ----
    else if (Mainloop::is_dq_writer()) Mainloop::write_dq(p, tma, bi, pol, k0, walk, sm);
    return;
  }
  // ---- [fa3_bwd_sm90:consumers] Alg.2 l.6-17: dK_j, dV_j over every (h, i), dQ_i on the way, then dK_j, dV_j out ----
  Mainloop::consumer_start();
  typename Mainloop::State st;
  Mainloop::consume(p, tma, bi, pol, k0, walk, sm, st);
  Mainloop::store(p, bi, k0, st);
  if constexpr (Mainloop::PAIR) cluster_sync();  // no copy or arrive from the partner may reach an exited CTA
}

}  // namespace rf

namespace rf {
// The mainloop of a tile row: 64 keys (BC) for two consumer warpgroups is the column split (launch.py's
// fa3_bwd_split_d); it has no DETERMINISTIC form.
template <typename T, int D, int BR, int BC, int STAGES, class Pol, bool DET, int DV> struct Fa3BwdMainloop {
  static_assert(BC == 128 || !DET, "the column split has no ordered dQ (deterministic=True: fa2_bwd + fa2_bwd_dq)");
  using type = typename Select<BC == 64, MainloopBwdSm90WsSplitD<T, D, BR, BC, STAGES, Pol, DV>,
                               MainloopBwdSm90Ws<T, D, BR, BC, STAGES, Pol, DET, DV>>::type;
};
}  // namespace rf

// (three warpgroups either way: a producer and two consumers)
template <typename T, int D, int BR, int BC, int STAGES, int MASK, bool GENERAL, bool DETERMINISTIC, int DV,
          int SMEM_BYTES>
__global__ void __launch_bounds__(3 * 128, 1) __cluster_dims__(
    rf::Fa3BwdMainloop<T, D, BR, BC, STAGES, rf::Policy<MASK, GENERAL>, DETERMINISTIC, DV>::type::PAIR ? 2 : 1, 1, 1)
    fa3_bwd_sm90(const __grid_constant__ rf::BwdParams p, const __grid_constant__ rf::TmaBwd tma) {
  using namespace rf;
  using Mainloop = typename Fa3BwdMainloop<T, D, BR, BC, STAGES, Policy<MASK, GENERAL>, DETERMINISTIC, DV>::type;
  static_assert(Mainloop::NTHREADS == 3 * 128, "the launch bounds");
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  bwd_kernel_ws<Mainloop>(p, tma);
}
