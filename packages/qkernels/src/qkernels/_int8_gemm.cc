// Exact int8 x int8 -> int32 matrix products for XLA:CPU, as an XLA FFI handler.
//
// y (M, N) = x (M, K) . w, with w stored (K, N) (Flax's layout) or (N, K) (torch's),
// as int32 sums, or (the w8a8 handler) as float(sum) * x_scale[r], the first multiply
// of qcore's w8a8 expression, without an int32 temporary. Integer sums are exact in
// any order, so the result equals XLA's int8 dot (and qcore's w8a8 product) bit for
// bit; what differs is the speed on CPUs without int8 dot-product instructions
// (VNNI), where XLA's int8 GEMM runs at about float speed.
//
// The AVX2 code multiplies 32 pairs of codes per instruction: vpmaddubsw takes an
// unsigned and a signed byte vector and adds adjacent products into 16-bit sums. The
// activations are made unsigned by taking |x| and moving x's sign onto the weight
// (vpsignb), so each 16-bit sum is |x0|*s0*w0 + |x1|*s1*w1 with |x| <= 128 and
// |w| <= 127: at most 32512 in magnitude, never saturated. vpmaddwd against ones then
// widens adjacent 16-bit sums into the 32-bit accumulators. A weight code of -128
// (qcore's symmetric int8 uses it: its scale divides by 127.5) would overflow the
// sign step, so it is packed as -127 and x[:, k] subtracted from its column after.
//
// The weight is repacked on every call into panels of 16 columns in which each 32-bit
// lane holds one column's codes for 4 consecutive k, one block of K at a time (see
// ColumnsAvx2). Threads take runs of whole panels, so each reads its own part of the
// weight once. One activation row with a (K, N) weight (decoding) is memory-bound and
// takes its own loop without repacking (RowKn).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "_runtime.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace qkernels {
namespace {

constexpr int64_t kCols = 16;  // columns per panel: two vectors of eight 32-bit lanes
constexpr int kRows = 4;       // activation rows per tile

struct Gemm {
  const int8_t* x;  // (M, ldx) activations, ldx >= K, zero-padded to a multiple of 4
  int64_t ldx;
  const int8_t* w;  // (K, N) or (N, K) weight
  bool w_nk;
  int64_t m, k, n;
  int32_t* y;        // (M, N): the sums, or (scaled) the floats' bits
  const float* xs;   // (M,) row scales, or null: y holds the int32 sums
};

// y[r, c] from its integer sum: the sum itself, or float(sum) * xs[r] stored in y's
// 4 bytes (the first multiply of qcore's w8a8 expression; the caller multiplies by
// the column scales in XLA, which fuses that multiply with an add that follows it
// into one fused multiply-add, as on its own path).
inline int32_t Out(const Gemm& g, int64_t r, int32_t sum) {
  if (g.xs == nullptr) return sum;
  const float v = static_cast<float>(sum) * g.xs[r];
  int32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits;
}

// Code w[k, c] whatever the layout.
inline int8_t W(const Gemm& g, int64_t k, int64_t c) {
  return g.w_nk ? g.w[c * g.k + k] : g.w[k * g.n + c];
}

// Columns [c0, c0 + cols) of y, portable and exact.
void PanelScalar(const Gemm& g, int64_t c0, int64_t cols) {
  for (int64_t r = 0; r < g.m; ++r) {
    const int8_t* xr = g.x + r * g.ldx;
    for (int64_t c = c0; c < c0 + cols; ++c) {
      uint32_t s = 0;  // unsigned: wraps past 2**31 as XLA's int32 sums do, defined
      for (int64_t k = 0; k < g.k; ++k)
        s += static_cast<uint32_t>(int32_t{xr[k]} * int32_t{W(g, k, c)});
      g.y[r * g.n + c] = Out(g, r, static_cast<int32_t>(s));
    }
  }
}

#if defined(__x86_64__)
// A weight code of -128, stored as -127 in a panel: (k, column) of y to correct.
struct Lowest {
  int64_t k, c;
};

// Packs groups [q0, q1) (k = 4q .. 4q + 3) of columns [c0, c0 + cols) into `panel`:
// each group 64 bytes, column j's four codes at bytes 4j .. 4j + 3 (zeros past K and
// past the last column). Codes of -128 are stored as -127 and appended to `lowest`.
__attribute__((target("avx2,fma"))) void Pack(const Gemm& g, int64_t c0, int64_t cols,
                                               int64_t q0, int64_t q1, int8_t* panel,
                                               std::vector<Lowest>* lowest) {
  int64_t q = q0;
  if (!g.w_nk && cols == kCols) {
    // Four rows of 16 codes, interleaved byte-wise then pair-wise into k-quads.
    for (; q < q1 && 4 * q + 3 < g.k; ++q) {
      const int8_t* r = g.w + 4 * q * g.n + c0;
      auto row = [&](int i) {
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i * g.n));
      };
      __m128i a = row(0), b = row(1), c = row(2), d = row(3);
      __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);
      __m128i cd_lo = _mm_unpacklo_epi8(c, d), cd_hi = _mm_unpackhi_epi8(c, d);
      __m128i* out = reinterpret_cast<__m128i*>(panel + 64 * (q - q0));
      _mm_storeu_si128(out + 0, _mm_unpacklo_epi16(ab_lo, cd_lo));
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(ab_lo, cd_lo));
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(ab_hi, cd_hi));
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(ab_hi, cd_hi));
    }
  } else if (g.w_nk && cols == kCols) {
    // Each column's four codes are already adjacent.
    for (; q < q1 && 4 * q + 3 < g.k; ++q)
      for (int64_t j = 0; j < kCols; ++j)
        std::memcpy(panel + 64 * (q - q0) + 4 * j, g.w + (c0 + j) * g.k + 4 * q, 4);
  }
  for (; q < q1; ++q)  // the last, partial group; or every group of a narrow panel
    for (int64_t j = 0; j < kCols; ++j)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t k = 4 * q + i;
        panel[64 * (q - q0) + 4 * j + i] = (j < cols && k < g.k) ? W(g, k, c0 + j) : 0;
      }
  const __m256i min = _mm256_set1_epi8(-128);
  for (int64_t b = 0; b < 2 * (q1 - q0); ++b) {
    int8_t* v = panel + 32 * b;
    uint32_t hits = static_cast<uint32_t>(_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)), min)));
    for (; hits; hits &= hits - 1) {
      const int byte = __builtin_ctz(hits), at = 32 * static_cast<int>(b % 2) + byte;
      v[byte] = -127;
      lowest->push_back({4 * (q0 + b / 2) + at % 4, c0 + at / 4});
    }
  }
}

