// Shared by the CPU kernels: conversions, rounding to the tensor's dtype, vectorised
// dot/axpy/exp/softmax, argument checks. Vectorisation is explicit (AVX-512 intrinsics, or
// AVX2 ones on CPUs without AVX-512) where it pays and plain loops elsewhere; files are
// compiled with -march=native on the machine that runs them (kv_kernels/cpu_build.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
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

// CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel client cores): the attention's and softmax's loops
// on 8 lanes. Without them gcc vectorises the plain loops below only partly (not the softmax's sums and exps).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define S3_CPU_AVX2 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename scalar_t>
constexpr bool kLoads8 = kVectorisesAny<scalar_t>;
#else
template <typename scalar_t>
constexpr bool kLoads8 = kVectorisesAny<scalar_t> && !std::is_same_v<scalar_t, c10::Half>;
#endif
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
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
#elif defined(S3_CPU_AVX2)
  if constexpr (kLoads8<scalar_t>) {
    if (n % 8 == 0) {
      for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
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
#elif defined(S3_CPU_AVX2)
  if (n % 16 == 0) {  // two chains: the FMA's latency
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    return hsum8(_mm256_add_ps(acc0, acc1));
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
#elif defined(S3_CPU_AVX2)
  if (n % 8 == 0) {
    const __m256 weight = _mm256_set1_ps(a);
    for (int64_t d = 0; d < n; d += 8) {
      _mm256_storeu_ps(y + d, _mm256_fmadd_ps(weight, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
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
// exp(r) by a degree-6 polynomial, 2^n from the exponent bits. Vectorises; the 16- and 8-lane
// versions below compute the same with these constants.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;  // ln2 = hi + lo, hi exact
constexpr float kExpPoly[7] = {1.3888949e-3f, 8.3333962e-3f, 4.1666638e-2f, 1.6666667e-1f, 0.5f, 1.f, 1.f};

inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * kLog2e;
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * r + kExpPoly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp_poly on 16 lanes.
inline __m512 exp_poly16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), _mm512_min_ps(_mm512_set1_ps(88.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}
#elif defined(S3_CPU_AVX2)
// exp_poly on 8 lanes; 2^n from the exponent bits, as the scalar one (n + 127 in [1, 254] after the clamp).
inline __m256 exp_poly8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), _mm256_min_ps(_mm256_set1_ps(88.f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
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
#elif defined(S3_CPU_AVX2)
  __m256 vmax = _mm256_set1_ps(row[0]);
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + i));
  max_value = hmax8(vmax);
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
#elif defined(S3_CPU_AVX2)
  const __m256 vshift = _mm256_set1_ps(max_value);
  __m256 vsum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vshift));
    _mm256_storeu_ps(row + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum8(vsum);
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
#elif defined(S3_CPU_AVX2)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), vinv));
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
