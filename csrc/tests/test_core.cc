// Multithreaded checks of the core without the GIL in the way: the pool never hands one slot to two
// owners and its free count stays in range under contention, the ClockTable loses no update and its
// global clock never goes back, waiters respect the bound, CPU streams keep their order, and a task
// that fails surfaces as an exception (never std::terminate). Run plain and under ThreadSanitizer
// (HETPIPE_SANITIZE=thread), where every data race these threads could hit is reported.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "hetpipe/buffer_pool.h"
#include "hetpipe/clock_bench.h"
#include "hetpipe/clock_table.h"
#include "hetpipe/errors.h"
#include "hetpipe/shard_ops.h"
#include "hetpipe/shard_plane.h"
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

// Runs body(t) on `threads` threads until `seconds` passed (each checks the flag between rounds).
template <class Body>
void for_a_while(int threads, double seconds, Body body) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      while (!stop.load(std::memory_order_relaxed)) body(t);
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop.store(true);
  for (auto& th : pool) th.join();
}

// available() is read while six threads acquire and release: it must stay in [0, num_slots]. The
// old protocol (counter updated after the stack operation) returned 2^64 - 1 here within milliseconds.
void pool_available_stays_in_range() {
  constexpr std::size_t kSlots = 4;
  auto pool = hetpipe::PinnedBufferPool::create(kSlots, 64);
  std::atomic<long> out_of_range{0};
  std::atomic<long> reads{0};
  std::atomic<long> cycles{0};
  for_a_while(7, 0.4, [&](int t) {
    if (t == 0) {
      for (int i = 0; i < 256; ++i) {
        if (pool->available() > kSlots) out_of_range.fetch_add(1);
      }
      reads.fetch_add(256);
      return;
    }
    if (auto s = pool->try_acquire(8, std::chrono::milliseconds(5))) {
      pool->release(*s);
      cycles.fetch_add(1);
    }
  });
  CHECK(out_of_range.load() == 0);
  CHECK(reads.load() > 0 && cycles.load() > 0);
  CHECK(pool->available() == kSlots);
}

