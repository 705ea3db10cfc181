// Multithreaded checks of the core without the GIL in the way: the pool never hands one slot to two
// owners, the ClockTable loses no update, waiters respect the bound, CPU streams keep their order.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "hetpipe/buffer_pool.h"
#include "hetpipe/clock_bench.h"
#include "hetpipe/clock_table.h"
#include "hetpipe/errors.h"
#include "hetpipe/shard_ops.h"
#include "hetpipe/streams.h"

namespace {

int g_failures = 0;

#define CHECK(cond)                                                       \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                       \
    }                                                                     \
  } while (0)

void pool_exclusive_ownership() {
  auto pool = hetpipe::PinnedBufferPool::create(3, 64);
  std::vector<std::atomic<int>> owner(3);
  std::atomic<int> violations{0};
  std::vector<std::thread> threads;
  for (int t = 1; t <= 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        hetpipe::Slot s = pool->acquire(8, 10.0);
        int expected = 0;
        if (!owner[s.index].compare_exchange_strong(expected, t)) violations.fetch_add(1);
        std::memcpy(s.data(), &t, sizeof t);
        int back = 0;
        std::memcpy(&back, s.data(), sizeof back);
        if (back != t) violations.fetch_add(1);
        owner[s.index].store(0);
        pool->release(s);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(violations.load() == 0);
  CHECK(pool->available() == 3);
}

void pool_errors() {
  auto pool = hetpipe::PinnedBufferPool::create(1, 64);
  hetpipe::Slot s = pool->acquire(0, 0);
  bool timed_out = false;
  try {
    pool->acquire(0, 0.01);
  } catch (const hetpipe::TimeoutError&) {
    timed_out = true;
  }
  CHECK(timed_out);
  pool->release(s);
  bool double_release = false;
  try {
    pool->release(s);
  } catch (const std::invalid_argument&) {
    double_release = true;
  }
  CHECK(double_release);
}

void clock_no_lost_update_and_bound() {
  hetpipe::ClockTable table(4);
  std::atomic<int> violations{0};
  std::vector<std::thread> waiters;
  for (int w = 0; w < 4; ++w) {
    waiters.emplace_back([&] {
      for (std::int64_t wave = 0; wave < 2000; ++wave) {
        const std::int64_t g = table.wait_until(wave, 1, 30.0);
        if (g < wave - 1 || table.global_clock() < wave - 1) violations.fetch_add(1);
      }
    });
  }
  hetpipe::clock_stress(table, 8, 8000);
  for (auto& th : waiters) th.join();
  std::int64_t total = 0;
  for (int vw = 0; vw < 4; ++vw) total += table.clock(vw);
  CHECK(total == 8000);
  CHECK(violations.load() == 0);
}

void cpu_stream_order() {
  hetpipe::Stream a, b;
  CHECK(!a.is_cuda());
  std::vector<unsigned char> src(1 << 16, 7), mid(1 << 16, 0), dst(1 << 16, 0);
  hetpipe::Event e;
  a.enqueue_sleep(0.05);
  a.copy_async(mid.data(), src.data(), src.size());
  e.record(a);
  CHECK(!e.query());
  b.wait_for(e);
  b.copy_async(dst.data(), mid.data(), mid.size());
  b.synchronize();
  CHECK(e.query());
  CHECK(dst[0] == 7 && dst.back() == 7);
}

void apply_delta_thread_invariant() {
  const std::size_t n = (1 << 20) + 13;
  std::vector<float> a(n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i % 1000) * 0.001f;
    b[i] = static_cast<float>((i * 7) % 997) * -0.37f;
  }
  std::vector<float> one = a, many = a;
  hetpipe::apply_delta(one.data(), b.data(), n, 0.1f, 1);
  hetpipe::apply_delta(many.data(), b.data(), n, 0.1f, 4);
  CHECK(std::memcmp(one.data(), many.data(), n * sizeof(float)) == 0);
}

}  // namespace

int main() {
  pool_exclusive_ownership();
  pool_errors();
  clock_no_lost_update_and_bound();
  cpu_stream_order();
  apply_delta_thread_invariant();
  if (g_failures != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return EXIT_FAILURE;
  }
  std::printf("all core checks passed\n");
  return EXIT_SUCCESS;
}
