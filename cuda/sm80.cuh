// rawflash tile verbs for mma.sync (sm_80 and later): swizzled shared-memory tiles, cp.async copies, ldmatrix
// fragment loads, the m16n8k16 product and warp-level products on register tiles (acc.cuh).
//
// Fragment conventions are those of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16").
// A lane is 4*g + t (g = lane / 4 in 0..7, t = lane % 4 in 0..3).
//   C tile (16 x 8, float[4]):   element e sits at row g + 8*(e/2), col 2t + e%2.
//   A tile (16 x 16, 8 values):  element e sits at row g + 8*((e/2)%2), col 2t + e%2 + 8*(e/4).
//   B tile (16 x 8,  4 values):  element e sits at k = 2t + e%2 + 8*(e/2), n = g.
// float16 / bfloat16 keep A and B packed two per register and use tensor cores. float32 has its own overloads
// of the three warp-level products with scalar FMAs that produce the same C layout, so every kernel body is
// written once for all three dtypes.
#pragma once
#include "acc.cuh"

namespace rf {

template <typename T> struct Frag {                  // float16 / bfloat16: two values per 32-bit register
  struct A { u32 r[4]; };
  struct B { u32 r[2]; };
};

// ---------------------------------------------------------------- shared-memory tiles
// A ROWS x COLS row-major tile stored in 16-byte chunks whose index is XOR-swizzled by row, so that the
// 8 row addresses of one ldmatrix (or one 16-byte cp.async per lane) hit 8 different bank groups.
// A row of C chunks is swizzled in groups of 8 chunks (c ^ row%8); a trailing group of 4 chunks
// (head_dim 32 or 96 in 16-bit) uses c ^ (row/2)%4, which is conflict-free for 64-byte row halves.
template <typename T, int ROWS, int COLS> struct Tile {
  static constexpr int CHUNK = 16 / (int)sizeof(T);  // elements per 16-byte chunk
  static constexpr int C = COLS / CHUNK;             // chunks per row
  static constexpr int FULL = (C / 8) * 8;           // chunks in whole groups of 8
  static constexpr int BYTES = ROWS * COLS * (int)sizeof(T);
  static_assert(COLS % CHUNK == 0, "tile rows are whole 16-byte chunks");
  static_assert(C % 8 == 0 || C % 8 == 4, "rows of 4, 8k or 8k+4 chunks");
  T* p;
  __device__ __forceinline__ static int swizzle(int row, int c) {
    return c < FULL ? (c ^ (row & 7)) : (c ^ ((row >> 1) & 3));
  }
  __device__ __forceinline__ int offset(int row, int col) const {  // element offset of (row, col)
    return row * COLS + swizzle(row, col / CHUNK) * CHUNK + col % CHUNK;
  }
  __device__ __forceinline__ T* at(int row, int col) const { return p + offset(row, col); }
  __device__ __forceinline__ u32 saddr(int row, int col) const {
    return (u32)__cvta_generic_to_shared(at(row, col));
  }
};

// ---------------------------------------------------------------- global -> shared copies (cp.async)
__device__ __forceinline__ void cp_async16(u32 saddr, const void* gptr, bool valid) {
  // src-size 0 writes 16 zero bytes: rows past the sequence end and columns past head_dim read as 0
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gptr), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 saddr, const void* gptr, bool valid) {  // one float; 0 when !valid
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(saddr), "l"(gptr), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copy rows [0, ROWS) of a tile whose row r starts at g + r*row_stride; rows >= rows_valid and
// columns >= cols_valid are zero-filled. All NTHREADS threads of the CTA take part.
template <int NTHREADS, typename T, int ROWS, int COLS>
__device__ __forceinline__ void load_tile(Tile<T, ROWS, COLS> s, const T* g, long long row_stride,
                                          int rows_valid, int cols_valid) {
  using TL = Tile<T, ROWS, COLS>;
#pragma unroll
  for (int idx = threadIdx.x; idx < ROWS * TL::C; idx += NTHREADS) {
    const int row = idx / TL::C, col = (idx % TL::C) * TL::CHUNK;
    const bool valid = row < rows_valid && col < cols_valid;
    const T* src = valid ? g + row * row_stride + col : g;
    cp_async16(s.saddr(row, col), src, valid);
  }
}

// The same with each row's first element from row_ptr(row) (a paged forward's keys: BlockInfo::paged_key, a page
// table read each), located chunk by chunk (the mma.sync forms' registers leave no room to hold a thread's rows);
// base: any address inside the tensor (the source of zero-filled chunks).
template <int NTHREADS, typename T, int ROWS, int COLS, class RowPtr>
__device__ __forceinline__ void load_tile_rows(Tile<T, ROWS, COLS> s, RowPtr row_ptr, const T* base, int rows_valid,
                                               int cols_valid) {
  using TL = Tile<T, ROWS, COLS>;
  for (int idx = threadIdx.x; idx < ROWS * TL::C; idx += NTHREADS) {
    const int row = idx / TL::C, col = (idx % TL::C) * TL::CHUNK;
    const bool valid = row < rows_valid && col < cols_valid;
    cp_async16(s.saddr(row, col), valid ? row_ptr(row) + col : base, valid);
  }
}

// ---------------------------------------------------------------- fragment loads from shared memory
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// A (16 x 16) at rows m0.., cols k0.. of a tile stored [m][k].
template <typename T, int R, int C>
__device__ __forceinline__ void load_a(typename Frag<T>::A& a, const Tile<T, R, C>& s, int m0, int k0) {
  const int l = lane_id(), q = l >> 3;               // lane l addresses row l%8 of 8x8 matrix q
  ldmatrix_x4(a.r, s.saddr(m0 + (l & 7) + 8 * (q & 1), k0 + 8 * (q >> 1)));
}
// A (16 x 16) with A[m][k] read from a tile stored transposed, [k][m] (rows k0.., cols m0..).
template <typename T, int R, int C>
__device__ __forceinline__ void load_a_trans(typename Frag<T>::A& a, const Tile<T, R, C>& s, int m0, int k0) {
  const int l = lane_id(), q = l >> 3;
  ldmatrix_x4_trans(a.r, s.saddr(k0 + (l & 7) + 8 * (q >> 1), m0 + 8 * (q & 1)));
}
// Two B tiles (k16 x n8 each, n0.. and n0+8..) from a tile stored [n][k] (K for S = Q K^T).
template <typename T, int R, int C>
__device__ __forceinline__ void load_b2_nk(typename Frag<T>::B& b0, typename Frag<T>::B& b1,
                                           const Tile<T, R, C>& s, int n0, int k0) {
  const int l = lane_id(), q = l >> 3;
  u32 r[4];
  ldmatrix_x4(r, s.saddr(n0 + (l & 7) + 8 * (q >> 1), k0 + 8 * (q & 1)));
  b0.r[0] = r[0]; b0.r[1] = r[1]; b1.r[0] = r[2]; b1.r[1] = r[3];
}
// Two B tiles from a tile stored [k][n] (V for O = P V): ldmatrix.trans.
template <typename T, int R, int C>
__device__ __forceinline__ void load_b2_kn(typename Frag<T>::B& b0, typename Frag<T>::B& b1,
                                           const Tile<T, R, C>& s, int k0, int n0) {
  const int l = lane_id(), q = l >> 3;
  u32 r[4];
  ldmatrix_x4_trans(r, s.saddr(k0 + (l & 7) + 8 * (q & 1), n0 + 8 * (q >> 1)));
  b0.r[0] = r[0]; b0.r[1] = r[1]; b1.r[0] = r[2]; b1.r[1] = r[3];
}

// ---------------------------------------------------------------- e4m3 tiles (FP8 caches) as float16 fragments
// Products over an e4m3 tile run in float16 (every e4m3 value is a float16 exactly, one cvt per pair). ldmatrix
// moves b16 units, i.e. byte pairs, so each loader below hands out its fragments in a permuted order that the
// other operand follows.
// Four e4m3 values (the low byte first) as the two registers of a float16 B fragment: bytes 0, 1 to r[0], 2, 3
// to r[1].
__device__ __forceinline__ void e4m3x4_to_b(Frag<__half>::B& b, u32 four) {
  b.r[0] = e4m3x2_to_f16x2(four & 0xffff);
  b.r[1] = e4m3x2_to_f16x2(four >> 16);
}
// K8 stored [n][k] (S = Q K^T): lane (g, t) receives bytes 4t .. 4t + 3 of row g of each 8 x 16-byte matrix,
// which are B's k slots 2t, 2t + 1, 2t + 8, 2t + 9: the A operand must hold its columns 4t .. 4t + 3 of each
// 16-column step in those slots (permute_k16). b[0], b[1]: n-tiles n0.., n0 + 8.. of k-step k0; b[2], b[3]: the
// same of k-step k0 + 16.
template <int R, int C>
__device__ __forceinline__ void load_b4_nk_e4m3(Frag<__half>::B (&b)[4], const Tile<e4m3, R, C>& s, int n0, int k0) {
  const int l = lane_id(), q = l >> 3;
  u32 r[4];
  ldmatrix_x4(r, s.saddr(n0 + (l & 7) + 8 * (q & 1), k0 + 16 * (q >> 1)));
#pragma unroll
  for (int i = 0; i < 4; ++i) e4m3x4_to_b(b[i], r[i]);
}
// The A-operand order load_b4_nk_e4m3 asks for, as a permutation of the eight 4-byte words (column pairs) of a
// 16-column float16 step: slot word t holds column pair 2t, slot word t + 4 column pair 2t + 1 (t < 4).
__device__ __forceinline__ void permute_k16(u32 (&w)[8]) {
  const u32 x[8] = {w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]};
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    w[t] = x[2 * t];
    w[t + 4] = x[2 * t + 1];
  }
}
// V8 stored [k][n] (O = P V): ldmatrix.trans of an 8-key x 16-byte matrix hands lane (g, t) the bytes of keys
// 2t, 2t + 1 at columns 2g, 2g + 1; byte permutes make B fragments of two n-tiles, the even columns n0 + 2g
// (b[0]) and the odd ones n0 + 2g + 1 (b[1]) of keys k0 .. k0 + 15, and b[2], b[3] the same of columns n0 + 16...
// So accumulator tile 2m + h holds columns 16m + 2c + h at its column c: o_col_e4m3 gives a column's place.
template <int R, int C>
__device__ __forceinline__ void load_b4_kn_e4m3(Frag<__half>::B (&b)[4], const Tile<e4m3, R, C>& s, int k0, int n0) {
  const int l = lane_id(), q = l >> 3;
  u32 r[4];
  ldmatrix_x4_trans(r, s.saddr(k0 + (l & 7) + 8 * (q & 1), n0 + 16 * (q >> 1)));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const u32 even = __byte_perm(r[2 * h], r[2 * h + 1], 0x6420), odd = __byte_perm(r[2 * h], r[2 * h + 1], 0x7531);
    e4m3x4_to_b(b[2 * h], even);
    e4m3x4_to_b(b[2 * h + 1], odd);
  }
}
// The column of the output that accumulator column col (8 j + 2 t + e, for_each's numbering) holds after
// products with load_b4_kn_e4m3's fragments.
__device__ __forceinline__ int o_col_e4m3(int col) {
  const int j = col / 8, c = col % 8;
  return 16 * (j / 2) + 2 * c + (j & 1);
}

