// hetpipe_core.wire_protocol(): the C++ side of the wire protocol (hetpipe/wire.h), for the test that
// holds it against the Python definition (python/hetpipe/transport/protocol.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings/bind.h"
#include "hetpipe/wire.h"

namespace py = pybind11;

namespace hetpipe::bindings {

void bind_wire(py::module_& m) {
  m.def("wire_protocol", [] {
    py::dict kinds;
    for (const auto& k : wire::kKinds) kinds[k.name] = k.value;
    std::vector<std::string> dtypes(wire::kDtypes.begin(), wire::kDtypes.end());
    py::dict tags;
    for (const auto& k : wire::kKinds) tags[k.name] = py::make_tuple(wire::header_tag(k.value), wire::payload_tag(k.value));
    py::dict d;
    d["header_words"] = wire::kHeaderWords;
    d["max_ndim"] = wire::kMaxNdim;
    d["kinds"] = kinds;
    d["dtypes"] = dtypes;
    d["tags"] = tags;
    d["stopped"] = wire::kStopped;
    d["fields"] = py::make_tuple(wire::kKindWord, wire::kVwWord, wire::kStageWord, wire::kMbWord, wire::kAuxWord,
                                 wire::kDtypeWord, wire::kNdimWord, wire::kNbytesWord, wire::kShapeWord);
    d["chunk_word"] = wire::kChunkWord;
    d["default_chunk_bytes"] = wire::kDefaultChunkBytes;
    return d;
  }, "The wire protocol as the core's MPI services use it (hetpipe/wire.h): header_words, max_ndim, kinds\n"
     "by name, dtypes in code order (code = index + 1), tags per kind (header, payload), and the header\n"
     "word index of kind, vw, stage, mb, aux, dtype, ndim, nbytes and the first shape entry; stopped: the\n"
     "aux of a WEIGHTS reply to a pull after an early stop; chunk_word: the word holding the chunk size a\n"
     "payload was cut at; default_chunk_bytes: the core's chunk size unless told otherwise.");
}

}  // namespace hetpipe::bindings