// y[r0 .. r0 + R, c0 .. c0 + cols) from groups [q0, q0 + groups) of a packed panel,
// added to what y holds if `add` (and scaled if the `last` block), corrected for the
// panel's codes of -128 in this block (`lowest`, `hits` of them: each stored as -127,
// so x[:, k] is subtracted).
template <int R>
__attribute__((target("avx2,fma"))) void Tile(const Gemm& g, const int8_t* panel,
                                               int64_t q0, int64_t groups, int64_t r0,
                                               int64_t c0, int64_t cols, bool add,
                                               bool last, const Lowest* lowest,
                                               int64_t hits) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int8_t* x0 = g.x + r0 * g.ldx + 4 * q0;
  for (int64_t q = 0; q < groups; ++q) {
    const __m256i* p = reinterpret_cast<const __m256i*>(panel + 64 * q);
    const __m256i w0 = _mm256_loadu_si256(p), w1 = _mm256_loadu_si256(p + 1);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, x0 + r * g.ldx + 4 * q, 4);
      const __m256i xs = _mm256_set1_epi32(quad);
      const __m256i xa = _mm256_abs_epi8(xs);  // |-128| is 128 as an unsigned byte
      acc[r][0] = _mm256_add_epi32(
          acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xs)), ones));
      acc[r][1] = _mm256_add_epi32(
          acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xs)), ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    int32_t* yr = g.y + (r0 + r) * g.n + c0;
    alignas(32) int32_t tmp[kCols] = {};
    if (add) std::memcpy(tmp, yr, cols * sizeof(int32_t));
    for (int h = 0; h < 2; ++h) {
      __m256i* t = reinterpret_cast<__m256i*>(tmp + 8 * h);
      _mm256_store_si256(t, add ? _mm256_add_epi32(_mm256_load_si256(t), acc[r][h]) : acc[r][h]);
    }
    for (int64_t i = 0; i < hits; ++i) {  // (unsigned, as above)
      uint32_t& t = reinterpret_cast<uint32_t&>(tmp[lowest[i].c - c0]);
      t -= static_cast<uint32_t>(int32_t{g.x[(r0 + r) * g.ldx + lowest[i].k]});
    }
    if (last && g.xs != nullptr)
      for (int64_t j = 0; j < cols; ++j) tmp[j] = Out(g, r0 + r, tmp[j]);
    std::memcpy(yr, tmp, cols * sizeof(int32_t));
  }
}

