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
// floats in registers (sign-extend, convert), multiplied by its scale and then by the float32
// activations: the float product by the dequantised weight, from a quarter of the bytes. (Not VNNI's int8 x int8 dot: that needs the
// activations rounded to int8 as well, a different result; at 1 to 12 rows a step is bound by the
// bytes of the weights, and widening costs 2 instructions per 16 weights.)
#include <immintrin.h>

#include <cmath>
#include <string>
#include <type_traits>
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

// out[m0 .. m0 + MB, columns of panel p] = acc, the columns past N left out.
template <int MB>
void store_rows(const vec (&acc)[MB][kPanelVectors], float* out, int64_t m0, int64_t n, int64_t p) {
  int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
  for (int m = 0; m < MB; ++m) {
    float* o = out + (m0 + m) * n + col;
    float tmp[kPanel];
    float* dst = cols == kPanel ? o : tmp;
    for (int v = 0; v < kPanelVectors; ++v) store_vec(dst + v * kLanes, acc[m][v]);
    if (cols != kPanel) std::memcpy(o, tmp, cols * sizeof(float));
  }
}

// out[m0 .. m0 + MB, columns of panel p] for one panel (its weights wp; for int8 its scales sp
// [G, 32], null for float32); `cols` of its 32 columns are real. An int8 row is widened and
// multiplied by its group's scale before the products: the float32 dequantised weight, exactly
// what the dequantise-once path of `panels` stores, so a row's result is the same bits whichever
// path its call takes (and so independent of how many rows share the call).
template <int MB, typename T>
void panel(const float* x, const T* wp, const float* sp, int64_t groups, float* out, int64_t m0, int64_t n,
           int64_t k, int64_t p) {
  vec acc[MB][kPanelVectors] = {};
  int64_t size = k / groups;
  for (int64_t g = 0; g < groups; ++g) {
    vec scale[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) scale[v] = sp != nullptr ? load_vec(sp + g * kPanel + v * kLanes) : vec{};
    for (int64_t i = g * size; i < (g + 1) * size; ++i) {
      vec row[kPanelVectors];
      for (int v = 0; v < kPanelVectors; ++v) row[v] = widen(wp + i * kPanel + v * kLanes);
      if (sp != nullptr)
        for (int v = 0; v < kPanelVectors; ++v) row[v] *= scale[v];
      for (int m = 0; m < MB; ++m) {
        float a = x[(m0 + m) * k + i];
        for (int v = 0; v < kPanelVectors; ++v) acc[m][v] += a * row[v];
      }
    }
  }
  store_rows<MB>(acc, out, m0, n, p);
}

// f(MB, m0) for blocks of rows m0 .. m0 + MB covering rows 0 .. rows - 1: kRowBlock at a time,
// and the last 1 to kMaxRows in one pass (MB a std::integral_constant, so a block's accumulators
// are a compile-time count), so a panel is read once per kRowBlock rows at most.
template <int MB, typename F>
void last_rows(const F& f, int64_t m, int64_t rows) {
  if constexpr (MB > 0) {
    if (rows - m == MB) return f(std::integral_constant<int, MB>{}, m);
    last_rows<MB - 1>(f, m, rows);
  }
}

template <typename F>
void row_blocks(const F& f, int64_t rows) {
  int64_t m = 0;
  for (; rows - m > kMaxRows; m += kRowBlock) f(std::integral_constant<int, kRowBlock>{}, m);
  last_rows<kMaxRows>(f, m, rows);
}

