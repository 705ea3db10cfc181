#include "shard_service.h"

#include "hetpipe/wire.h"
#include "mpi/mpi_check.h"

#include <algorithm>
#include <cstring>
#include <chrono>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace hetpipe {

namespace {

using wire::kFloat32;
using wire::kHeaderWords;
using wire::kMaxNdim;
using wire::kPull;
using wire::kPush;
using wire::kWeights;

constexpr auto kFirstBackoff = std::chrono::microseconds(20);
constexpr auto kMaxBackoff = std::chrono::milliseconds(1);
// While a payload is in flight it moves only while we call into MPI, but also only while its stage
// does, between its instructions (every 0.1 to a few ms): polling faster than that takes a core from
// the computing ranks on a shared host and moves nothing sooner.
constexpr auto kMaxInFlightBackoff = std::chrono::microseconds(250);
constexpr auto kReplyGrace = std::chrono::seconds(1);

using mpi::MpiError;
using mpi::check;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string dtype_name(std::int64_t code) {
  return code >= 1 && code <= static_cast<std::int64_t>(wire::kDtypes.size()) ? wire::kDtypes[code - 1]
                                                                          : "dtype#" + std::to_string(code);
}

std::string describe(const std::array<std::int64_t, 16>& w) {
  std::ostringstream out;
  out << dtype_name(w[5]) << "[";
  const std::int64_t ndim = std::min<std::int64_t>(std::max<std::int64_t>(w[6], 0), kMaxNdim);
  for (std::int64_t i = 0; i < ndim; ++i) out << (i ? ", " : "") << w[static_cast<std::size_t>(8 + i)];
  out << "] (" << w[7] << " bytes)";
  return out.str();
}

// Sleeps while nothing moves: 20 us doubling to `max`, reset by progress. One thread's.
class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds max = kMaxBackoff) : max_(max) {}
  void reset() { delay_ = kFirstBackoff; }
  void wait() {
    std::this_thread::sleep_for(delay_);
    delay_ = std::min<std::chrono::microseconds>(delay_ * 2, max_);
  }

 private:
  std::chrono::microseconds max_;
  std::chrono::microseconds delay_ = kFirstBackoff;
};

// Completes what finished of `requests` (MPI_Testsome); returns how many did.
int test_some(std::vector<MPI_Request>& requests, const char* what) {
  std::vector<int> done(requests.size());
  int count = 0;
  check(MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &count, done.data(), MPI_STATUSES_IGNORE),
        what);
  return count == MPI_UNDEFINED ? 0 : count;
}

// A protocol error in a message from rank `source` (its transport source, not its header's claim).
struct PeerError : std::invalid_argument {
  PeerError(const std::string& message, int from) : std::invalid_argument(message), source(from) {}
  int source;
};

// Runs `body`, which handles a message from rank `src`: a protocol error it raises is that rank's.
template <class Body>
void from_peer(int src, Body body) {
  try {
    body();
  } catch (const PeerError&) {
    throw;
  } catch (const std::invalid_argument& e) {
    throw PeerError(e.what(), src);
  } catch (const std::logic_error& e) {
    throw PeerError(e.what(), src);
  }
}

// Plane errors are the peers breaking the protocol; MPI's are the transport's; the rest are ours.
template <class Body>
void guarded(Body body, const std::function<void(const std::string&, const std::string&, int)>& fail) {
  try {
    body();
  } catch (const PeerError& e) {
    fail("wsp", e.what(), e.source);
  } catch (const MpiError& e) {
    fail("mpi", e.what(), -1);
  } catch (const std::invalid_argument& e) {
    fail("wsp", e.what(), -1);
  } catch (const std::logic_error& e) {
    fail("wsp", e.what(), -1);
  } catch (const std::bad_alloc&) {
    fail("internal", "out of host memory", -1);
  } catch (const std::exception& e) {
    fail("internal", e.what(), -1);
  } catch (...) {
    fail("internal", "unknown exception", -1);
  }
}

}  // namespace

