// decode: KV-cache attention for inference (Flash-Decoding): a few query rows per sequence against its cache.
// decode_split: grid (cdiv(num_splits, WARPS), kv_heads * row_groups, batch), each warp one split of the keys
//   (mainloop_decode.cuh) for the GQA-packed query rows of one kv head; the CTA's WARPS splits are merged in
//   shared memory into one partial O and lse (float32, one per CTA: num_partials of them per row). With
//   p.decode_counters (forms.decode_fuses_combine: few rows and partials), the last CTA of each (b, kv head, row
//   group) to finish then merges the partials itself ([decode:fused_combine]: no launch of its own); otherwise
//   decode_combine_warp / decode_combine do it.
//   With one row group (p.split_appends, forms.decode_split_appends) each warp first writes the new keys that fall
//   in its own range of keys into the cache ([decode:split_append]), so no launch of its own appends them.
//   The latent cache (DV < D: MLA's absorbed decode, K of 576 columns whose first 512 are V): the CTA's warps share
//   one split (MainloopDecodeLatent), so grid x counts splits; K alone is appended, out has head_dim_v columns.
// decode_append: k_new / v_new written into the cache (contiguous or paged) at cache_seqlens[b] + t, before
//   decode_split, where several row groups read the same keys (their CTAs cannot wait for one another).
// decode_combine_warp (num_partials <= 32): one warp per (b, query, head) row, several rows per CTA: a lane per
//   partial for the lse (shuffles), 4-column chunks per lane for out. decode_combine (more partials): one CTA per
//   row (lanes over the partials, threads over the columns). Both, like the fused combine, add the sink to the
//   denominator and write out (input dtype) and lse; forms.decode_combine chooses.
//
// The launch never depends on the values of cache_seqlens (the host does not read them): the grid is planned from
// the cache's capacity, and sequence b's keys are cut on the device into num_splits runs of whole tiles
// (cdiv(tiles_b, num_splits) each); splits past its keys are empty (lse -inf, no partial O written).
// Lengths and page-table entries are checked here: a sequence whose cache_seqlens + new keys lies outside
// [0, cache_capacity], or whose used pages lie outside the cache, gets NaN out and lse, its append is skipped,
// and nothing outside the cache is read or written.
// C is the cache's element: T, or e4m3 (an FP8 cache with 16-bit queries, new keys and outputs). An FP8 cache
// holds K / k_descale and V / v_descale (per tensor, or per (sequence, kv head): FwdParams' descale strides); the
// appends are quantised so (round to nearest, saturating at +-448) and the attention reads K = k_descale K8 and
// V = v_descale V8.
#include "mainloop_decode.cuh"
#include "mainloop_decode_sm90.cuh"
#include "softmax.cuh"

namespace rf {

// A quiet NaN (NVRTC has no <cmath> NAN): the results of a sequence that does not fit its cache.
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }

// e^x of the splits' and partials' merges (natural-log lse): the hardware approximation for 16-bit outputs, expf
// for float32.
template <typename T> __device__ __forceinline__ float exp_lse(float x) {
  return sizeof(T) == 4 ? expf(x) : __expf(x);
}

// cache_seqlens[b] as given (seqused_k; cache_len when the caller gives one int for every sequence).
__device__ __forceinline__ int decode_cache_len(const FwdParams& p, int b) {
  return p.seqused_k ? p.seqused_k[b] : p.cache_len;
}
// Whether sequence b's lengths fit its cache: 0 <= cache_seqlens[b] and cache_seqlens[b] + new_keys <= capacity.
__device__ __forceinline__ bool decode_len_ok(const FwdParams& p, int len) {
  return len >= 0 && len <= p.cache_capacity - p.new_keys;
}

// Block-wide reductions of one float (THREADS a multiple of 32; every thread gets the result).
template <int THREADS, class Op> __device__ __forceinline__ float block_reduce(float x, float* red, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  if (lane_id() == 0) red[warp_id()] = x;
  __syncthreads();
  x = red[0];
#pragma unroll
  for (int w = 1; w < THREADS / 32; ++w) x = op(x, red[w]);
  __syncthreads();  // red is free again
  return x;
}

// An FP8 cache's descale for sequence b, kv head hk (x: k_descale or v_descale; nullptr: 1).
__device__ __forceinline__ float cache_descale(const FwdParams& p, const float* x, int b, int hk) {
  return x ? x[b * p.descale_sb + hk * p.descale_sh] : 1.f;
}

// 8 values of a new key or value into the cache at dst: as they are, or (FP8) divided by the descale and rounded
// to e4m3 (8 bytes).
template <typename T, typename C> __device__ __forceinline__ void store_cache8(C* dst, float (&x)[8], float descale) {
  if constexpr (Same<C, e4m3>::value) {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = __fdiv_rn(x[e], descale);
    *reinterpret_cast<uint2*>(dst) = e4m3x8_from(x);
  } else {
    store8(dst, x);
  }
}

