// Batch-1 weight-only products with a (K, N) weight for XLA:CPU, as XLA FFI handlers.
//
// Each handler computes, bit for bit, the value of the pure-XLA formulation in
// qcore/ops/kernels.py that it replaces (qcore falls back to that formulation when
// this library is missing): the same float operations on the same operands in the
// same order, with fused multiply-adds exactly where XLA:CPU's code generator emits
// them. What that order is, and why, is written beside each function and in
// qcore.ops.kernels. The speed comes from keeping each partial row's sums in cache
// (4-bit codes: in registers), from summing the partial rows depth first in cache (XLA
// writes them all to a temporary first), from threads that each read one contiguous
// part of the weight, and for int8 codes from reading the weight front to back with
// prefetches into L2 ahead of the reads (kPrefetchBytes).
//
// Built with -ffp-contract=off: every fused multiply-add below is written out.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "_runtime.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace qkernels {
namespace {

// ------------------------------------------------------------------------------------
// The partial rows. For the weight rows k = p * bk + j (j < bk) of partial row p,
//   o = x[k0] * w[k0] + x[k1] * w[k1] + ... + x[k_{bk-1}] * w[k_{bk-1}]
// evaluated as XLA:CPU evaluates that expression: the first add fuses its left
// product, o = fma(x0, w0, x1 * w1); every later add fuses the new product,
// o = fma(xj, wj, o). One partial row has one term when bk == 1. For packed int4 the
// terms of packed row r are (x[2r], low nibble) then (x[2r + 1], high nibble).
// ------------------------------------------------------------------------------------

// What the weight's bytes hold: int8 codes, or two 4-bit codes per byte (K rows 2i
// and 2i + 1 of the column, low nibble first): signed int4 values, or indices into a
// 16-level codebook (nf4).
enum class Codes { kInt8, kInt4, kCodebook4 };

struct Operands {
  const float* x;       // (K,) activations
  const uint8_t* w;     // (K, N) int8 codes or (K/2, N) packed 4-bit codes
  int64_t n;            // columns
  int64_t bk;           // weight rows (4-bit: packed rows) per partial row
  const float* levels;  // the 16 codebook levels (kCodebook4), else null
  const float* scales;  // (G, N) group scales of 4-bit codes, or null (sums unscaled)
  int64_t group_rows;   // partial rows per group (row p takes scale row p / group_rows)
};

// With group scales each code's value is multiplied by its scale (rounded) before it
// enters the sums: the term is x * (code * scale), as in qcore. (Scaling the partial
// rows instead would be cheaper, but XLA fuses that multiply into the tree's first
// add for some shapes and not for others, so no kernel could match it.)
inline const float* ScaleRow(const Operands& a, int64_t p) {
  return a.scales ? a.scales + (p / a.group_rows) * a.n : nullptr;
}

// The value of a 4-bit code.
template <Codes kCodes>
inline float Nibble(const Operands& a, int code) {
  if (kCodes == Codes::kCodebook4) return a.levels[code];
  return static_cast<float>((code ^ 8) - 8);
}

// Term t of partial row p in column c, as (activation, weight) floats.
template <Codes kCodes>
inline void Term(const Operands& a, int64_t p, int64_t t, int64_t c, float* xv, float* wv) {
  if (kCodes != Codes::kInt8) {
    int64_t r = p * a.bk + t / 2;
    uint8_t b = a.w[r * a.n + c];
    *xv = a.x[2 * r + (t % 2)];
    *wv = Nibble<kCodes>(a, t % 2 ? b >> 4 : b & 15);
    if (const float* scale = ScaleRow(a, p)) *wv = *wv * scale[c];
  } else {
    int64_t r = p * a.bk + t;
    *xv = a.x[r];
    *wv = static_cast<float>(static_cast<int8_t>(a.w[r * a.n + c]));
  }
}

// Partial row p for columns [c0, c0 + width), portable code.
template <Codes kCodes>
void PartialScalar(const Operands& a, int64_t p, int64_t c0, int64_t width, float* out) {
  const int64_t terms = kCodes != Codes::kInt8 ? 2 * a.bk : a.bk;
  for (int64_t c = c0; c < c0 + width; ++c) {
    float xv, wv, o;
    Term<kCodes>(a, p, 0, c, &xv, &wv);
    if (terms == 1) {
      o = xv * wv;
    } else {
      float x1, w1;
      Term<kCodes>(a, p, 1, c, &x1, &w1);
      o = std::fma(xv, wv, x1 * w1);
      for (int64_t t = 2; t < terms; ++t) {
        Term<kCodes>(a, p, t, c, &xv, &wv);
        o = std::fma(xv, wv, o);
      }
    }
    out[c - c0] = o;
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline __m256 Int8x8(const uint8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// How far ahead of the row being read the int8 code asks for the weight to be brought
// into L2 (prefetch instructions never fault, so this may point past the weight's end).
// Without it, a core's reads of a weight from memory overlapped too little with the
// arithmetic: the conversion's instructions fill the out-of-order window with few cache
// lines in flight. Scratch measurements, 6 distinct 4096 x 4096 weights: 0.95-1.04 ms
// per layer, against about 1.25 in this order without the prefetch and 1.15-1.22 for
// the former strips of 128 columns (see docs/design.md).
constexpr int64_t kPrefetchBytes = 2048;

// Partial row p over the columns [0, width) (width a multiple of 8) for int8 codes, with
// AVX2 + FMA: one weight row at a time, each column's sum kept in out[] (L1 or L2),
// so that the weight is read front to back, one contiguous row after another. (Summing
// strips of 128 columns in registers over the partial row's rows, 4 KiB apart, was
// 15-20 % slower from memory; other strip widths did no better.)
__attribute__((target("avx2,fma"))) void Int8Avx2(const Operands& a, int64_t p, int64_t width,
                                                  float* out) {
  const int64_t n = a.n, bk = a.bk;
  const uint8_t* r0 = a.w + (p * bk) * n;
  const __m256 x0 = _mm256_set1_ps(a.x[p * bk]);
  if (bk == 1) {
    for (int64_t c = 0; c < width; c += 8)
      _mm256_storeu_ps(out + c, _mm256_mul_ps(x0, Int8x8(r0 + c)));
    return;
  }
  const __m256 x1 = _mm256_set1_ps(a.x[p * bk + 1]);
  for (int64_t c = 0; c < width; c += 8)
    _mm256_storeu_ps(out + c,
                     _mm256_fmadd_ps(x0, Int8x8(r0 + c), _mm256_mul_ps(x1, Int8x8(r0 + n + c))));
  for (int64_t j = 2; j < bk; ++j) {
    const __m256 xj = _mm256_set1_ps(a.x[p * bk + j]);
    const uint8_t* rj = r0 + j * n;
    int64_t c = 0;
    for (; c + 64 <= width; c += 64) {  // one cache line of codes per step
      _mm_prefetch(reinterpret_cast<const char*>(rj + c + kPrefetchBytes), _MM_HINT_T1);
      for (int u = 0; u < 64; u += 8)
        _mm256_storeu_ps(out + c + u, _mm256_fmadd_ps(xj, Int8x8(rj + c + u),
                                                      _mm256_loadu_ps(out + c + u)));
    }
    for (; c < width; c += 8)
      _mm256_storeu_ps(out + c, _mm256_fmadd_ps(xj, Int8x8(rj + c), _mm256_loadu_ps(out + c)));
  }
}

// 4-bit codes are read 32 bytes (32 columns) at a time, as eight 32-bit lanes: lane l
// holds the bytes of columns 4l .. 4l + 3, so nibble t of a lane is the low (t even)
// or high (t odd) code of column 4l + t / 2. Each nibble is taken out with shifts of
// the whole lane. This does the work of the per-8-byte widening loads it replaced with
// fewer instructions on the shuffle and shift units (about 1.4x the products per
// second in scratch measurements, weights in L1).

// The value of nibble kT of each lane: a signed int4 (shifted to the top, then
// arithmetically down), or a codebook level (the low three index bits choose within
// an 8-entry permute, which ignores the higher bits; bit 3, shifted to the sign,
// chooses between the two halves of the table).
template <Codes kCodes, int kT>
__attribute__((target("avx2,fma"))) inline __m256 NibbleAt(__m256i v, __m256 table_lo,
                                                            __m256 table_hi) {
  const __m256i top = kT == 7 ? v : _mm256_slli_epi32(v, 28 - 4 * kT);
  if (kCodes == Codes::kInt4) return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 28));
  const __m256i index = kT == 0 ? v : _mm256_srli_epi32(v, 4 * kT);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table_lo, index),
                          _mm256_permutevar8x32_ps(table_hi, index), _mm256_castsi256_ps(top));
}