ShardService::ShardService(ShardPlane& plane, MPI_Comm comm, int shard, bool trace, std::int64_t chunk_bytes,
                           std::vector<int> sources)
    : plane_(plane),
      comm_(comm),
      shard_(shard),
      tracing_(trace),
      chunk_bytes_(chunk_bytes),
      sources_(std::move(sources)) {
  if (chunk_bytes < 0) {
    throw std::invalid_argument(where() + ": chunk_bytes must be >= 0 (0: one message per reply), got " +
                                std::to_string(chunk_bytes));
  }
  int initialised = 0, finalised = 0, level = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  if (!initialised || finalised) throw std::runtime_error(where() + ": MPI is not initialised (or already finalised)");
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE) {
    throw std::runtime_error(where() + ": MPI runs at thread level " + std::to_string(level) +
                             ", the service needs MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) + ")");
  }
  int slots = 0;
  for (int vw = 0; vw < plane_.num_vws(); ++vw) {
    slot_base_.push_back(slots);
    const int stages = plane_.num_stages(vw);
    num_stages_.push_back(stages);
    slots += stages;
  }
  if (sources_.empty()) {
    for (int k = 0; k < slots; ++k) sources_.push_back(k);
  } else if (static_cast<int>(sources_.size()) != slots) {
    throw std::invalid_argument(where() + ": sources names " + std::to_string(sources_.size()) +
                                " ranks, the plane has " + std::to_string(slots) + " stages");
  }
  received_.reset(new std::atomic<std::int64_t>[static_cast<std::size_t>(std::max(slots, 1))]);
  packed_.resize(static_cast<std::size_t>(slots));
  for (int i = 0; i < std::max(slots, 1); ++i) received_[static_cast<std::size_t>(i)].store(0);
}

ShardService::~ShardService() { stop(); }

std::string ShardService::where() const { return "PS shard " + std::to_string(shard_); }

void ShardService::start() {
  if (running_.exchange(true)) throw std::logic_error(where() + ": the service is already running");
  stopping_.store(false);
  receiver_ = std::thread([this] { receive_loop(); });
  worker_ = std::thread([this] { serve_loop(); });
}

void ShardService::stop() {
  if (!running_.load(std::memory_order_acquire)) return;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  wake_.notify_all();
  if (receiver_.joinable()) receiver_.join();
  if (worker_.joinable()) worker_.join();
  running_.store(false, std::memory_order_release);
}

void ShardService::fail(const std::string& kind, const std::string& message, int source) {
  {
    std::lock_guard<std::mutex> lock(info_mutex_);
    if (error_.empty()) {
      error_kind_ = kind;
      error_source_ = source;
      error_ = message.rfind("ShardPlane: ", 0) == 0 ? where() + ": " + message.substr(12) : message;
    }
  }
  failed_.store(true, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_.store(true, std::memory_order_release);
  }
  wake_.notify_all();
}

std::string ShardService::error() const {
  std::lock_guard<std::mutex> lock(info_mutex_);
  return error_;
}

std::string ShardService::error_kind() const {
  std::lock_guard<std::mutex> lock(info_mutex_);
  return error_kind_;
}

int ShardService::error_source() const {
  std::lock_guard<std::mutex> lock(info_mutex_);
  return error_source_;
}

void ShardService::check_source(int vw, int stage, int src, const char* what, std::int64_t wave) const {
  if (vw < 0 || vw >= static_cast<int>(num_stages_.size()) || stage < 0 ||
      stage >= num_stages_[static_cast<std::size_t>(vw)]) {
    throw PeerError(where() + ": rank " + std::to_string(src) + " sent a " + what + " of wave " + std::to_string(wave) +
                        " claiming VW " + std::to_string(vw) + " stage " + std::to_string(stage) +
                        ", which the plan does not have (a malformed header)",
                    src);
  }
  const int owner = sources_[static_cast<std::size_t>(slot_base_[static_cast<std::size_t>(vw)] + stage)];
  if (src != owner) {
    throw PeerError(where() + ": rank " + std::to_string(src) + " sent a " + what + " of wave " + std::to_string(wave) +
                        " claiming VW " + std::to_string(vw) + " stage " + std::to_string(stage) + ", which is rank " +
                        std::to_string(owner) + " (a forged or corrupt header; the sender is named by its transport "
                        "source)",
                    src);
  }
}

