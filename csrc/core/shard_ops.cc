// Compiled with -ffp-contract=off (see CMakeLists.txt): a*b+c must round twice, as numpy does.
#include "hetpipe/shard_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace hetpipe {
namespace {

constexpr std::size_t kMinPerThread = std::size_t{1} << 18;  // 1 MiB of float32: below, a thread costs more than it saves
constexpr std::size_t kChunkAlign = 16;  // 64 bytes of float32: chunks never share a cache line
constexpr int kMaxThreads = 16;

void axpy(float* __restrict shard, const float* __restrict delta, std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) shard[i] = shard[i] + scale * delta[i];
}

void axpy_divided(float* __restrict shard, const float* __restrict delta, std::size_t n, float divisor) {
  for (std::size_t i = 0; i < n; ++i) shard[i] = shard[i] + delta[i] / divisor;
}

void divide(float* x, std::size_t n, float divisor) {
  for (std::size_t i = 0; i < n; ++i) x[i] = x[i] / divisor;
}

void nesterov(float* __restrict shard, float* __restrict momentum, float* __restrict aggregated, std::size_t n,
              float lr, float mu) {
  for (std::size_t i = 0; i < n; ++i) {
    const float g = -aggregated[i];
    const float m = mu * momentum[i] + g;
    momentum[i] = m;
    const float step = mu * m + g;
    shard[i] = shard[i] - lr * step;
    aggregated[i] = 0.0f;
  }
}

void delayed_momentum(float* __restrict shard, float* __restrict momentum, float* __restrict accumulated,
                      std::size_t n, float lr, float mu) {
  for (std::size_t i = 0; i < n; ++i) {
    const float m = mu * momentum[i] - accumulated[i];
    momentum[i] = m;
    shard[i] = shard[i] - lr * (mu * m);
    accumulated[i] = 0.0f;
  }
}

void change(float* __restrict delta, const float* after, const float* before, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) delta[i] = delta[i] + (after[i] - before[i]);
}

// shard and delta are the same buffer.
void axpy_self(float* shard, std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) shard[i] = shard[i] + scale * shard[i];
}

bool overlap(const void* a, const void* b, std::size_t nbytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + nbytes && y < x + nbytes;
}

// Runs body(begin, end) over a static split of [0, n) into `threads` chunks; chunk 0 on the caller.
template <class Body>
void split(std::size_t n, int threads, Body body) {
  if (threads <= 1) {
    body(std::size_t{0}, n);
    return;
  }
  std::size_t chunk = (n + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
  chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(threads) - 1);
  for (int t = 1; t < threads; ++t) {
    const std::size_t begin = std::min(n, chunk * static_cast<std::size_t>(t));
    const std::size_t end = std::min(n, begin + chunk);
    if (begin < end) workers.emplace_back([=] { body(begin, end); });
  }
  body(std::size_t{0}, std::min(n, chunk));
  for (auto& w : workers) w.join();
}

}  // namespace

int shard_threads(int num_threads, std::size_t n) noexcept {
  int threads = num_threads;
  if (threads <= 0) {
    threads = static_cast<int>(std::thread::hardware_concurrency());
    threads = std::min(std::max(threads, 1), kMaxThreads);
  }
  const std::size_t by_size = std::max<std::size_t>(1, n / kMinPerThread);
  return static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), by_size));
}

void apply_delta(float* shard, const float* delta, std::size_t n, float scale, int num_threads) {
  if (n == 0) return;
  const bool same = shard == delta;
  if (!same && overlap(shard, delta, n * sizeof(float))) {
    throw std::invalid_argument("apply_delta: shard and delta overlap (and are not the same buffer)");
  }
  split(n, shard_threads(num_threads, n), [=](std::size_t begin, std::size_t end) {
    if (same) {
      axpy_self(shard + begin, end - begin, scale);
    } else {
      axpy(shard + begin, delta + begin, end - begin, scale);
    }
  });
}

void apply_delta_divided(float* shard, const float* delta, std::size_t n, float divisor, int num_threads) {
  if (n == 0) return;
  if (overlap(shard, delta, n * sizeof(float))) {
    throw std::invalid_argument("apply_delta_divided: shard and delta overlap");
  }
  split(n, shard_threads(num_threads, n), [=](std::size_t begin, std::size_t end) {
    axpy_divided(shard + begin, delta + begin, end - begin, divisor);
  });
}

void divide_in_place(float* x, std::size_t n, float divisor, int num_threads) {
  if (n == 0) return;
  split(n, shard_threads(num_threads, n), [=](std::size_t begin, std::size_t end) {
    divide(x + begin, end - begin, divisor);
  });
}

void outer_nesterov(float* shard, float* momentum, float* aggregated, std::size_t n, float lr, float mu,
                    int num_threads) {
  if (n == 0) return;
  const std::size_t nbytes = n * sizeof(float);
  if (overlap(shard, momentum, nbytes) || overlap(shard, aggregated, nbytes) || overlap(momentum, aggregated, nbytes)) {
    throw std::invalid_argument("outer_nesterov: shard, momentum and aggregated overlap");
  }
  split(n, shard_threads(num_threads, n), [=](std::size_t begin, std::size_t end) {
    nesterov(shard + begin, momentum + begin, aggregated + begin, end - begin, lr, mu);
  });
}

void outer_delayed_momentum(float* shard, float* momentum, float* accumulated, std::size_t n, float lr, float mu,
                            int num_threads) {
  if (n == 0) return;
  const std::size_t nbytes = n * sizeof(float);
  if (overlap(shard, momentum, nbytes) || overlap(shard, accumulated, nbytes) ||
      overlap(momentum, accumulated, nbytes)) {
    throw std::invalid_argument("outer_delayed_momentum: shard, momentum and accumulated overlap");
  }
  split(n, shard_threads(num_threads, n), [=](std::size_t begin, std::size_t end) {
    delayed_momentum(shard + begin, momentum + begin, accumulated + begin, end - begin, lr, mu);
  });
}

void accumulate_change(float* delta, const float* after, const float* before, std::size_t n, int num_threads) {
  if (n == 0) return;
  const std::size_t nbytes = n * sizeof(float);
  if (overlap(delta, after, nbytes) || overlap(delta, before, nbytes)) {
    throw std::invalid_argument("accumulate_change: delta overlaps after or before");
  }
  split(n, shard_threads(num_threads, n), [=](std::size_t begin, std::size_t end) {
    change(delta + begin, after + begin, before + begin, end - begin);
  });
}

void average_buffers(float* b, const float* const* pushed, std::size_t count, std::size_t n) {
  const float divisor = static_cast<float>(count);
  for (std::size_t i = 0; i < n; ++i) {
    float change = 0.0f;
    for (std::size_t k = 0; k < count; ++k) change = change + (pushed[k][i] - b[i]);
    b[i] = b[i] + change / divisor;
  }
}

void snapshot(const void* shard, void* out, std::size_t nbytes, int num_threads) {
  if (nbytes == 0) return;
  if (overlap(shard, out, nbytes)) throw std::invalid_argument("snapshot: shard and out overlap");
  const auto* src = static_cast<const unsigned char*>(shard);
  auto* dst = static_cast<unsigned char*>(out);
  split(nbytes, shard_threads(num_threads, nbytes / sizeof(float)), [=](std::size_t begin, std::size_t end) {
    std::memcpy(dst + begin, src + begin, end - begin);
  });
}

}  // namespace hetpipe
