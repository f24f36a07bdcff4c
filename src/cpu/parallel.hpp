// parallel.hpp: the CPU backend's one threading primitive. Internal.
#pragma once

#include <cstdint>
#include <functional>

namespace qkvfuse::cpu {

/// Calls body(begin, end) on disjoint contiguous chunks that together cover [0, count), one chunk
/// per thread (up to std::thread::hardware_concurrency()). Ranges of fewer than 2 * grain items
/// run inline on the caller's thread. Returns when every chunk is done; an exception thrown by a
/// chunk is rethrown here.
///
/// Determinism is the caller's side of the contract: each output element must be computed by one
/// call of body from its own inputs, and reductions must combine per-item partial results in a
/// fixed order after parallel_for returns. Results are then identical for any thread count.
void parallel_for(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

}  // namespace qkvfuse::cpu
