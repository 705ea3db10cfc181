// PinnedBufferPool: fixed-size, 256-byte-aligned slots of page-locked host memory, handed out lock-free.
//
// Memory: one allocation of num_slots * stride bytes (stride = slot_bytes rounded up to 256), page-locked
// through cudaHostAlloc when CUDA is built and a device is usable, 256-byte-aligned host memory otherwise.
//
// Lifetime: a pool lives in a shared_ptr (create()); every Slot and every exported view holds that
// shared_ptr, so slot memory stays valid while anything refers to it, even after the creator drops its
// handle. close() only stops further acquires; the memory is freed with the last reference.
//
// Threads: acquire, release, available and close may be called from any thread concurrently.
//
// Memory ordering: free slot indices form a Treiber stack whose head packs a 32-bit ABA tag with
// index + 1. All head operations are sequentially consistent. A release's successful CAS (push)
// synchronises with the CAS of the acquire that pops the same index, so whatever the releasing thread
// wrote into the slot is visible to the next owner. The single total order of those operations and of
// the waiter count (waiters_) rules out lost wake-ups: a blocking acquirer registers in waiters_
// before re-checking the stack; a release pushes before it reads waiters_, so either the acquirer
// sees the pushed index or the release sees the waiter and notifies it under the mutex.
// Each slot's generation (even = free, odd = in use) is advanced with an acq_rel CAS by release, so a
// second release of the same acquisition fails deterministically (double release).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <string>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

namespace hetpipe {

class PinnedBufferPool;

// One acquisition of one slot. Copyable handle; the memory belongs to the pool until release().
struct Slot {
  std::shared_ptr<PinnedBufferPool> pool;
  std::uint32_t index = 0;
  std::uint64_t generation = 0;  // odd: the generation this acquisition was given

  void* data() const;
  std::size_t nbytes() const;  // the slot size (pool->slot_bytes())
};

class PinnedBufferPool : public std::enable_shared_from_this<PinnedBufferPool> {
  struct Private {};

 public:
  static constexpr std::size_t kAlignment = 256;

  // Throws std::invalid_argument for zero slots or zero bytes, std::bad_alloc when memory is short.
  static std::shared_ptr<PinnedBufferPool> create(std::size_t num_slots, std::size_t slot_bytes);

  PinnedBufferPool(Private, std::size_t num_slots, std::size_t slot_bytes);
  ~PinnedBufferPool();
  PinnedBufferPool(const PinnedBufferPool&) = delete;
  PinnedBufferPool& operator=(const PinnedBufferPool&) = delete;

  std::size_t num_slots() const noexcept { return num_slots_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  bool pinned() const noexcept { return pinned_; }
  // Free slots now; a snapshot that may be stale as soon as it returns.
  std::size_t available() const noexcept { return free_count_.load(std::memory_order_relaxed); }

  // Waits up to `wait` for a free slot; nullopt when none became free. Never spins: after one
  // lock-free attempt it sleeps on a condition variable that release() signals.
  // Throws std::invalid_argument when nbytes > slot_bytes() (the message names both sizes) and
  // std::runtime_error when the pool is closed.
  std::optional<Slot> try_acquire(std::size_t nbytes, std::chrono::nanoseconds wait);
  // As try_acquire; timeout_seconds < 0 waits forever. Throws TimeoutError naming the pool size.
  Slot acquire(std::size_t nbytes, double timeout_seconds);
  // The TimeoutError message of an acquire that found no free slot within timeout_seconds.
  std::string exhausted_message(double timeout_seconds) const;

  // Returns the slot. Throws std::invalid_argument for a slot of another pool or a second release
  // of the same acquisition.
  void release(const Slot& slot);

  // No acquire succeeds afterwards; blocked acquirers wake and throw. Outstanding slots stay valid.
  void close();
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }

  void* slot_data(std::uint32_t index) const noexcept { return base_ + std::size_t{index} * stride_; }

 private:
  std::optional<std::uint32_t> pop() noexcept;
  void push(std::uint32_t index) noexcept;
  Slot take(std::uint32_t index);
  void check_request(std::size_t nbytes) const;

  std::size_t num_slots_;
  std::size_t slot_bytes_;
  std::size_t stride_;
  bool pinned_ = false;
  unsigned char* base_ = nullptr;

  alignas(64) std::atomic<std::uint64_t> head_{0};
  alignas(64) std::atomic<std::size_t> free_count_{0};
  std::atomic<int> waiters_{0};
  std::atomic<bool> closed_{false};
  std::unique_ptr<std::atomic<std::uint32_t>[]> next_;        // index + 1 of the next free slot, 0 = none
  std::unique_ptr<std::atomic<std::uint64_t>[]> generation_;  // even: free, odd: in use
  std::mutex mutex_;                                           // slow path only
  std::condition_variable freed_;
};

}  // namespace hetpipe
