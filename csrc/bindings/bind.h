// Each area of the core binds itself into the module; module.cc calls these in order.
#pragma once

#include <pybind11/pybind11.h>

namespace hetpipe::bindings {

void bind_buffers(pybind11::module_& m);
void bind_streams(pybind11::module_& m);
void bind_clock(pybind11::module_& m);
void bind_shard_ops(pybind11::module_& m);
void bind_shard_plane(pybind11::module_& m);
void bind_wire(pybind11::module_& m);

}  // namespace hetpipe::bindings
