// optimum_neuronx::int8_matvec for AOTInductor on x86 CPUs with AVX-512 or AVX2 (see custom_kernels.py).
//
// y[r, n] = scale[n] * sum_k x[r, k] * weight[n, k] for a few rows r (decode: one per sequence, or a verification
// pass's tokens): int8 weights (symmetric, per output channel), float32 scales, x and y bfloat16 or float32, float32
// sums. Each weight row is read once for all rows of x, widened to float32 in registers (never stored wider), so a
// step streams a quarter of float32's bytes. x is copied once per call into a zero-padded float32 buffer; the weight
// rows are handed to the threads in chunks as rows_matvec hands out its own (Shares, kChunkBytes: this file is spliced
// after rows_matvec.cpp), each prefetched OPTIMUM_NEURONX_ROW_PREFETCH_BYTES ahead with rows_matvec's hints.
#include "common.h"

namespace optimum_neuronx_kernels {

constexpr int kInt8MaxRows = 4;

#if OPTIMUM_NEURONX_DOT_AVX512
#define OPTIMUM_NEURONX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl"), optimize("O3")))
constexpr int64_t kInt8Step = 64;  // int8 weights per step: one 64-byte line, four 16-lane float32 vectors

template <int R>
OPTIMUM_NEURONX_INT8_TARGET void int8_rows(const int8_t* __restrict weight, const float* __restrict x, int64_t k,
                                           int64_t k_padded, int64_t n_begin, int64_t n_end, float* __restrict sums) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* row = weight + n * k;
    __m512 acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kInt8Step <= k; i += kInt8Step) {
      __builtin_prefetch(row + i + OPTIMUM_NEURONX_ROW_PREFETCH_BYTES, 0,
                         R == 1 ? OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY : OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY);
      __m512 w[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16 * j))));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
          acc[r][j] = _mm512_fmadd_ps(w[j], _mm512_load_ps(x + r * k_padded + i + 16 * j), acc[r][j]);
    }
    for (; i < k; i += 16) {  // the row's tail, 16 at a time; nothing read past the row (x is zero-padded)
      const int64_t left = k - i < 16 ? k - i : 16;
      const __m128i bytes = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << left) - 1), row + i);
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * k_padded + i), acc[r][0]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      sums[r * (n_end - n_begin) + (n - n_begin)] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
  }
}
#else
#define OPTIMUM_NEURONX_INT8_TARGET __attribute__((target("avx2,fma"), optimize("O3")))
constexpr int64_t kInt8Step = 32;  // four 8-lane float32 vectors

__attribute__((target("avx2,fma"), always_inline)) inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int R>
OPTIMUM_NEURONX_INT8_TARGET void int8_rows(const int8_t* __restrict weight, const float* __restrict x, int64_t k,
                                           int64_t k_padded, int64_t n_begin, int64_t n_end, float* __restrict sums) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* row = weight + n * k;
    __m256 acc[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + kInt8Step <= k; i += kInt8Step) {
      if (i % 64 == 0)
        __builtin_prefetch(row + i + OPTIMUM_NEURONX_ROW_PREFETCH_BYTES, 0,
                           R == 1 ? OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY : OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY);
      const __m256 w0 = widen8(row + i), w1 = widen8(row + i + 8), w2 = widen8(row + i + 16), w3 = widen8(row + i + 24);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * k_padded + i;
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_load_ps(xr), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_load_ps(xr + 8), acc[r][1]);
        acc[r][0] = _mm256_fmadd_ps(w2, _mm256_load_ps(xr + 16), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w3, _mm256_load_ps(xr + 24), acc[r][1]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_add_ps(acc[r][0], acc[r][1]);
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      float sum = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
      for (int64_t j = i; j < k; ++j) sum += static_cast<float>(row[j]) * x[r * k_padded + j];  // the row's tail
      sums[r * (n_end - n_begin) + (n - n_begin)] = sum;
    }
  }
}
#endif

template <typename Element>
inline Element int8_store(float value);
template <>
inline float int8_store<float>(float value) { return value; }
template <>
inline uint16_t int8_store<uint16_t>(float value) { return round_to_bf16(value); }

template <typename Element>
inline float int8_load(Element value);
template <>
inline float int8_load<float>(float value) { return value; }
template <>
inline float int8_load<uint16_t>(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  return out;
}

// y [rows, n_out] (Element: float or bfloat16 bits) from x [rows, k] (strides given) and weight [n_out, k] int8.
template <typename Element>
bool int8_matvec(const Element* x, const int64_t* x_strides, const int8_t* weight, const float* scale, int64_t rows,
                 int64_t k, int64_t n_out, Element* y) {
  const int64_t k_padded = (k + kInt8Step - 1) / kInt8Step * kInt8Step;
  float* xf = kept_buffer<float, 4>(rows * k_padded);
  if (!xf) return false;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; ++i) xf[r * k_padded + i] = int8_load<Element>(x[r * x_strides[0] + i * x_strides[1]]);
    for (int64_t i = k; i < k_padded; ++i) xf[r * k_padded + i] = 0.0f;
  }
  bool failed = false;
  Shares shares(n_out);
  const int64_t fitting = kChunkBytes / (k > 0 ? k : 1);
  const int64_t chunk = fitting > 1 ? fitting : 1;  // weight rows per chunk
