// optimum_neuronx::rows_matvec for AOTInductor on x86 CPUs with AVX-512 (see inductor_kernels.py).
//
// y[r, n] = sum_k x[r, k] * weight[n, k] for a few rows r (decode: one per sequence), float32 sums, in and out
// either bfloat16 (needs avx512_bf16) or float32. Each weight row is read from memory once for all rows of x:
// one instruction per row of x and 64-byte line of weight (bfloat16: vdpbf16ps, 32 products summed in pairs
// into 16 float32 lanes; float32: one fused multiply-add of 16 lanes). Inductor's own multiply + sum spends ~40
// instructions per line at 4 bfloat16 rows (conversions, separate multiplies and adds) and cannot keep up with
// memory; oneDNN keeps up but spends ~14 us per call outside its kernel, a fifth of a SmolLM2 step at batch 4.
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

constexpr int kMaxRows = 4;  // rows of x per pass over the weight (one accumulator each per weight row)
constexpr int64_t kLineBytes = 64;

inline uint16_t round_to_bf16(float value) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  if (value != value) return 0x7fc0;
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// One element type's 64-byte line: load a weight line (whole, or its first `count` elements), multiply it by a
// line of x and add to 16 float32 lanes, round a float32 sum to an element.
// kBlockRows: weight rows per block for several rows of x (dot_block). Measured on SmolLM2's projections, 2 threads,
// a slow memory phase (~24 GB/s): at 4 float32 rows, blocks of 4 ran its batch-4 token graph 11% faster than
// oneDNN (one row at a time: 1%) and streamed the projections 1.5x faster with weights in cache; at 4 bfloat16
// rows, blocks of 4 ran the token graph 4-7% slower than one row at a time (bfloat16 lines hold twice the inputs
// for the same multiply-adds: the loop is further from its compute limit). At 1 row, single weight rows stream
// memory ~10% faster than blocks.
// kPieceBytes: the most input bytes (all rows of x) one pass over the weight rows takes (piece_columns; 0: whole
// rows). Measured on the 1.1B shape's projections (22 layers of each from memory, 2 threads, a slow memory phase,
// ~32 GB/s), against one row of x: 4 bfloat16 rows of 5632 (45 KiB) whole streamed at 0.64x, in pieces of at most
// 24 KiB 0.98x, 16 KiB 0.93x, 8 KiB 0.80x; rows of 2048 (16 KiB) whole 1.0x. Blocks of 4 float32 weight rows load
// each line of x once per 4 weight lines: whole rows of 5632 (90 KiB) ran 1.06-1.10x faster than pieces of 22 KiB.
struct BFloat16Lines {
  using Element = uint16_t;
  using Vector = __m512bh;
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  static constexpr int kBlockRows = 1;
  static constexpr int64_t kPieceBytes = 24576;
  __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline Vector load(const Element* p) {
    return (Vector)_mm512_loadu_si512(p);
  }
  __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline Vector load_first(
      const Element* p, int64_t count) {
    return (Vector)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << count) - 1), p);
  }
  __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline __m512 load_x(const Element* x) {
    return _mm512_castsi512_ps(_mm512_load_si512(x));
  }
  __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline __m512 multiply_add(
      __m512 acc, Vector w, __m512 x) {
    return _mm512_dpbf16_ps(acc, w, (Vector)x);
  }
  static inline Element store(float sum) { return round_to_bf16(sum); }
};

struct Float32Lines {
  using Element = float;
  using Vector = __m512;
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  static constexpr int kBlockRows = 4;
  static constexpr int64_t kPieceBytes = 0;
  __attribute__((target("avx512f"), always_inline)) static inline Vector load(const Element* p) {
    return _mm512_loadu_ps(p);
  }
  __attribute__((target("avx512f"), always_inline)) static inline Vector load_first(const Element* p,
                                                                                     int64_t count) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p);
  }
  __attribute__((target("avx512f"), always_inline)) static inline __m512 load_x(const Element* x) {
    return _mm512_load_ps(x);
  }
  __attribute__((target("avx512f"), always_inline)) static inline __m512 multiply_add(__m512 acc, Vector w,
                                                                                       __m512 x) {
    return _mm512_fmadd_ps(w, x, acc);
  }
  static inline Element store(float sum) { return sum; }
};

