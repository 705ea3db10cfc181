// The MPI data planes in one process (mpiexec -n 1): a StageEndpoint sends to itself, and a
// ShardService serves a StageEndpoint of the same rank, so every thread of both (the endpoint's
// progress thread, the service's receiver and worker, the plane's apply threads) runs against the
// caller's thread for real. ctest runs it under ThreadSanitizer or AddressSanitizer when the build
// is instrumented (tests/core/test_ctest.py). Checks are against values computed here, not against
// the planes' own results: every payload is a known function of its message, and every pull reply
// must be the weights of exactly the version it announces.
#include <mpi.h>

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define HETPIPE_TSAN 1
#endif
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "hetpipe/buffer_pool.h"
#include "hetpipe/shard_plane.h"
#include "hetpipe/wire.h"
#include "mpi/shard_service.h"
#include "mpi/stage_endpoint.h"

namespace {

using hetpipe::HeaderWords;
using hetpipe::PinnedBufferPool;
using hetpipe::Received;
using hetpipe::Slot;
namespace wire = hetpipe::wire;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

HeaderWords header(std::int64_t kind, int vw, int stage, std::int64_t mb, std::int64_t aux, std::size_t floats) {
  HeaderWords w{};
  w[wire::kKindWord] = kind;
  w[wire::kVwWord] = vw;
  w[wire::kStageWord] = stage;
  w[wire::kMbWord] = mb;
  w[wire::kAuxWord] = aux;
  w[wire::kDtypeWord] = wire::kFloat32;
  w[wire::kNdimWord] = floats ? 1 : 0;
  w[wire::kNbytesWord] = static_cast<std::int64_t>(4 * floats);
  w[wire::kShapeWord] = static_cast<std::int64_t>(floats);
  return w;
}

// A slot of `floats` floats, waiting for one to come free (the endpoint releases sent ones).
Slot take(PinnedBufferPool& pool, std::size_t floats) {
  return pool.acquire(4 * floats, 30.0);
}

// Activations to itself: 3000 messages of varying sizes, at most 3 in flight, each payload a known
// function of its minibatch number, delivered in order and intact. Payloads above 1000 bytes travel in
// chunks of 1000 (the last one shorter), so most messages are reassembled from several.
void endpoint_sends_to_itself() {
  auto pool = PinnedBufferPool::create(8, 4 * 4096);
  hetpipe::StageEndpoint ep(pool, MPI_COMM_WORLD, 1000);
  const int n = 3000;
  int sent = 0, got = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (got < n) {
    check(std::chrono::steady_clock::now() < deadline, "endpoint loopback: no progress in 120 s");
    check(!ep.failed(), "endpoint loopback: " + ep.error());
    if (sent < n && sent - got < 3) {
      const std::size_t floats = 1 + static_cast<std::size_t>(sent * 37) % 4096;
      Slot slot = take(*pool, floats);
      auto* f = static_cast<float*>(slot.data());
      for (std::size_t i = 0; i < floats; ++i) f[i] = static_cast<float>((sent * 7 + static_cast<int>(i)) % 65536);
      ep.send(0, header(wire::kAct, 0, 0, sent, 0, floats), slot);
      ++sent;
    }
    std::optional<Received> r = ep.try_recv(0, wire::kAct);
    if (!r) {
      std::this_thread::yield();
      continue;
    }
    const std::int64_t mb = r->words[wire::kMbWord];
    check(mb == got, "endpoint loopback: minibatch " + std::to_string(mb) + " arrived, expected " + std::to_string(got));
    const std::size_t floats = 1 + static_cast<std::size_t>(got * 37) % 4096;
    check(r->words[wire::kNbytesWord] == static_cast<std::int64_t>(4 * floats) && r->slot.has_value(),
          "endpoint loopback: wrong payload size");
    const auto* f = static_cast<const float*>(r->slot->data());
    for (std::size_t i = 0; i < floats; ++i) {
      if (f[i] != static_cast<float>((got * 7 + static_cast<int>(i)) % 65536)) {
        check(false, "endpoint loopback: minibatch " + std::to_string(got) + " payload differs at " + std::to_string(i));
      }
    }
    pool->release(*r->slot);
    ++got;
  }
  while (ep.pending_sends() > 0) std::this_thread::yield();
  check(ep.close().empty(), "endpoint loopback: messages lost at close");
  check(pool->available() == pool->num_slots(), "endpoint loopback: a slot was not given back");
}

// Two VWs of two stages push waves to a shard of three layers (mean, D = 1) and pull after each
// push, all through one endpoint; VW v's every delta element is v + 1. The weights of version g are
// therefore 1.5 g everywhere: each reply must be uniformly 1.5 x the version it announces, and the
// final weights 1.5 x the waves. Pushes travel in chunks of 1236 bytes, replies in chunks of 3000.
void service_serves_an_endpoint() {
  const std::vector<std::size_t> numels{1000, 3000, 500};
  const std::vector<std::vector<std::vector<int>>> stage_layers{{{0, 1}, {2}}, {{0, 1}, {2}}};
  hetpipe::ShardPlaneOptions options;
  options.mean = true;
  hetpipe::ShardPlane plane(numels, stage_layers, 1, 2, options);
  for (int l = 0; l < plane.num_layers(); ++l) std::memset(plane.weights(l), 0, 4 * plane.layer_numel(l));
  // One process plays every stage: each (vw, stage)'s messages come from rank 0.
  hetpipe::ShardService service(plane, MPI_COMM_WORLD, 0, true, 3000, std::vector<int>(4, 0));
  service.start();
  auto pool = PinnedBufferPool::create(16, 4 * 4000);
  hetpipe::StageEndpoint ep(pool, MPI_COMM_WORLD, 1236);
  const int waves = 200;
  int replies = 0, pulls = 0;
  auto take_replies = [&](int until_outstanding) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (pulls - replies > until_outstanding) {
      check(std::chrono::steady_clock::now() < deadline, "service loopback: a pull got no reply in 120 s");
      check(!service.failed(), "service loopback: " + service.error());
      check(!ep.failed(), "service loopback: " + ep.error());
      std::optional<Received> r = ep.try_recv(0, wire::kWeights);
      if (!r) {
        std::this_thread::yield();
        continue;
      }
      const std::int64_t g = r->words[wire::kAuxWord];
      const std::int64_t wave = r->words[wire::kMbWord];
      check(g >= wave - 1 && g <= waves, "service loopback: version " + std::to_string(g) + " for wave " +
                                             std::to_string(wave) + " breaks D = 1");
      const auto floats = static_cast<std::size_t>(r->words[wire::kNbytesWord] / 4);
      const auto* f = static_cast<const float*>(r->slot->data());
      for (std::size_t i = 0; i < floats; ++i) {
        if (f[i] != 1.5f * static_cast<float>(g)) {
          check(false, "service loopback: a reply of version " + std::to_string(g) + " holds " + std::to_string(f[i]));
        }
      }
      pool->release(*r->slot);
      ++replies;
    }
  };
  for (int w = 0; w < waves; ++w) {
    for (int vw = 0; vw < 2; ++vw) {
      for (int stage = 0; stage < 2; ++stage) {
        const std::size_t floats = plane.stage_numel(vw, stage);
        Slot slot = take(*pool, floats);
        auto* f = static_cast<float*>(slot.data());
        for (std::size_t i = 0; i < floats; ++i) f[i] = static_cast<float>(vw + 1);
        ep.send(0, header(wire::kPush, vw, stage, -1, w, floats), slot);
        ep.send(0, header(wire::kPull, vw, stage, 0, w + 1, 0), std::nullopt);
        ++pulls;
      }
    }
    take_replies(4);
  }
  take_replies(0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (plane.applied() < waves) {
    check(std::chrono::steady_clock::now() < deadline, "service loopback: the last waves were never applied");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  service.stop();
  check(!service.failed(), "service loopback: " + service.error());
  check(ep.close().empty() && service.lost().empty(), "service loopback: messages lost at close");
  for (int l = 0; l < plane.num_layers(); ++l) {
    const float* f = plane.weights(l);
    for (std::size_t i = 0; i < plane.layer_numel(l); ++i) {
      if (f[i] != 1.5f * waves) check(false, "service loopback: final weights differ in layer " + std::to_string(l));
    }
  }
  check(service.trace().size() == static_cast<std::size_t>(2 * 4 * waves), "service loopback: events missing");
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  check(provided == MPI_THREAD_MULTIPLE, "MPI does not provide MPI_THREAD_MULTIPLE");
  endpoint_sends_to_itself();
  service_serves_an_endpoint();
  std::printf("test_mpi_loopback: ok\n");
  std::fflush(stdout);
#if defined(__SANITIZE_THREAD__) || defined(HETPIPE_TSAN)
  // MPICH's MPI_Finalize crashes under ThreadSanitizer's runtime even in a program that only
  // initialises MPI; every check has passed by now, so the process ends without it (mpiexec accepts
  // a rank that exits 0 without finalising).
  std::_Exit(0);
#else
  MPI_Finalize();
  return 0;
#endif
}
