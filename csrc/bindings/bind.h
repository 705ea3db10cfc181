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

// A float32, C-contiguous buffer of `name` (TypeError/ValueError naming fn and name otherwise);
// writable when asked. Defined in bind_shard_ops.cc.
pybind11::buffer_info float32_buffer(const pybind11::buffer& b, bool writable, const char* fn, const char* name);

}  // namespace hetpipe::bindings
