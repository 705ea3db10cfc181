// Internal: the device-facing primitives, implemented once per backend (cpu/device.cc without CUDA,
// cuda/device.cu with it). Portable code calls these and decides at run time, from
// cuda_device_count(), whether a CUDA path applies; the CPU backend's CUDA entry points throw
// std::logic_error because they are unreachable there.
#pragma once

#include <cstddef>

namespace hetpipe::backend {

struct HostAllocation {
  void* ptr = nullptr;
  bool pinned = false;  // page-locked (cudaHostAlloc)
};

// `bytes` of host memory aligned to `alignment` (a power of two <= 4096); page-locked when a CUDA
// device is usable. Throws std::bad_alloc.
HostAllocation host_alloc(std::size_t bytes, std::size_t alignment);
void host_free(const HostAllocation& allocation) noexcept;

// Opaque CUDA handles (cudaStream_t, cudaEvent_t). Errors throw std::runtime_error naming the call.
void* stream_create(int device);
void stream_destroy(void* stream) noexcept;
bool stream_query(void* stream);
void* event_create(int device);  // blocking-sync event: waiting sleeps instead of spinning
void event_destroy(void* event) noexcept;
void event_record(void* event, void* stream);
bool event_query(void* event);
void event_synchronize(void* event);
void stream_wait_event(void* stream, void* event);
void memcpy_async(void* dst, const void* src, std::size_t nbytes, void* stream);
// Runs fn(arg) on a driver thread once the preceding work of the stream has completed.
void launch_host_func(void* stream, void (*fn)(void*), void* arg);

}  // namespace hetpipe::backend
