// Python bindings of PinnedBufferPool and Slot (buffer protocol and DLPack export).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bind.h"
#include "bindings/dlpack_abi.h"
#include "bindings/wait.h"
#include "hetpipe/buffer_pool.h"
#include "hetpipe/errors.h"

namespace py = pybind11;

namespace hetpipe::bindings {
namespace {

using dlpack::DLManagedTensor;
using dlpack::DLManagedTensorVersioned;
using dlpack::DLTensor;

// Owns what a DLPack capsule points to; holding the pool keeps the slot memory alive.
template <class Managed>
struct Export {
  Managed managed{};
  std::int64_t shape[1]{};
  std::int64_t strides[1]{1};
  std::shared_ptr<PinnedBufferPool> owner;
};

template <class Managed>
void delete_export(Managed* self) {
  delete static_cast<Export<Managed>*>(self->manager_ctx);
}

// Where a slot lives for DLPack: page-locked memory of a pool pinned through CUDA is kDLCUDAHost,
// ordinary host memory kDLCPU. The memory is portable (every CUDA context sees it), so the id is 0,
// as for kDLCPU.
dlpack::DLDevice slot_device(const Slot& slot) {
  return {slot.pool->pinned() ? dlpack::kDLCUDAHost : dlpack::kDLCPU, 0};
}

void fill(DLTensor& t, const Slot& slot, dlpack::DLDevice device, std::int64_t* shape, std::int64_t* strides) {
  shape[0] = static_cast<std::int64_t>(slot.nbytes());
  t.data = slot.data();
  t.device = device;
  t.ndim = 1;
  t.dtype = {dlpack::kDLUInt, 8, 1};
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = 0;
}

// Capsule destructors: run the deleter only when no consumer took the tensor (the name is unchanged).
void capsule_legacy(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, dlpack::kCapsuleLegacy)) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleLegacy));
    if (m != nullptr && m->deleter != nullptr) m->deleter(m);
  }
}

void capsule_versioned(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, dlpack::kCapsuleVersioned)) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleVersioned));
    if (m != nullptr && m->deleter != nullptr) m->deleter(m);
  }
}