std::int64_t ShardService::pushes_received(int vw, int stage) const {
  if (vw < 0 || vw >= static_cast<int>(num_stages_.size()) || stage < 0 ||
      stage >= num_stages_[static_cast<std::size_t>(vw)]) {
    return 0;
  }
  return received_[static_cast<std::size_t>(slot_base_[static_cast<std::size_t>(vw)] + stage)].load();
}

std::vector<ShardServiceEvent> ShardService::trace() const {
  std::lock_guard<std::mutex> lock(info_mutex_);
  return events_log_;
}

std::vector<std::string> ShardService::lost() const {
  std::lock_guard<std::mutex> lock(info_mutex_);
  return lost_;
}

void ShardService::record(const ShardServiceEvent& e) {
  if (!tracing_) return;
  std::lock_guard<std::mutex> lock(info_mutex_);
  events_log_.push_back(e);
}

// --- receiver ---------------------------------------------------------------------------------------

void ShardService::receive_loop() {
  auto on_fail = [this](const std::string& k, const std::string& m, int source) { fail(k, m, source); };
  guarded(
      [this] {
        check(MPI_Irecv(push_words_.data(), kHeaderWords, MPI_INT64_T, MPI_ANY_SOURCE, wire::header_tag(kPush),
                        comm_, &push_header_),
              "MPI_Irecv (push header)");
        check(MPI_Irecv(pull_words_.data(), kHeaderWords, MPI_INT64_T, MPI_ANY_SOURCE, wire::header_tag(kPull),
                        comm_, &pull_header_),
              "MPI_Irecv (pull header)");
        Backoff backoff, in_flight(kMaxInFlightBackoff);
        while (!stopping_.load(std::memory_order_acquire)) {
          bool progressed = false;
          int done = 0;
          MPI_Status status;
          check(MPI_Test(&push_header_, &done, &status), "MPI_Test (push header)");
          if (done) {
            const int src = status.MPI_SOURCE;
            from_peer(src, [&] { on_push_header(push_words_, src); });
            check(MPI_Irecv(push_words_.data(), kHeaderWords, MPI_INT64_T, MPI_ANY_SOURCE,
                            wire::header_tag(kPush), comm_, &push_header_),
                  "MPI_Irecv (push header)");
            progressed = true;
          }
          check(MPI_Test(&pull_header_, &done, &status), "MPI_Test (pull header)");
          if (done) {
            const int src = status.MPI_SOURCE;
            from_peer(src, [&] { on_pull_header(pull_words_, src); });
            check(MPI_Irecv(pull_words_.data(), kHeaderWords, MPI_INT64_T, MPI_ANY_SOURCE,
                            wire::header_tag(kPull), comm_, &pull_header_),
                  "MPI_Irecv (pull header)");
            progressed = true;
          }
          progressed = test_pushes() || progressed;
          if (progressed) {
            backoff.reset();
            in_flight.reset();
          } else if (!pushes_.empty()) {
            // A payload in flight moves only while we call into MPI (a rendezvous transfer takes many
            // progress calls): keep polling, at most kMaxInFlightBackoff apart.
            in_flight.wait();
          } else {
            backoff.wait();
          }
        }
      },
      on_fail);
  guarded([this] { cancel_receives(); }, on_fail);
}

