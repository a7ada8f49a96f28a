// optimum_neuronx::rows_matvec for AOTInductor on x86 CPUs with AVX-512 or AVX2 (see custom_kernels.py).
//
// y[r, n] = sum_k x[r, k] * weight[n, k] for a few rows r (decode: one per sequence), float32 sums, in and out
// either bfloat16 or float32. Each weight row is read from memory once for all rows of x. AVX-512: one instruction
// per row of x and 64-byte line of weight (float32: one fused multiply-add of 16 lanes; bfloat16 with avx512_bf16:
// vdpbf16ps, 32 products summed in pairs into 16 float32 lanes; without it, the line widened to float32 as AVX2
// does below, and two multiply-adds). AVX2: two 8-lane fused
// multiply-adds per 64-byte line of float32; a line of bfloat16 is widened to float32 by a shift and a mask
// (even and odd elements) and takes four, against x stored widened in that order. Inductor's own multiply + sum
// spends many more instructions per line at several bfloat16 rows and cannot keep up with memory; oneDNN keeps up
// but costs more per call outside its kernel than a decode projection takes.
//
// This file is spliced into the C++ wrapper of each graph that calls the op, inside `extern "C" { extern "C++"
// { ... } }`, so the compiled graph carries its own copy and loading it needs no extra library. The wrapper
// is compiled at -O1: the hot functions ask for -O3 themselves. Defined in front of this file
// (custom_kernels.kernel_defines): OPTIMUM_NEURONX_ROW_PREFETCH_BYTES, OPTIMUM_NEURONX_DOT_AVX512 (1: the AVX-512
// variant, 0: AVX2), OPTIMUM_NEURONX_DOT_BF16_NATIVE (AVX-512: 1, bfloat16 through avx512_bf16's dot products; 0,
// widened), OPTIMUM_NEURONX_DOT_PIECE_BYTES (-1: each variant's own kPieceBytes; tests set it to cut rows into
// pieces where the variant takes them whole), OPTIMUM_NEURONX_DOT_CHUNK_BYTES (0: kChunkBytes' default; tests set
// it to hand out one block at a time), OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY and
// OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY (the weights' prefetch hint at one and at several rows of x, per CPU:
// kernels/tuning.json).
#include "common.h"

namespace optimum_neuronx_kernels {

constexpr int kMaxRows = 4;  // rows of x per pass over the weight (one accumulator each per weight row)

// Lines that keep x as it is: copy_x_row copies one row of x into the kernel's buffer, zero-padded to k_padded
// elements. (The AVX2 bfloat16 lines keep x widened instead, with their own copy_x_row.)
struct PlainX {
  template <typename Element>
  static void copy_x_row(Element* dst, const Element* x, int64_t k, int64_t col_stride, int64_t k_padded) {
    if (col_stride == 1) {  // the usual case: one copy per row (element by element it took 3% of a decode step)
      __builtin_memcpy(dst, x, k * sizeof(Element));
    } else {
      for (int64_t i = 0; i < k; ++i) dst[i] = x[i * col_stride];
    }
    __builtin_memset(dst + k, 0, (k_padded - k) * sizeof(Element));
  }
};

// The bfloat16 variants that widen x to float32 (AVX-512 without avx512_bf16, AVX2) keep each group of kGroup
// elements as its even elements, then its odd ones: x[i + 2j] at kGroup * (i / kGroup) + j, x[i + 2j + 1] kGroup / 2
// further. This writes x's elements from i on one at a time in that order (the row's tail, or a strided row), and
// zeros the rest of the row up to k_padded.
template <int kGroup>
inline void widen_x_tail(float* dst, const uint16_t* x, int64_t i, int64_t k, int64_t col_stride, int64_t k_padded) {
  __builtin_memset(dst + i, 0, (k_padded - i) * sizeof(float));
  for (; i < k; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i * col_stride]) << 16;
    __builtin_memcpy(dst + i / kGroup * kGroup + (i % 2) * (kGroup / 2) + (i % kGroup) / 2, &bits, sizeof(bits));
  }
}

// One element type's 64-byte line of weight, for one instruction set: Acc, the float32 lanes it is summed into
// (zero, add, reduce); load a weight line (whole, or its first `count` elements); XElement, x as the kernel keeps
// it (copy_x_row: x's row into that form, zero-padded to whole lines), and load_x, one line of it for
// multiply_add; store, a float32 sum rounded to an element; lines_per_step (below).
// kBlockRows: weight rows per block for several rows of x (dot_block) longer than kShortRowsBytes (all rows, as
// the kernel keeps them): a block loads each line of x once per kBlockRows weight lines, which keeps long rows of x
// from being re-read from beyond L1 for every weight row. Shorter rows, and one row, take one weight row at a time.
// kPieceBytes: the most bytes of one row of x one pass over the weight rows takes (piece_columns; 0: whole rows), so
// that a long row stays in L1 next to the streaming weights.
#if OPTIMUM_NEURONX_DOT_AVX512
struct Avx512Lanes : PlainX {
  using Acc = __m512;
  __attribute__((target("avx512f"), always_inline)) static inline Acc zero() { return _mm512_setzero_ps(); }
  __attribute__((target("avx512f"), always_inline)) static inline Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  __attribute__((target("avx512f"), always_inline)) static inline float reduce(Acc a) { return _mm512_reduce_add_ps(a); }
  // GCC folds a load used by several multiply-adds into each of them (a memory operand apiece): at 4 x 4 that is
  // 20 loads per 4 weight lines instead of 8. An empty asm that "changes" the register keeps one load.
  template <typename Value>
  __attribute__((always_inline)) static inline void keep_in_register(Value& value) {
    asm("" : "+v"(value));
  }
  // A block of 4 weight rows x 4 rows of x has its 16 sums reduced together by sum16 and stored 4 at a time
  // (store_4x4), where each of the 16 takes ~8 instructions alone.
  // sum16: lane j is the sum of v[j]'s lanes; a transposed tree, 30 shuffles and 15 adds.
  __attribute__((target("avx512f"), always_inline)) static inline __m512 sum16(const Acc (&v)[16]) {
    __m512 pairs[8], quads[4], halves[2];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)  // each 128-bit lane: v[2j] (elements 0+2, 1+3 of that lane), v[2j+1] interleaved
      pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)  // each 128-bit lane: v[4j .. 4j+3], that lane's sum of each
      quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0x44),
                               _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], 0xee));
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j)  // 128-bit lanes: v[8j .. 8j+3] twice (sums of lanes 0-1, of 2-3), v[8j+4 ..] same
      halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
  }
  // Lane 4r + c of v to row r, element c of 4 rows `stride` apart; bfloat16 rounded as round_to_bf16 does.
  __attribute__((target("avx512f"), always_inline)) static inline void store_4x4(float* p, int64_t stride,
                                                                                  __m512 v) {
    _mm_storeu_ps(p, _mm512_castps512_ps128(v));
    _mm_storeu_ps(p + stride, _mm512_extractf32x4_ps(v, 1));
    _mm_storeu_ps(p + 2 * stride, _mm512_extractf32x4_ps(v, 2));
    _mm_storeu_ps(p + 3 * stride, _mm512_extractf32x4_ps(v, 3));
  }
  __attribute__((target("avx512f"), always_inline)) static inline void store_4x4(uint16_t* p, int64_t stride,
                                                                                  __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    alignas(32) uint64_t rows[4];  // row r's 4 elements in rows[r]
    _mm256_store_si256(reinterpret_cast<__m256i*>(rows), _mm512_cvtepi32_epi16(rounded));
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) __builtin_memcpy(p + r * stride, &rows[r], sizeof(rows[r]));
  }
  // Independent chains of multiply-adds (one per accumulator): with fewer than ~8 (vdpbf16ps takes 6 cycles, a
  // float32 multiply-add 4) the core idles between lines, so several lines go per step, up to 16 chains.
  static constexpr int lines_per_step(int accumulators) {
    return accumulators >= 16 ? 1 : 16 / accumulators < 4 ? 16 / accumulators : 4;
  }
  static constexpr int kBlockRows = 4;  // several rows of x past kShortRowsBytes: blocks of 4 weight rows
};

