// Internal: the blocking slow path shared by PinnedBufferPool and ClockTable.
//
// Both keep a lock-free fast path and let a thread that must wait sleep on a condition variable.
// The protocol (stated once here, relied on by both): a waiter increments its object's waiter count
// (seq_cst) while holding the mutex, then re-checks its condition; an updater changes the state
// first, reads the waiter count (seq_cst) after, and notifies through notify_under() only when the
// count is non-zero. In the single total order of seq_cst operations either the waiter sees the new
// state or the updater sees the waiter, so no wake-up is lost and the fast path takes no lock.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace hetpipe::detail {

// Registers a waiter for the lifetime of the object; the caller holds the object's mutex.
class WaiterRegistration {
 public:
  explicit WaiterRegistration(std::atomic<int>& count) : count_(count) {
    count_.fetch_add(1, std::memory_order_seq_cst);
  }
  ~WaiterRegistration() { count_.fetch_sub(1, std::memory_order_seq_cst); }
  WaiterRegistration(const WaiterRegistration&) = delete;
  WaiterRegistration& operator=(const WaiterRegistration&) = delete;

 private:
  std::atomic<int>& count_;
};

// Wakes every waiter. Taking the mutex orders the notification after any waiter's check-then-sleep.
inline void notify_under(std::mutex& mutex, std::condition_variable& cv) {
  { std::lock_guard<std::mutex> lock(mutex); }
  cv.notify_all();
}

// A timeout in seconds as a duration; negative means "wait forever" (a span no deadline overflows).
inline std::chrono::nanoseconds timeout_from_seconds(double seconds) {
  if (seconds < 0) return std::chrono::nanoseconds::max() / 4;
  return std::chrono::nanoseconds(static_cast<std::int64_t>(seconds * 1e9));
}

}  // namespace hetpipe::detail
