// fa2_bwd: FlashAttention-2 backward (Dao 2023, Algorithm 2) on mma.sync, for every dtype and GPU (sm_80+).
// fa2_bwd_preprocess: D_i = rowsum(dO_i * O_i) and L_i in log2 units (hidden rows: +inf, so P = 0), with sinks
//   each row's share of the sink gradient, and zeros in the float32 dQ rows the main pass adds into.
// fa2_bwd: the bwd.cuh skeleton with mainloop_bwd_sm80: grid (Tc, kv_heads, batch), one CTA per key block; with
//   ATOMIC_DQ it also accumulates dQ into a float32 buffer that fa2_bwd_convert_dq casts.
// fa2_bwd_dq: the deterministic dQ (no atomics): one CTA per query block, looping over key blocks (WC > 1: warps
//   also split dQ_i's columns).
// Rows of the per-row buffers (L, D, dQ's accumulator, the sink terms) follow params.cuh's layout: (rows_batch,
// heads, rows_seqlen) with rows_batch = 1 for packed sequences.
#include "mainloop_bwd_sm80.cuh"
#include "scheduler.cuh"

namespace rf {

// (b, h, i) of row `row` of the per-row buffers, and the element offset of that row in a q-like tensor.
__device__ __forceinline__ long long row_offset(const BwdParams& p, long long row, long long sb, long long ss,
                                                long long sh) {
  const int i = row % p.rows_seqlen, h = (row / p.rows_seqlen) % p.heads,
            b = row / ((long long)p.rows_seqlen * p.heads);
  return b * sb + i * ss + h * sh;
}

// fa2_bwd_preprocess's threads per row: one per 16-column block of D's ordered sum, rounded up to a power of two
// (a shuffle segment); launch.preprocess_lanes is the host's copy of this formula.
__device__ __forceinline__ int preprocess_lanes(int head_dim) {
  int lanes = 1;
  while (lanes < cdiv(head_dim, 16)) lanes *= 2;
  return lanes;
}

}  // namespace rf

