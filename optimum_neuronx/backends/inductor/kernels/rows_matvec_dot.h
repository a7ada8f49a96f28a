// rows_matvec.cpp's dot scheduler: blocks of weight rows times rows of x, pieces, and the threads' shares.

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