// Every row against one panel.
template <typename T>
void rows_by_panel(const float* x, const T* wp, const float* sp, int64_t groups, float* out, int64_t rows, int64_t n,
                   int64_t k, int64_t p) {
  row_blocks([&](auto mb, int64_t m) { panel<decltype(mb)::value>(x, wp, sp, groups, out, m, n, k, p); }, rows);
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

// ---- bf16 ----------------------------------------------------------------------------------
// A bf16 weight is held as panels [P, K2, 32, 2] (K2 = ceil(K / 2), a zero row past an odd K):
// rows 2j and 2j + 1 of a panel interleaved column by column, so one 32-bit lane holds a
// column's pair of weights, the operand layout of AVX512-BF16's vdpbf16ps. The rows of x are
// rounded to bf16 (to nearest even; bf16 activations are exact) and paired the same way, once
// a call. With AVX512-BF16 each pair of rows is one vdpbf16ps a column vector (the products of
// bf16 pairs summed into float32 accumulators): prefill runs at the bf16 matrix rate, twice
// float32's. Without it, each pair is widened to two float32 rows in registers (a shift and a
// mask) and multiplied as the float32 kernel does, from half the bytes. Either way the same
// arithmetic runs for any number of rows, so a row's result never depends on the others.
struct Bf16 {
  uint16_t bits;
};

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, sizeof u); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, sizeof f); return f; }

inline uint16_t to_bf16(float f) {  // round to nearest even; a NaN stays a (quiet) NaN
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// x [rows, K] float32 as bf16 pairs [rows, K2]: the low half of pair j is x[2j], the high x[2j + 1].
std::vector<uint32_t> pair_rows(const float* x, int64_t rows, int64_t k) {
  int64_t k2 = (k + 1) / 2;
  std::vector<uint32_t> pairs(rows * k2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k2; ++j) {
      uint32_t lo = to_bf16(x[r * k + 2 * j]), hi = 2 * j + 1 < k ? to_bf16(x[r * k + 2 * j + 1]) : 0;
      pairs[r * k2 + j] = lo | (hi << 16);
    }
  return pairs;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
typedef uint32_t lanes_u32 __attribute__((vector_size(sizeof(vec))));
#endif

// out[m0 .. m0 + MB, columns of panel p] = x pairs [.., K2] @ bf16 panel wp [K2, 32, 2].
template <int MB>
void bf16_panel(const uint32_t* x, const Bf16* wp, float* out, int64_t m0, int64_t n, int64_t k2, int64_t p) {
  vec acc[MB][kPanelVectors] = {};
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (int64_t j = 0; j < k2; ++j) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + j * 2 * kPanel);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + j * 2 * kPanel + kPanel);
    for (int m = 0; m < MB; ++m) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(int(x[(m0 + m) * k2 + j]));
      acc[m][0] = (vec)_mm512_dpbf16_ps((__m512)acc[m][0], a, w0);
      acc[m][1] = (vec)_mm512_dpbf16_ps((__m512)acc[m][1], a, w1);
    }
  }
#else
  for (int64_t j = 0; j < k2; ++j) {
    for (int v = 0; v < kPanelVectors; ++v) {  // kLanes columns: their weights of rows 2j and 2j + 1
      lanes_u32 u;
      std::memcpy(&u, wp + j * 2 * kPanel + v * 2 * kLanes, sizeof u);
      lanes_u32 lo = u << 16, hi = u & 0xffff0000u;
      vec even, odd;
      std::memcpy(&even, &lo, sizeof even);
      std::memcpy(&odd, &hi, sizeof odd);
      for (int m = 0; m < MB; ++m) {
        uint32_t pair = x[(m0 + m) * k2 + j];
        acc[m][v] += bits_float(pair << 16) * even;
        acc[m][v] += bits_float(pair & 0xffff0000u) * odd;
      }
    }
  }
#endif
  store_rows<MB>(acc, out, m0, n, p);
}

// All rows (as pairs) against bf16 panels p0 .. p1 (K2 pairs of rows a panel).
void panels(const uint32_t* x, Weight<Bf16> w, float* out, int64_t rows, int64_t n, int64_t k2, int64_t p0,
            int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const Bf16* wp = w.panels + p * k2 * 2 * kPanel;
    row_blocks([&](auto mb, int64_t m) { bf16_panel<decltype(mb)::value>(x, wp, out, m, n, k2, p); }, rows);
  }
}

