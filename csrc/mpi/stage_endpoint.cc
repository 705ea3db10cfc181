#include "stage_endpoint.h"

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "hetpipe/wire.h"
#include "mpi/mpi_check.h"

namespace hetpipe {

namespace {

constexpr auto kFirstBackoff = std::chrono::microseconds(20);
constexpr auto kMaxBackoff = std::chrono::milliseconds(1);
// A payload in flight: polled with yields while something moved within kSpinWindow, then with naps of
// 20 us doubling to kMaxInFlightNap (see the header: a transfer moves only inside MPI calls; a send
// whose receiver has not posted its receive yet moves nothing however often it is tested, and a
// ring of shared-memory cells, 512 KiB, drained every 250 us still moves 2 GB/s).
constexpr auto kSpinWindow = std::chrono::microseconds(200);
constexpr auto kMaxInFlightNap = std::chrono::microseconds(250);

using mpi::MpiError;
using mpi::check;

std::string kind_name(std::int64_t kind) {
  for (const auto& k : wire::kKinds) {
    if (k.value == kind) return k.name;
  }
  return "kind " + std::to_string(kind);
}

std::string describe(const HeaderWords& w, int peer, bool from) {
  std::ostringstream out;
  out << kind_name(w[wire::kKindWord]) << " message (VW " << w[wire::kVwWord] << " stage " << w[wire::kStageWord]
      << ", minibatch " << w[wire::kMbWord] << ", " << w[wire::kNbytesWord] << " bytes) " << (from ? "from" : "to")
      << " rank " << peer;
  return out.str();
}

// Completes what finished of `requests` (MPI_Testsome); returns how many did.
int test_some(std::vector<MPI_Request>& requests, std::vector<int>& done, const char* what) {
  done.resize(requests.size());
  int count = 0;
  check(MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &count, done.data(), MPI_STATUSES_IGNORE),
        what);
  return count == MPI_UNDEFINED ? 0 : count;
}

}  // namespace

StageEndpoint::StageEndpoint(std::shared_ptr<PinnedBufferPool> pool, MPI_Comm comm, std::int64_t chunk_bytes)
    : pool_(std::move(pool)), comm_(comm), chunk_bytes_(chunk_bytes) {
  if (chunk_bytes < 0) {
    throw std::invalid_argument("StageEndpoint: chunk_bytes must be >= 0 (0: one message per payload), got " +
                                std::to_string(chunk_bytes));
  }
  int level = 0;
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE) {
    throw std::runtime_error("StageEndpoint: MPI must be initialised with MPI_THREAD_MULTIPLE (it runs at level " +
                             std::to_string(level) + ")");
  }
  thread_ = std::thread([this] { run(); });
}

StageEndpoint::~StageEndpoint() { close(); }

void StageEndpoint::wake() {
  if (sleeping_.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_one();
  }
}

void StageEndpoint::send(int dest, const HeaderWords& words, std::optional<Slot> slot) {
  if (failed()) throw std::runtime_error(error());
  const auto nbytes = words[wire::kNbytesWord];
  if (nbytes < 0 || (nbytes > 0 && (!slot || static_cast<std::size_t>(nbytes) > slot->nbytes()))) {
    throw std::invalid_argument("StageEndpoint: " + describe(words, dest, false) + " needs a slot of at least " +
                                std::to_string(nbytes) + " bytes");
  }
  HeaderWords cut = words;
  cut[wire::kChunkWord] = wire::chunk_word(nbytes, chunk_bytes_);
  sends_pending_.fetch_add(1, std::memory_order_acq_rel);
  if (!commands_.push(Command{dest, cut, std::move(slot), nullptr})) {
    sends_pending_.fetch_sub(1, std::memory_order_acq_rel);
    throw std::runtime_error("StageEndpoint: " + std::to_string(kRingSize) + " commands queued; the progress thread "
                             "is not keeping up");
  }
  wake();
}

