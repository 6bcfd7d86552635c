// fp32 matmul against a weight packed in column panels, as an XLA FFI custom call (CPU).
//
//   out[..., N] = x[..., K] @ w,  with w [K, N] stored as panels [P, K, 32]: panel p holds
//   columns 32p .. 32p + 31 (zero past N), row after row, so each panel is one contiguous run.
//
// Why (BENCHMARKS.md, "Expert weights in panels"): decode multiplies a few rows by weights far
// larger than the caches. XLA:CPU runs products of 2 to 32 rows at 10-20 GB/s of weights, and a
// register-blocked kernel reading the plain [K, N] layout was no better: each row of a column
// tile lies a whole weight row away from the last, which defeats the hardware prefetchers.
// Reading a panel front to back streams it. Per panel, a block of rows of x at a time is
// accumulated in registers (rows x the panel's 32 floats: 8 rows of 2 vectors with AVX-512, 3 of
// 4 with AVX2); panels are split into chunks that the caller and XLA's intra-op thread pool take
// from one counter.
//
// grouped_panel_matmul is the MoE's: rows grouped by expert, each group against its own
// expert's panels, every expert in one call.
#include <vector>

#include "kernels.h"

namespace {

using namespace grok_kernels;

constexpr int64_t kPanel = 32;
using Panels = ffi::Buffer<ffi::F32, 3>;  // aliases: a macro argument cannot hold the comma
using ExpertPanels = ffi::Buffer<ffi::F32, 4>;
using Rows = ffi::Buffer<ffi::F32, 2>;
using Sizes = ffi::Buffer<ffi::S32, 1>;
constexpr int kPanelVectors = kPanel / kLanes;  // 2 with AVX-512, 4 with AVX2
// Rows multiplied per pass over a panel: kRowBlock at a time, and the last 1 to kMaxRows in one
// pass, so that their accumulators (rows x kPanelVectors) and one broadcast fit in the registers:
// 8 and 12 rows with AVX-512's 32 (up to 24 accumulators), 3 and 3 with AVX2's 16 (12).
constexpr int kMaxRows = kVectorRegisters >= 32 ? 12 : (kVectorRegisters - 1) / kPanelVectors;
constexpr int kRowBlock = kVectorRegisters >= 32 ? 8 : kMaxRows;

// out[m0 .. m0 + MB, columns of panel p] for one panel; `cols` of its 32 columns are real.
template <int MB>
void panel(const float* x, const float* w, float* out, int64_t m0, int64_t n, int64_t k, int64_t p) {
  vec acc[MB][kPanelVectors] = {};
  const float* wp = w + p * k * kPanel;
  for (int64_t i = 0; i < k; ++i) {
    vec row[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) row[v] = load_vec(wp + i * kPanel + v * kLanes);
    for (int m = 0; m < MB; ++m) {
      float a = x[(m0 + m) * k + i];
      for (int v = 0; v < kPanelVectors; ++v) acc[m][v] += a * row[v];
    }
  }
  int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
  for (int m = 0; m < MB; ++m) {
    float* o = out + (m0 + m) * n + col;
    float tmp[kPanel];
    float* dst = cols == kPanel ? o : tmp;
    for (int v = 0; v < kPanelVectors; ++v) store_vec(dst + v * kLanes, acc[m][v]);
    if (cols != kPanel) std::memcpy(o, tmp, cols * sizeof(float));
  }
}

template <int MB>
void rest(const float* x, const float* w, float* out, int64_t m, int64_t rows, int64_t n, int64_t k, int64_t p) {
  if constexpr (MB > 0) {
    if (rows - m == MB) return panel<MB>(x, w, out, m, n, k, p);
    rest<MB - 1>(x, w, out, m, rows, n, k, p);
  }
}

// All rows against panels p0 .. p1: kRowBlock rows at a time, and the last 1 to kMaxRows in one
// pass, so each panel is read once per kRowBlock rows at most.
void panels(const float* x, const float* w, float* out, int64_t rows, int64_t n, int64_t k, int64_t p0,
            int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = 0;
    for (; rows - m > kMaxRows; m += kRowBlock) panel<kRowBlock>(x, w, out, m, n, k, p);
    rest<kMaxRows>(x, w, out, m, rows, n, k, p);
  }
}

