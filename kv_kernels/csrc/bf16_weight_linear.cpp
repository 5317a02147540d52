// An fp32 linear that reads its weight in bf16: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 x, out, bias
// and arithmetic, W packed once by `kv_kernels.cpu_kernels.bf16_weight_pack`.
//
// On CPUs without bf16 instructions (AVX2 only: AMD Zen 1-3, Intel client cores) the engine computes in fp32,
// and a decode step of a few sequences is bound by reading the weights: fp32 weights are twice the bytes of
// the checkpoint's bf16 ones. This kernel keeps the weights in bf16 and widens them to fp32 in registers (a
// bf16 is the top half of an fp32), as llama.cpp does with 16-bit weights and OpenVINO with its fp16 export on
// such CPUs.
//
// Layout: W in panels of 16 output columns, each panel [K, 16] with a k's 16 weights in one 32-byte row,
// interleaved so that one load widens with two instructions: 32-bit lane i holds column i in its low half and
// column i + 8 in its high half (shift left 16: columns 0-7 as fp32; mask the low half: columns 8-15):
//
//     packed[p, k, 2 i] = W[16 p + i, k],  packed[p, k, 2 i + 1] = W[16 p + 8 + i, k]   (zero columns past N)
//
// The micro-kernel is an outer product: per k, the panel's 16 weights times up to 6 tokens' x[m, k]
// (broadcast) into 6 x 2 accumulators, so each widened weight feeds up to 6 FMAs (the arithmetic binds past a
// few tokens, not the loads). Threads split the panels; a thread's panel stays in L1/L2 while every block of
// 6 tokens passes over it. Any K and N; without AVX2 and FMA a plain loop reads the same layout.
#include "vector_math.h"

namespace s3_cpu {
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kPanel = 16;    // output columns per packed panel
constexpr int kTokenBlock = 6;    // tokens per micro-kernel call: 12 accumulators, 2 weights, 1 broadcast
constexpr int64_t kChunkBytes = 256 * 1024;  // x rows a thread keeps in L2 while its panels pass

#if defined(S3_CPU_AVX2)
// row[0 : cols] = the first cols of [lo | hi] (+ bias): the last panel, whose columns past N are padding
__attribute__((noinline)) void store_partial(float* row, __m256 lo, __m256 hi, const float* bias, int64_t cols) {
  alignas(32) float sums[kPanel];
  _mm256_store_ps(sums, lo);
  _mm256_store_ps(sums + 8, hi);
  for (int64_t c = 0; c < cols; ++c) row[c] = sums[c] + (bias != nullptr ? bias[c] : 0.f);
}

// out[m, n0 : n0 + cols] for m < MB from one panel; cols < 16 only for the last panel.
template <int MB>
inline void panel_tokens(const float* x, int64_t K, const bf16* panel, const float* bias, float* out, int64_t N,
                         int64_t n0, int64_t cols) {
  // few tokens: two sets of accumulators over even and odd k keep enough FMAs in flight for their latency
  constexpr int kSets = MB <= 3 ? 2 : 1;
  __m256 lo[kSets][MB], hi[kSets][MB];
#pragma GCC unroll 16
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) lo[s][m] = hi[s][m] = _mm256_setzero_ps();
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto* w = reinterpret_cast<const __m256i*>(panel);
  int64_t k = 0;
  for (; k + kSets <= K; k += kSets) {
#pragma GCC unroll 2
    for (int s = 0; s < kSets; ++s) {
      const __m256i raw = _mm256_loadu_si256(w + k + s);
      const __m256 w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));  // columns 0-7
      const __m256 w_hi = _mm256_castsi256_ps(_mm256_and_si256(raw, high_half));  // columns 8-15
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * K + k + s);
        lo[s][m] = _mm256_fmadd_ps(xv, w_lo, lo[s][m]);
        hi[s][m] = _mm256_fmadd_ps(xv, w_hi, hi[s][m]);
      }
    }
  }
  for (; k < K; ++k) {  // odd K with two sets
    const __m256i raw = _mm256_loadu_si256(w + k);
    const __m256 w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 w_hi = _mm256_castsi256_ps(_mm256_and_si256(raw, high_half));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      lo[0][m] = _mm256_fmadd_ps(xv, w_lo, lo[0][m]);
      hi[0][m] = _mm256_fmadd_ps(xv, w_hi, hi[0][m]);
    }
  }
  const bool whole = cols == kPanel;
  const __m256 b_lo = bias != nullptr && whole ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
  const __m256 b_hi = bias != nullptr && whole ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {  // unrolled: the accumulators stay registers (an indexed one would live in memory)
    __m256 sum_lo = lo[0][m], sum_hi = hi[0][m];
    if constexpr (kSets == 2) {
      sum_lo = _mm256_add_ps(sum_lo, lo[1][m]);
      sum_hi = _mm256_add_ps(sum_hi, hi[1][m]);
    }
    if (whole) {
      _mm256_storeu_ps(out + m * N + n0, _mm256_add_ps(sum_lo, b_lo));
      _mm256_storeu_ps(out + m * N + n0 + 8, _mm256_add_ps(sum_hi, b_hi));
    } else {
      store_partial(out + m * N + n0, sum_lo, sum_hi, bias == nullptr ? nullptr : bias + n0, cols);
    }
  }
}

