// What the compiled core contains and what it can use right now.
#pragma once

#include <string>

namespace hetpipe {

struct BuildInfo {
  std::string version;
  bool cuda_built;         // the CUDA implementation was compiled in
  bool cuda_available;     // a CUDA device is usable now (false without a driver or device)
  int cuda_device_count;   // 0 when CUDA is not built or no device is present
  bool mpi_built;          // the MPI extension hetpipe_core._mpi was built beside the core
};

// Never throws: a missing driver or device reads as "not available".
BuildInfo build_info();

}  // namespace hetpipe
