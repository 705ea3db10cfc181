#include "hetpipe/streams.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "core/backend.h"
#include "hetpipe/device.h"

namespace hetpipe {
namespace detail {

constexpr std::uint64_t kEverything = std::numeric_limits<std::uint64_t>::max();

// The first failure of a stream's work. `at` is the sequence number of the failed task (CPU
// streams) or 1 (CUDA streams, whose later reports all see it); 0 while nothing failed.
// Memory ordering: `what` is written once under `mutex` before `at` is stored with release; a
// reader that loads a non-zero `at` with acquire reads `what` under `mutex`.
struct Failure {
  mutable std::mutex mutex;
  std::atomic<std::uint64_t> at{0};
  std::string what;  // guarded by mutex

  // Keeps the exception being handled (call inside a catch block) unless an earlier one was kept.
  void keep_current(std::uint64_t seq) noexcept {
    std::string message;
    try {
      throw;
    } catch (const StreamError& e) {
      message = e.what();  // a wait on a failed point: the original failure, unchanged
    } catch (const std::exception& e) {
      message = std::string("a stream task failed: ") + e.what();
    } catch (...) {
      message = "a stream task failed with an exception that is not a std::exception";
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (at.load(std::memory_order_relaxed) != 0) return;
    what = std::move(message);
    at.store(seq, std::memory_order_release);
  }

  bool failed() const noexcept { return at.load(std::memory_order_acquire) != 0; }

  // Throws StreamError when a task at or before `seq` failed.
  void throw_if_failed(std::uint64_t seq) const {
    const std::uint64_t first = at.load(std::memory_order_acquire);
    if (first == 0 || first > seq) return;
    std::lock_guard<std::mutex> lock(mutex);
    throw StreamError(what);
  }
};

// A CPU stream's queue and worker. Kept in a shared_ptr so events recorded on it outlive the Stream.
struct CpuQueue {
  std::mutex mutex;
  std::condition_variable has_work;
  std::condition_variable progressed;
  std::deque<std::function<void()>> tasks;  // guarded by mutex
  std::uint64_t enqueued = 0;               // guarded by mutex; sequence number of the last task
  std::atomic<std::uint64_t> completed{0};  // written under mutex with release
  bool stopping = false;                    // guarded by mutex
  Failure failure;
  std::thread worker;

  // Thread role: the worker thread only. A task runs without the mutex held; once a task failed,
  // the later ones are dropped unrun (they may depend on it) and still count as completed.
  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      has_work.wait(lock, [&] { return stopping || !tasks.empty(); });
      if (tasks.empty()) return;
      std::function<void()> task = std::move(tasks.front());
      tasks.pop_front();
      const std::uint64_t seq = completed.load(std::memory_order_relaxed) + 1;
      lock.unlock();
      if (!failure.failed()) {
        try {
          task();
        } catch (...) {
          failure.keep_current(seq);
        }
      }
      task = nullptr;  // what the task captured is released outside the mutex
      lock.lock();
      completed.store(seq, std::memory_order_release);
      progressed.notify_all();
    }
  }

  std::uint64_t enqueue(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mutex);
    if (stopping) throw std::logic_error("Stream is closed");
    tasks.push_back(std::move(task));
    has_work.notify_one();
    return ++enqueued;
  }

  std::uint64_t last_enqueued() {
    std::lock_guard<std::mutex> lock(mutex);
    return enqueued;
  }

  bool reached(std::uint64_t seq) const { return completed.load(std::memory_order_acquire) >= seq; }

  // Never blocks; throws StreamError when the work up to `seq` failed.
  bool query(std::uint64_t seq) const {
    if (!reached(seq)) return false;
    failure.throw_if_failed(seq);
    return true;
  }

  void wait(std::uint64_t seq) {
    if (!reached(seq)) {
      std::unique_lock<std::mutex> lock(mutex);
      progressed.wait(lock, [&] { return reached(seq); });
    }
    failure.throw_if_failed(seq);
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (stopping) return;
      stopping = true;
      has_work.notify_one();
    }
    if (worker.joinable()) worker.join();
  }
};

struct StreamState {
  std::mutex mutex;  // CUDA: serialises enqueueing against close(); never held while waiting
  int device = -1;
  void* cuda = nullptr;  // cudaStream_t; null for a CPU stream
  std::atomic<bool> closed{false};
  std::shared_ptr<CpuQueue> cpu;
  std::shared_ptr<Failure> host_failure;  // CUDA: failures of host functions
};

// One CUDA event handle. Shared between an Event and every wait or synchronize still using the
// point it marks, so re-recording or destroying the Event never touches a handle in use.
struct CudaPoint {
  void* event;
  int device;
  explicit CudaPoint(int d) : event(backend::event_create(d)), device(d) {}
  ~CudaPoint() { backend::event_destroy(event, device); }
  CudaPoint(const CudaPoint&) = delete;
  CudaPoint& operator=(const CudaPoint&) = delete;
};

