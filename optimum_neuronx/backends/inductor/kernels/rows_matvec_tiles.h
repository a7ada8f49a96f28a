// rows_matvec.cpp's kernels over weights in tiles (AVX-512): decode (tiled_matvec) and prefill (tiled_gemm).

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