// dl_device: a consumer may ask for the slot's own device, or for kDLCPU (pinned memory is host
// memory too, for a consumer that does not know kDLCUDAHost); the tensor then says what was asked.
py::object to_dlpack(const Slot& slot, const py::object& /*stream*/, const py::object& max_version, const py::object& dl_device,
                     const py::object& copy) {
  dlpack::DLDevice device = slot_device(slot);
  if (!dl_device.is_none()) {
    auto dev = dl_device.cast<py::tuple>();
    const int type = dev.size() == 2 ? dev[0].cast<int>() : -1;
    const bool ok = dev.size() == 2 && dev[1].cast<int>() == 0 && (type == device.device_type || type == dlpack::kDLCPU);
    if (!ok) {
      throw py::buffer_error(std::string("Slot.__dlpack__: a slot lives in ") +
                             (slot.pool->pinned() ? "page-locked host memory (kDLCUDAHost, or kDLCPU)"
                                                  : "host memory (kDLCPU)") +
                             "; cannot export to " + py::str(dl_device).cast<std::string>());
    }
    device.device_type = type;
  }
  if (!copy.is_none() && copy.cast<bool>()) {
    throw py::buffer_error("Slot.__dlpack__: copy=True is not supported; slot exports are zero-copy");
  }
  bool versioned = false;
  if (!max_version.is_none()) versioned = max_version.cast<py::tuple>()[0].cast<int>() >= 1;
  PyObject* capsule = nullptr;
  if (versioned) {
    auto* e = new Export<DLManagedTensorVersioned>();
    e->owner = slot.pool;
    e->managed.version = {dlpack::kMajor, dlpack::kMinor};
    e->managed.manager_ctx = e;
    e->managed.deleter = delete_export<DLManagedTensorVersioned>;
    e->managed.flags = 0;
    fill(e->managed.dl_tensor, slot, device, e->shape, e->strides);
    capsule = PyCapsule_New(&e->managed, dlpack::kCapsuleVersioned, capsule_versioned);
    if (capsule == nullptr) delete e;
  } else {
    auto* e = new Export<DLManagedTensor>();
    e->owner = slot.pool;
    e->managed.manager_ctx = e;
    e->managed.deleter = delete_export<DLManagedTensor>;
    fill(e->managed.dl_tensor, slot, device, e->shape, e->strides);
    capsule = PyCapsule_New(&e->managed, dlpack::kCapsuleLegacy, capsule_legacy);
    if (capsule == nullptr) delete e;
  }
  if (capsule == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace

void bind_buffers(py::module_& m) {
  py::class_<PinnedBufferPool, std::shared_ptr<PinnedBufferPool>>(
      m, "PinnedBufferPool",
      "Fixed-size, 256-byte-aligned slots of host memory, acquired and released lock-free.\n\n"
      "device >= 0: page-locked through that CUDA device's context (the current device is left as it\n"
      "was); device=-1: ordinary host memory and no CUDA call (a rank without a GPU opens no context).\n"
      "Slot memory stays valid while any Slot or exported view (DLPack, buffer protocol) is alive,\n"
      "even after this handle is dropped. Thread-safe.")
      .def(py::init(py::overload_cast<std::size_t, std::size_t, int>(&PinnedBufferPool::create)),
           py::arg("num_slots"), py::arg("slot_bytes"), py::arg("device") = -1)
      .def_static(
          "of_classes",
          [](const std::vector<std::pair<std::size_t, std::size_t>>& classes, int device) {
            std::vector<SlotClass> shape;
            for (const auto& [count, bytes] : classes) shape.push_back({count, bytes});
            return PinnedBufferPool::create(shape, device);
          },
          py::arg("classes"), py::arg("device") = -1,
          "A pool of several size classes, classes = [(num_slots, slot_bytes), ...] in any order: acquire(n)\n"
          "takes a slot of the smallest class holding n bytes, of a larger one while those are in use.")
      .def_property_readonly("num_slots", &PinnedBufferPool::num_slots, "Slots over all classes.")
      .def_property_readonly("slot_bytes", &PinnedBufferPool::slot_bytes,
                             "The largest slot: the most bytes one acquire may ask for.")
      .def_property_readonly(
          "classes",
          [](const PinnedBufferPool& p) {
            std::vector<std::pair<std::size_t, std::size_t>> out;
            for (const SlotClass& c : p.classes()) out.emplace_back(c.count, c.bytes);
            return out;
          },
          "The size classes as (num_slots, slot_bytes), smallest slots first.")
      .def_property_readonly("total_bytes", &PinnedBufferPool::total_bytes,
                             "The bytes the pool allocated (every slot, each rounded up to 256 bytes).")
      .def_property_readonly("pinned", &PinnedBufferPool::pinned, "Page-locked (cudaHostAlloc) memory.")
      .def_property_readonly("pin_error", &PinnedBufferPool::pin_error,
                             "Why the memory is not page-locked ('' when it is): host memory was asked for\n"
                             "(device -1), the core has no CUDA, no device is usable, or CUDA's error.")
      .def_property_readonly("device", &PinnedBufferPool::device,
                             "The CUDA device whose context pinned the memory; -1 when not pinned.")
      .def_property_readonly("closed", &PinnedBufferPool::closed)
      .def("available", &PinnedBufferPool::available,
           "Free slots now, in [0, num_slots] (a snapshot). When one thread does all the acquiring, that\n"
           "many of its acquires succeed without waiting.")
      .def(
          "acquire",
          [](PinnedBufferPool& pool, std::size_t nbytes, std::optional<double> timeout) {
            // The lock-free attempt never blocks, so it runs without dropping the GIL.
            if (auto slot = pool.try_acquire(nbytes, std::chrono::nanoseconds::zero())) return std::move(*slot);
            auto slot = wait_interruptible(timeout, [&](std::chrono::nanoseconds chunk) {
              return pool.try_acquire(nbytes, chunk);
            });
            if (slot) return std::move(*slot);
            throw TimeoutError(pool.exhausted_message(timeout.value_or(0.0)));
          },
          py::arg("nbytes") = 0, py::arg("timeout") = py::none(),
          "A free slot able to hold nbytes (0: any). Blocks with the GIL released up to `timeout` seconds\n"
          "(None: until one is free); raises TimeoutError naming the pool size when none became free,\n"
          "ValueError when nbytes exceeds slot_bytes, RuntimeError after close().")
      .def("release", &PinnedBufferPool::release, py::arg("slot"),
           "Returns a slot. ValueError for a slot of another pool or a double release.")
      .def("close", &PinnedBufferPool::close,
           "Stops further acquires and wakes blocked ones; outstanding slots and views stay valid.")
      .def("__repr__", [](const PinnedBufferPool& p) {
        std::ostringstream s;
        s << "PinnedBufferPool(num_slots=" << p.num_slots() << ", slot_bytes=" << p.slot_bytes();
        if (p.classes().size() > 1) {
          s << ", classes=[";
          for (std::size_t k = 0; k < p.classes().size(); ++k) {
            s << (k ? ", " : "") << "(" << p.classes()[k].count << ", " << p.classes()[k].bytes << ")";
          }
          s << "]";
        }
        s << ", pinned=" << (p.pinned() ? "True" : "False") << ", device=" << p.device()
          << ", available=" << p.available() << ")";
        return s.str();
      });

  py::class_<Slot>(m, "Slot", py::buffer_protocol(),
                   "One acquired slot: a writable 1-D uint8 buffer of `nbytes` bytes, exported zero-copy\n"
                   "through the buffer protocol and DLPack. Return it with pool.release(slot).")
      .def_buffer([](Slot& s) {
        return py::buffer_info(s.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(s.nbytes())}, {1}, false);
      })
      .def_readonly("index", &Slot::index)
      .def_property_readonly("nbytes", &Slot::nbytes)
      .def_property_readonly("ptr", [](const Slot& s) { return reinterpret_cast<std::uintptr_t>(s.data()); })
      .def_readonly("pool", &Slot::pool)
      .def("__dlpack__", &to_dlpack, py::kw_only(), py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
           "A DLPack capsule of the slot (1-D uint8): kDLCUDAHost when the pool is pinned through CUDA,\n"
           "kDLCPU otherwise (dl_device=(1, 0) asks for kDLCPU either way); `stream` is ignored for host memory.")
      .def("__dlpack_device__",
           [](const Slot& s) {
             const dlpack::DLDevice d = slot_device(s);
             return py::make_tuple(d.device_type, d.device_id);
           },
           "(3, 0), kDLCUDAHost, for a slot of a pool pinned through CUDA; (1, 0), kDLCPU, otherwise.")
      .def(
          "numpy",
          [](py::object self, py::object dtype, py::ssize_t count) {
            const Slot& s = self.cast<const Slot&>();
            const py::dtype dt = py::dtype::from_args(dtype);
            const auto itemsize = static_cast<std::size_t>(dt.itemsize());
            const py::ssize_t fits = static_cast<py::ssize_t>(s.nbytes() / itemsize);
            if (count < 0) count = fits;
            if (count > fits) {
              throw py::value_error("Slot.numpy: " + std::to_string(count) + " items of " + std::to_string(itemsize) +
                                    " bytes exceed the slot's " + std::to_string(s.nbytes()) + " bytes");
            }
            return py::array(dt, {count}, {static_cast<py::ssize_t>(itemsize)}, s.data(), self);
          },
          py::arg("dtype") = "float32", py::arg("count") = -1,
          "A writable zero-copy numpy view of the first `count` items (-1: as many as fit).")
      .def("__repr__", [](const Slot& s) {
        return "Slot(index=" + std::to_string(s.index) + ", nbytes=" + std::to_string(s.nbytes()) + ")";
      });
}

}  // namespace hetpipe::bindings
