// mainloop_decode: attention of a few query rows against a long KV cache, split over the keys (Flash-Decoding).
//
// Decoding is bound by reading the cache, so every cache byte must be read once and the reads must keep HBM busy.
// GQA packing: the group's query heads and the call's few query rows (speculative decoding, chunked prefill) are
// one tile of packed rows, r = i * group + hh (query i, head hk * group + hh), so K_j and V_j are read once for all
// of them. Split-KV: each warp owns one split, a contiguous chunk of keys, which it streams through its own
// STAGES-deep cp.async ring of BCW-key tiles with no barrier but __syncwarp; the CTA's warps share the Q tile.
// A warp's result is a partial O (divided by its own l) and a partial lse in float32; decode_combine merges them
// (and adds the sink) once every split is done. The policy is the general one at run time: bottom-right causal
// masks and windows per packed row, soft-capping, ALiBi per head; BlockInfo locates the keys and reads the page
// table (one division per tile).
// FP8 caches (C = e4m3, T the queries' 16-bit type): the ring holds e4m3 tiles, half the bytes of a 16-bit tile of
// as many keys, and the products read them straight from the ring into float16 fragments (every e4m3 value is a
// float16 exactly; sm80.cuh's e4m3 loaders), one cvt per pair of values on the way to the tensor cores. The
// products run in float16 with float32 accumulators, so the Q tile is float16 too: decode_split's q_half scales
// each packed row by a power of two that puts its largest |q| in [2^14, 2^15) (exact for every 16-bit value down
// to 2^-28 of the row's largest), converts it and permutes each 16 columns as load_b4_nk_e4m3 asks; P is packed
// as float16. S is multiplied back by the row's 2^-a and by k_descale before the score transform; O's columns
// come out permuted (o_col_e4m3), and decode_split multiplies the split's O by v_descale.
#pragma once
#include "block_info.cuh"
#include "policy.cuh"
#include "sm80.cuh"
#include "softmax.cuh"

