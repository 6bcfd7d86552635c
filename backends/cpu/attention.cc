// One decode step of Grok-1's grouped-query attention read straight from the KV cache, as an
// XLA FFI custom call (CPU, float32).
//
//   q [B, N, H], caches k, v [B, K, S_max, H], mask [B, S] (S <= S_max)  ->  out [B, N, H]
//   out[b, n] = sum_s p[s] v[b, n / G, s]  over the keys s < S that mask[b] allows, with
//   p = softmax(cap * tanh(scale * q[b, n] . k[b, n / G, s] / cap))   (G = N / K query heads a KV head)
//
// Why (BENCHMARKS.md): XLA:CPU copies the first S positions out of each cache (a slice of a
// strided array) before its dots, one copy of K and one of V a layer and step, which took 5-9 ms
// of a 52 ms batch-32 step. Here each (row, KV head) is one task that reads its keys and
// values in place, once, for all G query heads. Masked keys are skipped: their weight is
// exactly zero, as XLA's -1e30 logit gives; a row with no key allowed gets zeros.
#include <cmath>
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

struct Attention {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t kv_heads, group, s_max, s, h;
  float scale, cap;

  // Row b, KV head j: its G query heads against keys 0 .. S-1 that the mask allows. HV = ceil(H / 16)
  // vectors a head (a compile-time count, so one head's accumulators stay in registers).
  template <int HV>
  void task(int64_t b, int64_t j) const {
    const int64_t g_count = group, tail = h % 16;  // the last vector's lanes in use (0: all 16)
    auto row = [tail](const float* p, int c) { return c == HV - 1 && tail ? load_part(p + 16 * c, tail) : load(p + 16 * c); };
    const float* keys = k + (b * kv_heads + j) * s_max * h;
    const float* values = v + (b * kv_heads + j) * s_max * h;
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
      const float* kr = keys + int64_t(keep[i]) * h;
      const char* vr = reinterpret_cast<const char*>(values + int64_t(keep[i]) * h);
      for (int64_t line = 0; line < h * int64_t(sizeof(float)); line += 64) __builtin_prefetch(vr + line);
      if (i + 8 < n) {
        const char* ahead = reinterpret_cast<const char*>(keys + int64_t(keep[i + 8]) * h);
        for (int64_t line = 0; line < h * int64_t(sizeof(float)); line += 64) __builtin_prefetch(ahead + line);
      }
      v16 key[HV];
      for (int c = 0; c < HV; ++c) key[c] = row(kr, c);
      for (int64_t g = 0; g < g_count; ++g) {
        const float* qg = query + g * h;
        v16 acc = row(qg, 0) * key[0];
        for (int c = 1; c < HV; ++c) acc += row(qg, c) * key[c];
        lg[g * padded + i] = sum(acc);
      }
    }
    // out[g] = sum_i p[g][i] v[keep[i]] / sum_i p[g][i], one head at a time (the value rows are in
    // cache by now)
    for (int64_t g = 0; g < g_count; ++g) {
      float* p = lg + g * padded;
      const float inv = 1.0f / exp_logits(p, n, padded);
      v16 acc[HV] = {};
      for (int64_t i = 0; i < n; ++i) {
        const float* vr = values + int64_t(keep[i]) * h;
        for (int c = 0; c < HV; ++c) acc[c] += p[i] * row(vr, c);
      }
      float* og = o + g * h;
      for (int c = 0; c < HV; ++c) {
        acc[c] *= inv;
        if (c == HV - 1 && tail) std::memcpy(og + 16 * c, &acc[c], tail * sizeof(float));
        else store(og + 16 * c, acc[c]);
      }
    }
  }

  // In place: the n logits of one head scaled, soft-capped and exponentiated less their maximum
  // (lanes n .. padded-1 are 0); returns their sum, the softmax's denominator.
  float exp_logits(float* lg, int64_t n, int64_t padded) const {
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
    switch ((h + 15) / 16) {
      case 1: return task<1>(b, j);
      case 2: return task<2>(b, j);
      case 3: return task<3>(b, j);
      case 4: return task<4>(b, j);
      case 5: return task<5>(b, j);
      case 6: return task<6>(b, j);
      case 7: return task<7>(b, j);
      default: return task<8>(b, j);  // H <= 128 (checked by the caller)
    }
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, float scale, float cap,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  auto same = [](auto a, auto b) { return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin()); };
  if (qd.size() != 3 || kd.size() != 4 || md.size() != 2 || !same(v.dimensions(), kd) || !same(out->dimensions(), qd))
    return ffi::Error::InvalidArgument("decode_attention: q [B, N, H], k and v [B, K, S_max, H], mask [B, S]");
  int64_t batch = qd[0], heads = qd[1], h = qd[2], kv_heads = kd[1];
  if (kd[0] != batch || kd[3] != h || md[0] != batch || md[1] > kd[2] || kv_heads == 0 ||
      heads % kv_heads != 0 || heads / kv_heads > kMaxHeadsPerKv || h > kMaxHeadDim)
    return ffi::Error::InvalidArgument(
        "decode_attention: shapes do not match, or G > 16 query heads a KV head, or H > 128");
  Attention a{q.typed_data(), k.typed_data(), v.typed_data(), mask.typed_data(), out->typed_data(),
              kv_heads, heads / kv_heads, kd[2], md[1], h, scale, cap};
  ParallelFor(pool, batch * kv_heads, [&](int64_t t) { a.task(t / kv_heads, t % kv_heads); });
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
                                  .Attr<float>("scale")
                                  .Attr<float>("cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
