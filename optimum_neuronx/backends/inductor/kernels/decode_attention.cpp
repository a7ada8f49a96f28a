// optimum_neuronx::decode_attention for AOTInductor on x86 CPUs with AVX-512 or AVX2 (see custom_kernels.py).
//
// Decode attention over a cache window and the step's new tokens, for one group of query rows per (sequence, KV
// head): q [B, KV, R, D] float32, already scaled (R: the group's query heads times the new tokens); keys and
// values [B, KV, W, D] (the window, a view of the cache) and [B, KV, T, D] (the new tokens), bfloat16 or float32;
// additive masks [B, 1, R, W] and [B, 1, R, T] of that dtype. One softmax over both parts, float32 throughout,
// the output [B, KV, R, D] rounded once to the keys' dtype. Each (sequence, KV head) is one unit of work for one
// thread, which reads each key and value row once for all R query rows; Inductor's fused reductions read them once
// per query head and split the work into ~15 loops, each ending in a barrier of all threads. Rows are taken
// kLanes at a time: a block of keys (bfloat16 widened once) gives each query row one vector of kLanes scores, and
// a block of values is added into sums held in registers; both are prefetched two blocks ahead, since a step's
// weights have pushed the cache out of the CPU's caches since the step before (one row at a time would sum each
// dot product across its lanes alone and add each value row into sums in memory). A whole block's masked scores
// are one vector, and the softmax's maximum is taken lane by lane. Of the window, only the keys some row sees are read
// (seen_window). On AVX-512, keys and values whose rows are 64 or 128 elements back to back take their own loops
// (DenseRows below; bfloat16 with avx512_bf16): every row at a fixed offset, no float32 copy of a bfloat16 block.
//
// Spliced after rows_matvec.cpp into the same wrapper (custom_kernels.py).

#include "common.h"

