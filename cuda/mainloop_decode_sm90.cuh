// mainloop_decode_sm90: the latent cache's split (MLA's absorbed decode) on Hopper's warpgroup products (wgmma).
//
// The same split as MainloopDecodeLatent (mainloop_decode.cuh): 64 packed rows of one kv head, one cache of D
// columns (512 latent + 64 rotary) whose first DV columns are the values, every key read once into a ring of
// BCW-key tiles that the CTA's warps share. What changes is who multiplies what. The CTA's 8 warps are two
// warpgroups, and a wgmma reads both operands from shared memory, so no warp reloads the Q tile for its own few
// keys (the mma.sync form's 8 warps each read all 64 x 576 of Q for 8 keys: shared memory, not the tensor cores,
// bounds it):
// - S: warpgroup w forms S for all 64 rows over keys [w BCW / 2, (w + 1) BCW / 2) of the tile and all D columns
//   (m64n32k16, both operands in shared memory), so no score is computed twice;
// - the tile's row maxima go through shared memory (a float per warpgroup and row), so both warpgroups keep the
//   same running max; each writes its P (16-bit) into one 64 x BCW tile;
// - O: warpgroup w accumulates columns [w DV / 2, (w + 1) DV / 2) of O (64 x 256 float32: 128 registers a thread)
//   over all of the tile's keys, P from shared memory, V_j read MN-major from the K tile (the same bytes: no copy).
// The tiles are 128-byte swizzled (hopper.cuh's Sw128: the wgmma operand layout), copied by cp.async as the other
// forms copy theirs. Three CTA barriers a tile, as in the mma.sync form: the tile has landed (and the previous
// tile, its P and maxima are free), the maxima are written, P is written. 16-bit caches only; sm_90a.
// No Numba twin: the twins run the mma.sync form (MainloopDecodeLatent), whose results this form matches.
#pragma once
#include "hopper.cuh"
#include "mainloop_decode.cuh"

namespace rf {

// Keys k0 .. k0 + nk - 1 of this sequence into a BCW x D swizzled tile, zero past the last key: load_kv_tile's
// copy (the CTA's threads, one 16-byte chunk each step; a tile inside one page located once) into Sw128's layout.
template <int THREADS, typename T, int ROWS, int D, class Info>
__device__ __forceinline__ void load_latent_tile(const Sw128<T, ROWS, D>& sk, const FwdParams& p, const Info& bi,
                                                 int k0, int nk) {
  constexpr int CH = D / 8;  // 16-byte chunks a row
  const typename Info::PagePos pos = bi.page_pos(p, k0);
  long long ko, vo;
  bi.key_offsets(p, pos, 0, ko, vo);
  const T* kb = (const T*)p.k + ko;
  const bool one_page = !p.block_table || pos.row + ROWS <= p.page_size;  // (uniform)
#pragma unroll 4
  for (int idx = threadIdx.x; idx < ROWS * CH; idx += THREADS) {
    const int row = idx / CH, col = (idx % CH) * 8;
    const bool valid = row < nk && col < p.head_dim;
    const T* src = kb;
    if (valid) {
      if (one_page) {
        src = kb + row * p.k_ss + col;
      } else {
        long long kr, vr;
        bi.key_offsets(p, pos, row, kr, vr);
        src = (const T*)p.k + kr + col;
      }
    }
    cp_async16(sk.addr(row, col), src, valid);
  }
}

template <typename T_, typename C_, int D, int DV, int MT, int BCW, int STAGES, int WARPS_>
struct MainloopDecodeLatentWg {
  using T = T_;
  using C = C_;
  using Pol = Policy<WINDOW, true>;
  using Info = BlockInfo<true>;
  static constexpr bool FP8 = false, VALUES = false;  // (values: K's first DV columns, never copied apart)
  static constexpr int WARPS = WARPS_, WC = WARPS_, SPLITS = 1, ROWS = 16 * MT, GROUPS = WARPS_ / 4;
  static constexpr int NS = BCW / GROUPS / 8, NO = DV / GROUPS / 8;  // S: a warpgroup's keys; O: its columns (/ 8)
  static constexpr int ALIGN = 1024, Q_BYTES = ROWS * D * 2, QMAX_BYTES = 0, KV_BYTES = BCW * D * 2;
  static constexpr int P_BYTES = ROWS * BCW * 2, MAX_BYTES = GROUPS * ROWS * 4;
  // the Q tile, STAGES K tiles, P, the row maxima (then the row sums), from the first 1024-byte boundary (the
  // swizzle's period: ALIGN bytes of slack)
  static constexpr int SMEM_BYTES = ALIGN + Q_BYTES + STAGES * KV_BYTES + P_BYTES + MAX_BYTES;
  static constexpr float STALE_LOG2 = 8.f;  // MainloopDecode's lazy rescale
  static_assert(Same<T_, C_>::value && sizeof(T_) == 2, "a 16-bit latent cache of the queries' type");
  static_assert(ROWS == 64 && WARPS_ == 8, "64 packed rows: one wgmma M, two warpgroups");
  static_assert(D % 64 == 0 && BCW == 64 && DV % (64 * GROUPS) == 0 && STAGES >= 2,
                "whole 64-column panels; P one 64 x 64 tile; O's columns in whole panels per warpgroup");
  static_assert(Q_BYTES % 1024 == 0 && KV_BYTES % 1024 == 0, "the swizzled tiles stay 1024-byte aligned");
  using QTile = Sw128<T, ROWS, D>;
  using KTile = Sw128<C, BCW, D>;
  using OAcc = Acc<1, NO>;           // a warp's 16 rows x the warpgroup's DV / GROUPS columns of O
  static constexpr int SM_ROWS = 2;  // softmax rows a thread holds (the C layout's two)

