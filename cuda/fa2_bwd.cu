// fa2_bwd: FlashAttention-2 backward (Dao 2023, Algorithm 2).
// fa2_bwd_preprocess: D_i = rowsum(dO_i * O_i) and L_i in log2 units (hidden rows: +inf, so P = 0).
// fa2_bwd: grid (Tc, kv_heads, batch); one CTA per key block K_j, V_j, which stay in shared memory while the
//   CTA walks every query head of its GQA group and every query block Q_i that sees K_j; dK_j, dV_j stay in
//   registers (so the group sum needs no atomics) and P is recomputed from L. Warps split the keys (16*MTK
//   rows each) and, with WC > 1, the head_dim columns of dK_j, dV_j. With ATOMIC_DQ, dQ_i += dS K_j goes
//   through shared memory (dS^T) and float32 atomicAdd into a work buffer; fa2_bwd_convert_dq casts it.
// fa2_bwd_dq: the deterministic dQ (no atomics): one CTA per query block, looping over key blocks.
#include "common.cuh"

namespace rf {

template <typename T, int D, int BR, int BC, bool ATOMIC_DQ> struct Fa2BwdSmem {
  static constexpr int BYTES = (2 * BC + 4 * BR) * D * (int)sizeof(T) + (ATOMIC_DQ ? BC * BR * (int)sizeof(T) : 0) + 4 * BR * 4;
};
template <typename T, int D, int BR, int BC> struct Fa2BwdDqSmem {
  static constexpr int BYTES = (2 * BC + 2 * BR) * D * (int)sizeof(T) + 2 * BR * 4;
};

// Q_i, dO_i to shared memory (cp.async) and L_i, D_i beside them; rows past seqlen_q read L = +inf, D = 0.
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

// Column groups for the dQ product: as many as the warps allow while each stays a multiple of 16 columns.
constexpr int dq_column_groups(int groups, int d) { return (d / groups) % 16 == 0 ? groups : dq_column_groups(groups / 2, d); }

}  // namespace rf

template <typename T>
__global__ void fa2_bwd_preprocess(const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
                                   float* __restrict__ lse2, float* __restrict__ delta, long long o_sb, long long o_ss,
                                   long long o_sh, long long do_sb, long long do_ss, long long do_sh, int batch,
                                   int seqlen_q, int heads, int head_dim) {
  using namespace rf;
  // ---- [fa2_bwd:preprocess] Alg.2 l.4: D_i = rowsum(dO_i * O_i); one thread per row ----
  // The sum runs in the order the products accumulate dP (FMA chains over 16 columns, added up in order), so a
  // row whose P is a single 1 gets dP - D = 0 exactly in float32, as the naive computation does.
  const long long row = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // (b * heads + h) * seqlen_q + i
  if (row >= (long long)batch * heads * seqlen_q) return;
  const int i = row % seqlen_q, h = (row / seqlen_q) % heads, b = row / ((long long)seqlen_q * heads);
  const T* o = out + b * o_sb + i * o_ss + h * o_sh;
  const T* d = dout + b * do_sb + i * do_ss + h * do_sh;
  // 16-byte loads of 8 values where the rows allow it (head_dim % 8 == 0, aligned), else one value at a time.
  const bool vec =
      head_dim % 8 == 0 && ((reinterpret_cast<unsigned long long>(o) | reinterpret_cast<unsigned long long>(d)) & 15) == 0;
  float acc = 0.f;
  for (int c0 = 0; c0 < head_dim; c0 += 16) {
    float part = 0.f;
    if (vec) {
      for (int c = c0; c < min(c0 + 16, head_dim); c += 8) {
        float a[8], x[8];
        load8(a, o + c);
        load8(x, d + c);
#pragma unroll
        for (int e = 0; e < 8; ++e) part = fmaf(a[e], x[e], part);
      }
    } else {
      for (int c = c0; c < min(c0 + 16, head_dim); ++c) part = fmaf(to_float(o[c]), to_float(d[c]), part);
    }
    acc += part;
  }
  delta[row] = acc;
  lse2[row] = lse[row] == -INFINITY ? INFINITY : lse[row] * LOG2E;
}

