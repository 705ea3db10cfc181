// Internal: the device-facing primitives, implemented once per backend (cpu/device.cc without CUDA,
// cuda/device.cu with it). Portable code calls these and decides at run time, from
// cuda_device_count(), whether a CUDA path applies; the CPU backend's CUDA entry points throw
// std::logic_error because they are unreachable there.
//
// Devices: every CUDA entry point names the device its handle lives on and runs with that device's
// primary context pushed on the calling thread for the duration of the call (cuda/device.cu's
// DeviceGuard), then pops it. So no call here changes the thread's current device, and none
// creates a context on a device other than the one named (a thread that never touched CUDA stays
// without a current context; a CPU worker thread waiting on a CUDA event opens nothing on GPU 0).
#pragma once

#include <cstddef>
#include <string>

namespace hetpipe::backend {

struct HostAllocation {
  void* ptr = nullptr;
  bool pinned = false;  // page-locked (cudaHostAlloc)
  int device = -1;      // the device whose context pinned it; -1 when not pinned
  std::string why;      // why it is not pinned; empty when it is
};

// `bytes` of host memory aligned to `alignment` (a power of two <= 4096). device < 0: ordinary
// host memory, and no CUDA call at all. device >= 0 and usable: page-locked through that device's
// context (portable to every context); ordinary memory when pinning fails, with the reason in `why`
// (the caller decides whether that is an error). Throws std::bad_alloc.
HostAllocation host_alloc(std::size_t bytes, std::size_t alignment, int device);
void host_free(const HostAllocation& allocation) noexcept;

// Opaque CUDA handles (cudaStream_t, cudaEvent_t) and the device each lives on. Errors throw
// std::runtime_error naming the call.
void* stream_create(int device);
void stream_destroy(void* stream, int device) noexcept;
bool stream_query(void* stream, int device);
void* event_create(int device);  // blocking-sync event: waiting sleeps instead of spinning
void event_destroy(void* event, int device) noexcept;
void event_record(void* event, void* stream, int device);
bool event_query(void* event, int device);
void event_synchronize(void* event, int device);
void stream_wait_event(void* stream, int device, void* event);  // `event` may be of any device
// Makes `stream` wait for the work enqueued so far on `foreign`, a cudaStream_t of any context (0,
// 1, 2: the default streams as seen from `device`): a transient event is recorded on `foreign` in
// that stream's own context, waited for, and destroyed (CUDA frees it once it completed).
void stream_wait_stream(void* stream, int device, void* foreign);
void memcpy_async(void* dst, const void* src, std::size_t nbytes, void* stream, int device);
// Runs fn(arg) on a driver thread once the preceding work of the stream has completed. fn must not
// throw (a host function that throws ends the process).
void launch_host_func(void* stream, int device, void (*fn)(void*), void* arg);

}  // namespace hetpipe::backend
