// What the CPU kernels (panel_matmul.cc, attention.cc) share: 16-float vectors and a parallel
// loop over XLA's intra-op thread pool.
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

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

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
