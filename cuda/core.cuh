// rawflash core: element types and their conversions, the softmax exponential, thread coordinates.
// Every other header includes this one; it knows nothing of tiles, kernels or Python.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC has no <cmath>
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace rf {

using u32 = unsigned int;        // NVRTC has no <cstdint>
using u64 = unsigned long long;

[[maybe_unused]] constexpr float LOG2E = 1.4426950408889634f;
[[maybe_unused]] constexpr float LN2 = 0.6931471805599453f;
[[maybe_unused]] constexpr double LOG2E_D = 1.4426950408889634;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

// x, hidden from the optimiser (an empty asm): the compiler can no longer derive it from earlier values, so it does
// not strength-reduce what depends on it across a loop (fwd.cuh's serial tile loop, mainloop_bwd_sm80's EARLY_DV).
__device__ __forceinline__ int opaque(int x) {
  asm("" : "+r"(x));
  return x;
}
// The same at this point of every iteration of a loop, for a value the loop does not change (volatile: the asm is
// neither hoisted out of the loop nor merged): what depends on it is computed where it is used, not carried.
__device__ __forceinline__ int opaque_here(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// A compile-time bool as a type, so one generic lambda body can be instantiated masked and unmasked.
template <bool B> struct Bool { static constexpr bool value = B; };
// The type A when C holds, else B (NVRTC has no <type_traits>).
template <bool C, class A, class B> struct Select { using type = A; };
template <class A, class B> struct Select<false, A, B> { using type = B; };
// Whether A and B are one type (std::is_same).
template <class A, class B> struct Same { static constexpr bool value = false; };
template <class A> struct Same<A, A> { static constexpr bool value = true; };

// ---------------------------------------------------------------- element types
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<u32*>(&h);
}
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&h);
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// exp2 for the softmax: the hardware approximation (2 ulp) for 16-bit inputs, where it is far below the input
// rounding; through double for float32, where a naive float32 computation has correctly rounded exponentials.
template <typename T> __device__ __forceinline__ float exp2_(float x) { return exp2f(x); }
template <> __device__ __forceinline__ float exp2_<float>(float x) { return (float)exp2((double)x); }

// tanh for soft-capping, one per score on top of the softmax's exponential, so its cost is in the special-function
// unit's budget (16 operations per clock per SM on sm_90, which the softmax alone uses a third of at 650 TFLOP/s).
// bfloat16: the hardware tanh.approx.f32 (one operation; relative error 2^-10.99, 8x below bfloat16's own
// rounding of the score that the same-precision baseline has). float16, whose rounding is as fine as that error:
// 1 - 2 / (2^(2x log2 e) + 1) with the hardware exp2 and reciprocal (two operations, about 1e-7 relative; a
// correctly rounded reciprocal is a dozen instructions with a slow path). float32: tanhf.
template <typename T> __device__ __forceinline__ float tanh_(float x) {
  return 1.f - __fdividef(2.f, exp2f(2.f * LOG2E * x) + 1.f);
}
template <> __device__ __forceinline__ float tanh_<__nv_bfloat16>(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <> __device__ __forceinline__ float tanh_<float>(float x) { return tanhf(x); }

// 8 consecutive values (16 bytes of 16-bit, 32 of float32; the address aligned to 16 bytes) to / from float.
template <typename T> __device__ __forceinline__ void load8(float (&v)[8], const T* p) {
  if constexpr (sizeof(T) == 2) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = to_float(reinterpret_cast<const T*>(w)[e]);
  } else {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}
// FP8 KV caches (decode): an e4m3 element as its byte. Every e4m3 value is a float16 and a bfloat16 exactly.
struct e4m3 {
  unsigned char bits;
};
// Two e4m3 values (the low byte first) as a float16 pair (the low byte to the low half), exact.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)two));
  return h;
}
// 8 floats -> 8 e4m3 bytes (round to nearest, saturating at +-448: cvt.rn.satfinite), v[0] in the lowest byte.
__device__ __forceinline__ uint2 e4m3x8_from(const float (&v)[8]) {
  u32 w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(v[4 * i]), "f"(v[4 * i + 1]));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(v[4 * i + 2]), "f"(v[4 * i + 3]));
    w[i] = (u32)lo | ((u32)hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

template <typename T> __device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]),
                                              pack2<T>(v[6], v[7]));
  } else {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
  }
}

}  // namespace rf
