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
};

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
