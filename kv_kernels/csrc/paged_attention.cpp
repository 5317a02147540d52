// Paged attention of the S3 engine on CPU: the KV append and ragged paged attention
// (decodes and prefill chunks in one call, one work item per sequence x query tile,
// no Python loop), registered as torch ops `s3_cpu::append_kv` and `s3_cpu::paged_attention`.
// Semantics: kv_kernels/reference.py, which the tests compare them with.

#include "vector_math.h"

namespace s3_cpu {
namespace {

// ---------------------------------------------------------------------------
// KV append: key/value [T, KVH, D] rows into their slots of k_cache/v_cache
// [NB, BS, KVH, D]; a negative slot skips the token (padding).

template <typename scalar_t>
void append_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);  // KVH * D, contiguous within a token
  const int64_t key_stride = key.stride(0), value_stride = value.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k_src = key.data_ptr<scalar_t>();
  const scalar_t* v_src = value.data_ptr<scalar_t>();
  scalar_t* k_dst = k_cache.data_ptr<scalar_t>();
  scalar_t* v_dst = v_cache.data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      std::memcpy(k_dst + slot * row, k_src + t * key_stride, row * sizeof(scalar_t));
      std::memcpy(v_dst + slot * row, v_src + t * value_stride, row * sizeof(scalar_t));
    }
  });
}

void append_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_mapping) {
  check_cpu(key, "key");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [T, KVH, D] of one shape");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key/value rows must be contiguous within a token");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be int64");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "key/value dtype must match the cache dtype ", k_cache.scalar_type());
  TORCH_CHECK(slot_mapping.numel() == key.size(0), "slot_mapping needs one slot per token");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "append_kv",
                                  [&] { append_kv_impl<scalar_t>(key, value, k_cache, v_cache, slot_mapping); });
}

// ---------------------------------------------------------------------------
// Ragged paged attention.
//
//   query:           [T, H, D], tokens of sequence s at query_start_loc[s] .. [s+1]
//   k_cache/v_cache: [NB, BS, KVH, D]
//   block_tables:    [S, W] int32
//   query_start_loc: [S + 1] int32
//   seq_lens:        [S] int32, tokens in the cache after this step (prefix + chunk)
//   window:          0, or a sliding window: a query sees only its last `window` keys
//   out:             [T, H, D]
//
// Query token j of a chunk of q_len sits at position seq_len - q_len + j and attends
// to cache positions 0 ..= that position (its chunk's K/V must be appended first),
// or to the last `window` of them.
// Work item = (sequence, tile of up to kQueryTile queries): every query head of the
// tile shares each cache row read.

struct WorkItem {
  int32_t seq;
  int32_t q_begin;  // chunk-relative query range [q_begin, q_end)
  int32_t q_end;
  int64_t cost;
};

constexpr int kQueryTile = 8;