std::optional<Received> StageEndpoint::try_recv(int src, std::int64_t kind) {
  if (src < 0) throw std::invalid_argument("StageEndpoint: try_recv needs a source rank, got " + std::to_string(src));
  const auto key = std::make_pair(src, kind);
  auto known = keys_.find(key);
  if (known == keys_.end()) {
    auto in = std::make_unique<Incoming>();
    in->src = src;
    in->kind = kind;
    in->words = std::make_unique<HeaderWords>();
    Incoming* raw = in.get();
    if (!commands_.push(Command{src, {}, std::nullopt, raw})) {
      throw std::runtime_error("StageEndpoint: " + std::to_string(kRingSize) + " commands queued");
    }
    in.release();  // the progress thread adopts it (incoming_)
    known = keys_.emplace(key, raw).first;
    wake();
  }
  while (auto got = arrived_.pop()) {
    ready_[{got->src, got->words[wire::kKindWord]}].push_back(std::move(*got));
  }
  auto queue = ready_.find(key);
  if (queue == ready_.end() || queue->second.empty()) {
    if (failed()) throw std::runtime_error(error());
    // Python waits for this message: a sleeping progress thread would only look again after its
    // back-off (up to 1 ms), and nothing else wakes it when bytes arrive. Python's polling (its own
    // back-off) paces the thread instead, as it paced mpi4py's requests.
    wake();
    return std::nullopt;
  }
  Received out = std::move(queue->second.front());
  queue->second.pop_front();
  known->second->taken.store(true, std::memory_order_release);
  wake();
  return out;
}

std::string StageEndpoint::slot_wait() const {
  const auto w = slot_wait_.load(std::memory_order_acquire);
  if (w < 0) return "";
  const auto total = pool_->num_slots();
  return "a free pinned slot (" + std::to_string(total - pool_->available()) + " of " + std::to_string(total) +
         " in use) for the payload of a " + kind_name(w % 16) + " message from rank " + std::to_string(w / 16);
}

std::string StageEndpoint::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

std::string StageEndpoint::error_kind() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_kind_;
}

void StageEndpoint::fail(const std::string& kind, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_.empty()) {
      error_ = "StageEndpoint: " + message;
      error_kind_ = kind;
    }
  }
  failed_.store(true, std::memory_order_release);
}

void StageEndpoint::run() {
  using Clock = std::chrono::steady_clock;
  using us = std::chrono::microseconds;
  const auto first = std::chrono::duration_cast<us>(kFirstBackoff);
  auto idle = first, flying = first;  // the next nap with nothing in flight, and with a payload in flight
  auto moved_at = Clock::now();
  try {
    while (!stopping_.load(std::memory_order_acquire)) {
      if (step()) {
        idle = flying = first;
        moved_at = Clock::now();
        continue;
      }
      const bool in_flight_now = in_flight();
      if (in_flight_now && Clock::now() - moved_at < kSpinWindow) {
        std::this_thread::yield();
        continue;
      }
      sleeping_.store(true, std::memory_order_seq_cst);
      if (commands_.empty() && !stopping_.load(std::memory_order_acquire)) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait_for(lock, in_flight_now ? flying : idle);
      }
      sleeping_.store(false, std::memory_order_seq_cst);
      if (in_flight_now) {
        flying = std::min(flying * 2, std::chrono::duration_cast<us>(kMaxInFlightNap));
      } else {
        idle = std::min(idle * 2, std::chrono::duration_cast<us>(kMaxBackoff));
      }
    }
  } catch (const MpiError& e) {
    fail("mpi", e.what());
  } catch (const std::exception& e) {
    fail("internal", e.what());
  }
}

bool StageEndpoint::in_flight() const {
  if (!outgoing_.empty()) return true;
  for (const auto& p : incoming_) {
    if (p->stage == Stage::kPayload) return true;
  }
  return false;
}

bool StageEndpoint::step() {
  bool moved = false;
  while (auto c = commands_.pop()) {
    start(std::move(*c));
    moved = true;
  }
  moved = test_sends() || moved;
  moved = test_receives() || moved;
  return moved;
}

