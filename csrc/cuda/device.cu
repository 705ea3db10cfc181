// Backend with CUDA: page-locked host memory and CUDA streams/events when a device is usable;
// aligned host memory when none is (the build has CUDA, the machine may not).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "core/backend.h"
#include "hetpipe/device.h"

namespace hetpipe {

bool cuda_built() noexcept { return true; }

int cuda_device_count() noexcept {
  int n = 0;
  // No driver or no device is an error code here, not an exception: report zero devices.
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

}  // namespace

HostAllocation host_alloc(std::size_t bytes, std::size_t alignment) {
  const std::size_t n = bytes == 0 ? alignment : bytes;
  if (cuda_device_count() > 0) {
    void* p = nullptr;
    // cudaHostAlloc returns page-aligned memory, which satisfies any alignment <= 4096.
    if (cudaHostAlloc(&p, n, cudaHostAllocPortable) == cudaSuccess) return {p, true};
    cudaGetLastError();
  }
  const std::size_t rounded = (n + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  return {p, false};
}

void host_free(const HostAllocation& allocation) noexcept {
  if (allocation.pinned) {
    cudaFreeHost(allocation.ptr);
  } else {
    std::free(allocation.ptr);
  }
}

void* stream_create(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

void stream_destroy(void* stream) noexcept { cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }

bool stream_query(void* stream) {
  const cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaStreamQuery");
  return true;
}

void* event_create(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreateWithFlags");
  return e;
}

void event_destroy(void* event) noexcept { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

void event_record(void* event, void* stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)), "cudaEventRecord");
}

bool event_query(void* event) {
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void event_synchronize(void* event) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(event)), "cudaEventSynchronize");
}

void stream_wait_event(void* stream, void* event) {
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
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

void memcpy_async(void* dst, const void* src, std::size_t nbytes, void* stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  // cudaMemcpyAsync between two host buffers is synchronous with respect to the host: it would
  // block the caller until the stream drains. A host function keeps the copy stream-ordered and
  // the call non-blocking, as on the CPU backend.
  if (on_host(dst) && on_host(src)) {
    auto copy = std::make_unique<HostCopy>(HostCopy{dst, src, nbytes});
    launch_host_func(stream, host_copy, copy.get());
    copy.release();  // owned by host_copy from here on
    return;
  }
  check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s), "cudaMemcpyAsync");
}

void launch_host_func(void* stream, void (*fn)(void*), void* arg) {
  check(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg), "cudaLaunchHostFunc");
}

}  // namespace backend
}  // namespace hetpipe
