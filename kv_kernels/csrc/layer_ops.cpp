// The fused elementwise ops of a decoder layer on CPU (workers/engine/fast_decoder.py):
// RMSNorm (Llama's or Gemma's rounding), residual add + RMSNorm, rotary embedding, SiLU x up. Each rounds to the
// tensor's dtype exactly where the Hugging Face modules do (every bf16 op rounds its
// result), so bf16 outputs track HF's bf16 forward; in fp32 rounding is the identity.
// Registered as torch ops `s3_cpu::rms_norm`, `fused_add_rms_norm`, `rotary_embedding`, `silu_and_mul`.

#include "vector_math.h"

namespace s3_cpu {
namespace {

// ---------------------------------------------------------------------------
// RMSNorm, two roundings as two model families compute it:
//   weight in x's dtype (LlamaRMSNorm):        y = weight * round(x * rsqrt(mean(x^2) + eps))
//   weight float32 (Gemma3RMSNorm, weight = 1 + w, computed once in fp32):
//                                              y = round(weight * (x * rsqrt(mean(x^2) + eps)))
// In fp32 the two are the same arithmetic.

template <typename scalar_t, typename weight_t>
inline void rms_norm_row(scalar_t* dst, const float* x, const weight_t* weight, int64_t n, float eps) {
  constexpr bool kGemma = std::is_same_v<weight_t, float> && !std::is_same_v<scalar_t, float>;
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[d + j] * x[d + j];
  }
  float sum = 0.f;
  for (; d < n; ++d) sum += x[d] * x[d];
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorElementwise<scalar_t>) {
    const __m512 scale = _mm512_set1_ps(inv_rms);
    for (; i + 16 <= n; i += 16) {
      const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(x + i), scale);
      if constexpr (kGemma) {
        store_lanes(dst + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i), normed));
      } else {
        store_lanes(dst + i, _mm512_mul_ps(load_lanes(weight + i), round_lanes<scalar_t>(normed)));
      }
    }
  }
#endif
  for (; i < n; ++i) {
    if constexpr (kGemma) {
      dst[i] = static_cast<scalar_t>(weight[i] * (x[i] * inv_rms));
    } else {
      dst[i] = static_cast<scalar_t>(to_float(weight[i]) * rounded<scalar_t>(x[i] * inv_rms));
    }
  }
}

// weight: x's dtype, or float32 for the Gemma rounding (see above)
inline void check_norm_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous(), "weight must be contiguous [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must be float32 or x's dtype");
}

template <typename scalar_t, typename weight_t>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  const weight_t* w_ptr = weight.data_ptr<weight_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      convert_row(row.data(), x_ptr + r * x.stride(0), n);
      rms_norm_row(o_ptr + r * out.stride(0), row.data(), w_ptr, n, static_cast<float>(eps));
    }
  });
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "dtype mismatch");
  check_norm_weight(x, weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if (weight.scalar_type() == at::kFloat) {
      rms_norm_impl<scalar_t, float>(out, x, weight, eps);
    } else {
      rms_norm_impl<scalar_t, scalar_t>(out, x, weight, eps);
    }
  });
}

// residual = round(x + residual); x = rms_norm(residual): the add that closes a sublayer
// and the norm that opens the next one, in one pass.
template <typename scalar_t, typename weight_t>
void fused_add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* r_ptr = residual.data_ptr<scalar_t>();
  const weight_t* w_ptr = weight.data_ptr<weight_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = x_ptr + r * x.stride(0);
      scalar_t* rr = r_ptr + r * residual.stride(0);
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (kVectorElementwise<scalar_t>) {
        for (; i + 16 <= n; i += 16) {
          const __m512 sum = round_lanes<scalar_t>(_mm512_add_ps(load_lanes(rr + i), load_lanes(xr + i)));
          store_lanes(rr + i, sum);
          _mm512_storeu_ps(row.data() + i, sum);
        }
      }
#endif
      for (; i < n; ++i) {
        const scalar_t sum = static_cast<scalar_t>(to_float(rr[i]) + to_float(xr[i]));
        rr[i] = sum;
        row[i] = to_float(sum);
      }
      rms_norm_row(xr, row.data(), w_ptr, n, static_cast<float>(eps));
    }
  });
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "dtype mismatch");
  check_norm_weight(x, weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    if (weight.scalar_type() == at::kFloat) {
      fused_add_rms_norm_impl<scalar_t, float>(x, residual, weight, eps);
    } else {
      fused_add_rms_norm_impl<scalar_t, scalar_t>(x, residual, weight, eps);
    }
  });
}

