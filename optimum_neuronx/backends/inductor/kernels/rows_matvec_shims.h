// rows_matvec.cpp's AOTInductor entry points: the C shim functions a graph's wrapper calls.


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