// Columns [c, c + 8) of new key t (K and V; K alone without VALUES: the latent cache, whose values are its keys'
// first columns) of sequence bi.b, kv head bi.hk, into the cache as key len + t (len = cache_seqlens[b], checked by
// the caller with decode_len_ok); nothing is written where that key's page lies outside the cache. decode_append's
// threads and decode_split's warps both append through here.
template <typename T, typename C, bool VALUES = true>
__device__ __forceinline__ void append_chunk(const FwdParams& p, const BlockInfo<true>& bi, int len, int t, int c) {
  const BlockInfo<true>::PagePos pos = bi.page_pos(p, len + t);
  if (!BlockInfo<true>::slot_inside(p, bi.page_slot(p, pos.page))) return;  // the page lies outside the cache
  long long ko, vo;
  bi.key_offsets(p, pos, 0, ko, vo);
  float kv[8];
  load8(kv, (const T*)p.k_new + bi.b * p.kn_sb + t * p.kn_ss + bi.hk * p.kn_sh + c);
  store_cache8<T>((C*)p.k + ko + c, kv, cache_descale(p, p.k_descale, bi.b, bi.hk));
  if constexpr (!VALUES) return;
  load8(kv, (const T*)p.v_new + bi.b * p.vn_sb + t * p.vn_ss + bi.hk * p.vn_sh + c);
  store_cache8<T>((C*)p.v + vo + c, kv, cache_descale(p, p.v_descale, bi.b, bi.hk));
}

constexpr int DECODE_MAX_SPLITS = 256;  // rawflash/kernels/launch.py's DECODE_MAX_SPLITS (tests/test_decode.py)

// decode_split's shared memory after the key loop (the tiles' bytes reused): each warp's O (ROWS x D float32, rows
// 4 floats longer than D so a row's 16-byte chunks stay aligned) and lse, a flag, and for the fused combine the
// weights of every partial of the CTA's rows (combine_weights: rows x partials, then each row's lse).
template <int D, int ROWS, int WARPS> struct DecodeMerge {
  static constexpr int OS = D + 4;
  static constexpr int O_FLOATS = WARPS * ROWS * OS, LSE_FLOATS = WARPS * ROWS;
  static constexpr int combine_bytes(int partials) { return ROWS * (partials + 1) * 4; }
  static constexpr int FLAG_AT = (O_FLOATS + LSE_FLOATS) * 4 > combine_bytes(DECODE_MAX_SPLITS)
                                     ? (O_FLOATS + LSE_FLOATS) * 4 : combine_bytes(DECODE_MAX_SPLITS);
  static constexpr int BYTES = FLAG_AT + 16;
  float* base;
  float* lse;  // [WARPS][ROWS]
  int* flag;   // [1]: this CTA finished the (b, hk, row group) last
  __device__ explicit DecodeMerge(char* smem)
      : base((float*)smem), lse((float*)smem + O_FLOATS), flag((int*)(smem + FLAG_AT)) {}
  __device__ __forceinline__ float* o(int w, int row) const { return base + (w * ROWS + row) * OS; }
  __device__ __forceinline__ float* combine_weights() const { return base; }
};

// O's columns (out's, and a partial's in o_ws): head_dim, or the latent cache's head_dim_v (NARROW_V). Read
// where each use is, as p.head_dim is read there without NARROW_V.
template <bool NARROW_V> __device__ __forceinline__ int out_cols(const FwdParams& p) {
  if constexpr (NARROW_V)
    return p.head_dim_v;
  else
    return p.head_dim;
}