void StageEndpoint::start(Command&& c) {
  if (c.incoming != nullptr) {
    incoming_.emplace_back(c.incoming);
    post_header(*incoming_.back());
    return;
  }
  Outgoing out;
  out.words = std::make_unique<HeaderWords>(c.words);
  out.slot = std::move(c.slot);
  const auto kind = c.words[wire::kKindWord];
  const auto nbytes = c.words[wire::kNbytesWord];
  const auto cut = c.words[wire::kChunkWord];
  const auto pieces = nbytes > 0 ? wire::chunk_count(nbytes, cut) : 0;
  out.requests.assign(static_cast<std::size_t>(1 + pieces), MPI_REQUEST_NULL);
  out.left = static_cast<int>(out.requests.size());
  check(MPI_Isend(out.words->data(), wire::kHeaderWords, MPI_INT64_T, c.peer, wire::header_tag(kind), comm_,
                  &out.requests[0]),
        "MPI_Isend (header)");
  for (std::int64_t i = 0; i < pieces; ++i) {
    const auto [off, len] = wire::chunk_at(nbytes, cut, i);
    check(MPI_Isend_c(static_cast<char*>(out.slot->data()) + off, static_cast<MPI_Count>(len), MPI_BYTE, c.peer,
                      wire::payload_tag(kind), comm_, &out.requests[static_cast<std::size_t>(1 + i)]),
          "MPI_Isend (payload)");
  }
  outgoing_.push_back(std::move(out));
}

bool StageEndpoint::test_sends() {
  bool moved = false;
  for (auto it = outgoing_.begin(); it != outgoing_.end();) {
    const int done = test_some(it->requests, done_, "MPI_Testsome (send)");
    it->left -= done;
    moved = moved || done > 0;
    if (it->left > 0) {
      ++it;
      continue;
    }
    if (it->slot) pool_->release(*it->slot);
    it = outgoing_.erase(it);
    sends_pending_.fetch_sub(1, std::memory_order_acq_rel);
    moved = true;
  }
  return moved;
}

void StageEndpoint::post_header(Incoming& in) {
  check(MPI_Irecv(in.words->data(), wire::kHeaderWords, MPI_INT64_T, in.src, wire::header_tag(in.kind), comm_,
                  &in.request),
        "MPI_Irecv (header)");
  in.stage = Stage::kHeader;
}