// ---------------------------------------------------------------- mma: C(16x8) += A(16x16) B(16x8)
__device__ __forceinline__ void mma(float (&c)[4], const Frag<__half>::A& a, const Frag<__half>::B& b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
__device__ __forceinline__ void mma(float (&c)[4], const Frag<__nv_bfloat16>::A& a,
                                    const Frag<__nv_bfloat16>::B& b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}
// ---------------------------------------------------------------- warp-level products
// The k loop of every 16-bit product: acc += A B over k in [0, K) in steps of 16, KU steps unrolled together.
// load_a(a, i, kk) fetches A's m-tile i of k-step kk, load_b(b0, b1, j, kk) B's n-tiles j and j + 1.
template <int MT, int NT, int K, int KU, typename T, class LA, class LB>
__device__ __forceinline__ void mma_k_loop(Acc<MT, NT>& acc, LA load_a_, LB load_b_) {
  static_assert(NT % 2 == 0 && K % 16 == 0, "B tiles are loaded in pairs; k in steps of 16");
#pragma unroll KU
  for (int kk = 0; kk < K; kk += 16) {
    typename Frag<T>::A a[MT];
#pragma unroll
    for (int i = 0; i < MT; ++i) load_a_(a[i], i, kk);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      typename Frag<T>::B b[2];
      load_b_(b[0], b[1], j, kk);
#pragma unroll
      for (int i = 0; i < MT; ++i) { mma(acc.v[i][j], a[i], b[0]); mma(acc.v[i][j + 1], a[i], b[1]); }
    }
  }
}

