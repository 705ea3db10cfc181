// MPI return codes as exceptions, for the core's MPI services (shard_service.cc, stage_endpoint.cc).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace hetpipe::mpi {

// An MPI call failed; the message names the call and MPI's error string.
class MpiError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws MpiError unless rc is MPI_SUCCESS. `what` names the call ("MPI_Isend (header)").
inline void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw MpiError(std::string(what) + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

}  // namespace hetpipe::mpi