// The fused combine of decode_split's last CTA: rows [r0, r0 + nrows) of kv head hk's packed rows of sequence b
// from the `parts` CTA partials in o_ws / m_ws, decode_combine's math: lse = log(sum_c e^lse_c + e^sink), out =
// sum_c e^(lse_c - lse) O_c summed in partial order, a NaN lse making the row NaN. One warp per row for the lse
// (lanes over the partials), then each thread 4 columns of a row, BATCH loads in flight. wts: rows x parts
// weights, then each row's lse (DecodeMerge::combine_weights). The partials are other CTAs' stores: read through
// L2 (ld.global.cg), after the caller's fence. NARROW_V: out has head_dim_v columns (out_cols).
template <typename T, int THREADS, bool NARROW_V = false>
__device__ __forceinline__ void decode_combine_rows(const FwdParams& p, float* wts, int b, int hk, int group, int r0,
                                                    int nrows, int parts) {
  constexpr unsigned FULL = 0xffffffffu;
  constexpr int BATCH = 8;
  const long long lse_split = p.ws_split / out_cols<NARROW_V>(p);
  float* row_lse = wts + nrows * parts;
  for (int row = warp_id(); row < nrows; row += THREADS / 32) {
    const int r = r0 + row, i = r / group, h = hk * group + r % group;
    const long long lr = ((long long)b * p.heads + h) * p.seqlen_q + i;
    float* wr = wts + row * parts;
    float m = -INFINITY;
    bool nan = false;
    for (int c = lane_id(); c < parts; c += 32) {
      const float x = __ldcg(p.m_ws + c * lse_split + lr);
      wr[c] = x;
      nan |= x != x;
      m = fmaxf(m, x);
    }
    nan = __any_sync(FULL, nan);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    if (p.sinks) m = fmaxf(m, p.sinks[h]);
    const float m_use = m == -INFINITY ? 0.f : m;
    float denom = 0.f;
    for (int c = lane_id(); c < parts; c += 32) denom += exp_lse<T>(wr[c] - m_use);  // the lane's own entries
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(FULL, denom, o);
    if (p.sinks) denom += exp_lse<T>(p.sinks[h] - m_use);
    const float lse = nan ? nan_f() : denom > 0.f ? m_use + logf(denom) : -INFINITY;
    for (int c = lane_id(); c < parts; c += 32) wr[c] = wr[c] == -INFINITY || nan ? 0.f : exp_lse<T>(wr[c] - lse);
    if (lane_id() == 0) {
      row_lse[row] = lse;
      if (p.lse) p.lse[lr] = lse;
    }
  }
  __syncthreads();  // every row's weights and lse
  const int c4s = out_cols<NARROW_V>(p) / 4;
  for (int x = threadIdx.x; x < nrows * c4s; x += THREADS) {
    const int row = x / c4s, c = 4 * (x % c4s), r = r0 + row, i = r / group, h = hk * group + r % group;
    const float* src = p.o_ws + (((long long)b * p.seqlen_q + i) * p.heads + h) * out_cols<NARROW_V>(p) + c;
    const float* wr = wts + row * parts;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c0 = 0; c0 < parts; c0 += BATCH) {
      float wt[BATCH];
      float4 y[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        wt[u] = c0 + u < parts ? wr[c0 + u] : 0.f;
        y[u] = wt[u] != 0.f ? __ldcg(reinterpret_cast<const float4*>(src + (c0 + u) * p.ws_split))
                            : make_float4(0.f, 0.f, 0.f, 0.f);  // (no O is written for a weight of 0)
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u)
        acc.x += wt[u] * y[u].x, acc.y += wt[u] * y[u].y, acc.z += wt[u] * y[u].z, acc.w += wt[u] * y[u].w;
    }
    if (row_lse[row] != row_lse[row]) acc = make_float4(nan_f(), nan_f(), nan_f(), nan_f());
    T* out = (T*)p.o + b * p.o_sb + i * p.o_ss + h * p.o_sh + c;
    out[0] = from_float<T>(acc.x), out[1] = from_float<T>(acc.y), out[2] = from_float<T>(acc.z),
    out[3] = from_float<T>(acc.w);
  }
}

}  // namespace rf

template <typename T, typename C, bool VALUES = true>
__global__ void decode_append(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  // ---- [decode:append] one thread per 8 columns of one new key (K and V): into its row (or page) of the cache ----
  // (VALUES false: K alone, the latent cache)
  const int c8 = p.head_dim / 8;
  const long long n = (long long)p.batch * p.new_keys * p.kv_heads * c8;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(x % c8) * 8, hk = (x / c8) % p.kv_heads, t = (x / c8 / p.kv_heads) % p.new_keys;
    const int b = x / ((long long)c8 * p.kv_heads * p.new_keys);
    const int len = decode_cache_len(p, b);
    if (!decode_len_ok(p, len)) continue;  // out of the cache: nothing written (decode_split makes b's rows NaN)
    append_chunk<T, C, VALUES>(p, BlockInfo<true>(p, b, hk * (p.heads / p.kv_heads)), len, t, c);
  }
}

// DV: the latent cache's value columns (MLA: K of D = 576 columns, V its first DV = 512), the CTA's warps sharing
// one split (MainloopDecodeLatent; WG: MainloopDecodeLatentWg, its warpgroup products, sm_90a); DV = D (the
// default): separate K and V caches, a split per warp. The mainloop says which rows and columns of O a thread
// holds (row0, col0, OAcc, SM_ROWS) and which threads hold the rows' lse.
template <typename T, typename C, int D, int MT, int BCW, int STAGES, int WARPS, int SMEM_BYTES, int DV = D,
          bool WG = false>
