// A hand-written fp32 matmul for few rows, as an XLA FFI custom call: the experiment of
// bench/ffi_matmul.py (does a kernel of our own beat XLA:CPU's dots at decode shapes?).
// Not used by the runner.
//
// out[M, N] = x[M, K] @ w, with w stored [K, N] ("NN") or [N, K] ("NT", transposed = true).
// Register-blocked over (rows of x) x (16-float vectors of output); output columns (NN) or
// weight rows (NT) are split into chunks that the caller and XLA's intra-op thread pool take
// from one atomic counter. GCC/Clang vector extensions, so -march picks AVX-512 or AVX2.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
static inline float hsum(v16 v) {
  v8 a, b;
  std::memcpy(&a, &v, 32);
  std::memcpy(&b, reinterpret_cast<char*>(&v) + 32, 32);
  v8 s = a + b;
  v4 c, d;
  std::memcpy(&c, &s, 16);
  std::memcpy(&d, reinterpret_cast<char*>(&s) + 16, 16);
  v4 t = c + d;
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// NN: out[m, n0 : n0 + 16R] for rows m in [m0, m0 + MB), accumulators in registers.
template <int MB, int R>
static void nn_tile(const float* x, const float* w, float* out, int64_t m0, int64_t N, int64_t K, int64_t n0) {
  v16 acc[MB][R] = {};
  for (int64_t k = 0; k < K; ++k) {
    v16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + k * N + n0 + 16 * r);
    for (int m = 0; m < MB; ++m) {
      float a = x[(m0 + m) * K + k];
      for (int r = 0; r < R; ++r) acc[m][r] += a * wv[r];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) store(out + (m0 + m) * N + n0 + 16 * r, acc[m][r]);
}

template <int MB, int R>
static void nn_cols(const float* x, const float* w, float* out, int64_t m0, int64_t N, int64_t K, int64_t n0,
                    int64_t n1) {
  int64_t n = n0;
  for (; n + 16 * R <= n1; n += 16 * R) nn_tile<MB, R>(x, w, out, m0, N, K, n);
  for (; n + 16 <= n1; n += 16) nn_tile<MB, 1>(x, w, out, m0, N, K, n);
  for (; n < n1; ++n)
    for (int m = 0; m < MB; ++m) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[(m0 + m) * K + k] * w[k * N + n];
      out[(m0 + m) * N + n] = s;
    }
}

static void nn(const float* x, const float* w, float* out, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) nn_cols<8, 2>(x, w, out, m, N, K, n0, n1);
  if (M - m >= 4) nn_cols<4, 4>(x, w, out, m, N, K, n0, n1), m += 4;
  switch (M - m) {
    case 3: nn_cols<3, 4>(x, w, out, m, N, K, n0, n1); break;
    case 2: nn_cols<2, 8>(x, w, out, m, N, K, n0, n1); break;
    case 1: nn_cols<1, 8>(x, w, out, m, N, K, n0, n1); break;
  }
}

// NT: out[m, n] = x[m, :] . w[n, :] for weight rows n in [n0, n0 + R).
template <int MB, int R>
static void nt_tile(const float* x, const float* w, float* out, int64_t m0, int64_t N, int64_t K, int64_t n0) {
  v16 acc[MB][R] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + (n0 + r) * K + k);
    for (int m = 0; m < MB; ++m) {
      v16 xv = load(x + (m0 + m) * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += x[(m0 + m) * K + kk] * w[(n0 + r) * K + kk];
      out[(m0 + m) * N + n0 + r] = s;
    }
}

template <int MB, int R>
static void nt_rows(const float* x, const float* w, float* out, int64_t m0, int64_t N, int64_t K, int64_t n0,
                    int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) nt_tile<MB, R>(x, w, out, m0, N, K, n);
  for (; n < n1; ++n) nt_tile<MB, 1>(x, w, out, m0, N, K, n);
}

static void nt(const float* x, const float* w, float* out, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) nt_rows<8, 2>(x, w, out, m, N, K, n0, n1);
  if (M - m >= 4) nt_rows<4, 4>(x, w, out, m, N, K, n0, n1), m += 4;
  switch (M - m) {
    case 3: nt_rows<3, 4>(x, w, out, m, N, K, n0, n1); break;
    case 2: nt_rows<2, 4>(x, w, out, m, N, K, n0, n1); break;
    case 1: nt_rows<1, 4>(x, w, out, m, N, K, n0, n1); break;
  }
}

// Shared by the caller and the pool tasks; a task that starts after the last chunk is taken
// finds nothing to do, and holds the state alive (shared_ptr) until it returns.
struct Work {
  const float* x;
  const float* w;
  float* out;
  int64_t M, N, K, chunk, chunks;
  bool transposed;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      (transposed ? nt : nn)(x, w, out, M, N, K, n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

static ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> out, bool transposed) {
  auto dims = w.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("w must be 2-D");
  int64_t N = transposed ? dims[0] : dims[1], K = transposed ? dims[1] : dims[0];
  if (K == 0 || x.element_count() % K != 0) return ffi::Error::InvalidArgument("x's last dimension is not w's K");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->out = out->typed_data();
  work->M = x.element_count() / K;
  work->N = N;
  work->K = K;
  work->transposed = transposed;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t pieces = 4 * threads, align = transposed ? 4 : 128;
  work->chunk = std::max(align, ((N + pieces - 1) / pieces + align - 1) / align * align);
  work->chunks = (N + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t) pool.Schedule([work] { work->run(); });
  work->run();  // the caller works too, so it never waits on a pool that is busy elsewhere
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(matmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));
