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
//
// The int8 variants (int8_panel_matmul, grouped_int8_panel_matmul) read int8 panels [P, K, 32]
// and float32 scales [P, G, 32]: rows g K/G .. (g + 1) K/G of panel p are scaled by scales[p, g]
// (G = 1: per output channel; Grok-1's grouped scales otherwise). Each int8 row is widened to
// floats in registers (sign-extend, convert) and multiplied by the float32 activations; a group's
// sum is scaled once at its end. So the result is the float product by the dequantised weight up
// to float32 rounding, from a quarter of the bytes. (Not VNNI's int8 x int8 dot: that needs the
// activations rounded to int8 as well, a different result; at 1 to 12 rows a step is bound by the
// bytes of the weights, and widening costs 2 instructions per 16 weights.)
#include <immintrin.h>

#include <string>
#include <vector>

#include "kernels.h"

namespace {

using namespace grok_kernels;

constexpr int64_t kPanel = 32;
using Panels = ffi::Buffer<ffi::F32, 3>;  // aliases: a macro argument cannot hold the comma
using ExpertPanels = ffi::Buffer<ffi::F32, 4>;
using Rows = ffi::Buffer<ffi::F32, 2>;
using Sizes = ffi::Buffer<ffi::S32, 1>;
using Int8Panels = ffi::Buffer<ffi::S8, 3>;
using Int8ExpertPanels = ffi::Buffer<ffi::S8, 4>;
using Scales = ffi::Buffer<ffi::F32, 3>;
using ExpertScales = ffi::Buffer<ffi::F32, 4>;
constexpr int kPanelVectors = kPanel / kLanes;  // 2 with AVX-512, 4 with AVX2
// Rows multiplied per pass over a panel: kRowBlock at a time, and the last 1 to kMaxRows in one
// pass, so that their accumulators (rows x kPanelVectors) and one broadcast fit in the registers:
// 8 and 12 rows with AVX-512's 32 (up to 24 accumulators), 3 and 3 with AVX2's 16 (12).
constexpr int kMaxRows = kVectorRegisters >= 32 ? 12 : (kVectorRegisters - 1) / kPanelVectors;
constexpr int kRowBlock = kVectorRegisters >= 32 ? 8 : kMaxRows;

// One weight's panels: float32 (scales null), or int8 with float32 scales [P, G, 32].
template <typename T>
struct Weight {
  const T* panels;
  const float* scales;
  int64_t groups;
};

typedef int8_t bytes_vec __attribute__((vector_size(kLanes)));  // kLanes int8 weights: one vec widened

inline vec widen(const float* p) { return load_vec(p); }
inline vec widen(const int8_t* p) {  // sign-extend and convert: vpmovsxbd + vcvtdq2ps
#if defined(__AVX512F__)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else  // GCC 12 turns this into one scalar conversion per lane
  bytes_vec b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vec);
#endif
}

// acc[m] += x[m0 + m, i0 .. i1] @ panel rows i0 .. i1
template <int MB, typename T>
inline void accumulate(vec (&acc)[MB][kPanelVectors], const float* x, const T* wp, int64_t m0, int64_t k,
                       int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    vec row[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) row[v] = widen(wp + i * kPanel + v * kLanes);
    for (int m = 0; m < MB; ++m) {
      float a = x[(m0 + m) * k + i];
      for (int v = 0; v < kPanelVectors; ++v) acc[m][v] += a * row[v];
    }
  }
}