#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
struct BFloat16Lines : Avx512Lanes {
  using Element = uint16_t;
  using XElement = uint16_t;
  using Vector = __m512bh;
  using XLine = __m512;
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  static constexpr int64_t kShortRowsBytes = 24576;
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
#else
// AVX-512 without avx512_bf16: a line of 32 bfloat16 weights widened to float32 by a shift (its even elements) and a
// mask (its odd ones), two multiply-adds of 16 lanes per row of x, against x stored widened in that order
// (copy_x_row) -- the AVX2 variant's scheme at twice the width, half its instructions per line.
struct BFloat16Lines : Avx512Lanes {
  using Element = uint16_t;
  using XElement = float;
  struct Vector {
    __m512 even, odd;
  };
  using XLine = Vector;  // a line of x as two halves in the weights' order
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  static constexpr int64_t kShortRowsBytes = 0;  // x is float32 here: blocks at every length, as Float32Lines
  static constexpr int64_t kPieceBytes = 0;
  using Avx512Lanes::keep_in_register;
  __attribute__((always_inline)) static inline void keep_in_register(Vector& value) {
    asm("" : "+v"(value.even), "+v"(value.odd));
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Vector widen(__m512i w) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Vector load(const Element* p) {
    return widen(_mm512_loadu_si512(p));
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline Vector load_first(const Element* p,
                                                                                           int64_t count) {
    return widen(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << count) - 1), p));
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline XLine load_x(const XElement* x) {
    return {_mm512_load_ps(x), _mm512_load_ps(x + 16)};
  }
  __attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512 multiply_add(
      __m512 acc, const Vector& w, const XLine& x) {
    return _mm512_fmadd_ps(w.odd, x.odd, _mm512_fmadd_ps(w.even, x.even, acc));
  }
  static inline Element store(float sum) { return round_to_bf16(sum); }
  // x widened to float32, each line in load()'s order: x[i + 2j] at 32 * (i / 32) + j, x[i + 2j + 1] 16 further.
  __attribute__((target("avx512f,avx512bw"))) static void copy_x_row(XElement* dst, const Element* x, int64_t k,
                                                                      int64_t col_stride, int64_t k_padded) {
    int64_t i = 0;
    if (col_stride == 1) {
      for (; i + kLine <= k; i += kLine) {
        const Vector line = load(x + i);
        _mm512_store_ps(dst + i, line.even);
        _mm512_store_ps(dst + i + 16, line.odd);
      }
    }
    widen_x_tail<kLine>(dst, x, i, k, col_stride, k_padded);
  }
};
#endif

struct Float32Lines : Avx512Lanes {
  using Element = float;
  using XElement = float;
  using Vector = __m512;
  using XLine = __m512;
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  static constexpr int64_t kShortRowsBytes = 0;  // blocks at every length
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
#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
#define OPTIMUM_NEURONX_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16"), optimize("O3")))
#else
#define OPTIMUM_NEURONX_DOT_TARGET __attribute__((target("avx512f,avx512bw"), optimize("O3")))
#endif
#else

// AVX2: 16 vector registers of 8 float32 lanes. A 64-byte line takes two accumulators (float32: its halves;
// bfloat16: its even and its odd elements), so chains are counted in pairs, and one weight row at a time keeps
// a block's accumulators in registers (4 rows of x: 8). Whole rows of x (no pieces), for both element types: each
// piece of a row would start a new stream the hardware prefetchers must find.
struct Avx2Lanes : PlainX {
  struct Acc {
    __m256 a, b;
  };
  __attribute__((target("avx2,fma"), always_inline)) static inline Acc zero() {
    return {_mm256_setzero_ps(), _mm256_setzero_ps()};
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline Acc add(Acc x, Acc y) {
    return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)};
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline float reduce(Acc x) {
    const __m256 v = _mm256_add_ps(x.a, x.b);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  template <typename Value>
  static inline void keep_in_register(Value&) {}
  // 4-cycle multiply-adds, two per cycle: ~8 chains, i.e. 4 line accumulators, keep it busy.
  static constexpr int lines_per_step(int accumulators) { return accumulators >= 3 ? 1 : accumulators >= 2 ? 2 : 4; }
  static constexpr int kBlockRows = 1;  // no blocks: kShortRowsBytes is not read
  static constexpr int64_t kPieceBytes = 0;
  using XElement = float;
  using XLine = const float*;
  __attribute__((target("avx2,fma"), always_inline)) static inline XLine load_x(const float* x) { return x; }
};

struct Float32Lines : Avx2Lanes {
  using Element = float;
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  struct Vector {
    __m256 a, b;
  };
  __attribute__((target("avx2,fma"), always_inline)) static inline Vector load(const Element* p) {
    return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline Vector load_first(const Element* p,
                                                                                     int64_t count) {
    // maskload reads nothing past the row where the mask is off (the last row may end a mapping)
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane);
    const __m256i second = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count) - 8), lane);
    return {_mm256_maskload_ps(p, first), _mm256_maskload_ps(p + 8, second)};
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline Acc multiply_add(Acc acc, Vector w, XLine x) {
    return {_mm256_fmadd_ps(w.a, _mm256_load_ps(x), acc.a), _mm256_fmadd_ps(w.b, _mm256_load_ps(x + 8), acc.b)};
  }
  static inline Element store(float sum) { return sum; }
};

struct BFloat16Lines : Avx2Lanes {
  using Element = uint16_t;
  static constexpr int64_t kLine = kLineBytes / sizeof(Element);
  // A line's 32 weights widened: even and odd elements of its first 16, then of its last 16. x is kept in
  // the same order (copy_x_row), so the products pair up without shuffles.
  struct Vector {
    __m256 even0, odd0, even1, odd1;
  };
  __attribute__((target("avx2,fma"), always_inline)) static inline void widen(__m256i w, __m256& even, __m256& odd) {
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline Vector load(const Element* p) {
    Vector v;
    widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), v.even0, v.odd0);
    widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)), v.even1, v.odd1);
    return v;
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline Vector load_first(const Element* p,
                                                                                     int64_t count) {
    // No 16-bit masked load in AVX2: the row's last elements go through a zeroed line (read nothing past the row)
    alignas(64) Element line[kLine] = {};
    __builtin_memcpy(line, p, count * sizeof(Element));
    return load(line);
  }
  __attribute__((target("avx2,fma"), always_inline)) static inline Acc multiply_add(Acc acc, const Vector& w,
                                                                                    XLine x) {
    acc.a = _mm256_fmadd_ps(w.even0, _mm256_load_ps(x), acc.a);
    acc.b = _mm256_fmadd_ps(w.odd0, _mm256_load_ps(x + 8), acc.b);
    acc.a = _mm256_fmadd_ps(w.even1, _mm256_load_ps(x + 16), acc.a);
    acc.b = _mm256_fmadd_ps(w.odd1, _mm256_load_ps(x + 24), acc.b);
    return acc;
  }
  static inline Element store(float sum) { return round_to_bf16(sum); }
  // x widened to float32, each line in load()'s order: x[i + 2j] at 16 * (i / 16) + j, x[i + 2j + 1] 8 further.
  __attribute__((target("avx2,fma"))) static void copy_x_row(XElement* dst, const Element* x, int64_t k,
                                                              int64_t col_stride, int64_t k_padded) {
    int64_t i = 0;
    if (col_stride == 1) {
      for (; i + 16 <= k; i += 16) {
        __m256 even, odd;
        widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), even, odd);
        _mm256_store_ps(dst + i, even);
        _mm256_store_ps(dst + i + 8, odd);
      }
    }
    widen_x_tail<16>(dst, x, i, k, col_stride, k_padded);
  }
};

