// Backend without CUDA: aligned host memory; the CUDA entry points are unreachable.
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#include "core/backend.h"
#include "hetpipe/device.h"

namespace hetpipe {

bool cuda_built() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }
bool cuda_context_active(int) noexcept { return false; }

namespace backend {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw std::logic_error(std::string(what) + ": hetpipe_core was built without CUDA");
}

}  // namespace

HostAllocation host_alloc(std::size_t bytes, std::size_t alignment, int device) {
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
  if (p == nullptr) throw std::bad_alloc();
  return {p, false, -1, device < 0 ? "host memory was asked for (device -1)" : "hetpipe_core was built without CUDA"};
}

void host_free(const HostAllocation& allocation) noexcept { std::free(allocation.ptr); }

void* stream_create(int) { no_cuda("stream_create"); }
void stream_destroy(void*, int) noexcept {}
bool stream_query(void*, int) { no_cuda("stream_query"); }
void* event_create(int) { no_cuda("event_create"); }
void event_destroy(void*, int) noexcept {}
void event_record(void*, void*, int) { no_cuda("event_record"); }
bool event_query(void*, int) { no_cuda("event_query"); }
void event_synchronize(void*, int) { no_cuda("event_synchronize"); }
void stream_wait_event(void*, int, void*) { no_cuda("stream_wait_event"); }
void stream_wait_stream(void*, int, void*) { no_cuda("stream_wait_stream"); }
void memcpy_async(void*, const void*, std::size_t, void*, int) { no_cuda("memcpy_async"); }
void launch_host_func(void*, int, void (*)(void*), void*) { no_cuda("launch_host_func"); }

}  // namespace backend
}  // namespace hetpipe