__global__ void __launch_bounds__(WARPS * 32) decode_split(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  using Latent = typename Select<WG, MainloopDecodeLatentWg<T, C, D, DV, MT, BCW, STAGES, WARPS>,
                                 MainloopDecodeLatent<T, C, D, DV, MT, BCW, STAGES, WARPS>>::type;
  using Mainloop = typename Select<DV == D, MainloopDecode<T, C, D, MT, BCW, STAGES, WARPS>, Latent>::type;
  static_assert(!WG || DV != D, "the warpgroup form is the latent cache's");
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  constexpr int ROWS = Mainloop::ROWS, WC = Mainloop::WC, SPLITS = Mainloop::SPLITS;  // WC warps a split
  using Merge = DecodeMerge<DV, ROWS, SPLITS>;
  static_assert(Merge::BYTES <= SMEM_BYTES, "the merge and the fused combine reuse the tiles' shared memory");
  extern __shared__ __align__(16) char smem[];
  // ---- [decode:schedule] split s of kv head hk's packed rows [r0, r0 + ROWS) of sequence b ----
  const int group = p.heads / p.kv_heads, m_rows = group * p.seqlen_q, row_groups = cdiv(m_rows, ROWS);
  const int hk = blockIdx.y / row_groups, r0 = (blockIdx.y % row_groups) * ROWS, b = blockIdx.z;
  const int split = warp_id() / WC, s = blockIdx.x * SPLITS + split, nrows = min(ROWS, m_rows - r0);
  const bool active = s < p.num_splits;  // the last CTA's splits past num_splits run nothing (and stay for the merge)
  // ---- [decode:setup] the sequence (its keys after the append, checked against the cache) and the policy ----
  BlockInfo<true> bi(p, b, hk * group);
  const int len = decode_cache_len(p, b);
  const bool len_ok = decode_len_ok(p, len);
  bi.seqlen_q = p.seqlen_q;
  bi.seqlen_k = len_ok ? len + p.new_keys : 0;
  const Policy<WINDOW, true> pol(p, bi);
  // ---- [decode:load_q] the packed Q tile, shared by the warps (row r: query r / group, head hk * group + r % group)
  char* const tiles_at = Mainloop::tiles_at(smem);  // the Q tile, then the ring (the swizzled forms: aligned)
  const typename Mainloop::QTile sQ = Mainloop::q_tile(tiles_at);
  using TQ = Tile<T, ROWS, D>;  // (its chunk counts; sQ's layout is the mainloop's)
  for (int idx = threadIdx.x; idx < ROWS * TQ::C; idx += WARPS * 32) {
    const int row = idx / TQ::C, col = (idx % TQ::C) * TQ::CHUNK, r = r0 + row;
    const bool valid = row < nrows && col < p.head_dim;
    const T* src =
        (const T*)p.q + (valid ? b * p.q_sb + (r / group) * p.q_ss + (hk * group + r % group) * p.q_sh + col : 0);
    cp_async16(sQ.saddr(row, col), src, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();  // the Q tile is visible to every warp
  // ---- [decode:q_half] (FP8) the Q tile as float16 in place: row by 2^a (q_half_exp of its largest |q|), each
  // 16 columns permuted for the e4m3 products (permute_k16); a thread per (row, 16 columns) ----
  unsigned* qmax = (unsigned*)(tiles_at + Mainloop::Q_BYTES);
  if constexpr (Mainloop::FP8) {
    constexpr int PER_ROW = D / 16;
    for (int r = threadIdx.x; r < ROWS; r += WARPS * 32) qmax[r] = 0u;
    __syncthreads();
    for (int x = threadIdx.x; x < ROWS * PER_ROW; x += WARPS * 32) {
      const int row = x / PER_ROW, c = 16 * (x % PER_ROW);
      float v[8];
      float m = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        load8(v, sQ.at(row, c + 8 * h));
#pragma unroll
        for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(v[e]));  // (NaN aside: the products carry it)
      }
      atomicMax(qmax + row, __float_as_uint(m));  // m >= 0: its bits order as its values
    }
    __syncthreads();  // every row's largest |q| is in qmax
    for (int x = threadIdx.x; x < ROWS * PER_ROW; x += WARPS * 32) {
      const int row = x / PER_ROW, c = 16 * (x % PER_ROW);
      const float sc = pow2f(q_half_exp(qmax[row]));
      u32 w[8];
      float v[8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        load8(v, sQ.at(row, c + 8 * h));
#pragma unroll
        for (int e = 0; e < 4; ++e) w[4 * h + e] = pack2<__half>(v[2 * e] * sc, v[2 * e + 1] * sc);
      }
      permute_k16(w);
      *reinterpret_cast<uint4*>(sQ.at(row, c)) = make_uint4(w[0], w[1], w[2], w[3]);
      *reinterpret_cast<uint4*>(sQ.at(row, c + 8)) = make_uint4(w[4], w[5], w[6], w[7]);
    }
    __syncthreads();  // the float16 rows are visible to every warp
  }
  // ---- [decode:split_append] the split's keys [k_begin, k_end); the new keys among them into the cache ----
  // The s-th run of cdiv(tiles, num_splits) key tiles of the sequence. The runs of the num_splits splits cover
  // [0, seqlen_k) whatever the mask, so every new key len .. len + new_keys - 1 of a sequence that fits its cache
  // is in exactly one split's range, and that split's warp writes it here (per key, only where its page is inside
  // the cache, as decode_append does), seen by its rows or not: the mask narrows the tiles a warp loads, never
  // the range it writes. Only this warp reads keys of its range (its tiles lie in [k_begin, k_end)), and with one
  // row group (the only case the host sets split_appends for) no other CTA reads them either. Ordering: the
  // stores, then __threadfence() (visible at GPU scope, i.e. in L2, where the ring's cp.async.cg reads; the
  // CTA-scope order of the barrier alone would do by the memory model, the fence makes it independent of the
  // cache path), then __syncwarp() (which orders the lanes' memory operations for the warp), then this warp's
  // cp.async of the tiles: non-bulk cp.async reads its source as an ordinary weak (generic-proxy) load of the
  // issuing thread, so issued after the barrier it sees the stores. One fence per split that holds new keys.
  // The __syncwarp() stands outside the branch: inside it, ptxas gives the tile loop up to 38 more registers
  // (float32 d = 256 spills 628 B, offline; bench/NOTES.md). A warp past num_splits has the empty range [0, 0).
  const int per = cdiv(cdiv(bi.seqlen_k, BCW), p.num_splits) * BCW;
  const int k_begin = active ? s * per : 0, k_end = active ? min(bi.seqlen_k, k_begin + per) : 0;
  if (p.split_appends && len_ok) {
    const int j0 = max(k_begin, len), j1 = min(k_end, len + p.new_keys);
    if (j1 > j0) {  // uniform over the split's warps
      const int c8 = p.head_dim / 8;
      for (int x = WC == 1 ? lane_id() : (int)threadIdx.x; x < (j1 - j0) * c8; x += 32 * WC)
        append_chunk<T, C, Mainloop::VALUES>(p, bi, len, j0 - len + x / c8, x % c8 * 8);
      __threadfence();
    }
  }
  if constexpr (WC == 1)
    __syncwarp();  // the split's new keys are in the cache before its first tile is read
  else
    __syncthreads();  // (the latent form: the CTA's warps are the split's)
  // ---- [decode:mainloop] this warp's split: its key tiles through the ring (mainloop_decode.cuh) ----
  typename Mainloop::OAcc o;  // (the latent forms: the thread's share of O)
  OnlineSoftmax<Mainloop::SM_ROWS> sm;
  const bool bad = !len_ok || !bi.pages_inside(p, k_begin, k_end);  // the split's pages, once (the warp's lanes)
  float k_mul[Mainloop::SM_ROWS];  // (FP8) what multiplies a row's scores: 2^-a of its float16 copy, k_descale
  const float kd = cache_descale(p, p.k_descale, b, hk);
#pragma unroll
  for (int rr = 0; rr < Mainloop::SM_ROWS; ++rr)
    k_mul[rr] = Mainloop::FP8 ? pow2f(-q_half_exp(qmax[16 * (rr / 2) + (lane_id() >> 2) + 8 * (rr % 2)])) * kd : 1.f;
  const int tiles = Mainloop::run(p, bi, pol, group, r0, nrows, k_begin, bad ? k_begin : k_end, sQ,
                                  WC == 1 ? tiles_at + Mainloop::Q_BYTES + Mainloop::QMAX_BYTES +
                                                warp_id() * STAGES * 2 * Mainloop::KV_BYTES
                                          : tiles_at + Mainloop::Q_BYTES,  // (the latent forms: the CTA's one ring)
                                  k_mul, o, sm);
  // ---- [decode:merge] the CTA's splits into one partial O (divided by its l) and lse, float32 ----
  // Each warp's O (divided by its own l) and lse go to shared memory (the tiles' bytes: every warp is past its
  // key loop), then each thread merges 4 columns of a row over the WARPS splits by their lse, as the combine
  // merges partials: lse = log sum_w e^lse_w, O = sum_w e^(lse_w - lse) O_w. So the partials are the CTAs' (one
  // per WARPS splits), not the warps'. A split with no key (or past num_splits) has lse -inf and weight 0; a
  // sequence outside its cache has lse NaN in every split, and its partials' lse is NaN (the combine turns its
  // rows into NaN); a partial's O is written only where its lse is finite (the combine reads no other).
  float f[Mainloop::SM_ROWS], lse[Mainloop::SM_ROWS];
  sm.template finalize<T, false>(-INFINITY, f, lse);
  if constexpr (Mainloop::FP8) {  // O = P (v_descale V8): the split's O by the descale, with its 1 / l
    const float vd = cache_descale(p, p.v_descale, b, hk);
#pragma unroll
    for (int rr = 0; rr < Mainloop::SM_ROWS; ++rr) f[rr] *= vd;
  }
  __syncthreads();  // every warp is done with the Q tile and its ring
  const Merge mg(smem);
  // the thread's rows and columns of O: from row0 (the warp's first) and col0 (its first column)
  const int g = lane_id() >> 2, t = lane_id() & 3, r0w = Mainloop::row0(), c0 = Mainloop::col0();
  if (active && tiles > 0 && !bad)
    for_each(o, [&](float& x, int row, int col) {
      mg.o(split, r0w + row)[Mainloop::FP8 ? o_col_e4m3(col) : c0 + col] = x * f[2 * (row / 16) + ((row % 16) >= 8)];
    });
#pragma unroll
  for (int rr = 0; rr < Mainloop::SM_ROWS; ++rr)
    if (t == 0 && Mainloop::holds_lse())  // (the split's warps that share rows hold the same lse)
      mg.lse[split * ROWS + r0w + 16 * (rr / 2) + g + 8 * (rr % 2)] = !active ? -INFINITY : bad ? nan_f() : lse[rr];
  __syncthreads();  // every split's O and lse are in shared memory
  const long long lse_split = p.ws_split / out_cols<DV != D>(p);
  float* ows = p.o_ws + blockIdx.x * p.ws_split;
  float* lws = p.m_ws + blockIdx.x * lse_split;
  const int c4s = out_cols<DV != D>(p) / 4;
  for (int x = threadIdx.x; x < nrows * c4s; x += WARPS * 32) {
    const int row = x / c4s, c = 4 * (x % c4s), r = r0 + row, i = r / group, h = hk * group + r % group;
    float m = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int w = 0; w < SPLITS; ++w) {
      const float y = mg.lse[w * ROWS + row];
      nan |= y != y;
      m = fmaxf(m, y);
    }
    const float m_use = m == -INFINITY ? 0.f : m;
    float denom = 0.f;
#pragma unroll
    for (int w = 0; w < SPLITS; ++w) denom += exp_lse<T>(mg.lse[w * ROWS + row] - m_use);
    const float l = nan ? nan_f() : denom > 0.f ? m_use + logf(denom) : -INFINITY;
    if (c == 0) lws[((long long)b * p.heads + h) * p.seqlen_q + i] = l;
    if (nan || l == -INFINITY) continue;  // the combine reads no O of this partial's row
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < SPLITS; ++w) {
      const float y = mg.lse[w * ROWS + row];
      if (y == -INFINITY) continue;  // no O is written for it
      const float wt = exp_lse<T>(y - l);
      const float4 v = *reinterpret_cast<const float4*>(mg.o(w, row) + c);
      acc.x += wt * v.x, acc.y += wt * v.y, acc.z += wt * v.z, acc.w += wt * v.w;
    }
    *reinterpret_cast<float4*>(ows + (((long long)b * p.seqlen_q + i) * p.heads + h) * out_cols<DV != D>(p) + c) = acc;
  }
  if (!p.decode_counters) return;  // decode_combine merges the partials in a launch of its own
  // ---- [decode:fused_combine] the last CTA of (b, hk, row group) to finish merges every CTA's partial ----
  // Each CTA counts itself once its partial is written (the classic last-block reduction: stores, a GPU-scope
  // fence, then the atomic); the CTA that brings the count to gridDim.x knows every partial is visible, puts the
  // counter back to zero for the next launch on the stream (nothing else touches it in this one) and runs the
  // combine for its rows: decode_combine's math (the sink added), the partials read from L2 (ld.global.cg).
  __threadfence();  // this thread's partial stores are visible GPU-wide before the CTA is counted
  __syncthreads();  // ... every thread's, and the merge's reads of shared memory are done
  const int pair = blockIdx.z * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) {
    const int done = atomicAdd(p.decode_counters + pair, 1);
    mg.flag[0] = done == (int)gridDim.x - 1;
    if (mg.flag[0]) p.decode_counters[pair] = 0;
  }
  __syncthreads();
  if (!mg.flag[0]) return;
  __threadfence();  // the other CTAs' partials, counted before this CTA's atomic, are read after it
  decode_combine_rows<T, WARPS * 32, DV != D>(p, mg.combine_weights(), b, hk, group, r0, nrows, gridDim.x);
}