namespace rf {

// Keys k0 .. k0 + nk - 1 of this sequence into two BCW x D tiles (K_j and V_j), zero past the last key: cp.async
// by THREADS threads (a warp's 32 lanes, or a CTA's threads), one 16-byte chunk of K and one of V per thread and
// step; VALUES false copies K alone (the latent cache, whose values are K's first columns: sv is not written).
// BlockInfo locates the keys: one
// page division per tile (page_pos). When the tile lies in one page (always in a contiguous cache, and for every
// tile when the page size is a multiple of the tile's keys) its rows are one stride apart from the first, located
// once (key_offsets of row 0): a chunk's address is then one multiply-add, where locating each row on its own (a
// page-table read, the carry, six 64-bit products) makes the copies 60 % of the tile loop's instructions
// (offline SASS, d = 128). Otherwise each row's offsets come with a carry (key_offsets). The split's pages are
// checked before its first tile (BlockInfo::pages_inside).
template <int THREADS = 32, bool VALUES = true, typename T, int ROWS, int D, class Info>
__device__ __forceinline__ void load_kv_tile(const Tile<T, ROWS, D>& sk, const Tile<T, ROWS, D>& sv,
                                             const FwdParams& p, const Info& bi, int k0, int nk) {
  using TL = Tile<T, ROWS, D>;
  const int first = THREADS == 32 ? lane_id() : (int)threadIdx.x;
  const typename Info::PagePos pos = bi.page_pos(p, k0);
  if (!p.block_table || pos.row + ROWS <= p.page_size) {  // (the same for the whole warp)
    long long ko, vo;
    bi.key_offsets(p, pos, 0, ko, vo);
    const T *kb = (const T*)p.k + ko, *vb = (const T*)p.v + vo;
#pragma unroll
    for (int idx = first; idx < ROWS * TL::C; idx += THREADS) {
      const int row = idx / TL::C, col = (idx % TL::C) * TL::CHUNK;
      const bool valid = row < nk && col < p.head_dim;
      cp_async16(sk.saddr(row, col), valid ? kb + row * p.k_ss + col : kb, valid);
      if constexpr (VALUES) cp_async16(sv.saddr(row, col), valid ? vb + row * p.v_ss + col : vb, valid);
    }
    return;
  }
#pragma unroll
  for (int idx = first; idx < ROWS * TL::C; idx += THREADS) {
    const int row = idx / TL::C, col = (idx % TL::C) * TL::CHUNK;
    const bool valid = row < nk && col < p.head_dim;
    long long ko = 0, vo = 0;
    if (valid) {
      bi.key_offsets(p, pos, row, ko, vo);
      ko += col, vo += col;
    }
    cp_async16(sk.saddr(row, col), (const T*)p.k + ko, valid);
    if constexpr (VALUES) cp_async16(sv.saddr(row, col), (const T*)p.v + vo, valid);
  }
}

// (FP8) The power of two a that decode_split's load_q scales a packed row of Q by: its largest |q| (float bits m)
// into [2^14, 2^15), so the row's float16 copy neither overflows nor turns a value above 2^-28 of the largest
// subnormal; 0 for a row of zeros or one holding Inf or NaN; within [-126, 126], so 2^a and 2^-a are normal.
__device__ __forceinline__ int q_half_exp(unsigned m) {
  const int e = (int)(m >> 23);  // m's biased exponent: m in [2^(e - 127), 2^(e - 126))
  if (m == 0u || e == 255) return 0;
  return max(-126, min(126, 141 - e));
}
__device__ __forceinline__ float pow2f(int a) { return __int_as_float((a + 127) << 23); }  // a in [-126, 127]

// What the latent mainloops know of a split before its first tile: the key tiles it visits and the thread's 2 MT
// packed rows (from the warp's first row row_base: query index, ALiBi slope, visible keys [lo, hi); padding rows
// past nrows see nothing), computed once, so the tile loop has no division; and the step of a tile's scores
// through the policy.
template <int MT, int BCW> struct DecodeSplitRows {
  using Pol = Policy<WINDOW, true>;
  int qi[2 * MT], lo[2 * MT], hi[2 * MT];
  float slope[2 * MT];
  int first, end, tiles, interior_start, interior_end;  // tiles from key `first`; keys [first, end) seen by some row
  __device__ __forceinline__ DecodeSplitRows(const FwdParams& p, const BlockInfo<true>& bi, const Pol& pol,
                                             int group, int r0, int nrows, int k_begin, int k_end,
                                             int row_base = 0) {
    // Packed rows r0 + r: query (r0 + r) / group of head hk * group + (r0 + r) % group.
    const int i_first = r0 / group, i_last = (r0 + nrows - 1) / group;
    // Tiles start on multiples of BCW (split boundaries are), so a tile never reaches into the next split: keys
    // before row_start or past row_end / seqlen_k inside a tile are masked, and a split ends on a tile edge.
    first = max(k_begin, pol.row_start(i_first)) / BCW * BCW, end = min(k_end, pol.row_end(i_last));
    tiles = end > first ? cdiv(end - first, BCW) : 0;
    interior_end = min(end, pol.row_end(i_first)), interior_start = max(first, pol.row_start(i_last));
    const int g = lane_id() >> 2;
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr) {
      const int row = row_base + 16 * (rr / 2) + g + 8 * (rr % 2), r = r0 + row;
      qi[rr] = r / group;
      slope[rr] = pol.head_slope(p, bi, r % group);
      lo[rr] = row < nrows ? pol.row_start(qi[rr]) : 0x7fffffff;
      hi[rr] = row < nrows ? pol.row_end(qi[rr]) : 0;
    }
  }
  // Whether the tile of keys [k0, k0 + BCW) needs the mask (some row does not see all of it).
  __device__ __forceinline__ bool edge(int k0) const { return k0 < interior_start || k0 + BCW > interior_end; }
  // S's scores (column c is key j0 + c) through the transform (FP8: first multiplied by the row's k_mul), and
  // -inf where the row does not see the key (edge tiles only).
  template <typename T, bool FP8, int NT>
  __device__ __forceinline__ void scores(Acc<MT, NT>& s, const Pol& pol, int j0, bool edge,
                                         const float (&k_mul)[2 * MT]) const {
    const int tq = lane_id() & 3;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int nj = 0; nj < NT; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rr = 2 * mi + (e >> 1), j = j0 + 8 * nj + 2 * tq + (e & 1);
          float& x = s.v[mi][nj][e];
          x = pol.template score<T>(FP8 ? x * k_mul[rr] : x, qi[rr], j, nullptr, slope[rr]);
          if (edge && (j < lo[rr] || j >= hi[rr])) x = -INFINITY;
        }
  }
};