#define OPTIMUM_NEURONX_DOT_TARGET __attribute__((target("avx2,fma"), optimize("O3")))
#endif

// Adds one 64-byte line of C weight rows (from column i; only its first k - i elements when kTail) times R rows
// of x (k_padded elements apart, column i at x + i: in pieces, dot_rows passes each piece's rows and their spacing)
// to acc[c][r]. kPieces: the
// rows are read a piece at a time (dot_rows), and the prefetch reaches `ahead` elements past each line: into the
// same piece of a later row.
template <typename Lines, int R, int C, bool kTail, bool kPieces>
OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) inline void add_line(
    typename Lines::Acc (&acc)[C][R], const typename Lines::Element* __restrict row,
    const typename Lines::XElement* __restrict x,
    int64_t k, int64_t k_padded, int64_t i, int64_t ahead) {
  constexpr int64_t line = Lines::kLine;
  typename Lines::Vector w[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    // Weights are read once per step, so prefetches keep memory busy. One whole row: `ahead` elements further. A
    // block of whole rows: the next block, front to back, C lines per step. The hint depends on the CPU:
    // OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY for one weight row against one row of x, else
    // OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY.
    if (!kTail)
      __builtin_prefetch(C == 1 || kPieces ? row + c * k + i + ahead : row + C * k + C * i + c * line, 0,
                         R == 1 && C == 1 ? OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY
                                          : OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY);
    w[c] = kTail ? Lines::load_first(row + c * k + i, k - i) : Lines::load(row + c * k + i);
    if (R > 1) Lines::keep_in_register(w[c]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    typename Lines::XLine xr = Lines::load_x(x + r * k_padded + i);  // zero past k: masked-off weights multiply zeros
    if (C > 1) Lines::keep_in_register(xr);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c][r] = Lines::multiply_add(acc[c][r], w[c], xr);
  }
}

// C weight rows from `row`, columns [begin, end), times R rows of x (64-byte aligned, each zero-padded to
// k_padded): total[c][r], whose lanes sum to weight row c . row r of x. Each line of x is loaded once for C weight
// rows and each line of weight once for R rows of x: at 4 x 4 a weight line costs 2 loads and 4 multiply-adds, where
// one weight row at a time costs 5 loads.
template <typename Lines, int R, int C, bool kPieces>
OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) inline void dot_block(
    const typename Lines::Element* __restrict row, const typename Lines::XElement* __restrict x, int64_t k,
    int64_t k_padded, int64_t begin, int64_t end, int64_t ahead, typename Lines::Acc (&total)[C][R]) {
  constexpr int64_t line = Lines::kLine;
  constexpr int U = Lines::lines_per_step(R * C);  // lines per step, each with its own accumulators
  typename Lines::Acc acc[U][C][R];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[u][c][r] = Lines::zero();
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
      total[c][r] = acc[0][c][r];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) total[c][r] = Lines::add(total[c][r], acc[u][c][r]);
    }
}