// Tokens [m0, m0 + count) against one panel, count <= kTokenBlock.
inline void token_block(int64_t count, const float* x, int64_t K, const bf16* panel, const float* bias, float* out,
                        int64_t N, int64_t n0, int64_t cols) {
  switch (count) {
    case 6: panel_tokens<6>(x, K, panel, bias, out, N, n0, cols); break;
    case 5: panel_tokens<5>(x, K, panel, bias, out, N, n0, cols); break;
    case 4: panel_tokens<4>(x, K, panel, bias, out, N, n0, cols); break;
    case 3: panel_tokens<3>(x, K, panel, bias, out, N, n0, cols); break;
    case 2: panel_tokens<2>(x, K, panel, bias, out, N, n0, cols); break;
    case 1: panel_tokens<1>(x, K, panel, bias, out, N, n0, cols); break;
    default: break;
  }
}

void panels(const float* x, const bf16* packed, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
            int64_t begin, int64_t end) {
  // tokens in chunks whose x rows stay in L2 (~256 KB) while the thread's panels pass over them
  const int64_t chunk = std::max<int64_t>(kTokenBlock, (kChunkBytes / (4 * K)) / kTokenBlock * kTokenBlock);
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t rows = std::min(chunk, M - c0);
    // blocks of as even a size as fits: 16 tokens as 6 + 5 + 5, not 6 + 6 + 4 (small blocks run slower)
    const int64_t blocks = (rows + kTokenBlock - 1) / kTokenBlock;
    for (int64_t p = begin; p < end; ++p) {
      const bf16* panel = packed + p * K * kPanel;
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      int64_t m0 = c0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t count = rows / blocks + (b < rows % blocks ? 1 : 0);
        token_block(count, x + m0 * K, K, panel, bias, out + m0 * N, N, n0, cols);
        m0 += count;
      }
    }
  }
}
#else
void panels(const float* x, const bf16* packed, const float* bias, float* out, int64_t M, int64_t K, int64_t N,
            int64_t begin, int64_t end) {
  for (int64_t p = begin; p < end; ++p)
    for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
      const int64_t slot = c < 8 ? 2 * c : 2 * (c - 8) + 1;  // the interleave (see the layout above)
      for (int64_t m = 0; m < M; ++m) {
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * static_cast<float>(packed[(p * K + k) * kPanel + slot]);
        out[m * N + p * kPanel + c] = sum + (bias != nullptr ? bias[p * kPanel + c] : 0.f);
      }
    }
}
#endif

void bf16_weight_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && out.is_contiguous(),
              "bf16_weight_linear takes contiguous x, packed weight and out");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && out.dim() == 2,
              "bf16_weight_linear takes 2-D x and out and a packed weight [ceil(N / 16), K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kFloat,
              "bf16_weight_linear takes fp32 x and out and a bf16 packed weight");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "out must have x's ", M, " rows");
  TORCH_CHECK(packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(1) == K && packed.size(2) == kPanel,
              "packed weight must be [", (N + kPanel - 1) / kPanel, ", ", K, ", 16] for x [M, ", K, "] and out [M, ",
              N, "]");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous fp32 [", N, "]");
    bias_ptr = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const bf16* wp = packed.data_ptr<bf16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, packed.size(0), 4,
                   [&](int64_t begin, int64_t end) { panels(xp, wp, bias_ptr, op, M, K, N, begin, end); });
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
  m.def("bf16_weight_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("bf16_weight_linear_native() -> bool", &bf16_weight_linear_native);
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("bf16_weight_linear", &bf16_weight_linear);
}

}  // namespace s3_cpu
