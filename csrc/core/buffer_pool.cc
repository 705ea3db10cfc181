#include "hetpipe/buffer_pool.h"

#include <limits>
#include <sstream>
#include <stdexcept>

#include "core/backend.h"
#include "core/waiters.h"
#include "hetpipe/device.h"
#include "hetpipe/errors.h"

namespace hetpipe {
namespace {

constexpr std::uint64_t kIndexMask = 0xffffffffull;

std::uint64_t pack(std::uint64_t head, std::uint32_t top_plus_one) {
  return (((head >> 32) + 1) << 32) | top_plus_one;
}

}  // namespace

void* Slot::data() const { return pool->slot_data(index); }
std::size_t Slot::nbytes() const { return pool->slot_bytes(); }

std::shared_ptr<PinnedBufferPool> PinnedBufferPool::create(std::size_t num_slots, std::size_t slot_bytes,
                                                           int device) {
  return std::make_shared<PinnedBufferPool>(Private{}, num_slots, slot_bytes, device);
}

PinnedBufferPool::PinnedBufferPool(Private, std::size_t num_slots, std::size_t slot_bytes, int device)
    : num_slots_(num_slots), slot_bytes_(slot_bytes) {
  if (num_slots == 0 || slot_bytes == 0) {
    std::ostringstream msg;
    msg << "PinnedBufferPool needs at least one slot of at least one byte, got " << num_slots << " slots of "
        << slot_bytes << " bytes";
    throw std::invalid_argument(msg.str());
  }
  if (num_slots >= std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument("PinnedBufferPool: too many slots (" + std::to_string(num_slots) + ")");
  }
  const int devices = device >= 0 ? cuda_device_count() : 0;
  if (device < -1 || (devices > 0 && device >= devices)) {
    throw std::invalid_argument("PinnedBufferPool: device " + std::to_string(device) + " out of range (-1 for host " +
                                "memory, or below the " + std::to_string(devices) + " CUDA devices)");
  }
  stride_ = (slot_bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (stride_ > std::numeric_limits<std::size_t>::max() / num_slots) throw std::bad_alloc();
  const backend::HostAllocation allocation = backend::host_alloc(stride_ * num_slots, kAlignment, device);
  base_ = static_cast<unsigned char*>(allocation.ptr);
  pinned_ = allocation.pinned;
  device_ = allocation.device;
  next_.reset(new std::atomic<std::uint32_t>[num_slots]);
  generation_.reset(new std::atomic<std::uint64_t>[num_slots]);
  // Slot 0 on top: index i links to i + 1 (stored as index + 1), the last one to nothing.
  for (std::size_t i = 0; i < num_slots; ++i) {
    next_[i].store(i + 1 < num_slots ? static_cast<std::uint32_t>(i + 2) : 0u, std::memory_order_relaxed);
    generation_[i].store(0, std::memory_order_relaxed);
  }
  head_.store(1, std::memory_order_seq_cst);
  free_.store(num_slots, std::memory_order_seq_cst);
}

PinnedBufferPool::~PinnedBufferPool() { backend::host_free({base_, pinned_, device_}); }

bool PinnedBufferPool::reserve() noexcept {
  std::size_t free = free_.load(std::memory_order_seq_cst);
  while (free > 0) {
    if (free_.compare_exchange_weak(free, free - 1, std::memory_order_seq_cst)) return true;
  }
  return false;
}

std::uint32_t PinnedBufferPool::pop() noexcept {
  std::uint64_t head = head_.load(std::memory_order_seq_cst);
  for (;;) {
    const auto top = static_cast<std::uint32_t>(head & kIndexMask);
    if (top == 0) {
      // Cannot happen: the stack holds at least as many indices as there are reservations (see
      // the header). Re-read rather than hand out nothing for a reservation.
      head = head_.load(std::memory_order_seq_cst);
      continue;
    }
    // May read a stale link when another thread popped and pushed `top` meanwhile; the tag then
    // differs and the CAS fails.
    const std::uint32_t next = next_[top - 1].load(std::memory_order_relaxed);
    if (head_.compare_exchange_weak(head, pack(head, next), std::memory_order_seq_cst)) return top - 1;
  }
}

std::optional<std::uint32_t> PinnedBufferPool::try_pop() noexcept {
  if (!reserve()) return std::nullopt;
  return pop();
}

void PinnedBufferPool::push(std::uint32_t index) noexcept {
  std::uint64_t head = head_.load(std::memory_order_relaxed);
  do {
    next_[index].store(static_cast<std::uint32_t>(head & kIndexMask), std::memory_order_relaxed);
  } while (!head_.compare_exchange_weak(head, pack(head, index + 1), std::memory_order_seq_cst,
                                        std::memory_order_relaxed));
  free_.fetch_add(1, std::memory_order_seq_cst);
}

Slot PinnedBufferPool::take(std::uint32_t index) {
  const std::uint64_t generation = generation_[index].fetch_add(1, std::memory_order_acq_rel) + 1;
  return Slot{shared_from_this(), index, generation};
}

void PinnedBufferPool::check_request(std::size_t nbytes) const {
  if (nbytes > slot_bytes_) {
    std::ostringstream msg;
    msg << "PinnedBufferPool: requested " << nbytes << " bytes but a slot holds " << slot_bytes_ << " bytes";
    throw std::invalid_argument(msg.str());
  }
  if (closed()) throw std::runtime_error("PinnedBufferPool is closed");
}

std::optional<Slot> PinnedBufferPool::try_acquire(std::size_t nbytes, std::chrono::nanoseconds wait) {
  check_request(nbytes);
  if (auto index = try_pop()) return take(*index);
  if (wait <= std::chrono::nanoseconds::zero()) return std::nullopt;

  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::unique_lock<std::mutex> lock(mutex_);
  const detail::WaiterRegistration registered(waiters_);
  for (;;) {
    if (closed()) throw std::runtime_error("PinnedBufferPool is closed");
    if (auto index = try_pop()) return take(*index);
    if (freed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (auto index = try_pop()) return take(*index);
      return std::nullopt;
    }
  }
}

Slot PinnedBufferPool::acquire(std::size_t nbytes, double timeout_seconds) {
  if (auto slot = try_acquire(nbytes, detail::timeout_from_seconds(timeout_seconds))) return std::move(*slot);
  throw TimeoutError(exhausted_message(timeout_seconds));
}

std::string PinnedBufferPool::exhausted_message(double timeout_seconds) const {
  std::ostringstream msg;
  msg << "PinnedBufferPool exhausted: all " << num_slots_ << " slots of " << slot_bytes_
      << " bytes are in use and none was released within " << timeout_seconds << " s";
  return msg.str();
}

void PinnedBufferPool::release(const Slot& slot) {
  if (slot.pool.get() != this) {
    std::ostringstream msg;
    msg << "PinnedBufferPool.release: slot " << slot.index << " belongs to another pool (" << num_slots_
        << " slots of " << slot_bytes_ << " bytes here)";
    throw std::invalid_argument(msg.str());
  }
  if (slot.index >= num_slots_ || slot.generation % 2 == 0) {
    throw std::invalid_argument("PinnedBufferPool.release: not an acquired slot (index " +
                                std::to_string(slot.index) + ")");
  }
  std::uint64_t expected = slot.generation;
  if (!generation_[slot.index].compare_exchange_strong(expected, slot.generation + 1, std::memory_order_acq_rel)) {
    throw std::invalid_argument("PinnedBufferPool.release: double release of slot " + std::to_string(slot.index) +
                                " (it was already released)");
  }
  push(slot.index);
  if (waiters_.load(std::memory_order_seq_cst) > 0) detail::notify_under(mutex_, freed_);
}

void PinnedBufferPool::close() {
  closed_.store(true, std::memory_order_seq_cst);
  detail::notify_under(mutex_, freed_);
}

}  // namespace hetpipe