// One work item: the tile's query tokens x every head. Both passes walk the sequence's
// blocks once, each token's row of all KV heads in one go (rows of one token are
// contiguous): measured on a 1 GiB pool, this reads KV at 9.5 GB/s against 6 GB/s for a
// walk per KV head, whose strided rows the hardware prefetchers fetch in full anyway.
//
//   scores[row][pos] = scale * q[row] . k[pos, head(row)]      row = r * num_heads + h
//   out[row]         = sum_pos softmax(scores[row])[pos] * v[pos, head(row)]
template <typename scalar_t, int HEAD_DIM>
void attend_item(const WorkItem& item, const scalar_t* query, int64_t q_stride_t, int64_t q_stride_h,
                 const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* block_table, int64_t block_size,
                 int64_t num_kv_heads, int64_t dynamic_head_dim, int64_t group, int64_t q_start, int64_t seq_len,
                 int64_t q_len, float scale, int64_t window, scalar_t* out, int64_t o_stride_t, int64_t o_stride_h,
                 std::vector<float>& scratch) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : dynamic_head_dim;
  const int64_t num_queries = item.q_end - item.q_begin;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t rows = num_queries * num_heads;
  const int64_t first_pos = seq_len - q_len + item.q_begin;  // position of the tile's first query
  const int64_t max_ctx = first_pos + num_queries;            // keys the tile's last query sees
  const int64_t score_stride = (max_ctx + 15) / 16 * 16;
  const int64_t row_floats = (head_dim + 15) / 16 * 16;  // rows start 64-byte aligned
  constexpr bool bf16_dot = kHasBf16Dot && std::is_same_v<scalar_t, c10::BFloat16>;
  const bool use_bf16_dot = bf16_dot && head_dim % 32 == 0;
  // scratch (64-byte aligned parts): q as float [rows, row_floats] | q as bf16 [rows, row_floats] (bf16 only)
  //   | scores [rows, score_stride] | acc [rows, row_floats] | staging [row_floats]
  const size_t needed = rows * row_floats * 3 + rows * score_stride + row_floats + 16;
  if (scratch.size() < needed) scratch.resize(needed);
  float* q = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  c10::BFloat16* q_bf16 = reinterpret_cast<c10::BFloat16*>(q + rows * row_floats);
  float* scores = q + rows * row_floats * 2;
  float* acc = scores + rows * score_stride;
  float* staging = acc + rows * row_floats;
  for (int64_t r = 0; r < num_queries; ++r) {
    const int64_t token = q_start + item.q_begin + r;
    for (int64_t h = 0; h < num_heads; ++h) {
      const scalar_t* src = query + token * q_stride_t + h * q_stride_h;
      const int64_t row = r * num_heads + h;
      if (use_bf16_dot) {
        std::memcpy(q_bf16 + row * row_floats, src, head_dim * sizeof(c10::BFloat16));
      } else {
        convert_row(q + row * row_floats, src, head_dim);
      }
    }
  }
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_bytes = block_size * token_stride * static_cast<int64_t>(sizeof(scalar_t));
  // body(pos, first_row, token_row) for every cached position the tile sees, block by block;
  // first_row is the first query of the tile that sees pos. The next block lies anywhere in the
  // pool, where the hardware prefetchers cannot follow: it is fetched while this one is read
  // (measured in the engine, alternating steps in one process: decode steps 2-8% shorter from
  // batch 1 to 128; two blocks ahead gained less).
  auto for_each_token = [&](const scalar_t* cache, auto&& body) {
    const int64_t num_blocks = (max_ctx + block_size - 1) / block_size;
    auto block_rows = [&](int64_t b) {  // block b's first token row in `cache`
      return cache + static_cast<int64_t>(block_table[b]) * block_size * token_stride;
    };
    for (int64_t b = 0; b < num_blocks; ++b) {
      const scalar_t* token_row = block_rows(b);
      if (b + 1 < num_blocks) {
        const char* next = reinterpret_cast<const char*>(block_rows(b + 1));
        for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(next + line, 0, 3);
      }
      const int64_t pos0 = b * block_size;
      const int64_t in_block = std::min(block_size, max_ctx - pos0);
      for (int64_t o = 0; o < in_block; ++o, token_row += token_stride) {
        const int64_t pos = pos0 + o;
        body(pos, pos <= first_pos ? 0 : pos - first_pos, token_row);
      }
    }
  };
  // Pass 1: scores. Query r sees positions [0, first_pos + r].
  for_each_token(k_cache, [&](int64_t pos, int64_t first_row, const scalar_t* token_row) {
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      const scalar_t* key = token_row + kvh * head_dim;
      if constexpr (bf16_dot) {
        if (use_bf16_dot) {
          for (int64_t r = first_row; r < num_queries; ++r) {
            for (int64_t g = 0; g < group; ++g) {
              const int64_t row = r * num_heads + kvh * group + g;
              scores[row * score_stride + pos] = scale * dot_bf16(q_bf16 + row * row_floats, key, head_dim);
            }
          }
          continue;
        }
      }
      convert_row(staging, key, head_dim);
      for (int64_t r = first_row; r < num_queries; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = r * num_heads + kvh * group + g;
          scores[row * score_stride + pos] = scale * dot_f32(q + row * row_floats, staging, head_dim);
        }
      }
    }
  });
  for (int64_t r = 0; r < num_queries; ++r) {
    // A query sees keys 0 .. its position; with a sliding window only the last `window` of them.
    const int64_t seen = first_pos + r + 1;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, seen - window) : 0;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* row = scores + (r * num_heads + h) * score_stride;
      std::fill(row, row + lo, 0.f);  // weight 0 in pass 2
      softmax_inplace(row + lo, seen - lo);
    }
  }
  // Pass 2: weighted values.
  std::fill(acc, acc + rows * row_floats, 0.f);
  for_each_token(v_cache, [&](int64_t pos, int64_t first_row, const scalar_t* token_row) {
    for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
      convert_row(staging, token_row + kvh * head_dim, head_dim);
      for (int64_t r = first_row; r < num_queries; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = r * num_heads + kvh * group + g;
          axpy_f32(acc + row * row_floats, scores[row * score_stride + pos], staging, head_dim);
        }
      }
    }
  });
  for (int64_t r = 0; r < num_queries; ++r) {
    const int64_t token = q_start + item.q_begin + r;
    for (int64_t h = 0; h < num_heads; ++h) {
      scalar_t* dst = out + token * o_stride_t + h * o_stride_h;
      const float* src = acc + (r * num_heads + h) * row_floats;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d]);
    }
  }
}