// ---------------------------------------------------------------------------
// Rotary embedding, rotate-half (Llama) layout, in place on query [T, H*D] and key
// [T, KVH*D] (row strides free: they may be column slices of one qkv output).
// cos_sin [max_pos, D]: cos of the D/2 frequencies, then their sin, already rounded to
// the model's dtype as HF rounds them. HF: x * cos + rotate_half(x) * sin, each op rounded.

template <typename scalar_t>
inline void rotate_heads(scalar_t* x, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* head = x + h * head_dim;
    int64_t i = 0;
#if defined(__AVX512F__)
    if constexpr (kVectorElementwise<scalar_t>) {
      for (; i + 16 <= half; i += 16) {
        const __m512 x1 = load_lanes(head + i), x2 = load_lanes(head + i + half);
        const __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
        const __m512 a = _mm512_add_ps(round_lanes<scalar_t>(_mm512_mul_ps(x1, c)),
                                       round_lanes<scalar_t>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s)));
        const __m512 b = _mm512_add_ps(round_lanes<scalar_t>(_mm512_mul_ps(x2, c)),
                                       round_lanes<scalar_t>(_mm512_mul_ps(x1, s)));
        store_lanes(head + i, a);
        store_lanes(head + i + half, b);
      }
    }
#endif
    for (; i < half; ++i) {
      const float x1 = to_float(head[i]), x2 = to_float(head[i + half]);
      const float a = rounded<scalar_t>(x1 * cos[i]) + rounded<scalar_t>(-x2 * sin[i]);
      const float b = rounded<scalar_t>(x2 * cos[i]) + rounded<scalar_t>(x1 * sin[i]);
      head[i] = static_cast<scalar_t>(a);
      head[i + half] = static_cast<scalar_t>(b);
    }
  }
}

template <typename scalar_t>
void rotary_impl(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin,
                 int64_t head_dim) {
  const int64_t num_tokens = positions.size(0);
  const int64_t num_heads = query.size(1) / head_dim, num_kv_heads = key.size(1) / head_dim;
  const int64_t half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* k_ptr = key.data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * head_dim;
      const float* sin = cos + half;
      rotate_heads(q_ptr + t * query.stride(0), num_heads, head_dim, cos, sin);
      rotate_heads(k_ptr + t * key.stride(0), num_kv_heads, head_dim, cos, sin);
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin,
                      int64_t head_dim) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(positions.numel() == query.size(0) && key.size(0) == query.size(0), "one position per token");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == head_dim,
              "cos_sin must be float32 [max_pos, head_dim]");
  TORCH_CHECK(head_dim % 2 == 0 && query.size(1) % head_dim == 0 && key.size(1) % head_dim == 0,
              "rows must hold whole heads of even head_dim");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key dtypes differ");
  if (positions.numel() > 0) {  // a loop, not at::aminmax: that was 10 us of tensors and syncs per layer
    const int64_t* pos = positions.data_ptr<int64_t>();
    const auto [low, high] = std::minmax_element(pos, pos + positions.numel());
    TORCH_CHECK(*low >= 0 && *high < cos_sin.size(0), "positions [", *low, ", ", *high,
                "] outside the rotary table of ", cos_sin.size(0));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding",
                                  [&] { rotary_impl<scalar_t>(positions, query, key, cos_sin, head_dim); });
}

// ---------------------------------------------------------------------------
// out = round(silu(gate)) * up, for x = [gate | up] of shape [T, 2I] (LlamaMLP's act(gate) * up).

template <typename scalar_t>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x_ptr + r * x.stride(0);
      scalar_t* orow = o_ptr + r * out.stride(0);
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (kVectorElementwise<scalar_t>) {
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= width; i += 16) {
          const __m512 g = load_lanes(xr + i);
          const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
          store_lanes(orow + i, _mm512_mul_ps(round_lanes<scalar_t>(silu), load_lanes(xr + width + i)));
        }
      }
#elif defined(S3_CPU_AVX2)
      if constexpr (std::is_same_v<scalar_t, float>) {  // fp32 on AVX2: was scalar exps, 5% of a batch-96 step
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= width; i += 8) {
          const __m256 g = _mm256_loadu_ps(xr + i);
          const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_poly8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
          _mm256_storeu_ps(orow + i, _mm256_mul_ps(silu, _mm256_loadu_ps(xr + width + i)));
        }
      }
#endif
      for (; i < width; ++i) {
        const float g = to_float(xr[i]);
        const float silu = g / (1.f + exp_poly(-g));
        orow[i] = static_cast<scalar_t>(rounded<scalar_t>(silu) * to_float(xr[width + i]));
      }
    }
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1), "x must be [T, 2I] for out [T, I]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "dtype mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_impl<scalar_t>(out, x); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin, int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}

}  // namespace s3_cpu
