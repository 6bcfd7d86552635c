// One decode step of Grok-1's grouped-query attention read straight from the KV cache, as an
// XLA FFI custom call (CPU, float32 queries; float32 or bf16 caches, or int8 ones with a float32
// scale a position and KV head).
//
//   q [B, N, H], caches k, v [B, K, S_max, H], mask [B, S] (S <= S_max)  ->  out [B, N, H]
//   out[b, n] = sum_s p[s] v[b, n / G, s]  over the keys s < S that mask[b] allows, with
//   p = softmax(t[b] * cap * tanh(scale * q[b, n] . k[b, n / G, s] / cap))   (G = N / K query heads a KV
//   head; t[b] a row's attention temperature, Grok-2's, 1 otherwise)
//   int8: k[b, j, s] = k_int8[b, j, s] * k_scale[b, j, s] (the same for v); the scale of a key
//   multiplies its logit after the dot, that of a value its weight, so the int8 rows are
//   converted in registers and never written back as floats (4x fewer bytes read than float32).
//
// Why (BENCHMARKS.md): XLA:CPU copies the first S positions out of each cache (a slice of a
// strided array) before its dots, one copy of K and one of V a layer and step, which took 5-9 ms
// of a 52 ms batch-32 step. Here each (row, KV head) is one task that reads its keys and
// values in place for all G query heads (a key row once, value rows a block at a time). Masked keys are skipped: their weight is
// exactly zero, as XLA's -1e30 logit gives; a row with no key allowed gets zeros.
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the int8 conversions
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using namespace grok_kernels;

// tanh(x) = sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}), about 2 ulp away from 0; near 0 the odd
// Taylor series x - x^3/3 + 2x^5/15 - 17x^7/315 avoids the cancellation.
inline v16 tanh_(v16 x) {
  v16 a = x < 0 ? -x : x;
  v16 e = exp_nonpositive(-2.0f * a);
  v16 big = (1.0f - e) / (1.0f + e);
  v16 a2 = a * a;
  v16 small = a * (1.0f + a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315))));
  v16 t = a < 0.0625f ? small : big;
  return x < 0 ? -t : t;
}

constexpr int kMaxHeadsPerKv = 16, kMaxHeadDim = 128;

// The per-key work runs on the target's own vectors (``vec``: 8 floats with AVX2, 16 with AVX-512):
// 16-float vectors are split by GCC into halves kept on the stack on AVX2, which made this kernel
// slower than XLA there (BENCHMARKS.md). An int8 row is sign-extended and converted a register at
// a time.
typedef int8_t bytes_vec __attribute__((vector_size(kLanes)));

inline vec load_lanes(const float* p) { return load_vec(p); }
inline vec load_lanes(const int8_t* p) {
#if defined(__AVX512F__)
  __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  bytes_vec x8;
  std::memcpy(&x8, p, sizeof x8);
  vec x = __builtin_convertvector(x8, vec);  // GCC scalarises this one on AVX2: the intrinsics above
#endif
  vec v;
  std::memcpy(&v, &x, sizeof v);
  return v;
}
// A bf16 row: each value's 16 bits are the high half of its float32 (exact), a zero-extend and shift.
inline vec load_lanes(const uint16_t* p) {
#if defined(__AVX512F__)
  __m512 x = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__)
  __m256 x = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  float x[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    uint32_t bits = uint32_t(p[l]) << 16;
    std::memcpy(&x[l], &bits, sizeof bits);
  }
#endif
  vec v;
  std::memcpy(&v, &x, sizeof v);
  return v;
}
template <typename T>
inline vec load_lanes_part(const T* p, int64_t count) {
  T part[kLanes] = {};
  std::memcpy(part, p, count * sizeof(T));
  return load_lanes(part);
}

