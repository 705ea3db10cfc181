// Backend with CUDA: page-locked host memory and CUDA streams/events when a device is usable;
// aligned host memory when none is (the build has CUDA, the machine may not).
//
// Every call that touches a device runs under a DeviceGuard: the device's primary context is pushed
// on the calling thread for the call and popped after (driver API, reached through the runtime's
// cudaGetDriverEntryPoint*, so the module links no libcuda and imports on machines without a
// driver). Pushing and popping, unlike cudaSetDevice, restores the thread's state exactly, a thread
// with no current context included: cudaSetDevice back to a "previous" device 0 would open a
// context on GPU 0 that the thread never used.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "core/backend.h"
#include "hetpipe/device.h"

#if CUDART_VERSION < 12000
#error "hetpipe_core needs CUDA 12.0 or newer (cudaGetDriverEntryPoint with a query result)"
#endif

namespace hetpipe {

bool cuda_built() noexcept { return true; }

int cuda_device_count() noexcept {
  int n = 0;
  // No driver or no device is an error code here, not an exception: report zero devices.
  // cudaGetDeviceCount initialises the driver but creates no context.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

namespace backend {
namespace {

void check(cudaError_t err, const char* call) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string(call) + " failed: " + cudaGetErrorString(err));
  }
}

void check_cu(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error(std::string(call) + " failed: CUresult " + std::to_string(static_cast<int>(result)));
  }
}

// The few driver entry points the guard needs, resolved once through the runtime.
struct Driver {
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) retain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) release = nullptr;
  decltype(&::cuDevicePrimaryCtxGetState) get_state = nullptr;
  decltype(&::cuCtxGetCurrent) get_current = nullptr;
  decltype(&::cuCtxPushCurrent) push = nullptr;
  decltype(&::cuCtxPopCurrent) pop = nullptr;
  // Only Stream::wait_external on a foreign stream needs it: resolved apart from `ok`, so a driver
  // without it loses that call alone.
  decltype(&::cuStreamGetCtx) stream_get_ctx = nullptr;
  int device_count = 0;
  // Primary contexts this process retained, one slot per device; retained on first use and held
  // for the life of the process (as the runtime holds the ones it opens).
  std::unique_ptr<std::atomic<CUcontext>[]> contexts;
  bool ok = false;
};

