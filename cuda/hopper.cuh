// rawflash Hopper tile verbs (sm_90a): warpgroup matrix products (wgmma) that read shared memory through
// 64-bit matrix descriptors (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout").
//
// A warpgroup is 4 consecutive warps (128 threads) starting at a warp index divisible by 4. One wgmma computes a
// 64 x N tile: warp w of the group owns rows 16w..16w+15 in mma.sync's C layout (wgmma_ops.cuh), so its
// accumulator is an Acc<1, N/8> and every verb of acc.cuh (row_max, row_sum, scale_rows, store_rows) works on it.
//
// Shared-memory layout of a 16-bit tile (Sw128): the columns are cut into panels of 64 (128 bytes); a panel is
// ROWS rows of 128 bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8). This is the "128-byte swizzle"
// canonical layout of wgmma, both K-major (rows are M or N, columns are K) and MN-major (rows are K, columns
// are N): the same bytes can be read either way, which is how V feeds O += P V without a transpose.
#pragma once
#include "sm80.cuh"
#include "wgmma_ops.cuh"

namespace rf {


__device__ __forceinline__ int warpgroup_id() { return threadIdx.x >> 7; }
// The same index through a shuffle from lane 0: the compiler then knows it is warp-uniform and keeps what is built
// from it (the wgmma descriptors' row offsets) in uniform registers, instead of moving each descriptor from a
// vector register (R2UR) in the key loop. Only where the whole warp is converged (it is a full-mask shuffle).
__device__ __forceinline__ int uniform_warpgroup_id() { return __shfl_sync(0xffffffffu, warpgroup_id(), 0); }
__device__ __forceinline__ int warp_in_group() { return (threadIdx.x >> 5) & 3; }

// Descriptor fields: start address, leading and stride byte offsets (all >> 4), and the layout type (bits 62-63):
// 1 the 128-byte swizzle, 2 the 64-byte one.
__device__ __forceinline__ u64 make_desc(u32 saddr, u32 lbo, u32 sbo, u32 layout = 1) {
  return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | ((u64)layout << 62);
}

template <typename T, int ROWS, int COLS> struct Sw128 {
  static_assert(sizeof(T) == 2, "wgmma tiles hold float16 / bfloat16");
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "whole 64-column panels of whole 8-row swizzle atoms");
  static constexpr int PANEL_COLS = 64, PANELS = COLS / 64;
  static constexpr int PANEL_BYTES = ROWS * 128, ROW_BYTES = 128;  // ROW_BYTES: a row's bytes in one panel
  static constexpr int BYTES = ROWS * COLS * 2;
  u32 base;  // shared-memory address, 1024-byte aligned (the swizzle repeats every 8 rows of 128 bytes)
  // Address of the 16-byte chunk holding (row, col..col+7), col % 8 == 0.
  __device__ __forceinline__ u32 addr(int row, int col) const {
    return base + (col >> 6) * PANEL_BYTES + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4);
  }
  __device__ __forceinline__ u32 saddr(int row, int col) const { return addr(row, col); }  // (Tile's name)
  // K-major operand (A or B of D = A B^T): rows r0..r0+63 (or N rows), k-step of 16 columns at k0.
  // Within a panel the hardware applies the swizzle to the absolute address, so stepping k is +32 bytes;
  // the 8-row atoms follow each other every 1024 bytes (SBO); LBO is unused in this mode.
  __device__ __forceinline__ u64 desc_k(int r0, int k0) const {
    return make_desc(base + (k0 >> 6) * PANEL_BYTES + r0 * 128 + (k0 & 63) * 2, 16, 1024);
  }
  // MN-major operand (B of D = A B with B stored [k][n], or A stored [k][m]): rows k0..k0+15 are K, columns
  // n0.. are N (or M). LBO steps from one 64-column panel to the next, SBO from one 8-row group of K to the next;
  // a start inside a panel (n0 % 64 = 32) is a byte offset, like the k-steps of desc_k, and is only right when
  // the operand ends inside that panel too (N <= 64 - n0 % 64): the hardware takes 64 contiguous columns per LBO.
  __device__ __forceinline__ u64 desc_mn(int k0, int n0) const {
    return make_desc(base + (n0 >> 6) * PANEL_BYTES + k0 * 128 + (n0 & 63) * 2, PANEL_BYTES, 1024);
  }
};