namespace optimum_neuronx_kernels {

#if OPTIMUM_NEURONX_DOT_AVX512
constexpr int kLanes = 16;
#define OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((target("avx512f,avx512bw"), optimize("O3")))
#define OPTIMUM_NEURONX_FMA(a, b, c) ((Floats)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define OPTIMUM_NEURONX_WIDEN(p) ((Words)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))
#else
constexpr int kLanes = 8;
#define OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((target("avx2,fma"), optimize("O3")))
#define OPTIMUM_NEURONX_FMA(a, b, c) ((Floats)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define OPTIMUM_NEURONX_WIDEN(p) ((Words)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))
#endif

// GCC vector extensions: one source for both widths.
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats splat(float value) {
  return Floats{} + value;
}

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats load_floats(const float* p) {
  Floats v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats load_floats(const uint16_t* p) {
  // bfloat16: the upper half of a float32 (one widening load; GCC's __builtin_convertvector took four instructions)
  return (Floats)(OPTIMUM_NEURONX_WIDEN(p) << 16);
}

inline float to_float(float value) { return value; }
inline float to_float(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store_element(float* p, float value) { *p = value; }
inline void store_element(uint16_t* p, float value) { *p = round_to_bf16(value); }

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline float lane_sum(Floats v) {
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// exp(x) for x <= 0 (scores minus their maximum), 0 below -87 (where float32 exp leaves the normal range; the
// weight is then < 2^-125 of the largest one's). Cephes' expf polynomial, ~1-2 ulp.
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats exp_nonpositive(Floats x) {
  const Floats low = splat(-87.f);
  const Ints underflow = x < low;
  x = underflow ? low : x;
  const Floats magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const Floats n = (x * splat(1.44269504088896341f) + magic) - magic;
  Floats r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  Floats p = splat(1.9875691500e-4f);
  p = OPTIMUM_NEURONX_FMA(p, r, splat(1.3981999507e-3f));
  p = OPTIMUM_NEURONX_FMA(p, r, splat(8.3334519073e-3f));
  p = OPTIMUM_NEURONX_FMA(p, r, splat(4.1665795894e-2f));
  p = OPTIMUM_NEURONX_FMA(p, r, splat(1.6666665459e-1f));
  p = OPTIMUM_NEURONX_FMA(p, r, splat(5.0000001201e-1f));
  const Floats y = OPTIMUM_NEURONX_FMA(p, r * r, r + splat(1.f));
  const Floats power = (Floats)((__builtin_convertvector(n, Ints) + 127) << 23);
  return underflow ? splat(0.f) : y * power;
}

// One row of D elements (stride `step` between them) as float32 into `out`.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline void row_to_floats(
    float* __restrict out, const Element* __restrict row, int64_t d, int64_t step) {
  int64_t i = 0;
  if (step == 1)
    for (; i + kLanes <= d; i += kLanes) {
      const Floats v = load_floats(row + i);
      __builtin_memcpy(out + i, &v, sizeof(v));
    }
  for (; i < d; ++i) out[i] = to_float(row[i * step]);
}

// A block of up to kLanes key or value rows from `first` as float32 rows: rows[j] points at row j, either into the
// source itself (float32 rows with unit stride) or into `scratch` [kLanes, d], converted once for all the group's
// query rows. Rows past `count` point at `zeros` (d zeros), so a block always has kLanes rows.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline void block_rows(
    const float* (&rows)[kLanes], const Element* first, const int64_t* strides, int64_t count, int64_t d,
    float* scratch, const float* zeros) {
  for (int64_t j = 0; j < kLanes; ++j) {
    if (j >= count) {
      rows[j] = zeros;
    } else if (sizeof(Element) == sizeof(float) && strides[3] == 1) {
      rows[j] = reinterpret_cast<const float*>(first + j * strides[2]);
    } else {
      row_to_floats(scratch + j * d, first + j * strides[2], d, strides[3]);
      rows[j] = scratch + j * d;
    }
  }
}

// Prefetches rows [from, to) of a part (clipped to its length), each row's elements whole lines at a time, into
// L1 (kLocality 3) or L2 (1). A unit's keys and values were written a whole step ago and have left the caches
// since (the step streams every weight through them): without prefetches each block of rows waits on memory.
template <int kLocality, typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline void prefetch_rows(
    const Element* part, const int64_t* strides, int64_t from, int64_t to, int64_t length, int64_t d) {
  const int64_t bytes = ((d - 1) * strides[3] + 1) * static_cast<int64_t>(sizeof(Element));
  const int64_t end = to < length ? to : length;
  if (strides[3] == 1 && strides[2] == d) {  // rows back to back (a cache's): each line once, no per-row extra
    const uintptr_t last = reinterpret_cast<uintptr_t>(part + end * d);
    for (uintptr_t at = reinterpret_cast<uintptr_t>(part + from * d) & ~uintptr_t(63); at < last; at += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(at), 0, kLocality);
    return;
  }
  for (int64_t j = from; j < end; ++j) {
    const char* row = reinterpret_cast<const char*>(part + j * strides[2]);
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, 0, kLocality);
    __builtin_prefetch(row + bytes - 1, 0, kLocality);  // a row that starts mid-line ends in one more
  }
}

// Lane j of the result: the sum of the lanes of v[j] (kLanes vectors in, one out). Each level adds the halves of
// its blocks pairwise, keeping the vectors' order: 3 levels of 2 shuffles and an add for 8 vectors (AVX2), where
// summing each vector's lanes alone takes a chain of kLanes dependent adds.
template <int kBlock, int... kLane>
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats add_halves(
    Floats a, Floats b, std::integer_sequence<int, kLane...>) {
  // output lane t: block t / kBlock of the pair (a, b), taken as one 2 * kLanes vector, its first and second half
  return __builtin_shufflevector(a, b, (kLane / kBlock * 2 * kBlock + kLane % kBlock)...) +
         __builtin_shufflevector(a, b, (kLane / kBlock * 2 * kBlock + kLane % kBlock + kBlock)...);
}

template <int kBlock = kLanes / 2>  // the level: 2 * kBlock vectors in, kBlock out
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats lane_sums(Floats* v) {
  for (int j = 0; j < kBlock; ++j)
    v[j] = add_halves<kBlock>(v[2 * j], v[2 * j + 1], std::make_integer_sequence<int, kLanes>());
  if constexpr (kBlock > 1) {
    return lane_sums<kBlock / 2>(v);
  } else {
    return v[0];
  }
}

// Scores of one part: scores[r * stride + j] = q[r] . keys[j] + mask[r, j], j < length, kLanes keys at a time
// (each key row converted once for all rows; one vector of kLanes scores per query row).
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET void part_scores(const float* __restrict q, int64_t rows, int64_t d,
                                                  const Element* __restrict keys, const int64_t* key_strides,
                                                  const Element* __restrict mask, const int64_t* mask_strides,
                                                  int64_t length, float* __restrict scores, int64_t stride,
                                                  float* __restrict scratch, const float* zeros,
                                                  const Element* __restrict values, const int64_t* value_strides) {
  constexpr int64_t kAhead = 2 * kLanes;  // rows
  const int64_t whole = d / kLanes * kLanes;
  prefetch_rows<3>(keys, key_strides, 0, kAhead, length, d);
  for (int64_t j0 = 0; j0 < length; j0 += kLanes) {
    const int64_t count = length - j0 < kLanes ? length - j0 : kLanes;
    prefetch_rows<3>(keys, key_strides, j0 + kAhead, j0 + kAhead + kLanes, length, d);
    prefetch_rows<1>(values, value_strides, j0, j0 + kLanes, length, d);  // read after the softmax
    const float* key[kLanes];
    block_rows(key, keys + j0 * key_strides[2], key_strides, count, d, scratch, zeros);
    for (int64_t r = 0; r < rows; ++r) {
      const float* query = q + r * d;
      Floats acc[kLanes] = {};
      for (int64_t i = 0; i < whole; i += kLanes) {
        const Floats x = load_floats(query + i);
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) acc[j] = OPTIMUM_NEURONX_FMA(x, load_floats(key[j] + i), acc[j]);
      }
      Floats sums = lane_sums(acc);
      for (int64_t i = whole; i < d; ++i)
        for (int j = 0; j < kLanes; ++j) sums[j] += query[i] * key[j][i];
      const Element* m = mask + r * mask_strides[2] + j0 * mask_strides[3];
      if (count == kLanes && mask_strides[3] == 1) {  // a whole block: one vector (element by element: ~5x the work)
        const Floats masked = sums + load_floats(m);
        __builtin_memcpy(scores + r * stride + j0, &masked, sizeof(masked));
      } else {
        for (int64_t j = 0; j < count; ++j) scores[r * stride + j0 + j] = sums[j] + to_float(m[j * mask_strides[3]]);
      }
    }
  }
}

