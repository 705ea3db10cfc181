// PinnedBufferPool: fixed-size, 256-byte-aligned slots of host memory, handed out lock-free, in one
// or more size classes.
//
// Size classes: a pool holds `count` slots of `bytes` bytes for each of its classes (a stage rank's
// pool has small slots for activations and large ones for the PS payloads, so that neither kind pays
// for the other's size). acquire(nbytes) takes a free slot of the smallest class that holds nbytes,
// and of a larger class when every fitting smaller one is in use; a pool of one class is the plain
// pool of num_slots x slot_bytes.
//
// Memory: one allocation holding every class's slots (each class's stride is its slot size rounded up
// to 256). `device` >= 0 with a usable CUDA device: page-locked through that device's context
// (cudaHostAlloc, portable to every context; the caller's current device is left as it was).
// `device` < 0: ordinary host memory and no CUDA call at all, so the pool opens no CUDA context.
// That is what a rank without a GPU (a parameter-server rank) uses: its slots only travel through
// MPI, which gains nothing from page-locking, and pinning would need a context on some GPU.
// Without CUDA, a driver or a device, or when page-locking fails, the pool is ordinary memory:
// pinned() says which, and pin_error() says why it is not pinned (callers that asked for pinning
// report it; the pool itself never fails over it).
//
// Lifetime: a pool lives in a shared_ptr (create()); every Slot and every exported view holds that
// shared_ptr, so slot memory stays valid while anything refers to it, even after the creator drops its
// handle. close() only stops further acquires; the memory is freed with the last reference.
//
// Threads: acquire, release, available and close may be called from any thread concurrently.
//
// Memory ordering: each class keeps its free slot indices in a Treiber stack whose head packs a
// 32-bit ABA tag with index + 1. All head operations are sequentially consistent. A release's
// successful CAS (push) synchronises with the CAS of the acquire that pops the same index, so
// whatever the releasing thread wrote into the slot is visible to the next owner.
// Each class's free count is a reservation counter kept beside its stack: an acquire first reserves
// (decrements the count only when it is positive, seq_cst CAS) and then pops; a release pushes first
// and then increments the count (seq_cst). So stack size = free + reserved-but-not-popped +
// pushed-but-not-counted at every instant: the count never exceeds the stack size, a reserved pop
// always finds an index, and each count stays in [0, class count] (available(), their sum, can
// never wrap below zero nor exceed num_slots).
// The free counts are also the condition the waiter protocol of core/waiters.h watches: a blocking
// acquirer registers in waiters_ before re-checking the counts of the classes that fit; a release
// increments its class's count before it reads waiters_; all seq_cst, so either the acquirer sees the
// slot or the release sees the waiter and notifies it under the mutex (no lost wake-up).
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
#include <vector>

namespace hetpipe {

class PinnedBufferPool;

// One size class of a pool: `count` slots of `bytes` bytes each.
struct SlotClass {
  std::size_t count = 0;
  std::size_t bytes = 0;
};

// One acquisition of one slot. Copyable handle; the memory belongs to the pool until release().
struct Slot {
  std::shared_ptr<PinnedBufferPool> pool;
  std::uint32_t index = 0;
  std::uint64_t generation = 0;  // odd: the generation this acquisition was given

  void* data() const;
  std::size_t nbytes() const;  // the size of this slot's class
};

class PinnedBufferPool : public std::enable_shared_from_this<PinnedBufferPool> {
  struct Private {};

 public:
  static constexpr std::size_t kAlignment = 256;

  // Throws std::invalid_argument for zero slots or zero bytes, or a device below -1 or not below
  // cuda_device_count() (when there is a device), std::bad_alloc when memory is short.
  static std::shared_ptr<PinnedBufferPool> create(std::size_t num_slots, std::size_t slot_bytes, int device = -1);
  // A pool of several size classes (in any order; classes of one size are merged). Throws
  // std::invalid_argument for no class, a class of zero slots or zero bytes, or a bad device.
  static std::shared_ptr<PinnedBufferPool> create(const std::vector<SlotClass>& classes, int device = -1);

  PinnedBufferPool(Private, const std::vector<SlotClass>& classes, int device);
  ~PinnedBufferPool();
  PinnedBufferPool(const PinnedBufferPool&) = delete;
  PinnedBufferPool& operator=(const PinnedBufferPool&) = delete;

  std::size_t num_slots() const noexcept { return num_slots_; }
  // The largest slot: the most bytes one acquire may ask for.
  std::size_t slot_bytes() const noexcept { return shape_.back().bytes; }
  // The size classes, smallest slots first.
  const std::vector<SlotClass>& classes() const noexcept { return shape_; }
  std::size_t slot_size(std::uint32_t index) const noexcept { return class_of(index).bytes; }
  std::size_t total_bytes() const noexcept { return total_bytes_; }
  bool pinned() const noexcept { return pinned_; }
  int device() const noexcept { return device_; }  // the device whose context pinned the memory; -1: not pinned
  // Why the memory is not page-locked ("" when it is): host memory was asked for (device -1), the
  // core has no CUDA, no device is usable, or page-locking failed (CUDA's error).
  const std::string& pin_error() const noexcept { return pin_error_; }
  // Free slots now, over all classes, in [0, num_slots]: a snapshot that may be stale as soon as it
  // returns. When one thread does all the acquiring, that many acquires of that thread succeed
  // without waiting (of a size every class holds).
  std::size_t available() const noexcept;

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

  void* slot_data(std::uint32_t index) const noexcept {
    const Class& c = class_of(index);
    return base_ + c.offset + std::size_t{index - c.first} * c.stride;
  }

 private:
  // One size class: slots [first, first + count) of `bytes` bytes, `stride` apart from `offset` on.
  struct Class {
    std::uint32_t first = 0;
    std::size_t count = 0;
    std::size_t bytes = 0;
    std::size_t stride = 0;
    std::size_t offset = 0;
    alignas(64) std::atomic<std::uint64_t> head{0};
    alignas(64) std::atomic<std::size_t> free{0};
  };

  std::size_t class_index(std::uint32_t index) const noexcept;  // the class slot `index` belongs to
  const Class& class_of(std::uint32_t index) const noexcept { return classes_[class_index(index)]; }
  static bool reserve(Class& c) noexcept;          // takes one unit of c.free when positive
  std::uint32_t pop(Class& c) noexcept;            // after a successful reserve(c): always finds an index
  std::optional<std::uint32_t> try_pop(std::size_t nbytes) noexcept;  // the smallest fitting class first
  void push(Class& c, std::uint32_t index) noexcept;
  Slot take(std::uint32_t index);
  void check_request(std::size_t nbytes) const;
  std::string describe() const;     // "4 slots of 64 bytes", or each class's

  std::size_t num_slots_ = 0;
  std::vector<SlotClass> shape_;
  std::unique_ptr<Class[]> classes_;
  std::size_t total_bytes_ = 0;
  bool pinned_ = false;
  int device_ = -1;
  std::string pin_error_;
  unsigned char* base_ = nullptr;

  std::atomic<int> waiters_{0};
  std::atomic<bool> closed_{false};
  std::unique_ptr<std::atomic<std::uint32_t>[]> next_;        // index + 1 of the next free slot, 0 = none
  std::unique_ptr<std::atomic<std::uint64_t>[]> generation_;  // even: free, odd: in use
  std::mutex mutex_;                                           // slow path only
  std::condition_variable freed_;
};

}  // namespace hetpipe
