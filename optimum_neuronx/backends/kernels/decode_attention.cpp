// optimum_neuronx::decode_attention for AOTInductor on x86 CPUs with AVX-512 or AVX2 (see inductor_kernels.py).
//
// Decode attention over a cache window and the step's new tokens, for one group of query rows per (sequence, KV
// head): q [B, KV, R, D] float32, already scaled (R: the group's query heads times the new tokens); keys and
// values [B, KV, W, D] (the window, a view of the cache) and [B, KV, T, D] (the new tokens), bfloat16 or float32;
// additive masks [B, 1, R, W] and [B, 1, R, T] of that dtype. One softmax over both parts, float32 throughout,
// the output [B, KV, R, D] rounded once to the keys' dtype. Each (sequence, KV head) is one unit of work for one
// thread, which reads each key and value row once for all R query rows; Inductor's fused reductions read them once
// per query head and split the work into ~15 loops, each ending in a barrier of all threads.
//
// Spliced after rows_matvec.cpp into the same wrapper (inductor_kernels.py), whose helpers it uses.

namespace optimum_neuronx_kernels {

#if OPTIMUM_NEURONX_DOT_AVX512
constexpr int kLanes = 16;
#define OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((target("avx512f,avx512bw"), optimize("O3")))
#define OPTIMUM_NEURONX_FMA(a, b, c) ((Floats)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#else
constexpr int kLanes = 8;
#define OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((target("avx2,fma"), optimize("O3")))
#define OPTIMUM_NEURONX_FMA(a, b, c) ((Floats)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#endif

// GCC vector extensions: one source for both widths.
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats splat(float value) {
  return Floats{} + value;
}

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats load_floats(const float* p) {
  Floats v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline Floats load_floats(const uint16_t* p) {
  Halves h;  // bfloat16: the upper half of a float32
  __builtin_memcpy(&h, p, sizeof(h));
  return (Floats)(__builtin_convertvector(h, Words) << 16);
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

OPTIMUM_NEURONX_ATTENTION_TARGET __attribute__((always_inline)) inline float dot(const float* __restrict a,
                                                                                const float* __restrict b, int64_t d) {
  Floats even = {}, odd = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= d; i += 2 * kLanes) {
    even = OPTIMUM_NEURONX_FMA(load_floats(a + i), load_floats(b + i), even);
    odd = OPTIMUM_NEURONX_FMA(load_floats(a + i + kLanes), load_floats(b + i + kLanes), odd);
  }
  for (; i + kLanes <= d; i += kLanes) even = OPTIMUM_NEURONX_FMA(load_floats(a + i), load_floats(b + i), even);
  float sum = lane_sum(even + odd);
  for (; i < d; ++i) sum += a[i] * b[i];
  return sum;
}

// Scores of one part: scores[r * stride + j] = q[r] . keys[j] + mask[r, j], j < keys.length.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET void part_scores(const float* __restrict q, int64_t rows, int64_t d,
                                                  const Element* __restrict keys, const int64_t* key_strides,
                                                  const Element* __restrict mask, const int64_t* mask_strides,
                                                  int64_t length, float* __restrict scores, int64_t stride,
                                                  float* __restrict key) {
  for (int64_t j = 0; j < length; ++j) {
    row_to_floats(key, keys + j * key_strides[2], d, key_strides[3]);
    for (int64_t r = 0; r < rows; ++r)
      scores[r * stride + j] = dot(q + r * d, key, d) + to_float(mask[r * mask_strides[2] + j * mask_strides[3]]);
  }
}

// out[r] += sum_j weights[r * stride + j] * values[j], j < length.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET void part_values(const float* __restrict weights, int64_t rows, int64_t d,
                                                  const Element* __restrict values, const int64_t* value_strides,
                                                  int64_t length, int64_t stride, float* __restrict out,
                                                  float* __restrict value) {
  for (int64_t j = 0; j < length; ++j) {
    row_to_floats(value, values + j * value_strides[2], d, value_strides[3]);
    for (int64_t r = 0; r < rows; ++r) {
      const Floats weight = splat(weights[r * stride + j]);
      float* o = out + r * d;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        const Floats sum = OPTIMUM_NEURONX_FMA(weight, load_floats(value + i), load_floats(o + i));
        __builtin_memcpy(o + i, &sum, sizeof(sum));
      }
      for (; i < d; ++i) o[i] += weights[r * stride + j] * value[i];
    }
  }
}