// Row tile r0 over every panel of a block. The block's codes of -128 are `lowest`,
// panel p's from lowest[first[p]] to lowest[first[p + 1]].
template <int R>
void Tiles(const Gemm& g, const int8_t* packed, int64_t panels, int64_t groups, int64_t q0,
           int64_t r0, int64_t c0, int64_t c1, const std::vector<Lowest>& lowest,
           const std::vector<int64_t>& first) {
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t c = c0 + p * kCols;
    Tile<R>(g, packed + p * groups * 64, q0, groups, r0, c, std::min(kCols, c1 - c), q0 > 0,
            q0 + groups == (g.k + 3) / 4, lowest.data() + first[p], first[p + 1] - first[p]);
  }
}

// Columns [c0, c0 + cols) of y with AVX2. The product is blocked as in GotoBLAS: for
// each block of kDepth groups, the block's panels are packed (about 128 KiB, kept in
// L2), then each tile of activation rows (4 x 4 kDepth bytes, kept in L1) passes over
// every panel, and the sums of later blocks are added to y. A code of -128 is packed
// as -127, and each tile then subtracts x[:, k] from its column.
void ColumnsAvx2(const Gemm& g, int64_t c0, int64_t cols) {
  constexpr int64_t kDepth = 128;
  const int64_t groups = (g.k + 3) / 4, panels = (cols + kCols - 1) / kCols;
  // Reused across calls: a fresh buffer of this size would be mapped (and page
  // faulted) anew on every call.
  thread_local std::vector<int8_t> packed;
  packed.resize(std::max<size_t>(packed.size(), panels * std::min(groups, kDepth) * 64));
  std::vector<Lowest> lowest;
  std::vector<int64_t> first(panels + 1);
  for (int64_t q0 = 0; q0 < groups; q0 += kDepth) {
    const int64_t q1 = std::min(groups, q0 + kDepth), depth = q1 - q0;
    lowest.clear();
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t c = c0 + p * kCols;
      first[p] = static_cast<int64_t>(lowest.size());
      Pack(g, c, std::min(kCols, c0 + cols - c), q0, q1, &packed[p * depth * 64], &lowest);
    }
    first[panels] = static_cast<int64_t>(lowest.size());
    const int8_t* pk = packed.data();
    const int64_t c1 = c0 + cols;
    int64_t r = 0;
    for (; r + kRows <= g.m; r += kRows)
      Tiles<kRows>(g, pk, panels, depth, q0, r, c0, c1, lowest, first);
    switch (g.m - r) {
      case 3: Tiles<3>(g, pk, panels, depth, q0, r, c0, c1, lowest, first); break;
      case 2: Tiles<2>(g, pk, panels, depth, q0, r, c0, c1, lowest, first); break;
      case 1: Tiles<1>(g, pk, panels, depth, q0, r, c0, c1, lowest, first); break;
      default: break;
    }
  }
}

// One activation row with a (K, N) weight (decoding): the product is memory-bound, so
// the weight is read once, front to back, eight rows at a time, without repacking.
// Each 32-byte load of a row holds 32 columns; four rows' loads are interleaved in
// registers so that each 32-bit lane holds one column's four codes (lane order: the
// columns of a strip go to vector (c % 16) / 4, lane c % 4 + 4 (c / 16)). Here the
// weight is the unsigned operand of vpmaddubsw, as |w|, and x carries w's sign
// (vpsignb), so a weight code of -128 (|w| = 128) needs no correction; x's codes of
// -128 are used as -127 and the row w[k, :] subtracted afterwards (RowKn).
constexpr int64_t kStrip = 32;  // columns per step
constexpr int64_t kDepth1 = 8;  // weight rows per pass over the columns

