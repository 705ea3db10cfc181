// Stream and Event: ordered asynchronous work (copies) on a CUDA stream, or on a CPU worker thread
// with the same semantics, so callers never branch on CUDA.
//
// Semantics (both implementations):
// - Work enqueued on one Stream runs in enqueue order.
// - Event::record(stream) marks the point after everything enqueued on `stream` so far; the event
//   completes when that work has completed. An event never recorded counts as complete. Recording
//   again replaces the marked point; it never disturbs a wait already enqueued on the old point.
// - Stream::wait_for(event) makes work enqueued on this stream afterwards wait for the event's
//   point as recorded at the time of the call, even when the event is re-recorded or destroyed
//   before the wait runs; it does not block the caller.
// - Stream::wait_external(handle, kind) does the same for another framework's stream or event
//   handle (a cudaStream_t or cudaEvent_t), as it stands at the time of the call.
// - synchronize() blocks the caller (never spinning a core); query() and closed() never block.
//
// Devices: a CUDA Stream or Event does its CUDA calls with its own device's context pushed for the
// call and popped after (core/backend.h), so creating Stream(1), recording on it or synchronizing
// it leaves the calling thread's current device (torch's current device) as it was.
//
// Errors: a task that fails (a host function that throws, a wait on a failed point, a CUDA error
// met by a CPU stream's wait) never ends the process. On a CPU stream the first failure is kept:
// later tasks of that stream are not run (they may depend on the failed one), and synchronize(),
// query() and close() of the stream, and synchronize()/query() of an event recorded at or after the
// failure, throw StreamError naming it. A wait on a failed point fails in turn. On a CUDA stream a
// failed host function is reported the same way by the stream's synchronize(), query() and close();
// CUDA's own errors surface as std::runtime_error from the call that meets them. Destructors never
// throw: ~Stream closes, and an error it meets is written to stderr and dropped.
//
// CPU implementation: each Stream owns one worker thread that runs its queue in order.
// Memory ordering: the worker publishes completion of task k by storing k into `completed` with
// release semantics under the stream's mutex (after recording a failure of task k, if any);
// Event::query/synchronize read it with acquire semantics (or under that mutex), so everything a
// task wrote (e.g. copied bytes) is visible to a thread that observed the event complete.
//
// Lifetime: memory passed to copy_async must stay valid until the copy completed (as with CUDA).
// Stream and Event are move-only RAII handles; close() (also run by the destructor) drains the
// queue and joins the worker (or synchronizes and destroys the CUDA stream). An Event keeps the
// state of the stream it was recorded on alive, so it can be queried after that stream is gone.
// Thread role: each handle may be used from several threads. On a CUDA stream the stream's mutex
// serialises enqueueing against close() and is never held while waiting for the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>

namespace hetpipe {

namespace detail {
struct StreamState;
struct EventState;
}  // namespace detail

// A task of a stream failed; the message names the first failure. Python: RuntimeError.
class StreamError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Event;

// What a foreign handle given to Stream::wait_external is.
enum class ExternalKind { kStream, kEvent };

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
  // Work enqueued afterwards waits for a handle of another framework (torch, CuPy, JAX), as it
  // stands at the time of the call; the caller does not block, and the handle may be destroyed
  // once this returns.
  // CUDA stream: kStream, a cudaStream_t of any device or context (0: the legacy default stream of
  // this stream's device; 1 and 2: the legacy and per-thread default streams), is waited for as far
  // as work was enqueued on it so far (an internal event recorded on it in its own context, then
  // cudaStreamWaitEvent); kEvent, a cudaEvent_t (not 0), is waited for as last recorded.
  // CPU stream: handle 0 (the null stream of a host framework, always complete) adds no work; any
  // other handle throws std::invalid_argument (a CPU stream cannot wait on a CUDA handle).
  // Throws std::logic_error once closed, std::runtime_error for a CUDA error.
  void wait_external(std::uintptr_t handle, ExternalKind kind);
  // Copies nbytes from src to dst in stream order (any host/device combination on CUDA).
  void copy_async(void* dst, const void* src, std::size_t nbytes);
  // For tests and benchmarks: occupies the stream for `seconds` (host callback on CUDA).
  void enqueue_sleep(double seconds);
  // Runs fn on a host thread in stream order (cudaLaunchHostFunc on CUDA). fn must not call into
  // this stream. An exception fn throws fails the stream (see Errors above).
  void launch_host_func(std::function<void()> fn);

  // Drains the queue and releases the worker or CUDA stream; idempotent. Enqueueing afterwards
  // throws std::logic_error. The call that closes the stream throws the stream's first failure
  // (StreamError) or the CUDA error met while draining, after releasing everything.
  void close();
  bool closed() const noexcept;

 private:
  friend class Event;
  void close_quietly() noexcept;  // close(), with any error written to stderr (destructor, move)
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
