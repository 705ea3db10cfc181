#include "hetpipe/clock_table.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include "core/waiters.h"
#include "hetpipe/errors.h"

namespace hetpipe {

ClockTable::ClockTable(int num_vws) : num_vws_(num_vws) {
  if (num_vws < 1) {
    throw std::invalid_argument("ClockTable needs at least one virtual worker, got " + std::to_string(num_vws));
  }
  clocks_.reset(new PaddedClock[static_cast<std::size_t>(num_vws)]);
}

ClockTable::PaddedClock& ClockTable::at(int vw) const {
  if (vw < 0 || vw >= num_vws_) {
    std::ostringstream msg;
    msg << "vw " << vw << " out of range for a ClockTable of " << num_vws_ << " virtual workers";
    throw std::out_of_range(msg.str());
  }
  return clocks_[static_cast<std::size_t>(vw)];
}

std::int64_t ClockTable::advance(int vw) {
  PaddedClock& c = at(vw);
  if (!c.active.load(std::memory_order_acquire)) {
    throw std::invalid_argument("ClockTable.advance: vw " + std::to_string(vw) + " was removed");
  }
  const std::int64_t now = c.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (waiters_.load(std::memory_order_seq_cst) != 0) notify_waiters();
  return now;
}

std::int64_t ClockTable::clock(int vw) const { return at(vw).value.load(std::memory_order_acquire); }

bool ClockTable::active(int vw) const { return at(vw).active.load(std::memory_order_acquire); }

std::int64_t ClockTable::scan(bool* any_active) const noexcept {
  std::int64_t lowest = std::numeric_limits<std::int64_t>::max();
  std::int64_t highest = 0;
  *any_active = false;
  for (int vw = 0; vw < num_vws_; ++vw) {
    const PaddedClock& c = clocks_[static_cast<std::size_t>(vw)];
    const std::int64_t v = c.value.load(std::memory_order_seq_cst);
    highest = std::max(highest, v);
    if (c.active.load(std::memory_order_seq_cst)) {
      *any_active = true;
      lowest = std::min(lowest, v);
    }
  }
  return *any_active ? lowest : highest;
}

std::int64_t ClockTable::global_clock() const noexcept {
  bool any_active = false;
  return scan(&any_active);
}

bool ClockTable::satisfied(std::int64_t wave, std::int64_t bound_d, std::int64_t* global) const noexcept {
  bool any_active = false;
  *global = scan(&any_active);
  return !any_active || *global >= wave - bound_d;
}

std::optional<std::int64_t> ClockTable::wait_until_for(std::int64_t wave, std::int64_t bound_d,
                                                       std::chrono::nanoseconds timeout) {
  std::int64_t global = 0;
  if (satisfied(wave, bound_d, &global)) return global;
  if (timeout <= std::chrono::nanoseconds::zero()) return std::nullopt;

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mutex_);
  const detail::WaiterRegistration registered(waiters_);
  for (;;) {
    if (satisfied(wave, bound_d, &global)) return global;
    if (advanced_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (satisfied(wave, bound_d, &global)) return global;
      return std::nullopt;
    }
  }
}

std::int64_t ClockTable::wait_until(std::int64_t wave, std::int64_t bound_d, double timeout_seconds) {
  if (auto global = wait_until_for(wave, bound_d, detail::timeout_from_seconds(timeout_seconds))) return *global;
  std::ostringstream msg;
  msg << "ClockTable.wait_until(wave=" << wave << ", bound_d=" << bound_d << ") timed out after " << timeout_seconds
      << " s: global clock " << global_clock() << " < " << wave - bound_d;
  throw TimeoutError(msg.str());
}

void ClockTable::remove(int vw) {
  at(vw).active.store(false, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) != 0) notify_waiters();
}

void ClockTable::notify_waiters() { detail::notify_under(mutex_, advanced_); }

}  // namespace hetpipe