// acc += A B^T with A = rows a0.. of sa ([m][k]) and B^T = rows b0.. of sb ([n][k]), over k in [0, K).
// KU k-steps of 16 are unrolled together (the tile table's kunroll): more loads in flight, more registers.
template <int MT, int NT, int K, int KU, typename T, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void gemm_abt(Acc<MT, NT>& acc, const Tile<T, RA, CA>& sa, int a0,
                                         const Tile<T, RB, CB>& sb, int b0) {
  mma_k_loop<MT, NT, K, KU, T>(
      acc, [&](typename Frag<T>::A& a, int i, int kk) { load_a(a, sa, a0 + 16 * i, kk); },
      [&](typename Frag<T>::B& x, typename Frag<T>::B& y, int j, int kk) { load_b2_nk(x, y, sb, b0 + 8 * j, kk); });
}

// Convert k-chunk kk (columns 16kk..16kk+15) of a C-layout accumulator into an A fragment (P stays in registers).
template <typename T, int MT, int NT>
__device__ __forceinline__ void acc_to_a(typename Frag<T>::A& a, const Acc<MT, NT>& acc, int i, int kk) {
  a.r[0] = pack2<T>(acc.v[i][2 * kk][0], acc.v[i][2 * kk][1]);
  a.r[1] = pack2<T>(acc.v[i][2 * kk][2], acc.v[i][2 * kk][3]);
  a.r[2] = pack2<T>(acc.v[i][2 * kk + 1][0], acc.v[i][2 * kk + 1][1]);
  a.r[3] = pack2<T>(acc.v[i][2 * kk + 1][2], acc.v[i][2 * kk + 1][3]);
}

