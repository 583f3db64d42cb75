// fp8_prep: the FP8 forward's pre-passes (rawflash/fp8.py and cupy_backend.py launch them).
//   - fp8_vt_permute: V (batch, seqlen_k, kv_heads, head_dim) e4m3 -> V^T (batch, kv_heads, head_dim, nk_pad)
//     with the keys of every 32-key slice in the order sigma of mainloop_fwd_sm90_fp8.cuh (column p of a slice
//     holds key sigma(p)) and zeros past seqlen_k: 8-bit wgmma reads B K-major only, and this order lets P go
//     from the accumulator registers into P V unmoved. One CTA per 64 keys of one (batch, kv head). Packed
//     sequences (cu_seqlens_k, V of (total_k, kv_heads, head_dim)): V^T (1, kv_heads, head_dim, nk_pad) with
//     sequence b's keys from vt_key0(b) = 128 (cu_seqlens_k[b] / 128 + b) (mainloop_fwd_sm90_fp8.cuh's), its
//     tiles of 64 keys zero past its length; the host zeroes the rest of the workspace.
//   - fp8_quantize: rows of x (batch, seqlen, heads, head_dim; 16-bit or float32) -> e4m3 bytes, one warp per
//     row. PASS 0 only finds the absolute maximum of each granule (tensor, or (batch, kv head)); PASS 1 writes
//     x * 448 / amax rounded to nearest e4m3 (saturating). ROTATE applies the random orthogonal Hadamard
//     transform of incoherent processing first: x -> (x * signs) H / sqrt(head_dim), H the Sylvester Hadamard
//     matrix (head_dim a power of two, 32..256), by the fast Walsh-Hadamard butterflies.
#include "core.cuh"

namespace rf {

__device__ __forceinline__ int vt_sigma(int p) {  // key of fragment column p of a 32-key slice
  return 16 * (p >> 4) + 8 * ((p & 3) >> 1) + 2 * ((p & 15) >> 2) + (p & 1);
}

__device__ __forceinline__ unsigned char to_e4m3(float x) {
  unsigned short b;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(b) : "f"(0.f), "f"(x));
  return (unsigned char)(b & 0xFF);
}

}  // namespace rf

constexpr int VT_THREADS = 256;

template <int VT_KEYS>
__global__ void __launch_bounds__(VT_THREADS)
    fp8_vt_permute(const unsigned char* __restrict__ v, long long v_sb, long long v_ss, long long v_sh, int seqlen_k,
                   int head_dim, int kv_heads, unsigned char* __restrict__ vt, int nk_pad,
                   const int* __restrict__ cu_seqlens_k) {
  using namespace rf;
  extern __shared__ unsigned int tile[];  // VT_KEYS keys x head_dim bytes, rows padded by 4 bytes (launch.py)
  const int rs = head_dim + 4, k0 = blockIdx.x * VT_KEYS, hk = blockIdx.y, b = blockIdx.z;
  unsigned char* t8 = reinterpret_cast<unsigned char*>(tile);
  long long out_key0 = k0;  // this CTA's first key in the workspace row
  if (cu_seqlens_k) {  // packed: sequence b's rows of V, its keys from vt_key0(b) of the one "batch" row
    const int row0 = cu_seqlens_k[b];
    seqlen_k = cu_seqlens_k[b + 1] - row0;
    if (k0 >= seqlen_k) return;  // (the whole CTA) past the sequence: zeros from the host
    v += (long long)row0 * v_ss;
    v_sb = 0;
    out_key0 += 128LL * (row0 / 128 + b);
  }
  // load: 64 keys of V, 16 bytes per thread and step, zeros past seqlen_k
  const int chunks = head_dim / 16;
  for (int i = threadIdx.x; i < VT_KEYS * chunks; i += VT_THREADS) {
    const int key = i / chunks, c = i % chunks;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (k0 + key < seqlen_k)
      x = *reinterpret_cast<const uint4*>(v + b * v_sb + (long long)(k0 + key) * v_ss + hk * v_sh + 16 * c);
    unsigned int* dst = reinterpret_cast<unsigned int*>(t8 + key * rs + 16 * c);
    dst[0] = x.x; dst[1] = x.y; dst[2] = x.z; dst[3] = x.w;
  }
  __syncthreads();  // the whole tile is in shared memory before any thread gathers its column of it
  // store: row d of V^T: 16 permuted keys per thread and step
  unsigned char* out = vt + ((long long)(cu_seqlens_k ? 0 : b) * kv_heads + hk) * head_dim * nk_pad + out_key0;
  for (int i = threadIdx.x; i < head_dim * (VT_KEYS / 16); i += VT_THREADS) {
    const int d = i / (VT_KEYS / 16), c = i % (VT_KEYS / 16);
    unsigned int w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      unsigned int word = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int p = 16 * c + 4 * q + e;
        word |= (unsigned int)t8[(32 * (p >> 5) + vt_sigma(p & 31)) * rs + d] << (8 * e);
      }
      w[q] = word;
    }
    *reinterpret_cast<uint4*>(out + (long long)d * nk_pad + 16 * c) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Rows are (b, s, h) of x with element strides sb, ss, sh (head_dim contiguous); out is contiguous. Granule g of