inline float sum_lanes(vec v) {
#if defined(__AVX512F__)
  v16 w;
  std::memcpy(&w, &v, sizeof w);
  return sum(w);
#else
  v4 a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

// T: the caches' element type: float, uint16_t (bf16) or int8_t (then k_scale, v_scale [B, K, S_max]
// are read).
template <typename T>
struct Attention {
  const float* q;
  const T *k, *v;
  const float *k_scale, *v_scale;  // int8 only
  const bool* mask;
  const float* temperature;  // [B]: row b's logits are temperature[b] * cap * tanh(scale * x / cap)
  float* out;
  int64_t kv_heads, group, s_max, s, h;
  float scale, cap;

  static constexpr bool kScaled = std::is_same<T, int8_t>::value;

  // Row b, KV head j: its G query heads against keys 0 .. S-1 that the mask allows. HV = ceil(H / kLanes)
  // vectors a head (a compile-time count, so one head's accumulators stay in registers).
  template <int HV>
  void task(int64_t b, int64_t j) const {
    const int64_t g_count = group, tail = h % kLanes;  // the last vector's lanes in use (0: all)
    auto lanes = [tail](const auto* p, int c) {
      return c == HV - 1 && tail ? load_lanes_part(p + kLanes * c, tail) : load_lanes(p + kLanes * c);
    };
    const T* keys = k + (b * kv_heads + j) * s_max * h;
    const T* values = v + (b * kv_heads + j) * s_max * h;
    const float* key_scales = kScaled ? k_scale + (b * kv_heads + j) * s_max : nullptr;
    const float* value_scales = kScaled ? v_scale + (b * kv_heads + j) * s_max : nullptr;
    const float* query = q + (b * kv_heads + j) * group * h;  // heads j*G .. j*G+G-1 are contiguous
    const bool* allowed = mask + b * s;
    thread_local std::vector<int32_t> keep;  // the allowed positions, in order
    thread_local std::vector<float> logits;  // [G, padded]; both grow once, then are reused
    keep.clear();
    for (int64_t i = 0; i < s; ++i)
      if (allowed[i]) keep.push_back(i);
    const int64_t n = keep.size(), padded = (n + 15) / 16 * 16;
    float* o = out + (b * kv_heads + j) * group * h;
    if (n == 0) {
      std::memset(o, 0, group * h * sizeof(float));
      return;
    }
    logits.resize(g_count * padded);
    float* lg = logits.data();
    // q.k for the G heads: each key row is read once, and its value row fetched for the pass below
    for (int64_t i = 0; i < n; ++i) {
      const T* kr = keys + int64_t(keep[i]) * h;
      const char* vr = reinterpret_cast<const char*>(values + int64_t(keep[i]) * h);
      for (int64_t line = 0; line < h * int64_t(sizeof(T)); line += 64) __builtin_prefetch(vr + line);
      if (i + 8 < n) {
        const char* ahead = reinterpret_cast<const char*>(keys + int64_t(keep[i + 8]) * h);
        for (int64_t line = 0; line < h * int64_t(sizeof(T)); line += 64) __builtin_prefetch(ahead + line);
      }
      vec key[HV];
      for (int c = 0; c < HV; ++c) key[c] = lanes(kr, c);
      const float key_scale = kScaled ? key_scales[keep[i]] : 1.0f;
      int64_t g = 0;
      for (; g + 4 <= g_count; g += 4) {  // four heads at once: four independent chains of FMAs
        const float* qg = query + g * h;
        vec a0{}, a1{}, a2{}, a3{};
        for (int c = 0; c < HV; ++c) {
          a0 += lanes(qg, c) * key[c];
          a1 += lanes(qg + h, c) * key[c];
          a2 += lanes(qg + 2 * h, c) * key[c];
          a3 += lanes(qg + 3 * h, c) * key[c];
        }
        lg[g * padded + i] = sum_lanes(a0) * key_scale;
        lg[(g + 1) * padded + i] = sum_lanes(a1) * key_scale;
        lg[(g + 2) * padded + i] = sum_lanes(a2) * key_scale;
        lg[(g + 3) * padded + i] = sum_lanes(a3) * key_scale;
      }
      for (; g < g_count; ++g) {
        const float* qg = query + g * h;
        vec acc{};
        for (int c = 0; c < HV; ++c) acc += lanes(qg, c) * key[c];
        lg[g * padded + i] = sum_lanes(acc) * key_scale;
      }
    }
    // out[g] = sum_i p[g][i] v[keep[i]] / sum_i p[g][i], over blocks of keys whose value rows fit
    // in L1 (16 KiB), each block read once for all G heads: at long contexts a head's pass over all
    // the values would evict them before the next head's. An int8 value's scale multiplies its weight.
    float inv[kMaxHeadsPerKv];
    // t * cap * tanh(scale * x / cap) is the cap and scale both times t (exactly them where t = 1)
    const float row_scale = scale * temperature[b], row_cap = cap * temperature[b];
    for (int64_t g = 0; g < g_count; ++g) inv[g] = 1.0f / exp_logits(lg + g * padded, n, padded, row_scale, row_cap);
    thread_local std::vector<vec> sums;  // [G, HV]: each head's running sums between blocks
    sums.assign(g_count * HV, vec{});
    const int64_t block = std::max<int64_t>(16, (16 << 10) / (h * int64_t(sizeof(T))));
    for (int64_t start = 0; start < n; start += block) {
      const int64_t end = std::min(n, start + block);
      for (int64_t g = 0; g < g_count; ++g) {
        const float* p = lg + g * padded;
        vec acc[HV];
        for (int c = 0; c < HV; ++c) acc[c] = sums[g * HV + c];
        for (int64_t i = start; i < end; ++i) {
          const T* vr = values + int64_t(keep[i]) * h;
          const float weight = kScaled ? p[i] * value_scales[keep[i]] : p[i];
          for (int c = 0; c < HV; ++c) acc[c] += weight * lanes(vr, c);
        }
        for (int c = 0; c < HV; ++c) sums[g * HV + c] = acc[c];
      }
    }
    for (int64_t g = 0; g < g_count; ++g) {
      float* og = o + g * h;
      for (int c = 0; c < HV; ++c) {
        vec x = sums[g * HV + c] * inv[g];
        if (c == HV - 1 && tail) std::memcpy(og + kLanes * c, &x, tail * sizeof(float));
        else store_vec(og + kLanes * c, x);
      }
    }
  }

  // In place: the n logits of one head scaled, soft-capped and exponentiated less their maximum
  // (lanes n .. padded-1 are 0); returns their sum, the softmax's denominator.
  static float exp_logits(float* lg, int64_t n, int64_t padded, float scale, float cap) {
    v16 top = splat(-INFINITY);
    for (int64_t i = 0; i < padded; i += 16) {
      v16 x = load(lg + i) * scale;
      x = cap * tanh_(x / cap);
      store(lg + i, x);
      top = (i + 16 <= n) ? (x > top ? x : top) : top;
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; ++l) m = std::max(m, top[l]);
    for (int64_t i = n / 16 * 16; i < n; ++i) m = std::max(m, lg[i]);
    v16 total{};
    for (int64_t i = 0; i < padded; i += 16) {
      v16 p = exp_nonpositive(load(lg + i) - m);
      if (i + 16 > n)  // zero the lanes past n
        for (int64_t l = n - i; l < 16; ++l) p[l] = 0;
      store(lg + i, p);
      total += p;
    }
    return sum(total);
  }

  void task(int64_t b, int64_t j) const {
    switch ((h + kLanes - 1) / kLanes) {  // H <= 128 (checked by the caller): at most 16 vectors
      case 1: return task<1>(b, j);
      case 2: return task<2>(b, j);
      case 3: return task<3>(b, j);
      case 4: return task<4>(b, j);
      case 5: return task<5>(b, j);
      case 6: return task<6>(b, j);
      case 7: return task<7>(b, j);
      case 8: return task<8>(b, j);
      case 9: return task<9>(b, j);
      case 10: return task<10>(b, j);
      case 11: return task<11>(b, j);
      case 12: return task<12>(b, j);
      case 13: return task<13>(b, j);
      case 14: return task<14>(b, j);
      case 15: return task<15>(b, j);
      default: return task<16>(b, j);
    }
  }
};

// The shapes every handler takes; an error says what they must be. The caches are every layer's
// [L, B, K, S_max, H] (model.memory.KVMemory), of which layer `layer` is read in place: a slice
// of the stack handed to a custom call would be copied out first.
template <typename KV>
ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& q, const KV& k, const KV& v, const ffi::Buffer<ffi::PRED>& mask,
                       const ffi::Buffer<ffi::S32>& layer, ffi::ResultBuffer<ffi::F32>& out) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (qd.size() != 3 || kd.size() != 5 || md.size() != 2 || layer.dimensions().size() != 0 ||
      !same(v.dimensions(), kd) || !same(out->dimensions(), qd))
    return ffi::Error::InvalidArgument(
        "decode_attention: q [B, N, H], k and v [L, B, K, S_max, H], mask [B, S], layer a scalar");
  int64_t batch = qd[0], heads = qd[1], h = qd[2], kv_heads = kd[2];
  if (kd[1] != batch || kd[4] != h || md[0] != batch || md[1] > kd[3] || kv_heads == 0 ||
      heads % kv_heads != 0 || heads / kv_heads > kMaxHeadsPerKv || h > kMaxHeadDim)
    return ffi::Error::InvalidArgument(
        "decode_attention: shapes do not match, or G > 16 query heads a KV head, or H > 128");
  int32_t l = *layer.typed_data();
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  return ffi::Error::Success();
}

