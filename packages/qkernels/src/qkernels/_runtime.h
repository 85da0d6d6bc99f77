// What qkernels' kernels share: the CPU features they dispatch on, the work split
// over XLA's thread pool, and the handlers defined outside _native.cc.
#ifndef QKERNELS_RUNTIME_H_
#define QKERNELS_RUNTIME_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace qkernels {

namespace ffi = xla::ffi;

// Whether this CPU runs the AVX2 + FMA code (else the portable code runs).
inline bool HasAvx2Fma() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

// Whether this CPU has int8 dot-product instructions (AVX-VNNI or AVX-512 VNNI),
// which XLA's own int8 GEMM uses and qkernels' AVX2 int8 GEMM does not.
inline bool HasVnni() {
#if defined(__x86_64__)
  static const bool ok =
      __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni");
  return ok;
#else
  return false;
#endif
}

// Work split: items handed out through an atomic counter. The calling thread takes
// items too and waits only for items another thread has started, so a pool too busy
// to run the scheduled tasks never blocks the call.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

template <typename F>
void ParallelItems(ffi::ThreadPool& pool, int64_t items, F body) {
  auto work = std::make_shared<Work>();
  work->total = items;
  auto run = [work, body]() {
    for (int64_t s; (s = work->next.fetch_add(1)) < work->total;) {
      body(s);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < items; ++i) {
    auto task = run;  // Schedule takes ownership of a copy
    pool.Schedule(std::move(task));
  }
  run();
  while (work->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace qkernels

// Defined in _int8_gemm.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(QkInt8Gemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QkW8a8);

#endif  // QKERNELS_RUNTIME_H_
