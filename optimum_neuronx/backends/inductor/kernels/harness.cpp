// Times rows_matvec's dot kernel outside any graph: y [rows, n] = x [rows, k] @ W [n, k].T over one weight, against a
// plain read of the same weight in the same process, and prints one JSON line. Built by tools/kernel_harness.py
// with the defines a graph compiles the kernel with (custom_kernels.kernel_defines).
//
//   harness <f32|bf16> <rows> <k> <n> <repeats>
#define OPTIMUM_NEURONX_KERNELS_NO_SHIMS 1
#include "common.h"
#include "rows_matvec.cpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace {

template <typename F>
double best_seconds(int repeats, F f) {
  f();  // warm-up
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = s < best ? s : best;
  }
  return best;
}

float to_float(float v) { return v; }
float to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
void from_float(float* p, float v) { *p = v; }
void from_float(uint16_t* p, float v) { *p = optimum_neuronx_kernels::round_to_bf16(v); }

template <typename Lines>
int run(const char* dtype, int64_t rows, int64_t k, int64_t n, int repeats) {
  using Element = typename Lines::Element;
  auto* w = static_cast<Element*>(std::aligned_alloc(64, (n * k * sizeof(Element) + 63) / 64 * 64));
  auto* x = static_cast<Element*>(std::aligned_alloc(64, (rows * k * sizeof(Element) + 63) / 64 * 64));
  auto* y = static_cast<Element*>(std::aligned_alloc(64, (rows * n * sizeof(Element) + 63) / 64 * 64));
  if (!w || !x || !y) {
    std::fprintf(stderr, "harness: out of memory\n");
    return 1;
  }
#pragma omp parallel for
  for (int64_t i = 0; i < n * k; ++i) from_float(w + i, float((i * 7919) % 251) / 251.0f - 0.5f);
  for (int64_t i = 0; i < rows * k; ++i) from_float(x + i, float((i * 104729) % 127) / 127.0f - 0.5f);
  const int64_t x_strides[2] = {k, 1};
  bool ok = true;
  const double kernel_s = best_seconds(repeats, [&] {
    ok = ok && optimum_neuronx_kernels::rows_matvec<Lines>(x, x_strides, w, rows, k, n, y);
  });
  // A plain read of the weight: one float32 sum per thread over 64-bit words.
  const auto* words = reinterpret_cast<const uint64_t*>(w);
  const int64_t count = n * k * int64_t(sizeof(Element)) / 8;
  uint64_t sink = 0;
  const double read_s = best_seconds(repeats, [&] {
    uint64_t total = 0;
#pragma omp parallel for reduction(^ : total)
    for (int64_t i = 0; i < count; ++i) total ^= words[i];
    sink ^= total;
  });
  double max_error = 0;  // against a double sum, on a few outputs of every row
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; j += n / 7 + 1) {
      double ref = 0;
      for (int64_t i = 0; i < k; ++i) ref += double(to_float(x[r * k + i])) * double(to_float(w[j * k + i]));
      const double err = std::fabs(double(to_float(y[r * n + j])) - ref) / (1.0 + std::fabs(ref));
      max_error = err > max_error ? err : max_error;
    }
  const double bytes = double(n) * double(k) * sizeof(Element);
  std::printf(
      "{\"dtype\": \"%s\", \"rows\": %lld, \"k\": %lld, \"n\": %lld, \"threads\": %d, \"ok\": %s, \"kernel_gb_s\": %.3f, "
      "\"read_gb_s\": %.3f, \"max_relative_error\": %.3g, \"sink\": %llu}\n",
      dtype, (long long)rows, (long long)k, (long long)n, omp_get_max_threads(), ok ? "true" : "false",
      bytes / kernel_s / 1e9, bytes / read_s / 1e9, max_error, (unsigned long long)(sink & 1));
  std::free(w);
  std::free(x);
  std::free(y);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: harness <f32|bf16> <rows> <k> <n> <repeats>\n");
    return 2;
  }
  const int64_t rows = std::atoll(argv[2]), k = std::atoll(argv[3]), n = std::atoll(argv[4]);
  const int repeats = std::atoi(argv[5]);
  if (rows < 1 || rows > 64 || k < 1 || n < 1 || repeats < 1) {
    std::fprintf(stderr, "harness: rows 1-64, k, n and repeats positive\n");
    return 2;
  }
  if (std::strcmp(argv[1], "f32") == 0) return run<optimum_neuronx_kernels::Float32Lines>("f32", rows, k, n, repeats);
  if (std::strcmp(argv[1], "bf16") == 0) return run<optimum_neuronx_kernels::BFloat16Lines>("bf16", rows, k, n, repeats);
  std::fprintf(stderr, "harness: dtype %s is not f32 or bf16\n", argv[1]);
  return 2;
}