// Elements of one layer of a [L, B, K, S_max, H] (or [..., 1]) stack: where layer `layer` starts.
template <typename KV>
int64_t LayerOffset(const KV& x, const ffi::Buffer<ffi::S32>& layer) {
  auto d = x.dimensions();
  return int64_t(*layer.typed_data()) * d[1] * d[2] * d[3] * d[4];
}

// One factor a row: [B] float32.
ffi::Error CheckTemperature(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& temperature) {
  auto td = temperature.dimensions();
  if (td.size() != 1 || td[0] != q.dimensions()[0])
    return ffi::Error::InvalidArgument("decode attention: the temperature must be [B] like the queries' rows");
  return ffi::Error::Success();
}

template <typename T>
void Run(ffi::ThreadPool& pool, const Attention<T>& a, int64_t batch) {
  ParallelFor(pool, batch * a.kv_heads, [&](int64_t t) { a.task(t / a.kv_heads, t % a.kv_heads); });
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> temperature,
                           ffi::Buffer<ffi::S32> layer, float scale, float cap, ffi::ResultBuffer<ffi::F32> out) {
  if (auto error = CheckShapes(q, k, v, mask, layer, out); error.failure()) return error;
  if (auto error = CheckTemperature(q, temperature); error.failure()) return error;
  auto qd = q.dimensions(), kd = k.dimensions();
  int64_t at = LayerOffset(k, layer);
  Attention<float> a{q.typed_data(), k.typed_data() + at, v.typed_data() + at, nullptr, nullptr, mask.typed_data(),
                     temperature.typed_data(), out->typed_data(), kd[2], qd[1] / kd[2], kd[3], mask.dimensions()[1], qd[2], scale, cap};
  Run(pool, a, qd[0]);
  return ffi::Error::Success();
}