// int8 weights with bf16 activations (Grok-1's released format) where the CPU has AVX512-BF16:
// each int8 panel is dequantised into bf16 pairs in cache (w * scale, rounded to bf16: the
// weight Grok-1's reference multiplies by, which dequantises to bf16), then multiplied as a bf16
// panel, for any number of rows: decode reads a quarter of float32's bytes, prefill runs at the
// bf16 rate, and a row's result does not depend on the rows beside it.
void int8_to_pairs(const int8_t* wp, const float* sp, int64_t groups, int64_t k, Bf16* dst) {
  int64_t size = k / groups, k2 = (k + 1) / 2;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  // after cvtne2ps(b, a) the 32 bf16 are a0..a15 b0..b15; this puts them as a0 b0 a1 b1 ...
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(order);
  auto row = [&](int64_t i, int h) {  // 16 columns of row i, dequantised to float32 (zero past K)
    if (i >= k) return _mm512_setzero_ps();
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + i * kPanel + h * 16))));
    return _mm512_mul_ps(w, _mm512_loadu_ps(sp + (i / size) * kPanel + h * 16));
  };
  for (int64_t j = 0; j < k2; ++j)
    for (int h = 0; h < 2; ++h) {
      __m512i pairs = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(row(2 * j + 1, h), row(2 * j, h)));
      _mm512_storeu_si512(dst + j * 2 * kPanel + h * 32, pairs);
    }
#else
  for (int64_t j = 0; j < k2; ++j)
    for (int64_t c = 0; c < kPanel; ++c)
      for (int t = 0; t < 2; ++t) {
        int64_t i = 2 * j + t;
        dst[j * 2 * kPanel + c * 2 + t].bits = i < k ? to_bf16(float(wp[i * kPanel + c]) * sp[(i / size) * kPanel + c]) : 0;
      }
#endif
}

void panels(const uint32_t* x, Weight<int8_t> w, float* out, int64_t rows, int64_t n, int64_t k, int64_t p0,
            int64_t p1) {
  int64_t k2 = (k + 1) / 2;
  thread_local std::vector<Bf16> pairs;
  pairs.resize(k2 * 2 * kPanel);
  for (int64_t p = p0; p < p1; ++p) {
    int8_to_pairs(w.panels + p * k * kPanel, w.scales + p * w.groups * kPanel, w.groups, k, pairs.data());
    row_blocks([&](auto mb, int64_t m) { bf16_panel<decltype(mb)::value>(x, pairs.data(), out, m, n, k2, p); }, rows);
  }
}

// One piece of work: panels p0 .. p1 of one weight, for `rows` rows of x.
template <typename T, typename X = float>
struct Item {
  const X* x;
  Weight<T> w;
  float* out;
  int64_t rows, p0, p1;
};

// Splits each weight's panels into chunks, a few per thread over all weights together, so a
// late or busy thread costs little, and runs them. A panel of a weight with more rows takes
// longer, so its chunks hold fewer panels (a panel costs about as much to read from memory as 8
// rows cost to multiply; an int8 panel a quarter of that).
template <typename T, typename X>
ffi::Error Run(ffi::ThreadPool& pool, const std::vector<Item<T, X>>& weights, int64_t num_panels, int64_t n,
               int64_t k) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  constexpr int64_t read = sizeof(T) == 1 ? 2 : sizeof(T) == 2 ? 4 : 8;
  auto cost = [](const Item<T, X>& one) { return one.rows + read; };
  int64_t total = 0;
  for (const Item<T, X>& one : weights) total += num_panels * cost(one);
  int64_t target = std::max<int64_t>(1, total / (4 * threads));
  std::vector<Item<T, X>> items;
  for (const Item<T, X>& one : weights) {
    int64_t chunk = std::max<int64_t>(1, target / cost(one));
    for (int64_t p = 0; p < num_panels; p += chunk)
      items.push_back({one.x, one.w, one.out, one.rows, p, std::min(num_panels, p + chunk)});
  }
  ParallelFor(pool, items.size(), [&](int64_t i) {
    const Item<T, X>& it = items[i];
    panels(it.x, it.w, it.out, it.rows, n, k, it.p0, it.p1);
  });
  return ffi::Error::Success();
}