// One target for both element types (GCC inlines intrinsics only into functions that enable their instruction
// set); the float32 instantiations emit no bfloat16 instruction and run on any AVX-512 CPU.
#define OPTIMUM_NEURONX_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16"), optimize("O3")))

// Lines of weight per step, each with its own accumulators: one chain of multiply-adds waits on the previous
// result (vdpbf16ps takes 6 cycles on Zen 4, a float32 multiply-add 4), so fewer than ~8 chains leave the core
// idle between lines. C harness, 2 threads, SmolLM2's projections from memory: bfloat16 4 rows 1.1-1.4x, 1 row
// 1.05x; the 1.1B shape at 1 row, where memory is the limit, within 2%.
template <int R, int C>
constexpr int kLinesPerStep = R * C >= 8 ? 1 : R * C >= 4 ? 2 : 4;

// Adds one 64-byte line of C weight rows (from column i; only its first k - i elements when kTail) times R rows
// of x to acc[c][r]. kPieces: the rows are read a piece at a time (dot_rows), and the prefetch reaches `ahead`
// elements past each line: into the same piece of a later row.
template <typename Lines, int R, int C, bool kTail, bool kPieces>
OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) inline void add_line(
    __m512 (&acc)[C][R], const typename Lines::Element* __restrict row, const typename Lines::Element* __restrict x,
    int64_t k, int64_t k_padded, int64_t i, int64_t ahead) {
  constexpr int64_t line = Lines::kLine;
  typename Lines::Vector w[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    // Weights are read once per step, so prefetches keep memory busy. One whole row: `ahead` elements further
    // (inductor_codegen.py measured the distance for Inductor's own loops). A block of whole rows: the next
    // block, front to back, C lines per step (a few KiB ahead in each row pointed into this block). The hint:
    // non-temporal at one row of x (evicts nothing); into L2 (t2) at several, whose slower loop lost non-temporal
    // lines before it reached them (t2 streamed 1.1-1.3x faster there, C harness, SmolLM2's projections; one row:
    // no difference).
    if (!kTail)
      __builtin_prefetch(C == 1 || kPieces ? row + c * k + i + ahead : row + C * k + C * i + c * line, 0,
                         R == 1 ? 0 : 1);
    w[c] = kTail ? Lines::load_first(row + c * k + i, k - i) : Lines::load(row + c * k + i);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 xr = Lines::load_x(x + r * k_padded + i);  // zero past k: masked-off weights multiply zeros
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c][r] = Lines::multiply_add(acc[c][r], w[c], xr);
  }
}

// C weight rows from `row`, columns [begin, end), times R rows of x (64-byte aligned, each zero-padded to
// k_padded): sums[c][r]. Each line of x is loaded once for C weight rows and each line of weight once for R rows
// of x: at 4 x 4 a weight line costs 2 loads and 4 multiply-adds, where one weight row at a time costs 5 loads.
template <typename Lines, int R, int C, bool kPieces>
OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) inline void dot_block(
    const typename Lines::Element* __restrict row, const typename Lines::Element* __restrict x, int64_t k,
    int64_t k_padded, int64_t begin, int64_t end, int64_t ahead, float (&sums)[C][R]) {
  constexpr int64_t line = Lines::kLine;
  constexpr int U = kLinesPerStep<R, C>;
  __m512 acc[U][C][R];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[u][c][r] = _mm512_setzero_ps();
  int64_t i = begin;
  for (; i + U * line <= end; i += U * line)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u)
      add_line<Lines, R, C, false, kPieces>(acc[u], row, x, k, k_padded, i + u * line, ahead);
  for (; i + line <= end; i += line) add_line<Lines, R, C, false, kPieces>(acc[0], row, x, k, k_padded, i, ahead);
  if (i < end) add_line<Lines, R, C, true, kPieces>(acc[0], row, x, k, k_padded, i, ahead);
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m512 sum = acc[0][c][r];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][c][r]);
      sums[c][r] = _mm512_reduce_add_ps(sum);
    }
}