// A bf16 cache: k, v [L, B, K, S_max, H] bf16, widened in registers (half of float32's bytes read).
ffi::Error DecodeAttentionBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::BF16> k,
                               ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> temperature,
                               ffi::Buffer<ffi::S32> layer, float scale, float cap, ffi::ResultBuffer<ffi::F32> out) {
  if (auto error = CheckShapes(q, k, v, mask, layer, out); error.failure()) return error;
  if (auto error = CheckTemperature(q, temperature); error.failure()) return error;
  auto qd = q.dimensions(), kd = k.dimensions();
  int64_t at = LayerOffset(k, layer);
  Attention<uint16_t> a{q.typed_data(), reinterpret_cast<const uint16_t*>(k.typed_data()) + at,
                        reinterpret_cast<const uint16_t*>(v.typed_data()) + at, nullptr, nullptr, mask.typed_data(),
                        temperature.typed_data(), out->typed_data(), kd[2], qd[1] / kd[2], kd[3], mask.dimensions()[1], qd[2], scale, cap};
  Run(pool, a, qd[0]);
  return ffi::Error::Success();
}

// The int8 cache: values k, v [L, B, K, S_max, H] int8 and their scales [L, B, K, S_max, 1] float32.
ffi::Error DecodeAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> temperature,
                               ffi::Buffer<ffi::S32> layer, float scale, float cap, ffi::ResultBuffer<ffi::F32> out) {
  if (auto error = CheckShapes(q, k, v, mask, layer, out); error.failure()) return error;
  if (auto error = CheckTemperature(q, temperature); error.failure()) return error;
  auto qd = q.dimensions(), kd = k.dimensions();
  for (auto* s : {&k_scale, &v_scale}) {
    auto sd = s->dimensions();
    if (sd.size() != 5 || sd[0] != kd[0] || sd[1] != kd[1] || sd[2] != kd[2] || sd[3] != kd[3] || sd[4] != 1)
      return ffi::Error::InvalidArgument("decode_attention_int8: scales must be [L, B, K, S_max, 1] like k and v");
  }
  int64_t at = LayerOffset(k, layer), scales_at = LayerOffset(k_scale, layer);
  Attention<int8_t> a{q.typed_data(), k.typed_data() + at, v.typed_data() + at, k_scale.typed_data() + scales_at,
                      v_scale.typed_data() + scales_at, mask.typed_data(), temperature.typed_data(), out->typed_data(),
                      kd[2], qd[1] / kd[2], kd[3], mask.dimensions()[1], qd[2], scale, cap};
  Run(pool, a, qd[0]);
  return ffi::Error::Success();
}

