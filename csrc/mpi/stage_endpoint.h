// StageEndpoint: a stage rank's message traffic over MPI, progressed by a core thread of its own.
//
// With mpi4py, a request progresses only when Python calls Test() between instructions, so a large
// push or activation makes no progress during a long forward or backward. Here one progress thread
// owns every MPI request of the stage's slot traffic (activations, gradients and tied gradients to
// and from its peers; pushes, pull requests and DONE to the PS shards; the weights they answer): it
// starts sends, keeps a header receive posted for every (source, kind) the stage receives, takes a
// pool slot for each payload and receives it straight into the slot, while Python computes.
//
// Wire format: hetpipe/wire.h (16 int64 header words on header_tag(kind), then nbytes payload bytes on
// payload_tag(kind), from the same sender; MPI's non-overtaking rule pairs them). A payload above the
// endpoint's chunk size is sent as consecutive chunks (the header's chunk word says the size); a
// received payload is cut as its sender's header says, one receive per chunk into one slot.
//
// Threads and queues. One Python thread (the stage's executor) calls send(), try_recv(),
// pending_sends(), slot_wait(), error() and close(); the progress thread does all MPI calls of the
// endpoint. They meet in two single-producer single-consumer rings (Ring below): commands (send,
// start receiving a (source, kind)) from Python to the thread, and received messages from the thread
// to Python. Neither side takes a lock on the hot path.
// Polling: while a payload is in flight (a send, or a payload receive posted) the thread polls
// without sleeping, yielding its core between polls (MPI_Testsome over each message's chunks), as
// long as something moved within the last kSpinWindow: a rendezvous transfer moves only inside MPI
// calls, and with shared-memory copies through cells both sides must keep calling. A payload in
// flight that has not moved for that long (its receiver has not posted the receive yet) is polled
// after naps of 20 us doubling to 250 us instead, so a stalled send does not hold a core the
// computing threads need. With nothing in flight the thread sleeps with a back-off (20 us doubling to
// 1 ms). send() wakes a sleeping thread at once.
// Memory ordering: a ring's producer writes the entry, then stores the tail with release; the
// consumer loads the tail with acquire before reading the entry, then stores the head with release,
// which the producer loads with acquire before reusing the entry. The wake-up is a Dekker pair:
// the thread stores sleeping_ = true (seq_cst) and re-checks the command ring before it waits;
// send() pushes, then loads sleeping_ (seq_cst) and notifies under the mutex if it was set, so a
// command is never left waiting for a full back-off.
//
// Bounded prefetch: each (source, kind) has at most one message received and not yet taken by
// Python, the bound mpi4py's transport had (one receive per key), so the endpoint holds no more pool
// slots than it did and cannot starve the sends of slots.
//
// Slots: send() takes ownership of the slot, which goes back to the pool when the transfer completed;
// a received message hands its slot to the caller of try_recv(). The pool outlives the endpoint.
//
// Failures: an MPI error in the thread is kept as the first error (error()); the thread then stops.
// close() stops and joins the thread (it never blocks in MPI), cancels the posted receives, and
// returns what was lost: messages consumed and not delivered.
//
// Calling contract: MPI runs at MPI_THREAD_MULTIPLE (Python's mpi4py keeps calling MPI on other
// communicators or collectives); nobody else receives the kinds this endpoint receives from the
// same sources on `comm`.
#pragma once

#include <mpi.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hetpipe/buffer_pool.h"
#include "hetpipe/wire.h"

namespace hetpipe {

using HeaderWords = std::array<std::int64_t, 16>;

// A bounded single-producer single-consumer ring (see the memory ordering above).
template <class T, std::size_t N>
class Ring {
 public:
  bool push(T&& value) {
    const auto tail = tail_.load(std::memory_order_relaxed);
    if (tail - head_.load(std::memory_order_acquire) == N) return false;
    items_[tail % N] = std::move(value);
    tail_.store(tail + 1, std::memory_order_release);
    return true;
  }
  std::optional<T> pop() {
    const auto head = head_.load(std::memory_order_relaxed);
    if (head == tail_.load(std::memory_order_acquire)) return std::nullopt;
    T value = std::move(items_[head % N]);
    head_.store(head + 1, std::memory_order_release);
    return value;
  }
  bool empty() const { return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire); }

 private:
  std::array<T, N> items_{};
  alignas(64) std::atomic<std::uint64_t> head_{0};
  alignas(64) std::atomic<std::uint64_t> tail_{0};
};

// A message received: its sender, header and payload slot (none when nbytes is 0).
struct Received {
  int src = -1;
  HeaderWords words{};
  std::optional<Slot> slot;
};