// NARROW_V (both combines): out has head_dim_v columns (the latent cache's values), else head_dim.
template <typename T, int THREADS, int MAX_SPLITS, int SMEM_BYTES, bool NARROW_V = false>
__global__ void __launch_bounds__(THREADS) decode_combine(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  static_assert(THREADS % 32 == 0 && THREADS >= 64, "whole warps");
  static_assert(SMEM_BYTES == THREADS * 16 + MAX_SPLITS * 4 + THREADS / 32 * 4,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  extern __shared__ __align__(16) char smem[];
  float4* part = (float4*)smem;                      // per (split group, column chunk) partial sums
  float* w = (float*)(smem + THREADS * 16);          // each split's lse, then its weight e^(lse_s - lse)
  float* red = w + MAX_SPLITS;                       // one value per warp (block reductions)
  // ---- [decode:combine] row (b, i, h): lse = log(sum_s e^lse_s + e^sink), out = sum_s e^(lse_s - lse) O_s ----
  // Lanes over the splits for the lse (block reductions), then each thread a chunk of 4 columns and every
  // groups-th split, the groups summed through shared memory. A NaN lse (a sequence outside its cache) makes the
  // row NaN.
  const long long row = blockIdx.x;  // (b * seqlen_q + i) * heads + h
  const int h = row % p.heads, i = (row / p.heads) % p.seqlen_q, b = row / ((long long)p.heads * p.seqlen_q);
  const long long lse_row = ((long long)b * p.heads + h) * p.seqlen_q + i,
                  lse_split = p.ws_split / out_cols<NARROW_V>(p);
  const int splits = min(p.num_partials, MAX_SPLITS);  // (the CTAs' partials: see decode_split's merge)
  float m = -INFINITY;
  int nan = 0;
  for (int s = threadIdx.x; s < splits; s += THREADS) {
    const float x = p.m_ws[s * lse_split + lse_row];
    w[s] = x;
    nan |= x != x;
    m = fmaxf(m, x);
  }
  nan = __syncthreads_or(nan);
  if (p.sinks) m = fmaxf(m, p.sinks[h]);
  m = block_reduce<THREADS>(m, red, [](float a, float c) { return fmaxf(a, c); });
  const float m_use = m == -INFINITY ? 0.f : m;
  float denom = 0.f;
  for (int s = threadIdx.x; s < splits; s += THREADS) denom += exp_lse<T>(w[s] - m_use);  // the thread's own w
  denom = block_reduce<THREADS>(denom, red, [](float a, float c) { return a + c; });
  if (p.sinks) denom += exp_lse<T>(p.sinks[h] - m_use);
  const float lse = nan ? nan_f() : denom > 0.f ? m_use + logf(denom) : -INFINITY;
  for (int s = threadIdx.x; s < splits; s += THREADS)
    w[s] = w[s] == -INFINITY || nan ? 0.f : exp_lse<T>(w[s] - lse);
  __syncthreads();  // every weight is visible
  // out_cols is a multiple of 8 and at most 4 * THREADS
  const int chunks = out_cols<NARROW_V>(p) / 4, groups = THREADS / chunks;
  const int c4 = threadIdx.x % chunks, sg = threadIdx.x / chunks;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sg < groups) {
    const float* src = p.o_ws + row * out_cols<NARROW_V>(p) + 4 * c4;
#pragma unroll 4
    for (int s = sg; s < splits; s += groups) {
      const float wt = w[s];
      if (wt != 0.f) {  // empty splits wrote no O
        const float4 x = *reinterpret_cast<const float4*>(src + s * p.ws_split);
        acc.x += wt * x.x, acc.y += wt * x.y, acc.z += wt * x.z, acc.w += wt * x.w;
      }
    }
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  if (sg == 0) {
    for (int gg = 1; gg < groups; ++gg) {
      const float4 x = part[gg * chunks + c4];
      acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    T* out = (T*)p.o + b * p.o_sb + i * p.o_ss + h * p.o_sh + 4 * c4;
    if (nan) acc = make_float4(nan_f(), nan_f(), nan_f(), nan_f());
    out[0] = from_float<T>(acc.x), out[1] = from_float<T>(acc.y), out[2] = from_float<T>(acc.z),
    out[3] = from_float<T>(acc.w);
  }
  if (threadIdx.x == 0 && p.lse) p.lse[lse_row] = lse;
}

template <typename T, int WARPS, bool NARROW_V = false>
__global__ void __launch_bounds__(WARPS * 32, 16 / WARPS) decode_combine_warp(const __grid_constant__ rf::FwdParams p) {
  using namespace rf;
  constexpr unsigned FULL = 0xffffffffu;
  constexpr int BATCH = 16;  // independent loads per lane before their sums (12 - 32 splits: one or two round trips)
  // ---- [decode:combine_warp] decode_combine's math, row (b, i, h) by one warp (num_splits <= 32), WARPS a CTA ----
  // Lane s holds split s's lse: max and sum by xor shuffles (the same tree, hence the same lse, as decode_combine's
  // block reduction over at most 32 splits), then each lane owns 4-column chunks of out and sums them over the
  // splits in order, the weights broadcast by shuffles; head dims of fewer than 128 columns split the splits
  // between groups of lanes (lane = group * chunks + chunk), added by shuffles at the end. No shared memory, no
  // CTA barrier. Empty splits (lse -inf, weight 0) are not read; a NaN lse (a sequence outside its cache) makes
  // the row NaN. Each lane issues BATCH loads of its partials before it sums them, so a row costs the lse's round
  // trip and one or two of the partials'. __launch_bounds__ with 16 / WARPS CTAs: given the thread count alone,
  // ptxas holds this kernel at 40 registers and spills 28 B (offline, CUDA 13); with 16 warps per SM it keeps the
  // 16 loads in flight (112 - 118 registers), and 132 SMs hold 2112 rows at once (b = 64 x 32 heads: one wave).
  const long long row = (long long)blockIdx.x * WARPS + warp_id();  // (b * seqlen_q + i) * heads + h
  if (row >= (long long)p.batch * p.seqlen_q * p.heads) return;      // the whole warp
  const int h = row % p.heads, i = (row / p.heads) % p.seqlen_q, b = row / ((long long)p.heads * p.seqlen_q);
  const long long lse_row = ((long long)b * p.heads + h) * p.seqlen_q + i,
                  lse_split = p.ws_split / out_cols<NARROW_V>(p);
  const int lane = lane_id(), splits = min(p.num_partials, 32);
  const float x = lane < splits ? p.m_ws[lane * lse_split + lse_row] : -INFINITY;
  const bool nan = __any_sync(FULL, x != x);
  float m = x;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
  if (p.sinks) m = fmaxf(m, p.sinks[h]);
  const float m_use = m == -INFINITY ? 0.f : m;
  float denom = lane < splits ? exp_lse<T>(x - m_use) : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) denom += __shfl_xor_sync(FULL, denom, o);
  if (p.sinks) denom += exp_lse<T>(p.sinks[h] - m_use);
  const float lse = nan ? nan_f() : denom > 0.f ? m_use + logf(denom) : -INFINITY;
  const float wt = lane >= splits || x == -INFINITY || nan ? 0.f : exp_lse<T>(x - lse);
  // out_cols is a multiple of 8 and at most 512: 2 .. 128 chunks of 4 columns
  const int chunks = out_cols<NARROW_V>(p) / 4, groups = chunks >= 32 ? 1 : 32 / chunks;
  const int sg = lane / chunks, c = lane % chunks;
  const float* src = p.o_ws + row * out_cols<NARROW_V>(p);
  T* out = (T*)p.o + b * p.o_sb + i * p.o_ss + h * p.o_sh;
  for (int c0 = 0; c0 < chunks; c0 += 32) {  // uniform: one pass up to 128 columns, two at 192 and 256, 4 at 512
    const int c4 = c0 + c;
    const bool mine = sg < groups && c4 < chunks;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += BATCH * groups) {  // BATCH loads in flight per lane, then their sums
      float ws[BATCH];
      float4 y[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int s = s0 + u * groups + sg;
        ws[u] = __shfl_sync(FULL, wt, s & 31);
        if (!mine || s >= splits) ws[u] = 0.f;
        y[u] = ws[u] != 0.f ? *reinterpret_cast<const float4*>(src + s * p.ws_split + 4 * c4)  // empty splits
                            : make_float4(0.f, 0.f, 0.f, 0.f);                                 // wrote no O
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u)
        acc.x += ws[u] * y[u].x, acc.y += ws[u] * y[u].y, acc.z += ws[u] * y[u].z, acc.w += ws[u] * y[u].w;
    }
    for (int gg = 1; gg < groups; ++gg) {  // the groups' sums into group 0, in order
      const int from = (gg * chunks + c) & 31;
      const float4 y = make_float4(__shfl_sync(FULL, acc.x, from), __shfl_sync(FULL, acc.y, from),
                                   __shfl_sync(FULL, acc.z, from), __shfl_sync(FULL, acc.w, from));
      if (sg == 0) acc.x += y.x, acc.y += y.y, acc.z += y.z, acc.w += y.w;
    }
    if (sg == 0 && c4 < chunks) {
      if (nan) acc = make_float4(nan_f(), nan_f(), nan_f(), nan_f());
      T* dst = out + 4 * c4;
      dst[0] = from_float<T>(acc.x), dst[1] = from_float<T>(acc.y), dst[2] = from_float<T>(acc.z),
      dst[3] = from_float<T>(acc.w);
    }
  }
  if (lane == 0 && p.lse) p.lse[lse_row] = lse;
}
