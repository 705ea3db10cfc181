// Device queries implemented once per backend (cpu/device.cc or cuda/device.cu).
#pragma once

namespace hetpipe {

// Whether this build has the CUDA implementation compiled in.
bool cuda_built() noexcept;

// Number of usable CUDA devices; 0 without CUDA, a driver or a device. Never throws.
int cuda_device_count() noexcept;

// Whether this process holds an active primary context on CUDA device `device` (the driver's
// cuDevicePrimaryCtxGetState): the check that a rank which must not touch a GPU (a PS rank) opened
// none. False without CUDA, a driver or that device. Creates no context; never throws.
bool cuda_context_active(int device) noexcept;

}  // namespace hetpipe