// acc[r][v] += weights[r * stride] * row[v * kLanes ...] for kRows rows: the row's kVectors vectors loaded (bfloat16:
// widened) once for all of them.
template <int kRows, int kVectors, typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline void add_weighted_line(
    Floats (&acc)[kRows][kVectors], const Element* __restrict row, const float* __restrict weights, int64_t stride) {
  Floats line[kVectors];
#pragma GCC unroll 4
  for (int v = 0; v < kVectors; ++v) line[v] = load_floats(row + v * kLanes);
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    const Floats weight = splat(weights[r * stride]);
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) acc[r][v] = OPTIMUM_NEURONX_FMA(weight, line[v], acc[r][v]);
  }
}

// out[r * d + i0 + e] += sum_j weights[r * stride + j] * value[j][i0 + e] (e < kVectors * kLanes, r < kRows,
// j < count): the sums held in registers across the block's rows. Each line of a value row is loaded once for the
// kRows rows, whose sums are independent chains of multiply-adds (one row at a time would leave each vector of sums
// a chain of `count` dependent multiply-adds).
template <int kRows, int kVectors>
OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline void add_weighted(
    float* __restrict out, int64_t d, const float* const (&value)[kLanes], const float* __restrict weights,
    int64_t stride, int64_t count, int64_t i0) {
  Floats acc[kRows][kVectors];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) acc[r][v] = load_floats(out + r * d + i0 + v * kLanes);
  for (int64_t j = 0; j < count; ++j) add_weighted_line(acc, value[j] + i0, weights + j, stride);
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) __builtin_memcpy(out + r * d + i0 + v * kLanes, &acc[r][v], sizeof(Floats));
}

// add_weighted over a row's `vectors` whole vectors, 4 at a time (4 x 4 sums and 4 lines: 20 of AVX-512's 32
// registers; AVX2's groups of 2 rows, 2 x 4 and 4: 12 of its 16).
template <int kRows>
OPTIMUM_NEURONX_ATTENTION_TARGET void add_weighted_rows(float* __restrict out, int64_t d,
                                                        const float* const (&value)[kLanes],
                                                        const float* __restrict weights, int64_t stride,
                                                        int64_t count, int64_t vectors) {
  int64_t v = 0;
  for (; v + 4 <= vectors; v += 4) add_weighted<kRows, 4>(out, d, value, weights, stride, count, v * kLanes);
  switch (vectors - v) {
    case 3: add_weighted<kRows, 3>(out, d, value, weights, stride, count, v * kLanes); break;
    case 2: add_weighted<kRows, 2>(out, d, value, weights, stride, count, v * kLanes); break;
    case 1: add_weighted<kRows, 1>(out, d, value, weights, stride, count, v * kLanes); break;
    default: break;
  }
}