// The cache write: `update` [B, T, K, H] into layer `layer` of a stack [L, B, K, S, H] (any
// dtype: the rows are copied as bytes) at (rows[b, t], positions[b, t]); a row or position out of
// range is dropped. The result aliases the stack (ffi_call's input_output_aliases), so with the
// stack donated the write is in place: XLA:CPU's scatter into a bf16 stack widens the whole stack
// to float32 and back, and its bits-as-uint16 scatter copies the stack for each layer's readers.
ffi::Error KvWrite(ffi::AnyBuffer stack, ffi::AnyBuffer update, ffi::Buffer<ffi::S32> rows,
                   ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out) {
  auto sd = stack.dimensions(), ud = update.dimensions(), rd = rows.dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (sd.size() != 5 || ud.size() != 4 || rd.size() != 2 || layer.dimensions().size() != 0 ||
      !same(positions.dimensions(), rd) || ud[0] != rd[0] || ud[1] != rd[1] || ud[2] != sd[2] || ud[3] != sd[4] ||
      update.element_type() != stack.element_type() || out->element_type() != stack.element_type() ||
      !same(out->dimensions(), sd))
    return ffi::Error::InvalidArgument(
        "kv_write: stack [L, B, K, S, H], update [B', T, K, H] of its dtype, rows and positions [B', T], layer a scalar");
  int32_t l = *layer.typed_data();
  if (l < 0 || l >= sd[0]) return ffi::Error::InvalidArgument("kv_write: layer out of range");
  auto* dst = static_cast<char*>(out->untyped_data());
  if (dst != stack.untyped_data()) std::memcpy(dst, stack.untyped_data(), stack.size_bytes());
  const int64_t width = ffi::ByteWidth(stack.element_type()), kv_heads = sd[2], s_max = sd[3];
  const int64_t row = width * sd[4];  // bytes of one (head, position)
  const auto* src = static_cast<const char*>(update.untyped_data());
  const int32_t *r = rows.typed_data(), *p = positions.typed_data();
  for (int64_t i = 0; i < rd[0] * rd[1]; ++i) {
    if (r[i] < 0 || r[i] >= sd[1] || p[i] < 0 || p[i] >= s_max) continue;
    char* at = dst + ((((int64_t(l) * sd[1] + r[i]) * kv_heads) * s_max + p[i]) * row);
    for (int64_t k = 0; k < kv_heads; ++k) std::memcpy(at + k * s_max * row, src + (i * kv_heads + k) * row, row);
  }
  return ffi::Error::Success();
}

