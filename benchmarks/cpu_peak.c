/* The multiply-accumulate rate of one core for one instruction sequence (cpu_peak.py).
 *
 * Usage: cpu_peak SEQUENCE ITERATIONS; prints the multiply-accumulates per second.
 * Each sequence updates ten independent accumulators in registers, so neither memory
 * nor one chain's latency limits it: what remains is the rate at which the core issues
 * the sequence's instructions. Each accumulator feeds its own next multiply, so the
 * compiler can neither hoist nor share a product between accumulators.
 *
 *   f32   vfmadd231ps: 8 float32 multiply-accumulates per instruction.
 *   int8  vpsignb, vpmaddubsw, vpmaddwd, vpaddd: 32 exact int8 x int8 products added
 *         into int32 (the inner step of qkernels' int8 GEMM, _int8_gemm.cc).
 *   int16 vpmaddwd, vpaddd: 16 int16 x int16 products added into int32 (int8 codes
 *         widened to int16 first; the widening is not counted).
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TEN(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9)

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Each returns the seconds taken; *sink receives the accumulators (keeping them live). */
__attribute__((target("avx2,fma"))) static double F32(long n, float* sink) {
  const __m256 a = _mm256_set1_ps(0.5f), b = _mm256_set1_ps(0.25f);
#define DECLARE(j) __m256 f##j = _mm256_set1_ps(j * 1e-3f);
  TEN(DECLARE)
#undef DECLARE
  const double t = Now();
  for (long i = 0; i < n; ++i) {
#define STEP(j) f##j = _mm256_fmadd_ps(a, f##j, b);
    TEN(STEP)
#undef STEP
  }
  const double dt = Now() - t;
#define SINK(j) *sink += _mm256_cvtss_f32(f##j);
  TEN(SINK)
#undef SINK
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

int main(int argc, char** argv) {
  if (argc != 3 || atol(argv[2]) < 1) {
    fprintf(stderr, "usage: %s f32|int8|int16 ITERATIONS (a positive count)\n", argv[0]);
    return 2;
  }
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    fprintf(stderr, "this CPU has no AVX2 + FMA\n");
    return 3;
  }
  const long n = atol(argv[2]);
  float sink = 0;
  double seconds, macs_per_step;
  if (strcmp(argv[1], "f32") == 0) {
    seconds = F32(n, &sink), macs_per_step = 8;
  } else if (strcmp(argv[1], "int8") == 0) {
    seconds = Int8(n, &sink), macs_per_step = 32;
  } else if (strcmp(argv[1], "int16") == 0) {
    seconds = Int16(n, &sink), macs_per_step = 16;
  } else {
    fprintf(stderr, "unknown sequence %s; allowed: f32, int8, int16\n", argv[1]);
    return 2;
  }
  printf("%.6e %g\n", 10.0 * macs_per_step * n / seconds, sink);
  return 0;
}
