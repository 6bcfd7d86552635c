// What the CPU kernels (panel_matmul.cc, attention.cc, sampling.cc) share: 16-float vectors, a
// vectorised e^x, and a parallel loop over XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace grok_kernels {

namespace ffi = xla::ffi;

typedef float v16 __attribute__((vector_size(64)));  // GCC/Clang vector extension: AVX-512 or 2 x AVX2
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));

// The widest vector the target has registers for: a vector type wider than the registers is
// split by GCC into halves that it keeps on the stack, which made the panel kernel 4-50x slower
// built for AVX2 (BENCHMARKS.md). kVectorRegisters bounds how many accumulators a kernel keeps.
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
constexpr int kVectorRegisters = 32;
#else
typedef float vec __attribute__((vector_size(32)));  // AVX2 (and SSE, as two halves)
constexpr int kVectorRegisters = 16;
#endif
constexpr int kLanes = sizeof(vec) / sizeof(float);

inline vec load_vec(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void store_vec(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 load_part(const float* p, int64_t count) { v16 v{}; std::memcpy(&v, p, count * sizeof(float)); return v; }
inline v16 splat(float a) { return v16{} + a; }

inline float sum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// e^x for x <= 0 to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 Taylor
// polynomial, 2^n built in the exponent bits. Below -87 (where float underflows) it is 0.
inline v16 exp_nonpositive(v16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  v16 n = x * 1.44269504f;
  i16 ni = __builtin_convertvector(n - 0.5f, i16);  // round half down: x <= 0, so n <= 0
  n = __builtin_convertvector(ni, v16);
  v16 r = x - n * 0.693145752f - n * 1.42860677e-6f;
  v16 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  i16 bits = (ni + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// fn(i) for every i in [0, count), on the caller and up to count - 1 pool threads, which take
// indices from one counter; returns when all are done. The caller works too, so it never waits
// on a pool that is busy elsewhere. A pool task that starts after the last index is taken finds
// nothing to do and never touches fn; it holds the counters (shared_ptr) until it returns.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, const Fn& fn) {
  if (count <= 0) return;
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, count, f = &fn] {
    for (int64_t i; (i = counters->next.fetch_add(1)) < count;) {
      (*f)(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t t = 1; t < std::min(threads, count); ++t) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace grok_kernels
