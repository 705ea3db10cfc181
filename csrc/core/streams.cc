#include "hetpipe/streams.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "core/backend.h"
#include "hetpipe/device.h"

namespace hetpipe {
namespace detail {

// A CPU stream's queue and worker. Kept in a shared_ptr so events recorded on it outlive the Stream.
struct CpuQueue {
  std::mutex mutex;
  std::condition_variable has_work;
  std::condition_variable progressed;
  std::deque<std::function<void()>> tasks;  // guarded by mutex
  std::uint64_t enqueued = 0;               // guarded by mutex; sequence number of the last task
  std::atomic<std::uint64_t> completed{0};  // written under mutex with release
  bool stopping = false;                    // guarded by mutex
  std::thread worker;

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      has_work.wait(lock, [&] { return stopping || !tasks.empty(); });
      if (tasks.empty()) return;
      std::function<void()> task = std::move(tasks.front());
      tasks.pop_front();
      lock.unlock();
      task();
      lock.lock();
      completed.store(completed.load(std::memory_order_relaxed) + 1, std::memory_order_release);
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

  void wait(std::uint64_t seq) {
    if (reached(seq)) return;
    std::unique_lock<std::mutex> lock(mutex);
    progressed.wait(lock, [&] { return reached(seq); });
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
  std::mutex mutex;  // serialises close() against enqueueing on the CUDA path
  int device = -1;
  void* cuda = nullptr;  // cudaStream_t; null for a CPU stream
  bool closed = false;
  std::shared_ptr<CpuQueue> cpu;
};

// A recorded point: a CPU queue position, or a CUDA event.
struct EventState {
  mutable std::mutex mutex;
  std::shared_ptr<CpuQueue> cpu;  // set when last recorded on a CPU stream
  std::uint64_t seq = 0;
  void* cuda = nullptr;  // created on the first record on a CUDA stream
  int cuda_device = -1;
  bool on_cuda = false;  // the last record was on a CUDA stream

  ~EventState() {
    if (cuda != nullptr) backend::event_destroy(cuda);
  }
};

}  // namespace detail

namespace {

void require_open(const detail::StreamState& s) {
  if (s.closed) throw std::logic_error("Stream is closed");
}

void sleep_host(void* arg) {
  auto* seconds = static_cast<double*>(arg);
  std::this_thread::sleep_for(std::chrono::duration<double>(*seconds));
  delete seconds;
}

struct CpuWait {
  std::shared_ptr<detail::CpuQueue> queue;
  std::uint64_t seq;
};

void wait_cpu_point(void* arg) {
  auto* w = static_cast<CpuWait*>(arg);
  w->queue->wait(w->seq);
  delete w;
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
    state_->cuda = backend::stream_create(device);
    return;
  }
  state_->cpu = std::make_shared<detail::CpuQueue>();
  detail::CpuQueue* queue = state_->cpu.get();
  state_->cpu->worker = std::thread([queue] { queue->run(); });
}

Stream::~Stream() {
  if (state_) close();
}

Stream::Stream(Stream&&) noexcept = default;

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (state_) close();
    state_ = std::move(other.state_);
  }
  return *this;
}

bool Stream::is_cuda() const noexcept { return state_ && state_->cuda != nullptr; }
int Stream::device() const noexcept { return state_ ? state_->device : -1; }
std::uintptr_t Stream::handle() const noexcept {
  return state_ ? reinterpret_cast<std::uintptr_t>(state_->cuda) : 0;
}

bool Stream::closed() const noexcept {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->closed;
}

void Stream::synchronize() {
  if (!state_) return;
  if (state_->cpu) {
    state_->cpu->wait(state_->cpu->last_enqueued());
    return;
  }
  // Wait on a blocking-sync event so the caller sleeps instead of spinning in cudaStreamSynchronize.
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->closed) return;
  void* event = backend::event_create(state_->device);
  try {
    backend::event_record(event, state_->cuda);
    backend::event_synchronize(event);
  } catch (...) {
    backend::event_destroy(event);
    throw;
  }
  backend::event_destroy(event);
}