// One key block whose row maxima mx (log2 units, the scores' own) were taken over more scores than this warp's
// (the latent form splits a tile's keys between warps that share the rows): OnlineSoftmax::update's running-max step
// with the lazy rescale (stale_log2 > 0) from that max, so every warp sharing the rows keeps the same m and fo. P =
// exp2(S - m) in place; l gathers this warp's share of the row sums (mx is overwritten).
template <typename T, int MT, int NT, int ROWS>
__device__ __forceinline__ void latent_update_max(OnlineSoftmax<ROWS>& sm, Acc<MT, NT>& s, float (&mx)[ROWS],
                                                  float (&fo)[ROWS], float stale_log2) {
  float rs[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float cand = fmaxf(sm.m[r], mx[r]);
    const bool keep = cand - sm.m[r] <= stale_log2;  // (false while the row has seen nothing: NaN)
    mx[r] = keep ? sm.m[r] : cand == -INFINITY ? 0.f : cand;
    fo[r] = keep ? 1.f : exp2_<T>(sm.m[r] - mx[r]);
    sm.m[r] = keep ? sm.m[r] : cand;
  }
  for_each_row(s, [&](float& x, int r) { x = exp2_<T>(x - mx[r]); });
  row_sum(rs, s);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) sm.l[r] = fo[r] * sm.l[r] + rs[r];
}

// The start of a split: O = 0, the softmax state's m = -inf and l = 0, and the ring's first STAGES - 1 tiles
// (of n) streaming, one cp.async group each (empty past n).
template <int STAGES, int MT, int NO, class Load>
__device__ __forceinline__ void start_split(Acc<MT, NO>& o, OnlineSoftmax<2 * MT>& sm, int n, Load load) {
  zero(o);
  sm.init();
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < n) load(t);
    cp_async_commit();
  }
}

