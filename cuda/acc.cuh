// Register tiles and the element-wise verbs every kernel applies to them.
//
// Acc<MT, NT> is one warp's (16 MT) x (8 NT) float32 tile in mma.sync's C layout (PTX ISA, "Matrix fragments for
// mma.m16n8k16"); a warpgroup's wgmma accumulator of 64 x N is Acc<1, N/8> in each of its four warps. With
// g = lane / 4 and t = lane % 4, element v[i][j][e] sits at row 16i + g + 8(e/2), column 8j + 2t + e%2 of the
// warp's tile. A thread holds 2 MT rows; row r = 2i + h (h = e/2) indexes per-row values (max, sum, factors).
// In the backward the same layout holds transposed products (S^T: rows are keys, columns are queries).
#pragma once
#include "core.cuh"

namespace rf {

template <int MT_, int NT_> struct Acc {
  static constexpr int MT = MT_, NT = NT_, ROWS = 2 * MT_;
  float v[MT_][NT_][4];
};

// f(i, j, e, row, col) for every element v[i][j][e] a thread holds, at (row, col) of the warp tile (C layout).
// Every element-wise walk below is this one loop nest (a walk over column pairs takes the even e).
template <int MT, int NT, class F> __device__ __forceinline__ void for_each_index(F f) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(i, j, e, 16 * i + g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1));
}

// f(x, row, col) for every element, row and col relative to the warp tile's first row and column.
template <int MT, int NT, class F> __device__ __forceinline__ void for_each(Acc<MT, NT>& a, F f) {
  for_each_index<MT, NT>([&](int i, int j, int e, int row, int col) { f(a.v[i][j][e], row, col); });
}

// f(x, y, row, col) for every pair of elements at the same place in two tiles of one shape (P and dS).
template <int MT, int NT, class F> __device__ __forceinline__ void for_each2(Acc<MT, NT>& a, Acc<MT, NT>& b, F f) {
  for_each_index<MT, NT>([&](int i, int j, int e, int row, int col) { f(a.v[i][j][e], b.v[i][j][e], row, col); });
}

// f(x, r) for every element, r the thread's row index (2i + e/2) into per-row arrays.
template <int MT, int NT, class F> __device__ __forceinline__ void for_each_row(Acc<MT, NT>& a, F f) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(a.v[i][j][e], 2 * i + (e >> 1));
}

// f(x, col) for every element, col its column in the warp tile (per-column values: L_i, D_i of S^T).
template <int MT, int NT, class F> __device__ __forceinline__ void for_each_col(Acc<MT, NT>& a, F f) {
  const int t = lane_id() & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(a.v[i][j][e], 8 * j + 2 * t + (e & 1));
}

template <int MT, int NT> __device__ __forceinline__ void zero(Acc<MT, NT>& a) {
  for_each_row(a, [](float& x, int) { x = 0.f; });
}

// Multiply row r of a by f[r].
template <int MT, int NT> __device__ __forceinline__ void scale_rows(Acc<MT, NT>& a, const float (&f)[2 * MT]) {
  for_each_row(a, [&](float& x, int r) { x *= f[r]; });
}

// Row maxima and sums: a row lives in one quad (4 lanes), reduced with two shuffles.
__device__ __forceinline__ float quad_max(float m) {
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}
template <int MT, int NT> __device__ __forceinline__ void row_max(float (&mx)[2 * MT], const Acc<MT, NT>& a) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j) m = fmaxf(m, fmaxf(a.v[i][j][2 * h], a.v[i][j][2 * h + 1]));
      mx[2 * i + h] = quad_max(m);
    }
}
template <int MT, int NT> __device__ __forceinline__ void row_sum(float (&sm)[2 * MT], const Acc<MT, NT>& a) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) s += a.v[i][j][2 * h] + a.v[i][j][2 * h + 1];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      sm[2 * i + h] = s + __shfl_xor_sync(0xffffffffu, s, 2);
    }
}

// Write rows [r0, r0+16 MT) x cols [c0, c0+8 NT) of a * f[row] to g (row stride ld), clipped to rows < nrows and
// cols < ncols; head_dim is a multiple of 8, so a column pair is written whole or not at all.
template <typename T, int MT, int NT>
__device__ __forceinline__ void store_rows(T* g, long long ld, const Acc<MT, NT>& a, const float (&f)[2 * MT], int r0,
                                           int c0, int nrows, int ncols) {
  const int gg = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + 16 * i + gg + 8 * h;
      if (row >= nrows) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = c0 + 8 * j + 2 * t;
        if (col >= ncols) continue;
        T* dst = g + row * ld + col;
        const float x0 = a.v[i][j][2 * h] * f[2 * i + h], x1 = a.v[i][j][2 * h + 1] * f[2 * i + h];
        if constexpr (sizeof(T) == 2) {
          *reinterpret_cast<u32*>(dst) = pack2<T>(x0, x1);
        } else {
          *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);
        }
      }
    }
}

// One value per row (lse, L, D ...): lane t = 0 of each quad writes row r0 + (its row) when it is < nrows.
template <int MT>
__device__ __forceinline__ void store_row_values(float* g, const float (&x)[2 * MT], int r0, int nrows) {
  const int gg = lane_id() >> 2;
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r) {
    const int row = r0 + 16 * (r / 2) + gg + 8 * (r % 2);
    if ((lane_id() & 3) == 0 && row < nrows) g[row] = x[r];
  }
}

}  // namespace rf