void ShardService::on_push_header(const std::array<std::int64_t, 16>& w, int src) {
  const int vw = static_cast<int>(w[1]), stage = static_cast<int>(w[2]);
  const std::int64_t wave = w[4];
  std::ostringstream who;
  who << "push from VW " << vw << " stage " << stage << " wave " << wave << " (rank " << src << ")";
  if (w[0] != kPush) throw std::invalid_argument(where() + ": " + who.str() + " carries a header of kind " + std::to_string(w[0]));
  check_source(vw, stage, src, "push", wave);
  if (!plane_.pushes_from(vw, stage)) {
    throw std::invalid_argument(where() + ": VW " + std::to_string(vw) + " stage " + std::to_string(stage) +
                                " (rank " + std::to_string(src) + ") holds none of its layers but pushed wave " +
                                std::to_string(wave));
  }
  if (wave > plane_.clock(vw) + plane_.d() + 1) {
    std::ostringstream msg;
    msg << where() << ": " << who.str() << " is beyond VW " << vw << "'s clock " << plane_.clock(vw) << " + D + 1 = "
        << plane_.clock(vw) + plane_.d() + 1 << ": no stage can push it under the staleness bound (a corrupt header, "
        << "or a stage that ran ahead of its pulls)";
    throw std::invalid_argument(msg.str());
  }
  const std::size_t want = plane_.stage_numel(vw, stage);
  if (w[5] != kFloat32 || w[7] != static_cast<std::int64_t>(4 * want)) {
    std::ostringstream msg;
    msg << where() << ": " << who.str() << " is " << describe(w) << ", expected float32[" << want << "] ("
        << 4 * want << " bytes)";
    throw std::invalid_argument(msg.str());
  }
  if (w[3] >= 0) {
    const std::int64_t known = stop_after_.load(std::memory_order_acquire);
    if (known >= 0 && known != w[3]) {
      throw std::invalid_argument(where() + ": " + who.str() + " announces a stop after wave " + std::to_string(w[3]) +
                                  ", another push announced one after wave " + std::to_string(known));
    }
    stop_after_.store(w[3], std::memory_order_release);
  }
  const std::int64_t cut = w[wire::kChunkWord];
  if (cut < 0) {
    throw std::invalid_argument(where() + ": " + who.str() + " announces chunks of " + std::to_string(cut) + " bytes");
  }
  const double start = now_s();
  const std::int64_t before = plane_.global_clock();
  float* into = plane_.begin_push(vw, stage, wave, want);
  const auto total = static_cast<std::int64_t>(4 * want);
  const std::int64_t pieces = wire::chunk_count(total, cut);
  PendingPush p{std::vector<MPI_Request>(static_cast<std::size_t>(pieces), MPI_REQUEST_NULL),
                static_cast<int>(pieces), src, vw, stage, wave, start, before};
  for (std::int64_t i = 0; i < pieces; ++i) {
    const auto [off, len] = wire::chunk_at(total, cut, i);
    check(MPI_Irecv_c(reinterpret_cast<char*>(into) + off, static_cast<MPI_Count>(len), MPI_BYTE, src,
                      wire::payload_tag(kPush), comm_, &p.requests[static_cast<std::size_t>(i)]),
          "MPI_Irecv (push payload)");
  }
  pushes_.push_back(std::move(p));
  events_.fetch_add(1, std::memory_order_acq_rel);
}

bool ShardService::test_pushes() {
  bool progressed = false;
  // In arrival order: a stage's pushes end in wave order.
  for (auto it = pushes_.begin(); it != pushes_.end();) {
    const int done = test_some(it->requests, "MPI_Testsome (push payload)");
    it->left -= done;
    if (it->left > 0) {
      progressed = progressed || done > 0;
      ++it;
      continue;
    }
    const PendingPush p = std::move(*it);
    it = pushes_.erase(it);
    bool due = false;
    from_peer(p.src, [&] { due = plane_.end_push(p.vw, p.stage, p.wave); });
    received_[static_cast<std::size_t>(slot_base_[static_cast<std::size_t>(p.vw)] + p.stage)].fetch_add(1);
    events_.fetch_add(1, std::memory_order_acq_rel);
    record({true, p.vw, p.stage, p.wave, p.start_s, now_s(), p.global_before, plane_.global_clock()});
    if (due) {
      std::lock_guard<std::mutex> lock(queue_mutex_);  // pairs with the worker's wait: no lost wake-up
      wake_.notify_one();
    }
    progressed = true;
  }
  return progressed;
}

