// Work sharing for the C++ CPU kernels (linear_cpu.cc, ragged_paged_attention_cpu.cc) over
// XLA's intra-op thread pool. cpu_build.py's cache key covers the headers a kernel source
// includes from this folder.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ksana_cpu_pool {

// Calls run(i) for every i in [0, n) on the caller and up to n - 1 of the pool's threads,
// each thread claiming the next unclaimed i, and returns when all have finished. A pool task
// may start only after the caller has returned: it then finds no item left (the count lives
// in `state`, which it co-owns) and touches nothing else -- run, which may refer to the
// caller's data, is called only for claimed items, all of which finish before the return.
template <typename Run>
void run_on_pool(xla::ffi::ThreadPool& pool, int64_t n, Run run) {
  struct State {
    State(int64_t count, Run f) : num_items(count), run(std::move(f)) {}
    const int64_t num_items;
    const Run run;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
  };
  auto state = std::make_shared<State>(n, std::move(run));
  auto worker = [state]() {
    state->active.fetch_add(1);
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= state->num_items) break;
      state->run(i);
    }
    state->active.fetch_sub(1);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = worker;  // Schedule takes its task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  worker();
  // Every item is claimed; wait for the ones still running.
  while (state->active.load() != 0) std::this_thread::yield();
}

}  // namespace ksana_cpu_pool
