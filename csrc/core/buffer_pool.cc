#include "hetpipe/buffer_pool.h"

#include <algorithm>
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
std::size_t Slot::nbytes() const { return pool->slot_size(index); }

std::shared_ptr<PinnedBufferPool> PinnedBufferPool::create(std::size_t num_slots, std::size_t slot_bytes,
                                                           int device) {
  return create(std::vector<SlotClass>{{num_slots, slot_bytes}}, device);
}

std::shared_ptr<PinnedBufferPool> PinnedBufferPool::create(const std::vector<SlotClass>& classes, int device) {
  return std::make_shared<PinnedBufferPool>(Private{}, classes, device);
}

PinnedBufferPool::PinnedBufferPool(Private, const std::vector<SlotClass>& classes, int device) {
  if (classes.empty()) throw std::invalid_argument("PinnedBufferPool needs at least one size class");
  for (const SlotClass& c : classes) {
    if (c.count == 0 || c.bytes == 0) {
      std::ostringstream msg;
      msg << "PinnedBufferPool needs at least one slot of at least one byte, got " << c.count << " slots of "
          << c.bytes << " bytes";
      throw std::invalid_argument(msg.str());
    }
  }
  // Smallest slots first, one class per size: acquire walks them in this order.
  std::vector<SlotClass> sorted = classes;
  std::sort(sorted.begin(), sorted.end(), [](const SlotClass& a, const SlotClass& b) { return a.bytes < b.bytes; });
  for (const SlotClass& c : sorted) {
    if (!shape_.empty() && shape_.back().bytes == c.bytes) {
      shape_.back().count += c.count;
    } else {
      shape_.push_back(c);
    }
  }
  std::size_t total = 0;
  for (const SlotClass& c : shape_) {
    if (c.count >= std::numeric_limits<std::uint32_t>::max() - total) {
      throw std::invalid_argument("PinnedBufferPool: too many slots (" + std::to_string(total + c.count) + ")");
    }
    total += c.count;
  }
  num_slots_ = total;
  const int devices = device >= 0 ? cuda_device_count() : 0;
  if (device < -1 || (devices > 0 && device >= devices)) {
    throw std::invalid_argument("PinnedBufferPool: device " + std::to_string(device) + " out of range (-1 for host " +
                                "memory, or below the " + std::to_string(devices) + " CUDA devices)");
  }
  classes_.reset(new Class[shape_.size()]);
  std::uint32_t first = 0;
  std::size_t offset = 0;
  for (std::size_t k = 0; k < shape_.size(); ++k) {
    Class& c = classes_[k];
    c.first = first;
    c.count = shape_[k].count;
    c.bytes = shape_[k].bytes;
    c.stride = (c.bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (c.stride < c.bytes || c.stride > (std::numeric_limits<std::size_t>::max() - offset) / c.count) {
      throw std::bad_alloc();
    }
    c.offset = offset;
    offset += c.stride * c.count;
    first += static_cast<std::uint32_t>(c.count);
  }
  total_bytes_ = offset;
  const backend::HostAllocation allocation = backend::host_alloc(total_bytes_, kAlignment, device);
  base_ = static_cast<unsigned char*>(allocation.ptr);
  pinned_ = allocation.pinned;
  device_ = allocation.device;
  pin_error_ = allocation.why;
  next_.reset(new std::atomic<std::uint32_t>[num_slots_]);
  generation_.reset(new std::atomic<std::uint64_t>[num_slots_]);
  // Each class's first slot on top of its stack: index i links to i + 1 (stored as index + 1), the
  // class's last one to nothing.
  for (std::size_t k = 0; k < shape_.size(); ++k) {
    Class& c = classes_[k];
    const std::size_t end = c.first + c.count;
    for (std::size_t i = c.first; i < end; ++i) {
      next_[i].store(i + 1 < end ? static_cast<std::uint32_t>(i + 2) : 0u, std::memory_order_relaxed);
      generation_[i].store(0, std::memory_order_relaxed);
    }
    c.head.store(c.first + 1, std::memory_order_seq_cst);
    c.free.store(c.count, std::memory_order_seq_cst);
  }
}

PinnedBufferPool::~PinnedBufferPool() { backend::host_free({base_, pinned_, device_, ""}); }

std::size_t PinnedBufferPool::class_index(std::uint32_t index) const noexcept {
  std::size_t k = shape_.size() - 1;
  while (k > 0 && classes_[k].first > index) --k;
  return k;
}

std::size_t PinnedBufferPool::available() const noexcept {
  std::size_t free = 0;
  for (std::size_t k = 0; k < shape_.size(); ++k) free += classes_[k].free.load(std::memory_order_seq_cst);
  return free;
}

bool PinnedBufferPool::reserve(Class& c) noexcept {
  std::size_t free = c.free.load(std::memory_order_seq_cst);
  while (free > 0) {
    if (c.free.compare_exchange_weak(free, free - 1, std::memory_order_seq_cst)) return true;
  }
  return false;
}

std::uint32_t PinnedBufferPool::pop(Class& c) noexcept {
  std::uint64_t head = c.head.load(std::memory_order_seq_cst);
  for (;;) {
    const auto top = static_cast<std::uint32_t>(head & kIndexMask);
    if (top == 0) {
      // Cannot happen: the stack holds at least as many indices as there are reservations (see
      // the header). Re-read rather than hand out nothing for a reservation.
      head = c.head.load(std::memory_order_seq_cst);
      continue;
    }
    // May read a stale link when another thread popped and pushed `top` meanwhile; the tag then
    // differs and the CAS fails.
    const std::uint32_t next = next_[top - 1].load(std::memory_order_relaxed);
    if (c.head.compare_exchange_weak(head, pack(head, next), std::memory_order_seq_cst)) return top - 1;
  }
}

std::optional<std::uint32_t> PinnedBufferPool::try_pop(std::size_t nbytes) noexcept {
  for (std::size_t k = 0; k < shape_.size(); ++k) {
    Class& c = classes_[k];
    if (c.bytes >= nbytes && reserve(c)) return pop(c);
  }
  return std::nullopt;
}

void PinnedBufferPool::push(Class& c, std::uint32_t index) noexcept {
  std::uint64_t head = c.head.load(std::memory_order_relaxed);
  do {
    next_[index].store(static_cast<std::uint32_t>(head & kIndexMask), std::memory_order_relaxed);
  } while (!c.head.compare_exchange_weak(head, pack(head, index + 1), std::memory_order_seq_cst,
                                         std::memory_order_relaxed));
  c.free.fetch_add(1, std::memory_order_seq_cst);
}

Slot PinnedBufferPool::take(std::uint32_t index) {
  const std::uint64_t generation = generation_[index].fetch_add(1, std::memory_order_acq_rel) + 1;
  return Slot{shared_from_this(), index, generation};
}

void PinnedBufferPool::check_request(std::size_t nbytes) const {
  if (nbytes > slot_bytes()) {
    std::ostringstream msg;
    msg << "PinnedBufferPool: requested " << nbytes << " bytes but a slot holds " << slot_bytes() << " bytes";
    throw std::invalid_argument(msg.str());
  }
  if (closed()) throw std::runtime_error("PinnedBufferPool is closed");
}

std::optional<Slot> PinnedBufferPool::try_acquire(std::size_t nbytes, std::chrono::nanoseconds wait) {
  check_request(nbytes);
  if (auto index = try_pop(nbytes)) return take(*index);
  if (wait <= std::chrono::nanoseconds::zero()) return std::nullopt;

  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::unique_lock<std::mutex> lock(mutex_);
  const detail::WaiterRegistration registered(waiters_);
  for (;;) {
    if (closed()) throw std::runtime_error("PinnedBufferPool is closed");
    if (auto index = try_pop(nbytes)) return take(*index);
    if (freed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (auto index = try_pop(nbytes)) return take(*index);
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
  msg << "PinnedBufferPool exhausted: all " << describe() << " are in use and none was released within "
      << timeout_seconds << " s";
  return msg.str();
}

std::string PinnedBufferPool::describe() const {
  std::ostringstream out;
  for (std::size_t k = 0; k < shape_.size(); ++k) {
    out << (k == 0 ? "" : k + 1 == shape_.size() ? " and " : ", ") << shape_[k].count
        << (k == 0 ? " slots of " : " of ") << shape_[k].bytes << " bytes";
  }
  return out.str();
}

void PinnedBufferPool::release(const Slot& slot) {
  if (slot.pool.get() != this) {
    std::ostringstream msg;
    msg << "PinnedBufferPool.release: slot " << slot.index << " belongs to another pool (" << describe()
        << " here)";
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
  push(classes_[class_index(slot.index)], slot.index);
  if (waiters_.load(std::memory_order_seq_cst) > 0) detail::notify_under(mutex_, freed_);
}

void PinnedBufferPool::close() {
  closed_.store(true, std::memory_order_seq_cst);
  detail::notify_under(mutex_, freed_);
}

}  // namespace hetpipe