bool Stream::query() const {
  if (!state_) return true;
  if (state_->cpu) return state_->cpu->reached(state_->cpu->last_enqueued());
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->closed || backend::stream_query(state_->cuda);
}

void Stream::wait_for(const Event& event) {
  if (!state_) throw std::logic_error("Stream is closed");
  std::shared_ptr<detail::CpuQueue> point_queue;
  std::uint64_t point_seq = 0;
  void* point_cuda = nullptr;
  {
    std::lock_guard<std::mutex> lock(event.state_->mutex);
    if (event.state_->on_cuda) {
      point_cuda = event.state_->cuda;
    } else if (event.state_->cpu) {
      point_queue = event.state_->cpu;
      point_seq = event.state_->seq;
    } else {
      return;  // never recorded: complete
    }
  }
  if (state_->cpu) {
    if (point_queue) {
      if (point_queue == state_->cpu) return;  // in-order: already satisfied by stream order
      state_->cpu->enqueue([point_queue, point_seq] { point_queue->wait(point_seq); });
    } else {
      // A CUDA point: the event's later re-records are not tracked, as documented for wait_for.
      state_->cpu->enqueue([point_cuda] { backend::event_synchronize(point_cuda); });
    }
    return;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  require_open(*state_);
  if (point_cuda != nullptr) {
    backend::stream_wait_event(state_->cuda, point_cuda);
  } else {
    backend::launch_host_func(state_->cuda, wait_cpu_point, new CpuWait{point_queue, point_seq});
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
  backend::memcpy_async(dst, src, nbytes, state_->cuda);
}

void Stream::enqueue_sleep(double seconds) {
  if (!state_) throw std::logic_error("Stream is closed");
  if (seconds < 0) throw std::invalid_argument("Stream.enqueue_sleep: negative duration");
  if (state_->cpu) {
    state_->cpu->enqueue([seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
    return;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  require_open(*state_);
  backend::launch_host_func(state_->cuda, sleep_host, new double(seconds));
}

void Stream::close() {
  if (!state_) return;
  if (state_->cpu) {
    state_->cpu->stop();
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
    return;
  }
  synchronize();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->closed) return;
  state_->closed = true;
  backend::stream_destroy(state_->cuda);
}

Event::Event() : state_(std::make_unique<detail::EventState>()) {}
Event::~Event() = default;
Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;

void Event::record(Stream& stream) {
  if (!stream.state_) throw std::logic_error("Stream is closed");
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (stream.state_->cpu) {
    state_->cpu = stream.state_->cpu;
    {
      std::lock_guard<std::mutex> qlock(state_->cpu->mutex);
      if (state_->cpu->stopping) throw std::logic_error("Stream is closed");
      state_->seq = state_->cpu->enqueued;
    }
    state_->on_cuda = false;
    return;
  }
  std::lock_guard<std::mutex> slock(stream.state_->mutex);
  require_open(*stream.state_);
  if (state_->cuda != nullptr && state_->cuda_device != stream.state_->device) {
    backend::event_destroy(state_->cuda);
    state_->cuda = nullptr;
  }
  if (state_->cuda == nullptr) {
    state_->cuda = backend::event_create(stream.state_->device);
    state_->cuda_device = stream.state_->device;
  }
  backend::event_record(state_->cuda, stream.state_->cuda);
  state_->on_cuda = true;
  state_->cpu.reset();
}

void Event::synchronize() const {
  std::shared_ptr<detail::CpuQueue> queue;
  std::uint64_t seq = 0;
  void* cuda = nullptr;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->on_cuda) {
      cuda = state_->cuda;
    } else {
      queue = state_->cpu;
      seq = state_->seq;
    }
  }
  if (cuda != nullptr) {
    backend::event_synchronize(cuda);
  } else if (queue) {
    queue->wait(seq);
  }
}

bool Event::query() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->on_cuda) return backend::event_query(state_->cuda);
  return !state_->cpu || state_->cpu->reached(state_->seq);
}

void copy_async(void* dst, const void* src, std::size_t nbytes, Stream& stream) {
  stream.copy_async(dst, src, nbytes);
}

}  // namespace hetpipe