template <class F>
bool resolve(const char* name, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t err = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

const Driver& driver() {
  static const Driver* const instance = [] {
    auto* d = new Driver();  // never freed: contexts stay retained until the process exits
    d->device_count = cuda_device_count();
    if (d->device_count == 0) return d;
    d->ok = resolve("cuDeviceGet", d->device_get) && resolve("cuDevicePrimaryCtxRetain", d->retain) &&
            resolve("cuDevicePrimaryCtxRelease", d->release) &&
            resolve("cuDevicePrimaryCtxGetState", d->get_state) && resolve("cuCtxGetCurrent", d->get_current) &&
            resolve("cuCtxPushCurrent", d->push) && resolve("cuCtxPopCurrent", d->pop);
    if (!resolve("cuStreamGetCtx", d->stream_get_ctx)) d->stream_get_ctx = nullptr;
    d->contexts.reset(new std::atomic<CUcontext>[static_cast<std::size_t>(d->device_count)]);
    for (int i = 0; i < d->device_count; ++i) d->contexts[i].store(nullptr, std::memory_order_relaxed);
    return d;
  }();
  return *instance;
}

// The primary context of `device`, retained once per process (this creates it on first use).
CUcontext primary_context(int device) {
  const Driver& d = driver();
  if (!d.ok) throw std::runtime_error("hetpipe_core: the CUDA driver entry points are unavailable");
  if (device < 0 || device >= d.device_count) {
    throw std::invalid_argument("CUDA device " + std::to_string(device) + " out of range (" +
                                std::to_string(d.device_count) + " CUDA devices)");
  }
  std::atomic<CUcontext>& slot = d.contexts[device];
  // acquire: pairs with the release CAS below, so the context is fully retained when seen.
  if (CUcontext ctx = slot.load(std::memory_order_acquire)) return ctx;
  CUdevice dev = 0;
  check_cu(d.device_get(&dev, device), "cuDeviceGet");
  CUcontext ctx = nullptr;
  check_cu(d.retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  CUcontext expected = nullptr;
  if (!slot.compare_exchange_strong(expected, ctx, std::memory_order_acq_rel)) {
    d.release(dev);  // another thread retained it first: keep one retain only
    return expected;
  }
  return ctx;
}

// RAII: `ctx` is current on this thread for the guard's lifetime; the thread's previous context (or
// none) is current again afterwards. Nothing is pushed when `ctx` is already current.
class ContextGuard {
 public:
  explicit ContextGuard(CUcontext ctx) {
    const Driver& d = driver();
    CUcontext current = nullptr;
    check_cu(d.get_current(&current), "cuCtxGetCurrent");
    if (current != ctx) {
      check_cu(d.push(ctx), "cuCtxPushCurrent");
      pushed_ = true;
    }
  }
  ~ContextGuard() {
    if (pushed_) {
      CUcontext popped = nullptr;
      driver().pop(&popped);
    }
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  bool pushed_ = false;
};

// RAII: `device`'s primary context is current on this thread for the guard's lifetime.
class DeviceGuard : public ContextGuard {
 public:
  explicit DeviceGuard(int device) : ContextGuard(primary_context(device)) {}
};

}  // namespace

HostAllocation host_alloc(std::size_t bytes, std::size_t alignment, int device) {
  const std::size_t n = bytes == 0 ? alignment : bytes;
  std::string why = "host memory was asked for (device -1)";
  if (device >= 0 && cuda_device_count() == 0) {
    why = "no usable CUDA device (cudaGetDeviceCount found none)";
  } else if (device >= 0) {
    const DeviceGuard guard(device);
    void* p = nullptr;
    // cudaHostAlloc returns page-aligned memory, which satisfies any alignment <= 4096.
    const cudaError_t err = cudaHostAlloc(&p, n, cudaHostAllocPortable);
    if (err == cudaSuccess) return {p, true, device, ""};
    cudaGetLastError();
    why = "cudaHostAlloc of " + std::to_string(n) + " bytes through device " + std::to_string(device) +
          " failed: " + cudaGetErrorString(err);
  }
  const std::size_t rounded = (n + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return {p, false, -1, why};
}

void host_free(const HostAllocation& allocation) noexcept {
  if (!allocation.pinned) {
    std::free(allocation.ptr);
    return;
  }
  try {
    const DeviceGuard guard(allocation.device);
    cudaFreeHost(allocation.ptr);
  } catch (const std::exception&) {
    // The driver is gone (process teardown): the memory goes with the process.
  }
}

void* stream_create(int device) {
  const DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

void stream_destroy(void* stream, int device) noexcept {
  try {
    const DeviceGuard guard(device);
    cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  } catch (const std::exception&) {
    // No context to destroy it in (driver shut down): nothing is left to release.
  }
}

bool stream_query(void* stream, int device) {
  const DeviceGuard guard(device);
  const cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaStreamQuery");
  return true;
}

void* event_create(int device) {
  const DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreateWithFlags");
  return e;
}

void event_destroy(void* event, int device) noexcept {
  try {
    const DeviceGuard guard(device);
    cudaEventDestroy(static_cast<cudaEvent_t>(event));
  } catch (const std::exception&) {
    // As stream_destroy.
  }
}

void event_record(void* event, void* stream, int device) {
  const DeviceGuard guard(device);
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)), "cudaEventRecord");
}

bool event_query(void* event, int device) {
  const DeviceGuard guard(device);
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void event_synchronize(void* event, int device) {
  const DeviceGuard guard(device);
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void stream_wait_event(void* stream, int device, void* event) {
  const DeviceGuard guard(device);
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

void stream_wait_stream(void* stream, int device, void* foreign) {
  const DeviceGuard guard(device);
  const Driver& d = driver();
  if (d.stream_get_ctx == nullptr) {
    throw std::runtime_error("cuStreamGetCtx is unavailable in this CUDA driver: cannot wait on a foreign stream");
  }
  // cuEventRecord needs the event in the stream's own context; for the default streams (0, 1, 2)
  // that is the current one, this stream's device's.
  CUcontext ctx = nullptr;
  check_cu(d.stream_get_ctx(static_cast<CUstream>(foreign), &ctx), "cuStreamGetCtx");
  cudaEvent_t marker = nullptr;
  {
    const ContextGuard in_foreign(ctx);
    check(cudaEventCreateWithFlags(&marker, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t recorded = cudaEventRecord(marker, static_cast<cudaStream_t>(foreign));
    if (recorded != cudaSuccess) cudaEventDestroy(marker);
    check(recorded, "cudaEventRecord on the foreign stream");
  }
  const cudaError_t waited = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), marker, 0);
  {
    // The wait captured the recorded point; CUDA releases the event once that work completed.
    const ContextGuard in_foreign(ctx);
    cudaEventDestroy(marker);
  }
  check(waited, "cudaStreamWaitEvent");
}

namespace {

bool on_host(const void* ptr) {
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, ptr), "cudaPointerGetAttributes");
  return attributes.type == cudaMemoryTypeUnregistered || attributes.type == cudaMemoryTypeHost;
}

struct HostCopy {
  void* dst;
  const void* src;
  std::size_t nbytes;
};

void host_copy(void* arg) {
  auto* copy = static_cast<HostCopy*>(arg);
  std::memcpy(copy->dst, copy->src, copy->nbytes);
  delete copy;
}

}  // namespace

void memcpy_async(void* dst, const void* src, std::size_t nbytes, void* stream, int device) {
  const DeviceGuard guard(device);
  auto* s = static_cast<cudaStream_t>(stream);
  // cudaMemcpyAsync between two host buffers is synchronous with respect to the host: it would
  // block the caller until the stream drains. A host function keeps the copy stream-ordered and
  // the call non-blocking, as on the CPU backend.
  if (on_host(dst) && on_host(src)) {
    auto copy = std::make_unique<HostCopy>(HostCopy{dst, src, nbytes});
    check(cudaLaunchHostFunc(s, host_copy, copy.get()), "cudaLaunchHostFunc");
    copy.release();  // owned by host_copy from here on
    return;
  }
  check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
}

void launch_host_func(void* stream, int device, void (*fn)(void*), void* arg) {
  const DeviceGuard guard(device);
  check(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg), "cudaLaunchHostFunc");
}

}  // namespace backend

bool cuda_context_active(int device) noexcept {
  const backend::Driver& d = backend::driver();
  if (!d.ok || device < 0 || device >= d.device_count) return false;
  CUdevice dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (d.device_get(&dev, device) != CUDA_SUCCESS || d.get_state(dev, &flags, &active) != CUDA_SUCCESS) return false;
  return active != 0;
}

}  // namespace hetpipe