// a row: 0 per tensor, else b * kv_heads + h / group. amax holds float bits (non-negative floats order as ints).
template <typename T, bool ROTATE, int PASS>
__global__ void __launch_bounds__(256)
    fp8_quantize(const T* __restrict__ x, long long sb, long long ss, long long sh, int batch, int seqlen, int heads,
                 int head_dim, int group, int per_head, const float* __restrict__ signs,
                 unsigned int* __restrict__ amax, unsigned char* __restrict__ out) {
  using namespace rf;
  constexpr int E = 8;  // elements per lane (head_dim <= 256): lane l holds columns l * e_n .. l * e_n + e_n - 1
  const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= (long long)batch * seqlen * heads) return;  // whole warps leave together (rows are per warp)
  const int h = (int)(row % heads), s = (int)((row / heads) % seqlen), b = (int)(row / ((long long)heads * seqlen));
  const int en = (head_dim + 31) / 32;
  const T* src = x + b * sb + s * ss + h * sh;
  float v[E];
  // load (and the random signs of the rotation)
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int col = lane * en + e;
    v[e] = (e < en && col < head_dim) ? to_float(src[col]) : 0.f;
    if (ROTATE && e < en) v[e] *= signs[col];
  }
  if (ROTATE) {
    // rotate: Walsh-Hadamard butterflies: in-lane strides, then across lanes
#pragma unroll
    for (int hh = 1; hh < E; hh <<= 1)
      if (hh < en)
#pragma unroll
        for (int e = 0; e < E; ++e)
          if (!(e & hh) && e + hh < en) {
            const float a = v[e], c = v[e + hh];
            v[e] = a + c;
            v[e + hh] = a - c;
          }
    for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, v[e], m);
        v[e] = (lane & m) ? other - v[e] : v[e] + other;
      }
    }
    const float norm = rsqrtf((float)head_dim);
#pragma unroll
    for (int e = 0; e < E; ++e) v[e] *= norm;
  }
  const int g = per_head ? b * (heads / group) + h / group : 0;
  if (PASS == 0) {
    // amax of the row, then of the granule
    float m = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) m = fmaxf(m, fabsf(v[e]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) atomicMax(amax + g, __float_as_uint(m));
    return;
  }
  // store: x * 448 / amax, nearest e4m3
  const float a = __uint_as_float(amax[g]), f = a > 0.f ? 448.f / a : 1.f;
  unsigned char* dst = out + row * head_dim;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int col = lane * en + e;
    if (e < en && col < head_dim) dst[col] = to_e4m3(v[e] * f);
  }
}
