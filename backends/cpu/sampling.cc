// What the sampler needs from each row of logits on CPU, as XLA FFI custom calls (float32):
// the cut of top-k/top-p without sorting the row, and the row's top tokens and log-normaliser in
// one pass.
//
// sampling_threshold
//
//   scaled [B, V] (tempered logits), top_k [B] int32 (0 = off), nucleus_p [B] float32  ->  threshold [B]
//
// runner/sampling.py keeps the tokens whose tempered logit is >= the threshold. Its reference rule
// sorts each row: keep the k largest, then, over their softmax, keep a token while the mass of the
// tokens before it is below p. The last token kept sets the threshold, and it is the smallest
// logit t among the k largest whose mass above (of the tokens strictly greater than t) is below
// p: ties with t all pass the >= either way. XLA:CPU's sort took 190 ms a batch-32 step for
// 32768 tokens (BENCHMARKS.md). Here a radix select over each logit's bits finds the same value:
// three rounds (11, 11 and 10 bits) that count (top-k) or weigh (top-p) only the tokens left in
// the bucket the previous round chose.
//
// NaN logits are never kept. A row whose largest logit is infinite, or that has no number but
// -inf, gets that largest logit (the +inf tokens pass, or all do).
//
// logits_summary
//
//   logits [B, V]  ->  top [B, T] values and ids (T <= V; descending, ties by lower id), lse [B]
//
// What jax.lax.top_k and jax.nn.logsumexp give, in one pass for the top T (a vector compare
// against the T-th best so far; the rare winners are inserted in order) and one for the sum of
// exponentials. The greedy token is top id 0: the first of the largest logits. XLA:CPU took
// 1.6 ms a batch-32 step for the top 8 of 32768 alone. NaN ranks as -inf (after the numbers);
// a NaN in the row makes its lse NaN, as in JAX.
#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

using namespace grok_kernels;

