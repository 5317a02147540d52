// A bf16 linear for few tokens: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), fp32 accumulation.
//
// Decoding one sequence reads every weight once per step and multiplies it by a single
// token, so the step is bound by memory bandwidth. oneDNN's packed bf16 linear streams its
// weights at 10-14 GB/s here at M = 1 (its AMX kernels are built for large M), of the
// machine's 19-24. This kernel streams the plain row-major weight: each 32-element slice of
// 8 weight rows is loaded once and dotted (vdpbf16ps, bf16 pairs into fp32) with up to 2
// token rows; more tokens re-read the 8 rows from L1 for the next 2. Output rows are split
// across threads (at::parallel_for). The sum is rounded to bf16 once, after the bias, as
// oneDNN rounds. From 2 tokens on oneDNN is as fast or faster. The engine uses this kernel on CPUs with
// AVX512-BF16 but no AMX; with AMX, amx_linear.cpp's kernel is faster from 1 token on.
//
// Built without AVX512-BF16 it is a plain loop (correct, slow), and `small_linear_native`
// says so: the engine then keeps oneDNN (workers/engine/fast_decoder.py).
#include "vector_math.h"

namespace s3_cpu {
namespace {

using bf16 = c10::BFloat16;
constexpr int kTokenBlock = 2;   // token rows sharing one load of the weight slice
constexpr int kWeightBlock = 8;  // weight rows in flight: 8 streams, and independent dot chains hide vdpbf16ps latency

#if defined(__AVX512BF16__)
inline __m512bh load_pairs(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[m, n0 + r] for m < MB, r < NB: the dots of MB token rows with NB weight rows.
template <int MB, int NB>
inline void dot_block(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t K, int64_t N,
                      int64_t n0) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh wv[NB];
    for (int r = 0; r < NB; ++r) wv[r] = load_pairs(w + (n0 + r) * K + k, mask);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = load_pairs(x + m * K + k, mask);
      for (int r = 0; r < NB; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < NB; ++r) {
      const float b = bias != nullptr ? static_cast<float>(bias[n0 + r]) : 0.f;
      out[m * N + n0 + r] = bf16(_mm512_reduce_add_ps(acc[m][r]) + b);
    }
}

template <int NB>
inline void token_blocks(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t M, int64_t K, int64_t N,
                         int64_t n0) {
  // every token block against the same NB weight rows: after the first, they come from L1
  for (int64_t m0 = 0; m0 < M; m0 += kTokenBlock) {
    const bf16* xm = x + m0 * K;
    bf16* om = out + m0 * N;
    if (M - m0 >= 2) {
      dot_block<2, NB>(xm, w, bias, om, K, N, n0);
    } else {
      dot_block<1, NB>(xm, w, bias, om, K, N, n0);
    }
  }
}

void weight_rows(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t M, int64_t K, int64_t N,
                 int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kWeightBlock <= end; n += kWeightBlock) token_blocks<kWeightBlock>(x, w, bias, out, M, K, N, n);
  for (; n < end; ++n) token_blocks<1>(x, w, bias, out, M, K, N, n);
}
#else
void weight_rows(const bf16* x, const bf16* w, const bf16* bias, bf16* out, int64_t M, int64_t K, int64_t N,
                 int64_t begin, int64_t end) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = begin; n < end; ++n) {
      float sum = bias != nullptr ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<float>(x[m * K + k]) * static_cast<float>(w[n * K + k]);
      out[m * N + n] = bf16(sum);
    }
}
#endif

void small_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "small_linear takes contiguous x, weight and out");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "small_linear takes 2-D x, weight and out");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "small_linear takes bf16 x, weight and out");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "weight must be [N, ", K, "] for x [M, ", K, "]");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [", M, ", ", N, "]");
  const bf16* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous bf16 [", N, "]");
    bias_ptr = bias->data_ptr<bf16>();
  }
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  // threads split the weight rows (each reads its share of the weight once); grain: 64 rows
  at::parallel_for(0, N, 64,
                   [&](int64_t begin, int64_t end) { weight_rows(xp, wp, bias_ptr, op, M, K, N, begin, end); });
}

// True when this build streams with vdpbf16ps (compiled for a CPU with AVX512-BF16).
bool small_linear_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("small_linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.def("small_linear_native() -> bool", &small_linear_native);
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("small_linear", &small_linear);
}

}  // namespace s3_cpu