// An 8-bit tile (FP8 e4m3, as bytes) in a swizzled layout of PANEL-byte rows: panels of PANEL columns, a panel
// ROWS rows of PANEL bytes. Sw128x8 (PANEL 128) is the 128-byte swizzle of the 16-bit tiles, 16-byte chunk c of
// row r at chunk c ^ (r % 8); Sw64x8 (PANEL 64, for widths of whole 64-byte panels only, such as the FP8 form's
// V^T tiles of 192 keys) the 64-byte one, chunk c ^ (r / 2 % 4), an 8-row atom of 512 bytes. Only K-major reads
// exist for 8-bit wgmma operands, so only desc_k (the descriptor's layout 1 or 2, SBO one 8-row atom); a k-step
// of 32 columns is +32 bytes inside a panel. Only TMA writes these tiles (the map's swizzle matching PANEL).
template <int ROWS, int COLS, int PANEL> struct SwizzledX8 {
  static_assert(PANEL == 128 || PANEL == 64, "the 128- or 64-byte swizzle");
  static_assert(COLS % PANEL == 0 && ROWS % 8 == 0, "whole panels of whole 8-row swizzle atoms");
  static constexpr int PANEL_COLS = PANEL, PANELS = COLS / PANEL;
  static constexpr int PANEL_BYTES = ROWS * PANEL, ROW_BYTES = PANEL;
  static constexpr int BYTES = ROWS * COLS;
  u32 base;  // shared-memory address, 1024-byte aligned
  __device__ __forceinline__ u64 desc_k(int r0, int k0) const {
    return make_desc(base + (k0 / PANEL) * PANEL_BYTES + r0 * PANEL + (k0 % PANEL), 16, 8 * PANEL,
                     PANEL == 128 ? 1 : 2);
  }
};
template <int ROWS, int COLS> using Sw128x8 = SwizzledX8<ROWS, COLS, 128>;
template <int ROWS, int COLS> using Sw64x8 = SwizzledX8<ROWS, COLS, 64>;

// Copy rows [0, ROWS) of a tile whose row r starts at g + r*row_stride into an Sw128 tile (cp.async, 16 bytes
// per thread and step, consecutive threads on consecutive chunks of a row); rows >= rows_valid and columns
// >= cols_valid are zero-filled. Where the chunks of a row divide the threads, each thread keeps one column chunk
// and steps down the rows NTHREADS / C at a time in a fully unrolled loop: a copy costs a compare, an address add
// and the LDGSTS itself (the general walk spent about 30 instructions on each).
template <int NTHREADS, typename T, int ROWS, int COLS>
__device__ __forceinline__ void load_tile(const Sw128<T, ROWS, COLS>& s, const T* g, long long row_stride,
                                          int rows_valid, int cols_valid) {
  constexpr int C = COLS / 8, RSTEP = NTHREADS / C;
  if constexpr (NTHREADS % C == 0 && ROWS % RSTEP == 0) {
    const int col = (threadIdx.x % C) * 8, r0 = threadIdx.x / C;
    const bool col_ok = col < cols_valid;
    const T* src = g + r0 * row_stride + col;
    const long long step = RSTEP * row_stride;
#pragma unroll
    for (int n = 0; n < ROWS / RSTEP; ++n) {
      const int row = r0 + n * RSTEP;
      const bool valid = col_ok && row < rows_valid;
      cp_async16(s.addr(row, col), valid ? src + n * step : g, valid);
    }
  } else {  // rows of a chunk count that does not divide the threads (head_dim 192): the general walk
    for (int idx = threadIdx.x; idx < ROWS * C; idx += NTHREADS) {
      const int row = idx / C, col = (idx % C) * 8;
      const bool valid = row < rows_valid && col < cols_valid;
      cp_async16(s.addr(row, col), valid ? g + row * row_stride + col : g, valid);
    }
  }
}

// The same with each row's first element from row_ptr(row) (a paged forward's keys: BlockInfo::paged_key, a page
// table read each). A thread locates all its rows first, so their table reads are in flight together, then
// issues its copies; base: any address inside the tensor (the source of zero-filled chunks).
template <int NTHREADS, typename T, int ROWS, int COLS, class RowPtr>
__device__ __forceinline__ void load_tile_rows(const Sw128<T, ROWS, COLS>& s, RowPtr row_ptr, const T* base,
                                               int rows_valid, int cols_valid) {
  constexpr int C = COLS / 8, RSTEP = NTHREADS / C;
  if constexpr (NTHREADS % C == 0 && ROWS % RSTEP == 0) {
    const int col = (threadIdx.x % C) * 8, r0 = threadIdx.x / C;
    const bool col_ok = col < cols_valid;
    const T* src[ROWS / RSTEP];
#pragma unroll
    for (int n = 0; n < ROWS / RSTEP; ++n) src[n] = r0 + n * RSTEP < rows_valid ? row_ptr(r0 + n * RSTEP) : base;
#pragma unroll
    for (int n = 0; n < ROWS / RSTEP; ++n) {
      const int row = r0 + n * RSTEP;
      const bool valid = col_ok && row < rows_valid;
      cp_async16(s.addr(row, col), valid ? src[n] + col : base, valid);
    }
  } else {  // (head_dim 192) the general walk, a row located per chunk
    for (int idx = threadIdx.x; idx < ROWS * C; idx += NTHREADS) {
      const int row = idx / C, col = (idx % C) * 8;
      const bool valid = row < rows_valid && col < cols_valid;
      cp_async16(s.addr(row, col), valid ? row_ptr(row) + col : base, valid);
    }
  }
}