template <typename T> __global__ void fa2_bwd_preprocess(const __grid_constant__ rf::BwdParams p) {
  using namespace rf;
  // ---- [fa2_bwd:preprocess] Alg.2 l.4: D_i = rowsum(dO_i * O_i); a group of threads per row ----
  // The sum runs in the order the products accumulate dP (FMA chains over 16 columns, added up in order), so a
  // row whose P is a single 1 gets dP - D = 0 exactly in float32, as the naive computation does. Thread `blk` of
  // a row's group (preprocess_lanes: one per 16-column block, rounded up to a power of two) forms block blk's
  // chain, and the group adds the chains up in block order through shuffles, so a warp reads 32 / lanes rows
  // side by side in 32-byte pieces (one thread per row read 16 bytes at a time, a row apart: 1.3 TB/s on the
  // H200). A grid-stride loop over (row, block) pairs; a row's group is whole or absent in every step (lanes
  // divides 32, and so the loop's stride). O and dO have v's head_dim (p.head_dim_v: MLA's narrower v in FA3's DV
  // form) and dQ's rows q's; the blocks cover q's, the ones past v's columns add nothing to D.
  const int lanes = preprocess_lanes(p.head_dim), nblk = cdiv(p.head_dim, 16);
  const unsigned group = lanes >= 32 ? 0xffffffffu : ((1u << lanes) - 1u) << (lane_id() & ~(lanes - 1));
  const long long n = (long long)p.rows_batch * p.heads * p.rows_seqlen * lanes;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const long long row = x / lanes;
    const int blk = (int)(x % lanes), c0 = 16 * blk, c1 = min(c0 + 16, p.head_dim), cv = min(c1, p.head_dim_v);
    const T* o = (const T*)p.out + row_offset(p, row, p.o_sb, p.o_ss, p.o_sh);
    const T* d = (const T*)p.dout + row_offset(p, row, p.do_sb, p.do_ss, p.do_sh);
    // 16-byte loads of 8 values where the rows allow it (head_dim_v % 8 == 0, aligned), else one value at a time.
    const bool vec = p.head_dim_v % 8 == 0 &&
                     ((reinterpret_cast<unsigned long long>(o) | reinterpret_cast<unsigned long long>(d)) & 15) == 0;
    float part = 0.f;
    if (vec) {
      for (int c = c0; c < cv; c += 8) {
        float a[8], y[8];
        load8(a, o + c);
        load8(y, d + c);
#pragma unroll
        for (int e = 0; e < 8; ++e) part = fmaf(a[e], y[e], part);
      }
    } else {
      for (int c = c0; c < cv; ++c) part = fmaf(to_float(o[c]), to_float(d[c]), part);
    }
    // ---- [fa2_bwd:zero_dq] the float32 dQ rows the main pass adds into start at zero: this block's columns ----
    if (p.dq_ws) {
      float* z = p.dq_ws + row * p.head_dim;
      if (p.head_dim % 4 == 0)
        for (int c = c0; c < c1; c += 4) *reinterpret_cast<float4*>(z + c) = make_float4(0.f, 0.f, 0.f, 0.f);
      else
        for (int c = c0; c < c1; ++c) z[c] = 0.f;
    }
    float acc = 0.f;
    for (int b = 0; b < nblk; ++b) acc += __shfl_sync(group, part, b, lanes);
    if (blk != 0) continue;
    const float lse = p.lse[row];
    p.delta[row] = acc;
    p.lse2[row] = lse == -INFINITY ? INFINITY : lse * LOG2E;
    // ---- [fa2_bwd:sink_terms] d(loss)/d(sink_h) = -sum_i exp(sink_h - lse_i) D_i: this row's term ----
    if (p.sinks) {
      const float sink = p.sinks[(row / p.rows_seqlen) % p.heads];
      p.dsink_ws[row] = (sizeof(T) == 4 ? (float)exp((double)sink - (double)lse) : expf(sink - lse)) * acc;
    }
  }
}

