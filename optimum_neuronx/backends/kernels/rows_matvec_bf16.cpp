// optimum_neuronx::rows_matvec_bf16 for AOTInductor on x86 CPUs with avx512_bf16 (see inductor_kernels.py).
//
// y[r, n] = sum_k x[r, k] * weight[n, k] for a few rows r (decode: one per sequence), bfloat16 in and out,
// float32 sums. Each weight row is read from memory once for all rows of x: one vdpbf16ps per row of x and
// 64-byte line of weight (32 products, summed in pairs into 16 float32 lanes). Inductor's own multiply + sum
// spends ~40 instructions per line at 4 rows (bf16 -> float conversions, separate multiplies and adds) and
// cannot keep up with memory; this loop spends 6.
//
// This file is spliced into the C++ wrapper of each graph that calls the op, inside `extern "C" { extern "C++"
// { ... } }`, so the compiled graph carries its own copy and loading it needs no extra library. The wrapper
// is compiled at -O1: the hot functions ask for -O3 themselves. OPTIMUM_NEURONX_ROW_PREFETCH_BYTES is defined
// in front of this file.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstdlib>

namespace optimum_neuronx_kernels {

constexpr int kMaxRows = 4;  // accumulators per weight row: 4 rows of x keep all loads within two per line
constexpr int64_t kLine = 32;  // bfloat16 elements per 64-byte line
constexpr int64_t kPrefetchAhead = OPTIMUM_NEURONX_ROW_PREFETCH_BYTES / 2;

inline uint16_t round_to_bf16(float value) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  if (value != value) return 0x7fc0;
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// Weight rows [n_begin, n_end) times R rows of x (64-byte aligned, each row zero-padded to k_padded).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"), optimize("O3"))) void dot_rows(
    const uint16_t* __restrict weight, const uint16_t* __restrict x, int64_t k, int64_t k_padded, int64_t n_out,
    int64_t n_begin, int64_t n_end, uint16_t* __restrict y) {
  const __mmask32 tail = static_cast<__mmask32>((1ull << (k % kLine)) - 1);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* row = weight + n * k;
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kLine <= k; i += kLine) {
      // Weights are read once per step: a non-temporal prefetch a few rows ahead keeps memory busy without
      // evicting anything (inductor_codegen.py measured the distance for Inductor's own loops).
      __builtin_prefetch(row + i + kPrefetchAhead, 0, 0);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(row + i);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_load_si512(x + r * k_padded + i));
    }
    if (i < k) {  // x is zero past k: the masked-off weights multiply zeros
      const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(tail, row + i);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_load_si512(x + r * k_padded + i));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) y[r * n_out + n] = round_to_bf16(_mm512_reduce_add_ps(acc[r]));
  }
}

template <int R>
void dot_rows_parallel(const uint16_t* weight, const uint16_t* x, int64_t k, int64_t k_padded, int64_t n_out,
                       uint16_t* y) {
#pragma omp parallel num_threads(omp_get_max_threads())
  {
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    dot_rows<R>(weight, x, k, k_padded, n_out, n_out * thread / threads, n_out * (thread + 1) / threads, y);
  }
}

// x copied into a 64-byte aligned, zero-padded buffer: unaligned 64-byte loads of x ran 2.7x slower at 4 rows.
// One buffer per calling thread, grown as needed and kept (a few KiB).
const uint16_t* aligned_rows(const uint16_t* x, int64_t rows, int64_t k, int64_t row_stride, int64_t col_stride,
                             int64_t k_padded) {
  static thread_local uint16_t* buffer = nullptr;
  static thread_local int64_t capacity = 0;
  if (capacity < rows * k_padded) {
    std::free(buffer);
    buffer = static_cast<uint16_t*>(std::aligned_alloc(64, rows * k_padded * sizeof(uint16_t)));
    capacity = buffer ? rows * k_padded : 0;
    if (!buffer) return nullptr;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k_padded; ++i) buffer[r * k_padded + i] = i < k ? x[r * row_stride + i * col_stride] : 0;
  return buffer;
}

}  // namespace optimum_neuronx_kernels

// AOTInductor's C shim for the op: named aoti_torch_cpu_<op name>, called directly by the graph's wrapper.
extern "C" AOTITorchError aoti_torch_cpu_rows_matvec_bf16(AtenTensorHandle x, AtenTensorHandle weight,
                                                          AtenTensorHandle* ret0) {
  namespace kernels = optimum_neuronx_kernels;
  int64_t x_dim, w_dim, *x_sizes, *x_strides, *w_sizes, *w_strides;
  int32_t x_dtype, w_dtype;
  void *x_data, *w_data, *y_data;
  aoti_torch_get_dim(x, &x_dim);
  aoti_torch_get_dim(weight, &w_dim);
  aoti_torch_get_dtype(x, &x_dtype);
  aoti_torch_get_dtype(weight, &w_dtype);
  if (x_dim != 2 || w_dim != 2 || x_dtype != aoti_torch_dtype_bfloat16() || w_dtype != x_dtype) return AOTI_TORCH_FAILURE;
  aoti_torch_get_sizes(x, &x_sizes);
  aoti_torch_get_strides(x, &x_strides);
  aoti_torch_get_sizes(weight, &w_sizes);
  aoti_torch_get_strides(weight, &w_strides);
  const int64_t rows = x_sizes[0], k = x_sizes[1], n_out = w_sizes[0];
  // The weight is streamed row by row: it must be dense [n_out, k] (graph constants are).
  if (w_sizes[1] != k || (n_out > 1 && w_strides[0] != k) || (k > 1 && w_strides[1] != 1)) return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {rows, n_out}, strides[2] = {n_out, 1};
  AOTITorchError status = aoti_torch_empty_strided(2, sizes, strides, x_dtype, aoti_torch_device_type_cpu(), 0, ret0);
  if (status != AOTI_TORCH_SUCCESS) return status;
  if (rows == 0 || n_out == 0) return AOTI_TORCH_SUCCESS;
  aoti_torch_get_data_ptr(x, &x_data);
  aoti_torch_get_data_ptr(weight, &w_data);
  aoti_torch_get_data_ptr(*ret0, &y_data);
  if (k == 0) {  // empty sums
    __builtin_memset(y_data, 0, rows * n_out * sizeof(uint16_t));
    return AOTI_TORCH_SUCCESS;
  }
  const int64_t k_padded = (k + kernels::kLine - 1) / kernels::kLine * kernels::kLine;
  const uint16_t* w = static_cast<const uint16_t*>(w_data);
  for (int64_t first = 0; first < rows; first += kernels::kMaxRows) {
    const int64_t count = rows - first < kernels::kMaxRows ? rows - first : kernels::kMaxRows;
    const uint16_t* xs = kernels::aligned_rows(static_cast<const uint16_t*>(x_data) + first * x_strides[0], count, k,
                                               x_strides[0], x_strides[1], k_padded);
    if (!xs) return AOTI_TORCH_FAILURE;
    uint16_t* y = static_cast<uint16_t*>(y_data) + first * n_out;
    switch (count) {
      case 1: kernels::dot_rows_parallel<1>(w, xs, k, k_padded, n_out, y); break;
      case 2: kernels::dot_rows_parallel<2>(w, xs, k, k_padded, n_out, y); break;
      case 3: kernels::dot_rows_parallel<3>(w, xs, k, k_padded, n_out, y); break;
      default: kernels::dot_rows_parallel<4>(w, xs, k, k_padded, n_out, y); break;
    }
  }
  return AOTI_TORCH_SUCCESS;
}
