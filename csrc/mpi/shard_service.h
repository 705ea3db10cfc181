// ShardService: a PS shard rank's receive/serve path over MPI, on the core's own threads.
//
// Wire format (hetpipe/wire.h, mirroring python/hetpipe/transport/protocol.py): 16 int64 header words on tag
// 2 * kind, then, when the header's nbytes > 0, the payload on tag 2 * kind + 1, from the same sender.
// MPI's non-overtaking rule (one sender, one tag) pairs each payload with its header. A push arrives in
// the chunks its header announces (one receive per chunk, straight into the pending buffer); a reply
// above the service's chunk size leaves in chunks of that size.
//
// Threads (both started by start(), both joined by stop()):
// - the receiver owns every receive: it keeps a header receive posted for PUSH and one for PULL (any
//   source), receives each push's payload straight into the ShardPlane's pending buffer (begin_push,
//   no intermediate copy), ends the push when its payload completed (end_push: clocks advance) and
//   queues pulls for the worker.
// - the worker owns every send and is the plane's only applier: it applies the waves the global clock
//   passed (apply_ready: apply_delta's threads), then answers the queued pulls the staleness bound
//   allows, in arrival order, with a WEIGHTS header and the reply sent in place from the weights when
//   it is one contiguous piece (a stage's layers lie back to back in the plane: no snapshot copy),
//   else packed into the stage's reply buffer. While a reply is in flight the worker applies nothing,
//   so what it sends is exactly the version it announced.
// Neither thread blocks in MPI: requests are polled (MPI_Test) with a back-off sleep (20 us doubling
// to 1 ms) while nothing moves, so stop() ends both within about a millisecond plus one wave's apply.
// The clocks are the plane's ClockTables (lock-free reads); the queue of pulls is under queue_mutex_.
// A failure in either thread (a malformed or duplicate push, a broken clock bound, an MPI error) is
// kept as the first error (error()), and both threads stop; no exception leaves a thread. A message
// that breaks the protocol is blamed on its transport source (error_source()), never on the VW and
// stage its header claims; a header claiming a (vw, stage) whose rank (`sources`) is not the sender's
// is refused by name.
//
// Calling contract: MPI is initialised with MPI_THREAD_MULTIPLE (the caller's mpi4py keeps receiving
// other kinds, e.g. DONE, on the same communicator); while the service runs nobody else pushes to,
// pulls from or applies on the plane; the plane outlives the service. Every method is called from one
// controlling thread (the rank's main thread), except the const accessors, which any thread may call.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hetpipe/shard_plane.h"
#include "hetpipe/wire.h"

namespace hetpipe {

// One push received or one pull answered, for the rank's timeline. Times are steady_clock seconds.
struct ShardServiceEvent {
  bool push;                // false: a pull
  int vw, stage;
  std::int64_t wave;
  double start_s, end_s;    // push: header arrived .. payload complete; pull: request arrived .. reply sent
  std::int64_t from, to;    // push: the global clock before and after it; pull: g (from == to)
};

class ShardService {
 public:
  // comm: the MPI communicator the stages send on (mpi4py's handle). shard: the shard's index (messages).
  // trace: keep a ShardServiceEvent per push and pull. chunk_bytes: the size replies are cut at (0: one
  // message each; std::invalid_argument below 0). Throws std::runtime_error when MPI is not initialised
  // with MPI_THREAD_MULTIPLE.
  // sources: the rank in `comm` of each (vw, stage), VW by VW, stage by stage; empty: plan order (the
  // k-th stage of that order is rank k, as hetpipe numbers a run's communicator).
  ShardService(ShardPlane& plane, MPI_Comm comm, int shard, bool trace,
               std::int64_t chunk_bytes = wire::kDefaultChunkBytes, std::vector<int> sources = {});
  ShardService(const ShardService&) = delete;
  ShardService& operator=(const ShardService&) = delete;
  ~ShardService();  // stop()

  void start();
  // Stops and joins both threads; idempotent. Receives still posted are cancelled; a message one of
  // them had already consumed is listed in lost(). A reply whose receiver never takes it is cancelled
  // after a grace second (and listed in lost()).
  void stop();