bool Matches(int64_t num_panels, int64_t n) { return (num_panels - 1) * kPanel < n && n <= num_panels * kPanel; }

// The checks and the call of a product by one weight: x [..., K] @ panels [P, K, 32] (scaled by
// scales [P, G, 32] for int8) into out [..., N].
template <typename T>
ffi::Error Single(const char* name, ffi::ThreadPool& pool, ffi::AnyBuffer::Dimensions wd, const float* x,
                  int64_t x_count, Weight<T> w, int64_t scale_groups, ffi::Result<ffi::Buffer<ffi::F32>>& out,
                  bool bf16 = false) {
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
  if constexpr (std::is_same<T, int8_t>::value) {
    if (bf16 && kBf16Dot) {  // int8 x bf16: the rows as bf16 pairs, each panel dequantised to bf16
      std::vector<uint32_t> pairs = pair_rows(x, rows, k);
      std::vector<Item<T, uint32_t>> paired;
      if (rows > 0) paired.push_back({pairs.data(), w, out->typed_data(), rows, 0, 0});
      return Run(pool, paired, num_panels, n, k);
    }
  }
  std::vector<Item<T>> weights;
  if (rows > 0) weights.push_back({x, w, out->typed_data(), rows, 0, 0});
  return Run(pool, weights, num_panels, n, k);
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Panels w,
                       ffi::ResultBuffer<ffi::F32> out) {
  return Single<float>("panel_matmul", pool, w.dimensions(), x.typed_data(), x.element_count(),
                       {w.typed_data(), nullptr, 1}, 1, out);
}

ffi::Error Int8PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Int8Panels w, Scales scales, bool bf16,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto wd = w.dimensions(), sd = scales.dimensions();
  if (sd[0] != wd[0] || sd[2] != kPanel)
    return ffi::Error::InvalidArgument("int8_panel_matmul: scales must be [P, G, 32] for w [P, K, 32]");
  return Single<int8_t>("int8_panel_matmul", pool, wd, x.typed_data(), x.element_count(),
                        {w.typed_data(), scales.typed_data(), sd[1]}, sd[1], out, bf16);
}

// Rows grouped by expert: x [R, K] holds sizes[0] rows for expert 0, then sizes[1] rows for
// expert 1, ...; out [R, N] gets each group times its expert's weight (w [E, P, K, 32], and for
// int8 scales [E, P, G, 32]) and zeros in the rows past the last group. An expert with no rows is
// not read at all, and one with many reads each of its panels once for all of them (the panel
// stays in cache).
template <typename T>
ffi::Error Grouped(const char* name, ffi::ThreadPool& pool, Rows& x, ffi::AnyBuffer::Dimensions wd, const T* w,
                   const float* scales, int64_t groups, Sizes& sizes, ffi::Result<Rows>& out, bool bf16 = false) {
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
  if constexpr (std::is_same<T, int8_t>::value) {
    if (bf16 && kBf16Dot) {  // int8 x bf16: the rows as bf16 pairs, each panel dequantised to bf16
      int64_t k2 = (k + 1) / 2;
      std::vector<uint32_t> pairs = pair_rows(x.typed_data(), start, k);
      std::vector<Item<T, uint32_t>> paired;
      for (const Item<T>& one : weights)
        paired.push_back({pairs.data() + (one.x - x.typed_data()) / k * k2, one.w, one.out, one.rows, 0, 0});
      return Run(pool, paired, num_panels, n, k);
    }
  }
  return Run(pool, weights, num_panels, n, k);
}

ffi::Error GroupedPanelMatmul(ffi::ThreadPool pool, Rows x, ExpertPanels w, Sizes sizes,
                              ffi::ResultBuffer<ffi::F32, 2> out) {
  return Grouped<float>("grouped_panel_matmul", pool, x, w.dimensions(), w.typed_data(), nullptr, 1, sizes, out);
}