template <typename T_, typename C_, int D, int MT, int BCW, int STAGES, int WARPS_> struct MainloopDecode {
  using T = T_;
  using C = C_;  // the cache's element: T, or e4m3 (an FP8 cache)
  using Pol = Policy<WINDOW, true>;
  using Info = BlockInfo<true>;
  static constexpr bool FP8 = Same<C_, e4m3>::value;
  static constexpr int WARPS = WARPS_, ROWS = 16 * MT, NT = BCW / 8, NO = D / 8;
  static constexpr int Q_BYTES = ROWS * D * (int)sizeof(T_), KV_BYTES = BCW * D * (int)sizeof(C_);
  // (FP8) each packed row's largest |q| as float bits, whole 128-byte lines so the rings stay 128-byte aligned
  static constexpr int QMAX_BYTES = FP8 ? 128 * cdiv(ROWS * 4, 128) : 0;
  // the Q tile, the row maxima; per warp, STAGES x (K_j, V_j)
  static constexpr int SMEM_BYTES = Q_BYTES + QMAX_BYTES + WARPS * STAGES * 2 * KV_BYTES;
  static_assert(BCW % 16 == 0 && STAGES >= 2, "whole 16-key steps; at least double buffering");
  static_assert(!FP8 || (sizeof(T_) == 2 && D % 32 == 0), "an FP8 cache: 16-bit queries, head dims of 32-column steps");
  static constexpr float STALE_LOG2 = 8.f;  // OnlineSoftmax::update's lazy rescale: P <= 2^8 (any dtype holds it)
  // decode_split's view: every warp a split of its own (WC = 1 warp per split, SPLITS per CTA), reading K and V
  static constexpr int WC = 1, SPLITS = WARPS;
  static constexpr bool VALUES = true;
  using QTile = Tile<T_, ROWS, D>;
  using OAcc = Acc<MT, NO>;               // the warp's O: every packed row, every column
  static constexpr int SM_ROWS = 2 * MT;  // softmax rows a thread holds
  // decode_split's view of the thread's share of O and of the rows
  __device__ __forceinline__ static char* tiles_at(char* smem) { return smem; }
  __device__ __forceinline__ static QTile q_tile(char* at) { return QTile{(T_*)at}; }
  __device__ __forceinline__ static int row0() { return 0; }
  __device__ __forceinline__ static int col0() { return 0; }
  __device__ __forceinline__ static bool holds_lse() { return true; }

  // (FP8) S = Q K8^T: sQ's float16 rows (their columns permuted as load_b4_nk_e4m3 asks) against the e4m3 tile.
  __device__ __forceinline__ static void scores_e4m3(Acc<MT, NT>& s, const Tile<T, ROWS, D>& sQ,
                                                     const Tile<C, BCW, D>& sK) {
    const Tile<__half, ROWS, D> sQh{(__half*)sQ.p};
#pragma unroll
    for (int kk = 0; kk < D; kk += 32) {
      Frag<__half>::A a[MT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        load_a(a[i][0], sQh, 16 * i, kk);
        load_a(a[i][1], sQh, 16 * i, kk + 16);
      }
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        Frag<__half>::B b[4];
        load_b4_nk_e4m3(b, sK, 8 * j, kk);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mma(s.v[i][j], a[i][0], b[0]);
          mma(s.v[i][j + 1], a[i][0], b[1]);
          mma(s.v[i][j], a[i][1], b[2]);
          mma(s.v[i][j + 1], a[i][1], b[3]);
        }
      }
    }
  }
  // (FP8) O += P V8: P packed as float16; O's columns permuted (o_col_e4m3).
  __device__ __forceinline__ static void pv_e4m3(Acc<MT, NO>& o, const Acc<MT, NT>& s, const Tile<C, BCW, D>& sV) {
#pragma unroll
    for (int ks = 0; ks < BCW / 16; ++ks) {
      Frag<__half>::A a[MT];
#pragma unroll
      for (int i = 0; i < MT; ++i) acc_to_a<__half>(a[i], s, i, ks);
#pragma unroll
      for (int n0 = 0; n0 < D; n0 += 32) {
        Frag<__half>::B b[4];
        load_b4_kn_e4m3(b, sV, 16 * ks, n0);
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int h = 0; h < 4; ++h) mma(o.v[i][n0 / 8 + h], a[i], b[h]);
      }
    }
  }

  // The split of one warp: keys [k_begin, k_end) of its sequence, rows [r0, r0 + nrows) of the packed tile, into
  // the running O and softmax state. FP8: sQ holds the float16 rows (load_q), and k_mul[rr] (the row's 2^-a times
  // k_descale) multiplies its scores. warp_smem: the warp's STAGES * 2 * KV_BYTES. Returns the key tiles it read
  // (0: an empty split).
  __device__ __forceinline__ static int run(const FwdParams& p, const Info& bi, const Pol& pol, int group, int r0,
                                            int nrows, int k_begin, int k_end, const Tile<T, ROWS, D>& sQ,
                                            char* warp_smem, const float (&k_mul)[2 * MT], Acc<MT, NO>& o,
                                            OnlineSoftmax<2 * MT>& sm) {
    auto sK = [&](int t) { return Tile<C, BCW, D>{(C*)(warp_smem + (t % STAGES) * 2 * KV_BYTES)}; };
    auto sV = [&](int t) { return Tile<C, BCW, D>{(C*)(warp_smem + (t % STAGES) * 2 * KV_BYTES + KV_BYTES)}; };
    // Packed rows r0 + r: query (r0 + r) / group of head hk * group + (r0 + r) % group.
    const int i_first = r0 / group, i_last = (r0 + nrows - 1) / group;
    // Tiles start on multiples of BCW (split boundaries are), so a tile never reaches into the next split: keys
    // before row_start or past row_end / seqlen_k inside a tile are masked, and a split ends on a tile edge.
    const int lo = max(k_begin, pol.row_start(i_first)) / BCW * BCW, hi = min(k_end, pol.row_end(i_last));
    const int n = hi > lo ? cdiv(hi - lo, BCW) : 0;
    const int interior_end = min(hi, pol.row_end(i_first)), interior_start = max(lo, pol.row_start(i_last));
    auto load = [&](int t) {
      const int k0 = lo + t * BCW;
      load_kv_tile(sK(t), sV(t), p, bi, k0, min(BCW, hi - k0));
    };
    // ---- [mainloop_decode:init] O = 0, l = 0, m = -inf; the first STAGES - 1 key tiles start streaming ----
    // The thread's 2 MT packed rows, fixed for the split: query index, ALiBi slope, visible keys [row_lo, row_hi)
    // (padding rows past nrows see nothing). Computed once, so the tile loop has no division.
    const int g = lane_id() >> 2, tq = lane_id() & 3;
    int qi[2 * MT], row_lo[2 * MT], row_hi[2 * MT];
    float slope[2 * MT];
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr) {
      const int row = 16 * (rr / 2) + g + 8 * (rr % 2), r = r0 + row;
      qi[rr] = r / group;
      slope[rr] = pol.head_slope(p, bi, r % group);
      row_lo[rr] = row < nrows ? pol.row_start(qi[rr]) : 0x7fffffff;
      row_hi[rr] = row < nrows ? pol.row_end(qi[rr]) : 0;
    }
    zero(o);
    sm.init();
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
      if (t < n) load(t);
      cp_async_commit();
    }
    for (int t = 0; t < n; ++t) {
      const int k0 = lo + t * BCW;
      // ---- [mainloop_decode:wait] tile t has landed; tile t + STAGES - 1 starts streaming ----
      cp_async_wait<STAGES - 2>();
      __syncwarp();  // every lane's chunks of tile t are visible to the warp; tile t - 1's stage is free
      if (t + STAGES - 1 < n) load(t + STAGES - 1);
      cp_async_commit();
      // ---- [mainloop_decode:scores] S = Q K_j^T for every packed row, through the transform and the mask ----
      Acc<MT, NT> s;
      zero(s);
      if constexpr (FP8)
        scores_e4m3(s, sQ, sK(t));
      else
        gemm_abt<MT, NT, D, 1>(s, sQ, 0, sK(t), 0);
      const bool edge = k0 < interior_start || k0 + BCW > interior_end;
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int nj = 0; nj < NT; ++nj)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rr = 2 * mi + (e >> 1), j = k0 + 8 * nj + 2 * tq + (e & 1);
            float& x = s.v[mi][nj][e];
            x = pol.template score<T>(FP8 ? x * k_mul[rr] : x, qi[rr], j, nullptr, slope[rr]);
            if (edge && (j < row_lo[rr] || j >= row_hi[rr])) x = -INFINITY;
          }
      // ---- [mainloop_decode:softmax] online softmax of the block; O rescaled unless no row's max moved ----
      // (FA4's lazy rescale: the max is kept while a tile's exceeds it by at most STALE_LOG2, so P <= 2^8; O's
      // rescale is D / 2 multiplies a thread against 2 BCW / 8 scores, and after the first tiles it is rare)
      float fo[2 * MT];
      sm.template update<T>(s, 1.f, fo, 0.f, STALE_LOG2);
      sm.template rescale<true, true>(o, fo);  // (padding rows see no key at all)
      // ---- [mainloop_decode:pv] O += P V_j ----
      if constexpr (FP8)
        pv_e4m3(o, s, sV(t));
      else
        gemm_rb<MT, NO, NT / 2>(o, s, sV(t), 0, 0);
    }
    cp_async_wait<0>();
    return n;
  }
};