// Write a C-layout accumulator (64 rows of a warpgroup, MT = 1) into an Sw128 tile at rows r0.., cols c0..
// (r0: this warp's first row). Each quad writes 16 contiguous bytes of a row: no bank conflicts.
template <typename T, int NT, int R, int C>
__device__ __forceinline__ void store_acc(const Sw128<T, R, C>& s, const Acc<1, NT>& acc, int r0, int c0) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + g + 8 * h, col = c0 + 8 * j + 2 * t;
      const u32 v = pack2<T>(acc.v[0][j][2 * h], acc.v[0][j][2 * h + 1]);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s.addr(row, col & ~7) + (col & 7) * 2), "r"(v) : "memory");
    }
}

// Four 8 x 8 matrices of 16-bit values to shared memory (sm_90): register i of lane l holds row l / 4, columns
// 2 (l % 4).. of matrix i (mma's C layout, packed in pairs); lanes 8i..8i+7 give the addresses of matrix i's rows.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// A warp's 16 rows of a C-layout accumulator (MT = 1), row h of each quad times f[h], cast to T, into rows r0..
// of an Sw128 tile by stmatrix: one instruction per 16 columns (matrices: rows 0-7 and 8-15 of columns 8j..,
// then of 8j + 8..), each 8-row matrix on 8 different 16-byte bank groups (the swizzle). The epilogue's staging
// of O for its TMA store.
template <typename T, int NT, int R, int C>
__device__ __forceinline__ void stage_rows(const Sw128<T, R, C>& s, const Acc<1, NT>& acc, const float (&f)[2],
                                           int r0) {
  static_assert(NT % 2 == 0, "whole 16-column steps");
  const int m = lane_id() >> 3, row = r0 + (lane_id() & 7) + 8 * (m & 1);
#pragma unroll
  for (int j = 0; j < NT; j += 2) {
    const u32 r[4] = {pack2<T>(acc.v[0][j][0] * f[0], acc.v[0][j][1] * f[0]),
                      pack2<T>(acc.v[0][j][2] * f[1], acc.v[0][j][3] * f[1]),
                      pack2<T>(acc.v[0][j + 1][0] * f[0], acc.v[0][j + 1][1] * f[0]),
                      pack2<T>(acc.v[0][j + 1][2] * f[1], acc.v[0][j + 1][3] * f[1])};
    stmatrix_x4(s.addr(row, 8 * (j + (m >> 1))), r);
  }
}

// The transpose of store_acc: element (row r0 + r, column c) of a warp's 16 rows of a C-layout accumulator goes to
// row c, column r0 + r of an Sw128 tile, by stmatrix .trans (one instruction per 16 columns; each 8 x 8 matrix is
// stored as 8 rows of 16 bytes, one per accumulator column, on 8 bank groups through the swizzle). The backward's
// 80-row tile keeps dS_i this way round (rows queries) from its dS_i^T accumulator.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
template <typename T, int NT, int R, int C>
__device__ __forceinline__ void store_acc_transposed(const Sw128<T, R, C>& s, const Acc<1, NT>& acc, int r0) {
  static_assert(NT % 2 == 0, "whole 16-column steps");
  // lanes 8m..8m+7 address matrix m: accumulator rows r0 + 8 (m % 2).., columns 8 (j + m / 2)..
  const int m = lane_id() >> 3, i = lane_id() & 7;
#pragma unroll
  for (int j = 0; j < NT; j += 2) {
    const u32 r[4] = {pack2<T>(acc.v[0][j][0], acc.v[0][j][1]), pack2<T>(acc.v[0][j][2], acc.v[0][j][3]),
                      pack2<T>(acc.v[0][j + 1][0], acc.v[0][j + 1][1]),
                      pack2<T>(acc.v[0][j + 1][2], acc.v[0][j + 1][3])};
    stmatrix_x4_trans(s.addr(8 * (j + (m >> 1)) + i, r0 + 8 * (m & 1)), r);
  }
}

// ---------------------------------------------------------------- ordering
// Before the first wgmma of a batch: ordinary code has written registers it reads or accumulates into.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed batches of this warpgroup are still running (they finish in order).
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by this thread (cp.async, st.shared) becomes visible to the tensor cores' async proxy
// once every writer has executed this and the CTA has passed a barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keep the compiler from moving reads or writes of an accumulator across a wgmma that is still running.
template <int NT> __device__ __forceinline__ void fence_operand(Acc<1, NT>& d) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d.v[0][j][e])::"memory");
}

