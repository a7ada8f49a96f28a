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
//
// The parts, included in this order: rows_matvec_lines.h (a 64-byte line of weight per element type and instruction
// set), rows_matvec_dot.h (blocks, pieces and the threads' shares), rows_matvec_tiles.h (weights in tiles), then
// rows_matvec_shims.h (the AOTInductor entry points). custom_kernels.kernel_source splices them into one text.
#include "common.h"

namespace optimum_neuronx_kernels {

constexpr int kMaxRows = 4;  // rows of x per pass over the weight (one accumulator each per weight row)

#include "rows_matvec_lines.h"

#include "rows_matvec_dot.h"

#include "rows_matvec_tiles.h"

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
#include "rows_matvec_shims.h"