// out[r] += sum_j weights[r * stride + j] * values[j], j < length, kLanes value rows at a time.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET void part_values(const float* __restrict weights, int64_t rows, int64_t d,
                                                  const Element* __restrict values, const int64_t* value_strides,
                                                  int64_t length, int64_t stride, float* __restrict out,
                                                  float* __restrict scratch, const float* zeros) {
  constexpr int64_t kGroup = kLanes == 16 ? 4 : 2;  // rows of sums per pass
  constexpr int64_t kAhead = 2 * kLanes;  // rows (in L2 already: part_scores)
  const int64_t vectors = d / kLanes;  // whole vectors in a row
  prefetch_rows<3>(values, value_strides, 0, kAhead, length, d);
  for (int64_t j0 = 0; j0 < length; j0 += kLanes) {
    const int64_t count = length - j0 < kLanes ? length - j0 : kLanes;
    prefetch_rows<3>(values, value_strides, j0 + kAhead, j0 + kAhead + kLanes, length, d);
    const float* value[kLanes];
    block_rows(value, values + j0 * value_strides[2], value_strides, count, d, scratch, zeros);
    for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
      float* o = out + r0 * d;
      const float* w = weights + r0 * stride + j0;
      switch (rows - r0 < kGroup ? rows - r0 : kGroup) {  // (AVX2 never meets 3 or 4: no such groups compiled)
        case 4: add_weighted_rows<kGroup == 4 ? 4 : 1>(o, d, value, w, stride, count, vectors); break;
        case 3: add_weighted_rows<kGroup == 4 ? 3 : 1>(o, d, value, w, stride, count, vectors); break;
        case 2: add_weighted_rows<2>(o, d, value, w, stride, count, vectors); break;
        default: add_weighted_rows<1>(o, d, value, w, stride, count, vectors); break;
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = vectors * kLanes; i < d; ++i)
        for (int64_t j = 0; j < count; ++j) out[r * d + i] += weights[r * stride + j0 + j] * value[j][i];
  }
}

// In place over each of `rows` rows of `length` scores: exp(score - the row's max); returns nothing, writes each
// row's sum of weights to sums[r].
OPTIMUM_NEURONX_ATTENTION_TARGET void softmax_weights(float* __restrict scores, int64_t rows, int64_t length,
                                                      int64_t stride, float* __restrict sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    float peak = s[0];
    int64_t j = 0;
    if (length >= kLanes) {  // lane by lane, then across the lanes (one chain of compares was ~3 cycles a score)
      Floats peaks = load_floats(s);
      for (j = kLanes; j + kLanes <= length; j += kLanes) {
        const Floats v = load_floats(s + j);
        peaks = v > peaks ? v : peaks;
      }
      for (int i = 0; i < kLanes; ++i) peak = peaks[i] > peak ? peaks[i] : peak;
    }
    for (; j < length; ++j) peak = s[j] > peak ? s[j] : peak;
    Floats total = {};
    for (j = 0; j + kLanes <= length; j += kLanes) {
      const Floats w = exp_nonpositive(load_floats(s + j) - splat(peak));
      __builtin_memcpy(s + j, &w, sizeof(w));
      total += w;
    }
    float sum = lane_sum(total);
    if (j < length) {  // the last few through a padded vector
      alignas(64) float tail[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) tail[i] = j + i < length ? s[j + i] - peak : -1e30f;
      const Floats w = exp_nonpositive(load_floats(tail));
      for (int64_t i = 0; j + i < length; ++i) {
        s[j + i] = w[i];
        sum += w[i];
      }
    }
    sums[r] = sum;
  }
}

#if OPTIMUM_NEURONX_DOT_AVX512
// Keys and values whose rows are kD elements back to back (a cache window; a single new token) on AVX-512: float32,
// and bfloat16 where the CPU has avx512_bf16. part_scores and part_values take each block of rows through 16 row
// pointers (bfloat16: a float32 copy of the block, read back once per query row). Here every row is at a fixed
// offset from the block's
// start; a bfloat16 key is multiplied straight from the cache by vdpbf16ps against the query rows rounded once to
// bfloat16 (as Transformers' bfloat16 attention has them; the products and their sums stay float32), a float32 key
// by the same multiply-adds as part_scores; each value row is widened in registers (bfloat16) and added into float32
// sums exactly as part_values does.
#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
#define OPTIMUM_NEURONX_DENSE_ROWS_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16"), optimize("O3")))
#else
#define OPTIMUM_NEURONX_DENSE_ROWS_TARGET __attribute__((target("avx512f,avx512bw"), optimize("O3")))
#endif

template <typename Element, int kD>
struct DenseRows {
  static constexpr bool kBf16 = sizeof(Element) == sizeof(uint16_t);
  static constexpr int kPerVector = kBf16 ? 32 : kLanes;  // elements per vector: bfloat16 pairs, or float32 lanes
  static constexpr int kVectors = kD / kPerVector;
  static constexpr int64_t kAhead = 2 * kLanes;  // rows prefetched ahead

