// An fp32 linear that reads its weight in bf16: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), fp32 x, out,
// bias and arithmetic.
//
// On CPUs without bf16 instructions (AVX2 only: AMD Zen 1-3, Intel client cores) the engine computes in
// fp32, and a decode step of a few sequences is bound by reading the weights: fp32 weights are twice the
// bytes of the checkpoint's bf16 ones. This kernel keeps the weights in bf16 and widens each 8-element slice
// to fp32 in registers (a bf16 is the top half of an fp32: zero-extend and shift), as llama.cpp does with
// 16-bit weights and OpenVINO with its fp16 export on such CPUs. Each slice of NB weight rows is loaded once
// per 2 token rows; more tokens re-read it from L1. Output rows are split across threads.
//
// Built without AVX2 and FMA, or for K not a multiple of 8, it runs a plain loop (correct, slow);
// `bf16_weight_linear_native` says whether this build has the fast path.
#include "vector_math.h"

namespace s3_cpu {
namespace {

using bf16 = c10::BFloat16;
constexpr int kTokenBlock = 2;   // token rows sharing one load of the weight slice
constexpr int kWeightBlock = 4;  // weight rows in flight: 2 x 4 accumulators, 4 widened slices, 1 token slice

#if defined(S3_CPU_AVX2)
// out[m, n0 + r] for m < MB, r < NB: the dots of MB token rows with NB weight rows.
template <int MB, int NB>
inline void dot_block(const float* x, const bf16* w, const float* bias, float* out, int64_t K, int64_t N,
                      int64_t n0) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = load8(w + (n0 + r) * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < NB; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) out[m * N + n0 + r] = hsum8(acc[m][r]) + (bias != nullptr ? bias[n0 + r] : 0.f);
}

template <int NB>
inline void token_blocks(const float* x, const bf16* w, const float* bias, float* out, int64_t M, int64_t K,
                         int64_t N, int64_t n0) {
  // every token block against the same NB weight rows: after the first, they come from L1
  for (int64_t m0 = 0; m0 < M; m0 += kTokenBlock) {
    if (M - m0 >= 2) {
      dot_block<2, NB>(x + m0 * K, w, bias, out + m0 * N, K, N, n0);
    } else {
      dot_block<1, NB>(x + m0 * K, w, bias, out + m0 * N, K, N, n0);
    }
  }
}
#endif

void plain_rows(const float* x, const bf16* w, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
                int64_t begin, int64_t end) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = begin; n < end; ++n) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * static_cast<float>(w[n * K + k]);
      out[m * N + n] = sum + (bias != nullptr ? bias[n] : 0.f);
    }
}

void weight_rows(const float* x, const bf16* w, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
                 int64_t begin, int64_t end) {
#if defined(S3_CPU_AVX2)
  if (K % 8 == 0) {
    int64_t n = begin;
    for (; n + kWeightBlock <= end; n += kWeightBlock) token_blocks<kWeightBlock>(x, w, bias, out, M, K, N, n);
    for (; n < end; ++n) token_blocks<1>(x, w, bias, out, M, K, N, n);
    return;
  }
#endif
  plain_rows(x, w, bias, out, M, K, N, begin, end);
}

void bf16_weight_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "bf16_weight_linear takes contiguous x, weight and out");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "bf16_weight_linear takes 2-D x, weight and out");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kFloat,
              "bf16_weight_linear takes fp32 x and out and a bf16 weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must be [N, ", K, "] for x [M, ", K, "]");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [", M, ", ", N, "]");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous fp32 [", N, "]");
    bias_ptr = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const bf16* wp = weight.data_ptr<bf16>();
  float* op = out.data_ptr<float>();
  // threads split the weight rows (each reads its share of the weight once); grain: 64 rows
  at::parallel_for(0, N, 64,
                   [&](int64_t begin, int64_t end) { weight_rows(xp, wp, bias_ptr, op, M, K, N, begin, end); });
}

// True when this build widens the weights on AVX2 lanes (compiled for a CPU with AVX2 and FMA but no AVX-512).
bool bf16_weight_linear_native() {
#if defined(S3_CPU_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("bf16_weight_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("bf16_weight_linear_native() -> bool", &bf16_weight_linear_native);
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("bf16_weight_linear", &bf16_weight_linear);
}

}  // namespace s3_cpu