// One piece, columns [begin, end), of weight rows [n_begin, n_end) times R rows of x, C weight rows at a time.
// Its sums go to partial[r * n_out + n] (set by the first piece, added to by the others) and, with the last
// piece, rounded to y[r * n_out + n]; a single piece (first and last) writes y alone.
template <typename Lines, int R, int C, bool kPieces>
OPTIMUM_NEURONX_DOT_TARGET void dot_piece(const typename Lines::Element* __restrict weight,
                                          const typename Lines::XElement* __restrict x, int64_t k, int64_t k_padded,
                                          int64_t n_out, int64_t n_begin, int64_t n_end, int64_t begin, int64_t end,
                                          int64_t ahead, bool first, bool last, float* __restrict partial,
                                          typename Lines::Element* __restrict y) {
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) {
    typename Lines::Acc total[C][R];
    dot_block<Lines, R, C, kPieces>(weight + n * k, x, k, k_padded, begin, end, ahead, total);
    if constexpr (R == 4 && C == 4) {  // blocks of 4 weight rows (AVX-512), rows whole: Avx512Lanes::sum16
      typename Lines::Acc by_row[16];  // sum16's lane 4r + c: at r * n_out + n + c
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) by_row[r * C + c] = total[c][r];
      static_assert(!kPieces, "blocks of weight rows take rows of x whole");
      Lines::store_4x4(y + n, n_out, Lines::sum16(by_row));
      continue;
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * n_out + n + c;
        const float reduced = Lines::reduce(total[c][r]);
        const float sum = first ? reduced : partial[at] + reduced;
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

// Input columns per piece for R rows of k: as few pieces as keep to Lines::kPieceBytes (one row; several rows only
// with the tests' OPTIMUM_NEURONX_DOT_PIECE_BYTES) each (all R rows together), of even size in whole 64-byte lines;
// at least k (whole rows, no partial sums) where that is 0, and for several rows where Lines has blocks (dot_rows). One weight
// row at a time reads the input rows once per weight row, so they must stay in L1 next to the streaming weights:
// each piece is then done for all weight rows of a thread before the next, its float32 sums kept in `partial`.
template <typename Lines>
int64_t piece_columns(int rows, int64_t k) {
  constexpr int64_t line = Lines::kLine;
  const int64_t bytes = OPTIMUM_NEURONX_DOT_PIECE_BYTES >= 0 ? OPTIMUM_NEURONX_DOT_PIECE_BYTES
                        : rows > 1                            ? 0
                                                              : Lines::kPieceBytes;
  if (bytes == 0 || (rows > 1 && Lines::kBlockRows > 1)) return k;
  int64_t most = bytes / (rows * int64_t(sizeof(typename Lines::XElement))) / line * line;
  if (most < line) most = line;
  const int64_t pieces = (k + most - 1) / most;
  return ((k + pieces - 1) / pieces + line - 1) / line * line;
}

// The weight rows per block dot_rows may take for R rows of x: Lines::kBlockRows at several rows, else one.
template <typename Lines, int R>
constexpr int block_rows() {
  return R > 1 ? Lines::kBlockRows : 1;
}

// Weight rows per block for R rows of x, each k_padded elements (dot_rows): block_rows for several rows longer than
// Lines::kShortRowsBytes, else 1.
template <typename Lines, int R>
int64_t weight_rows_per_block(int64_t k_padded) {
  constexpr int kBlock = block_rows<Lines, R>();
  if constexpr (kBlock > 1) {
    if (R * k_padded * int64_t(sizeof(typename Lines::XElement)) > Lines::kShortRowsBytes) return kBlock;
  }
  return 1;
}

// Weight rows [n_begin, n_end) times R rows of x, in blocks of weight_rows_per_block.
template <typename Lines, int R>
OPTIMUM_NEURONX_DOT_TARGET void dot_rows(const typename Lines::Element* __restrict weight,
                                         const typename Lines::XElement* __restrict x, int64_t k, int64_t k_padded,
                                         int64_t n_out, int64_t n_begin, int64_t n_end, int64_t piece,
                                         float* __restrict partial, typename Lines::Element* __restrict y) {
  constexpr int64_t row_ahead = OPTIMUM_NEURONX_ROW_PREFETCH_BYTES / sizeof(typename Lines::Element);
  constexpr int kBlock = block_rows<Lines, R>();
  if constexpr (kBlock > 1) {
    if (weight_rows_per_block<Lines, R>(k_padded) > 1) {
      dot_piece<Lines, R, kBlock, false>(weight, x, k, k_padded, n_out, n_begin, n_end, 0, k, row_ahead, true, true,
                                         nullptr, y);
      return;
    }
  }
  constexpr int C = 1;
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
    // This piece's R rows of x, `piece` apart, indexed by column (aligned_rows keeps them piece after piece)
    const typename Lines::XElement* x_piece = x + begin / piece * (R - 1) * piece;
    dot_piece<Lines, R, C, true>(weight, x_piece, k, piece, n_out, n_begin, n_end, begin, end, ahead, begin == 0,
                                 end == k, partial, y);
  }
}

// Each thread's share of the weight rows is handed out in chunks of about kChunkBytes
// (OPTIMUM_NEURONX_DOT_CHUNK_BYTES when positive): a thread takes its own share's chunks front to back, one stream,
// then the chunks left in the others' shares. The threads' shares of the memory bandwidth differ from one call to
// the next, and an even split leaves one thread waiting for the other at the end of each call.
constexpr int64_t kChunkBytes = OPTIMUM_NEURONX_DOT_CHUNK_BYTES > 0 ? OPTIMUM_NEURONX_DOT_CHUNK_BYTES : 131072;
// Weight rows read in pieces (x cut by piece_columns; piece after piece within each chunk) take larger chunks: each
// chunk's pieces start new streams at every row, the prefetch 2 rows ahead of each, so the longer each piece's pass
// the fewer of those starts.
constexpr int64_t kPiecedChunkBytes = OPTIMUM_NEURONX_DOT_CHUNK_BYTES > 0 ? OPTIMUM_NEURONX_DOT_CHUNK_BYTES : 524288;
constexpr int kMaxShares = 256;  // more threads than that start in a share another thread owns

struct alignas(64) NextRow {  // a line of its own: its owner's claims stay in its core's cache
  int64_t row;  // claimed with __atomic_fetch_add
};

// Elements per row of x as the kernel keeps it: whole lines.
template <typename Lines>
int64_t padded_columns(int64_t k) {
  return (k + Lines::kLine - 1) / Lines::kLine * Lines::kLine;
}

// x copied into a 64-byte aligned, zero-padded buffer, in the form the kernel reads (Lines::copy_x_row): rows of
// k_padded elements (unaligned loads of x are slower), and several rows read in pieces of `piece` columns laid out
// piece after piece: piece q's row r at (q * rows + r) * piece, zero-padded to `piece` (dot_rows points into it),
// so that a piece's rows lie together.
template <typename Lines>
const typename Lines::XElement* aligned_rows(const typename Lines::Element* x, int64_t rows, int64_t k,
                                             int64_t row_stride, int64_t col_stride, int64_t k_padded,
                                             int64_t piece) {
  using XElement = typename Lines::XElement;
  const bool by_piece = rows > 1 && piece < k;
  const int64_t pieces = (k + piece - 1) / piece;
  XElement* buffer = kept_buffer<XElement, 0>(by_piece ? pieces * rows * piece : rows * k_padded);
  if (!buffer) return nullptr;
  if (!by_piece) {
    for (int64_t r = 0; r < rows; ++r) Lines::copy_x_row(buffer + r * k_padded, x + r * row_stride, k, col_stride, k_padded);
    return buffer;
  }
  XElement* in_order = kept_buffer<XElement, 3>(k_padded);
  if (!in_order) return nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    Lines::copy_x_row(in_order, x + r * row_stride, k, col_stride, k_padded);
    for (int64_t q = 0; q < pieces; ++q) {  // k_padded <= pieces * piece: piece is whole lines
      const int64_t first = q * piece, kept = k_padded - first < piece ? k_padded - first : piece;
      XElement* dst = buffer + (q * rows + r) * piece;
      __builtin_memcpy(dst, in_order + first, kept * sizeof(XElement));
      __builtin_memset(dst + kept, 0, (piece - kept) * sizeof(XElement));
    }
  }
  return buffer;
}

// Items [0, n) (weight rows, tiles) split into one share per thread of the team planned (omp_get_max_threads), each
// handed out in chunks: a thread takes its own share's chunks front to back, then the chunks left in the others'.
// Built before the parallel region (the fork publishes it to the team); every thread of the region calls take().
struct Shares {
  int count;
  NextRow next[kMaxShares];

  explicit Shares(int64_t n) {
    const int max_threads = omp_get_max_threads();
    count = max_threads < kMaxShares ? max_threads : kMaxShares;
    for (int s = 0; s < count; ++s) next[s].row = n * s / count;
  }

