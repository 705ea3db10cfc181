// Device queries implemented once per backend (cpu/device.cc or cuda/device.cu).
#pragma once

namespace hetpipe {

// Whether this build has the CUDA implementation compiled in.
bool cuda_built() noexcept;

// Number of usable CUDA devices; 0 without CUDA, a driver or a device. Never throws.
int cuda_device_count() noexcept;

}  // namespace hetpipe