// The four k-quad vectors of columns [c, c + 32) of rows r[0..3].
__attribute__((target("avx2,fma"))) inline void Quads(const int8_t* const* r, int64_t c,
                                                      __m256i* q) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[0] + c));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[1] + c));
  const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[2] + c));
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[3] + c));
  const __m256i ab_lo = _mm256_unpacklo_epi8(a, b), ab_hi = _mm256_unpackhi_epi8(a, b);
  const __m256i de_lo = _mm256_unpacklo_epi8(d, e), de_hi = _mm256_unpackhi_epi8(d, e);
  q[0] = _mm256_unpacklo_epi16(ab_lo, de_lo);
  q[1] = _mm256_unpackhi_epi16(ab_lo, de_lo);
  q[2] = _mm256_unpacklo_epi16(ab_hi, de_hi);
  q[3] = _mm256_unpackhi_epi16(ab_hi, de_hi);
}

// Each 32-bit lane's four products |w| * (x carrying w's sign), summed into int32.
__attribute__((target("avx2,fma"))) inline __m256i QuadSums(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The position in a strip's sums of its column j (see above).
inline int64_t InStrip(int64_t j) { return 8 * ((j % 16) / 4) + j % 4 + 4 * (j / 16); }

// acc (strips of 32 columns, in lane order) += x'[k0, k1) . w[k0, k1), for the first
// `full` columns (a multiple of 32) and k1 - k0 a multiple of kDepth1; x' is x with
// -128 as -127. Sums wrap modulo 2**32 as XLA's int32 sums do.
__attribute__((target("avx2,fma"))) void RowsKnAvx2(const Gemm& g, const int8_t* xq,
                                                    int64_t k0, int64_t k1, int64_t full,
                                                    uint32_t* acc) {
  for (int64_t k = k0; k < k1; k += kDepth1) {
    int32_t lo, hi;
    std::memcpy(&lo, xq + k, 4);
    std::memcpy(&hi, xq + k + 4, 4);
    const __m256i x0 = _mm256_set1_epi32(lo), x1 = _mm256_set1_epi32(hi);
    const int8_t* r[kDepth1];
    for (int i = 0; i < kDepth1; ++i) r[i] = g.w + (k + i) * g.n;
    for (int64_t c = 0; c < full; c += kStrip) {
      __m256i q[4], p[4];
      Quads(r, c, q);
      Quads(r + 4, c, p);
      __m256i* out = reinterpret_cast<__m256i*>(acc + c);
      for (int i = 0; i < 4; ++i) {
        const __m256i s = _mm256_add_epi32(QuadSums(q[i], x0), QuadSums(p[i], x1));
        _mm256_storeu_si256(out + i, _mm256_add_epi32(_mm256_loadu_si256(out + i), s));
      }
    }
  }
}

// y (1, N) for one activation row and a (K, N) weight, threads splitting K (each
// reads a contiguous part of the weight into its own sums, added at the end).
ffi::Error RowKn(ffi::ThreadPool& pool, const Gemm& g) {
  const int64_t n = g.n, k = g.k;
  const int64_t full = n / kStrip * kStrip, deep = k / kDepth1 * kDepth1;
  std::vector<int8_t> xq(g.x, g.x + k);
  for (auto& v : xq) v = v == -128 ? -127 : v;
  const int64_t groups = deep / kDepth1;
  const int64_t items = std::max<int64_t>(1, std::min<int64_t>(groups, pool.num_threads()));
  std::vector<uint32_t> sums(items * full, 0);
  const bool ok = ParallelItems(pool, items, [&](int64_t item) {
    RowsKnAvx2(g, xq.data(), groups * item / items * kDepth1,
               groups * (item + 1) / items * kDepth1, full, sums.data() + item * full);
  });
  if (!ok) return Failed();
  std::vector<uint32_t> total(n, 0);
  for (int64_t c = 0; c < full; ++c) {
    const int64_t at = c / kStrip * kStrip + InStrip(c % kStrip);
    for (int64_t item = 0; item < items; ++item) total[c] += sums[item * full + at];
  }
  // The rows and columns the strips left out, with x's own codes; and for x's codes
  // of -128, used as -127 in the strips, the row once more.
  for (int64_t kk = 0; kk < k; ++kk) {
    const int8_t* w = g.w + kk * n;
    const int32_t xv = g.x[kk];
    const int64_t c0 = kk < deep ? full : 0;
    for (int64_t c = c0; c < n; ++c) total[c] += static_cast<uint32_t>(xv * int32_t{w[c]});
    if (kk < deep && xv == -128)
      for (int64_t c = 0; c < full; ++c) total[c] -= static_cast<uint32_t>(int32_t{w[c]});
  }
  for (int64_t c = 0; c < n; ++c) g.y[c] = Out(g, 0, static_cast<int32_t>(total[c]));
  return ffi::Error::Success();
}
#endif

// The checks and the run shared by both handlers; xs is null for int32 sums.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::S8>& x, ffi::Buffer<ffi::S8>& w,
               int64_t w_nk, const float* xs, size_t xs_count, void* y, size_t y_count) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || (w_nk != 0 && w_nk != 1))
    return ffi::Error::InvalidArgument("qkernels: expected x (M, K), w (K, N) or (N, K)");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = w_nk ? wd[0] : wd[1];
  const bool scaled = xs != nullptr;
  if ((w_nk ? wd[1] : wd[0]) != k || y_count != static_cast<size_t>(m * n) ||
      (scaled && xs_count != static_cast<size_t>(m)))
    return ffi::Error::InvalidArgument(
        "qkernels: inconsistent shapes: x is (" + std::to_string(m) + ", " +
        std::to_string(k) + "), w is (" + std::to_string(wd[0]) + ", " +
        std::to_string(wd[1]) + ") " + (w_nk ? "(N, K)" : "(K, N)") +
        (scaled ? ", " + std::to_string(xs_count) + " row scales" : std::string()) +
        "; allowed: w's K equal to x's K, one scale per row of x");
  Gemm g{x.typed_data(), k, w.typed_data(), w_nk != 0, m, k, n, static_cast<int32_t*>(y), xs};
  if (m == 0 || n == 0) return ffi::Error::Success();
  const bool simd = HasAvx2Fma() && k > 0;