  // Every share is visited by every thread, so a team smaller than planned (a nested call) still does all items.
  template <typename Body>
  void take(int64_t n, int64_t chunk, Body body) {
    const int thread = omp_get_thread_num();
    for (int i = 0; i < count; ++i) {
      const int share = (thread + i) % count;
      const int64_t end = n * (share + 1) / count;
      for (int64_t begin; (begin = __atomic_fetch_add(&next[share].row, chunk, __ATOMIC_RELAXED)) < end;)
        body(begin, begin + chunk < end ? begin + chunk : end);
    }
  }
};

// Each thread copies x (aligned_rows) into a buffer of its own inside the parallel region: x was just written by
// the step's previous kernels, partly on the other core, and one thread's copy read by all sent every line across
// once more, after a copy the other thread waited for.
template <typename Lines, int R>
bool dot_rows_parallel(const typename Lines::Element* weight, const typename Lines::Element* x_data,
                       const int64_t* x_strides, int64_t k, int64_t k_padded, int64_t n_out, int64_t piece,
                       float* partial, typename Lines::Element* y) {
  bool failed = false;
  Shares shares(n_out);
  // Rows per chunk: whole blocks, at least one (a remainder only where a share ends)
  const int64_t block = weight_rows_per_block<Lines, R>(k_padded);
  const int64_t row_bytes = k * int64_t(sizeof(typename Lines::Element));
  const int64_t chunk_bytes = piece < k ? kPiecedChunkBytes : kChunkBytes;
  const int64_t fitting = chunk_bytes / row_bytes / block * block;  // the whole blocks that fit in chunk_bytes
  const int64_t chunk = fitting > block ? fitting : block;
#pragma omp parallel
  {
    const typename Lines::XElement* x =
        aligned_rows<Lines>(x_data, R, k, x_strides[0], x_strides[1], k_padded, piece);
    if (!x) __atomic_store_n(&failed, true, __ATOMIC_RELAXED);
    if (x)
      // by value: each thread's copies, not the main thread's stack (tiled_dot_parallel)
      shares.take(n_out, chunk, [=](int64_t begin, int64_t end) {
        dot_rows<Lines, R>(weight, x, k, k_padded, n_out, begin, end, piece, partial, y);
      });
  }
  return !failed;
}

#if OPTIMUM_NEURONX_DOT_AVX512
// Weights in tiles [n_out / T, k, T] (modeling/layout.py's tile_weight): tile t holds outputs t T .. t T + T - 1 input by input,
// so a pass reads one stream, and each input's T weights are multiplied by that input of each row of x, broadcast,
// into T / 16 float32 accumulators per row: per weight line one load and R multiply-adds, no loads of x lines and no
// sums across lanes (plain rows at several rows of x read 4 streams and a line of x per weight line). Decode prefetches ROW_PREFETCH_BYTES ahead in the stream, which runs on into the next tile.
//
// A step is one float32 input (Float32Tiles) or two bfloat16 ones (BFloat16Tiles, avx512_bf16): vdpbf16ps multiplies
// the two bfloat16 of each 32-bit lane by the two of another and adds both products into one float32 lane. bfloat16
// tiles keep float32's layout (tile_weight and untile_weight serve both dtypes): the lines of inputs 2p and
// 2p + 1 are interleaved as they are loaded (unpacklo/hi_epi16, within 128-bit lanes: `lo` holds the pairs of
// outputs 8L .. 8L + 3 of each 128-bit lane L, `hi` those of 8L + 4 .. 8L + 7), each row's inputs 2p and 2p + 1 are
// broadcast as one 32-bit lane, and the sums are put back in order once per tile. An odd last input is paired with
// zeros. (Kept as pairs, [K / 2, T, 2], the tiles would save the two unpacks per pair of lines but need a layout of
// their own.)
struct Float32Tiles {
  using Element = float;
  static constexpr int64_t kInputs = 1;  // inputs per step
  // Rows of x with contiguous inputs (`row` apart): row r's input i.
  struct X {
    const float* data;
    int64_t row;
    float at(int r, int64_t i) const { return data[r * row + i]; }
  };
  // Adds input i's weights (T / 16 lines, prefetched kAhead elements ahead when kAhead > 0) times input i of R rows.
  template <int R, int T, int64_t kAhead, int kLocality>
  OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) static inline void add_step(
      __m512 (&acc)[R][T / 16], const float* __restrict tile, const X& x, int64_t i) {
    constexpr int V = T / 16;
    const float* w = tile + i * T;
    __m512 line[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      if (kAhead > 0) __builtin_prefetch(w + v * 16 + kAhead, 0, kLocality);
      line[v] = _mm512_loadu_ps(w + v * 16);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x.at(r, i));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(line[v], xr, acc[r][v]);
    }
  }
  template <int R, int T, int64_t kAhead, int kLocality>
  static inline void add_last(__m512 (&)[R][T / 16], const float*, const X&, int64_t) {}  // every step is whole
  // A row's T sums (+ T bias elements, or none) to its outputs.
  template <int T>
  OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) static inline void store(
      const __m512 (&sums)[T / 16], const float* __restrict bias, float* __restrict y) {
#pragma GCC unroll 4
    for (int v = 0; v < T / 16; ++v)
      _mm512_storeu_ps(y + v * 16, bias ? _mm512_add_ps(sums[v], _mm512_loadu_ps(bias + v * 16)) : sums[v]);
  }
};

