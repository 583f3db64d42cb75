// fa2_fwd: FlashAttention-2 forward (Dao 2023, Algorithm 1).
// Grid (Tr, heads, batch): one CTA per query block Q_i ("sequence parallelism"); Q_i stays in shared memory;
// each warp owns 16*MT whole rows ("split-Q"), so softmax needs no inter-warp exchange; O is divided by l
// once at the end ("deferred normalisation"). Each idea is a template switch so it can be turned off alone:
// SEQ_PARALLEL=false loops over all query blocks in one CTA per (batch, head), SPLIT_Q=false uses FA1's
// split-K warp partition (splitk.cuh), DEFER_NORM=false rescales O by 1/l after every key block.
// Scores are kept in log2 units (scale_log2 = scale * log2(e)) so every exponential is one exp2.
#include "common.cuh"
#include "splitk.cuh"

namespace rf {

// Shared memory of one CTA in bytes; rawflash/launch.py computes the same number (checked at compile time).
template <typename T, int D, int BR, int BC, int NWARPS, bool SPLIT_Q> struct Fa2FwdSmem {
  static constexpr int TILES = (BR + 2 * BC) * D * (int)sizeof(T);       // Q_i, K_j, V_j
  static constexpr int STATE = SPLIT_Q ? 0 : SplitK<BR, D, NWARPS>::BYTES + (BR * D + 2 * BR) * 4;  // + O, m, l
  static constexpr int BYTES = TILES + STATE;
};

struct FwdArgs {  // everything a block step needs besides the tiles; pointers are already at (batch, head)
  const void *q, *k, *v;
  void* o;
  float* lse;
  long long q_ss, k_ss, v_ss, o_ss;
  Mask mask;
  int head_dim;
  float scale_log2;
};

// One query block with the split-Q partition: warp w owns rows [q0 + 16*MT*w, q0 + 16*MT*(w+1)).
template <typename T, int D, int BR, int BC, int NWARPS, int KUNROLL, bool DEFER_NORM>
__device__ __forceinline__ void fa2_block_split_q(const Tile<T, BR, D>& sQ, const Tile<T, BC, D>& sK,
                                                  const Tile<T, BC, D>& sV, const FwdArgs& a, int i) {
  constexpr int NTHREADS = NWARPS * 32, MT = BR / (16 * NWARPS), NT = BC / 8, NO = D / 8;
  const T *q = (const T*)a.q, *k = (const T*)a.k, *v = (const T*)a.v;
  const Mask& mask = a.mask;
  const int q0 = i * BR, wq = 16 * MT * warp_id(), nrows = min(BR, mask.seqlen_q - q0);
  // ---- [fa2_fwd:load_q] Alg.1 l.4: Q_i to shared memory, where it stays; K_0 behind it ----
  const int tc = mask.key_blocks(q0, nrows, BC);                            // key blocks past the diagonal: never loaded
  load_tile<NTHREADS>(sQ, q + q0 * a.q_ss, a.q_ss, nrows, a.head_dim);
  if (tc > 0) load_tile<NTHREADS>(sK, k, a.k_ss, min(BC, mask.seqlen_k), a.head_dim);
  cp_async_commit();
  // ---- [fa2_fwd:init] Alg.1 l.5: O = 0, l = 0, m = -inf ----
  float o[MT][NO][4], m[2 * MT], l[2 * MT];
  zero(o);
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
  for (int j = 0; j < tc; ++j) {
    const int k0 = j * BC;
    // ---- [fa2_fwd:load_kv] Alg.1 l.7: V_j streams in while S = Q_i K_j^T is computed ----
    cp_async_wait<0>();
    __syncthreads();  // K_j (and Q_i) have landed; every warp is done reading V_{j-1}
    load_tile<NTHREADS>(sV, v + k0 * a.v_ss, a.v_ss, min(BC, mask.seqlen_k - k0), a.head_dim);
    cp_async_commit();
    // ---- [fa2_fwd:scores] Alg.1 l.8: S_ij = Q_i K_j^T, scaled into log2 units ----
    float s[MT][NT][4];
    zero(s);
    gemm_abt<MT, NT, D, KUNROLL>(s, sQ, wq, sK, 0);
#pragma unroll
    for (int x = 0; x < MT; ++x)
#pragma unroll
      for (int y = 0; y < NT; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[x][y][e] *= a.scale_log2;
    // ---- [fa2_fwd:mask] only blocks on the diagonal or the ragged edge pay for a mask ----
    if (mask.block_needs_mask(q0, BR, k0, BC)) apply_mask(s, mask, q0 + wq, k0);
    // ---- [fa2_fwd:softmax] Alg.1 l.9: m_new = max(m, rowmax S), P = exp2(S - m_new), l = e^(m-m_new) l + rowsum P ----
    float mx[2 * MT], rs[2 * MT], fo[2 * MT];
    row_max(mx, s);
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      const float m_new = fmaxf(m[r], mx[r]);
      mx[r] = m_new == -INFINITY ? 0.f : m_new;                             // a row with nothing visible yet keeps P = 0
      fo[r] = exp2_<T>(m[r] - mx[r]);
      m[r] = m_new;
    }
#pragma unroll
    for (int x = 0; x < MT; ++x)
#pragma unroll
      for (int y = 0; y < NT; ++y)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[x][y][e] = exp2_<T>(s[x][y][e] - mx[2 * x + (e >> 1)]);
    row_sum(rs, s);
#pragma unroll
    for (int r = 0; r < 2 * MT; ++r) {
      const float l_old = l[r];
      l[r] = fo[r] * l_old + rs[r];
      if (!DEFER_NORM) {                                                    // keep O normalised (FA1 Alg.1 l.12):
        mx[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;                              // O = diag(l_old e^(m-m_new) / l_new) O
        fo[r] *= l_old * mx[r];                                             //     + diag(1 / l_new) P V
      }
    }
    if (!DEFER_NORM) scale_rows(s, mx);
    scale_rows(o, fo);                                                      // Alg.1 l.10: diag(e^(m_old - m_new)) O
    // ---- [fa2_fwd:wait_v] K_{j+1} streams in while O += P V_j is computed ----
    cp_async_wait<0>();
    __syncthreads();  // V_j has landed; every warp is done reading K_j
    if (j + 1 < tc)
      load_tile<NTHREADS>(sK, k + (k0 + BC) * a.k_ss, a.k_ss, min(BC, mask.seqlen_k - k0 - BC), a.head_dim);
    cp_async_commit();
    // ---- [fa2_fwd:pv] Alg.1 l.10: O += P V_j with P as the A operand straight from registers ----
    gemm_rb<MT, NO, NT / 2>(o, s, sV, 0, 0);
  }
  // ---- [fa2_fwd:epilogue] Alg.1 l.12-13: O_i = diag(l)^-1 O_i, L_i = m_i + log(l_i); hidden rows get 0 and -inf ----
  float f[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) f[r] = l[r] > 0.f ? (DEFER_NORM ? 1.f / l[r] : 1.f) : 0.f;
  store_rows<T>((T*)a.o, a.o_ss, o, f, q0 + wq, 0, mask.seqlen_q, a.head_dim);
  const int g = lane_id() >> 2;
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    const int row = q0 + wq + 16 * (r / 2) + g + 8 * (r % 2);
    if ((lane_id() & 3) == 0 && row < mask.seqlen_q) a.lse[row] = l[r] > 0.f ? m[r] * LN2 + logf(l[r]) : -INFINITY;
  }
  cp_async_wait<0>();
  __syncthreads();  // with SEQ_PARALLEL off the next query block overwrites sQ, sK and sV
}

// One query block with FA1's split-K partition (the ablation of split-Q): the running O, m, l live in shared memory.
template <typename T, int D, int BR, int BC, int NWARPS, bool DEFER_NORM>
__device__ __forceinline__ void fa2_block_split_k(const Tile<T, BR, D>& sQ, const Tile<T, BC, D>& sK,
                                                  const Tile<T, BC, D>& sV, char* state, const FwdArgs& a, int i) {
  constexpr int NTHREADS = NWARPS * 32;
  const T *q = (const T*)a.q, *k = (const T*)a.k, *v = (const T*)a.v;
  const Mask& mask = a.mask;
  const SplitK<BR, D, NWARPS> sk(state);
  float *sO = (float*)(state + SplitK<BR, D, NWARPS>::BYTES), *sM = sO + BR * D, *sL = sM + BR;
  const int q0 = i * BR, nrows = min(BR, mask.seqlen_q - q0), tc = mask.key_blocks(q0, nrows, BC);
  // ---- [fa2_fwd:splitk_init] O = 0, m = -inf, l = 0 in shared memory ----
  for (int x = threadIdx.x; x < BR * D; x += NTHREADS) { sO[x] = 0.f; sk.acc[x] = 0.f; }
  for (int r = threadIdx.x; r < BR; r += NTHREADS) { sM[r] = -INFINITY; sL[r] = 0.f; }
  load_tile<NTHREADS>(sQ, q + q0 * a.q_ss, a.q_ss, nrows, a.head_dim);
  for (int j = 0; j < tc; ++j) {
    const int k0 = j * BC;
    // ---- [fa2_fwd:splitk_step] every warp takes BC/NWARPS keys; rows are merged through shared memory ----
    load_tile<NTHREADS>(sK, k + k0 * a.k_ss, a.k_ss, min(BC, mask.seqlen_k - k0), a.head_dim);
    load_tile<NTHREADS>(sV, v + k0 * a.v_ss, a.v_ss, min(BC, mask.seqlen_k - k0), a.head_dim);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // Q_i, K_j, V_j and the zeroed state are visible to every warp
    splitk_block<BR, BC, D, NWARPS>(sk, sQ, sK, sV, mask, q0, k0, a.scale_log2);
    splitk_merge<T, !DEFER_NORM, BR, D, NTHREADS>(sk, sM, sL, sO, D, BR, D);
  }
  // ---- [fa2_fwd:splitk_epilogue] O_i = diag(l)^-1 O_i (or as kept), L_i = m_i + log(l_i) ----
  cp_async_wait<0>();
  __syncthreads();  // the state is final (also when no key block was visible)
  T* o = (T*)a.o;
  for (int x = threadIdx.x; x < nrows * a.head_dim; x += NTHREADS) {
    const int r = x / a.head_dim, c = x % a.head_dim;
    const float f = sL[r] > 0.f ? (DEFER_NORM ? 1.f / sL[r] : 1.f) : 0.f;
    o[(q0 + r) * a.o_ss + c] = from_float<T>(sO[r * D + c] * f);
  }
  for (int r = threadIdx.x; r < nrows; r += NTHREADS)
    a.lse[q0 + r] = sL[r] > 0.f ? sM[r] * LN2 + logf(sL[r]) : -INFINITY;
  __syncthreads();  // every thread is done with the state before the next query block resets it
}

}  // namespace rf

