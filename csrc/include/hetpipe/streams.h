// Stream and Event: ordered asynchronous work (copies) on a CUDA stream, or on a CPU worker thread
// with the same semantics, so callers never branch on CUDA.
//
// Semantics (both implementations):
// - Work enqueued on one Stream runs in enqueue order.
// - Event::record(stream) marks the point after everything enqueued on `stream` so far; the event
//   completes when that work has completed. An event never recorded counts as complete. Recording
//   again replaces the marked point.
// - Stream::wait_for(event) makes work enqueued on this stream afterwards wait for the event's
//   point as recorded at the time of the call; it does not block the caller.
// - synchronize() blocks the caller (never spinning a core); query() never blocks.
//
// CPU implementation: each Stream owns one worker thread that runs its queue in order.
// Memory ordering: the worker publishes completion of task k by storing k into `completed` with
// release semantics under the stream's mutex; Event::query/synchronize read it with acquire
// semantics (or under that mutex), so everything a task wrote (e.g. copied bytes) is visible to a
// thread that observed the event complete.
//
// Lifetime: memory passed to copy_async must stay valid until the copy completed (as with CUDA).
// Stream and Event are move-only RAII handles; close() (also run by the destructor) drains the
// queue and joins the worker (or synchronizes and destroys the CUDA stream). An Event keeps the
// state of the stream it was recorded on alive, so it can be queried after that stream is gone.
// Thread role: each handle may be used from several threads; operations on one handle serialise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace hetpipe {

namespace detail {
struct StreamState;
struct EventState;
}  // namespace detail

class Event;

class Stream {
 public:
  // device < 0, or no usable CUDA device: a CPU stream. Otherwise a non-blocking CUDA stream on
  // `device`; throws std::invalid_argument when `device` is not below cuda_device_count().
  explicit Stream(int device = -1);
  ~Stream();
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  bool is_cuda() const noexcept;
  int device() const noexcept;             // -1 for a CPU stream
  std::uintptr_t handle() const noexcept;  // the cudaStream_t, 0 for a CPU stream

  void synchronize();
  bool query() const;
  void wait_for(const Event& event);
  // Copies nbytes from src to dst in stream order (any host/device combination on CUDA).
  void copy_async(void* dst, const void* src, std::size_t nbytes);
  // For tests and benchmarks: occupies the stream for `seconds` (host callback on CUDA).
  void enqueue_sleep(double seconds);

  // Drains the queue and releases the worker or CUDA stream; idempotent. Enqueueing afterwards
  // throws std::logic_error.
  void close();
  bool closed() const noexcept;

 private:
  friend class Event;
  std::shared_ptr<detail::StreamState> state_;
};

class Event {
 public:
  Event();
  ~Event();
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(Stream& stream);
  void synchronize() const;
  bool query() const;

 private:
  friend class Stream;
  std::unique_ptr<detail::EventState> state_;
};

// Free-function form of Stream::copy_async.
void copy_async(void* dst, const void* src, std::size_t nbytes, Stream& stream);

}  // namespace hetpipe