// An unsigned key in the order of the floats (-inf < ... < -0 < +0 < ... < +inf); NaN is 0, below all.
inline uint32_t order_key(float x) {
  if (x != x) return 0;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float key_value(uint32_t key) {
  uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

constexpr int kRounds = 3, kShift[kRounds] = {21, 10, 0}, kBits[kRounds] = {11, 11, 10};
constexpr uint32_t kNoNaN = 1;  // the smallest key of a number (NaN is 0)

class Row {
 public:
  float threshold(const float* x, int64_t v, int32_t top_k, float p) {
    float m = max(x, v);
    if (!(m > -INFINITY) || m == INFINITY) return m;
    keys_.resize(v);
    for (int64_t i = 0; i < v; ++i) keys_[i] = order_key(x[i]);
    // top-k: the k-th largest logit (counted with its ties) and how many are strictly greater
    uint32_t floor = kNoNaN;
    int64_t greater = 0, equal = 0;
    bool kth = false;
    if (top_k > 0 && top_k < v) {
      int64_t need = top_k, last = 0;
      uint32_t key = radix<false>(kNoNaN, [&](const int64_t* count, const double*, int buckets) {
        for (int b = buckets - 1; b >= 0; --b) {
          if (count[b] >= need) {
            last = count[b];
            return b;
          }
          need -= count[b];
        }
        return -1;  // fewer than k numbers: no cut
      });
      if (key != kNone) kth = true, floor = key, greater = top_k - need, equal = last;
    }
    if (!(p < 1.0f)) return kth ? key_value(floor) : -INFINITY;
    // top-p over the softmax of the k largest: the walk down the buckets stops at the last one whose
    // mass above is still below p times the total
    e_.resize(v + 16);
    int64_t i = 0;
    for (; i + 16 <= v; i += 16) store(e_.data() + i, exp_nonpositive(load(x + i) - m));
    if (i < v) store(e_.data() + i, exp_nonpositive(load_part(x + i, v - i) - m));
    double above = 0, target = -1;
    uint32_t key = radix<true>(floor, [&](const int64_t* count, const double* mass, int buckets) {
      if (target < 0) {  // the first round weighs every candidate: the softmax's total
        double total = 0;
        for (int b = 0; b < buckets; ++b) total += mass[b];
        if (kth) {  // only top_k - greater of the ties with the k-th are among the k largest
          double tie = exp_nonpositive(splat(key_value(floor) - m))[0];
          total += (double(top_k - greater) - double(equal)) * tie;
        }
        target = double(p) * total;
      }
      int chosen = -1;
      double acc = above, chosen_above = 0;
      for (int b = buckets - 1; b >= 0; --b) {
        if (count[b] == 0) continue;
        if (!(acc < target)) break;
        chosen = b, chosen_above = acc;
        acc += mass[b];
      }
      above = chosen_above;
      return chosen;
    });
    return key == kNone ? m : key_value(key);  // none: p <= 0 keeps the most likely alone
  }

 private:
  static constexpr uint32_t kNone = 0;  // a NaN's key: never a result

  static float max(const float* x, int64_t v) {
    v16 top = splat(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= v; i += 16) {
      v16 a = load(x + i);
      top = a > top ? a : top;  // NaN compares false: skipped
    }
    float m = -INFINITY;
    for (int j = 0; j < 16; ++j) m = top[j] > m ? top[j] : m;
    for (; i < v; ++i) m = x[i] > m ? x[i] : m;
    return m;
  }

  // Three rounds over the tokens whose key is >= floor: each counts them (and, if kWeigh, sums their
  // e_) into the buckets of its bits, and pick(count, mass, buckets) names the bucket holding the
  // answer (-1: none). Returns the answer's key, or kNone.
  template <bool kWeigh, typename Pick>
  uint32_t radix(uint32_t floor, const Pick& pick) {
    uint32_t prefix = 0;
    for (int round = 0; round < kRounds; ++round) {
      const int shift = kShift[round], buckets = 1 << kBits[round];
      const uint32_t mask = uint32_t(buckets - 1);
      std::fill(count_, count_ + buckets, 0);
      if (kWeigh) std::fill(mass_, mass_ + buckets, 0.0);
      auto add = [&](int64_t i) {
        uint32_t b = (keys_[i] >> shift) & mask;
        ++count_[b];
        if (kWeigh) mass_[b] += e_[i];
      };
      if (round == 0) {
        for (int64_t i = 0; i < int64_t(keys_.size()); ++i)
          if (keys_[i] >= floor) add(i);
      } else {
        for (int64_t i : members_) add(i);
      }
      int b = pick(count_, mass_, buckets);
      if (b < 0) return kNone;
      prefix |= uint32_t(b) << shift;
      if (round + 1 == kRounds) break;
      next_.clear();  // the tokens of bucket b, for the next round
      if (round == 0) {
        for (int64_t i = 0; i < int64_t(keys_.size()); ++i)
          if (keys_[i] >= floor && (keys_[i] >> shift) == uint32_t(b)) next_.push_back(i);
      } else {
        for (int64_t i : members_)
          if (((keys_[i] >> shift) & mask) == uint32_t(b)) next_.push_back(i);
      }
      members_.swap(next_);
    }
    return prefix;
  }

  std::vector<uint32_t> keys_;
  std::vector<float> e_;
  std::vector<int64_t> members_, next_;
  int64_t count_[1 << 11];
  double mass_[1 << 11];
};

ffi::Error SamplingThreshold(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scaled, ffi::Buffer<ffi::S32> top_k,
                             ffi::Buffer<ffi::F32> nucleus_p, ffi::ResultBuffer<ffi::F32> out) {
  auto d = scaled.dimensions();
  if (d.size() != 2 || int64_t(top_k.element_count()) != d[0] || int64_t(nucleus_p.element_count()) != d[0] ||
      int64_t(out->element_count()) != d[0])
    return ffi::Error::InvalidArgument("sampling_threshold: scaled [B, V], top_k [B], nucleus_p [B] -> [B]");
  const int64_t v = d[1];
  const float* x = scaled.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* p = nucleus_p.typed_data();
  float* t = out->typed_data();
  ParallelFor(pool, d[0], [&](int64_t r) {
    thread_local Row row;  // its buffers outlive the call: no allocation once they have grown
    t[r] = row.threshold(x + r * v, v, k[r], p[r]);
  });
  return ffi::Error::Success();
}

// Row r's top T (into vals, ids) and log-sum-exp.
void Summarize(const float* x, int64_t v, int64_t t, float* vals, int32_t* ids, float* lse) {
  int64_t filled = 0;  // slots 0 .. filled-1 hold the best so far, in order
  auto offer = [&](int64_t i) {
    float a = x[i] == x[i] ? x[i] : -INFINITY;  // NaN ranks as -inf, after the numbers before it
    if (filled == t && !(a > vals[t - 1])) return;
    int64_t slot = filled < t ? filled++ : t - 1;
    for (; slot > 0 && a > vals[slot - 1]; --slot) vals[slot] = vals[slot - 1], ids[slot] = ids[slot - 1];
    vals[slot] = a, ids[slot] = int32_t(i);
  };
  int64_t i = 0;
  for (; i < v && filled < t; ++i) offer(i);
  for (; i + 16 <= v; i += 16) {
    v16 block = load(x + i);
    auto better = block > splat(vals[t - 1]);  // NaN compares false
    bool any = false;
    for (int l = 0; l < 16; ++l) any |= better[l] != 0;
    if (any)
      for (int l = 0; l < 16; ++l) offer(i + l);
  }
  for (; i < v; ++i) offer(i);
  for (int64_t j = 0; j < t; ++j)  // the values as given (a NaN stays NaN)
    vals[j] = x[ids[j]];
  const float m = vals[0];
  const bool finite = m > -INFINITY && m < INFINITY;
  v16 total{};
  float rest = 0;
  bool nan = false;
  for (i = 0; i + 16 <= v; i += 16) {
    v16 block = load(x + i);
    auto bad = block != block;
    for (int l = 0; l < 16; ++l) nan |= bad[l] != 0;
    if (finite) total += exp_nonpositive(block - m);
  }
  for (; i < v; ++i) {
    nan |= x[i] != x[i];
    if (finite) rest += exp_nonpositive(splat(x[i] - m))[0];
  }
  *lse = nan ? NAN : finite ? m + std::log(sum(total) + rest) : m;  // no finite maximum: -inf or +inf
}

ffi::Error LogitsSummary(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::F32> top_vals,
                         ffi::ResultBuffer<ffi::S32> top_ids, ffi::ResultBuffer<ffi::F32> lse) {
  auto d = logits.dimensions(), td = top_vals->dimensions();
  if (d.size() != 2 || td.size() != 2 || td[0] != d[0] || td[1] < 1 || td[1] > d[1] ||
      top_ids->element_count() != top_vals->element_count() || int64_t(lse->element_count()) != d[0])
    return ffi::Error::InvalidArgument("logits_summary: logits [B, V] -> top values, ids [B, T <= V], lse [B]");
  const int64_t v = d[1], t = td[1];
  ParallelFor(pool, d[0], [&](int64_t r) {
    Summarize(logits.typed_data() + r * v, v, t, top_vals->typed_data() + r * t, top_ids->typed_data() + r * t,
              lse->typed_data() + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(logits_summary, LogitsSummary,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(sampling_threshold, SamplingThreshold,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