void ShardService::on_pull_header(const std::array<std::int64_t, 16>& w, int src) {
  const int vw = static_cast<int>(w[1]), stage = static_cast<int>(w[2]);
  check_source(vw, stage, src, "pull", w[4]);
  if (w[0] != kPull || !plane_.pulls_from(vw, stage)) {
    throw std::invalid_argument(where() + ": VW " + std::to_string(vw) + " stage " + std::to_string(stage) +
                                " (rank " + std::to_string(src) + ") holds none of its layers but pulled wave " +
                                std::to_string(w[4]));
  }
  // A stage pulls wave w once its own pull of w - 1 was answered, which needed the global clock (and
  // so its VW's clock here) at w - 1 - D: a later wave cannot come from a stage that keeps the protocol.
  const std::int64_t clock = plane_.clock(vw);
  if (w[4] > clock + plane_.d() + 1) {
    std::ostringstream msg;
    msg << where() << ": pull of wave " << w[4] << " from VW " << vw << " stage " << stage << " (rank " << src
        << ") is beyond VW " << vw << "'s clock " << clock << " + D + 1 = " << clock + plane_.d() + 1
        << ": no stage can pull it under the staleness bound (a corrupt header, or a stage that ran ahead)";
    throw std::invalid_argument(msg.str());
  }
  outstanding_.fetch_add(1, std::memory_order_acq_rel);
  events_.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    queue_.push_back({src, vw, stage, w[4], now_s()});
  }
  wake_.notify_one();
}

void ShardService::cancel_receives() {
  std::vector<std::string> lost;
  auto cancel = [&](MPI_Request& req, const std::string& what) {
    if (req == MPI_REQUEST_NULL) return;
    MPI_Status status;
    check(MPI_Cancel(&req), "MPI_Cancel");
    check(MPI_Wait(&req, &status), "MPI_Wait (cancelled receive)");
    int cancelled = 0;
    MPI_Test_cancelled(&status, &cancelled);
    if (!cancelled) lost.push_back(what + " from rank " + std::to_string(status.MPI_SOURCE));
  };
  cancel(push_header_, "a push header");
  cancel(pull_header_, "a pull header");
  for (PendingPush& p : pushes_) {
    // Its header was consumed: the push is lost whether or not its payload had started arriving.
    for (MPI_Request& r : p.requests) {
      if (r == MPI_REQUEST_NULL) continue;
      check(MPI_Cancel(&r), "MPI_Cancel");
      check(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait (cancelled receive)");
    }
    lost.push_back("the push of wave " + std::to_string(p.wave) + " from VW " + std::to_string(p.vw) + " stage " +
                   std::to_string(p.stage) + " (its payload never completed)");
  }
  pushes_.clear();
  std::lock_guard<std::mutex> lock(info_mutex_);
  lost_.insert(lost_.end(), lost.begin(), lost.end());
}

// --- worker -----------------------------------------------------------------------------------------

void ShardService::serve_loop() {
  auto on_fail = [this](const std::string& k, const std::string& m, int source) { fail(k, m, source); };
  guarded(
      [this] {
        Backoff in_flight(kMaxInFlightBackoff);
        while (!stopping_.load(std::memory_order_acquire)) {
          bool progressed = test_replies();
          // Replies are read from the weights in place: nothing is applied while one is in flight.
          if (replies_.empty() && plane_.apply_due()) progressed = plane_.apply_ready() > 0 || progressed;
          progressed = serve_ready() || progressed;
          if (progressed) {
            in_flight.reset();
            continue;
          }
          if (!replies_.empty()) {
            in_flight.wait();  // a reply in flight moves only while we call into MPI
            continue;
          }
          std::unique_lock<std::mutex> lock(queue_mutex_);
          if (stopping_.load(std::memory_order_acquire)) break;
          // Sleep until a pull or a due wave wakes us (the timeout covers a wave made due by a
          // release() of a hold, which notifies nobody).
          wake_.wait_for(lock, std::chrono::microseconds(kMaxBackoff));
        }
      },
      on_fail);
  guarded([this] { finish_replies(); }, on_fail);
}

bool ShardService::serve_ready() {
  std::vector<QueuedPull> ready;
  const std::int64_t a = plane_.applied();
  const std::int64_t stop = stop_after_.load(std::memory_order_acquire);
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->wave - plane_.d() <= a || (stop >= 0 && it->wave > stop)) {
        ready.push_back(*it);
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const QueuedPull& q : ready) {
    const bool stopped = stop >= 0 && q.wave > stop;
    // A pull after the stop gets a header only: its stage ends its stream there.
    const std::int64_t g = stopped ? wire::kStopped : plane_.serve(q.vw, q.stage, q.wave, nullptr, 0);
    const std::size_t n = stopped ? 0 : plane_.reply_numel(q.vw, q.stage);
    const auto total = static_cast<std::int64_t>(4 * n);
    const std::int64_t cut = wire::chunk_word(total, chunk_bytes_);
    const std::int64_t messages = n > 0 ? wire::chunk_count(total, cut) : 0;
    Reply r{std::vector<MPI_Request>(static_cast<std::size_t>(1 + messages), MPI_REQUEST_NULL),
            static_cast<int>(1 + messages), std::make_unique<std::array<std::int64_t, 16>>(), q.vw, q.stage};
    auto& words = *r.words;
    words.fill(0);
    words[0] = kWeights;
    words[1] = q.vw;
    words[2] = q.stage;
    words[3] = q.wave;
    words[4] = g;
    words[5] = kFloat32;
    words[6] = 1;
    words[7] = total;
    words[8] = static_cast<std::int64_t>(n);
    words[wire::kChunkWord] = cut;
    check(MPI_Isend(words.data(), kHeaderWords, MPI_INT64_T, q.src, wire::header_tag(kWeights), comm_,
                    &r.requests[0]),
          "MPI_Isend (weights header)");
    if (n > 0) {
      // One piece (a stage's weights, back to back in the plane) is sent in place; replicas or synced
      // buffers make several, packed into the stage's reply buffer (MPI datatypes over scattered
      // pieces were measured ~4x slower than this copy with MPICH's UCX device).
      const auto pieces = plane_.reply_pieces(q.vw, q.stage);
      const float* from = pieces.empty() ? nullptr : pieces.front().first;
      if (pieces.size() > 1) {
        std::vector<float>& packed = packed_[static_cast<std::size_t>(slot_base_[static_cast<std::size_t>(q.vw)] + q.stage)];
        packed.resize(n);
        std::size_t off = 0;
        for (const auto& [ptr, numel] : pieces) {
          std::memcpy(packed.data() + off, ptr, numel * sizeof(float));
          off += numel;
        }
        from = packed.data();
      }
      for (std::int64_t i = 0; i < messages; ++i) {
        const auto [off, len] = wire::chunk_at(total, cut, i);
        check(MPI_Isend_c(reinterpret_cast<const char*>(from) + off, static_cast<MPI_Count>(len), MPI_BYTE, q.src,
                          wire::payload_tag(kWeights), comm_, &r.requests[static_cast<std::size_t>(1 + i)]),
              "MPI_Isend (weights payload)");
      }
    }
    events_.fetch_add(1, std::memory_order_acq_rel);
    if (!stopped) record({false, q.vw, q.stage, q.wave, q.start_s, now_s(), g, g});
    replies_.push_back(std::move(r));
  }
  return !ready.empty();
}