template <typename T, int D, int BR, int BC, int NWARPS, int MIN_BLOCKS, int KUNROLL, bool CAUSAL, bool DEFER_NORM,
          bool SEQ_PARALLEL, bool SPLIT_Q, int SMEM_BYTES>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fa2_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
        float* __restrict__ lse, long long q_sb, long long q_ss, long long q_sh, long long k_sb, long long k_ss,
        long long k_sh, long long v_sb, long long v_ss, long long v_sh, long long o_sb, long long o_ss,
        long long o_sh, int seqlen_q, int seqlen_k, int heads, int kv_heads, int head_dim, float scale_log2) {
  using namespace rf;
  static_assert(Fa2FwdSmem<T, D, BR, BC, NWARPS, SPLIT_Q>::BYTES == SMEM_BYTES,
                "rawflash/launch.py and the kernel disagree on shared memory");
  static_assert(!SPLIT_Q || BR % (16 * NWARPS) == 0, "split-Q: every warp owns whole 16-row tiles");
  // ---- [fa2_fwd:setup] (batch, head) from the grid; query head h reads kv head h / (heads / kv_heads) ----
  extern __shared__ __align__(16) char smem[];
  const int b = blockIdx.z, h = blockIdx.y, hk = h / (heads / kv_heads);
  const Tile<T, BR, D> sQ{(T*)smem};
  const Tile<T, BC, D> sK{(T*)(smem + BR * D * sizeof(T))}, sV{(T*)(smem + (BR + BC) * D * sizeof(T))};
  char* state = smem + Fa2FwdSmem<T, D, BR, BC, NWARPS, true>::BYTES;
  const FwdArgs a{q + b * q_sb + h * q_sh, k + b * k_sb + hk * k_sh, v + b * v_sb + hk * v_sh,
                  o + b * o_sb + h * o_sh, lse + ((long long)b * heads + h) * seqlen_q,
                  q_ss, k_ss, v_ss, o_ss, Mask{seqlen_q, seqlen_k, CAUSAL}, head_dim, scale_log2};
  // ---- [fa2_fwd:schedule] sequence parallelism: this CTA's query block, or all of them in turn ----
  const int tr = (seqlen_q + BR - 1) / BR;
  const int i_first = SEQ_PARALLEL ? tr - 1 - (int)blockIdx.x : 0;          // longest causal rows start first
  const int i_end = SEQ_PARALLEL ? i_first + 1 : tr;
  for (int i = i_first; i < i_end; ++i) {
    if constexpr (SPLIT_Q) fa2_block_split_q<T, D, BR, BC, NWARPS, KUNROLL, DEFER_NORM>(sQ, sK, sV, a, i);
    else fa2_block_split_k<T, D, BR, BC, NWARPS, DEFER_NORM>(sQ, sK, sV, state, a, i);
  }
}