  // Rows [from, to) of `part` (clipped to `length`) into L1 (kLocality 3) or L2 (1): prefetch_rows over rows back
  // to back.
  template <int kLocality>
  OPTIMUM_NEURONX_DENSE_ROWS_TARGET __attribute__((always_inline)) static inline void prefetch(
      const Element* part, int64_t from, int64_t to, int64_t length) {
    static constexpr int64_t kBackToBack[4] = {0, 0, kD, 1};
    prefetch_rows<kLocality>(part, kBackToBack, from, to, length, kD);
  }

#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
  OPTIMUM_NEURONX_DENSE_ROWS_TARGET __attribute__((always_inline)) static inline __m512bh pairs(const uint16_t* p) {
    __m512bh v;
    __builtin_memcpy(&v, p, sizeof(v));
    return v;
  }
#endif

  // The dot product of a key row with query row `query` (kD elements; bfloat16: rounded, round_queries) as the
  // lanes of one vector.
  OPTIMUM_NEURONX_DENSE_ROWS_TARGET __attribute__((always_inline)) static inline Floats dot(const Element* key,
                                                                                             const Element* query) {
#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
    if constexpr (kBf16) {
      __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), pairs(key), pairs(query));
#pragma GCC unroll 4
      for (int v = 1; v < kVectors; ++v) sum = _mm512_dpbf16_ps(sum, pairs(key + v * 32), pairs(query + v * 32));
      return (Floats)sum;
    }
#endif
    if constexpr (!kBf16) {
      Floats sum = {};
#pragma GCC unroll 8
      for (int v = 0; v < kVectors; ++v)
        sum = OPTIMUM_NEURONX_FMA(load_floats(query + v * kLanes), load_floats(key + v * kLanes), sum);
      return sum;
    }
    return Floats{};
  }

  // Scores of one part, as part_scores: scores[r * stride + j] = query[r] . keys[j] + mask[r, j]; `query` rows x kD
  // (bfloat16: rounded). The keys and the block's values are prefetched into L2 (add_values reads the values).
  OPTIMUM_NEURONX_DENSE_ROWS_TARGET static void scores(const Element* __restrict query, int64_t rows,
                                                       const Element* __restrict keys, const Element* __restrict mask,
                                                       const int64_t* mask_strides, int64_t length,
                                                       float* __restrict out, int64_t stride,
                                                       const Element* __restrict values) {
    prefetch<1>(keys, 0, kAhead, length);
    int64_t j0 = 0;
    for (; j0 + kLanes <= length; j0 += kLanes) {
      prefetch<1>(keys, j0 + kAhead, j0 + kAhead + kLanes, length);
      prefetch<1>(values, j0, j0 + kLanes, length);
      const Element* block = keys + j0 * kD;
      for (int64_t r = 0; r < rows; ++r) {
        Floats acc[kLanes];
#pragma GCC unroll 16
        for (int j = 0; j < kLanes; ++j) acc[j] = dot(block + j * kD, query + r * kD);
        const Floats sums = lane_sums(acc);
        const Element* m = mask + r * mask_strides[2] + j0 * mask_strides[3];
        if (mask_strides[3] == 1) {
          const Floats masked = sums + load_floats(m);
          __builtin_memcpy(out + r * stride + j0, &masked, sizeof(masked));
        } else {
          for (int64_t j = 0; j < kLanes; ++j) out[r * stride + j0 + j] = sums[j] + to_float(m[j * mask_strides[3]]);
        }
      }
    }
    for (int64_t j = j0; j < length; ++j)  // the last few keys one at a time
      for (int64_t r = 0; r < rows; ++r)
        out[r * stride + j] = lane_sum(dot(keys + j * kD, query + r * kD)) +
                              to_float(mask[r * mask_strides[2] + j * mask_strides[3]]);
  }

  // out[r] += sum_j weights[r * stride + j] * values[j] for kRows rows, 4 vectors of 16 float32 sums per row and
  // pass, each value row loaded (bfloat16: widened) once for all kRows rows.
  template <int kRows>
  OPTIMUM_NEURONX_DENSE_ROWS_TARGET static void add_values(float* __restrict out, const Element* __restrict values,
                                                           int64_t length, const float* __restrict weights,
                                                           int64_t stride) {
    constexpr int kPass = 4;
    for (int i0 = 0; i0 < kD; i0 += kPass * kLanes) {
      Floats acc[kRows][kPass];
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kPass; ++v) acc[r][v] = load_floats(out + r * kD + i0 + v * kLanes);
      prefetch<3>(values, 0, kAhead, length);
      for (int64_t j = 0; j < length; ++j) {
        if (j % kLanes == 0) prefetch<3>(values, j + kAhead, j + kAhead + kLanes, length);
        add_weighted_line(acc, values + j * kD + i0, weights + j, stride);
      }
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < kPass; ++v) __builtin_memcpy(out + r * kD + i0 + v * kLanes, &acc[r][v], sizeof(Floats));
    }
  }

  static void values_of(const float* weights, int64_t rows, const Element* values, int64_t length, int64_t stride,
                        float* out) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      float* o = out + r0 * kD;
      const float* w = weights + r0 * stride;
      switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 4: add_values<4>(o, values, length, w, stride); break;
        case 3: add_values<3>(o, values, length, w, stride); break;
        case 2: add_values<2>(o, values, length, w, stride); break;
        default: add_values<1>(o, values, length, w, stride); break;
      }
    }
  }
};