ffi::Error GroupedInt8PanelMatmul(ffi::ThreadPool pool, Rows x, Int8ExpertPanels w, ExpertScales scales, Sizes sizes,
                                  bool bf16, ffi::ResultBuffer<ffi::F32, 2> out) {
  auto wd = w.dimensions(), sd = scales.dimensions();
  if (sd[0] != wd[0] || sd[1] != wd[1] || sd[3] != kPanel)
    return ffi::Error::InvalidArgument("grouped_int8_panel_matmul: scales must be [E, P, G, 32] for w [E, P, K, 32]");
  return Grouped<int8_t>("grouped_int8_panel_matmul", pool, x, wd, w.typed_data(), scales.typed_data(), sd[2], sizes,
                         out, bf16);
}

// bf16 panels arrive as their bits (uint16): see ops.pack_pairs
using Bf16Panels = ffi::Buffer<ffi::U16, 4>;
using Bf16ExpertPanels = ffi::Buffer<ffi::U16, 5>;

// x [..., K] @ bf16 panels [P, K2, 32, 2] into out [..., N].
ffi::Error Bf16PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, Bf16Panels w,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  auto fail = [](const char* what) { return ffi::Error::InvalidArgument(std::string("bf16_panel_matmul: ") + what); };
  if (wd[2] != kPanel || wd[3] != 2) return fail("w must be [P, K2, 32, 2]");
  int64_t num_panels = wd[0], k2 = wd[1], k = xd.size() ? xd[xd.size() - 1] : 0, n = od.size() ? od[od.size() - 1] : 0;
  if (k == 0 || (k + 1) / 2 != k2) return fail("x [..., K] does not match w [P, ceil(K / 2), 32, 2]");
  if (!Matches(num_panels, n)) return fail("out's last dimension does not match w's panels");
  int64_t rows = x.element_count() / k;
  if (rows * n != out->element_count()) return fail("x [..., K] and out [..., N] do not match");
  std::vector<uint32_t> pairs = pair_rows(x.typed_data(), rows, k);
  std::vector<Item<Bf16, uint32_t>> weights;
  if (rows > 0)
    weights.push_back({pairs.data(), {reinterpret_cast<const Bf16*>(w.typed_data()), nullptr, 1}, out->typed_data(),
                       rows, 0, 0});
  return Run(pool, weights, num_panels, n, k2);
}

// grouped_panel_matmul with bf16 experts: x [R, K], w [E, P, K2, 32, 2], sizes [E] -> out [R, N].
ffi::Error Bf16GroupedPanelMatmul(ffi::ThreadPool pool, Rows x, Bf16ExpertPanels w, Sizes sizes,
                                  ffi::ResultBuffer<ffi::F32, 2> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  int64_t experts = wd[0], num_panels = wd[1], k2 = wd[2], rows = xd[0], k = xd[1], n = od[1];
  auto fail = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("grouped_bf16_panel_matmul: ") + what);
  };
  if (wd[3] != kPanel || wd[4] != 2) return fail("w must be [E, P, K2, 32, 2]");
  if ((k + 1) / 2 != k2 || od[0] != rows || !Matches(num_panels, n))
    return fail("x [R, K], w [E, P, ceil(K / 2), 32, 2] and out [R, N] do not match");
  if (sizes.element_count() != experts) return fail("sizes must have one entry per expert");
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t size = sizes.typed_data()[e];
    if (size < 0 || size > rows - start) return fail("group sizes must be >= 0 and sum to at most R");
    start += size;
  }
  std::vector<uint32_t> pairs = pair_rows(x.typed_data(), start, k);  // the rows past the groups are not read
  const Bf16* panels = reinterpret_cast<const Bf16*>(w.typed_data());
  std::vector<Item<Bf16, uint32_t>> weights;
  start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t size = sizes.typed_data()[e];
    if (size > 0)
      weights.push_back({pairs.data() + start * k2, {panels + e * num_panels * k2 * 2 * kPanel, nullptr, 1},
                         out->typed_data() + start * n, size, 0, 0});
    start += size;
  }
  std::memset(out->typed_data() + start * n, 0, (rows - start) * n * sizeof(float));
  return Run(pool, weights, num_panels, n, k2);
}