// One piece of work: panels p0 .. p1 of one weight, for `rows` rows of x.
struct Item {
  const float* x;
  const float* w;
  float* out;
  int64_t rows, p0, p1;
};

// Splits each weight's panels into chunks, a few per thread over all weights together, so a
// late or busy thread costs little, and runs them. A panel of a weight with more rows takes
// longer, so its chunks hold fewer panels (a panel costs about as much to read from memory as 8
// rows cost to multiply).
ffi::Error Run(ffi::ThreadPool& pool, const std::vector<Item>& weights, int64_t num_panels, int64_t n, int64_t k) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto cost = [](const Item& one) { return one.rows + 8; };
  int64_t total = 0;
  for (const Item& one : weights) total += num_panels * cost(one);
  int64_t target = std::max<int64_t>(1, total / (4 * threads));
  std::vector<Item> items;
  for (const Item& one : weights) {
    int64_t chunk = std::max<int64_t>(1, target / cost(one));
    for (int64_t p = 0; p < num_panels; p += chunk)
      items.push_back({one.x, one.w, one.out, one.rows, p, std::min(num_panels, p + chunk)});
  }
  ParallelFor(pool, items.size(), [&](int64_t i) {
    const Item& it = items[i];
    panels(it.x, it.w, it.out, it.rows, n, k, it.p0, it.p1);
  });
  return ffi::Error::Success();
}

bool Matches(int64_t num_panels, int64_t n) { return (num_panels - 1) * kPanel < n && n <= num_panels * kPanel; }

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto wd = w.dimensions(), od = out->dimensions();
  int64_t num_panels = wd[0], k = wd[1], n = od.size() ? od[od.size() - 1] : 0;
  if (wd[2] != kPanel) return ffi::Error::InvalidArgument("panel_matmul: w must be [P, K, 32]");
  if (!Matches(num_panels, n))
    return ffi::Error::InvalidArgument("panel_matmul: out's last dimension does not match w's panels");
  if (k == 0 || x.element_count() % k != 0 || x.element_count() / k * n != out->element_count())
    return ffi::Error::InvalidArgument("panel_matmul: x [..., K] and out [..., N] do not match w [P, K, 32]");
  int64_t rows = x.element_count() / k;
  std::vector<Item> weights;
  if (rows > 0) weights.push_back({x.typed_data(), w.typed_data(), out->typed_data(), rows, 0, 0});
  return Run(pool, weights, num_panels, n, k);
}

// Rows grouped by expert: x [R, K] holds sizes[0] rows for expert 0, then sizes[1] rows for
// expert 1, ...; out [R, N] gets each group times its expert's weight (w [E, P, K, 32]) and
// zeros in the rows past the last group. An expert with no rows is not read at all, and one
// with many reads each of its panels once for all of them (the panel stays in cache).
ffi::Error GroupedPanelMatmul(ffi::ThreadPool pool, Rows x, ExpertPanels w, Sizes sizes,
                              ffi::ResultBuffer<ffi::F32, 2> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  int64_t experts = wd[0], num_panels = wd[1], k = wd[2], rows = xd[0], n = od[1];
  if (wd[3] != kPanel) return ffi::Error::InvalidArgument("grouped_panel_matmul: w must be [E, P, K, 32]");
  if (xd[1] != k || od[0] != rows || !Matches(num_panels, n))
    return ffi::Error::InvalidArgument("grouped_panel_matmul: x [R, K], w [E, P, K, 32] and out [R, N] do not match");
  if (sizes.element_count() != experts)
    return ffi::Error::InvalidArgument("grouped_panel_matmul: sizes must have one entry per expert");
  std::vector<Item> weights;
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t size = sizes.typed_data()[e];
    if (size < 0 || size > rows - start)
      return ffi::Error::InvalidArgument("grouped_panel_matmul: group sizes must be >= 0 and sum to at most R");
    if (size > 0)
      weights.push_back({x.typed_data() + start * k, w.typed_data() + e * num_panels * k * kPanel,
                         out->typed_data() + start * n, size, 0, 0});
    start += size;
  }
  std::memset(out->typed_data() + start * n, 0, (rows - start) * n * sizeof(float));
  return Run(pool, weights, num_panels, n, k);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(panel_matmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Panels>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(grouped_panel_matmul, GroupedPanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<ExpertPanels>()
                                  .Arg<Sizes>()
                                  .Ret<Rows>());