#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
struct BFloat16Tiles {
  using Element = uint16_t;
  static constexpr int64_t kInputs = 2;
  // Rows of x with contiguous inputs (`row` apart): row r's inputs 2p and 2p + 1 as one 32-bit lane.
  struct X {
    const uint16_t* data;
    int64_t row;
    uint32_t pair(int r, int64_t p) const {
      uint32_t both;
      __builtin_memcpy(&both, data + r * row + 2 * p, sizeof(both));
      return both;
    }
  };
  // Adds the pair of inputs 2p, 2p + 1 (T / 32 lines each) times those of R rows of x: sums [r][2 v] (`lo`) and
  // [r][2 v + 1] (`hi`) of the v-th 32 outputs. kSecond: the line of input 2p + 1 (false: zeros, no such input).
  template <int R, int T, int64_t kAhead, int kLocality, bool kSecond = true>
  OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) static inline void add_step(
      __m512 (&acc)[R][T / 16], const uint16_t* __restrict tile, const X& x, int64_t p) {
    constexpr int V = T / 32;
    const uint16_t* w = tile + 2 * p * T;
    __m512bh lo[V], hi[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      if (kAhead > 0) {
        __builtin_prefetch(w + v * 32 + kAhead, 0, kLocality);
        if (kSecond) __builtin_prefetch(w + T + v * 32 + kAhead, 0, kLocality);
      }
      const __m512i first = _mm512_loadu_si512(w + v * 32);
      const __m512i second = kSecond ? _mm512_loadu_si512(w + T + v * 32) : _mm512_setzero_si512();
      lo[v] = (__m512bh)_mm512_unpacklo_epi16(first, second);
      hi[v] = (__m512bh)_mm512_unpackhi_epi16(first, second);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint32_t both = kSecond ? x.pair(r, p) : x.data[r * x.row + 2 * p];
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        acc[r][2 * v] = _mm512_dpbf16_ps(acc[r][2 * v], lo[v], xr);
        acc[r][2 * v + 1] = _mm512_dpbf16_ps(acc[r][2 * v + 1], hi[v], xr);
      }
    }
  }
  // After k / 2 steps: an odd last input, paired with zeros.
  template <int R, int T, int64_t kAhead, int kLocality>
  OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) static inline void add_last(
      __m512 (&acc)[R][T / 16], const uint16_t* __restrict tile, const X& x, int64_t k) {
    if (k % 2) add_step<R, T, 0, kLocality, false>(acc, tile, x, k / 2);
  }
  // A row's T sums, lo/hi as add_step leaves them, back in order (+ T bias elements, or none), rounded to nearest even.
  template <int T>
  OPTIMUM_NEURONX_DOT_TARGET __attribute__((always_inline)) static inline void store(
      const __m512 (&sums)[T / 16], const uint16_t* __restrict bias, uint16_t* __restrict y) {
    // outputs 0-15 of 32: lo's lanes 0-3, hi's 0-3, lo's 4-7, hi's 4-7; outputs 16-31: lanes 8-11, then 12-15
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
#pragma GCC unroll 2
    for (int v = 0; v < T / 32; ++v) {
      __m512 low = _mm512_permutex2var_ps(sums[2 * v], first, sums[2 * v + 1]);
      __m512 high = _mm512_permutex2var_ps(sums[2 * v], second, sums[2 * v + 1]);
      if (bias) {  // widened: a bfloat16 is a float32's upper half
        const __m512i b = _mm512_loadu_si512(bias + v * 32);
        const __m512i first_bias = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(b));
        const __m512i second_bias = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1));
        low = _mm512_add_ps(low, _mm512_castsi512_ps(_mm512_slli_epi32(first_bias, 16)));
        high = _mm512_add_ps(high, _mm512_castsi512_ps(_mm512_slli_epi32(second_bias, 16)));
      }
      _mm512_storeu_si512(y + v * 32, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
};
#endif

// y[r, t T + j] for tiles t in [first, last) (n_out per row of y): R rows of x, each tile's steps prefetched.
// Few accumulators (R T / 16 <= 8) take two steps at a time into two sets, so that enough multiply-adds are
// independent.
template <typename Tiles, int R, int T>
OPTIMUM_NEURONX_DOT_TARGET void tiled_dot(const typename Tiles::Element* __restrict tiles, const typename Tiles::X x,
                                          int64_t k, int64_t first, int64_t last, int64_t n_out,
                                          typename Tiles::Element* __restrict y) {
  constexpr int S = T / 16, kSets = R * S <= 8 ? 2 : 1;
  constexpr int64_t kAhead = OPTIMUM_NEURONX_ROW_PREFETCH_BYTES / sizeof(typename Tiles::Element);
  constexpr int kLocality = R == 1 ? OPTIMUM_NEURONX_ROW_PREFETCH_LOCALITY : OPTIMUM_NEURONX_ROWS_PREFETCH_LOCALITY;
  const int64_t steps = k / Tiles::kInputs;
  for (int64_t t = first; t < last; ++t) {
    const typename Tiles::Element* tile = tiles + t * k * T;
    __m512 acc[kSets][R][S];
#pragma GCC unroll 2
    for (int u = 0; u < kSets; ++u)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) acc[u][r][s] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + kSets <= steps; i += kSets)
#pragma GCC unroll 2
      for (int u = 0; u < kSets; ++u) Tiles::template add_step<R, T, kAhead, kLocality>(acc[u], tile, x, i + u);
    for (; i < steps; ++i) Tiles::template add_step<R, T, kAhead, kLocality>(acc[0], tile, x, i);
    Tiles::template add_last<R, T, kAhead, kLocality>(acc[0], tile, x, k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      if (kSets > 1)
#pragma GCC unroll 4
        for (int s = 0; s < S; ++s) acc[0][r][s] = _mm512_add_ps(acc[0][r][s], acc[kSets - 1][r][s]);
      Tiles::template store<T>(acc[0][r], nullptr, y + r * n_out + t * T);
    }
  }
}

template <typename Tiles, int R, int T>
void tiled_dot_parallel(const typename Tiles::Element* tiles, const typename Tiles::X x, int64_t k, int64_t n_tiles,
                        typename Tiles::Element* y) {
  Shares shares(n_tiles);
  const int64_t tile_bytes = k * T * int64_t(sizeof(typename Tiles::Element));
  const int64_t chunk = kChunkBytes / tile_bytes > 1 ? kChunkBytes / tile_bytes : 1;
  // x's description copied to each thread's own stack, read there at every tile (not through a reference to the
  // main thread's stack, whose lines that thread keeps writing)
#pragma omp parallel
  shares.take(n_tiles, chunk, [&, own = x](int64_t begin, int64_t end) {
    tiled_dot<Tiles, R, T>(tiles, own, k, begin, end, n_tiles * T, y);
  });
}

// y = x @ the tiles' weight.T for any number of rows of x (in chunks of kMaxRows).
template <typename Tiles, int T>
void tiled_matvec(const typename Tiles::X& x, const typename Tiles::Element* tiles, int64_t rows, int64_t k,
                  int64_t n_tiles, typename Tiles::Element* y) {
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t count = rows - first < kMaxRows ? rows - first : kMaxRows;
    typename Tiles::X x_rows = x;
    x_rows.data += first * x.row;
    typename Tiles::Element* y_rows = y + first * n_tiles * T;
    switch (count) {
      case 1: tiled_dot_parallel<Tiles, 1, T>(tiles, x_rows, k, n_tiles, y_rows); break;
      case 2: tiled_dot_parallel<Tiles, 2, T>(tiles, x_rows, k, n_tiles, y_rows); break;
      case 3: tiled_dot_parallel<Tiles, 3, T>(tiles, x_rows, k, n_tiles, y_rows); break;
      default: tiled_dot_parallel<Tiles, 4, T>(tiles, x_rows, k, n_tiles, y_rows); break;
    }
  }
}

// Prefill over tiles (ops.py's tiled_linear): y = x @ W.T for many rows. Each thread takes whole tiles (a tile [k, T]
// stays in L2) and sweeps every row of x over it gemm_rows<T>() at a time (at most 16 accumulators: 8 rows at 1 or
// 2 a row, 4 at 4): per step, the tile's lines loaded once for those rows, each row's input(s) broadcast.
template <int T>
constexpr int gemm_rows() {
  return T / 16 >= 4 ? 4 : 8;
}