class StageEndpoint {
 public:
  static constexpr std::size_t kRingSize = 1024;

  // comm: the MPI communicator of the job (mpi4py's handle); pool: the stage's slots; chunk_bytes: the
  // size this endpoint cuts its payloads at (0: one message each; std::invalid_argument below 0).
  // Throws std::runtime_error when MPI is not initialised with MPI_THREAD_MULTIPLE. Starts the thread.
  StageEndpoint(std::shared_ptr<PinnedBufferPool> pool, MPI_Comm comm,
                std::int64_t chunk_bytes = wire::kDefaultChunkBytes);
  StageEndpoint(const StageEndpoint&) = delete;
  StageEndpoint& operator=(const StageEndpoint&) = delete;
  ~StageEndpoint();  // close(), lost messages dropped

  // Python thread. Starts sending `words` (and the first words[7] bytes of `slot`) to `dest`, its chunk
  // word set to this endpoint's cut; takes ownership of the slot. Never blocks (std::runtime_error if 1024 commands are already queued, or
  // after a failure: error() says which).
  void send(int dest, const HeaderWords& words, std::optional<Slot> slot);
  // Python thread. The next message of `kind` from `src` that fully arrived, or nothing; the first
  // call for a (src, kind) starts receiving them (src >= 0: no wildcard).
  std::optional<Received> try_recv(int src, std::int64_t kind);
  // Sends started and not yet complete (their slots not yet released).
  std::int64_t pending_sends() const noexcept { return sends_pending_.load(std::memory_order_acquire); }
  // What a receive waits for when no pool slot is free for its payload, or "".
  std::string slot_wait() const;
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  std::string error() const;
  // "mpi" when the first failure was an MPI call's error (a peer gone, the network), "internal"
  // otherwise, "" before any failure: the caller reports the former as its peer's fault.
  std::string error_kind() const;
  // Stops and joins the thread, cancels the posted receives, gives back every slot still held;
  // returns the messages consumed and not delivered. Idempotent (later calls return nothing).
  std::vector<std::string> close();

 private:
  struct Incoming;
  // A send (incoming == nullptr) or the start of receiving a (source, kind), whose state the Python
  // thread allocated and the progress thread adopts.
  struct Command {
    int peer = -1;
    HeaderWords words{};
    std::optional<Slot> slot;
    Incoming* incoming = nullptr;
  };
  struct Outgoing {
    std::vector<MPI_Request> requests;   // the header's, then one per chunk of the payload
    int left = 0;                        // requests not yet complete
    std::unique_ptr<HeaderWords> words;  // a header must outlive its send
    std::optional<Slot> slot;
  };
  enum class Stage { kHeader, kSlot, kPayload, kHeld };
  struct Incoming {
    int src = -1;
    std::int64_t kind = 0;
    Stage stage = Stage::kHeader;
    MPI_Request request = MPI_REQUEST_NULL;  // the header receive
    std::vector<MPI_Request> chunks;         // kPayload: one receive per chunk of the payload
    int left = 0;                            // chunk receives not yet complete
    std::unique_ptr<HeaderWords> words;      // the posted header receive writes here
    std::optional<Slot> slot;
    // False from a delivery until Python takes it; the thread reposts the header receive (kHeld ->
    // kHeader) only then. Stored false (release) before the delivery is pushed, true after Python popped it.
    std::atomic<bool> taken{true};
  };

  void run();
  bool step();
  bool in_flight() const;
  void start(Command&& c);
  bool test_sends();
  bool test_receives();
  void post_header(Incoming& in);
  void fail(const std::string& kind, const std::string& message);
  void wake();

  std::shared_ptr<PinnedBufferPool> pool_;
  MPI_Comm comm_;
  std::int64_t chunk_bytes_;

  Ring<Command, kRingSize> commands_;
  Ring<Received, kRingSize> arrived_;

  // Progress thread only.
  std::deque<Outgoing> outgoing_;
  std::vector<std::unique_ptr<Incoming>> incoming_;
  std::vector<int> done_;  // MPI_Testsome's indices

  // Python thread only: what try_recv has popped but not yet handed out, and the keys it started.
  std::map<std::pair<int, std::int64_t>, std::deque<Received>> ready_;
  std::map<std::pair<int, std::int64_t>, Incoming*> keys_;

  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<std::int64_t> sends_pending_{0};
  std::atomic<std::int64_t> slot_wait_{-1};  // src * 16 + kind of a payload waiting for a slot, or -1
  bool closed_ = false;

  mutable std::mutex mutex_;  // guards error_ and error_kind_; the sleep of the progress thread
  std::condition_variable wake_;
  std::string error_, error_kind_;
};

}  // namespace hetpipe