// What an event marks, copied out under the event's mutex: a CPU queue position, a CUDA point, or
// nothing (never recorded).
struct Point {
  std::shared_ptr<CpuQueue> cpu;
  std::uint64_t seq = 0;
  std::shared_ptr<CudaPoint> cuda;
};

struct EventState {
  mutable std::mutex mutex;
  Point point;  // guarded by mutex

  Point snapshot() const {
    std::lock_guard<std::mutex> lock(mutex);
    return point;
  }
};

}  // namespace detail

namespace {

void require_open(const detail::StreamState& s) {
  if (s.closed.load(std::memory_order_relaxed)) throw std::logic_error("Stream is closed");
}

std::string hex(std::uintptr_t value) {
  char text[2 + 2 * sizeof(value) + 1];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

const detail::EventState& event_state(const std::unique_ptr<detail::EventState>& state) {
  if (!state) throw std::logic_error("Event was moved from");
  return *state;
}

// A host function of a CUDA stream: owned by run_host_task, which runs it unless the stream already
// failed, and keeps what it throws (a CUDA host function must not throw, nor call CUDA).
struct HostTask {
  std::function<void()> fn;
  std::shared_ptr<detail::Failure> failure;
};

void run_host_task(void* arg) {
  std::unique_ptr<HostTask> task(static_cast<HostTask*>(arg));
  if (task->failure->failed()) return;
  try {
    task->fn();
  } catch (...) {
    task->failure->keep_current(1);
  }
}

}  // namespace

Stream::Stream(int device) : state_(std::make_shared<detail::StreamState>()) {
  const int count = device < 0 ? 0 : cuda_device_count();
  if (device >= 0 && count > 0) {
    if (device >= count) {
      throw std::invalid_argument("Stream: device " + std::to_string(device) + " out of range (" +
                                  std::to_string(count) + " CUDA devices)");
    }
    state_->device = device;
    state_->host_failure = std::make_shared<detail::Failure>();
    state_->cuda = backend::stream_create(device);
    return;
  }
  state_->cpu = std::make_shared<detail::CpuQueue>();
  detail::CpuQueue* queue = state_->cpu.get();
  state_->cpu->worker = std::thread([queue] { queue->run(); });
}

Stream::~Stream() { close_quietly(); }

Stream::Stream(Stream&&) noexcept = default;

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    close_quietly();
    state_ = std::move(other.state_);
  }
  return *this;
}

bool Stream::is_cuda() const noexcept { return state_ && state_->cuda != nullptr; }
int Stream::device() const noexcept { return state_ ? state_->device : -1; }
std::uintptr_t Stream::handle() const noexcept {
  return state_ ? reinterpret_cast<std::uintptr_t>(state_->cuda) : 0;
}

bool Stream::closed() const noexcept { return !state_ || state_->closed.load(std::memory_order_acquire); }

void Stream::synchronize() {
  if (!state_) return;
  if (state_->cpu) {
    state_->cpu->wait(state_->cpu->last_enqueued());
    return;
  }
  // Mark the end of the queue under the mutex (so close() cannot destroy the stream meanwhile), then
  // wait on that blocking-sync event without it: the caller sleeps instead of spinning in
  // cudaStreamSynchronize, and query()/closed() from other threads never wait behind it.
  std::shared_ptr<detail::CudaPoint> end;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->closed.load(std::memory_order_relaxed)) return;
    end = std::make_shared<detail::CudaPoint>(state_->device);
    backend::event_record(end->event, state_->cuda, state_->device);
  }
  backend::event_synchronize(end->event, end->device);
  state_->host_failure->throw_if_failed(detail::kEverything);
}

bool Stream::query() const {
  if (!state_) return true;
  if (state_->cpu) return state_->cpu->query(state_->cpu->last_enqueued());
  bool done = true;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->closed.load(std::memory_order_relaxed)) return true;
    done = backend::stream_query(state_->cuda, state_->device);  // cudaStreamQuery never waits
  }
  if (done) state_->host_failure->throw_if_failed(detail::kEverything);
  return done;
}

