// Backend without CUDA: aligned host memory; the CUDA entry points are unreachable.
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "core/backend.h"
#include "hetpipe/device.h"

namespace hetpipe {

bool cuda_built() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }

namespace backend {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  throw std::logic_error(std::string(what) + ": hetpipe_core was built without CUDA");
}

}  // namespace

HostAllocation host_alloc(std::size_t bytes, std::size_t alignment) {
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded == 0 ? alignment : rounded);
  if (p == nullptr) throw std::bad_alloc();
  return {p, false};
}

void host_free(const HostAllocation& allocation) noexcept { std::free(allocation.ptr); }

void* stream_create(int) { no_cuda("stream_create"); }
void stream_destroy(void*) noexcept {}
bool stream_query(void*) { no_cuda("stream_query"); }
void* event_create(int) { no_cuda("event_create"); }
void event_destroy(void*) noexcept {}
void event_record(void*, void*) { no_cuda("event_record"); }
bool event_query(void*) { no_cuda("event_query"); }
void event_synchronize(void*) { no_cuda("event_synchronize"); }
void stream_wait_event(void*, void*) { no_cuda("stream_wait_event"); }
void memcpy_async(void*, const void*, std::size_t, void*) { no_cuda("memcpy_async"); }
void launch_host_func(void*, void (*)(void*), void*) { no_cuda("launch_host_func"); }

}  // namespace backend
}  // namespace hetpipe
