#include "hetpipe/build_info.h"

#include "hetpipe/device.h"

namespace hetpipe {

BuildInfo build_info() {
  BuildInfo info;
  info.version = HETPIPE_VERSION;
  info.cuda_built = cuda_built();
  info.cuda_device_count = cuda_device_count();
  info.cuda_available = info.cuda_device_count > 0;
#ifdef HETPIPE_WITH_MPI
  info.mpi_built = true;
#else
  info.mpi_built = false;
#endif
  return info;
}

}  // namespace hetpipe
