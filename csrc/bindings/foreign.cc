// Borrowing foreign memory from Python: int addresses, the buffer protocol, DLPack (see foreign.h).
#include "bindings/foreign.h"

#include <pybind11/pybind11.h>

#include <string>
#include <utility>

namespace py = pybind11;

namespace hetpipe::bindings {
namespace {

using dlpack::DLDataType;
using dlpack::DLDevice;
using dlpack::DLManagedTensor;
using dlpack::DLManagedTensorVersioned;
using dlpack::DLTensor;

std::string device_name(DLDevice d) {
  const char* name = nullptr;
  switch (d.device_type) {
    case dlpack::kDLCPU: name = "kDLCPU"; break;
    case dlpack::kDLCUDA: name = "kDLCUDA"; break;
    case dlpack::kDLCUDAHost: name = "kDLCUDAHost"; break;
    case dlpack::kDLOpenCL: name = "kDLOpenCL"; break;
    case dlpack::kDLVulkan: name = "kDLVulkan"; break;
    case dlpack::kDLMetal: name = "kDLMetal"; break;
    case dlpack::kDLVPI: name = "kDLVPI"; break;
    case dlpack::kDLROCM: name = "kDLROCM"; break;
    case dlpack::kDLROCMHost: name = "kDLROCMHost"; break;
    case dlpack::kDLExtDev: name = "kDLExtDev"; break;
    case dlpack::kDLCUDAManaged: name = "kDLCUDAManaged"; break;
    case dlpack::kDLOneAPI: name = "kDLOneAPI"; break;
    case dlpack::kDLWebGPU: name = "kDLWebGPU"; break;
    case dlpack::kDLHexagon: name = "kDLHexagon"; break;
    case dlpack::kDLMAIA: name = "kDLMAIA"; break;
    default: break;
  }
  const std::string type = name != nullptr ? name : "device type " + std::to_string(d.device_type);
  return type + ":" + std::to_string(d.device_id);
}

std::string dtype_name(DLDataType t) {
  const char* code = nullptr;
  switch (t.code) {
    case dlpack::kDLInt: code = "int"; break;
    case dlpack::kDLUInt: code = "uint"; break;
    case dlpack::kDLFloat: code = "float"; break;
    case dlpack::kDLOpaqueHandle: code = "handle"; break;
    case dlpack::kDLBfloat: code = "bfloat"; break;
    case dlpack::kDLComplex: code = "complex"; break;
    case dlpack::kDLBool: code = "bool"; break;
    default: break;
  }
  std::string name = code != nullptr ? code + std::to_string(t.bits)
                                     : "code " + std::to_string(t.code) + " of " + std::to_string(t.bits) + " bits";
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return name;
}

// The CPU reaches host memory, page-locked or not; a CUDA stream also reaches device memory.
bool host_memory(std::int32_t type) {
  return type == dlpack::kDLCPU || type == dlpack::kDLCUDAHost || type == dlpack::kDLROCMHost;
}
bool cuda_memory(std::int32_t type) { return type == dlpack::kDLCUDA || type == dlpack::kDLCUDAManaged; }

// "copy_async: dst (the destination)", "copy_async: dst (the destination, DLPack kDLCPU:0)",
// "apply_delta: shard (DLPack kDLCPU:0)", "apply_delta: shard".
std::string subject(const Borrower& who, const std::string& where = "") {
  std::string s = std::string(who.fn) + ": " + who.name;
  if (who.role != nullptr && !where.empty()) return s + " (the " + who.role + ", " + where + ")";
  if (who.role != nullptr) return s + " (the " + who.role + ")";
  if (!where.empty()) return s + " (" + where + ")";
  return s;
}

// A shape or strides as Python writes a tuple: (), (10,), (2, 3).
template <class T>
std::string dims(const T* v, std::int32_t n) {
  std::string s = "(";
  for (std::int32_t i = 0; i < n; ++i) s += (i > 0 ? ", " : "") + std::to_string(v[i]);
  return s + (n == 1 ? ",)" : ")");
}

// Compact row-major strides, in units of `unit` (bytes for the buffer protocol, elements for DLPack);
// size-1 dimensions may have any stride, and an empty array is contiguous whatever its strides.
template <class T>
bool compact(const T* shape, const T* strides, std::int32_t ndim, std::int64_t unit) {
  for (std::int32_t d = 0; d < ndim; ++d) {
    if (shape[d] == 0) return true;
  }
  std::int64_t expected = unit;
  for (std::int32_t d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && static_cast<std::int64_t>(strides[d]) != expected) return false;
    expected *= static_cast<std::int64_t>(shape[d]);
  }
  return true;
}

void check_reach(DLDevice device, const Borrower& who, const Reach& reach) {
  if (host_memory(device.device_type) || (reach.cuda && cuda_memory(device.device_type))) return;
  throw py::value_error(subject(who) + " is on " + device_name(device) + ", which " + reach.what + " cannot reach");
}

// Calls __dlpack__ as a DLPack >= 1.0 consumer, or as a legacy one when the producer does not take
// max_version. An error of the producer is raised again with the borrower named, chained to it.
py::object call_dlpack(const py::object& obj, const py::object& stream, const Borrower& who) {
  py::object fn = obj.attr("__dlpack__");
  py::dict kwargs;
  if (!stream.is_none()) kwargs["stream"] = stream;
  try {
    kwargs["max_version"] = py::make_tuple(dlpack::kMajor, dlpack::kMinor);
    try {
      return fn(**kwargs);
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;
    }
    PyDict_DelItemString(kwargs.ptr(), "max_version");
    return fn(**kwargs);
  } catch (py::error_already_set& e) {
    const std::string cause = py::str(e.type().attr("__name__")).cast<std::string>() + ": " +
                              py::str(e.value()).cast<std::string>();
    py::raise_from(e, e.type().ptr(), (subject(who) + ": __dlpack__ failed: " + cause).c_str());
    throw py::error_already_set();
  }
}

}  // namespace