bool StageEndpoint::test_receives() {
  bool moved = false;
  std::int64_t waiting = -1;
  for (auto& p : incoming_) {
    Incoming& in = *p;
    if (in.stage == Stage::kHeld) {
      if (!in.taken.load(std::memory_order_acquire)) continue;
      post_header(in);
      moved = true;
    }
    if (in.stage == Stage::kHeader) {
      int done = 0;
      check(MPI_Test(&in.request, &done, MPI_STATUS_IGNORE), "MPI_Test (header)");
      if (!done) continue;
      moved = true;
      in.stage = (*in.words)[wire::kNbytesWord] > 0 ? Stage::kSlot : Stage::kHeld;
    }
    if (in.stage == Stage::kSlot) {
      const auto nbytes = static_cast<std::size_t>((*in.words)[wire::kNbytesWord]);
      if (nbytes > pool_->slot_bytes()) {
        throw std::runtime_error(describe(*in.words, in.src, true) + " does not fit a pool slot of " +
                                 std::to_string(pool_->slot_bytes()) + " bytes");
      }
      const std::int64_t cut = (*in.words)[wire::kChunkWord];
      if (cut < 0) throw std::runtime_error(describe(*in.words, in.src, true) + " announces chunks of " +
                                            std::to_string(cut) + " bytes");
      in.slot = pool_->try_acquire(nbytes, std::chrono::nanoseconds(0));
      if (!in.slot) {
        waiting = static_cast<std::int64_t>(in.src) * 16 + in.kind;
        continue;
      }
      const auto total = static_cast<std::int64_t>(nbytes);
      const std::int64_t pieces = wire::chunk_count(total, cut);
      in.chunks.assign(static_cast<std::size_t>(pieces), MPI_REQUEST_NULL);
      for (std::int64_t i = 0; i < pieces; ++i) {
        const auto [off, len] = wire::chunk_at(total, cut, i);
        check(MPI_Irecv_c(static_cast<char*>(in.slot->data()) + off, static_cast<MPI_Count>(len), MPI_BYTE, in.src,
                          wire::payload_tag(in.kind), comm_, &in.chunks[static_cast<std::size_t>(i)]),
              "MPI_Irecv (payload)");
      }
      in.left = static_cast<int>(pieces);
      in.stage = Stage::kPayload;
      moved = true;
    }
    if (in.stage == Stage::kPayload) {
      const int done = test_some(in.chunks, done_, "MPI_Testsome (payload)");
      in.left -= done;
      moved = moved || done > 0;
      if (in.left > 0) continue;
      in.stage = Stage::kHeld;
    }
    if (in.stage == Stage::kHeld && in.taken.load(std::memory_order_acquire)) {
      // Just completed (a delivery Python took would have been reposted above): deliver it.
      in.taken.store(false, std::memory_order_release);
      Received r{in.src, *in.words, std::move(in.slot)};
      in.slot.reset();
      if (!arrived_.push(std::move(r))) throw std::runtime_error("the ring of received messages is full");
    }
  }
  slot_wait_.store(waiting, std::memory_order_release);
  return moved;
}

std::vector<std::string> StageEndpoint::close() {
  std::vector<std::string> lost;
  if (closed_) return lost;
  closed_ = true;
  stopping_.store(true, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
  // The thread is gone: this thread owns every request now. Adopt the commands it never started.
  while (auto c = commands_.pop()) {
    if (c->incoming != nullptr) {
      incoming_.emplace_back(c->incoming);
    } else if (c->slot) {
      pool_->release(*c->slot);
      sends_pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
  for (auto& p : incoming_) {
    Incoming& in = *p;
    if (in.stage == Stage::kHeader && in.request != MPI_REQUEST_NULL) {
      MPI_Cancel(&in.request);
      MPI_Status status;
      MPI_Wait(&in.request, &status);
      int cancelled = 0;
      MPI_Test_cancelled(&status, &cancelled);
      if (!cancelled) lost.push_back(describe(*in.words, in.src, true));
    } else if (in.stage == Stage::kPayload) {
      // Its header was consumed: the message is lost whether or not its chunks had started arriving.
      for (auto& r : in.chunks) {
        if (r == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
      lost.push_back(describe(*in.words, in.src, true));
    } else if (in.stage == Stage::kSlot) {
      lost.push_back(describe(*in.words, in.src, true));
    }
    if (in.slot) pool_->release(*in.slot);
    in.slot.reset();
  }
  while (auto got = arrived_.pop()) ready_[{got->src, got->words[wire::kKindWord]}].push_back(std::move(*got));
  for (auto& entry : ready_) {
    for (auto& r : entry.second) {
      lost.push_back(describe(r.words, r.src, true) + ", received and never taken");
      if (r.slot) pool_->release(*r.slot);
    }
  }
  ready_.clear();
  // Sends still in flight: the peer may never take them (it failed); cancel rather than wait forever.
  for (auto& out : outgoing_) {
    for (auto& r : out.requests) {
      if (r == MPI_REQUEST_NULL) continue;
      int done = 0;
      MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Cancel(&r);
        MPI_Wait(&r, MPI_STATUS_IGNORE);
      }
    }
    if (out.slot) pool_->release(*out.slot);
    lost.push_back(describe(*out.words, -1, false) + ", send unfinished");
  }
  outgoing_.clear();
  sends_pending_.store(0, std::memory_order_release);
  return lost;
}

}  // namespace hetpipe