// Rows [0, R) of x over one tile, its T outputs from `bias` (T of them, or none).
template <typename Tiles, int R, int T>
OPTIMUM_NEURONX_DOT_TARGET void tiled_gemm_rows(const typename Tiles::Element* __restrict tile,
                                                const typename Tiles::X& x, int64_t k,
                                                const typename Tiles::Element* __restrict bias,
                                                typename Tiles::Element* __restrict y, int64_t n_out) {
  constexpr int S = T / 16;
  __m512 acc[R][S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  const int64_t steps = k / Tiles::kInputs;
  for (int64_t i = 0; i < steps; ++i) Tiles::template add_step<R, T, 0, 0>(acc, tile, x, i);
  Tiles::template add_last<R, T, 0, 0>(acc, tile, x, k);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) Tiles::template store<T>(acc[r], bias, y + r * n_out);
}

// Rows [0, rows) of x over one tile, R at a time, then what is left in half blocks.
template <typename Tiles, int T, int R = gemm_rows<T>()>
void tiled_gemm_tile(const typename Tiles::Element* tile, typename Tiles::X x, int64_t rows, int64_t k,
                     const typename Tiles::Element* bias, typename Tiles::Element* y, int64_t n_out) {
  int64_t m = 0;
  for (; m + R <= rows; m += R, x.data += R * x.row, y += R * n_out)
    tiled_gemm_rows<Tiles, R, T>(tile, x, k, bias, y, n_out);
  if constexpr (R > 1) {
    if (rows - m >= R / 2) {
      tiled_gemm_rows<Tiles, R / 2, T>(tile, x, k, bias, y, n_out);
      m += R / 2;
      x.data += R / 2 * x.row;
      y += R / 2 * n_out;
    }
    tiled_gemm_tile<Tiles, T, R / 2>(tile, x, rows - m, k, bias, y, n_out);
  }
}

// y [rows, n_tiles T] = x [rows, k] @ the tiles' weight.T (+ bias [n_tiles T], or none).
template <typename Tiles, int T>
void tiled_gemm(const typename Tiles::X& x, const typename Tiles::Element* tiles, const typename Tiles::Element* bias,
                int64_t rows, int64_t k, int64_t n_tiles, typename Tiles::Element* y) {
  const int64_t n_out = n_tiles * T;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < n_tiles; ++t)
    tiled_gemm_tile<Tiles, T>(tiles + t * k * T, x, rows, k, bias ? bias + t * T : nullptr, y + t * T, n_out);
}
#endif

// y = x @ weight.T for any number of rows, in chunks of kMaxRows.
template <typename Lines>
bool rows_matvec(const void* x_data, const int64_t* x_strides, const void* w_data, int64_t rows, int64_t k,
                 int64_t n_out, void* y_data) {
  using Element = typename Lines::Element;
  const Element* w = static_cast<const Element*>(w_data);
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t count = rows - first < kMaxRows ? rows - first : kMaxRows;
    const int64_t k_padded = padded_columns<Lines>(k);
    const int64_t piece = piece_columns<Lines>(count, k);
    const Element* x = static_cast<const Element*>(x_data) + first * x_strides[0];
    float* partial = piece < k ? kept_buffer<float, 1>(count * n_out) : nullptr;
    if (piece < k && !partial) return false;
    Element* y = static_cast<Element*>(y_data) + first * n_out;
    bool done;
    switch (count) {
      case 1: done = dot_rows_parallel<Lines, 1>(w, x, x_strides, k, k_padded, n_out, piece, partial, y); break;
      case 2: done = dot_rows_parallel<Lines, 2>(w, x, x_strides, k, k_padded, n_out, piece, partial, y); break;
      case 3: done = dot_rows_parallel<Lines, 3>(w, x, x_strides, k, k_padded, n_out, piece, partial, y); break;
      default: done = dot_rows_parallel<Lines, 4>(w, x, x_strides, k, k_padded, n_out, piece, partial, y); break;
    }
    if (!done) return false;
  }
  return true;
}

}  // namespace optimum_neuronx_kernels

#undef OPTIMUM_NEURONX_DOT_TARGET

#ifndef OPTIMUM_NEURONX_KERNELS_NO_SHIMS  // the AOTInductor entry points (harness.cpp leaves them out)
namespace optimum_neuronx_shims {

// A tensor's dim, dtype, sizes, strides and data, as the C shim API gives them.
struct Operand {
  int64_t dim, *sizes, *strides;
  int32_t dtype;
  void* data;
  explicit Operand(AtenTensorHandle tensor) {
    aoti_torch_get_dim(tensor, &dim);
    aoti_torch_get_dtype(tensor, &dtype);
    aoti_torch_get_sizes(tensor, &sizes);
    aoti_torch_get_strides(tensor, &strides);
    aoti_torch_get_data_ptr(tensor, &data);
  }
};

// The outputs of a weight the kernels stream row by row (tile by tile) against k inputs: dense [n_out, k], or tiles
// [n_out / T, k, T] with T of 16, 32 or 64 (graph constants are dense); -1 for any other weight.
inline int64_t streamed_outputs(const Operand& weight, int64_t k) {
  const bool tiled = weight.dim == 3;
  const int64_t tile = tiled ? weight.sizes[2] : 1;
  const bool tile_ok = !tiled || (weight.strides[2] == 1 && (tile == 16 || tile == 32 || tile == 64));
  if ((weight.dim != 2 && !tiled) || weight.sizes[1] != k || (weight.sizes[0] > 1 && weight.strides[0] != k * tile) ||
      (k > 1 && weight.strides[1] != tile) || !tile_ok)
    return -1;
  return weight.sizes[0] * tile;
}

// Whether a tile of T outputs is one the kernels take for this element type: float32 16, 32 or 64 (streamed_outputs);
// bfloat16 32 or 64 (whole lines), and only through avx512_bf16's dot products.
inline bool tile_taken(bool bf16, int64_t tile) {
  return !bf16 || (OPTIMUM_NEURONX_DOT_BF16_NATIVE && tile % 32 == 0);
}

// x [rows, k] with each row's inputs contiguous, as the tiled kernels read it: x itself where it is (the graphs' x),
// else a copy (ok false: none could be made). (Inputs a stride apart cost the decode loop a multiply per input.)
template <typename Element>
struct ContiguousRows {
  const Element* data;
  int64_t row;
  Element* copy = nullptr;
  bool ok = true;
  explicit ContiguousRows(const Operand& x) : data(static_cast<const Element*>(x.data)), row(x.strides[0]) {
    const int64_t rows = x.sizes[0], k = x.sizes[1];
    if (k == 0 || (x.strides[1] == 1 && (rows < 2 || row >= k))) return;
    copy = static_cast<Element*>(std::malloc(rows * k * sizeof(Element)));
    ok = copy != nullptr;
    if (!ok) return;
    for (int64_t r = 0; r < rows; ++r)
      optimum_neuronx_kernels::PlainX::copy_x_row(copy + r * k, data + r * x.strides[0], k, x.strides[1], k);
    data = copy;
    row = k;
  }
  ~ContiguousRows() { std::free(copy); }
  ContiguousRows(const ContiguousRows&) = delete;
  ContiguousRows& operator=(const ContiguousRows&) = delete;
};

#if OPTIMUM_NEURONX_DOT_AVX512
// x [rows, k] (ContiguousRows) times a weight in tiles of 16, 32 or 64 outputs (tile_taken) into y [rows, n_tiles
// tile], with prefill's kernel (tiled_gemm, + a bias or nullptr) or decode's (tiled_matvec, no bias); false where x
// could not be copied.
template <typename Tiles>
bool run_tiles(bool prefill, const Operand& x, const Operand& weight, const typename Tiles::Element* bias,
               void* y_data) {
  namespace kernels = optimum_neuronx_kernels;
  using Element = typename Tiles::Element;
  const int64_t rows = x.sizes[0], k = x.sizes[1], tile = weight.sizes[2], n_tiles = weight.sizes[0];
  const Element* tiles = static_cast<const Element*>(weight.data);
  Element* y = static_cast<Element*>(y_data);
  const ContiguousRows<Element> contiguous(x);
  if (!contiguous.ok) return false;
  const typename Tiles::X xt{contiguous.data, contiguous.row};
  auto run = [&](auto outputs) {
    constexpr int T = decltype(outputs)::value;
    if (prefill) kernels::tiled_gemm<Tiles, T>(xt, tiles, bias, rows, k, n_tiles, y);
    else kernels::tiled_matvec<Tiles, T>(xt, tiles, rows, k, n_tiles, y);
  };
  if (tile == 64) run(std::integral_constant<int, 64>());
  else if (tile == 32) run(std::integral_constant<int, 32>());
  else if constexpr (sizeof(Element) == sizeof(float)) run(std::integral_constant<int, 16>());
  return true;
}
#endif

}  // namespace optimum_neuronx_shims