template <typename scalar_t>
void paged_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                          const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_width = block_tables.size(1);

  std::vector<WorkItem> items;
  items.reserve(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    const int64_t first_pos = lens[s] - q_len;
    TORCH_CHECK(q_len >= 0 && first_pos >= 0, "sequence ", s, ": seq_len ", lens[s], " < query length ", q_len);
    TORCH_CHECK((lens[s] + block_size - 1) / block_size <= table_width, "sequence ", s, ": seq_len ", lens[s],
                " needs more blocks than block_tables has columns (", table_width, ")");
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryTile) {
      const int64_t q1 = std::min<int64_t>(q_len, q0 + kQueryTile);
      const int64_t cost = (q1 - q0) * (first_pos + q1) + 64;
      items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(q0), static_cast<int32_t>(q1), cost});
    }
  }
  if (items.empty()) return;
  // Longest-processing-time-first assignment to threads: items differ by orders of magnitude
  // (a decode vs a prefill tile late in a long prompt), so even splits would leave a core idle.
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  std::vector<std::vector<int64_t>> per_thread(num_threads);
  std::vector<int64_t> load(num_threads, 0);
  for (int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    per_thread[t].push_back(i);
    load[t] += items[i].cost;
  }
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i : per_thread[t]) {
        const WorkItem& item = items[i];
        const int64_t s = item.seq;
        auto attend = head_dim == 64 ? &attend_item<scalar_t, 64>
                      : head_dim == 128 ? &attend_item<scalar_t, 128> : &attend_item<scalar_t, 0>;
        attend(item, q_ptr, query.stride(0), query.stride(1), k_ptr, v_ptr, tables + s * table_width, block_size,
               num_kv_heads, head_dim, group, starts[s], lens[s], starts[s + 1] - starts[s],
               static_cast<float>(scale), window, o_ptr, out.stride(0), out.stride(1), scratch);
      }
    }
  });
}

void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale, int64_t window, at::Tensor& out) {
  check_cpu(query, "query");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: the whole context), got ", window);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with unit last stride");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1, "out must match query's shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, cache and out must share a dtype");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "query_start_loc and seq_lens: contiguous int32");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc needs num_seqs + 1 entries");
  TORCH_CHECK(block_tables.size(0) >= seq_lens.size(0), "block_tables needs a row per sequence");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window,
                                   out);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("append_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("append_kv", &append_kv);
  m.impl("paged_attention", &paged_attention);
}

}  // namespace s3_cpu
