// The threads the CPU kernels share (tree_attention.cc, weight_grad.cc): how many to start for a
// call, and running one function per thread. Each kernel decides which work items a thread runs;
// the kernels that must be bitwise repeatable make that a function of the item costs and the
// thread count alone, never of timing.

#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace jtree_cpu {

// The threads of a call of `items` work items: `requested` (<= 0: one per hardware thread), no
// more than there are items, at least one.
inline int thread_count(int64_t requested, int64_t items) {
  const int64_t t = requested > 0 ? requested
                                  : std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::max<int64_t>(1, std::min(t, items)));
}

// Runs work(t) for t = 0 .. threads - 1, t = 0 on the calling thread, and returns when all are
// done.
template <typename Fn>
void run_on_threads(int threads, Fn work) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
}

}  // namespace jtree_cpu