#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
// `count` float32 query elements rounded to bfloat16 (to nearest even, as round_to_bf16).
OPTIMUM_NEURONX_DENSE_ROWS_TARGET inline void round_queries(uint16_t* __restrict out, const float* __restrict in,
                                                            int64_t count) {
  int64_t i = 0;
  for (; i + 32 <= count; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i)));
  for (; i < count; ++i) out[i] = round_to_bf16(in[i]);
}
#endif

// Whether DenseRows<Element, d> takes a part of `length` rows with these strides: bfloat16 only with avx512_bf16,
// rows of 64 or 128 back to back (one row: any spacing).
template <typename Element>
inline bool dense_rows(int64_t d, const int64_t* strides, int64_t length) {
  if (sizeof(Element) == sizeof(uint16_t) && !OPTIMUM_NEURONX_DOT_BF16_NATIVE) return false;
  return (d == 64 || d == 128) && strides[3] == 1 && (strides[2] == d || length <= 1);
}
#undef OPTIMUM_NEURONX_DENSE_ROWS_TARGET
#define OPTIMUM_NEURONX_ATTENTION_DENSE_ROWS 1
#else
#define OPTIMUM_NEURONX_ATTENTION_DENSE_ROWS 0
#endif

// An additive mask at or below this hides its key: the decoder's masks are 0 or the dtype's lowest (-3.4e38).
constexpr float kHidden = -1e30f;

// The window's keys [first, last) that some query row sees: every key outside is hidden from every row (left
// padding; the bucket's slots past the newest token). Where some row sees no key at all, in either part, it
// averages every key with equal weights, so then the whole window.
template <typename Element>
inline void seen_window(const Element* const* masks, const int64_t* const* mask_strides, int64_t b, int64_t rows,
                        int64_t window, int64_t fresh, int64_t& first, int64_t& last) {
  first = window, last = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const Element* m = masks[0] + b * mask_strides[0][0] + r * mask_strides[0][2];
    const int64_t step = mask_strides[0][3];
    int64_t j = 0;
    while (j < window && to_float(m[j * step]) <= kHidden) ++j;
    bool seen = j < window;
    if (seen) {
      first = j < first ? j : first;
      int64_t end = window;
      while (to_float(m[(end - 1) * step]) <= kHidden) --end;  // stops at j at the latest
      last = end > last ? end : last;
    }
    const Element* n = masks[1] + b * mask_strides[1][0] + r * mask_strides[1][2];
    for (j = 0; j < fresh && !seen; ++j) seen = to_float(n[j * mask_strides[1][3]]) > kHidden;
    if (!seen) {
      first = 0, last = window;
      return;
    }
  }
  if (first > last) first = last = 0;  // no row sees the window: only the new tokens
}

