#include "hetpipe/clock_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace hetpipe {
namespace {

// Starts `threads` threads at once, runs body(t, count_t) and returns the wall seconds.
template <class Body>
double run_threads(int threads, std::int64_t ops, Body body) {
  if (threads < 1) throw std::invalid_argument("clock bench: threads must be >= 1, got " + std::to_string(threads));
  if (ops < 0) throw std::invalid_argument("clock bench: ops must be >= 0");
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    const std::int64_t count = ops / threads + (t < ops % threads ? 1 : 0);
    pool.emplace_back([&, t, count] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      body(t, count);
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The baseline: the same operations on counters behind one std::mutex.
class MutexClocks {
 public:
  explicit MutexClocks(int n) : clocks_(static_cast<std::size_t>(n), 0) {}
  std::int64_t advance(int vw) {
    std::lock_guard<std::mutex> lock(mutex_);
    return ++clocks_[static_cast<std::size_t>(vw)];
  }
  std::int64_t clock(int vw) {
    std::lock_guard<std::mutex> lock(mutex_);
    return clocks_[static_cast<std::size_t>(vw)];
  }
  std::int64_t global_clock() {
    std::lock_guard<std::mutex> lock(mutex_);
    return *std::min_element(clocks_.begin(), clocks_.end());
  }

 private:
  std::mutex mutex_;
  std::vector<std::int64_t> clocks_;
};

// Keeps a computed value alive so the loop is not optimised away.
std::atomic<std::int64_t> g_sink{0};

}  // namespace

ClockOp parse_clock_op(const std::string& name) {
  if (name == "advance") return ClockOp::advance;
  if (name == "clock") return ClockOp::clock;
  if (name == "global_clock") return ClockOp::global_clock;
  if (name == "wait_check") return ClockOp::wait_check;
  throw std::invalid_argument("unknown clock op '" + name + "' (advance, clock, global_clock, wait_check)");
}

double clock_bench(ClockTable& table, ClockOp op, int threads, std::int64_t ops) {
  const int n = table.num_vws();
  return run_threads(threads, ops, [&](int t, std::int64_t count) {
    const int vw = t % n;
    std::int64_t acc = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      switch (op) {
        case ClockOp::advance: acc += table.advance(vw); break;
        case ClockOp::clock: acc += table.clock(vw); break;
        case ClockOp::global_clock: acc += table.global_clock(); break;
        case ClockOp::wait_check:
          acc += *table.wait_until_for(0, 0, std::chrono::nanoseconds::zero());
          break;
      }
    }
    g_sink.fetch_add(acc, std::memory_order_relaxed);
  });
}

double mutex_clock_bench(int num_vws, ClockOp op, int threads, std::int64_t ops) {
  if (num_vws < 1) throw std::invalid_argument("mutex_clock_bench: num_vws must be >= 1");
  MutexClocks clocks(num_vws);
  return run_threads(threads, ops, [&](int t, std::int64_t count) {
    const int vw = t % num_vws;
    std::int64_t acc = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      switch (op) {
        case ClockOp::advance: acc += clocks.advance(vw); break;
        case ClockOp::clock: acc += clocks.clock(vw); break;
        case ClockOp::global_clock: acc += clocks.global_clock(); break;
        case ClockOp::wait_check: acc += clocks.global_clock() >= 0 ? 1 : 0; break;
      }
    }
    g_sink.fetch_add(acc, std::memory_order_relaxed);
  });
}

double clock_stress(ClockTable& table, int threads, std::int64_t ops) {
  const int n = table.num_vws();
  return run_threads(threads, ops, [&](int t, std::int64_t count) {
    for (std::int64_t i = 0; i < count; ++i) table.advance(static_cast<int>((t + i) % n));
  });
}

}  // namespace hetpipe