// A block of the cache read in place: positions [start, start + size) of rows `rows[g]` of layer
// `layer` of a stack [L, B, K, S, H] (any dtype: copied as bytes), as [G, K, size, H]. Indices are
// clamped as XLA's dynamic_slice and clamped gather clamp them (a row into [0, B), the start into
// [0, S - size]). XLA:CPU slices a bf16 stack only through a copy of the whole stack (widened to
// float32, or as its 16-bit patterns), once a layer in a prefill's loop over key blocks.
ffi::Error KvRead(ffi::AnyBuffer stack, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> start,
                  ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out) {
  auto sd = stack.dimensions(), od = out->dimensions(), rd = rows.dimensions();
  if (sd.size() != 5 || od.size() != 4 || rd.size() != 1 || start.dimensions().size() != 0 ||
      layer.dimensions().size() != 0 || od[0] != rd[0] || od[1] != sd[2] || od[2] > sd[3] || od[3] != sd[4] ||
      out->element_type() != stack.element_type())
    return ffi::Error::InvalidArgument(
        "kv_read: stack [L, B, K, S, H], rows [G], start and layer scalars, out [G, K, size <= S, H] of its dtype");
  int32_t l = *layer.typed_data();
  if (l < 0 || l >= sd[0]) return ffi::Error::InvalidArgument("kv_read: layer out of range");
  const int64_t kv_heads = sd[2], s_max = sd[3], size = od[2];
  const int64_t row = ffi::ByteWidth(stack.element_type()) * sd[4];  // bytes of one (head, position)
  const int64_t from = std::clamp<int64_t>(*start.typed_data(), 0, s_max - size);
  const auto* src = static_cast<const char*>(stack.untyped_data());
  auto* dst = static_cast<char*>(out->untyped_data());
  const int32_t* r = rows.typed_data();
  for (int64_t g = 0; g < rd[0]; ++g) {
    const int64_t b = std::clamp<int64_t>(r[g], 0, sd[1] - 1);
    for (int64_t k = 0; k < kv_heads; ++k)
      std::memcpy(dst + (g * kv_heads + k) * size * row,
                  src + (((int64_t(l) * sd[1] + b) * kv_heads + k) * s_max + from) * row, size * row);
  }
  return ffi::Error::Success();
}

// Blocks of `size` positions copied between two caches of every layer, [L, R, K, S, H] and
// [L, R', K, S', H] of one dtype (a slot stack and the prefix pool, either way): for each i,
// positions [dst_pos[i], + size) of row dst_row[i] of `dst` take positions [src_pos[i], + size) of
// row src_row[i] of `src`, in every layer and head; a pair with a row or block out of range
// (dst_row -1: none) is skipped. The result aliases `dst`, so with it donated the copy is in place:
// XLA:CPU's dynamic_update_slice into a bf16 pool widens the whole pool to float32 and back.
ffi::Error KvCopyBlocks(ffi::AnyBuffer dst, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> dst_row,
                        ffi::Buffer<ffi::S32> dst_pos, ffi::Buffer<ffi::S32> src_row, ffi::Buffer<ffi::S32> src_pos,
                        int64_t size, ffi::Result<ffi::AnyBuffer> out) {
  auto dd = dst.dimensions(), sd = src.dimensions(), pd = dst_row.dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (dd.size() != 5 || sd.size() != 5 || pd.size() != 1 || dd[0] != sd[0] || dd[2] != sd[2] || dd[4] != sd[4] ||
      src.element_type() != dst.element_type() || out->element_type() != dst.element_type() ||
      !same(out->dimensions(), dd) || !same(dst_pos.dimensions(), pd) || !same(src_row.dimensions(), pd) ||
      !same(src_pos.dimensions(), pd) || size < 1)
    return ffi::Error::InvalidArgument(
        "kv_copy_blocks: dst [L, R, K, S, H] and src [L, R', K, S', H] of one dtype, four index vectors [M], size >= 1");
  auto* to = static_cast<char*>(out->untyped_data());
  if (to != dst.untyped_data()) std::memcpy(to, dst.untyped_data(), dst.size_bytes());
  const auto* from = static_cast<const char*>(src.untyped_data());
  const int64_t row = ffi::ByteWidth(dst.element_type()) * dd[4], bytes = size * row;
  const int32_t *dr = dst_row.typed_data(), *dp = dst_pos.typed_data(), *sr = src_row.typed_data(),
                *sp = src_pos.typed_data();
  for (int64_t i = 0; i < pd[0]; ++i) {
    if (dr[i] < 0 || dr[i] >= dd[1] || dp[i] < 0 || dp[i] + size > dd[3] || sr[i] < 0 || sr[i] >= sd[1] || sp[i] < 0 ||
        sp[i] + size > sd[3])
      continue;
    for (int64_t l = 0; l < dd[0]; ++l)
      for (int64_t k = 0; k < dd[2]; ++k)
        std::memcpy(to + (((l * dd[1] + dr[i]) * dd[2] + k) * dd[3] + dp[i]) * row,
                    from + (((l * sd[1] + sr[i]) * sd[2] + k) * sd[3] + sp[i]) * row, bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(decode_attention_int8, DecodeAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(decode_attention_bf16, DecodeAttentionBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kv_write, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kv_read, KvRead,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kv_copy_blocks, KvCopyBlocks,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("size")
                                  .Ret<ffi::AnyBuffer>());