bool ShardService::test_replies() {
  bool progressed = false;
  for (auto it = replies_.begin(); it != replies_.end();) {
    const int done = test_some(it->requests, "MPI_Testsome (weights reply)");
    it->left -= done;
    if (it->left > 0) {
      progressed = progressed || done > 0;
      ++it;
      continue;
    }
    it = replies_.erase(it);
    outstanding_.fetch_sub(1, std::memory_order_acq_rel);
    progressed = true;
  }
  return progressed;
}

void ShardService::finish_replies() {
  // A reply whose receiver is gone would never complete: wait a grace period, then cancel it.
  const auto deadline = std::chrono::steady_clock::now() + kReplyGrace;
  while (!replies_.empty() && std::chrono::steady_clock::now() < deadline) {
    if (!test_replies()) std::this_thread::sleep_for(kMaxBackoff);
  }
  std::vector<std::string> lost;
  for (Reply& r : replies_) {
    for (MPI_Request& req : r.requests) {
      if (req == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&req);
      MPI_Request_free(&req);
    }
    // MPI may still read a freed request's header: its words are deliberately left allocated.
    r.words.release();
    lost.push_back("the weights reply to VW " + std::to_string(r.vw) + " stage " + std::to_string(r.stage));
  }
  replies_.clear();
  std::lock_guard<std::mutex> lock(info_mutex_);
  lost_.insert(lost_.end(), lost.begin(), lost.end());
}

}  // namespace hetpipe