// One piece, columns [begin, end), of weight rows [n_begin, n_end) times R rows of x, C weight rows at a time.
// Its sums go to partial[r * n_out + n] (set by the first piece, added to by the others) and, with the last
// piece, rounded to y[r * n_out + n]; a single piece (first and last) writes y alone.
template <typename Lines, int R, int C, bool kPieces>
OPTIMUM_NEURONX_DOT_TARGET void dot_piece(const typename Lines::Element* __restrict weight,
                                          const typename Lines::Element* __restrict x, int64_t k, int64_t k_padded,
                                          int64_t n_out, int64_t n_begin, int64_t n_end, int64_t begin, int64_t end,
                                          int64_t ahead, bool first, bool last, float* __restrict partial,
                                          typename Lines::Element* __restrict y) {
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) {
    float sums[C][R];
    dot_block<Lines, R, C, kPieces>(weight + n * k, x, k, k_padded, begin, end, ahead, sums);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * n_out + n + c;
        const float sum = first ? sums[c][r] : partial[at] + sums[c][r];
        if (last) {
          y[at] = Lines::store(sum);
        } else {
          partial[at] = sum;
        }
      }
  }
  if (C > 1 && n < n_end)
    dot_piece<Lines, R, 1, kPieces>(weight, x, k, k_padded, n_out, n, n_end, begin, end, ahead, first, last, partial,
                                    y);
}

// Input columns per piece for R rows of k: as few pieces as keep to Lines::kPieceBytes each (all R rows together),
// of even size in whole 64-byte lines; at least k (whole rows, no partial sums) when kPieceBytes is 0. A block of
// one weight row reads the input rows once per weight row, so they must stay in L1 next to the streaming weights:
// each piece is then done for all weight rows of a thread before the next, its float32 sums kept in `partial`.
template <typename Lines>
int64_t piece_columns(int rows, int64_t k) {
  constexpr int64_t line = Lines::kLine;
  if (Lines::kPieceBytes == 0) return k;
  int64_t most = Lines::kPieceBytes / (rows * int64_t(sizeof(typename Lines::Element))) / line * line;
  if (most < line) most = line;
  const int64_t pieces = (k + most - 1) / most;
  return ((k + pieces - 1) / pieces + line - 1) / line * line;
}

// Weight rows [n_begin, n_end) times R rows of x, Lines::kBlockRows weight rows at a time for several rows of x.
template <typename Lines, int R>
OPTIMUM_NEURONX_DOT_TARGET void dot_rows(const typename Lines::Element* __restrict weight,
                                         const typename Lines::Element* __restrict x, int64_t k, int64_t k_padded,
                                         int64_t n_out, int64_t n_begin, int64_t n_end, int64_t piece,
                                         float* __restrict partial, typename Lines::Element* __restrict y) {
  constexpr int C = R == 1 ? 1 : Lines::kBlockRows;
  constexpr int64_t row_ahead = OPTIMUM_NEURONX_ROW_PREFETCH_BYTES / sizeof(typename Lines::Element);
  if (piece >= k) {
    dot_piece<Lines, R, C, false>(weight, x, k, k_padded, n_out, n_begin, n_end, 0, k, row_ahead, true, true, nullptr,
                                  y);
    return;
  }
  // The prefetch reaches the same piece a whole number of rows further, about as far as in a whole row (at least
  // the next block).
  const int64_t rows_ahead = (row_ahead + piece - 1) / piece;
  const int64_t ahead = (rows_ahead > C ? rows_ahead : C) * k;
  for (int64_t begin = 0; begin < k; begin += piece) {
    const int64_t end = begin + piece < k ? begin + piece : k;
    dot_piece<Lines, R, C, true>(weight, x, k, k_padded, n_out, n_begin, n_end, begin, end, ahead, begin == 0,
                                 end == k, partial, y);
  }
}

template <typename Lines, int R>
void dot_rows_parallel(const typename Lines::Element* weight, const typename Lines::Element* x, int64_t k,
                       int64_t k_padded, int64_t n_out, int64_t piece, float* partial, typename Lines::Element* y) {
#pragma omp parallel
  {
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    dot_rows<Lines, R>(weight, x, k, k_padded, n_out, n_out * thread / threads, n_out * (thread + 1) / threads, piece,
                       partial, y);
  }
}

// A 64-byte aligned buffer of at least `count` elements, one per calling thread and tag, grown as needed and kept.
template <typename Element, int kTag>
Element* kept_buffer(int64_t count) {
  static thread_local Element* buffer = nullptr;
  static thread_local int64_t capacity = 0;
  if (capacity < count) {
    std::free(buffer);
    buffer = static_cast<Element*>(std::aligned_alloc(64, (count * sizeof(Element) + 63) / 64 * 64));
    capacity = buffer ? count : 0;
  }
  return buffer;
}