// ---------------------------------------------------------------- warpgroup products (issue only: commit, wait)
// acc (+)= A B^T, A = rows a0..a0+63 of sa ([m][k]), B = rows b0.. of sb ([n][k]), k over all K columns.
// accumulate = false overwrites acc (no need to zero it first).
template <typename T, int NT, int RA, int RB, int K>
__device__ __forceinline__ void wg_gemm_abt(Acc<1, NT>& acc, const Sw128<T, RA, K>& sa, int a0,
                                            const Sw128<T, RB, K>& sb, int b0, bool accumulate) {
#pragma unroll
  for (int k = 0; k < K; k += 16)
    Wgmma<T, 8 * NT, 0, 0>::ss(acc.v[0], sa.desc_k(a0, k), sb.desc_k(b0, k), (k > 0 || accumulate) ? 1 : 0);
}
// P (64 x 16*KT) in registers as A fragments, from an accumulator in C layout: k-chunk kk = columns 16kk.. .
template <typename T, int NT>
__device__ __forceinline__ void to_a_operand(u32 (&p)[NT / 2][4], const Acc<1, NT>& s) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    p[kk][0] = pack2<T>(s.v[0][2 * kk][0], s.v[0][2 * kk][1]);
    p[kk][1] = pack2<T>(s.v[0][2 * kk][2], s.v[0][2 * kk][3]);
    p[kk][2] = pack2<T>(s.v[0][2 * kk + 1][0], s.v[0][2 * kk + 1][1]);
    p[kk][3] = pack2<T>(s.v[0][2 * kk + 1][2], s.v[0][2 * kk + 1][3]);
  }
}
// acc += P B, P from registers (to_a_operand), B = rows k0.. (K) x columns n0.. (N = 8*NT) of sb stored [k][n].
template <typename T, int NT, int KT, int R, int C>
__device__ __forceinline__ void wg_gemm_rb(Acc<1, NT>& acc, const u32 (&p)[KT][4], const Sw128<T, R, C>& sb,
                                           int k0, int n0) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) Wgmma<T, 8 * NT, 0, 1>::rs(acc.v[0], p[kk], sb.desc_mn(k0 + 16 * kk, n0), 1);
}

// acc (+)= A B with A[m][k] read from sa stored [k][m] (columns m0..m0+63) and B from sb stored [k][n]
// (columns n0..): both operands MN-major, k over rows [0, K). Used for dQ = dS K with dS kept as dS^T.
template <int K, typename T, int NT, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void wg_gemm_atb(Acc<1, NT>& acc, const Sw128<T, RA, CA>& sa, int m0,
                                            const Sw128<T, RB, CB>& sb, int n0, bool accumulate) {
#pragma unroll
  for (int k = 0; k < K; k += 16)
    Wgmma<T, 8 * NT, 1, 1>::ss(acc.v[0], sa.desc_mn(k, m0), sb.desc_mn(k, n0), (k > 0 || accumulate) ? 1 : 0);
}

// acc (+)= A B^T with A[m][k] read from sa stored [k][m] (columns m0..m0+63, MN-major) and B = rows b0.. of sb
// ([n][k], K-major), k over rows [0, K) of sa. Used for dQ_i^T = K_j^T dS_i^T with dS_i kept untransposed.
template <int K, typename T, int NT, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void wg_gemm_atbt(Acc<1, NT>& acc, const Sw128<T, RA, CA>& sa, int m0,
                                             const Sw128<T, RB, CB>& sb, int b0, bool accumulate) {
#pragma unroll
  for (int k = 0; k < K; k += 16)
    Wgmma<T, 8 * NT, 1, 0>::ss(acc.v[0], sa.desc_mn(k, m0), sb.desc_k(b0, k), (k > 0 || accumulate) ? 1 : 0);
}

// acc (+)= A B with A = rows a0..a0+63 of sa ([m][k], K-major) and B from sb stored [k][n] (columns n0..,
// MN-major), k over rows [0, K) of sb. Used for dK, dV += (dS^T, P^T) (Q_i, dO_i) with dS^T, P^T in shared memory.
template <int K, typename T, int NT, int RA, int CA, int RB, int CB>
__device__ __forceinline__ void wg_gemm_ab(Acc<1, NT>& acc, const Sw128<T, RA, CA>& sa, int a0,
                                           const Sw128<T, RB, CB>& sb, int n0, bool accumulate) {
#pragma unroll
  for (int k = 0; k < K; k += 16)
    Wgmma<T, 8 * NT, 0, 1>::ss(acc.v[0], sa.desc_k(a0, k), sb.desc_mn(k, n0), (k > 0 || accumulate) ? 1 : 0);
}

// dst[0..1] += (a, b) in global memory, one vector reduction (sm_90).
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

}  // namespace rf