// In place over each of `rows` rows of `length` scores: exp(score - the row's max); returns nothing, writes each
// row's sum of weights to sums[r].
OPTIMUM_NEURONX_ATTENTION_TARGET void softmax_weights(float* __restrict scores, int64_t rows, int64_t length,
                                                      int64_t stride, float* __restrict sums) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * stride;
    float peak = s[0];
    for (int64_t j = 1; j < length; ++j) peak = s[j] > peak ? s[j] : peak;
    Floats total = {};
    int64_t j = 0;
    for (; j + kLanes <= length; j += kLanes) {
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

// One (sequence b, KV head h): its R query rows over both parts. kv: window keys, window values, new keys, new
// values; masks: window, new (one per sequence, for every KV head). `buffer`: the thread's scratch.
template <typename Element>
OPTIMUM_NEURONX_ATTENTION_TARGET void attend(const float* q, const int64_t* q_strides, const Element* const* kv,
                                             const int64_t* const* kv_strides, const Element* const* masks,
                                             const int64_t* const* mask_strides, int64_t b, int64_t h, int64_t rows,
                                             int64_t d, const int64_t (&lengths)[2], float* buffer, Element* y) {
  const int64_t length = lengths[0] + lengths[1];
  float* query = buffer;                // [rows, d]
  float* scores = query + rows * d;     // [rows, length], then the softmax weights
  float* row = scores + rows * length;  // one key or value row [d]
  float* sums = row + d;                // [rows, d], the weighted sums of the values
  float* totals = sums + rows * d;      // [rows], the sums of the weights
  for (int64_t r = 0; r < rows; ++r)
    row_to_floats(query + r * d, q + b * q_strides[0] + h * q_strides[1] + r * q_strides[2], d, q_strides[3]);
  const int64_t offsets[2] = {0, lengths[0]};  // each part's first column of `scores`
  for (int p = 0; p < 2; ++p) {
    const int64_t *ks = kv_strides[2 * p], *ms = mask_strides[p];
    part_scores(query, rows, d, kv[2 * p] + b * ks[0] + h * ks[1], ks, masks[p] + b * ms[0], ms, lengths[p],
                scores + offsets[p], length, row);
  }
  softmax_weights(scores, rows, length, length, totals);
  __builtin_memset(sums, 0, rows * d * sizeof(float));
  for (int p = 0; p < 2; ++p) {
    const int64_t* vs = kv_strides[2 * p + 1];
    part_values(scores + offsets[p], rows, d, kv[2 * p + 1] + b * vs[0] + h * vs[1], vs, lengths[p], length, sums,
                row);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.f / totals[r];
    for (int64_t i = 0; i < d; ++i) store_element(y + r * d + i, sums[r * d + i] * inverse);
  }
}

// All (sequence, KV head) units, split between the threads; `out` [B, KV, R, D] contiguous.
template <typename Element>
bool decode_attention(const float* q, const int64_t* q_strides, const Element* const* kv,
                      const int64_t* const* kv_strides, const Element* const* masks,
                      const int64_t* const* mask_strides, int64_t batch, int64_t heads, int64_t rows, int64_t d,
                      int64_t window, int64_t fresh, Element* out) {
  const int64_t lengths[2] = {window, fresh};
  const int64_t need = 2 * rows * d + rows * (window + fresh) + d + rows;
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
#undef OPTIMUM_NEURONX_FMA

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
  bool done;
  if (bf16) {
    const uint16_t* kv_ptrs[4] = {static_cast<const uint16_t*>(kv_data[0]), static_cast<const uint16_t*>(kv_data[1]),
                                  static_cast<const uint16_t*>(kv_data[2]), static_cast<const uint16_t*>(kv_data[3])};
    const uint16_t* mask_ptrs[2] = {static_cast<const uint16_t*>(mask_data[0]), static_cast<const uint16_t*>(mask_data[1])};
    done = kernels::decode_attention<uint16_t>(static_cast<const float*>(q_data), q_strides, kv_ptrs, kv_strides,
                                               mask_ptrs, mask_strides, batch, heads, rows, d, window, fresh,
                                               static_cast<uint16_t*>(y_data));
  } else {
    const float* kv_ptrs[4] = {static_cast<const float*>(kv_data[0]), static_cast<const float*>(kv_data[1]),
                               static_cast<const float*>(kv_data[2]), static_cast<const float*>(kv_data[3])};
    const float* mask_ptrs[2] = {static_cast<const float*>(mask_data[0]), static_cast<const float*>(mask_data[1])};
    done = kernels::decode_attention<float>(static_cast<const float*>(q_data), q_strides, kv_ptrs, kv_strides,
                                            mask_ptrs, mask_strides, batch, heads, rows, d, window, fresh,
                                            static_cast<float*>(y_data));
  }
  return done ? AOTI_TORCH_SUCCESS : AOTI_TORCH_FAILURE;
}
