// Shared by the CPU kernels: conversions, rounding to the tensor's dtype, vectorised
// dot/axpy/exp/softmax, argument checks. Vectorisation is explicit (AVX-512 intrinsics)
// where it pays and plain loops elsewhere; files are compiled with -march=native on the
// machine that runs them (kv_kernels/cpu_build.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

namespace s3_cpu {

constexpr int kLanes = 16;

template <typename scalar_t>
inline float to_float(scalar_t x) {
  return static_cast<float>(x);
}

// The value a float takes once stored in scalar_t (identity for float).
template <typename scalar_t>
inline float rounded(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[d + j] * b[d + j];
  }
  float sum = 0.f;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

template <typename scalar_t>
inline void load_row(float* dst, const scalar_t* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

template <typename scalar_t>
constexpr bool kVectorisesAny = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                                std::is_same_v<scalar_t, c10::Half>;

// Attention's inner loops over one cached key or value row (head_dim elements). With
// AVX-512 and head_dim % 16 == 0 they run on zmm registers; bf16 with AVX512-BF16 dots
// bf16 pairs straight from the cache (vdpbf16ps, fp32 accumulation; the query is rounded
// to bf16 once, as HF's bf16 attention has it).
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// dst[0:n] = float(src[0:n])
template <typename scalar_t>
inline void convert_row(float* dst, const scalar_t* src, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kVectorisesAny<scalar_t>) {
    if (n % 16 == 0) {
      for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
      return;
    }
  }
#endif
  load_row(dst, src, n);
}

inline float dot_f32(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t d = 16; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  return dot(a, b, n);
}

// y[0:n] += a * x[0:n], y 64-byte aligned when n % 16 == 0 (store forwarding needs whole-line stores).
inline void axpy_f32(float* y, float a, const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 weight = _mm512_set1_ps(a);
    for (int64_t d = 0; d < n; d += 16) {
      _mm512_store_ps(y + d, _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + d), _mm512_load_ps(y + d)));
    }
    return;
  }
#endif
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
inline float dot_bf16(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 32) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(a + d)),
                           (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(b + d)));
  }
  return _mm512_reduce_add_ps(acc);
}
#else
constexpr bool kHasBf16Dot = false;
inline float dot_bf16(const c10::BFloat16*, const c10::BFloat16*, int64_t) { return 0.f; }
#endif

// exp(x) for x in [-87, 88], relative error < 2e-7: x = n ln2 + r, |r| <= ln2/2,
// exp(r) by a degree-6 polynomial, 2^n from the exponent bits. Vectorises.
inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.3888949e-3f;
  p = p * r + 8.3333962e-3f;
  p = p * r + 4.1666638e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp_poly on 16 lanes.
inline __m512 exp_poly16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.3888949e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333962e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666638e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}
#endif

// 16-lane loads and rounding stores for the elementwise ops, where they vectorise: fp32
// (rounding is the identity), and bf16 on CPUs with AVX512-BF16 (vcvtneps2bf16 rounds to
// nearest even, as torch does). Other dtypes and CPUs take the scalar loops.
#if defined(__AVX512F__)
template <typename scalar_t>
constexpr bool kVectorElementwise = std::is_same_v<scalar_t, float>
#if defined(__AVX512BF16__)
                                    || std::is_same_v<scalar_t, c10::BFloat16>
#endif
    ;

template <typename scalar_t>
inline __m512 load_lanes(const scalar_t* p) {
  return load16(p);
}

// v rounded to scalar_t, as float (what storing and reloading it gives)
template <typename scalar_t>
inline __m512 round_lanes(__m512 v) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m256i bf16 = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
  }
#endif
  return v;
}

template <typename scalar_t>
inline void store_lanes(scalar_t* p, __m512 v) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    return;
  }
#endif
  if constexpr (std::is_same_v<scalar_t, float>) _mm512_storeu_ps(p, v);
}
#else
template <typename scalar_t>
constexpr bool kVectorElementwise = false;
#endif

// Softmax of row[0:n] in place.
inline void softmax_inplace(float* row, int64_t n) {
  int64_t i = 0;
  float max_value = row[0];
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(row[0]);
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + i));
  max_value = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < n; ++i) max_value = row[i] > max_value ? row[i] : max_value;
  float sum = 0.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vshift = _mm512_set1_ps(max_value);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_poly16(_mm512_sub_ps(_mm512_loadu_ps(row + i), vshift));
    _mm512_storeu_ps(row + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; i < n; ++i) {
    row[i] = exp_poly(row[i] - max_value);
    sum += row[i];
  }
  const float inv = 1.f / sum;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), vinv));
#endif
  for (; i < n; ++i) row[i] *= inv;
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
}

inline void check_rows(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with unit last stride, got ", t.sizes());
}

}  // namespace s3_cpu
