// A bf16 linear on AMX tiles for decode-sized batches: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias).
//
// A decode step multiplies every weight by one to a few dozen tokens, so it is bound by
// reading the weights. oneDNN's packed linears stream SmolLM2's 30 layers and head at
// 7-10 GB/s here from M = 1 to 32 (its AMX kernels are built for large M), of the
// machine's 19-24. This kernel streams a weight packed once for the tiles (`amx_pack` in
// kv_kernels/cpu_kernels.py) as one sequential read per 64 output columns, prefetched
// kPrefetchSlices slices ahead, at 14-15 GB/s at M = 1 to 16 and 10-11 at M = 32 (measured here):
//
//   packed [N_pad / 64, K / 32, 4, 16, 32] bf16: for each 64-column group and 32-deep slice
//   of K, four 1 KiB B tiles (16 columns each); tile row r holds, for its 16 columns c, the
//   pair weight[c, 2r], weight[c, 2r + 1] (the VNNI layout tdpbf16ps reads).
//
// Per group, each block of up to 16 token rows is an A tile; four C tiles (rows x 16 fp32)
// take the group's 64 columns. Past 16 tokens the next block re-reads the group from L2 and
// pays the tile loads again (they, not the multiplies, bound a block here), so M = 17
// costs about what M = 32 does. Output groups are split across threads (at::parallel_for);
// a thread configures its tiles (A and C with the block's rows) before its share. Sums are
// fp32 and rounded to bf16 once, after the bias, as oneDNN rounds.
//
// Without AMX in the build, or where Linux refuses the tile state, `amx_linear_native` is
// false and the engine keeps its other kernels (workers/engine/fast_decoder.py).
#include <cstdint>

#include "vector_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)  // AVX512-BF16: write_rows
#include <sys/syscall.h>
#include <unistd.h>
#define S3_AMX 1
#endif

namespace s3_cpu {
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kGroupColumns = 64;  // four C tiles of 16 columns
constexpr int64_t kSliceDepth = 32;    // K per tile step: 16 rows of bf16 pairs
constexpr int64_t kTokenRows = 16;     // rows of an A tile and of the C tiles
constexpr int64_t kTileElements = 16 * 32;
constexpr int64_t kSliceBytes = 4 * kTileElements * 2;  // four 1 KiB B tiles per 32-deep slice
constexpr int64_t kPrefetchSlices = 4;  // into L2, this many slices (16 KiB) ahead of the tile loads

#if defined(S3_AMX)
// Linux hands out the 8 KiB of tile state only to a process that asks (arch_prctl); once is enough.
bool tile_permission() {
  static const bool granted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tiles 0-3 and A tile 4 take `rows` token rows; B tiles 5-7 16 rows of pairs. All 64 bytes wide.
void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t < 5 ? rows : 16;
  }
  _tile_loadconfig(&config);
}

// Tiles: C 0-3, A 4, B 5-7. `x` has the configured rows (up to 16) of K (stride K); `group` is this group's
// packed slices; prefetches stop at `packed_end` (one past the last byte of the packed weight).
void group_block(const bf16* x, const bf16* group, uintptr_t packed_end, int64_t K, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride_bytes = K * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k = 0; k < K; k += kSliceDepth) {
    const bf16* b = group + (k / kSliceDepth) * 4 * kTileElements;
    // the prefetchers alone keep too few lines in flight (measured: 11 -> 15 GB/s); addresses as integers, so
    // none points past the buffer
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(b) + kPrefetchSlices * kSliceBytes;
    if (ahead < packed_end)
      for (int64_t line = 0; line < kSliceBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T1);
    _tile_loadd(4, x + k, stride_bytes);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + kTileElements, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 2 * kTileElements, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 3 * kTileElements, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  // sums [16, 64] fp32: C tile j holds columns 16j..16j+15
  _tile_stored(0, sums, kGroupColumns * sizeof(float));
  _tile_stored(1, sums + 16, kGroupColumns * sizeof(float));
  _tile_stored(2, sums + 32, kGroupColumns * sizeof(float));
  _tile_stored(3, sums + 48, kGroupColumns * sizeof(float));
}

// rows [rows, 64] fp32 sums (+ bias) rounded into out[m, n0 .. n0 + columns) of an [*, N] bf16 output
void write_rows(const float* sums, const bf16* bias, bf16* out, int64_t rows, int64_t N, int64_t n0,
                int64_t columns) {
  for (int64_t j = 0; j < columns; j += 16) {
    const int64_t width = std::min<int64_t>(16, columns - j);
    const __mmask16 mask = width == 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
    const __m512 b = bias != nullptr
        ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bias + n0 + j)) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + m * kGroupColumns + j), b);
      _mm256_mask_storeu_epi16(out + m * N + n0 + j, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

void groups(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t M, int64_t K, int64_t N,
            int64_t num_groups, int64_t begin, int64_t end) {
  int configured = 0;
  alignas(64) float sums[kTokenRows * kGroupColumns];
  const int64_t group_elements = (K / kSliceDepth) * 4 * kTileElements;
  const uintptr_t packed_end = reinterpret_cast<uintptr_t>(packed + num_groups * group_elements);
  for (int64_t g = begin; g < end; ++g) {
    const int64_t n0 = g * kGroupColumns;
    const int64_t columns = std::min(kGroupColumns, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kTokenRows) {
      const int64_t rows = std::min(kTokenRows, M - m0);
      if (rows != configured) {
        configure_tiles(rows);
        configured = rows;
      }
      group_block(x + m0 * K, packed + g * group_elements, packed_end, K, sums);
      write_rows(sums, bias, out + m0 * N, rows, N, n0, columns);
    }
  }
  _tile_release();
}
#endif

void amx_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous() && out.is_contiguous(),
              "amx_linear takes contiguous x, packed and out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && packed.dim() == 5, "amx_linear takes 2-D x and out, 5-D packed");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "amx_linear takes bf16 x, packed and out");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "out must have ", M, " rows for x [", M, ", ", K, "]");
  TORCH_CHECK(packed.size(0) * kGroupColumns >= N && packed.size(0) * kGroupColumns < N + kGroupColumns &&
                  packed.size(1) * kSliceDepth == K && packed.size(2) == 4 && packed.size(3) == 16 &&
                  packed.size(4) == 32,
              "packed must be amx_pack of a [", N, ", ", K, "] weight");
  const bf16* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous bf16 [", N, "]");
    bias_ptr = bias->data_ptr<bf16>();
  }
#if defined(S3_AMX)
  TORCH_CHECK(tile_permission(), "amx_linear: the kernel refused this process the AMX tile state");
  if (M == 0) return;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t num_groups = packed.size(0);
  at::parallel_for(0, num_groups, 1,
                   [&](int64_t begin, int64_t end) { groups(xp, wp, bias_ptr, op, M, K, N, num_groups, begin, end); });
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX (see amx_linear_native)");
#endif
}

// True when this build has the AMX kernel and the kernel grants the process the tile state.
bool amx_linear_native() {
#if defined(S3_AMX)
  return tile_permission();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(s3_cpu, m) {
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("amx_linear_native() -> bool", &amx_linear_native);
}

TORCH_LIBRARY_IMPL(s3_cpu, CPU, m) {
  m.impl("amx_linear", &amx_linear);
}

}  // namespace s3_cpu
