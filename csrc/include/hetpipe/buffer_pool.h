// PinnedBufferPool: fixed-size, 256-byte-aligned slots of host memory, handed out lock-free.
//
// Memory: one allocation of num_slots * stride bytes (stride = slot_bytes rounded up to 256).
// `device` >= 0 with a usable CUDA device: page-locked through that device's context
// (cudaHostAlloc, portable to every context; the caller's current device is left as it was).
// `device` < 0: ordinary host memory and no CUDA call at all, so the pool opens no CUDA context.
// That is what a rank without a GPU (a parameter-server rank) uses: its slots only travel through
// MPI, which gains nothing from page-locking, and pinning would need a context on some GPU.
// Without CUDA, a driver or a device, every pool is ordinary memory (pinned() says which).
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
// wrote into the slot is visible to the next owner.
// The free count (free_) is a reservation counter kept beside the stack: an acquire first reserves
// (decrements free_ only when it is positive, seq_cst CAS) and then pops; a release pushes first and
// then increments free_ (seq_cst). So stack size = free_ + reserved-but-not-popped + pushed-but-not-
// counted at every instant: free_ never exceeds the stack size, a reserved pop always finds an index,
// and free_ stays in [0, num_slots] (available() can never wrap below zero).
// free_ is also the condition the waiter protocol of core/waiters.h watches: a blocking acquirer
// registers in waiters_ before re-checking free_; a release increments free_ before it reads
// waiters_; all seq_cst, so either the acquirer sees the slot or the release sees the waiter and
// notifies it under the mutex (no lost wake-up).
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

  // Throws std::invalid_argument for zero slots or zero bytes, or a device below -1 or not below
  // cuda_device_count() (when there is a device), std::bad_alloc when memory is short.
  static std::shared_ptr<PinnedBufferPool> create(std::size_t num_slots, std::size_t slot_bytes, int device = -1);

  PinnedBufferPool(Private, std::size_t num_slots, std::size_t slot_bytes, int device);
  ~PinnedBufferPool();
  PinnedBufferPool(const PinnedBufferPool&) = delete;
  PinnedBufferPool& operator=(const PinnedBufferPool&) = delete;

  std::size_t num_slots() const noexcept { return num_slots_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  bool pinned() const noexcept { return pinned_; }
  int device() const noexcept { return device_; }  // the device whose context pinned the memory; -1: not pinned
  // Free slots now, in [0, num_slots]: a snapshot that may be stale as soon as it returns. When one
  // thread does all the acquiring, that many acquires of that thread succeed without waiting.
  std::size_t available() const noexcept { return free_.load(std::memory_order_seq_cst); }

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
  bool reserve() noexcept;          // takes one unit of free_ when positive
  std::uint32_t pop() noexcept;     // after a successful reserve(): always finds an index
  std::optional<std::uint32_t> try_pop() noexcept;  // reserve() + pop()
  void push(std::uint32_t index) noexcept;
  Slot take(std::uint32_t index);
  void check_request(std::size_t nbytes) const;

  std::size_t num_slots_;
  std::size_t slot_bytes_;
  std::size_t stride_;
  bool pinned_ = false;
  int device_ = -1;
  unsigned char* base_ = nullptr;

  alignas(64) std::atomic<std::uint64_t> head_{0};
  alignas(64) std::atomic<std::size_t> free_{0};
  std::atomic<int> waiters_{0};
  std::atomic<bool> closed_{false};
  std::unique_ptr<std::atomic<std::uint32_t>[]> next_;        // index + 1 of the next free slot, 0 = none
  std::unique_ptr<std::atomic<std::uint64_t>[]> generation_;  // even: free, odd: in use
  std::mutex mutex_;                                           // slow path only
  std::condition_variable freed_;
};

}  // namespace hetpipe
