/* The multiply-accumulate rate of one core for one instruction sequence (cpu_peak.py).
 *
 * Usage: cpu_peak SEQUENCE ITERATIONS; prints the multiply-accumulates per second.
 * Each sequence updates eight or ten independent accumulators in registers, so
 * neither memory nor one chain's latency limits it: what remains is the rate at which
 * the core issues the sequence's instructions. Each accumulator feeds its own next
 * multiply-add, so the compiler can neither hoist nor share one between accumulators.
 * The two weight-only sequences read their codes from a 4 KiB buffer, which stays in
 * L1, as their kernels load codes: their rates are those of the kernels' arithmetic
 * with the weight already in L1.
 *
 *   f32   vfmadd231ps: 8 float32 multiply-accumulates per instruction.
 *   int8  vpsignb, vpmaddubsw, vpmaddwd, vpaddd: 32 exact int8 x int8 products added
 *         into int32 (the inner step of qkernels' int8 GEMM, _int8_gemm.cc).
 *   int16 vpmaddwd, vpaddd: 16 int16 x int16 products added into int32 (int8 codes
 *         widened to int16 first; the widening is not counted).
 *   w8b1  vpmovsxbd, vcvtdq2ps, vfmadd231ps: 8 int8 codes widened, converted to
 *         float32 and multiply-added (the batch-1 weight-only int8 product of
 *         qkernels' _native.cc, one code per multiply-accumulate).
 *   w4b1  per 32 bytes of packed 4-bit codes: 7 vpslld, 8 vpsrad, 8 vcvtdq2ps and 8
 *         vfmadd231ps for 64 codes (the batch-1 int4 product of _native.cc: each
 *         nibble shifted to the top of its lane, arithmetically down, converted and
 *         multiply-added), two such vectors per loop trip.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TEN(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9)
/* Ten float accumulators f0..f9, and their sum into *sink after the loop. */
#define DECLARE_F(j) __m256 f##j = _mm256_set1_ps(j * 1e-3f);
#define SINK_F(j) *sink += _mm256_cvtss_f32(f##j);

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Each returns the seconds taken; *sink receives the accumulators (keeping them live). */
__attribute__((target("avx2,fma"))) static double F32(long n, float* sink) {
  const __m256 a = _mm256_set1_ps(0.5f), b = _mm256_set1_ps(0.25f);
  TEN(DECLARE_F)
  const double t = Now();
  for (long i = 0; i < n; ++i) {
#define STEP(j) f##j = _mm256_fmadd_ps(a, f##j, b);
    TEN(STEP)
#undef STEP
  }
  const double dt = Now() - t;
  TEN(SINK_F)
  return dt;
}

__attribute__((target("avx2,fma"))) static double Int8(long n, float* sink) {
  const __m256i x = _mm256_set1_epi8(3), xa = _mm256_abs_epi8(x), ones = _mm256_set1_epi16(1);
#define DECLARE(j) __m256i s##j = _mm256_set1_epi32(j + 1);
  TEN(DECLARE)
  const double t = Now();
  for (long i = 0; i < n; ++i) {
#define STEP(j) \
  s##j = _mm256_add_epi32(          \
      s##j, _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(s##j, x)), ones));
    TEN(STEP)
#undef STEP
  }
  const double dt = Now() - t;
#define SINK(j) *sink += (float)_mm256_extract_epi32(s##j, 0);
  TEN(SINK)
  return dt;
}

__attribute__((target("avx2,fma"))) static double Int16(long n, float* sink) {
  const __m256i y = _mm256_set1_epi16(3);
  TEN(DECLARE)
#undef DECLARE
  const double t = Now();
  for (long i = 0; i < n; ++i) {
#define STEP(j) s##j = _mm256_add_epi32(s##j, _mm256_madd_epi16(s##j, y));
    TEN(STEP)
#undef STEP
  }
  const double dt = Now() - t;
  TEN(SINK)
#undef SINK
  return dt;
}

/* A 4 KiB code buffer (plus the last step's reach), so every load hits L1. */
static unsigned char codes[4096 + 128];