#pragma omp parallel
  {
    float* sums = kept_buffer<float, 5>(rows * chunk);
    if (!sums) __atomic_store_n(&failed, true, __ATOMIC_RELAXED);
    if (sums)
      shares.take(n_out, chunk, [=](int64_t begin, int64_t end) {
        switch (rows) {
          case 1: int8_rows<1>(weight, xf, k, k_padded, begin, end, sums); break;
          case 2: int8_rows<2>(weight, xf, k, k_padded, begin, end, sums); break;
          case 3: int8_rows<3>(weight, xf, k, k_padded, begin, end, sums); break;
          default: int8_rows<4>(weight, xf, k, k_padded, begin, end, sums); break;
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t n = begin; n < end; ++n)
            y[r * n_out + n] = int8_store<Element>(sums[r * (end - begin) + (n - begin)] * scale[n]);
      });
  }
  return !failed;
}

}  // namespace optimum_neuronx_kernels

#undef OPTIMUM_NEURONX_INT8_TARGET

#ifndef OPTIMUM_NEURONX_KERNELS_NO_SHIMS
// AOTInductor's C shim for optimum_neuronx::int8_matvec: x [rows <= 4, k] bfloat16 or float32, weight [n_out, k]
// int8 (rows contiguous), scale [n_out] float32 -> y [rows, n_out] in x's dtype.
extern "C" AOTITorchError aoti_torch_cpu_int8_matvec(AtenTensorHandle x, AtenTensorHandle weight,
                                                     AtenTensorHandle scale, AtenTensorHandle* ret0) {
  namespace kernels = optimum_neuronx_kernels;
  int64_t x_dim, w_dim, s_dim, *x_sizes, *x_strides, *w_sizes, *w_strides, *s_sizes, *s_strides;
  int32_t x_dtype, w_dtype, s_dtype;
  void *x_data, *w_data, *s_data;
  aoti_torch_get_dim(x, &x_dim);
  aoti_torch_get_dim(weight, &w_dim);
  aoti_torch_get_dim(scale, &s_dim);
  if (x_dim != 2 || w_dim != 2 || s_dim != 1) return AOTI_TORCH_FAILURE;
  aoti_torch_get_dtype(x, &x_dtype);
  aoti_torch_get_dtype(weight, &w_dtype);
  aoti_torch_get_dtype(scale, &s_dtype);
  aoti_torch_get_sizes(x, &x_sizes);
  aoti_torch_get_strides(x, &x_strides);
  aoti_torch_get_sizes(weight, &w_sizes);
  aoti_torch_get_strides(weight, &w_strides);
  aoti_torch_get_sizes(scale, &s_sizes);
  aoti_torch_get_strides(scale, &s_strides);
  aoti_torch_get_data_ptr(x, &x_data);
  aoti_torch_get_data_ptr(weight, &w_data);
  aoti_torch_get_data_ptr(scale, &s_data);
  const bool bf16 = x_dtype == aoti_torch_dtype_bfloat16(), f32 = x_dtype == aoti_torch_dtype_float32();
  const int64_t rows = x_sizes[0], k = x_sizes[1], n_out = w_sizes[0];
  if (!(bf16 || f32) || w_dtype != aoti_torch_dtype_int8() || s_dtype != aoti_torch_dtype_float32() ||
      rows > kernels::kInt8MaxRows || w_sizes[1] != k || s_sizes[0] != n_out ||
      (k > 1 && w_strides[1] != 1) || (n_out > 1 && w_strides[0] != k) || (n_out > 1 && s_strides[0] != 1))
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[2] = {rows, n_out}, strides[2] = {n_out, 1};
  AOTITorchError status = aoti_torch_empty_strided(2, sizes, strides, x_dtype, aoti_torch_device_type_cpu(), 0, ret0);
  if (status != AOTI_TORCH_SUCCESS || rows == 0 || n_out == 0) return status;
  void* y_data;
  aoti_torch_get_data_ptr(*ret0, &y_data);
  const int8_t* w = static_cast<const int8_t*>(w_data);
  const float* s = static_cast<const float*>(s_data);
  const bool done =
      bf16 ? kernels::int8_matvec<uint16_t>(static_cast<const uint16_t*>(x_data), x_strides, w, s, rows, k, n_out,
                                            static_cast<uint16_t*>(y_data))
           : kernels::int8_matvec<float>(static_cast<const float*>(x_data), x_strides, w, s, rows, k, n_out,
                                         static_cast<float*>(y_data));
  return done ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}
#endif  // OPTIMUM_NEURONX_KERNELS_NO_SHIMS