#if defined(__x86_64__)
  if (simd && m == 1 && !g.w_nk) return RowKn(pool, g);
#endif
  std::vector<int8_t> padded;
  if (simd && k % 4) {  // the tiles read activations four codes at a time
    g.ldx = (k + 3) / 4 * 4;
    padded.assign(m * g.ldx, 0);
    for (int64_t r = 0; r < m; ++r) std::memcpy(&padded[r * g.ldx], g.x + r * k, k);
    g.x = padded.data();
  }
  // Items of at most kChunk panels, equal in size, at least one per thread: an
  // item's packed panels stay in L2 (see ColumnsAvx2).
  constexpr int64_t kChunk = 16;
  const int64_t panels = (n + kCols - 1) / kCols;
  const int64_t items = std::min(
      panels, std::max<int64_t>((panels + kChunk - 1) / kChunk, pool.num_threads()));
  const bool ok = ParallelItems(pool, items, [&](int64_t item) {
    const int64_t c0 = panels * item / items * kCols;
    const int64_t cols = std::min(n, panels * (item + 1) / items * kCols) - c0;
#if defined(__x86_64__)
    if (simd) return ColumnsAvx2(g, c0, cols);
#endif
    PanelScalar(g, c0, cols);
  });
  return ok ? ffi::Error::Success() : Failed();
}

ffi::Error Int8Gemm(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                    ffi::Result<ffi::Buffer<ffi::S32>> y, int64_t w_nk) {
  return Guarded(
      [&] { return Run(pool, x, w, w_nk, nullptr, 0, y->typed_data(), y->element_count()); });
}

// float(x . w) * x_scale[r], the int32 sums never leaving the tiles.
ffi::Error W8a8(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::F32> x_scale,
                ffi::Buffer<ffi::S8> w, ffi::Result<ffi::Buffer<ffi::F32>> y, int64_t w_nk) {
  return Guarded([&] {
    return Run(pool, x, w, w_nk, x_scale.typed_data(), x_scale.element_count(),
               y->typed_data(), y->element_count());
  });
}

}  // namespace
}  // namespace qkernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(QkInt8Gemm, qkernels::Int8Gemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int64_t>("w_nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QkW8a8, qkernels::W8a8,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("w_nk"));
