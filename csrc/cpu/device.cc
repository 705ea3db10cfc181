#include "hetpipe/device.h"

namespace hetpipe {

bool cuda_built() noexcept { return false; }
int cuda_device_count() noexcept { return 0; }

}  // namespace hetpipe
