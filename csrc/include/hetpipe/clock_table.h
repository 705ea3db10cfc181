// ClockTable: the WSP clocks of the virtual workers (VWs). A VW's clock counts the waves it finished;
// the global clock is the minimum over the VWs still active. A VW may start wave w only when
// global_clock() >= w - D.
//
// Layout: one cache line (alignas(64)) per VW holds its clock and its active flag, so advancing one
// VW never invalidates another VW's line.
//
// Memory ordering: advance() is a sequentially consistent fetch_add; clock() loads with acquire and
// global_clock() with seq_cst, so everything a thread wrote before advance(vw) returned is visible
// to a thread that reads the new clock (advance synchronises with the loads that observe its value). remove()
// stores the active flag with seq_cst; global_clock() loads it with seq_cst. Wake-ups follow the
// protocol of core/waiters.h: advance() and remove() update the clock first and read waiters_
// after; a waiter registers under mutex_ and re-reads the clocks, so no wake-up is lost.
// The fast path (no waiter) takes no lock: advance is one atomic RMW plus one load.
//
// Threads: every method may be called from any number of threads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

namespace hetpipe {

class ClockTable {
 public:
  explicit ClockTable(int num_vws);  // throws std::invalid_argument when num_vws < 1
  ClockTable(const ClockTable&) = delete;
  ClockTable& operator=(const ClockTable&) = delete;

  int num_vws() const noexcept { return num_vws_; }

  // Increments VW vw's clock; returns the new value. Throws std::out_of_range (vw outside
  // [0, num_vws)) or std::invalid_argument (vw was removed).
  std::int64_t advance(int vw);
  std::int64_t clock(int vw) const;
  bool active(int vw) const;

  // Minimum clock over the active VWs; with none active, the largest clock any VW reached.
  std::int64_t global_clock() const noexcept;

  // Blocks until global_clock() >= wave - bound_d, or no VW is active; returns global_clock().
  // nullopt when `timeout` passed first. Sleeps on a condition variable; never spins.
  std::optional<std::int64_t> wait_until_for(std::int64_t wave, std::int64_t bound_d,
                                             std::chrono::nanoseconds timeout);
  // As wait_until_for; timeout_seconds < 0 waits forever. Throws TimeoutError on timeout.
  std::int64_t wait_until(std::int64_t wave, std::int64_t bound_d, double timeout_seconds);

  // Takes a departed VW out of the minimum and wakes the waiters. Idempotent.
  void remove(int vw);

 private:
  struct alignas(64) PaddedClock {
    std::atomic<std::int64_t> value{0};
    std::atomic<bool> active{true};
  };

  PaddedClock& at(int vw) const;
  // The minimum clock over active VWs, or the maximum over all when none is active (seq_cst loads).
  std::int64_t scan(bool* any_active) const noexcept;
  bool satisfied(std::int64_t wave, std::int64_t bound_d, std::int64_t* global) const noexcept;
  void notify_waiters();

  int num_vws_;
  std::unique_ptr<PaddedClock[]> clocks_;
  alignas(64) std::atomic<int> waiters_{0};
  std::mutex mutex_;  // slow path only
  std::condition_variable advanced_;
};

}  // namespace hetpipe
