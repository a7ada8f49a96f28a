// What optimum-neuronx's kernels share (rows_matvec.cpp, decode_attention.cpp): the headers, bfloat16 rounding and
// per-thread buffers. custom_kernels.py splices this file once in front of the kernels in a graph's wrapper; the
// harness (harness.cpp) includes it.
#ifndef OPTIMUM_NEURONX_KERNELS_COMMON_H
#define OPTIMUM_NEURONX_KERNELS_COMMON_H

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

namespace optimum_neuronx_kernels {

constexpr int64_t kLineBytes = 64;

inline uint16_t round_to_bf16(float value) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  if (value != value) return 0x7fc0;
  uint32_t bits;
  __builtin_memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
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

}  // namespace optimum_neuronx_kernels

#endif  // OPTIMUM_NEURONX_KERNELS_COMMON_H