  bool running() const noexcept { return running_.load(std::memory_order_acquire); }
  // The first failure of a service thread, or "" (failed() says which).
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  std::string error() const;
  std::string error_kind() const;  // "wsp" (the peers broke the protocol), "mpi", or "internal"
  // The rank whose message caused the first failure (its transport source), or -1 (none: an MPI or
  // internal failure, or no failure).
  int error_source() const;
  // Pushes from (vw, stage) completed (end_push done).
  std::int64_t pushes_received(int vw, int stage) const;
  // Pulls received whose reply is not yet completely sent.
  std::int64_t pulls_outstanding() const noexcept { return outstanding_.load(std::memory_order_acquire); }
  // Messages handled so far (push headers, pushes ended, pulls received, replies started): progress.
  std::int64_t events() const noexcept { return events_.load(std::memory_order_acquire); }
  std::vector<ShardServiceEvent> trace() const;
  std::vector<std::string> lost() const;

 private:
  struct PendingPush {
    std::vector<MPI_Request> requests;  // one per chunk of the payload
    int left;                           // those not yet complete
    int src, vw, stage;
    std::int64_t wave;
    double start_s;
    std::int64_t global_before;
  };
  struct QueuedPull {
    int src, vw, stage;
    std::int64_t wave;
    double start_s;
  };
  struct Reply {
    std::vector<MPI_Request> requests;  // the header's, then one per chunk of the payload
    int left;                           // those not yet complete
    std::unique_ptr<std::array<std::int64_t, 16>> words;  // the header must outlive its send
    int vw, stage;
  };

  void receive_loop();
  void serve_loop();
  void on_push_header(const std::array<std::int64_t, 16>& words, int src);
  void on_pull_header(const std::array<std::int64_t, 16>& words, int src);
  bool test_pushes();
  bool test_replies();
  bool serve_ready();
  void cancel_receives();
  void finish_replies();
  void fail(const std::string& kind, const std::string& message, int source = -1);
  void check_source(int vw, int stage, int src, const char* what, std::int64_t wave) const;
  void record(const ShardServiceEvent& e);
  std::string where() const;

  ShardPlane& plane_;
  MPI_Comm comm_;
  int shard_;
  bool tracing_;
  std::int64_t chunk_bytes_;

  std::thread receiver_, worker_;
  std::atomic<bool> running_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::atomic<std::int64_t> outstanding_{0};
  // The wave after which the run stops (an early stop VW 0's pushes announce in their mb word), or -1.
  // Written by the receiver thread (release) before the push that carries it can make a wave due;
  // read by the worker (acquire), which answers pulls of later waves with a kStopped reply.
  std::atomic<std::int64_t> stop_after_{-1};
  std::atomic<std::int64_t> events_{0};
  std::unique_ptr<std::atomic<std::int64_t>[]> received_;  // by (vw, stage) slot
  std::vector<int> slot_base_;                              // per VW
  std::vector<int> sources_;                                // per (vw, stage) slot: its rank in comm_
  std::vector<int> num_stages_;

  // Receiver thread only.
  std::array<std::int64_t, 16> push_words_{}, pull_words_{};
  MPI_Request push_header_ = MPI_REQUEST_NULL, pull_header_ = MPI_REQUEST_NULL;
  std::vector<PendingPush> pushes_;
  // Worker thread only.
  std::vector<Reply> replies_;
  std::vector<std::vector<float>> packed_;  // per (vw, stage) slot: a reply of several pieces, packed

  std::mutex queue_mutex_;  // guards queue_; wake_ wakes the worker (a pull queued, a wave due, stop)
  std::condition_variable wake_;
  std::deque<QueuedPull> queue_;

  mutable std::mutex info_mutex_;  // guards everything below
  std::string error_, error_kind_;
  int error_source_ = -1;
  std::vector<ShardServiceEvent> events_log_;
  std::vector<std::string> lost_;
};

}  // namespace hetpipe