// ---- int8 x int8 (w8a8) ----------------------------------------------------------------------
// The int8 dot of llama.cpp's q8_0 (an opt-in mode, `--quantize w8a8`; not Grok-1's exact
// product): each row of x is rounded to int8 per block of 32 along K (scale = the block's largest
// magnitude / 127, to nearest even), and each block's products with the int8 weight are summed
// exactly in int32 before one float multiply by the two scales. The weight is held as panels of
// row quads [P, Kp / 4, 32, 4] (Kp: K rounded up to 32, zero rows past K): rows 4j .. 4j + 3 of
// a column in one 32-bit lane, the operand layout of VNNI's vpdpbusd (unsigned x signed bytes,
// four products summed into an int32 lane). vpdpbusd takes one side unsigned, so the rows go in
// as q + 128 and each block's sum starts from comp = -128 x (the block's column sums of w),
// precomputed [P, Kp / 32, 32]. Decode reads a quarter of float32's weight bytes with one
// instruction per 64 of them, where the int8 x float path widens and converts each.
constexpr int64_t kBlock = 32;
typedef int32_t ivec __attribute__((vector_size(sizeof(vec))));
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr int kInt8Dot = 2;  // AVX512-VNNI
inline ivec dot4(ivec acc, ivec a, ivec w) { return (ivec)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)a, (__m512i)w); }
#elif defined(__AVXVNNI__) && !defined(__AVX512F__)
constexpr int kInt8Dot = 1;  // AVX-VNNI (256 bits)
inline ivec dot4(ivec acc, ivec a, ivec w) {
  return (ivec)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)a, (__m256i)w);
}
#else
constexpr int kInt8Dot = 0;  // the same sums from shifts and multiplies: exact, slower
inline ivec dot4(ivec acc, ivec a, ivec w) {
  for (int t = 0; t < 4; ++t) acc += ((a >> (8 * t)) & 0xff) * ((w << (24 - 8 * t)) >> 24);
  return acc;
}
#endif
inline ivec load_ivec(const void* p) { ivec v; std::memcpy(&v, p, sizeof v); return v; }

// The rows of x rounded to int8 per block: u [rows, Kp] as q + 128, scales [rows, Kp / 32].
struct QuantRows {
  std::vector<uint8_t> u;
  std::vector<float> scales;
  int64_t kp = 0;
};

QuantRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  QuantRows q;
  q.kp = (k + kBlock - 1) / kBlock * kBlock;
  int64_t blocks = q.kp / kBlock;
  q.u.assign(rows * q.kp, 128);
  q.scales.assign(rows * blocks, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k + b * kBlock;
      int64_t size = std::min(kBlock, k - b * kBlock);
      float amax = 0.0f;
      for (int64_t i = 0; i < size; ++i) amax = std::max(amax, std::fabs(xb[i]));
      float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
      q.scales[r * blocks + b] = d;
      uint8_t* ub = q.u.data() + r * q.kp + b * kBlock;
      for (int64_t i = 0; i < size; ++i)
        ub[i] = uint8_t(int(std::clamp(std::nearbyint(xb[i] * id), -127.0f, 127.0f)) + 128);
    }
  return q;
}

struct Quad {  // a weight byte of a quad panel: picks the w8a8 overload of `panels`
  int8_t bits;
};

// One weight's quad panels, comp [P, Kp / 32, 32] and scales [P, G, 32].
struct QuadWeight {
  const int8_t* panels;
  const int32_t* comp;
  const float* scales;
  int64_t groups;
};

// Rows a pass keeps in registers: an int32 and a float accumulator per row and column vector.
constexpr int kQuadRows = kVectorRegisters >= 32 ? 6 : 1;