// acc += P B where P (16*MT x 16*KT) is a register accumulator and B = rows b_k0.. of sb stored [k][n],
// columns n0.. (NT n8 tiles).
template <int MT, int NT, int KT, typename T, int R, int C>
__device__ __forceinline__ void gemm_rb(Acc<MT, NT>& acc, const Acc<MT, 2 * KT>& p,
                                        const Tile<T, R, C>& sb, int b_k0, int n0) {
  mma_k_loop<MT, NT, 16 * KT, KT, T>(
      acc, [&](typename Frag<T>::A& a, int i, int kk) { acc_to_a<T>(a, p, i, kk / 16); },
      [&](typename Frag<T>::B& x, typename Frag<T>::B& y, int j, int kk) {
        load_b2_kn(x, y, sb, b_k0 + kk, n0 + 8 * j);
      });
}

// acc += A B where A[m][k] is read from sa stored [k][m] (columns m0..) and B from sb stored [k][n]
// (columns n0..), over k in [0, K). Used for dQ = dS K with dS kept as dS^T in shared memory.
template <int MT, int NT, int K, typename T, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void gemm_atb(Acc<MT, NT>& acc, const Tile<T, RA, CA>& sa, int m0,
                                         const Tile<T, RB, CB>& sb, int n0) {
  mma_k_loop<MT, NT, K, K / 16, T>(
      acc, [&](typename Frag<T>::A& a, int i, int kk) { load_a_trans(a, sa, m0 + 16 * i, kk); },
      [&](typename Frag<T>::B& x, typename Frag<T>::B& y, int j, int kk) { load_b2_kn(x, y, sb, kk, n0 + 8 * j); });
}

