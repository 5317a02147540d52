// Structured output's token mask on CPU (workers/engine/grammar_masks.py): set every logit a row's grammar does not allow
// to -inf, reading the grammar engine's bitmask (bit i of int32 word w allows token 32 * w + i). A word of all ones
// (most of a free-text position) costs one compare; only mixed words are read bit by bit. torch's masked_fill over
// an unpacked [rows, vocab] bool mask took 4-5 ms at 64 rows of SmolLM2's 49,152 tokens; this takes a fraction.
// Registered as the torch op `s3_cpu::mask_disallowed_`.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

namespace s3_cpu {
namespace {

void mask_disallowed_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [R]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0),
              "bitmask must be int32 [R, W], one row per entry of rows");
  const int64_t vocab = logits.size(1);
  const int64_t words = bitmask.size(1);
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int32_t* mask_ptr = bitmask.data_ptr<int32_t>();
  float* logit_ptr = logits.data_ptr<float>();
  const int64_t logit_stride = logits.stride(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    TORCH_CHECK(row_ptr[r] >= 0 && row_ptr[r] < logits.size(0), "row index out of range");
  }
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* out = logit_ptr + row_ptr[r] * logit_stride;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(mask_ptr + r * words);
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32;
        const int64_t stop = std::min<int64_t>(32, vocab - base);
        for (int64_t b = 0; b < stop; ++b) {
          if (!((word >> b) & 1u)) out[base + b] = neg_inf;
        }
      }
      for (int64_t t = words * 32; t < vocab; ++t) out[t] = neg_inf;  // past the grammar's vocabulary
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("mask_disallowed_(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()");
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("mask_disallowed_", &mask_disallowed_);
}

}  // namespace s3_cpu