// The latent cache's split (MLA's absorbed decode, DeepSeek-V3 / R1): one cache of D columns (512 latent + 64
// rotary) serves as the keys, and its first DV columns as the values. O of 16 x 512 in one warp would be 256
// float32 registers a thread, so the CTA's WARPS warps share one split, one ring of K tiles (V_j is the same tile's
// first DV columns: each key is read once, 1152 bytes at D = 576) and the packed rows, and split the work twice:
// by keys for S (warp w forms S for all ROWS rows over keys [8w, 8w + 8) of the tile and all D columns, so no score
// is computed twice) and by columns for O (warp w accumulates columns [w DV / WARPS, (w + 1) DV / WARPS) of O over
// all of the tile's keys). Between them, shared memory carries the tile's row maxima (each warp's, WARPS x ROWS
// floats) and P (ROWS x BCW, 16-bit): every warp then holds the same running max, and its own share of the row
// sums l, added over the warps once after the last tile. Three CTA barriers a tile: the tile has landed (and
// the previous one, its P and maxima, are free), the maxima are written, P is written. 16-bit caches only.
template <typename T_, typename C_, int D, int DV, int MT, int BCW, int STAGES, int WARPS_>
struct MainloopDecodeLatent {
  using T = T_;
  using C = C_;
  using Pol = Policy<WINDOW, true>;
  using Info = BlockInfo<true>;
  static constexpr bool FP8 = false, VALUES = false;  // (values: K's first DV columns, never copied apart)
  static constexpr int WARPS = WARPS_, WC = WARPS_, SPLITS = 1, ROWS = 16 * MT;
  static constexpr int NT = BCW / WARPS / 8, NO = DV / WARPS / 8;  // S: Acc<MT, NT> of a warp's keys; O: its columns
  static constexpr int Q_BYTES = ROWS * D * (int)sizeof(T_), QMAX_BYTES = 0, KV_BYTES = BCW * D * (int)sizeof(C_);
  static constexpr int P_BYTES = ROWS * BCW * (int)sizeof(T_), MAX_BYTES = WARPS * ROWS * 4;
  // the Q tile, STAGES K tiles, P, the row maxima (then the row sums)
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * KV_BYTES + P_BYTES + MAX_BYTES;
  static constexpr float STALE_LOG2 = 8.f;  // MainloopDecode's lazy rescale
  static_assert(Same<T_, C_>::value && sizeof(T_) == 2, "a 16-bit latent cache of the queries' type");
  static_assert(NT == 1 && D % 32 == 0, "8 keys of S a warp (one n-tile), D in 32-column steps");
  static_assert(DV <= D && NO % 2 == 0 && BCW % 16 == 0 && STAGES >= 2, "O's columns in pairs of n-tiles");
  using QTile = Tile<T_, ROWS, D>;
  using OAcc = Acc<MT, NO>;               // the warp's columns of O for every packed row
  static constexpr int SM_ROWS = 2 * MT;  // softmax rows a thread holds
  // decode_split's view of the thread's share of O and of the rows
  __device__ __forceinline__ static char* tiles_at(char* smem) { return smem; }
  __device__ __forceinline__ static QTile q_tile(char* at) { return QTile{(T_*)at}; }
  __device__ __forceinline__ static int row0() { return 0; }
  __device__ __forceinline__ static int col0() { return warp_id() * 8 * NO; }
  __device__ __forceinline__ static bool holds_lse() { return warp_id() == 0; }  // (every warp holds the same)