// Column 4l + kB of the packed row in `v` (the lanes above): its two terms added to o
// as in PartialScalar, the low code's term first; with kScaled each code's value times
// `scale` (that column's group scale in lane l) first.
template <Codes kCodes, bool kScaled, int kB>
__attribute__((target("avx2,fma"))) inline __m256 Step4(bool first, __m256 o, __m256i v,
                                                         __m256 xl, __m256 xh, __m256 table_lo,
                                                         __m256 table_hi, __m256 scale) {
  __m256 lo = NibbleAt<kCodes, 2 * kB>(v, table_lo, table_hi);
  __m256 hi = NibbleAt<kCodes, 2 * kB + 1>(v, table_lo, table_hi);
  if (kScaled) {
    lo = _mm256_mul_ps(lo, scale);
    hi = _mm256_mul_ps(hi, scale);
  }
  return first ? _mm256_fmadd_ps(xl, lo, _mm256_mul_ps(xh, hi))
               : _mm256_fmadd_ps(xh, hi, _mm256_fmadd_ps(xl, lo, o));
}

constexpr int64_t kStrip4 = 32;  // columns of 4-bit codes summed in registers at a time

// The 32 floats from `s` (columns 0..31 of a strip) in the lane order of the 4-bit
// code: column 4l + b in lane l of sv[b] (the inverse of FourBitAvx2's store).
__attribute__((target("avx2,fma"))) inline void InLanes(const float* s, __m256* sv) {
  const __m256 a0 = _mm256_loadu_ps(s), a1 = _mm256_loadu_ps(s + 8);
  const __m256 a2 = _mm256_loadu_ps(s + 16), a3 = _mm256_loadu_ps(s + 24);
  // b0..b3: lanes (0, 4), (1, 5), (2, 6), (3, 7), then a 4 x 4 transpose in each half.
  const __m256 b0 = _mm256_permute2f128_ps(a0, a2, 0x20), b1 = _mm256_permute2f128_ps(a0, a2, 0x31);
  const __m256 b2 = _mm256_permute2f128_ps(a1, a3, 0x20), b3 = _mm256_permute2f128_ps(a1, a3, 0x31);
  const __m256 t0 = _mm256_unpacklo_ps(b0, b1), t1 = _mm256_unpackhi_ps(b0, b1);
  const __m256 t2 = _mm256_unpacklo_ps(b2, b3), t3 = _mm256_unpackhi_ps(b2, b3);
  sv[0] = _mm256_shuffle_ps(t0, t2, 0x44);
  sv[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
  sv[2] = _mm256_shuffle_ps(t1, t3, 0x44);
  sv[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}

// Partial row p over kStrip4 columns from c0 for 4-bit codes. o[b] sums column
// 4l + b in lane l; a 4 x 8 transpose puts the columns back in order for the store.
template <Codes kCodes, bool kScaled>
__attribute__((target("avx2,fma"))) void FourBitAvx2(const Operands& a, int64_t p, int64_t c0,
                                                     float* out) {
  __m256 table_lo = _mm256_setzero_ps(), table_hi = _mm256_setzero_ps();
  if (kCodes == Codes::kCodebook4) {
    table_lo = _mm256_loadu_ps(a.levels);
    table_hi = _mm256_loadu_ps(a.levels + 8);
  }
  __m256 sv[4] = {table_lo, table_lo, table_lo, table_lo};  // (unused unless kScaled)
  if (kScaled) InLanes(ScaleRow(a, p) + c0, sv);
  __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
  for (int64_t j = 0; j < a.bk; ++j) {
    const int64_t r = p * a.bk + j;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + r * a.n + c0));
    const __m256 xl = _mm256_set1_ps(a.x[2 * r]), xh = _mm256_set1_ps(a.x[2 * r + 1]);
    const bool first = j == 0;
    o0 = Step4<kCodes, kScaled, 0>(first, o0, v, xl, xh, table_lo, table_hi, sv[0]);
    o1 = Step4<kCodes, kScaled, 1>(first, o1, v, xl, xh, table_lo, table_hi, sv[1]);
    o2 = Step4<kCodes, kScaled, 2>(first, o2, v, xl, xh, table_lo, table_hi, sv[2]);
    o3 = Step4<kCodes, kScaled, 3>(first, o3, v, xl, xh, table_lo, table_hi, sv[3]);
  }
  // t0..t3 pair the accumulators' lanes; u0..u3 hold lanes (0, 4), (1, 5), (2, 6), (3, 7)
  // of all four, i.e. columns 0-3 | 16-19, 4-7 | 20-23, 8-11 | 24-27, 12-15 | 28-31.
  const __m256 t0 = _mm256_unpacklo_ps(o0, o1), t1 = _mm256_unpackhi_ps(o0, o1);
  const __m256 t2 = _mm256_unpacklo_ps(o2, o3), t3 = _mm256_unpackhi_ps(o2, o3);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(u0, u1, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
  _mm256_storeu_ps(out + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm256_storeu_ps(out + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
}

#endif

// Partial row p over columns [0, n).
template <Codes kCodes>
void Partial(const Operands& a, int64_t p, bool simd, float* out) {
  int64_t c = 0;
#if defined(__x86_64__)
  if (simd && kCodes == Codes::kInt8) {
    c = a.n - a.n % 8;
    Int8Avx2(a, p, c, out);
  } else if (simd) {
    for (; c + kStrip4 <= a.n; c += kStrip4) {
      if (a.scales) {
        FourBitAvx2<kCodes, true>(a, p, c, out + c);
      } else {
        FourBitAvx2<kCodes, false>(a, p, c, out + c);
      }
    }
  }
#endif
  PartialScalar<kCodes>(a, p, c, a.n - c, out + c);
}

// The pairwise tree of qcore.ops.kernels._pairwise_sum: at each level with r rows,
// row i < r // 2 becomes row 2i + row 2i + 1, and an odd last row is carried.
// levels[l] is the number of rows at level l (levels[0] = P partial rows, the last 1).
// Nodes are evaluated depth first, so only one row per level is kept and the partial
// rows are computed first to last: the weight is read front to back.
struct Node {
  int level;
  int64_t i;
};

struct Tree {
  std::vector<int64_t> levels;
  explicit Tree(int64_t rows) {
    levels.push_back(rows);
    while (rows > 1) levels.push_back(rows = rows / 2 + rows % 2);
  }
  Node Root() const { return {static_cast<int>(levels.size()) - 1, 0}; }
  // The children of a node: none (a partial row), one (a carried row) or two.
  int Children(Node v, Node* c) const {
    if (v.level == 0) return 0;
    const int64_t h = levels[v.level - 1] / 2;
    if (v.i == h) {
      c[0] = {v.level - 1, 2 * h};
      return 1;
    }
    c[0] = {v.level - 1, 2 * v.i};
    c[1] = {v.level - 1, 2 * v.i + 1};
    return 2;
  }
  // The nodes `depth` levels below v (fewer where the tree ends or a row is carried).
  void Frontier(Node v, int depth, std::vector<Node>* out) const {
    Node c[2];
    int k = depth > 0 ? Children(v, c) : 0;
    if (k == 0) out->push_back(v);
    for (int j = 0; j < k; ++j) Frontier(c[j], depth - 1, out);
  }
};

// Evaluates node v into out (n floats), with one scratch row of n floats per level of
// the tree from `scratch`. `known(v)` returns a row already computed for v, or null;
// `leaf(p, out)` computes partial row p.
template <typename Known, typename Leaf>
void EvalNode(const Tree& tree, Node v, int64_t n, float* out, float* scratch,
              const Known& known, const Leaf& leaf) {
  if (const float* row = known(v)) {
    std::memcpy(out, row, n * sizeof(float));
    return;
  }
  Node c[2];
  int k = tree.Children(v, c);
  if (k == 0) return leaf(v.i, out);
  EvalNode(tree, c[0], n, out, scratch, known, leaf);
  if (k == 1) return;
  float* right = scratch + v.level * n;
  EvalNode(tree, c[1], n, right, scratch, known, leaf);
  for (int64_t j = 0; j < n; ++j) out[j] = out[j] + right[j];
}

// The calling thread's scratch rows for EvalNode: kept between calls, so that a call
// neither allocates nor clears them (that had cost more than the arithmetic of a small
// layer). Each thread keeps the largest it has needed, levels x N floats (for N =
// 152k columns and 2**13 int8 weight rows, about 6 MB), for the life of the process.
float* ScratchRows(const Tree& tree, int64_t n) {
  thread_local std::vector<float> rows;
  const size_t size = tree.levels.size() * n;
  if (rows.size() < size) rows.resize(size);
  return rows.data();
}

// y[0, n] = pairwise_sum_p(partial[p, n]), unscaled: the caller multiplies by the
// column scales in XLA, which fuses that multiply with an add that follows it (a
// bias) into one fused multiply-add, as on its own path. The threads split the tree, not
// the columns: each evaluates the subtrees below one node near the root over all
// columns, so it reads whole contiguous blocks of weight rows (splitting the columns
// made every thread read short pieces of every row: about 60 % of the speed).
// Group scales (`scales`, G x N floats, G dividing the partial rows) are applied to
// each code as it is read (see ScaleRow), so the result is then scaled.
template <Codes kCodes>
ffi::Error KnBatch1(ffi::ThreadPool pool, ffi::AnyBuffer x_buf, ffi::AnyBuffer w_buf,
                    ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bk, const float* levels,
                    const ffi::Buffer<ffi::F32>* scales = nullptr) {
  auto wd = w_buf.dimensions();
  if (wd.size() != 2 || x_buf.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("qkernels: expected x f32, w (rows, N)");
  const int64_t k_rows = wd[0], n = wd[1];
  const int64_t k = kCodes != Codes::kInt8 ? 2 * k_rows : k_rows;
  if (static_cast<int64_t>(x_buf.element_count()) != k || bk < 1 || k_rows % bk ||
      y->element_count() != static_cast<size_t>(n))
    return ffi::Error::InvalidArgument(
        "qkernels: inconsistent shapes: x has " + std::to_string(x_buf.element_count()) +
        " elements, w is (" + std::to_string(k_rows) + ", " + std::to_string(n) +
        "), bk is " + std::to_string(bk) + "; allowed: x (1, K), bk dividing w's rows");
  int64_t groups = 1;
  if (scales) {
    auto sd = scales->dimensions();
    groups = sd.size() == 2 ? sd[0] : 0;
    if (sd.size() != 2 || sd[1] != n || groups < 1 || (k_rows / bk) % groups)
      return ffi::Error::InvalidArgument(
          "qkernels: scales must be (G, " + std::to_string(n) +
          ") with G dividing the " + std::to_string(k_rows / bk) + " partial rows");
  }
  const Operands a{static_cast<const float*>(x_buf.untyped_data()),
                   static_cast<const uint8_t*>(w_buf.untyped_data()),
                   n,
                   bk,
                   levels,
                   scales ? scales->typed_data() : nullptr,
                   k_rows / bk / groups};
  float* out = y->typed_data();
  if (k_rows == 0) {  // an empty sum
    std::fill(out, out + n, 0.0f);
    return ffi::Error::Success();
  }
  const bool simd = HasAvx2Fma();
  const Tree tree(k_rows / bk);
  int depth = 0;
  while ((int64_t{1} << depth) < pool.num_threads()) ++depth;
  std::vector<Node> items;
  tree.Frontier(tree.Root(), depth, &items);
  std::unique_ptr<float[]> rows(new float[items.size() * n]);  // one row per item
  auto none = [](Node) -> const float* { return nullptr; };
  const bool ok = ParallelItems(pool, static_cast<int64_t>(items.size()), [&](int64_t item) {
    auto leaf = [&](int64_t p, float* dst) { Partial<kCodes>(a, p, simd, dst); };
    EvalNode(tree, items[item], n, rows.get() + item * n, ScratchRows(tree, n), none, leaf);
  });
  if (!ok) return Failed();
  auto known = [&](Node v) -> const float* {
    for (size_t j = 0; j < items.size(); ++j)
      if (items[j].level == v.level && items[j].i == v.i) return rows.get() + j * n;
    return nullptr;
  };
  EvalNode(tree, tree.Root(), n, out, ScratchRows(tree, n), known, [](int64_t, float*) {});
  return ffi::Error::Success();
}

ffi::Error Int8KnBatch1(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bk) {
  if (w.element_type() != ffi::S8) return ffi::Error::InvalidArgument("qkernels: w must be int8");
  return Guarded([&] { return KnBatch1<Codes::kInt8>(pool, x, w, y, bk, nullptr); });
}

ffi::Error Int4KnBatch1(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bk) {
  if (w.element_type() != ffi::U8) return ffi::Error::InvalidArgument("qkernels: w must be uint8");
  return Guarded([&] { return KnBatch1<Codes::kInt4>(pool, x, w, y, bk, nullptr); });
}

ffi::Error Codebook4KnBatch1(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> levels, ffi::Result<ffi::Buffer<ffi::F32>> y,
                             int64_t bk) {
  if (w.element_type() != ffi::U8) return ffi::Error::InvalidArgument("qkernels: w must be uint8");
  if (levels.element_count() != 16)
    return ffi::Error::InvalidArgument("qkernels: a 4-bit codebook has 16 levels");
  return Guarded(
      [&] { return KnBatch1<Codes::kCodebook4>(pool, x, w, y, bk, levels.typed_data()); });
}

ffi::Error Int4KnBatch1Groups(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> scales, ffi::Result<ffi::Buffer<ffi::F32>> y,
                              int64_t bk) {
  if (w.element_type() != ffi::U8) return ffi::Error::InvalidArgument("qkernels: w must be uint8");
  return Guarded([&] { return KnBatch1<Codes::kInt4>(pool, x, w, y, bk, nullptr, &scales); });
}

ffi::Error Codebook4KnBatch1Groups(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                   ffi::Buffer<ffi::F32> levels, ffi::Buffer<ffi::F32> scales,
                                   ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t bk) {
  if (w.element_type() != ffi::U8) return ffi::Error::InvalidArgument("qkernels: w must be uint8");
  if (levels.element_count() != 16)
    return ffi::Error::InvalidArgument("qkernels: a 4-bit codebook has 16 levels");
  return Guarded([&] {
    return KnBatch1<Codes::kCodebook4>(pool, x, w, y, bk, levels.typed_data(), &scales);
  });
}

}  // namespace

#define QK_BIND(...)                                                                   \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>() \
      __VA_ARGS__.Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("bk")

XLA_FFI_DEFINE_HANDLER_SYMBOL(QkInt8KnBatch1, Int8KnBatch1, QK_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QkInt4KnBatch1, Int4KnBatch1, QK_BIND());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QkCodebook4KnBatch1, Codebook4KnBatch1,
                              QK_BIND(.Arg<ffi::Buffer<ffi::F32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QkInt4KnBatch1Groups, Int4KnBatch1Groups,
                              QK_BIND(.Arg<ffi::Buffer<ffi::F32>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(QkCodebook4KnBatch1Groups, Codebook4KnBatch1Groups,
                              QK_BIND(.Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()));

}  // namespace qkernels

// ---- Python module: the handlers as capsules, and whether the SIMD code runs here.
static PyObject* Handlers(PyObject*, PyObject*) {
  const std::pair<const char*, void*> handlers[] = {
      {"qkernels_int8_kn_batch1", reinterpret_cast<void*>(qkernels::QkInt8KnBatch1)},
      {"qkernels_int4_kn_batch1", reinterpret_cast<void*>(qkernels::QkInt4KnBatch1)},
      {"qkernels_codebook4_kn_batch1", reinterpret_cast<void*>(qkernels::QkCodebook4KnBatch1)},
      {"qkernels_int4_kn_batch1_groups", reinterpret_cast<void*>(qkernels::QkInt4KnBatch1Groups)},
      {"qkernels_codebook4_kn_batch1_groups",
       reinterpret_cast<void*>(qkernels::QkCodebook4KnBatch1Groups)},
      {"qkernels_int8_gemm", reinterpret_cast<void*>(QkInt8Gemm)},
      {"qkernels_w8a8", reinterpret_cast<void*>(QkW8a8)},
  };
  PyObject* d = PyDict_New();
  for (const auto& [name, fn] : handlers) {
    PyObject* capsule = PyCapsule_New(fn, nullptr, nullptr);
    PyDict_SetItemString(d, name, capsule);
    Py_DECREF(capsule);
  }
  return d;
}

static PyObject* Simd(PyObject*, PyObject*) { return PyBool_FromLong(qkernels::HasAvx2Fma()); }

static PyObject* Vnni(PyObject*, PyObject*) { return PyBool_FromLong(qkernels::HasVnni()); }

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "FFI handler capsules by target name."},
    {"simd", Simd, METH_NOARGS, "Whether this CPU runs the AVX2 + FMA code."},
    {"vnni", Vnni, METH_NOARGS, "Whether this CPU has AVX-VNNI or AVX-512 VNNI."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native", nullptr, -1, kMethods,
                               nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&kModule); }
