// Work sharing for the C++ CPU kernels (linear_cpu.cc, ragged_paged_attention_cpu.cc).
// cpu_build.py's cache key covers the headers a kernel source includes from this folder.
//
// A batch-1 decode step calls the linear kernel ~120 times, 10-100 us each, with a few
// microseconds of other thunks between them. A sleeping thread takes tens of microseconds to
// wake (a futex wake, in a VM an inter-processor interrupt), so work handed to XLA's intra-op
// pool started late on every call. The kernels' own pool (SpinPool) keeps its threads
// spinning for KSANA_JAX_CPU_SPIN_US (default 300) after a call that asks for it, so the next
// call of the step finds them awake, then they sleep. A call followed by XLA's own
// multithreaded work (attention between XLA's dots at many rows) does not ask: a spinning
// thread would take a core from XLA's. The attention kernel asks only when it finds the pool
// awake (SpinPool::awake: a product before it asked), and then even its small steps share
// the pool. KSANA_JAX_CPU_SPIN_US=0 hands all work to XLA's pool.
//
// One pool per process: SpinPool::get()'s static is a GNU unique symbol (g++ on ELF), which
// the dynamic linker binds to one instance across both kernels' libraries though ctypes
// loads them RTLD_LOCAL; both are built from this one header (cpu_build.py keys on it).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace ksana_cpu_pool {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Threads of this process's own, one fewer than the cores it may run on (the caller is the
// last). One call at a time: a call that finds the pool busy (XLA running two thunks at
// once) gets false from try_run and shares its work some other way.
class SpinPool {
 public:
  static SpinPool& get() {
    static SpinPool* pool = new SpinPool();  // never destroyed: its threads outlive main
    return *pool;
  }

  bool enabled() const { return spin_ns_ > 0 && !threads_.empty(); }

  // Whether the pool's threads are spinning (none asleep): a call handed to them now starts
  // within microseconds, not after a wake.
  bool awake() const { return enabled() && sleeping_.load(std::memory_order_relaxed) == 0; }

  // The threads a call runs on: the pool's and the caller.
  int64_t workers() const { return static_cast<int64_t>(threads_.size()) + 1; }

  // Calls fn(ctx, i) for every i in [0, n) on the caller and the pool's threads; returns
  // when all have finished. `spin`: the threads spin for the next call before sleeping.
  bool try_run(int64_t n, void (*fn)(void*, int64_t), void* ctx, bool spin) {
    std::unique_lock<std::mutex> call(call_mutex_, std::try_to_lock);
    if (!call.owns_lock()) return false;
    const uint64_t g = generation_.load(std::memory_order_relaxed) + 1;
    fn_ = fn, ctx_ = ctx;
    limit_.store(tag(g) | static_cast<uint64_t>(n), std::memory_order_relaxed);
    spin_.store(spin, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    next_.store(tag(g), std::memory_order_relaxed);
    generation_.store(g, std::memory_order_seq_cst);  // publishes the job
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(g);
    // Every item is claimed: wait for those still running, yielding between looks. A pool
    // thread the scheduler set aside for another (the engine's host thread, overlapping the
    // step with async scheduling) may hold the last item (a float32 product's run for
    // milliseconds): it can then have this core, not wait out this thread's time slice.
    for (int i = 1; finished_.load(std::memory_order_acquire) != n; ++i) {
      cpu_relax();
      if (i % 64 == 0) sched_yield();
    }
    return true;
  }

 private:
  SpinPool() {
    const char* env = std::getenv("KSANA_JAX_CPU_SPIN_US");
    spin_ns_ = 1000 * (env ? std::atoll(env) : 300);
    cpu_set_t cpus;
    int cores = std::thread::hardware_concurrency();
    if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) cores = CPU_COUNT(&cpus);
    if (spin_ns_ <= 0) return;
    for (int t = 1; t < cores; ++t) threads_.emplace_back([this] { loop(); });
    for (std::thread& thread : threads_) thread.detach();
  }

  // A claim on job g's items: g's low 32 bits above the item index, so a thread that saw
  // an older job claims nothing of a newer one. The item count is tagged the same way: a
  // thread still in job g that read the next job's count beside g's claim word (stored
  // before the next job's claim word) would claim an item past g's last -- the claim word
  // still g's, its compare-exchange succeeds -- and run the next job's item and count it
  // done a second time, so that job's caller waited for ever (seen: an engine hung after
  // ~10^6 products; tests/test_linear_cpu.py's pool stress ran items twice in seconds).
  static uint64_t tag(uint64_t g) { return (g & 0xffffffffu) << 32; }
  static constexpr uint64_t kIndex = 0xffffffffu;

  // Claims and runs job g's items until none is left.
  void work(uint64_t g) {
    uint64_t claim = next_.load(std::memory_order_relaxed);
    for (;;) {
      if ((claim & ~kIndex) != tag(g)) return;
      const uint64_t limit = limit_.load(std::memory_order_relaxed);
      if ((limit & ~kIndex) != tag(g) || (claim & kIndex) >= (limit & kIndex)) return;
      const int64_t i = static_cast<int64_t>(claim & kIndex);
      if (!next_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel)) continue;
      // Claimed an item of job g: g's caller waits for it, so fn_ and ctx_ are still g's.
      fn_(ctx_, i);
      finished_.fetch_add(1, std::memory_order_release);
      claim = next_.load(std::memory_order_relaxed);
    }
  }

  void loop() {
    pthread_setname_np(pthread_self(), "ksana-cpu-pool");  // as tests and profilers see it
    uint64_t seen = generation_.load();
    for (;;) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      const int64_t budget = spin_.load(std::memory_order_relaxed) ? spin_ns_ : 0;
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(budget);
      while (g == seen) {
        for (int i = 0; i < 64 && g == seen; ++i) {
          cpu_relax();
          g = generation_.load(std::memory_order_acquire);
        }
        // A thread waiting for this core (the engine's host work, overlapping the step with
        // async scheduling) runs now, not after the spin; alone, this returns at once.
        if (g == seen) sched_yield();
        if (g == seen && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleeping_.fetch_sub(1, std::memory_order_relaxed);
          g = generation_.load(std::memory_order_acquire);
        }
      }
      seen = g;
      work(g);
    }
  }

  int64_t spin_ns_ = 0;
  std::vector<std::thread> threads_;
  std::mutex call_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> finished_{0};
  std::atomic<int> sleeping_{0};
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint64_t> limit_{0};  // tag(g) | job g's item count
  std::atomic<bool> spin_{false};
};

// Calls run(i) for every i in [0, n) on the caller and other threads (SpinPool's, or up to
// n - 1 of XLA's pool's when it is off or busy), each thread claiming the next unclaimed i,
// and returns when all have finished; `spin` as SpinPool::try_run's. An XLA pool task may
// start only after the caller has returned: it then finds no item left (the count lives in
// `state`, which it co-owns) and touches nothing else -- run, which may refer to the
// caller's data, is called only for claimed items, all of which finish before the return.
template <typename Run>
void run_on_pool(xla::ffi::ThreadPool& pool, int64_t n, bool spin, Run run) {
  SpinPool& spin_pool = SpinPool::get();
  if (spin_pool.enabled()) {
    auto call = [](void* ctx, int64_t i) { (*static_cast<Run*>(ctx))(i); };
    if (spin_pool.try_run(n, call, &run, spin)) return;
  }
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