// ---------------------------------------------------------------- float32 products (scalar FMA, same C layout)
// Lane (g, t) computes rows g, g+8 of each m-tile and columns 2t, 2t+1 of each n-tile. Sums run in blocks of 16
// terms that are then added to the accumulator (two-level summation): the rounding error grows like
// 16 + K/16 terms instead of K, comparable to the blocked sums of a float32 BLAS.
template <int MT, int NT>
__device__ __forceinline__ void fma_tile(Acc<MT, NT>& acc, const float (&a)[2 * MT], const float (&b)[2 * NT]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.v[i][j][e] = fmaf(a[2 * i + (e >> 1)], b[2 * j + (e & 1)], acc.v[i][j][e]);
}
// acc columns j0 + j += part columns j
template <int MT, int NT, int NP>
__device__ __forceinline__ void add_block(Acc<MT, NT>& acc, const Acc<MT, NP>& part, int j0) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NP; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.v[i][j0 + j][e] += part.v[i][j][e];
}
// A from sa at [row][k] (TRANS_A: at [k][row]), B from sb at [col][k] (TRANS_B: at [k][col]). The k loop is
// not unrolled: a step's 2 MT + 2 NT shared loads feed 4 MT NT FMAs, and the warps of a CTA hide the loads'
// latency between them. Unrolled 4 steps, NVRTC takes about 4x as long to compile every float32 instantiation
// for 0 - 14 % more float32 speed (the figures are in bench/NOTES.md).
template <int MT, int NT, int K, bool TRANS_A, bool TRANS_B, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void fma_gemm(Acc<MT, NT>& acc, const Tile<float, RA, CA>& sa, int a0,
                                         const Tile<float, RB, CB>& sb, int b0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll 1
  for (int kb = 0; kb < K; kb += 16) {
    Acc<MT, NT> part;
    zero(part);
#pragma unroll 1
    for (int k = kb; k < kb + 16; ++k) {
      float a[2 * MT], b[2 * NT];
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) {
        const int row = a0 + 16 * (r >> 1) + g + 8 * (r & 1);
        a[r] = TRANS_A ? *sa.at(k, row) : *sa.at(row, k);
      }
#pragma unroll
      for (int c = 0; c < 2 * NT; ++c) {
        const int col = b0 + 8 * (c >> 1) + 2 * t + (c & 1);
        b[c] = TRANS_B ? *sb.at(k, col) : *sb.at(col, k);
      }
      fma_tile(part, a, b);
    }
    add_block(acc, part, 0);
  }
}
template <int MT, int NT, int K, int KU, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void gemm_abt(Acc<MT, NT>& acc, const Tile<float, RA, CA>& sa, int a0,
                                         const Tile<float, RB, CB>& sb, int b0) {
  fma_gemm<MT, NT, K, false, false>(acc, sa, a0, sb, b0);
}
template <int MT, int NT, int K, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void gemm_atb(Acc<MT, NT>& acc, const Tile<float, RA, CA>& sa, int m0,
                                         const Tile<float, RB, CB>& sb, int n0) {
  fma_gemm<MT, NT, K, true, true>(acc, sa, m0, sb, n0);
}
// P from registers: column k of P lives in lane (g, k%8/2) of the quad, so each step shuffles it across the quad.
// Columns of B go in groups of 4 n-tiles, each summed over all of P's columns before it is added to acc.
template <int MT, int NT, int KT, int R, int C>
__device__ __forceinline__ void gemm_rb(Acc<MT, NT>& acc, const Acc<MT, 2 * KT>& p,
                                        const Tile<float, R, C>& sb, int b_k0, int n0) {
  constexpr int CG = NT % 4 == 0 ? 4 : 2;  // n-tiles summed together
  static_assert(NT % CG == 0, "whole groups of n-tiles");
  const int l = lane_id(), t = l & 3;
#pragma unroll
  for (int j0 = 0; j0 < NT; j0 += CG) {
    Acc<MT, CG> part;
    zero(part);
#pragma unroll
    for (int kk = 0; kk < 2 * KT; ++kk)              // n-tile kk of P holds columns 8kk..8kk+7
#pragma unroll 1
      for (int k8 = 0; k8 < 8; ++k8) {
        const int src = (l & ~3) | (k8 >> 1);        // the lane of this quad that holds column 8kk + k8 of P
        const bool odd = k8 & 1;
        float a[2 * MT], b[2 * CG];
#pragma unroll
        for (int r = 0; r < 2 * MT; ++r) {
          const float (&pe)[4] = p.v[r >> 1][kk];
          a[r] = __shfl_sync(0xffffffffu, odd ? pe[2 * (r & 1) + 1] : pe[2 * (r & 1)], src);
        }
#pragma unroll
        for (int c = 0; c < 2 * CG; ++c) b[c] = *sb.at(b_k0 + 8 * kk + k8, n0 + 8 * (j0 + (c >> 1)) + 2 * t + (c & 1));
        fma_tile(part, a, b);
      }
    add_block(acc, part, j0);
  }
}

// ---------------------------------------------------------------- register tile -> shared memory
// Write a C-layout accumulator into a shared tile at rows r0.., cols c0.. (dS^T for the dQ product).
template <typename T, int MT, int NT, int R, int C>
__device__ __forceinline__ void store_acc(const Tile<T, R, C>& s, const Acc<MT, NT>& acc, int r0, int c0) {
  for_each_index<MT, NT>([&](int i, int j, int e, int row, int col) {
    if (e & 1) return;  // one store per column pair
    T* dst = s.at(r0 + row, c0 + col);
    if constexpr (sizeof(T) == 2) {
      *reinterpret_cast<u32*>(dst) = pack2<T>(acc.v[i][j][e], acc.v[i][j][e + 1]);
    } else {
      *reinterpret_cast<float2*>(dst) = make_float2(acc.v[i][j][e], acc.v[i][j][e + 1]);
    }
  });
}

}  // namespace rf