__attribute__((target("avx2,fma"))) static double W8b1(long n, float* sink) {
  const __m256 x = _mm256_set1_ps(0.5f);
  TEN(DECLARE_F)
  const double t = Now();
  for (long i = 0; i < n; ++i) {
    const unsigned char* p = codes + (i & 63) * 64;
#define CODES(j) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * (j))))
#define STEP(j) f##j = _mm256_fmadd_ps(x, _mm256_cvtepi32_ps(CODES(j)), f##j);
    TEN(STEP)
#undef STEP
#undef CODES
  }
  const double dt = Now() - t;
  TEN(SINK_F)
  return dt;
}

/* Nibble t of each 32-bit lane of v as a float: shifted to the top, arithmetically
 * down, converted (_native.cc's NibbleAt for signed int4). */
#define NIBBLE(v, t) \
  _mm256_cvtepi32_ps(_mm256_srai_epi32((t) == 7 ? (v) : _mm256_slli_epi32((v), 28 - 4 * (t)), 28))

__attribute__((target("avx2,fma"))) static double W4b1(long n, float* sink) {
  const __m256 x = _mm256_set1_ps(0.5f);
  __m256 o[8];
  for (int j = 0; j < 8; ++j) o[j] = _mm256_set1_ps(j * 1e-3f);
  const double t = Now();
  for (long i = 0; i < n; ++i) {
    /* Two independent vectors of codes per trip, so that no chain's latency binds. */
    const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + (i & 63) * 64));
    const __m256i u = _mm256_loadu_si256((const __m256i*)(codes + (i & 63) * 64 + 32));
    o[0] = _mm256_fmadd_ps(x, NIBBLE(v, 1), _mm256_fmadd_ps(x, NIBBLE(v, 0), o[0]));
    o[1] = _mm256_fmadd_ps(x, NIBBLE(v, 3), _mm256_fmadd_ps(x, NIBBLE(v, 2), o[1]));
    o[2] = _mm256_fmadd_ps(x, NIBBLE(v, 5), _mm256_fmadd_ps(x, NIBBLE(v, 4), o[2]));
    o[3] = _mm256_fmadd_ps(x, NIBBLE(v, 7), _mm256_fmadd_ps(x, NIBBLE(v, 6), o[3]));
    o[4] = _mm256_fmadd_ps(x, NIBBLE(u, 1), _mm256_fmadd_ps(x, NIBBLE(u, 0), o[4]));
    o[5] = _mm256_fmadd_ps(x, NIBBLE(u, 3), _mm256_fmadd_ps(x, NIBBLE(u, 2), o[5]));
    o[6] = _mm256_fmadd_ps(x, NIBBLE(u, 5), _mm256_fmadd_ps(x, NIBBLE(u, 4), o[6]));
    o[7] = _mm256_fmadd_ps(x, NIBBLE(u, 7), _mm256_fmadd_ps(x, NIBBLE(u, 6), o[7]));
  }
  const double dt = Now() - t;
  for (int j = 0; j < 8; ++j) *sink += _mm256_cvtss_f32(o[j]);
  return dt;
}

int main(int argc, char** argv) {
  if (argc != 3 || atol(argv[2]) < 1) {
    fprintf(stderr, "usage: %s f32|int8|int16|w8b1|w4b1 ITERATIONS (a positive count)\n",
            argv[0]);
    return 2;
  }
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    fprintf(stderr, "this CPU has no AVX2 + FMA\n");
    return 3;
  }
  const long n = atol(argv[2]);
  float sink = 0;
  for (int i = 0; i < (int)sizeof codes; ++i) codes[i] = (unsigned char)(i * 37 + 11);
  double seconds, macs_per_trip;
  if (strcmp(argv[1], "f32") == 0) {
    seconds = F32(n, &sink), macs_per_trip = 80;
  } else if (strcmp(argv[1], "int8") == 0) {
    seconds = Int8(n, &sink), macs_per_trip = 320;
  } else if (strcmp(argv[1], "int16") == 0) {
    seconds = Int16(n, &sink), macs_per_trip = 160;
  } else if (strcmp(argv[1], "w8b1") == 0) {
    seconds = W8b1(n, &sink), macs_per_trip = 80;
  } else if (strcmp(argv[1], "w4b1") == 0) {
    seconds = W4b1(n, &sink), macs_per_trip = 128;
  } else {
    fprintf(stderr, "unknown sequence %s; allowed: f32, int8, int16, w8b1, w4b1\n", argv[1]);
    return 2;
  }
  printf("%.6e %g\n", macs_per_trip * n / seconds, sink);
  return 0;
}
