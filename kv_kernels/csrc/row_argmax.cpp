// Greedy decoding's pick on CPU: the index of each row's largest logit, registered as `s3_cpu::row_argmax`.
//
// torch.max(logits, dim=-1) reads SmolLM2's 49,152 bf16 logits at about one per nanosecond here (0.74 ms for 16
// rows, 3 ms for 64), a share of a decode step that grows with the batch. This keeps, per lane, the largest value
// seen and where (a strictly larger value replaces it, so each lane holds its first maximum), then takes the
// smallest index among the lanes holding the row's maximum: the first maximum, as torch gives it. A NaN wins, as
// in torch: a row with one returns its first NaN.

#include "vector_math.h"

namespace s3_cpu {
namespace {

// Goes on from position `from` with the first maximum before it (best_value at best_index, not a NaN): a strictly
// larger value replaces it, a NaN ends the scan.
template <typename scalar_t>
int64_t scan(const scalar_t* row, int64_t from, int64_t n, float best_value, int64_t best_index) {
  for (int64_t v = from; v < n; ++v) {
    const float x = to_float(row[v]);
    if (std::isnan(x)) return v;
    if (x > best_value) {
      best_value = x;
      best_index = v;
    }
  }
  return best_index;
}

// The whole row, one value at a time (it returns the first NaN, if any).
template <typename scalar_t>
int64_t argmax_scalar(const scalar_t* row, int64_t n) {
  const float first = to_float(row[0]);
  return std::isnan(first) ? 0 : scan(row, 1, n, first, 0);
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kVectorisesAny<scalar_t>) {
    if (n >= 16) {
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512 best = load16(row);
      __m512i where = lane;
      __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
      int64_t v = 16;
      for (; v + 16 <= n; v += 16) {
        const __m512 x = load16(row + v);
        const __mmask16 larger = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        best = _mm512_mask_mov_ps(best, larger, x);
        where = _mm512_mask_mov_epi32(where, larger, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(v))));
      }
      if (nan) return argmax_scalar(row, n);  // finds the first NaN
      const float best_value = _mm512_reduce_max_ps(best);
      const __mmask16 holding = _mm512_cmp_ps_mask(best, _mm512_set1_ps(best_value), _CMP_EQ_OQ);
      return scan(row, v, n, best_value, _mm512_mask_reduce_min_epi32(holding, where));  // the tail
    }
  }
#elif defined(S3_CPU_AVX2)
  if constexpr (kLoads8<scalar_t>) {
    if (n >= 8) {  // the same on 8 lanes
      const __m256i step = _mm256_set1_epi32(8);
      __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      __m256 best = load8(row);
      __m256i where = at;
      __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
      int64_t v = 8;
      for (; v + 8 <= n; v += 8) {
        at = _mm256_add_epi32(at, step);
        const __m256 x = load8(row + v);
        const __m256 larger = _mm256_cmp_ps(x, best, _CMP_GT_OQ);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        best = _mm256_blendv_ps(best, x, larger);
        where = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(at), larger));
      }
      if (_mm256_movemask_ps(nan)) return argmax_scalar(row, n);  // finds the first NaN
      const float best_value = hmax8(best);
      alignas(32) float values[8];
      alignas(32) int32_t indices[8];
      _mm256_store_ps(values, best);
      _mm256_store_si256(reinterpret_cast<__m256i*>(indices), where);
      int64_t first = n;
      for (int j = 0; j < 8; ++j) {
        if (values[j] == best_value) first = std::min<int64_t>(first, indices[j]);
      }
      return scan(row, v, n, best_value, first);  // the tail
    }
  }
#endif
  return argmax_scalar(row, n);
}

at::Tensor row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "row_argmax takes CPU logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "row_argmax takes logits [N, V] with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31), "row_argmax needs 1 to 2^31 - 1 columns");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out_ptr = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "row_argmax", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    // a row is a few microseconds: four or more to a thread
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out_ptr[r] = argmax_row(base + r * stride, n);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("row_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("row_argmax", &row_argmax);
}

}  // namespace s3_cpu
