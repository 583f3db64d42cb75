// The backward skeleton: key-tile scheduler x mainloop x epilogue (FA2 Alg.2). One CTA per key block K_j, V_j of
// one kv head: the mainloop keeps K_j, V_j in shared memory and dK_j, dV_j on chip while it walks every query head
// of the GQA group and every query block Q_i the policy says sees K_j (so the group's sum needs no atomics); the
// epilogue writes dK_j, dV_j. Mainloops: mainloop_bwd_sm80.cuh (mma.sync), mainloop_bwd_sm90.cuh (wgmma, keys
// split over warpgroups) and its column-split form for large head_dim.
#pragma once
#include "block_info.cuh"
#include "params.cuh"
#include "policy.cuh"
#include "scheduler.cuh"
#include "sm80.cuh"

namespace rf {

// The walk of one key tile over (query head, query block): iteration it is query block block(s) of query head
// hk * group + it / n, s = it % n, with the interior blocks of each head first and its edge blocks after them.
struct QIter {
  BlockRange qb;
  int h0, n, total;  // first query head of the group, blocks per head, iterations in all
  __device__ __forceinline__ QIter(const BlockRange& r, int hk, int group)
      : qb(r), h0(hk * group), n(r.n()), total(group * r.n()) {}
  __device__ __forceinline__ int head(int it) const { return h0 + it / n; }
  __device__ __forceinline__ int block(int it) const { return qb.block(it % n); }
  __device__ __forceinline__ bool edge(int it) const { return qb.is_edge(it % n); }
  // Iteration it's first query row; bh (and the general policy's per-head state) moved to its query head.
  template <int BR, class Pol>
  __device__ __forceinline__ int enter(const BwdParams& p, int it, typename Pol::Info& bh, Pol& pol) const {
    bh.set_head(p, head(it));
    if constexpr (Pol::GENERAL) pol.set_head(p, bh);
    return block(it) * BR;
  }
};

// The same walk with each head's query blocks in ascending order, the edges where they fall: the deterministic
// backward's order (the key blocks then reach a query block in the order of their ranks, Policy::dq_rank).
// first: the walk of every head starts at block qb.lo + first and wraps around (0 <= first < n; the rotated
// order of Policy::dq_start).
struct QIterAscending : QIter {
  int first;
  __device__ __forceinline__ QIterAscending(const BlockRange& r, int hk, int group, int first_ = 0)
      : QIter(r, hk, group), first(first_) {}
  __device__ __forceinline__ int block(int it) const {
    const int b = it % n + first;
    return qb.lo + (b >= n ? b - n : b);
  }
  __device__ __forceinline__ bool edge(int it) const {
    const int i = block(it);
    return i < qb.lo_full || i >= qb.hi_full;
  }
  template <int BR, class Pol>
  __device__ __forceinline__ int enter(const BwdParams& p, int it, typename Pol::Info& bh, Pol& pol) const {
    bh.set_head(p, head(it));
    if constexpr (Pol::GENERAL) pol.set_head(p, bh);
    return block(it) * BR;
  }
};

template <bool ASCENDING> struct QWalk {
  using type = QIter;
};
template <> struct QWalk<true> {
  using type = QIterAscending;
};

// The verbs every backward mainloop shares (mma.sync and wgmma alike: load_tile and store_rows take either tile).
// Alg.2 l.6-7: K_j, V_j of the key block at k0 into shared memory, one cp.async group.
template <int NTHREADS, int BC, typename T, class Info, class KTile>
__device__ __forceinline__ void load_key_block(const BwdParams& p, const Info& bi, int k0, const KTile& sK,
                                               const KTile& sV) {
  const int nk = min(BC, bi.seqlen_k - k0);
  load_tile<NTHREADS>(sK, bi.template k<T>(p) + k0 * p.k_ss, p.k_ss, nk, p.head_dim);
  load_tile<NTHREADS>(sV, bi.template v<T>(p) + k0 * p.v_ss, p.v_ss, nk, p.head_dim);
  cp_async_commit();
}

// Alg.2 l.17: dK_j (times scale) of the rows kr.. and columns c0.. a thread holds (q's head_dim columns).
template <typename T, class Info, int MT, int NT>
__device__ __forceinline__ void store_dk(const BwdParams& p, const Info& bi, const Acc<MT, NT>& dk, int kr, int c0) {
  float f[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) f[r] = p.scale;
  store_rows<T>(bi.template k_like<T>(p.dk, p.dk_sb, p.dk_ss, p.dk_sh), p.dk_ss, dk, f, kr, c0, bi.seqlen_k,
                p.head_dim);
}
// ... and dV_j: v's head_dim columns (BwdParams::head_dim_v: MLA's narrower v in FA3's DV form, else q's).
template <typename T, class Info, int MT, int NT>
__device__ __forceinline__ void store_dv(const BwdParams& p, const Info& bi, const Acc<MT, NT>& dv, int kr, int c0) {
  float f[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) f[r] = 1.f;
  store_rows<T>(bi.template k_like<T>(p.dv, p.dv_sb, p.dv_ss, p.dv_sh), p.dv_ss, dv, f, kr, c0, bi.seqlen_k,
                p.head_dim_v);
}
// Both, where dK_j and dV_j of a thread share their rows and columns.
template <typename T, class Info, int MT, int NT>
__device__ __forceinline__ void store_dkdv(const BwdParams& p, const Info& bi, const Acc<MT, NT>& dk,
                                           const Acc<MT, NT>& dv, int kr, int c0) {
  store_dk<T>(p, bi, dk, kr, c0);
  store_dv<T>(p, bi, dv, kr, c0);
}

template <class Mainloop> __device__ __forceinline__ void bwd_kernel(const BwdParams& p) {
  using Pol = typename Mainloop::Pol;
  extern __shared__ __align__(16) char smem[];
  KTileScheduler<Mainloop::BC, Pol::GENERAL> tile;
  // ---- [bwd:schedule] this CTA's key block K_j of kv head hk, batch b ----
  if (!tile.start(p)) return;
  const int group = p.heads / p.kv_heads;
  typename Pol::Info bi(p, tile.b, tile.hk * group);
  const int k0 = tile.j * Mainloop::BC;
  if (k0 >= bi.seqlen_k) return;
  // ---- [bwd:setup] the policy, and the query blocks that see K_j (query blocks that do not are skipped) ----
  Pol pol(p, bi);
  const QIter walk(pol.q_blocks(k0, Mainloop::BC, Mainloop::BR, cdiv(bi.seqlen_q, Mainloop::BR)), tile.hk, group);
  typename Mainloop::State st;
  // ---- [bwd:mainloop] Alg.2 l.6-16: dK_j, dV_j over every (h, i), dQ_i += dS K_j on the way ----
  Mainloop::run(p, bi, pol, k0, walk, smem, st);
  // ---- [bwd:epilogue] Alg.2 l.17: write dK_j (times scale) and dV_j (zero when no query sees K_j) ----
  Mainloop::store(p, bi, k0, st);
}

}  // namespace rf
