// ShardPlane: one parameter-server shard's data plane — WSP pushes, wave application and
// staleness-gated pulls — callable from any number of threads at once, with no Python in the way.
//
// Protocol (the WSP spec of python/hetpipe/runtime/ps.py, which this equals bit for bit):
// - push(vw, stage, wave, delta): the stage's wave delta for the shard's layers inside the stage (in
//   layer order). VW vw's clock becomes c + 1 once every stage of vw holding layers of this shard has
//   pushed wave c (waves complete in order).
// - Wave c's deltas are applied (apply_delta, VW 0 first, then 1, ..., layers in order) exactly when
//   the global clock (minimum over VWs) passes c; so the weights are always W_a, a = applied().
// - pull(vw, stage, wave, out): waits until applied() >= wave - D, then copies W_a of the stage's
//   layers into out and returns a.
//
// Threads: push and pull may be called from any threads concurrently (one thread per stage is the
// intended shape: a receiver per peer). The delta is copied into a pending buffer outside every lock,
// so pushes from different stages copy in parallel; the thread whose push lets the global clock pass
// a wave applies it (one applier at a time), with apply_delta's own worker threads. Clocks live in
// ClockTables (lock-free reads): clocks_ (one per VW) and applied_ (one entry: waves applied), on which
// pulls wait; a pull's fast path takes no lock but the weights' shared lock.
// Memory ordering: the applier writes the weights and advances applied_ under the exclusive side of
// weights_mutex_; a pull that saw applied_ >= w - D (seq_cst) takes the shared side, so it copies
// whole waves only, at least up to the one it waited for, and the count it reads under that lock is
// exactly the number of waves in what it copied.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <tuple>
#include <vector>

#include "hetpipe/clock_table.h"

namespace hetpipe {

class ShardPlane {
 public:
  // layer_numels[i]: elements of the shard's i-th layer (in layer order). stage_layers[vw][stage]:
  // the indices i that the stage holds, ascending (empty: none). Throws std::invalid_argument naming
  // the bad field. num_threads: apply_delta threads (<= 0: hardware concurrency, see shard_ops.h).
  ShardPlane(std::vector<std::size_t> layer_numels, std::vector<std::vector<std::vector<int>>> stage_layers,
             int d, int num_threads);
  ShardPlane(const ShardPlane&) = delete;
  ShardPlane& operator=(const ShardPlane&) = delete;

  int num_layers() const noexcept { return static_cast<int>(weights_.size()); }
  int num_vws() const noexcept { return clocks_.num_vws(); }
  std::size_t layer_numel(int layer) const;
  std::size_t stage_numel(int vw, int stage) const;
  // The layer's weights, for setting the initial values before the first push and reading them after
  // the last; not to be touched while pushes are applied.
  float* weights(int layer);

  // Copies `n` floats of delta (must equal stage_numel). Throws std::invalid_argument for a stage
  // holding none of the layers, a wrong size, a duplicate push or a wave the VW already passed;
  // std::logic_error when the clock bound 0 <= clock_vw - global <= D + 1 breaks.
  void push(int vw, int stage, std::int64_t wave, const float* delta, std::size_t n);

  // Waits up to `timeout` until applied() >= wave - D, then copies W_a into out (stage_numel floats)
  // and returns a; -1 on timeout (nothing copied).
  std::int64_t pull_for(int vw, int stage, std::int64_t wave, float* out, std::size_t n,
                        std::chrono::nanoseconds timeout);

  std::int64_t clock(int vw) const { return clocks_.clock(vw); }
  std::int64_t global_clock() const noexcept { return clocks_.global_clock(); }
  std::int64_t applied() const { return applied_.clock(0); }
  std::int64_t pushed_bytes() const noexcept { return pushed_bytes_.load(std::memory_order_relaxed); }

 private:
  const std::vector<int>& holds(int vw, int stage) const;  // throws for a stage holding nothing
  void apply_ready();

  std::vector<std::vector<float>> weights_;
  std::vector<std::vector<std::vector<int>>> stage_layers_;
  std::vector<std::size_t> stages_holding_;  // per VW: how many of its stages hold layers here
  std::int64_t d_;
  int num_threads_;

  ClockTable clocks_;   // per VW: waves whose pushes all arrived
  ClockTable applied_;  // one entry: waves applied to weights_

  // A pending delta: uninitialised floats (a fresh buffer is written once, by the push's copy).
  using Buffer = std::unique_ptr<float[]>;

  std::mutex state_mutex_;  // guards everything below up to apply_mutex_
  // wave -> vw -> layer -> delta (buffers of applied waves are reused through spare_)
  std::map<std::int64_t, std::vector<std::map<int, Buffer>>> pending_;
  std::map<std::pair<int, std::int64_t>, std::set<int>> arrived_;  // (vw, wave) -> stages
  std::set<std::tuple<int, int, std::int64_t>> seen_;
  std::vector<std::vector<Buffer>> spare_;  // per layer

  std::mutex apply_mutex_;             // one applier at a time
  std::shared_mutex weights_mutex_;    // exclusive: applying; shared: pulls copying
  std::atomic<std::int64_t> pushed_bytes_{0};
};

}  // namespace hetpipe