// One (sequence b, KV head h): its R query rows over both parts. kv: window keys, window values, new keys, new
// values; masks: window, new (one per sequence, for every KV head). `buffer`: the thread's scratch.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET void attend(const float* q, const int64_t* q_strides, const Element* const* kv,
                                             const int64_t* const* kv_strides, const Element* const* masks,
                                             const int64_t* const* mask_strides, int64_t b, int64_t h, int64_t rows,
                                             int64_t d, const int64_t (&sizes)[2], float* buffer, Element* y) {
  // Only the window's keys some row sees are read: a hidden key's weight is exactly 0 (exp_nonpositive of
  // -3.4e38 and less), and the skipped blocks are memory the step need not wait for. The benchmark's token
  // graphs read 128-191 of a 192-slot window; default power-of-two buckets leave up to half of one unused.
  int64_t first, last;
  seen_window(masks, mask_strides, b, rows, sizes[0], sizes[1], first, last);
  const int64_t lengths[2] = {last - first, sizes[1]};
  const int64_t length = lengths[0] + lengths[1];
  float* query = buffer;                      // [rows, d]
  float* scores = query + rows * d;           // [rows, length], then the softmax weights
  float* sums = scores + rows * length;       // [rows, d], the weighted sums of the values
  float* totals = sums + rows * d;            // [rows], the sums of the weights
  float* zeros = totals + rows;               // [d]
  float* scratch = zeros + d;                 // [kLanes, d], a block of key or value rows as float32
  uint16_t* q_bf16 = reinterpret_cast<uint16_t*>(scratch + kLanes * d);  // [rows, d], for DenseRows
  for (int64_t r = 0; r < rows; ++r)
    row_to_floats(query + r * d, q + b * q_strides[0] + h * q_strides[1] + r * q_strides[2], d, q_strides[3]);
  __builtin_memset(zeros, 0, d * sizeof(float));
  const Element* own[4];  // this unit's rows of kv[i], the window's from its first seen key
  for (int i = 0; i < 4; ++i)
    own[i] = kv[i] + b * kv_strides[i][0] + h * kv_strides[i][1] + (i < 2 ? first * kv_strides[i][2] : 0);
  const int64_t offsets[2] = {0, lengths[0]};  // each part's first column of `scores`
#if OPTIMUM_NEURONX_ATTENTION_DENSE_ROWS
  // Rows of 64 or 128 (DenseRows): the query as DenseRows reads it, bfloat16 ones rounded for both parts,
  // whichever loops take them.
  const Element* dense_query = reinterpret_cast<const Element*>(query);
#if OPTIMUM_NEURONX_DOT_BF16_NATIVE
  if (sizeof(Element) == sizeof(uint16_t) && (d == 64 || d == 128)) {
    round_queries(q_bf16, query, rows * d);
    for (int64_t i = 0; i < rows * d; ++i) query[i] = to_float(q_bf16[i]);
    dense_query = reinterpret_cast<const Element*>(q_bf16);
  }
#endif
#endif
  for (int p = 0; p < 2; ++p) {
    const int64_t* ms = mask_strides[p];
    const Element* mask = masks[p] + b * ms[0] + (p == 0 ? first * ms[3] : 0);
#if OPTIMUM_NEURONX_ATTENTION_DENSE_ROWS
    if (dense_rows<Element>(d, kv_strides[2 * p], lengths[p])) {
      (d == 64 ? DenseRows<Element, 64>::scores : DenseRows<Element, 128>::scores)(
          dense_query, rows, own[2 * p], mask, ms, lengths[p], scores + offsets[p], length, own[2 * p + 1]);
      continue;
    }
#endif
    part_scores(query, rows, d, own[2 * p], kv_strides[2 * p], mask, ms, lengths[p],
                scores + offsets[p], length, scratch, zeros, own[2 * p + 1], kv_strides[2 * p + 1]);
  }
  softmax_weights(scores, rows, length, length, totals);
  __builtin_memset(sums, 0, rows * d * sizeof(float));
  for (int p = 0; p < 2; ++p) {
#if OPTIMUM_NEURONX_ATTENTION_DENSE_ROWS
    if (dense_rows<Element>(d, kv_strides[2 * p + 1], lengths[p])) {
      (d == 64 ? DenseRows<Element, 64>::values_of : DenseRows<Element, 128>::values_of)(
          scores + offsets[p], rows, own[2 * p + 1], lengths[p], length, sums);
      continue;
    }
#endif
    part_values(scores + offsets[p], rows, d, own[2 * p + 1], kv_strides[2 * p + 1], lengths[p], length, sums,
                scratch, zeros);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.f / totals[r];
    for (int64_t i = 0; i < d; ++i) store_element(y + r * d + i, sums[r * d + i] * inverse);
  }
}

// All (sequence, KV head) units, split between the threads; `out` [B, KV, R, D] contiguous. The keys, values,
// masks and output are Element data (the shim's untyped pointers).
template <typename Element>
bool decode_attention(const float* q, const int64_t* q_strides, void* const (&kv_data)[4],
                      const int64_t* const* kv_strides, void* const (&mask_data)[2],
                      const int64_t* const* mask_strides, int64_t batch, int64_t heads, int64_t rows, int64_t d,
                      int64_t window, int64_t fresh, void* out_data) {
  const Element* kv[4];
  for (int i = 0; i < 4; ++i) kv[i] = static_cast<const Element*>(kv_data[i]);
  const Element* masks[2] = {static_cast<const Element*>(mask_data[0]), static_cast<const Element*>(mask_data[1])};
  Element* out = static_cast<Element*>(out_data);
  const int64_t lengths[2] = {window, fresh};
  const int64_t need = 2 * rows * d + rows * (window + fresh) + rows + (1 + kLanes) * d + (rows * d + 1) / 2;
  int failed = 0;
#pragma omp parallel
  {
    float* buffer = kept_buffer<float, 2>(need);
    // every thread meets the loop (its barrier), even one without a buffer
#pragma omp for schedule(static) reduction(| : failed)
    for (int64_t unit = 0; unit < batch * heads; ++unit) {
      if (!buffer) {
        failed = 1;
        continue;
      }
      attend(q, q_strides, kv, kv_strides, masks, mask_strides, unit / heads, unit % heads, rows, d, lengths, buffer,
             out + unit * rows * d);
    }
  }
  return !failed;
}

}  // namespace optimum_neuronx_kernels