  // decode_split's view of the thread's share of O and of the rows
  __device__ __forceinline__ static char* tiles_at(char* smem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    return smem + (((s + ALIGN - 1) & ~(u32)(ALIGN - 1)) - s);
  }
  __device__ __forceinline__ static QTile q_tile(char* at) { return QTile{(u32)__cvta_generic_to_shared(at)}; }
  __device__ __forceinline__ static int row0() { return 16 * warp_in_group(); }
  __device__ __forceinline__ static int col0() { return warpgroup_id() * (DV / GROUPS); }
  __device__ __forceinline__ static bool holds_lse() { return warpgroup_id() == 0; }  // (both hold the same)

  // The CTA's split: keys [k_begin, k_end), rows [r0, r0 + nrows): the warp's 16 rows and its warpgroup's DV /
  // GROUPS columns of O (o), and its rows' softmax state (m the same in both warpgroups; l, after the last tile,
  // the sum over them). ring: smem + Q_BYTES. k_mul is unused (no FP8 form). Returns the key tiles read.
  __device__ __forceinline__ static int run(const FwdParams& p, const Info& bi, const Pol& pol, int group, int r0,
                                            int nrows, int k_begin, int k_end, const QTile& sQ, char* ring,
                                            const float (&k_mul)[SM_ROWS], OAcc& o, OnlineSoftmax<SM_ROWS>& sm) {
    const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
    auto sK = [&](int t) { return KTile{ring_s + (t % STAGES) * KV_BYTES}; };
    const Sw128<T, ROWS, BCW> sP{ring_s + STAGES * KV_BYTES};
    float* xrow = (float*)(ring + STAGES * KV_BYTES + P_BYTES);  // [GROUPS][ROWS]: the row maxima, then l
    const int wg = uniform_warpgroup_id(), w0 = 16 * warp_in_group(), g = lane_id() >> 2;
    const int kw = wg * (BCW / GROUPS), cw = wg * (DV / GROUPS);  // the warpgroup's keys of S and columns of O
    // ---- [mainloop_decode_sm90:init] O = 0, l = 0, m = -inf; the first STAGES - 1 key tiles start streaming
    const DecodeSplitRows<1, BCW> rows(p, bi, pol, group, r0, nrows, k_begin, k_end, w0);
    const int lo = rows.first, hi = rows.end, n = rows.tiles;
    auto load = [&](int t) {
      const int k0 = lo + t * BCW;
      load_latent_tile<32 * WARPS>(sK(t), p, bi, k0, min(BCW, hi - k0));
    };
    start_split<STAGES>(o, sm, n, load);
    for (int t = 0; t < n; ++t) {  // (n is the CTA's: every warp takes every barrier)
      const int k0 = lo + t * BCW;
      // ---- [mainloop_decode_sm90:wait] tile t has landed; tile t + STAGES - 1 starts streaming ----
      cp_async_wait<STAGES - 2>();
      fence_async_smem();  // this thread's copies (tile t; before the first tile, the Q tile) reach the products
      __syncthreads();     // ... every thread's; both warpgroups are done with tile t - 1, its P and the maxima
      if (t + STAGES - 1 < n) load(t + STAGES - 1);
      cp_async_commit();
      // ---- [mainloop_decode_sm90:scores] S = Q K_j^T for the 64 rows over the warpgroup's keys ----
      Acc<1, NS> s;
      wgmma_fence();
      wg_gemm_abt(s, sQ, 0, sK(t), kw, false);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(s);
      rows.template scores<T, false>(s, pol, k0 + kw, rows.edge(k0), k_mul);
      // ---- [mainloop_decode_sm90:softmax] the tile's row maxima over the warpgroups; P to shared memory --
      float mx[SM_ROWS], fo[SM_ROWS];
      row_max(mx, s);
#pragma unroll
      for (int rr = 0; rr < SM_ROWS; ++rr)
        if ((lane_id() & 3) == 0) xrow[wg * ROWS + w0 + g + 8 * rr] = mx[rr];
      __syncthreads();  // both warpgroups' maxima
#pragma unroll
      for (int rr = 0; rr < SM_ROWS; ++rr) {
        mx[rr] = -INFINITY;
#pragma unroll
        for (int v = 0; v < GROUPS; ++v) mx[rr] = fmaxf(mx[rr], xrow[v * ROWS + w0 + g + 8 * rr]);
      }
      latent_update_max<T>(sm, s, mx, fo, STALE_LOG2);
      store_acc(sP, s, w0, kw);
      fence_async_smem();  // this thread's P reaches the products
      __syncthreads();     // ... every thread's
      sm.template rescale<true, true>(o, fo);  // (the same fo in both warpgroups; padding rows see no key at all)
      // ---- [mainloop_decode_sm90:pv] O[:, cw .. cw + DV / GROUPS) += P V_j (V_j: columns of the K tile) --
      fence_operand(o);
      wgmma_fence();
      wg_gemm_ab<BCW>(o, sP, 0, sK(t), cw, true);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operand(o);
    }
    cp_async_wait<0>();
    // ---- [mainloop_decode_sm90:sums] l = the sum of the warpgroups' shares (the same order in both) ----
    __syncthreads();  // both warpgroups are done with the maxima
#pragma unroll
    for (int rr = 0; rr < SM_ROWS; ++rr)
      if ((lane_id() & 3) == 0) xrow[wg * ROWS + w0 + g + 8 * rr] = sm.l[rr];
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < SM_ROWS; ++rr) {
      float l = 0.f;
#pragma unroll
      for (int v = 0; v < GROUPS; ++v) l += xrow[v * ROWS + w0 + g + 8 * rr];
      sm.l[rr] = l;
    }
    return n;
  }
};

}  // namespace rf
