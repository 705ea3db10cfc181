// Memory that Python hands to the core: an int address, an object exporting the buffer protocol
// (numpy, bytes, a Slot), or one exporting DLPack (__dlpack__ / __dlpack_device__: torch, JAX, CuPy,
// numpy), checked once here so the core only ever sees (pointer, bytes).
//
// DLPack, as a consumer: __dlpack_device__ is read first, and a device the borrower cannot reach is
// refused before the producer does any work. __dlpack__ is called with max_version=(1, 0) (a
// producer that does not take the keyword is called again without it and gives a legacy capsule)
// and, when the array is on a CUDA device and the borrower is a CUDA stream, with stream=<that
// stream's handle>, so the producer orders its pending work before the borrower's (DLPack's stream
// contract). The capsule is renamed "used_dltensor[_versioned]" as it is taken; the managed tensor's
// deleter runs when the Foreign is destroyed (or at once, when a check refuses it).
//
// Checks, each refused with one line naming the function, the argument and its role, the device
// and the reason: a reachable device, a C-contiguous layout (null strides, or compact strides; size-1
// dimensions may have any stride), whole-byte dtypes (bits * lanes a multiple of 8), a writable
// array for a writer (the buffer's readonly flag, DLPack's read-only flag; a legacy capsule carries
// none), a DLPack major version of 1.
//
// Lifetime: a Foreign holds what keeps the memory valid (the buffer view, or the consumed managed
// tensor) until it is destroyed; an int address holds nothing (its owner keeps it valid).
// Thread role: borrow() and the destructor run with the GIL held (releasing a view or calling a
// producer's deleter may touch Python objects); data() and nbytes() may be read without it.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/dlpack_abi.h"

namespace hetpipe::bindings {

// Who borrows the memory, for the checks and the error messages ("copy_async: dst (the destination) ...").
struct Borrower {
  const char* fn;          // "copy_async"
  const char* name;        // the argument, "dst"
  const char* role;        // "destination", or nullptr when the name says it all
  bool writes;             // the memory is written: a read-only array is refused
  bool address_ok = false; // an int address is accepted (unsized: the caller vouches for it)
};

// Where the memory is touched. host: by the CPU (a CPU stream, or code run on the caller's thread),
// which reaches kDLCPU and kDLCUDAHost memory; cuda: by a CUDA stream, which also reaches kDLCUDA and
// kDLCUDAManaged memory, and whose handle a DLPack producer on a CUDA device orders its work before.
struct Reach {
  bool cuda = false;
  std::uintptr_t stream = 0;  // the cudaStream_t of a CUDA stream
  const char* what = "host code";  // for errors: "a CPU stream", "a CUDA stream", "host code"
};

class Foreign {
 public:
  static Foreign borrow(const pybind11::object& obj, const Borrower& who, const Reach& reach);

  Foreign() = default;
  Foreign(Foreign&&) noexcept;
  Foreign& operator=(Foreign&&) noexcept;
  Foreign(const Foreign&) = delete;
  Foreign& operator=(const Foreign&) = delete;
  ~Foreign();  // GIL held

  void* data() const noexcept { return data_; }
  std::size_t nbytes() const noexcept { return nbytes_; }
  bool sized() const noexcept { return sized_; }  // false for an int address
  bool holds() const noexcept { return view_ != nullptr || legacy_ != nullptr || versioned_ != nullptr; }
  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  std::size_t count() const noexcept;  // elements: the product of shape()
  bool float32() const noexcept { return float32_; }
  const std::string& type() const noexcept { return type_; }  // "format 'd' of 8-byte items", "DLPack dtype float64"

 private:
  void release() noexcept;

  void* data_ = nullptr;
  std::size_t nbytes_ = 0;
  bool sized_ = false;
  bool float32_ = false;
  std::string type_;
  std::vector<std::int64_t> shape_;
  std::unique_ptr<pybind11::buffer_info> view_;
  dlpack::DLManagedTensor* legacy_ = nullptr;
  dlpack::DLManagedTensorVersioned* versioned_ = nullptr;
};

// A float32, C-contiguous array borrowed for host code (buffer protocol or DLPack on kDLCPU or
// kDLCUDAHost); writable when asked. TypeError/ValueError naming fn and name otherwise.
Foreign float32_array(const pybind11::object& obj, bool writable, const char* fn, const char* name);

}  // namespace hetpipe::bindings
