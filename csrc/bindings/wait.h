// Blocking waits from Python: the GIL is released while waiting, and the wait is cut into short
// chunks so that a signal (Ctrl-C) raises KeyboardInterrupt instead of hanging the interpreter.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace hetpipe::bindings {

// Calls attempt(chunk) with the GIL released until it returns a value or `timeout_seconds` (none:
// forever) has passed; nullopt on timeout. attempt(wait) must block at most about `wait`.
template <class Attempt>
auto wait_interruptible(std::optional<double> timeout_seconds, Attempt attempt)
    -> decltype(attempt(std::chrono::nanoseconds{})) {
  using clock = std::chrono::steady_clock;
  constexpr std::chrono::nanoseconds kChunk = std::chrono::milliseconds(50);
  const auto start = clock::now();
  const auto total = timeout_seconds
                         ? std::chrono::nanoseconds(static_cast<std::int64_t>(std::max(0.0, *timeout_seconds) * 1e9))
                         : std::chrono::nanoseconds::max();
  for (;;) {
    const auto elapsed = clock::now() - start;
    const auto left = total == std::chrono::nanoseconds::max() ? kChunk : total - elapsed;
    const auto chunk = std::max(std::chrono::nanoseconds::zero(), std::min(kChunk, left));
    decltype(attempt(chunk)) result;
    {
      pybind11::gil_scoped_release release;
      result = attempt(chunk);
    }
    if (result || (total != std::chrono::nanoseconds::max() && clock::now() - start >= total)) return result;
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

}  // namespace hetpipe::bindings
