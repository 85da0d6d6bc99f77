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
// to run the scheduled tasks never blocks the call. An exception in an item (an
// allocation that fails) is caught, so it neither terminates the process from a pool
// thread nor unwinds the caller while other threads still use its data; the call
// then returns false.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  int64_t total = 0;
};

template <typename F>
bool ParallelItems(ffi::ThreadPool& pool, int64_t items, F body) {
  auto work = std::make_shared<Work>();
  work->total = items;
  auto run = [work, body]() {
    for (int64_t s; (s = work->next.fetch_add(1)) < work->total;) {
      try {
        body(s);
      } catch (...) {
        work->failed.store(true);
      }
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 1; i < items; ++i) {
    auto task = run;  // Schedule takes ownership of a copy
    pool.Schedule(std::move(task));
  }
  run();
  while (work->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
  return !work->failed.load();
}

// The error a handler returns when it or one of its items threw (an allocation that
// failed): an exception must not leave an FFI handler.
inline ffi::Error Failed() {
  return ffi::Error::Internal("qkernels: the kernel failed (out of memory?)");
}

// f() (a handler's body), with any exception turned into Failed().
template <typename F>
ffi::Error Guarded(F f) {
  try {
    return f();
  } catch (...) {
    return Failed();
  }
}

}  // namespace qkernels

// Defined in _int8_gemm.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(QkInt8Gemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QkW8a8);

#endif  // QKERNELS_RUNTIME_H_