template <typename T, int D, int BR, int BC, int NWARPS, int WC, int MIN_BLOCKS, int KUNROLL, bool CAUSAL,
          bool ATOMIC_DQ, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fa2_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
        const float* __restrict__ lse2, const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
        float* __restrict__ dq_ws, long long q_sb, long long q_ss, long long q_sh, long long k_sb, long long k_ss,
        long long k_sh, long long v_sb, long long v_ss, long long v_sh, long long do_sb, long long do_ss,
        long long do_sh, long long dk_sb, long long dk_ss, long long dk_sh, long long dv_sb, long long dv_ss,
        long long dv_sh, int seqlen_q, int seqlen_k, int heads, int kv_heads, int head_dim, float scale,
        float scale_log2) {
  using namespace rf;
  constexpr int NTHREADS = NWARPS * 32, WK = NWARPS / WC, MTK = BC / (16 * WK), NQ = BR / 8, DW = D / WC;
  // dQ_i (BR x D) is split into QROWS x QCOLS warp tiles of 16 x DQW, done DQC columns at a time.
  constexpr int QROWS = BR / 16, QCOLS = dq_column_groups(NWARPS / QROWS, D), DQW = D / QCOLS;
  constexpr int DQC_MAX = sizeof(T) == 2 ? 64 : 32;                     // float32 keeps a second sum block live
  constexpr int DQC = DQW <= DQC_MAX ? DQW : DQW % DQC_MAX == 0 ? DQC_MAX : 16;
  static_assert(Fa2BwdSmem<T, D, BR, BC, ATOMIC_DQ>::BYTES == SMEM_BYTES,
                "rawflash/launch.py and the kernel disagree on shared memory");
  static_assert(BC % (16 * WK) == 0 && DW % 16 == 0 && NWARPS % QROWS == 0 && DQW % DQC == 0 && DQC % 16 == 0, "warp layout");
  // ---- [fa2_bwd:setup] key block j, kv head hk, batch b; warp (wk, wc) owns keys kw.. and columns dc.. ----
  extern __shared__ __align__(16) char smem[];
  const int j = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, group = heads / kv_heads;
  const int w = warp_id(), kw = 16 * MTK * (w % WK), dc = DW * (w / WK), k0 = j * BC;
  const Tile<T, BC, D> sK{(T*)smem}, sV{(T*)(smem + BC * D * sizeof(T))};
  T* const sQ0 = (T*)(smem + 2 * BC * D * sizeof(T));                     // 2 stages of Q_i, then 2 of dO_i
  T* const sdO0 = sQ0 + 2 * BR * D;
  const Tile<T, BC, BR> sdS{sdO0 + 2 * BR * D};
  float* const sL0 = (float*)(smem + SMEM_BYTES - 4 * BR * 4);             // 2 stages of L_i, then 2 of D_i
  float* const sDelta0 = sL0 + 2 * BR;
  const Mask mask{seqlen_q, seqlen_k, CAUSAL};
  const int nk = min(BC, seqlen_k - k0), tr = (seqlen_q + BR - 1) / BR;
  // The CTA visits (h, i) for every query head h of the group and every query block i that sees K_j, in order.
  const int i0 = mask.first_query_block(k0, BR), nqb = max(0, tr - i0), n_iter = group * nqb;
  // ---- [fa2_bwd:load_kv] Alg.2 l.6-7: K_j, V_j to shared memory once; dK_j = dV_j = 0 ----
  load_tile<NTHREADS>(sK, k + b * k_sb + hk * k_sh + k0 * k_ss, k_ss, nk, head_dim);
  load_tile<NTHREADS>(sV, v + b * v_sb + hk * v_sh + k0 * v_ss, v_ss, nk, head_dim);
  cp_async_commit();
  float dk_acc[MTK][DW / 8][4], dv_acc[MTK][DW / 8][4];
  zero(dk_acc);
  zero(dv_acc);
  auto issue = [&](int it) {  // start loading iteration it's Q_i, dO_i, L_i, D_i into stage it % 2
    const int h = hk * group + it / nqb, q0 = (i0 + it % nqb) * BR, st = it & 1;
    const long long bh = (long long)b * heads + h;
    load_query_block<NTHREADS>(Tile<T, BR, D>{sQ0 + st * BR * D}, Tile<T, BR, D>{sdO0 + st * BR * D}, sL0 + st * BR,
                               sDelta0 + st * BR, q + b * q_sb + h * q_sh, q_ss, dout + b * do_sb + h * do_sh, do_ss,
                               lse2 + bh * seqlen_q, delta + bh * seqlen_q, q0, seqlen_q, head_dim);
  };
  if (n_iter > 0) issue(0);
  for (int it = 0; it < n_iter; ++it) {
    const int h = hk * group + it / nqb, q0 = (i0 + it % nqb) * BR, st = it & 1;
    const long long bh = (long long)b * heads + h;
    const Tile<T, BR, D> sQ{sQ0 + st * BR * D}, sdO{sdO0 + st * BR * D};
    const float *sL = sL0 + st * BR, *sDelta = sDelta0 + st * BR;
    // ---- [fa2_bwd:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i; the next block's stream in behind them ----
    if (it + 1 < n_iter) {
      issue(it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // K_j, V_j and this stage's Q_i, dO_i, L_i, D_i are visible to every warp
    // ---- [fa2_bwd:scores] Alg.2 l.9-10: S^T = K_j Q_i^T, P^T = exp2(S^T - L) ----
    float p[MTK][NQ][4], ds[MTK][NQ][4];
    zero(p);
    gemm_abt<MTK, NQ, D, KUNROLL>(p, sK, kw, sQ, 0);
#pragma unroll
    for (int x = 0; x < MTK; ++x)
#pragma unroll
      for (int y = 0; y < NQ; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[x][y][e] *= scale_log2;
    if (mask.block_needs_mask(q0, BR, k0, BC)) apply_mask_t(p, mask, k0 + kw, q0);
    const int t = lane_id() & 3;
#pragma unroll
    for (int x = 0; x < MTK; ++x)
#pragma unroll
      for (int y = 0; y < NQ; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[x][y][e] = exp2_<T>(p[x][y][e] - sL[8 * y + 2 * t + (e & 1)]);
    // ---- [fa2_bwd:dv] Alg.2 l.11: dV_j += P^T dO_i ----
    gemm_rb<MTK, DW / 8, NQ / 2>(dv_acc, p, sdO, 0, dc);
    // ---- [fa2_bwd:dp] Alg.2 l.12: dP^T = V_j dO_i^T ----
    zero(ds);
    gemm_abt<MTK, NQ, D, KUNROLL>(ds, sV, kw, sdO, 0);
    // ---- [fa2_bwd:ds] Alg.2 l.13: dS^T = P^T * (dP^T - D_i) ----
#pragma unroll
    for (int x = 0; x < MTK; ++x)
#pragma unroll
      for (int y = 0; y < NQ; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[x][y][e] = p[x][y][e] * (ds[x][y][e] - sDelta[8 * y + 2 * t + (e & 1)]);
    // ---- [fa2_bwd:dk] Alg.2 l.15: dK_j += dS^T Q_i (scale applied at the end) ----
    gemm_rb<MTK, DW / 8, NQ / 2>(dk_acc, ds, sQ, 0, dc);
    // ---- [fa2_bwd:dq] Alg.2 l.14: dQ_i += scale * dS K_j, through shared memory and float32 atomics ----
    if constexpr (ATOMIC_DQ) {
      if (w < WK) store_acc(sdS, ds, kw, 0);                              // column groups hold identical dS
      __syncthreads();  // all of dS^T is in shared memory
      const int qr = 16 * (w % QROWS), qc = DQW * (w / QROWS), g = lane_id() >> 2;
      float* dq_bh = dq_ws + bh * seqlen_q * head_dim;
#pragma unroll
      for (int c0 = qc; c0 < qc + DQW && w < QROWS * QCOLS; c0 += DQC) {
        float acc[1][DQC / 8][4];
        zero(acc);
        gemm_atb<1, DQC / 8, BC>(acc, sdS, qr, sK, c0);
#pragma unroll
        for (int y = 0; y < DQC / 8; ++y)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = q0 + qr + g + 8 * (e >> 1), col = c0 + 8 * y + 2 * t + (e & 1);
            if (row < seqlen_q && col < head_dim) atomicAdd(dq_bh + (long long)row * head_dim + col, scale * acc[0][y][e]);
          }
      }
    }
    __syncthreads();  // every warp is done with this stage and dS before they are refilled
  }
  // ---- [fa2_bwd:epilogue] Alg.2 l.17: write dK_j (times scale) and dV_j (zero when no query sees K_j) ----
  cp_async_wait<0>();
  float fk[2 * MTK], fv[2 * MTK];
#pragma unroll
  for (int r = 0; r < 2 * MTK; ++r) { fk[r] = scale; fv[r] = 1.f; }
  store_rows<T>(dk + b * dk_sb + hk * dk_sh, dk_ss, dk_acc, fk, k0 + kw, dc, seqlen_k, head_dim);
  store_rows<T>(dv + b * dv_sb + hk * dv_sh, dv_ss, dv_acc, fv, k0 + kw, dc, seqlen_k, head_dim);
}

// Deterministic dQ: one CTA per query block i (grid (Tr, heads, batch)), split-Q warps, no atomics.
template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, int KUNROLL, bool CAUSAL, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fa2_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,
           const float* __restrict__ lse2, const float* __restrict__ delta, T* __restrict__ dq, long long q_sb,
           long long q_ss, long long q_sh, long long k_sb, long long k_ss, long long k_sh, long long v_sb,
           long long v_ss, long long v_sh, long long do_sb, long long do_ss, long long do_sh, long long dq_sb,
           long long dq_ss, long long dq_sh, int seqlen_q, int seqlen_k, int heads, int kv_heads, int head_dim,
           float scale, float scale_log2) {
  using namespace rf;
  constexpr int NTHREADS = NWARPS * 32, MT = BR / (16 * NWARPS), NT = BC / 8;
  static_assert(Fa2BwdDqSmem<T, D, BR, BC>::BYTES == SMEM_BYTES, "rawflash/launch.py and the kernel disagree on shared memory");
  // ---- [fa2_bwd:dq_setup] query block i of head h; warp w owns rows wq.. ----
  extern __shared__ __align__(16) char smem[];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (heads / kv_heads);
  const long long bh = (long long)b * heads + h;
  const Tile<T, BC, D> sK{(T*)smem}, sV{(T*)(smem + BC * D * sizeof(T))};
  const Tile<T, BR, D> sQ{(T*)(smem + 2 * BC * D * sizeof(T))}, sdO{(T*)(smem + (2 * BC + BR) * D * sizeof(T))};
  float* sL = (float*)(smem + (2 * BC + 2 * BR) * D * sizeof(T));
  float* sDelta = sL + BR;
  const Mask mask{seqlen_q, seqlen_k, CAUSAL};
  const int q0 = i * BR, wq = 16 * MT * warp_id(), t = lane_id() & 3, g = lane_id() >> 2;
  load_query_block<NTHREADS>(sQ, sdO, sL, sDelta, q + b * q_sb + h * q_sh, q_ss, dout + b * do_sb + h * do_sh, do_ss,
                             lse2 + bh * seqlen_q, delta + bh * seqlen_q, q0, seqlen_q, head_dim);
  float acc[MT][D / 8][4];
  zero(acc);
  const int tc = mask.key_blocks(q0, min(BR, seqlen_q - q0), BC);
  for (int j = 0; j < tc; ++j) {
    const int k0 = j * BC, nk = min(BC, seqlen_k - k0);
    // ---- [fa2_bwd:dq_block] recompute P, dP and dS for K_j, V_j; dQ_i += dS K_j ----
    load_tile<NTHREADS>(sK, k + b * k_sb + hk * k_sh + k0 * k_ss, k_ss, nk, head_dim);
    load_tile<NTHREADS>(sV, v + b * v_sb + hk * v_sh + k0 * v_ss, v_ss, nk, head_dim);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // K_j, V_j (and Q_i, dO_i, L, D) are visible to every warp
    float p[MT][NT][4], ds[MT][NT][4];
    zero(p);
    gemm_abt<MT, NT, D, KUNROLL>(p, sQ, wq, sK, 0);
#pragma unroll
    for (int x = 0; x < MT; ++x)
#pragma unroll
      for (int y = 0; y < NT; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[x][y][e] *= scale_log2;
    if (mask.block_needs_mask(q0, BR, k0, BC)) apply_mask(p, mask, q0 + wq, k0);
    zero(ds);
    gemm_abt<MT, NT, D, KUNROLL>(ds, sdO, wq, sV, 0);
#pragma unroll
    for (int x = 0; x < MT; ++x)
#pragma unroll
      for (int y = 0; y < NT; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = wq + 16 * x + g + 8 * (e >> 1);
          const float pe = exp2_<T>(p[x][y][e] - sL[r]);
          ds[x][y][e] = pe * (ds[x][y][e] - sDelta[r]);
        }
    gemm_rb<MT, D / 8, NT / 2>(acc, ds, sK, 0, 0);
    __syncthreads();  // every warp is done with K_j, V_j before the next block overwrites them
  }
  // ---- [fa2_bwd:dq_epilogue] dQ_i = scale * acc ----
  float f[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) f[r] = scale;
  cp_async_wait<0>();
  store_rows<T>(dq + b * dq_sb + h * dq_sh, dq_ss, acc, f, q0 + wq, 0, seqlen_q, head_dim);
}

// dQ = dq_ws (float32, (batch, heads, seqlen_q, head_dim), already scaled) in the input dtype.
template <typename T>
__global__ void fa2_bwd_convert_dq(const float* __restrict__ dq_ws, T* __restrict__ dq, long long dq_sb,
                                   long long dq_ss, long long dq_sh, int batch, int seqlen_q, int heads, int head_dim) {
  using namespace rf;
  // ---- [fa2_bwd:convert] 8 columns per thread and step (head_dim is a multiple of 8: cupy_backend pads it) ----
  const int c8 = head_dim / 8;
  const long long n = (long long)batch * heads * seqlen_q * c8;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < n; x += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(x % c8) * 8;
    const long long row = x / c8;
    const int i = row % seqlen_q, h = (row / seqlen_q) % heads, b = row / ((long long)seqlen_q * heads);
    float v[8];
    load8(v, dq_ws + row * head_dim + c);
    store8(dq + b * dq_sb + i * dq_ss + h * dq_sh + c, v);
  }
}
