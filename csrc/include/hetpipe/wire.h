// The wire protocol between ranks, C++ side: message kinds, the 16-word header, tags, dtype codes.
//
// The definition is python/hetpipe/transport/protocol.py; this header mirrors it for the core's MPI
// services, and tests/core/test_wire.py checks every constant here against it through
// hetpipe_core.wire_protocol(), so the two cannot drift apart.
//
// A message is kHeaderWords int64 words on tag header_tag(kind), then, when the header's nbytes word
// is above zero, nbytes payload bytes on tag payload_tag(kind) from the same sender. Header words:
// kind, vw, stage, mb, aux, dtype code, ndim, nbytes, then up to kMaxNdim shape entries, and last the
// chunk size the payload was cut at (0: one message). A cut payload is consecutive messages of
// chunk bytes (the last one shorter) on the payload tag, in order (chunk_count, chunk_at); the
// receiver posts one receive per chunk. Each sender chooses its chunk size; the receiver reads it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace hetpipe::wire {

constexpr int kHeaderWords = 16;
constexpr int kMaxNdim = kHeaderWords - 9;

// Header word indices.
constexpr int kKindWord = 0, kVwWord = 1, kStageWord = 2, kMbWord = 3, kAuxWord = 4, kDtypeWord = 5,
              kNdimWord = 6, kNbytesWord = 7, kShapeWord = 8, kChunkWord = kHeaderWords - 1;

// The chunk size a sender cuts payloads at unless told otherwise (Python: HETPIPE_CHUNK_BYTES).
constexpr std::int64_t kDefaultChunkBytes = std::int64_t{16} << 20;

// The chunk word for a payload of `nbytes` sent at `chunk` bytes: `chunk` when the payload is larger, else 0.
constexpr std::int64_t chunk_word(std::int64_t nbytes, std::int64_t chunk) {
  return chunk > 0 && chunk < nbytes ? chunk : 0;
}
// Messages a payload of `nbytes` cut at `chunk` (a header's chunk word) travels in.
constexpr std::int64_t chunk_count(std::int64_t nbytes, std::int64_t chunk) {
  return chunk <= 0 || nbytes <= chunk ? 1 : (nbytes + chunk - 1) / chunk;
}
// (offset, length) of message `i` of that payload.
constexpr std::pair<std::int64_t, std::int64_t> chunk_at(std::int64_t nbytes, std::int64_t chunk, std::int64_t i) {
  if (chunk <= 0 || nbytes <= chunk) return {0, nbytes};
  const std::int64_t off = i * chunk;
  return {off, std::min(chunk, nbytes - off)};
}

// Message kinds.
constexpr std::int64_t kAct = 1;      // stage s -> s + 1: output activation of minibatch mb
constexpr std::int64_t kGrad = 2;     // stage s -> s - 1: gradient of the input activation of minibatch mb
constexpr std::int64_t kPush = 3;     // stage -> PS shard: the stage's wave delta (aux = wave)
constexpr std::int64_t kPull = 4;     // stage -> PS shard: request the global weights for wave aux (no payload)
constexpr std::int64_t kWeights = 5;  // PS shard -> stage: mb = the pulled wave, aux = the version g, payload W_g
constexpr std::int64_t kDone = 6;     // stage -> PS shard: the stage finished its stream (aux = pushes sent)
constexpr std::int64_t kTied = 7;     // stage -> stage of its VW: tied-parameter gradients of minibatch mb
constexpr std::int64_t kNorm = 8;     // stage -> stage of its VW: its squared-gradient-norm share (aux: float64 bits)
constexpr std::int64_t kEval = 9;     // stage s -> s + 1 of VW 0: output activation of evaluation minibatch mb
constexpr std::int64_t kVerdict = 10; // last stage of VW 0 -> its other stages: mb = wave, aux = stop-after or -1

// A PUSH's mb word: -1, or the wave after which the run stops; a WEIGHTS reply whose aux is kStopped
// (no payload) answers a pull of a wave after that one.
constexpr std::int64_t kStopped = -2;

struct Kind {
  const char* name;
  std::int64_t value;
};
constexpr std::array<Kind, 10> kKinds{{{"ACT", kAct}, {"GRAD", kGrad}, {"PUSH", kPush}, {"PULL", kPull},
                                       {"WEIGHTS", kWeights}, {"DONE", kDone}, {"TIED", kTied}, {"NORM", kNorm},
                                       {"EVAL", kEval}, {"VERDICT", kVerdict}}};

// Wire dtypes by torch's names; a header carries the index + 1.
constexpr std::array<const char*, 8> kDtypes{"float32", "float64", "float16", "bfloat16",
                                              "int64",   "int32",   "uint8",   "bool"};
constexpr std::int64_t kFloat32 = 1;

constexpr int header_tag(std::int64_t kind) { return static_cast<int>(2 * kind); }
constexpr int payload_tag(std::int64_t kind) { return static_cast<int>(2 * kind + 1); }

}  // namespace hetpipe::wire