  // S (ROWS x 8 keys: rows n0.. of sK) = Q K^T over D columns: each 32 columns one ldmatrix.x4 of the 8 keys
  // (two k-steps of B) against the MT m-tiles of Q.
  __device__ __forceinline__ static void scores(Acc<MT, 1>& s, const Tile<T, ROWS, D>& sQ, const Tile<C, BCW, D>& sK,
                                                int n0) {
    const int l = lane_id();
#pragma unroll 1
    for (int kk = 0; kk < D; kk += 32) {
      u32 r[4];
      ldmatrix_x4(r, sK.saddr(n0 + (l & 7), kk + 8 * (l >> 3)));
      typename Frag<T>::B b0, b1;
      b0.r[0] = r[0], b0.r[1] = r[1], b1.r[0] = r[2], b1.r[1] = r[3];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        typename Frag<T>::A a0, a1;
        load_a(a0, sQ, 16 * i, kk);
        load_a(a1, sQ, 16 * i, kk + 16);
        mma(s.v[i][0], a0, b0);
        mma(s.v[i][0], a1, b1);
      }
    }
  }

  // The CTA's split: keys [k_begin, k_end), rows [r0, r0 + nrows), every warp its DV / WARPS columns of O (o) and
  // the rows' softmax state (m the same in every warp; l, after the last tile, the sum over the warps). ring:
  // smem + Q_BYTES. k_mul is unused (no FP8 form). Returns the key tiles read (0: an empty split).
  __device__ __forceinline__ static int run(const FwdParams& p, const Info& bi, const Pol& pol, int group, int r0,
                                            int nrows, int k_begin, int k_end, const Tile<T, ROWS, D>& sQ,
                                            char* ring, const float (&k_mul)[2 * MT], Acc<MT, NO>& o,
                                            OnlineSoftmax<2 * MT>& sm) {
    auto sK = [&](int t) { return Tile<C, BCW, D>{(C*)(ring + (t % STAGES) * KV_BYTES)}; };
    const Tile<T, ROWS, BCW> sP{(T*)(ring + STAGES * KV_BYTES)};
    float* xrow = (float*)(ring + STAGES * KV_BYTES + P_BYTES);  // [WARPS][ROWS]: each warp's row maxima, then l
    const int w = warp_id(), g = lane_id() >> 2, c0 = w * 8 * NO;
    // ---- [mainloop_decode_latent:init] O = 0, l = 0, m = -inf; the first STAGES - 1 key tiles start streaming ----
    const DecodeSplitRows<MT, BCW> rows(p, bi, pol, group, r0, nrows, k_begin, k_end);
    const int lo = rows.first, hi = rows.end, n = rows.tiles;
    auto load = [&](int t) {
      const int k0 = lo + t * BCW;
      load_kv_tile<32 * WARPS, false>(sK(t), sK(t), p, bi, k0, min(BCW, hi - k0));
    };
    start_split<STAGES>(o, sm, n, load);
    for (int t = 0; t < n; ++t) {  // (n is the CTA's: every warp takes every barrier)
      const int k0 = lo + t * BCW;
      // ---- [mainloop_decode_latent:wait] tile t has landed; tile t + STAGES - 1 starts streaming ----
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile t is visible; every warp is done with tile t - 1 (its stage, P, the maxima)
      if (t + STAGES - 1 < n) load(t + STAGES - 1);
      cp_async_commit();
      // ---- [mainloop_decode_latent:scores] S = Q K_j^T for every packed row over the warp's 8 keys ----
      Acc<MT, 1> s;
      zero(s);
      scores(s, sQ, sK(t), 8 * w);
      rows.template scores<T, false>(s, pol, k0 + 8 * w, rows.edge(k0), k_mul);
      // ---- [mainloop_decode_latent:softmax] the tile's row maxima over the warps; P to shared memory ----
      float mx[2 * MT], fo[2 * MT];
      row_max(mx, s);
#pragma unroll
      for (int rr = 0; rr < 2 * MT; ++rr)
        if ((lane_id() & 3) == 0) xrow[w * ROWS + 16 * (rr / 2) + g + 8 * (rr % 2)] = mx[rr];
      __syncthreads();  // every warp's maxima
#pragma unroll
      for (int rr = 0; rr < 2 * MT; ++rr) {
        mx[rr] = -INFINITY;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) mx[rr] = fmaxf(mx[rr], xrow[v * ROWS + 16 * (rr / 2) + g + 8 * (rr % 2)]);
      }
      latent_update_max<T>(sm, s, mx, fo, STALE_LOG2);
      store_acc(sP, s, 0, 8 * w);
      __syncthreads();  // every warp's P
      sm.template rescale<true, true>(o, fo);  // (the same fo in every warp; padding rows see no key at all)
      // ---- [mainloop_decode_latent:pv] O[:, c0 .. c0 + DV / WARPS) += P V_j (V_j: columns of the K tile) ----
      mma_k_loop<MT, NO, BCW, 1, T>(
          o, [&](typename Frag<T>::A& a, int i, int kk) { load_a(a, sP, 16 * i, kk); },
          [&](typename Frag<T>::B& x, typename Frag<T>::B& y, int j, int kk) {
            load_b2_kn(x, y, sK(t), kk, c0 + 8 * j);
          });
    }
    cp_async_wait<0>();
    // ---- [mainloop_decode_latent:sums] l = the sum of the warps' shares (the same order in every warp) ----
    __syncthreads();  // every warp is done with the maxima
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr)
      if ((lane_id() & 3) == 0) xrow[w * ROWS + 16 * (rr / 2) + g + 8 * (rr % 2)] = sm.l[rr];
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr) {
      float l = 0.f;
#pragma unroll
      for (int v = 0; v < WARPS; ++v) l += xrow[v * ROWS + 16 * (rr / 2) + g + 8 * (rr % 2)];
      sm.l[rr] = l;
    }
    return n;
  }
};

}  // namespace rf