// out[m0 .. m0 + MB, columns of panel p] from quad panel wp (Kp / 4 quads), comp cp, scales sp.
template <int MB>
void quad_panel(const QuantRows& x, const QuadWeight& w, float* out, int64_t m0, int64_t n, int64_t p) {
  int64_t kp = x.kp, blocks = kp / kBlock, per_group = blocks / w.groups;
  const int8_t* wp = w.panels + p * kp * kPanel;
  const int32_t* cp = w.comp + p * blocks * kPanel;
  const float* sp = w.scales + p * w.groups * kPanel;
  vec acc[MB][kPanelVectors] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    ivec sums[MB][kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) {
      ivec c = load_ivec(cp + b * kPanel + v * kLanes);
      for (int m = 0; m < MB; ++m) sums[m][v] = c;
    }
    for (int64_t j = b * kBlock / 4; j < (b + 1) * kBlock / 4; ++j) {
      ivec wv[kPanelVectors];
      for (int v = 0; v < kPanelVectors; ++v) wv[v] = load_ivec(wp + (j * kPanel + v * kLanes) * 4);
      for (int m = 0; m < MB; ++m) {
        int32_t four;
        std::memcpy(&four, x.u.data() + (m0 + m) * kp + 4 * j, sizeof four);
        ivec a = ivec{} + four;
        for (int v = 0; v < kPanelVectors; ++v) sums[m][v] = dot4(sums[m][v], a, wv[v]);
      }
    }
    const float* sg = sp + (b / per_group) * kPanel;
    for (int v = 0; v < kPanelVectors; ++v) {
      vec s = load_vec(sg + v * kLanes);
      for (int m = 0; m < MB; ++m)
        acc[m][v] += __builtin_convertvector(sums[m][v], vec) * (s * x.scales[(m0 + m) * blocks + b]);
    }
  }
  store_rows<MB>(acc, out, m0, n, p);
}

template <int MB>
void quad_rows(const QuantRows& x, const QuadWeight& w, float* out, int64_t m, int64_t rows, int64_t n, int64_t p) {
  if constexpr (MB > 0) {
    if (rows - m == MB) return quad_panel<MB>(x, w, out, m, n, p);
    quad_rows<MB - 1>(x, w, out, m, rows, n, p);
  }
}

// `rows` rows of x starting at row `first` against panels p0 .. p1 (out at row `first`).
struct QuadItem {
  const QuantRows* x;
  QuadWeight w;
  float* out;
  int64_t first, rows, p0, p1;
};

void quad_panels(const QuadItem& it, int64_t n) {
  for (int64_t p = it.p0; p < it.p1; ++p) {
    int64_t m = 0;
    for (; it.rows - m > kQuadRows; m += kQuadRows) quad_panel<kQuadRows>(*it.x, it.w, it.out, it.first + m, n, p);
    quad_rows<kQuadRows>(*it.x, it.w, it.out, it.first + m, it.first + it.rows, n, p);
  }
}

// As Run: each weight's panels in chunks, a few per thread, from one counter.
ffi::Error RunQuads(ffi::ThreadPool& pool, const std::vector<QuadItem>& weights, int64_t num_panels, int64_t n) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads()), total = 0;
  auto cost = [](const QuadItem& one) { return one.rows + 2; };
  for (const QuadItem& one : weights) total += num_panels * cost(one);
  int64_t target = std::max<int64_t>(1, total / (4 * threads));
  std::vector<QuadItem> items;
  for (const QuadItem& one : weights) {
    int64_t chunk = std::max<int64_t>(1, target / cost(one));
    for (int64_t p = 0; p < num_panels; p += chunk) {
      QuadItem part = one;
      part.p0 = p;
      part.p1 = std::min(num_panels, p + chunk);
      items.push_back(part);
    }
  }
  ParallelFor(pool, items.size(), [&](int64_t i) { quad_panels(items[i], n); });
  return ffi::Error::Success();
}

