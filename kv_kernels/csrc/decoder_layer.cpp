// One Llama-shaped decoder layer in one call: the fp32 engine over bf16 weights (`s3_cpu.bf16_weight_linear`) on
// AVX2-only CPUs, for steps of up to that kernel's tokens (workers/engine/fast_decoder.py).
//
// At a few tokens a layer's arithmetic takes ~0.3 ms on a 135M model, and its ~25 tensor ops called one by one
// from Python cost 2-4 us each on top: ~2-3 ms of a 16 ms step at batch 1 (Zen 3). This op runs the same ops,
// in the same order and on the same kernels, through the dispatcher from C++:
//
//     residual += hidden ; hidden = rms_norm(residual)          fused_add_rms_norm (the first layer: rms_norm)
//     q | k | v = hidden @ W_qkv (+ b)                           bf16_weight_linear
//     rotate q, k ; append k, v to the pool ; attend            rotary_embedding, append_kv, paged_attention
//     hidden = o @ W_o (+ b) ; residual += hidden ; rms_norm     bf16_weight_linear, fused_add_rms_norm
//     hidden = silu(gate) * up @ W_down                          bf16_weight_linear, silu_and_mul, bf16_weight_linear
//
// so its results are those of the ops called from Python, bit for bit (the tests compare them).
#include <chrono>

#include "vector_math.h"

namespace s3_cpu {
namespace {

using Linear = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
using RmsNorm = void(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Norm = void(at::Tensor&, at::Tensor&, const at::Tensor&, double);
using Rotary = void(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, int64_t);
using Append = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using Attend = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, double, int64_t, at::Tensor&);
using Act = void(at::Tensor&, const at::Tensor&);

// The registered ops, looked up once (the registry does not change while the library is loaded).
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features) {
  static const auto run = op<Linear>("s3_cpu::bf16_weight_linear");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  run.call(out, x, packed, bias);
  return out;
}

// hidden [T, hidden] fp32: the previous layer's output (first: any buffer of that shape, overwritten by
// rms_norm(residual)); residual [T, hidden] fp32; both updated; returns the layer's output [T, hidden].
// attention_seconds: a float64 scalar the time spent in append_kv and paged_attention is added to (the step
// profile's "attention").
at::Tensor decoder_layer(at::Tensor& hidden, at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& input_norm, const at::Tensor& qkv_weight,
                         const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
                         const c10::optional<at::Tensor>& o_bias, const at::Tensor& mlp_norm,
                         const at::Tensor& gate_up_weight, const at::Tensor& down_weight, const at::Tensor& cos_sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                         const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double eps, double scale, int64_t window, at::Tensor& attention_seconds, bool first) {
  static const auto norm = op<RmsNorm>("s3_cpu::rms_norm");
  static const auto add_norm = op<Norm>("s3_cpu::fused_add_rms_norm");
  static const auto rotary = op<Rotary>("s3_cpu::rotary_embedding");
  static const auto append = op<Append>("s3_cpu::append_kv");
  static const auto attend = op<Attend>("s3_cpu::paged_attention");
  static const auto act = op<Act>("s3_cpu::silu_and_mul");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat,
              "decoder_layer runs fp32 hidden states");
  TORCH_CHECK(attention_seconds.scalar_type() == at::kDouble && attention_seconds.numel() == 1,
              "attention_seconds must be a float64 scalar");
  const int64_t tokens = hidden.size(0), width = hidden.size(1);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t intermediate = down_weight.size(1);  // the down projection's inputs

  if (first) {
    norm.call(hidden, residual, input_norm, eps);
  } else {
    add_norm.call(hidden, residual, input_norm, eps);
  }
  at::Tensor qkv = linear(hidden, qkv_weight, qkv_bias, q_width + 2 * kv_width);  // [T, q | k | v]
  at::Tensor q = qkv.narrow(1, 0, q_width), k = qkv.narrow(1, q_width, kv_width);
  at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width);
  rotary.call(positions, q, k, cos_sin, head_dim);
  const auto start = std::chrono::steady_clock::now();
  append.call(k.view({tokens, num_kv_heads, head_dim}), v.view({tokens, num_kv_heads, head_dim}), k_cache, v_cache,
              slot_mapping);
  at::Tensor query = q.view({tokens, num_heads, head_dim});
  at::Tensor attended = at::empty({tokens, num_heads, head_dim}, hidden.options());
  attend.call(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window, attended);
  *attention_seconds.data_ptr<double>() +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  at::Tensor out = linear(attended.view({tokens, q_width}), o_weight, o_bias, width);
  add_norm.call(out, residual, mlp_norm, eps);
  at::Tensor gate_up = linear(out, gate_up_weight, c10::nullopt, 2 * intermediate);  // [T, gate | up]
  at::Tensor activated = at::empty({tokens, intermediate}, hidden.options());
  act.call(activated, gate_up);
  return linear(activated, down_weight, c10::nullopt, width);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("decoder_layer(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, Tensor input_norm, "
        "Tensor qkv_weight, Tensor? qkv_bias, Tensor o_weight, Tensor? o_bias, Tensor mlp_norm, "
        "Tensor gate_up_weight, Tensor down_weight, Tensor cos_sin, Tensor(c!) k_cache, Tensor(d!) v_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int num_heads, "
        "int num_kv_heads, int head_dim, float eps, float scale, int window, Tensor(e!) attention_seconds, "
        "bool first) -> Tensor");
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
}

}  // namespace s3_cpu
