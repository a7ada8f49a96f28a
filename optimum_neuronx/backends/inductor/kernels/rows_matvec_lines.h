// rows_matvec.cpp's 64-byte lines of weight, one struct per element type and instruction set (AVX-512, AVX2).

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
