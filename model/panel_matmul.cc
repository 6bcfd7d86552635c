// fp32 matmul against a weight packed in column panels, as an XLA FFI custom call (CPU).
//
//   out[..., N] = x[..., K] @ w,  with w [K, N] stored as panels [P, K, 32]: panel p holds
//   columns 32p .. 32p + 31 (zero past N), row after row, so each panel is one contiguous run.
//
// Why (BENCHMARKS.md, "Expert weights in panels"): decode multiplies a few rows by weights far
// larger than the caches. XLA:CPU runs products of 2 to 32 rows at 10-20 GB/s of weights, and a
// register-blocked kernel reading the plain [K, N] layout was no better: each row of a column
// tile lies a whole weight row away from the last, which defeats the hardware prefetchers.
// Reading a panel front to back streams it. Per panel, up to 8 rows of x at a time are
// accumulated in registers (8 x 2 vectors of 16 floats); panels are split into chunks that the
// caller and XLA's intra-op thread pool take from one atomic counter.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;
using Panels = ffi::Buffer<ffi::F32, 3>;  // an alias: a macro argument cannot hold the comma
typedef float v16 __attribute__((vector_size(64)));  // GCC/Clang vector extension: AVX-512 or 2 x AVX2

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// out[m0 .. m0 + MB, columns of panel p] for one panel; `cols` of its 32 columns are real.
template <int MB>
void panel(const float* x, const float* w, float* out, int64_t m0, int64_t n, int64_t k, int64_t p) {
  v16 acc[MB][2] = {};
  const float* wp = w + p * k * kPanel;
  for (int64_t i = 0; i < k; ++i) {
    v16 lo = load(wp + i * kPanel), hi = load(wp + i * kPanel + 16);
    for (int m = 0; m < MB; ++m) {
      float a = x[(m0 + m) * k + i];
      acc[m][0] += a * lo;
      acc[m][1] += a * hi;
    }
  }
  int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
  for (int m = 0; m < MB; ++m) {
    float* o = out + (m0 + m) * n + col;
    if (cols == kPanel) {
      store(o, acc[m][0]);
      store(o + 16, acc[m][1]);
    } else {
      float tmp[kPanel];
      store(tmp, acc[m][0]);
      store(tmp + 16, acc[m][1]);
      std::memcpy(o, tmp, cols * sizeof(float));
    }
  }
}

void panels(const float* x, const float* w, float* out, int64_t rows, int64_t n, int64_t k, int64_t p0,
            int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = 0;
    for (; m + 8 <= rows; m += 8) panel<8>(x, w, out, m, n, k, p);
    if (rows - m >= 4) panel<4>(x, w, out, m, n, k, p), m += 4;
    switch (rows - m) {
      case 3: panel<3>(x, w, out, m, n, k, p); break;
      case 2: panel<2>(x, w, out, m, n, k, p); break;
      case 1: panel<1>(x, w, out, m, n, k, p); break;
    }
  }
}

// Shared by the caller and the pool tasks. A task that starts after the last chunk is taken
// finds nothing to do; it holds the state (shared_ptr) until it returns.
struct Work {
  const float* x;
  const float* w;
  float* out;
  int64_t rows, n, k, num_panels, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      panels(x, w, out, rows, n, k, c * chunk, std::min(num_panels, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto wd = w.dimensions(), od = out->dimensions();
  int64_t num_panels = wd[0], k = wd[1], n = od.size() ? od[od.size() - 1] : 0;
  if (wd[2] != kPanel) return ffi::Error::InvalidArgument("panel_matmul: w must be [P, K, 32]");
  if (n <= (num_panels - 1) * kPanel || n > num_panels * kPanel)
    return ffi::Error::InvalidArgument("panel_matmul: out's last dimension does not match w's panels");
  if (k == 0 || x.element_count() % k != 0 || x.element_count() / k * n != out->element_count())
    return ffi::Error::InvalidArgument("panel_matmul: x [..., K] and out [..., N] do not match w [P, K, 32]");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->out = out->typed_data();
  work->rows = x.element_count() / k;
  work->n = n;
  work->k = k;
  work->num_panels = num_panels;
  if (work->rows == 0) return ffi::Error::Success();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t pieces = 4 * threads;  // a few chunks a thread, so a late or busy thread costs little
  work->chunk = std::max<int64_t>(1, (num_panels + pieces - 1) / pieces);
  work->chunks = (num_panels + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t) pool.Schedule([work] { work->run(); });
  work->run();  // the caller works too, so it never waits on a pool that is busy elsewhere
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(panel_matmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Panels>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