using QuadPanels = ffi::Buffer<ffi::S8, 5>;       // [E, P, Kp / 4, 32, 4]
using QuadComp = ffi::Buffer<ffi::S32, 4>;        // [E, P, Kp / 32, 32]

// x [R, K] grouped by expert (sizes [E]) times quad panels [E, P, Kp / 4, 32, 4] -> out [R, N];
// a plain product is one expert holding every row.
ffi::Error GroupedW8A8PanelMatmul(ffi::ThreadPool pool, Rows x, QuadPanels w, QuadComp comp, ExpertScales scales,
                                  Sizes sizes, ffi::ResultBuffer<ffi::F32, 2> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), cd = comp.dimensions(), sd = scales.dimensions(),
       od = out->dimensions();
  int64_t experts = wd[0], num_panels = wd[1], rows = xd[0], k = xd[1], n = od[1];
  int64_t kp = (k + kBlock - 1) / kBlock * kBlock, blocks = kp / kBlock, groups = sd[2];
  auto fail = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("grouped_w8a8_panel_matmul: ") + what);
  };
  if (wd[2] != kp / 4 || wd[3] != kPanel || wd[4] != 4) return fail("w must be [E, P, ceil(K / 32) * 8, 32, 4]");
  if (cd[0] != experts || cd[1] != num_panels || cd[2] != blocks || cd[3] != kPanel)
    return fail("comp must be [E, P, ceil(K / 32), 32]");
  if (sd[0] != experts || sd[1] != num_panels || sd[3] != kPanel || groups <= 0 || blocks % groups != 0)
    return fail("scales must be [E, P, G, 32] with G dividing K's blocks of 32");
  if (od[0] != rows || !Matches(num_panels, n)) return fail("x [R, K] and out [R, N] do not match w");
  if (sizes.element_count() != experts) return fail("sizes must have one entry per expert");
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t size = sizes.typed_data()[e];
    if (size < 0 || size > rows - start) return fail("group sizes must be >= 0 and sum to at most R");
    start += size;
  }
  QuantRows q = quantize_rows(x.typed_data(), start, k);  // the rows past the groups are not read
  std::vector<QuadItem> weights;
  start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t size = sizes.typed_data()[e];
    if (size > 0)
      weights.push_back({&q,
                         {w.typed_data() + e * num_panels * kp * kPanel,
                          comp.typed_data() + e * num_panels * blocks * kPanel,
                          scales.typed_data() + e * num_panels * groups * kPanel, groups},
                         out->typed_data(), start, size, 0, 0});
    start += size;
  }
  std::memset(out->typed_data() + start * n, 0, (rows - start) * n * sizeof(float));
  return RunQuads(pool, weights, num_panels, n);
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
                                  .Attr<bool>("bf16")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(grouped_int8_panel_matmul, GroupedInt8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Int8ExpertPanels>()
                                  .Arg<ExpertScales>()
                                  .Arg<Sizes>()
                                  .Attr<bool>("bf16")
                                  .Ret<Rows>());

// Whether the bf16 kernels run on vdpbf16ps (1) or widen to float32 (0): what build.bf16_dot() reports.
extern "C" int grok_runner_bf16_dot() { return kBf16Dot ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(bf16_panel_matmul, Bf16PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<Bf16Panels>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(grouped_bf16_panel_matmul, Bf16GroupedPanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Bf16ExpertPanels>()
                                  .Arg<Sizes>()
                                  .Ret<Rows>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(grouped_w8a8_panel_matmul, GroupedW8A8PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<QuadPanels>()
                                  .Arg<QuadComp>()
                                  .Arg<ExpertScales>()
                                  .Arg<Sizes>()
                                  .Ret<Rows>());

// Which instruction the w8a8 kernels sum on: 2 AVX512-VNNI, 1 AVX-VNNI, 0 neither (shifts and
// multiplies, the same sums): what build.int8_dot() reports.
extern "C" int grok_runner_int8_dot() { return kInt8Dot; }
