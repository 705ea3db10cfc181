#include <cuda_runtime.h>

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

}  // namespace hetpipe