#undef OPTIMUM_NEURONX_ATTENTION_TARGET
#undef OPTIMUM_NEURONX_ATTENTION_DENSE_ROWS
#undef OPTIMUM_NEURONX_FMA
#undef OPTIMUM_NEURONX_WIDEN

// AOTInductor's C shim for the op (see rows_matvec's).
extern "C" AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle q, AtenTensorHandle cache_k,
                                                          AtenTensorHandle cache_v, AtenTensorHandle cache_mask,
                                                          AtenTensorHandle new_k, AtenTensorHandle new_v,
                                                          AtenTensorHandle new_mask, AtenTensorHandle* ret0) {
  namespace kernels = optimum_neuronx_kernels;
  AtenTensorHandle kv[4] = {cache_k, cache_v, new_k, new_v}, masks[2] = {cache_mask, new_mask};
  int64_t dim, *q_sizes, *q_strides, *kv_sizes[4], *kv_strides[4], *mask_sizes[2], *mask_strides[2];
  int32_t dtype, other;
  void *q_data, *kv_data[4], *mask_data[2], *y_data;
  aoti_torch_get_dim(q, &dim);
  aoti_torch_get_dtype(q, &other);
  if (dim != 4 || other != aoti_torch_dtype_float32()) return AOTI_TORCH_FAILURE;
  aoti_torch_get_sizes(q, &q_sizes);
  aoti_torch_get_strides(q, &q_strides);
  aoti_torch_get_data_ptr(q, &q_data);
  aoti_torch_get_dtype(cache_k, &dtype);
  const bool bf16 = dtype == aoti_torch_dtype_bfloat16();
  if (!bf16 && dtype != aoti_torch_dtype_float32()) return AOTI_TORCH_FAILURE;
  const int64_t batch = q_sizes[0], heads = q_sizes[1], rows = q_sizes[2], d = q_sizes[3];
  for (int i = 0; i < 6; ++i) {
    AtenTensorHandle t = i < 4 ? kv[i] : masks[i - 4];
    aoti_torch_get_dim(t, &dim);
    aoti_torch_get_dtype(t, &other);
    if (dim != 4 || other != dtype) return AOTI_TORCH_FAILURE;
    int64_t *sizes, *strides;
    aoti_torch_get_sizes(t, &sizes);
    aoti_torch_get_strides(t, &strides);
    void* data;
    aoti_torch_get_data_ptr(t, &data);
    if (i < 4) {
      kv_sizes[i] = sizes, kv_strides[i] = strides, kv_data[i] = data;
      if (sizes[0] != batch || sizes[1] != heads || sizes[3] != d) return AOTI_TORCH_FAILURE;
    } else {
      mask_sizes[i - 4] = sizes, mask_strides[i - 4] = strides, mask_data[i - 4] = data;
      if (sizes[0] != batch || sizes[1] != 1 || sizes[2] != rows) return AOTI_TORCH_FAILURE;
    }
  }
  const int64_t window = kv_sizes[0][2], fresh = kv_sizes[2][2];
  if (kv_sizes[1][2] != window || kv_sizes[3][2] != fresh || mask_sizes[0][3] != window || mask_sizes[1][3] != fresh ||
      window + fresh == 0)
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[4] = {batch, heads, rows, d}, strides[4] = {heads * rows * d, rows * d, d, 1};
  AOTITorchError status = aoti_torch_empty_strided(4, sizes, strides, dtype, aoti_torch_device_type_cpu(), 0, ret0);
  if (status != AOTI_TORCH_SUCCESS) return status;
  if (batch * heads * rows * d == 0) return AOTI_TORCH_SUCCESS;
  aoti_torch_get_data_ptr(*ret0, &y_data);
  const bool done =
      bf16 ? kernels::decode_attention<uint16_t>(static_cast<const float*>(q_data), q_strides, kv_data, kv_strides,
                                                 mask_data, mask_strides, batch, heads, rows, d, window, fresh, y_data)
           : kernels::decode_attention<float>(static_cast<const float*>(q_data), q_strides, kv_data, kv_strides,
                                              mask_data, mask_strides, batch, heads, rows, d, window, fresh, y_data);
  return done ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}