// out[m0 .. m0 + MB, columns of panel p] for one panel (its weights wp, its scales sp: null
// for float32); `cols` of its 32 columns are real.
template <int MB, typename T>
void panel(const float* x, const T* wp, const float* sp, int64_t groups, float* out, int64_t m0, int64_t n,
           int64_t k, int64_t p) {
  vec acc[MB][kPanelVectors] = {};
  if (groups == 1) {  // float32, or int8 scaled per output channel: one scale a column, at the end
    accumulate<MB>(acc, x, wp, m0, k, 0, k);
    if (sp != nullptr)
      for (int v = 0; v < kPanelVectors; ++v) {
        vec scale = load_vec(sp + v * kLanes);
        for (int m = 0; m < MB; ++m) acc[m][v] *= scale;
      }
  } else {  // each group summed on its own, then scaled into the total (kept in memory: registers hold the group)
    alignas(64) float total[MB][kPanel] = {};
    int64_t size = k / groups;
    for (int64_t g = 0; g < groups; ++g) {
      vec part[MB][kPanelVectors] = {};
      accumulate<MB>(part, x, wp, m0, k, g * size, (g + 1) * size);
      for (int v = 0; v < kPanelVectors; ++v) {
        vec scale = load_vec(sp + g * kPanel + v * kLanes);
        for (int m = 0; m < MB; ++m) store_vec(total[m] + v * kLanes, load_vec(total[m] + v * kLanes) + part[m][v] * scale);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < kPanelVectors; ++v) acc[m][v] = load_vec(total[m] + v * kLanes);
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

template <int MB, typename T>
void rest(const float* x, const T* wp, const float* sp, int64_t groups, float* out, int64_t m, int64_t rows, int64_t n,
          int64_t k, int64_t p) {
  if constexpr (MB > 0) {
    if (rows - m == MB) return panel<MB>(x, wp, sp, groups, out, m, n, k, p);
    rest<MB - 1>(x, wp, sp, groups, out, m, rows, n, k, p);
  }
}

// Every row against one panel: kRowBlock rows at a time, and the last 1 to kMaxRows in one pass,
// so the panel is read once per kRowBlock rows at most.
template <typename T>
void rows_by_panel(const float* x, const T* wp, const float* sp, int64_t groups, float* out, int64_t rows, int64_t n,
                   int64_t k, int64_t p) {
  int64_t m = 0;
  for (; rows - m > kMaxRows; m += kRowBlock) panel<kRowBlock>(x, wp, sp, groups, out, m, n, k, p);
  rest<kMaxRows>(x, wp, sp, groups, out, m, rows, n, k, p);
}

// All rows against panels p0 .. p1. An int8 panel multiplied by more rows than one pass takes
// is dequantised once into a float32 panel (in cache) first, rather than widened again in every
// pass: at prefill's hundreds of rows the product is bound by the multiplications, and widening
// in every pass made it 6-8% slower than the float32 kernel's (BENCHMARKS.md).
template <typename T>
void panels(const float* x, Weight<T> w, float* out, int64_t rows, int64_t n, int64_t k, int64_t p0, int64_t p1) {
  bool once = sizeof(T) == 1 && rows > kMaxRows;
  std::vector<float> dequantised(once ? k * kPanel : 0);
  for (int64_t p = p0; p < p1; ++p) {
    const T* wp = w.panels + p * k * kPanel;
    const float* sp = w.scales == nullptr ? nullptr : w.scales + p * w.groups * kPanel;
    if (!once) {
      rows_by_panel(x, wp, sp, w.groups, out, rows, n, k, p);
      continue;
    }
    int64_t size = k / w.groups;
    for (int64_t i = 0; i < k; ++i)
      for (int v = 0; v < kPanelVectors; ++v)
        store_vec(dequantised.data() + i * kPanel + v * kLanes,
                  widen(wp + i * kPanel + v * kLanes) * load_vec(sp + (i / size) * kPanel + v * kLanes));
    rows_by_panel(x, static_cast<const float*>(dequantised.data()), nullptr, 1, out, rows, n, k, p);
  }
}

// One piece of work: panels p0 .. p1 of one weight, for `rows` rows of x.
template <typename T>
struct Item {
  const float* x;
  Weight<T> w;
  float* out;
  int64_t rows, p0, p1;
};

// Splits each weight's panels into chunks, a few per thread over all weights together, so a
// late or busy thread costs little, and runs them. A panel of a weight with more rows takes
// longer, so its chunks hold fewer panels (a panel costs about as much to read from memory as 8
// rows cost to multiply; an int8 panel a quarter of that).
template <typename T>
ffi::Error Run(ffi::ThreadPool& pool, const std::vector<Item<T>>& weights, int64_t num_panels, int64_t n,
               int64_t k) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  constexpr int64_t read = sizeof(T) == 1 ? 2 : 8;
  auto cost = [](const Item<T>& one) { return one.rows + read; };
  int64_t total = 0;
  for (const Item<T>& one : weights) total += num_panels * cost(one);
  int64_t target = std::max<int64_t>(1, total / (4 * threads));
  std::vector<Item<T>> items;
  for (const Item<T>& one : weights) {
    int64_t chunk = std::max<int64_t>(1, target / cost(one));
    for (int64_t p = 0; p < num_panels; p += chunk)
      items.push_back({one.x, one.w, one.out, one.rows, p, std::min(num_panels, p + chunk)});
  }
  ParallelFor(pool, items.size(), [&](int64_t i) {
    const Item<T>& it = items[i];
    panels(it.x, it.w, it.out, it.rows, n, k, it.p0, it.p1);
  });
  return ffi::Error::Success();
}

bool Matches(int64_t num_panels, int64_t n) { return (num_panels - 1) * kPanel < n && n <= num_panels * kPanel; }

// The checks and the call of a product by one weight: x [..., K] @ panels [P, K, 32] (scaled by
// scales [P, G, 32] for int8) into out [..., N].
template <typename T>
ffi::Error Single(const char* name, ffi::ThreadPool& pool, ffi::AnyBuffer::Dimensions wd, const float* x,
                  int64_t x_count, Weight<T> w, int64_t scale_groups, ffi::Result<ffi::Buffer<ffi::F32>>& out) {
  auto od = out->dimensions();
  int64_t num_panels = wd[0], k = wd[1], n = od.size() ? od[od.size() - 1] : 0;
  auto fail = [name](const char* what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  if (wd[2] != kPanel) return fail("w must be [P, K, 32]");
  if (!Matches(num_panels, n)) return fail("out's last dimension does not match w's panels");
  if (k == 0 || x_count % k != 0 || x_count / k * n != out->element_count())
    return fail("x [..., K] and out [..., N] do not match w [P, K, 32]");
  if (w.scales != nullptr && (w.groups <= 0 || k % w.groups != 0 || scale_groups != w.groups))
    return fail("scales must be [P, G, 32] with G dividing K");
  int64_t rows = x_count / k;
  std::vector<Item<T>> weights;
  if (rows > 0) weights.push_back({x, w, out->typed_data(), rows, 0, 0});
  return Run(pool, weights, num_panels, n, k);
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w,
                       ffi::ResultBuffer<ffi::F32> out) {
  return Single<float>("panel_matmul", pool, w.dimensions(), x.typed_data(), x.element_count(),
                       {w.typed_data(), nullptr, 1}, 1, out);
}

ffi::Error Int8PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Int8Panels w, Scales scales,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto wd = w.dimensions(), sd = scales.dimensions();
  if (sd[0] != wd[0] || sd[2] != kPanel)
    return ffi::Error::InvalidArgument("int8_panel_matmul: scales must be [P, G, 32] for w [P, K, 32]");
  return Single<int8_t>("int8_panel_matmul", pool, wd, x.typed_data(), x.element_count(),
                        {w.typed_data(), scales.typed_data(), sd[1]}, sd[1], out);
}

// Rows grouped by expert: x [R, K] holds sizes[0] rows for expert 0, then sizes[1] rows for
// expert 1, ...; out [R, N] gets each group times its expert's weight (w [E, P, K, 32], and for
// int8 scales [E, P, G, 32]) and zeros in the rows past the last group. An expert with no rows is
// not read at all, and one with many reads each of its panels once for all of them (the panel
// stays in cache).
template <typename T>
ffi::Error Grouped(const char* name, ffi::ThreadPool& pool, Rows& x, ffi::AnyBuffer::Dimensions wd, const T* w,
                   const float* scales, int64_t groups, Sizes& sizes, ffi::Result<Rows>& out) {
  auto xd = x.dimensions(), od = out->dimensions();
  int64_t experts = wd[0], num_panels = wd[1], k = wd[2], rows = xd[0], n = od[1];
  auto fail = [name](const char* what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  if (wd[3] != kPanel) return fail("w must be [E, P, K, 32]");
  if (xd[1] != k || od[0] != rows || !Matches(num_panels, n))
    return fail("x [R, K], w [E, P, K, 32] and out [R, N] do not match");
  if (sizes.element_count() != experts) return fail("sizes must have one entry per expert");
  if (scales != nullptr && (groups <= 0 || k % groups != 0)) return fail("scales must be [E, P, G, 32] with G dividing K");
  std::vector<Item<T>> weights;
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t size = sizes.typed_data()[e];
    if (size < 0 || size > rows - start) return fail("group sizes must be >= 0 and sum to at most R");
    if (size > 0) {
      Weight<T> one{w + e * num_panels * k * kPanel,
                    scales == nullptr ? nullptr : scales + e * num_panels * groups * kPanel, groups};
      weights.push_back({x.typed_data() + start * k, one, out->typed_data() + start * n, size, 0, 0});
    }
    start += size;
  }
  std::memset(out->typed_data() + start * n, 0, (rows - start) * n * sizeof(float));
  return Run(pool, weights, num_panels, n, k);
}

ffi::Error GroupedPanelMatmul(ffi::ThreadPool pool, Rows x, ExpertPanels w, Sizes sizes,
                              ffi::ResultBuffer<ffi::F32, 2> out) {
  return Grouped<float>("grouped_panel_matmul", pool, x, w.dimensions(), w.typed_data(), nullptr, 1, sizes, out);
}

ffi::Error GroupedInt8PanelMatmul(ffi::ThreadPool pool, Rows x, Int8ExpertPanels w, ExpertScales scales, Sizes sizes,
                                  ffi::ResultBuffer<ffi::F32, 2> out) {
  auto wd = w.dimensions(), sd = scales.dimensions();
  if (sd[0] != wd[0] || sd[1] != wd[1] || sd[3] != kPanel)
    return ffi::Error::InvalidArgument("grouped_int8_panel_matmul: scales must be [E, P, G, 32] for w [E, P, K, 32]");
  return Grouped<int8_t>("grouped_int8_panel_matmul", pool, x, wd, w.typed_data(), scales.typed_data(), sd[2], sizes,
                         out);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(int8_panel_matmul, Int8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Int8Panels>()
                                  .Arg<Scales>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(grouped_int8_panel_matmul, GroupedInt8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Int8ExpertPanels>()
                                  .Arg<ExpertScales>()
                                  .Arg<Sizes>()
                                  .Ret<Rows>());