void Stream::wait_for(const Event& event) {
  if (!state_) throw std::logic_error("Stream is closed");
  const detail::Point point = event_state(event.state_).snapshot();
  if (!point.cpu && !point.cuda) return;  // never recorded: complete
  if (point.cpu) {
    if (point.cpu == state_->cpu) return;  // in-order: already satisfied by stream order
    launch_host_func([queue = point.cpu, seq = point.seq] { queue->wait(seq); });
    return;
  }
  if (state_->cpu) {
    // The task holds the CUDA point itself: a later re-record of the event gets a new handle.
    state_->cpu->enqueue([cuda = point.cuda] { backend::event_synchronize(cuda->event, cuda->device); });
    return;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  require_open(*state_);
  backend::stream_wait_event(state_->cuda, state_->device, point.cuda->event);  // captured at this call
}

void Stream::wait_external(std::uintptr_t handle, ExternalKind kind) {
  if (!state_) throw std::logic_error("Stream is closed");
  const char* what = kind == ExternalKind::kStream ? "stream" : "event";
  if (state_->cpu) {
    require_open(*state_);
    if (handle == 0) return;  // a host framework's null stream: its work is already done
    throw std::invalid_argument(std::string("Stream.wait_external: a CPU stream cannot wait on CUDA ") + what +
                                " handle " + hex(handle) + "; only 0 (a host framework's null " + what +
                                ", always complete) is accepted");
  }
  if (kind == ExternalKind::kEvent && handle == 0) {
    throw std::invalid_argument("Stream.wait_external: event handle 0 is not a cudaEvent_t");
  }
  void* foreign = reinterpret_cast<void*>(handle);
  std::lock_guard<std::mutex> lock(state_->mutex);
  require_open(*state_);
  if (kind == ExternalKind::kEvent) {
    backend::stream_wait_event(state_->cuda, state_->device, foreign);
  } else if (foreign != state_->cuda) {  // this very stream: already satisfied by stream order
    backend::stream_wait_stream(state_->cuda, state_->device, foreign);
  }
}

void Stream::copy_async(void* dst, const void* src, std::size_t nbytes) {
  if (!state_) throw std::logic_error("Stream is closed");
  if (nbytes == 0) return;
  if (state_->cpu) {
    state_->cpu->enqueue([dst, src, nbytes] { std::memcpy(dst, src, nbytes); });
    return;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  require_open(*state_);
  backend::memcpy_async(dst, src, nbytes, state_->cuda, state_->device);
}

void Stream::enqueue_sleep(double seconds) {
  if (!state_) throw std::logic_error("Stream is closed");
  if (seconds < 0) throw std::invalid_argument("Stream.enqueue_sleep: negative duration");
  launch_host_func([seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
}

void Stream::launch_host_func(std::function<void()> fn) {
  if (!state_) throw std::logic_error("Stream is closed");
  if (state_->cpu) {
    state_->cpu->enqueue(std::move(fn));
    return;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  require_open(*state_);
  auto task = std::make_unique<HostTask>(HostTask{std::move(fn), state_->host_failure});
  backend::launch_host_func(state_->cuda, state_->device, run_host_task, task.get());
  task.release();  // owned by run_host_task from here on
}

void Stream::close() {
  if (!state_) return;
  if (state_->cpu) {
    state_->cpu->stop();
    if (state_->closed.exchange(true, std::memory_order_acq_rel)) return;
    state_->cpu->failure.throw_if_failed(detail::kEverything);
    return;
  }
  // Drain first; whatever that meets, the stream is destroyed before the error is reported.
  std::exception_ptr pending;
  try {
    synchronize();
  } catch (...) {
    pending = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->closed.exchange(true, std::memory_order_acq_rel)) return;
    backend::stream_destroy(state_->cuda, state_->device);
  }
  if (pending) std::rethrow_exception(pending);
}

void Stream::close_quietly() noexcept {
  try {
    close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hetpipe: closing a Stream (%s) failed: %s\n", is_cuda() ? "CUDA" : "CPU", e.what());
  } catch (...) {
    std::fprintf(stderr, "hetpipe: closing a Stream failed with an exception that is not a std::exception\n");
  }
}

Event::Event() : state_(std::make_unique<detail::EventState>()) {}
Event::~Event() = default;
Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;

void Event::record(Stream& stream) {
  if (!stream.state_) throw std::logic_error("Stream is closed");
  if (!state_) throw std::logic_error("Event was moved from");
  detail::StreamState& s = *stream.state_;
  std::lock_guard<std::mutex> lock(state_->mutex);
  detail::Point& point = state_->point;
  if (s.cpu) {
    std::uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> qlock(s.cpu->mutex);
      if (s.cpu->stopping) throw std::logic_error("Stream is closed");
      seq = s.cpu->enqueued;
    }
    point = detail::Point{s.cpu, seq, nullptr};
    return;
  }
  std::lock_guard<std::mutex> slock(s.mutex);
  require_open(s);
  // Re-record the handle in place only when nothing else holds it. Every other holder (a wait_for
  // task, a synchronize in progress) copied it under this mutex and only ever drops it, so a count
  // of one cannot grow behind our back; a holder drops it after its last CUDA call on it returned.
  const bool reusable = point.cuda && point.cuda->device == s.device && point.cuda.use_count() == 1;
  std::shared_ptr<detail::CudaPoint> cuda = reusable ? point.cuda : std::make_shared<detail::CudaPoint>(s.device);
  backend::event_record(cuda->event, s.cuda, s.device);
  point = detail::Point{nullptr, 0, std::move(cuda)};
}

void Event::synchronize() const {
  const detail::Point point = event_state(state_).snapshot();
  if (point.cuda) {
    backend::event_synchronize(point.cuda->event, point.cuda->device);
  } else if (point.cpu) {
    point.cpu->wait(point.seq);
  }
}

bool Event::query() const {
  const detail::Point point = event_state(state_).snapshot();
  if (point.cuda) return backend::event_query(point.cuda->event, point.cuda->device);
  return !point.cpu || point.cpu->query(point.seq);
}

void copy_async(void* dst, const void* src, std::size_t nbytes, Stream& stream) {
  stream.copy_async(dst, src, nbytes);
}

}  // namespace hetpipe