Foreign::Foreign(Foreign&& other) noexcept { *this = std::move(other); }

Foreign& Foreign::operator=(Foreign&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    nbytes_ = other.nbytes_;
    sized_ = other.sized_;
    float32_ = other.float32_;
    type_ = std::move(other.type_);
    shape_ = std::move(other.shape_);
    view_ = std::move(other.view_);
    legacy_ = std::exchange(other.legacy_, nullptr);
    versioned_ = std::exchange(other.versioned_, nullptr);
  }
  return *this;
}

Foreign::~Foreign() { release(); }

void Foreign::release() noexcept {
  view_.reset();  // PyBuffer_Release
  if (DLManagedTensorVersioned* m = std::exchange(versioned_, nullptr)) {
    if (m->deleter != nullptr) m->deleter(m);
  }
  if (DLManagedTensor* m = std::exchange(legacy_, nullptr)) {
    if (m->deleter != nullptr) m->deleter(m);
  }
}

std::size_t Foreign::count() const noexcept {
  if (!sized_) return 0;
  std::size_t n = 1;
  for (const std::int64_t d : shape_) n *= static_cast<std::size_t>(d);
  return n;
}

Foreign Foreign::borrow(const py::object& obj, const Borrower& who, const Reach& reach) {
  Foreign f;
  if (who.address_ok && py::isinstance<py::int_>(obj)) {
    f.data_ = reinterpret_cast<void*>(obj.cast<std::uintptr_t>());
    return f;
  }

  if (PyObject_CheckBuffer(obj.ptr())) {
    f.view_ = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(obj).request(false));
    const py::buffer_info& v = *f.view_;
    if (who.writes && v.readonly) throw py::value_error(subject(who) + " is read-only");
    if (!compact(v.shape.data(), v.strides.data(), static_cast<std::int32_t>(v.ndim), v.itemsize)) {
      throw py::value_error(subject(who) + " must be C-contiguous, got shape " +
                            dims(v.shape.data(), static_cast<std::int32_t>(v.ndim)) + " with strides " +
                            dims(v.strides.data(), static_cast<std::int32_t>(v.ndim)) + " bytes");
    }
    f.data_ = v.ptr;
    f.nbytes_ = static_cast<std::size_t>(v.size * v.itemsize);
    f.sized_ = true;
    f.shape_.assign(v.shape.begin(), v.shape.end());
    std::string format = v.format;
    f.type_ = "format '" + format + "' of " + std::to_string(v.itemsize) + "-byte items";
    if (!format.empty() && (format[0] == '<' || format[0] == '=' || format[0] == '@')) format = format.substr(1);
    f.float32_ = format == "f" && v.itemsize == 4;
    return f;
  }

  if (!py::hasattr(obj, "__dlpack__")) {
    throw py::type_error(subject(who) + " must be " + (who.address_ok ? "an int address, " : "") +
                         "an object with the buffer protocol or a DLPack array (__dlpack__), got " +
                         py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());
  }
  // The device first: a device this borrower cannot reach is refused before the producer works.
  py::object stream = py::none();
  if (py::hasattr(obj, "__dlpack_device__")) {
    const py::tuple announced = obj.attr("__dlpack_device__")();
    if (announced.size() != 2) throw py::type_error(subject(who) + ": __dlpack_device__() must return (type, id)");
    const DLDevice device{announced[0].cast<std::int32_t>(), announced[1].cast<std::int32_t>()};
    check_reach(device, who, reach);
    if (reach.cuda && cuda_memory(device.device_type)) stream = py::int_(reach.stream);
  }
  py::object capsule = call_dlpack(obj, stream, who);

  // Take the tensor: from the rename on, the capsule's destructor leaves it to us (and f's deleter call).
  PyObject* c = capsule.ptr();
  const DLTensor* t = nullptr;
  bool read_only = false;
  if (PyCapsule_IsValid(c, dlpack::kCapsuleVersioned)) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, dlpack::kCapsuleVersioned));
    if (PyCapsule_SetName(c, dlpack::kCapsuleVersionedUsed) != 0) throw py::error_already_set();
    f.versioned_ = m;
    if (m->version.major != dlpack::kMajor) {
      throw py::value_error(subject(who) + " is a DLPack " + std::to_string(m->version.major) + "." +
                            std::to_string(m->version.minor) + " tensor; this build reads DLPack 1.x");
    }
    t = &m->dl_tensor;
    read_only = (m->flags & dlpack::kFlagReadOnly) != 0;
  } else if (PyCapsule_IsValid(c, dlpack::kCapsuleLegacy)) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, dlpack::kCapsuleLegacy));
    if (PyCapsule_SetName(c, dlpack::kCapsuleLegacyUsed) != 0) throw py::error_already_set();
    f.legacy_ = m;
    t = &m->dl_tensor;
  } else {
    throw py::type_error(subject(who) + ": __dlpack__() returned " +
                         py::str(py::type::handle_of(capsule).attr("__name__")).cast<std::string>() +
                         ", not an unconsumed DLPack capsule");
  }

  // The tensor's own device is authoritative (__dlpack_device__ may be missing).
  check_reach(t->device, who, reach);
  const std::string where = "DLPack " + device_name(t->device);
  f.type_ = "DLPack dtype " + dtype_name(t->dtype);
  if (t->ndim < 0 || (t->ndim > 0 && t->shape == nullptr)) {
    throw py::value_error(subject(who, where) + " has an invalid shape (ndim " + std::to_string(t->ndim) + ")");
  }
  for (std::int32_t d = 0; d < t->ndim; ++d) {
    if (t->shape[d] < 0) throw py::value_error(subject(who, where) + " has a negative dimension in shape " + dims(t->shape, t->ndim));
  }
  const unsigned bits = static_cast<unsigned>(t->dtype.bits) * t->dtype.lanes;
  if (bits == 0 || bits % 8 != 0) {
    throw py::value_error(subject(who, where) + " has dtype " + dtype_name(t->dtype) +
                          "; only whole-byte element types can be copied");
  }
  if (t->strides != nullptr && !compact(t->shape, t->strides, t->ndim, 1)) {
    throw py::value_error(subject(who, where) + " must be C-contiguous, got shape " + dims(t->shape, t->ndim) +
                          " with strides " + dims(t->strides, t->ndim) + " elements");
  }
  if (who.writes && read_only) throw py::value_error(subject(who, where) + " is read-only (DLPack flags)");
  f.shape_.assign(t->shape, t->shape + t->ndim);
  f.sized_ = true;
  f.nbytes_ = f.count() * (bits / 8);
  f.data_ = static_cast<char*>(t->data) + t->byte_offset;
  f.float32_ = t->dtype.code == dlpack::kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1;
  return f;
}

Foreign float32_array(const py::object& obj, bool writable, const char* fn, const char* name) {
  Foreign f = Foreign::borrow(obj, Borrower{fn, name, nullptr, writable}, Reach{});
  if (!f.float32()) throw py::type_error(std::string(fn) + ": " + name + " must be float32, got " + f.type());
  return f;
}

}  // namespace hetpipe::bindings
