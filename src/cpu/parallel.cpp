// parallel.cpp: a fork-join parallel_for over std::thread (see parallel.hpp).
//
// Threads are started per call rather than pooled: the CPU backend is the reference and the
// fallback, where tens of microseconds of thread start-up per call are noise, and a pool would
// bring shutdown-order and fork-safety questions a static library should not raise.
#include "cpu/parallel.hpp"

#include <algorithm>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace qkvfuse::cpu {

void parallel_for(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (count <= 0) return;
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::min(hardware, count / std::max<int64_t>(1, grain));
  if (threads <= 1) {
    body(0, count);
    return;
  }

  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto run_chunk = [&](int64_t chunk) {
    // Balanced split: the first (count % threads) chunks take one extra item.
    const int64_t base = count / threads;
    const int64_t extra = count % threads;
    const int64_t begin = chunk * base + std::min(chunk, extra);
    const int64_t end = begin + base + (chunk < extra ? 1 : 0);
    try {
      body(begin, end);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };

  std::vector<std::thread> workers;
  workers.reserve(size_t(threads - 1));
  for (int64_t chunk = 1; chunk < threads; ++chunk) workers.emplace_back(run_chunk, chunk);
  run_chunk(0);
  for (std::thread& worker : workers) worker.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace qkvfuse::cpu