// x copied into a 64-byte aligned, zero-padded buffer: unaligned 64-byte loads of x ran 2.7x slower at 4 rows.
template <typename Element>
const Element* aligned_rows(const Element* x, int64_t rows, int64_t k, int64_t row_stride, int64_t col_stride,
                            int64_t k_padded) {
  Element* buffer = kept_buffer<Element, 0>(rows * k_padded);
  if (!buffer) return nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    Element* dst = buffer + r * k_padded;
    if (col_stride == 1) {  // the usual case: one copy per row (element by element it took 3% of a decode step)
      __builtin_memcpy(dst, x + r * row_stride, k * sizeof(Element));
    } else {
      for (int64_t i = 0; i < k; ++i) dst[i] = x[r * row_stride + i * col_stride];
    }
    __builtin_memset(dst + k, 0, (k_padded - k) * sizeof(Element));
  }
  return buffer;
}

// y = x @ weight.T for any number of rows, in chunks of kMaxRows.
template <typename Lines>
bool rows_matvec(const void* x_data, const int64_t* x_strides, const void* w_data, int64_t rows, int64_t k,
                 int64_t n_out, void* y_data) {
  using Element = typename Lines::Element;
  const int64_t k_padded = (k + Lines::kLine - 1) / Lines::kLine * Lines::kLine;
  const Element* w = static_cast<const Element*>(w_data);
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t count = rows - first < kMaxRows ? rows - first : kMaxRows;
    const Element* xs = aligned_rows(static_cast<const Element*>(x_data) + first * x_strides[0], count, k,
                                     x_strides[0], x_strides[1], k_padded);
    const int64_t piece = piece_columns<Lines>(count, k);
    float* partial = piece < k ? kept_buffer<float, 1>(count * n_out) : nullptr;
    if (!xs || (piece < k && !partial)) return false;
    Element* y = static_cast<Element*>(y_data) + first * n_out;
    switch (count) {
      case 1: dot_rows_parallel<Lines, 1>(w, xs, k, k_padded, n_out, piece, partial, y); break;
      case 2: dot_rows_parallel<Lines, 2>(w, xs, k, k_padded, n_out, piece, partial, y); break;
      case 3: dot_rows_parallel<Lines, 3>(w, xs, k, k_padded, n_out, piece, partial, y); break;
      default: dot_rows_parallel<Lines, 4>(w, xs, k, k_padded, n_out, piece, partial, y); break;
    }
  }
  return true;
}

}  // namespace optimum_neuronx_kernels

#undef OPTIMUM_NEURONX_DOT_TARGET

// AOTInductor's C shim for the op: named aoti_torch_cpu_<op name>, called directly by the graph's wrapper.
extern "C" AOTITorchError aoti_torch_cpu_rows_matvec(AtenTensorHandle x, AtenTensorHandle weight,
                                                     AtenTensorHandle* ret0) {
  namespace kernels = optimum_neuronx_kernels;
  int64_t x_dim, w_dim, *x_sizes, *x_strides, *w_sizes, *w_strides;
  int32_t x_dtype, w_dtype;
  void *x_data, *w_data, *y_data;
  aoti_torch_get_dim(x, &x_dim);
  aoti_torch_get_dim(weight, &w_dim);
  aoti_torch_get_dtype(x, &x_dtype);
  aoti_torch_get_dtype(weight, &w_dtype);
  const bool bf16 = x_dtype == aoti_torch_dtype_bfloat16(), f32 = x_dtype == aoti_torch_dtype_float32();
  if (x_dim != 2 || w_dim != 2 || !(bf16 || f32) || w_dtype != x_dtype) return AOTI_TORCH_FAILURE;
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
    __builtin_memset(y_data, 0, rows * n_out * (bf16 ? sizeof(uint16_t) : sizeof(float)));
    return AOTI_TORCH_SUCCESS;
  }
  const bool done =
      bf16 ? kernels::rows_matvec<kernels::BFloat16Lines>(x_data, x_strides, w_data, rows, k, n_out, y_data)
           : kernels::rows_matvec<kernels::Float32Lines>(x_data, x_strides, w_data, rows, k, n_out, y_data);
  return done ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}