// Blocked acquirers are woken by releases (no lost wake-up): more threads than slots, each holding a
// slot briefly, all finish their rounds; closing wakes the ones still waiting.
void pool_blocking_handoff() {
  auto pool = hetpipe::PinnedBufferPool::create(2, 64);
  std::atomic<int> rounds{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 300; ++i) {
        hetpipe::Slot s = pool->acquire(8, 30.0);
        std::this_thread::yield();
        pool->release(s);
        rounds.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(rounds.load() == 6 * 300);
  hetpipe::Slot a = pool->acquire(0, 0), b = pool->acquire(0, 0);
  std::atomic<bool> woke_with_error{false};
  std::thread blocked([&] {
    try {
      pool->acquire(0, 30.0);
    } catch (const std::runtime_error&) {
      woke_with_error = true;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  pool->close();
  blocked.join();
  CHECK(woke_with_error.load());
  pool->release(a);
  pool->release(b);
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

// A pool of two size classes under contention: threads asking for small payloads and threads
// asking for large ones never share a slot, a large request never gets a small slot, and small
// requests spill into the large class only while the small one is in use; every slot comes back.
void pool_classes_under_contention() {
  auto pool = hetpipe::PinnedBufferPool::create({{4, 64}, {2, 4096}});
  CHECK(pool->num_slots() == 6 && pool->slot_bytes() == 4096 && pool->classes().size() == 2);
  std::vector<std::atomic<int>> owner(6);
  std::atomic<int> violations{0};
  std::vector<std::thread> threads;
  for (int t = 1; t <= 6; ++t) {
    threads.emplace_back([&, t] {
      const std::size_t want = t % 2 ? 32 : 4000;
      for (int i = 0; i < 5000; ++i) {
        hetpipe::Slot s = pool->acquire(want, 10.0);
        int expected = 0;
        if (!owner[s.index].compare_exchange_strong(expected, t)) violations.fetch_add(1);
        if (s.nbytes() < want) violations.fetch_add(1);
        std::memset(s.data(), t, want);
        if (static_cast<unsigned char*>(s.data())[want - 1] != t) violations.fetch_add(1);
        owner[s.index].store(0);
        pool->release(s);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(violations.load() == 0);
  CHECK(pool->available() == 6);
  std::vector<hetpipe::Slot> small;
  for (int i = 0; i < 4; ++i) small.push_back(pool->acquire(8, 0));
  for (const auto& s : small) CHECK(s.nbytes() == 64);
  hetpipe::Slot spilled = pool->acquire(8, 0);
  CHECK(spilled.nbytes() == 4096);
  for (const auto& s : small) pool->release(s);
  pool->release(spilled);
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

// Readers see each VW's clock and the global clock only grow, and the global clock never exceeds a
// clock read after it, while advancers and a remove() run concurrently.
void clock_monotonic_under_contention() {
  constexpr int kVws = 3;
  hetpipe::ClockTable table(kVws);
  std::atomic<long> violations{0};
  std::atomic<bool> removed{false};
  for_a_while(5, 0.3, [&](int t) {
    if (t < 2) {
      for (int vw = 0; vw < kVws; ++vw) {
        if (vw == 2 && removed.load()) continue;
        try {
          table.advance(vw);
        } catch (const std::invalid_argument&) {
          // vw 2 was removed between the flag check and the advance
        }
      }
      return;
    }
    if (t == 2) {
      if (table.clock(0) > 1000 && !removed.exchange(true)) table.remove(2);
      std::this_thread::yield();
      return;
    }
    std::int64_t last_global = 0;
    std::vector<std::int64_t> last(kVws, 0);
    for (int i = 0; i < 200; ++i) {
      const std::int64_t g = table.global_clock();
      if (g < last_global) violations.fetch_add(1);
      last_global = g;
      for (int vw = 0; vw < kVws; ++vw) {
        const std::int64_t c = table.clock(vw);
        if (c < last[vw] || (table.active(vw) && c < g)) violations.fetch_add(1);
        last[vw] = c;
      }
    }
  });
  CHECK(violations.load() == 0);
  std::int64_t expected = table.clock(0);
  for (int vw = 1; vw < kVws; ++vw) {
    if (table.active(vw)) expected = std::min(expected, table.clock(vw));
  }
  CHECK(removed.load() && !table.active(2));
  CHECK(table.global_clock() == expected);
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

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const hetpipe::StreamError& e) {
    return e.what();
  }
  return "";
}

// A task that throws fails its stream: later tasks do not run, the stream and the events recorded
// at or after the failure raise StreamError, a stream waiting on such an event fails in turn, and
// points recorded before the failure still complete normally. Nothing calls std::terminate.
void cpu_stream_task_failure() {
  std::vector<unsigned char> src(4096, 3), dst(4096, 0);
  hetpipe::Stream a, b;
  hetpipe::Event before, after;
  a.copy_async(dst.data(), src.data(), 16);
  before.record(a);
  a.launch_host_func([] { throw std::runtime_error("boom in a host function"); });
  a.copy_async(dst.data() + 100, src.data(), 16);  // after the failure: never runs
  after.record(a);
  b.wait_for(after);
  const std::string sync = error_of([&] { a.synchronize(); });
  CHECK(sync.find("boom in a host function") != std::string::npos);
  CHECK(error_of([&] { (void)a.query(); }) == sync);
  before.synchronize();
  CHECK(before.query() && dst[0] == 3);
  CHECK(dst[100] == 0);
  CHECK(error_of([&] { after.synchronize(); }) == sync);
  CHECK(error_of([&] { b.synchronize(); }) == sync);  // the wait on a failed point failed b
  CHECK(error_of([&] { b.close(); }) == sync);
  CHECK(error_of([&] { a.close(); }) == sync);
  CHECK(a.closed());
  a.close();  // idempotent, and only the closing call reports
  {
    hetpipe::Stream c;  // never synchronised: its destructor meets the failure and must not throw
    c.launch_host_func([] { throw 42; });
  }
  bool closed_error = false;
  try {
    a.copy_async(dst.data(), src.data(), 16);
  } catch (const std::logic_error&) {
    closed_error = true;
  }
  CHECK(closed_error);
}

// A CPU stream takes handle 0 (a host framework's null stream or event) as complete and refuses any
// CUDA handle with an error naming it; a closed stream refuses both.
void cpu_stream_wait_external() {
  hetpipe::Stream s;
  std::vector<unsigned char> src(64, 5), dst(64, 0);
  s.wait_external(0, hetpipe::ExternalKind::kStream);
  s.wait_external(0, hetpipe::ExternalKind::kEvent);
  s.copy_async(dst.data(), src.data(), src.size());
  s.synchronize();
  CHECK(dst[63] == 5);
  for (const auto kind : {hetpipe::ExternalKind::kStream, hetpipe::ExternalKind::kEvent}) {
    std::string message;
    try {
      s.wait_external(0x7f00, kind);
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    CHECK(message.find("a CPU stream cannot wait on CUDA") != std::string::npos);
    CHECK(message.find("0x7f00") != std::string::npos);
  }
  s.close();
  bool closed_error = false;
  try {
    s.wait_external(0, hetpipe::ExternalKind::kStream);
  } catch (const std::logic_error&) {
    closed_error = true;
  }
  CHECK(closed_error);
}

// Events re-recorded on two streams while other threads wait on them, query them and make a third
// stream wait for them: no race on an event's point (checked by ThreadSanitizer), every wait ends.
void events_record_while_waiting() {
  hetpipe::Stream s0, s1, waiter;
  hetpipe::Event e;
  std::atomic<long> waits{0};
  for_a_while(4, 0.3, [&](int t) {
    if (t == 0) {
      s0.enqueue_sleep(1e-5);
      e.record(s0);
      s0.synchronize();  // keeps the queue short
    } else if (t == 1) {
      s1.enqueue_sleep(1e-5);
      e.record(s1);
      s1.synchronize();
    } else if (t == 2) {
      e.synchronize();
      (void)e.query();
      waits.fetch_add(1);
    } else {
      waiter.wait_for(e);
      waiter.synchronize();
      waits.fetch_add(1);
    }
  });
  CHECK(waits.load() > 0);
  s0.synchronize();
  s1.synchronize();
  CHECK(e.query());
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

// The outer Nesterov step, delayed Nesterov's momentum step and the in-place division split across threads
// as apply_delta does: the result is bitwise that of one thread, and the aggregated delta is left zeroed.
void outer_nesterov_thread_invariant() {
  const std::size_t n = (1 << 20) + 13;
  std::vector<float> w(n), m(n), a(n);
  for (std::size_t i = 0; i < n; ++i) {
    w[i] = static_cast<float>(i % 1000) * 0.001f;
    m[i] = static_cast<float>((i * 5) % 991) * 0.01f - 4.0f;
    a[i] = static_cast<float>((i * 7) % 997) * -0.37f;
  }
  std::vector<float> w1 = w, m1 = m, a1 = a, w4 = w, m4 = m, a4 = a;
  hetpipe::divide_in_place(a1.data(), n, 3.0f, 1);
  hetpipe::divide_in_place(a4.data(), n, 3.0f, 4);
  CHECK(std::memcmp(a1.data(), a4.data(), n * sizeof(float)) == 0);
  hetpipe::outer_nesterov(w1.data(), m1.data(), a1.data(), n, 0.7f, 0.9f, 1);
  hetpipe::outer_nesterov(w4.data(), m4.data(), a4.data(), n, 0.7f, 0.9f, 4);
  CHECK(std::memcmp(w1.data(), w4.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(m1.data(), m4.data(), n * sizeof(float)) == 0);
  CHECK(std::all_of(a4.begin(), a4.end(), [](float x) { return x == 0.0f; }));
  CHECK(std::memcmp(w1.data(), w.data(), n * sizeof(float)) != 0);
  std::vector<float> wd1 = w, md1 = m, ad1 = a, wd4 = w, md4 = m, ad4 = a;
  hetpipe::outer_delayed_momentum(wd1.data(), md1.data(), ad1.data(), n, 0.7f, 0.9f, 1);
  hetpipe::outer_delayed_momentum(wd4.data(), md4.data(), ad4.data(), n, 0.7f, 0.9f, 4);
  CHECK(std::memcmp(wd1.data(), wd4.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(md1.data(), md4.data(), n * sizeof(float)) == 0);
  CHECK(std::all_of(ad4.begin(), ad4.end(), [](float x) { return x == 0.0f; }));
  CHECK(std::memcmp(wd1.data(), w.data(), n * sizeof(float)) != 0);
}

// One thread per stage (2 VWs x 2 stages, D = 1) pulls wave w, then pushes its wave-w delta: the
// final weights (and the outer momentum, with nesterov) equal a single thread's pushes in canonical
// order bit for bit (waves are applied in VW order whatever the interleaving), and every pull saw at
// least w - D applied waves.
void shard_plane_concurrent_equals_sequential_with(const hetpipe::ShardPlaneOptions& options) {
  const std::vector<std::size_t> numels{3000, 5000, 700};
  const std::vector<std::vector<std::vector<int>>> stages{{{0, 1}, {2}}, {{0}, {1, 2}}};
  constexpr int kWaves = 60;
  constexpr std::int64_t kD = 1;
  auto delta_of = [&](int vw, int stage, int wave, std::size_t n) {
    std::vector<float> d(n);
    for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<float>((vw * 31 + stage * 7 + wave * 3 + i) % 97) * 1e-3f - 0.05f;
    return d;
  };
  hetpipe::ShardPlane sequential(numels, stages, kD, 1, options), concurrent(numels, stages, kD, 2, options);
  for (int wave = 0; wave < kWaves; ++wave) {
    for (int vw = 0; vw < 2; ++vw) {
      for (int stage = 0; stage < 2; ++stage) {
        const auto d = delta_of(vw, stage, wave, sequential.stage_numel(vw, stage));
        sequential.push(vw, stage, wave, d.data(), d.size());
      }
    }
  }
  std::atomic<int> violations{0};
  std::vector<std::thread> threads;
  for (int vw = 0; vw < 2; ++vw) {
    for (int stage = 0; stage < 2; ++stage) {
      threads.emplace_back([&, vw, stage] {
        std::vector<float> pulled(concurrent.stage_numel(vw, stage));
        for (int wave = 0; wave < kWaves; ++wave) {
          const std::int64_t a = concurrent.pull_for(vw, stage, wave, pulled.data(), pulled.size(), std::chrono::seconds(30));
          if (a < wave - kD) violations.fetch_add(1);
          const auto d = delta_of(vw, stage, wave, pulled.size());
          concurrent.push(vw, stage, wave, d.data(), d.size());
        }
      });
    }
  }
  for (auto& th : threads) th.join();
  CHECK(violations.load() == 0);
  CHECK(concurrent.applied() == kWaves && sequential.applied() == kWaves);
  for (int l = 0; l < 3; ++l) {
    CHECK(std::memcmp(concurrent.weights(l), sequential.weights(l), numels[l] * sizeof(float)) == 0);
    CHECK(concurrent.momentum_numel(l) == (options.outer.has_momentum() ? numels[l] : 0));
    CHECK(std::memcmp(concurrent.momentum(l), sequential.momentum(l), concurrent.momentum_numel(l) * sizeof(float)) ==
          0);
    CHECK(std::memcmp(concurrent.aggregated(l), sequential.aggregated(l),
                      concurrent.aggregated_numel(l) * sizeof(float)) == 0);
    CHECK(concurrent.outer_count(l) == sequential.outer_count(l));
  }
  bool duplicate = false;
  try {
    const auto d = delta_of(0, 0, 0, concurrent.stage_numel(0, 0));
    concurrent.push(0, 0, 0, d.data(), d.size());
  } catch (const std::invalid_argument&) {
    duplicate = true;
  }
  CHECK(duplicate);
}

void shard_plane_concurrent_equals_sequential() { shard_plane_concurrent_equals_sequential_with({}); }

void shard_plane_nesterov_concurrent_equals_sequential() {
  hetpipe::ShardPlaneOptions options;
  options.mean = true;
  options.outer.rule = hetpipe::OuterRule::kNesterov;
  options.outer.lr = 0.7f;
  options.outer.momentum = 0.9f;
  shard_plane_concurrent_equals_sequential_with(options);
}

// Delayed Nesterov with a momentum step every 3 pushes of a layer (2 VWs: the windows straddle waves)
// and the sqrt gain. (No staleness decay: the sequential plane's pushes never lag, the concurrent one's do.)
void shard_plane_delayed_nesterov_concurrent_equals_sequential() {
  hetpipe::ShardPlaneOptions options;
  options.outer.rule = hetpipe::OuterRule::kDelayedNesterov;
  options.outer.lr = 0.6f;
  options.outer.momentum = 0.8f;
  options.outer.delay = 3;
  options.outer.sqrt_gain = true;
  shard_plane_concurrent_equals_sequential_with(options);
}

// The shape of the MPI service (csrc/mpi/shard_service.h) without MPI: one receiver thread per stage
// writes each push into begin_push's buffer and ends it, one applier thread applies, a boundary thread
// holds the applier at every wave and compares the weights and synced buffers with a sequential plane's
// at that wave, and pullers are served as the staleness bound allows. Mean aggregate, synced buffers
// and a replica slice: the concurrent plane must equal the sequential one bit for bit.
void shard_plane_two_phase_with_holds() {
  const std::vector<std::size_t> numels{4000, 300, 0};
  hetpipe::ShardPlaneOptions options;
  options.buffer_numels = {0, 6, 8};
  options.mean = true;
  options.replicas = {{{}, {{0, 100, 50}}}, {{}, {}}};  // VW 0 stage 1 pulls a slice of layer 0
  const std::vector<std::vector<std::vector<int>>> stages{{{0}, {1, 2}}, {{0, 1, 2}, {}}};
  constexpr int kWaves = 30;
  constexpr std::int64_t kD = 1;
  auto delta_of = [](int vw, int stage, int wave, std::size_t n) {
    std::vector<float> d(n);
    for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<float>((vw * 13 + stage * 5 + wave * 7 + i) % 89) * 1e-3f - 0.04f;
    return d;
  };
  const std::vector<std::pair<int, int>> pushers{{0, 0}, {0, 1}, {1, 0}};
  hetpipe::ShardPlane sequential(numels, stages, kD, 1, options), concurrent(numels, stages, kD, 2, options);
  std::vector<std::vector<float>> at_wave;  // layer 0's weights then layers 1, 2's buffers, after each wave
  auto state_of = [&](hetpipe::ShardPlane& p) {
    std::vector<float> v(p.weights(0), p.weights(0) + numels[0]);
    for (int l = 1; l < 3; ++l) v.insert(v.end(), p.buffers(l), p.buffers(l) + p.buffer_numel(l));
    return v;
  };
  at_wave.push_back(state_of(sequential));
  for (int wave = 0; wave < kWaves; ++wave) {
    for (const auto& [vw, stage] : pushers) {
      const auto d = delta_of(vw, stage, wave, sequential.stage_numel(vw, stage));
      sequential.push(vw, stage, wave, d.data(), d.size());
    }
    at_wave.push_back(state_of(sequential));
  }
  concurrent.set_hold(true);
  std::atomic<bool> done{false};
  std::atomic<int> violations{0}, boundaries{0};
  std::thread applier([&] {
    while (!done.load()) {
      if (concurrent.apply_ready() == 0) std::this_thread::yield();
    }
  });
  std::thread boundary([&] {
    for (std::int64_t next = 1; next <= kWaves;) {
      const std::int64_t held = concurrent.held();
      if (held < 0) {
        std::this_thread::yield();
        continue;
      }
      if (held != next || state_of(concurrent) != at_wave[static_cast<std::size_t>(held)]) violations.fetch_add(1);
      boundaries.fetch_add(1);
      concurrent.release(held);
      next = held + 1;
    }
  });
  std::vector<std::thread> receivers;
  for (const auto& [vw, stage] : pushers) {
    receivers.emplace_back([&, vw = vw, stage = stage] {
      std::vector<float> reply(concurrent.reply_numel(vw, stage));
      for (int wave = 0; wave < kWaves; ++wave) {
        while (concurrent.applied() < wave - kD) std::this_thread::yield();
        if (concurrent.serve(vw, stage, wave, reply.data(), reply.size()) < wave - kD) violations.fetch_add(1);
        const auto d = delta_of(vw, stage, wave, reply.size() - (vw == 0 && stage == 1 ? 50 : 0));
        float* into = concurrent.begin_push(vw, stage, wave, d.size());
        std::memcpy(into, d.data(), d.size() * sizeof(float));
        concurrent.end_push(vw, stage, wave);
      }
    });
  }
  for (auto& th : receivers) th.join();
  boundary.join();
  done.store(true);
  applier.join();
  CHECK(violations.load() == 0);
  CHECK(boundaries.load() == kWaves);
  CHECK(concurrent.applied() == kWaves);
  CHECK(state_of(concurrent) == at_wave.back());
  CHECK(concurrent.log().applied == sequential.log().applied);
  CHECK(concurrent.log().pulls.size() == static_cast<std::size_t>(3 * kWaves));
}

// Runs one check and prints its wall time (the sanitizer build is several times slower).
void run(const char* name, void (*check)()) {
  const auto start = std::chrono::steady_clock::now();
  check();
  std::printf("%-44s %.2f s\n", name,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace

int main() {
  run("pool_exclusive_ownership", pool_exclusive_ownership);
  run("pool_available_stays_in_range", pool_available_stays_in_range);
  run("pool_blocking_handoff", pool_blocking_handoff);
  run("pool_errors", pool_errors);
  run("pool_classes_under_contention", pool_classes_under_contention);
  run("clock_no_lost_update_and_bound", clock_no_lost_update_and_bound);
  run("clock_monotonic_under_contention", clock_monotonic_under_contention);
  run("cpu_stream_order", cpu_stream_order);
  run("cpu_stream_task_failure", cpu_stream_task_failure);
  run("cpu_stream_wait_external", cpu_stream_wait_external);
  run("events_record_while_waiting", events_record_while_waiting);
  run("apply_delta_thread_invariant", apply_delta_thread_invariant);
  run("shard_plane_two_phase_with_holds", shard_plane_two_phase_with_holds);
  run("shard_plane_concurrent_equals_sequential", shard_plane_concurrent_equals_sequential);
  run("outer_nesterov_thread_invariant", outer_nesterov_thread_invariant);
  run("shard_plane_nesterov_concurrent_equals_sequential", shard_plane_nesterov_concurrent_equals_sequential);
  run("shard_plane_delayed_nesterov_concurrent_equals_sequential",
      shard_plane_delayed_nesterov_concurrent_equals_sequential);
  if (g_failures != 0) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return EXIT_FAILURE;
  }
  std::printf("all core checks passed\n");
  return EXIT_SUCCESS;
}