// AOTInductor's C shim for the op: named aoti_torch_cpu_<op name>, called directly by the graph's wrapper.
extern "C" AOTITorchError aoti_torch_cpu_rows_matvec(AtenTensorHandle x, AtenTensorHandle weight,
                                                     AtenTensorHandle* ret0) {
  namespace kernels = optimum_neuronx_kernels;
  namespace shims = optimum_neuronx_shims;
  const shims::Operand xs(x), ws(weight);
  const bool bf16 = xs.dtype == aoti_torch_dtype_bfloat16(), f32 = xs.dtype == aoti_torch_dtype_float32();
  const bool tiled = ws.dim == 3;  // tiles [n_out / T, k, T] (AVX-512; bfloat16 with avx512_bf16)
  if (xs.dim != 2 || !(bf16 || f32) || ws.dtype != xs.dtype || (tiled && !shims::tile_taken(bf16, ws.sizes[2])))
    return AOTI_TORCH_FAILURE;
  const int64_t rows = xs.sizes[0], k = xs.sizes[1], n_out = shims::streamed_outputs(ws, k);
  if (n_out < 0) return AOTI_TORCH_FAILURE;
#if !OPTIMUM_NEURONX_DOT_AVX512
  if (tiled) return AOTI_TORCH_FAILURE;
#endif
  const int64_t sizes[2] = {rows, n_out}, strides[2] = {n_out, 1};
  AOTITorchError status = aoti_torch_empty_strided(2, sizes, strides, xs.dtype, aoti_torch_device_type_cpu(), 0, ret0);
  if (status != AOTI_TORCH_SUCCESS) return status;
  if (rows == 0 || n_out == 0) return AOTI_TORCH_SUCCESS;
  void* y_data;
  aoti_torch_get_data_ptr(*ret0, &y_data);
  if (k == 0) {  // empty sums
    __builtin_memset(y_data, 0, rows * n_out * (bf16 ? sizeof(uint16_t) : sizeof(float)));
    return AOTI_TORCH_SUCCESS;
  }
  bool done = false;
  if (tiled) {
#if OPTIMUM_NEURONX_DOT_AVX512
#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
    if (bf16) done = shims::run_tiles<kernels::BFloat16Tiles>(false, xs, ws, nullptr, y_data);
#endif
    if (f32) done = shims::run_tiles<kernels::Float32Tiles>(false, xs, ws, nullptr, y_data);
#endif
  } else {
    done = bf16 ? kernels::rows_matvec<kernels::BFloat16Lines>(xs.data, xs.strides, ws.data, rows, k, n_out, y_data)
                : kernels::rows_matvec<kernels::Float32Lines>(xs.data, xs.strides, ws.data, rows, k, n_out, y_data);
  }
  return done ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}

// The C shim for optimum_neuronx::tiled_linear (prefill over tiled weights, AVX-512; bfloat16 with avx512_bf16):
// y [rows, n_out] = x [rows, k] @ W.T (+ bias [n_out], or nullptr: None) with W in tiles [n_out / T, k, T], through
// tiled_gemm.
extern "C" AOTITorchError aoti_torch_cpu_tiled_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                      AtenTensorHandle* bias, AtenTensorHandle* ret0) {
#if OPTIMUM_NEURONX_DOT_AVX512
  namespace kernels = optimum_neuronx_kernels;
  namespace shims = optimum_neuronx_shims;
  const shims::Operand xs(x), ws(weight);
  const bool bf16 = xs.dtype == aoti_torch_dtype_bfloat16(), f32 = xs.dtype == aoti_torch_dtype_float32();
  if (xs.dim != 2 || ws.dim != 3 || !(bf16 || f32) || ws.dtype != xs.dtype || !shims::tile_taken(bf16, ws.sizes[2]))
    return AOTI_TORCH_FAILURE;
  const int64_t rows = xs.sizes[0], k = xs.sizes[1], n_out = shims::streamed_outputs(ws, k);
  if (n_out < 0) return AOTI_TORCH_FAILURE;
  const void* bias_data = nullptr;
  if (bias && *bias) {  // dense [n_out], x's dtype
    const shims::Operand bs(*bias);
    if (bs.dim != 1 || bs.dtype != xs.dtype || bs.sizes[0] != n_out || (n_out > 1 && bs.strides[0] != 1))
      return AOTI_TORCH_FAILURE;
    bias_data = bs.data;
  }
  const int64_t sizes[2] = {rows, n_out}, strides[2] = {n_out, 1};
  AOTITorchError status = aoti_torch_empty_strided(2, sizes, strides, xs.dtype, aoti_torch_device_type_cpu(), 0, ret0);
  if (status != AOTI_TORCH_SUCCESS || rows == 0 || n_out == 0) return status;
  void* y_data;
  aoti_torch_get_data_ptr(*ret0, &y_data);
  bool done = false;
#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
  if (bf16)
    done = shims::run_tiles<kernels::BFloat16Tiles>(true, xs, ws, static_cast<const uint16_t*>(bias_data), y_data);
#endif
  if (f32) done = shims::run_tiles<kernels::Float32Tiles>(true, xs, ws, static_cast<const float*>(bias_data), y_data);
  return done ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
#else
  (void)x;
  (void)weight;
  (void)bias;
  (void)ret0;
  return AOTI_TORCH_FAILURE;  // tiles are an AVX-512 layout (backend.py)
#endif
}
#endif  // OPTIMUM_NEURONX_KERNELS_NO_SHIMS