template <typename T, int D, int BR, int BC, int NWARPS, int WC, int MIN_BLOCKS, int KUNROLL, int MASK, bool GENERAL,
          bool ATOMIC_DQ, bool EARLY_DV, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) fa2_bwd(const __grid_constant__ rf::BwdParams p) {
  using namespace rf;
  using Mainloop = MainloopBwdSm80<T, D, BR, BC, NWARPS, WC, KUNROLL, ATOMIC_DQ, Policy<MASK, GENERAL>, EARLY_DV>;
  static_assert(Mainloop::SMEM_BYTES == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  bwd_kernel<Mainloop>(p);
}

// Deterministic dQ: one CTA per query block i (grid (Tr, heads, batch), the forward's query tiles), split-Q warps
// over the key blocks the policy leaves visible, no atomics. With WC > 1 (head_dim 512) WC neighbouring warps share
// their rows and split dQ_i's columns, D / WC each, every one computing the rows' P and dS itself.
template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, int KUNROLL, int MASK, bool GENERAL,
          int SMEM_BYTES, int WC = 1>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS) fa2_bwd_dq(const __grid_constant__ rf::BwdParams p) {
  using namespace rf;
  using Pol = Policy<MASK, GENERAL>;
  constexpr int NTHREADS = NWARPS * 32, MT = BR / (16 * (NWARPS / WC)), NT = BC / 8, DW = D / WC;
  static_assert((2 * BC + 2 * BR) * D * (int)sizeof(T) + 2 * BR * 4 == SMEM_BYTES,
                "rawflash/kernels/launch.py and the kernel disagree on shared memory");
  static_assert(NWARPS % WC == 0 && BR % (16 * (NWARPS / WC)) == 0 && DW % 16 == 0, "warp layout");
  // ---- [fa2_bwd:dq_setup] query block i of head h; warp w owns rows wq.. (and columns dc.. of dQ_i) ----
  extern __shared__ __align__(16) char smem[];
  const Tile<T, BC, D> sK{(T*)smem}, sV{(T*)(smem + BC * D * sizeof(T))};
  const Tile<T, BR, D> sQ{(T*)(smem + 2 * BC * D * sizeof(T))}, sdO{(T*)(smem + (2 * BC + BR) * D * sizeof(T))};
  float* sL = (float*)(smem + (2 * BC + 2 * BR) * D * sizeof(T));
  float* sDelta = sL + BR;
  QTileScheduler<BR, false, GENERAL> tile;
  if (!tile.start(p)) return;
  const typename Pol::Info bi(p, tile.b, tile.h);
  const int q0 = tile.i * BR, wq = 16 * MT * (warp_id() / WC), dc = DW * (warp_id() % WC);
  if (q0 >= bi.seqlen_q) return;
  const Pol pol(p, bi);
  load_query_block<NTHREADS>(sQ, sdO, sL, sDelta, bi.template q<T>(p), p.q_ss,
                             bi.template q_like<const T>(p.dout, p.do_sb, p.do_ss, p.do_sh), p.do_ss, p.lse2 + bi.row0,
                             p.delta + bi.row0, q0, bi.seqlen_q, p.head_dim);
  Acc<MT, DW / 8> acc;
  zero(acc);
  const BlockRange kv = pol.kv_blocks(q0, min(BR, bi.seqlen_q - q0), BC);
  const T *k = bi.template k<T>(p), *v = bi.template v<T>(p);
  for (int s = 0; s < kv.n(); ++s) {
    const int k0 = kv.block(s) * BC, nk = min(BC, bi.seqlen_k - k0);
    const bool edge = kv.is_edge(s);
    // ---- [fa2_bwd:dq_block] recompute P, dP and dS for K_j, V_j; dQ_i += dS K_j ----
    load_tile<NTHREADS>(sK, k + k0 * p.k_ss, p.k_ss, nk, p.head_dim);
    load_tile<NTHREADS>(sV, v + k0 * p.v_ss, p.v_ss, nk, p.head_dim);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // K_j, V_j (and Q_i, dO_i, L, D) are visible to every warp
    Acc<MT, NT> pp, ds;
    zero(pp);
    gemm_abt<MT, NT, D, KUNROLL>(pp, sQ, wq, sK, 0);
    zero(ds);
    gemm_abt<MT, NT, D, KUNROLL>(ds, sdO, wq, sV, 0);
    pol.template backward_tile<T, false>(pp, ds, q0 + wq, k0, sL + wq, sDelta + wq, edge);
    gemm_rb<MT, DW / 8, NT / 2>(acc, ds, sK, 0, dc);
    __syncthreads();  // every warp is done with K_j, V_j before the next block overwrites them
  }
  // ---- [fa2_bwd:dq_epilogue] dQ_i = scale * acc ----
  float f[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) f[r] = p.scale;
  cp_async_wait<0>();
  store_rows<T>(bi.template q_like<T>(p.dq, p.dq_sb, p.dq_ss, p.dq_sh), p.dq_ss, acc, f, q0 + wq, dc, bi.seqlen_q,
                p.head_dim);
}

// dQ = dq_ws (float32 per-row buffer, already scaled) in the input dtype.
template <typename T> __global__ void fa2_bwd_convert_dq(const __grid_constant__ rf::BwdParams p) {
  using namespace rf;
  // ---- [fa2_bwd:convert] 8 columns per thread and step (head_dim is a multiple of 8: the backend pads it) ----
  const int c8 = p.head_dim / 8;
  const long long n = (long long)p.rows_batch * p.heads * p.rows_seqlen * c8;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(x % c8) * 8;
    const long long row = x / c8;
    float v[8];
    load8(v, p.dq_ws + row * p.head_dim + c);
    store8((T*)p.dq + row_offset(p, row, p.dq_sb, p.dq_ss, p.dq_sh) + c, v);
  }
}
