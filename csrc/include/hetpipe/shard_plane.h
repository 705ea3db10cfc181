// ShardPlane: one parameter-server shard's data plane — WSP pushes, wave application and
// staleness-gated pulls — callable from any number of threads at once, with no Python in the way.
//
// Protocol (the WSP spec of python/hetpipe/ps/shard.py, which this equals bit for bit):
// - push(vw, stage, wave, delta): the stage's wave delta for the shard's layers inside the stage (in
//   layer order), then the current values of those layers' synced buffers (BatchNorm running
//   statistics). VW vw's clock becomes c + 1 once every stage of vw holding layers of this shard has
//   pushed wave c (waves complete in order).
// - Wave c is applied exactly when the global clock (minimum over VWs) passes c: each push's weight
//   deltas in VW then stage order, layers in order (apply_delta; with `mean` each delta is first
//   divided by the VW count, as numpy's float32 division); then each synced buffer B becomes
//   B + (sum over VWs of (P - B)) / VWs (one VW: P itself). The weights are always W_a, a = applied().
// - The outer optimizer (options.outer; python/hetpipe/plan/outer.py, docs/design.md "Outer optimizer"): each
//   push's delta is divided by its k = float32(gain * decay): gain the VW count N with `mean`, else 1, or
//   sqrt(N) with the sqrt gain; decay 1, 1 + s (inverse) or sqrt(1 + s) (sqrt staleness), s = wave - the
//   version the stage's pull of that wave got (wave 0: s = 0). "sgd" adds it times lr (lr 1, no decay,
//   no gain: exactly the plain rule above, the same kernels); "nesterov" sums the wave's divided deltas
//   into A, then takes outer_nesterov (shard_ops.h) with the layer's momentum buffer M; "delayed-nesterov"
//   adds each times lr, sums it into A, and at every delay-th push of the layer takes
//   outer_delayed_momentum (shard_ops.h). M, and delayed-nesterov's A and count of pushes in it, are part
//   of the shard's state (momentum(layer), aggregated(layer), outer_count(layer)).
// - pull(vw, stage, wave, out): waits until applied() >= wave - D, then copies W_a of the stage's
//   layers, its replica slices (tied parameters it holds but this shard's layer owns), then B_a of its
//   layers into out and returns a.
//
// Two-phase pushes: begin_push hands out the pending buffer a push's bytes go into (a transport
// receives straight into it), end_push publishes it. push() is begin, memcpy, end, apply_ready.
//
// Threads: push, begin_push/end_push and pull may be called from any threads concurrently (one thread
// per stage, or one receiver for all). A push's bytes are written into its pending buffer outside
// every lock, so pushes of different stages copy in parallel. apply_ready() applies the waves the
// global clock passed (one applier at a time, with apply_delta's own worker threads); push() calls it
// itself. Clocks live in ClockTables (lock-free reads): clocks_ (one per VW) and applied_ (one
// entry: waves applied), on which pulls wait; a pull's fast path takes no lock but the weights'
// shared lock.
// Memory ordering: the applier writes the weights and advances applied_ under the exclusive side of
// weights_mutex_; a pull that saw applied_ >= w - D (seq_cst) takes the shared side, so it copies
// whole waves only, at least up to the one it waited for, and the count it reads under that lock is
// exactly the number of waves in what it copied. end_push publishes a buffer under state_mutex_,
// which the applier takes before it reads the buffer: the bytes written before end_push are visible.
// The momentum buffers, the aggregated deltas and their counts are written by the applier only, under the
// exclusive side of weights_mutex_, as the weights. The versions pulls got (inverse staleness) are kept under
// versions_mutex_, a leaf lock: serve records one before its reply leaves (so before the stage can push
// that wave), the applier takes a wave's versions before applying it.
// Hold: with set_hold(true) the applier stops after each wave until release(a) (a caller copying
// the weights of every wave boundary, e.g. a checkpoint, reads them while nothing is applied).
#pragma once

#include <array>
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
#include <utility>
#include <vector>

#include "hetpipe/clock_table.h"

namespace hetpipe {

// A slice of a layer's weights that a stage holds as a replica (a tied parameter owned by that layer).
struct ReplicaSlice {
  int layer;
  std::size_t offset;
  std::size_t numel;
};

// What a shard logs, as ShardLog of python/hetpipe/ps/shard.py.
struct ShardPlaneLog {
  std::vector<std::array<std::int64_t, 3>> pushes;   // (vw, stage, wave), arrival order
  std::vector<std::array<std::int64_t, 3>> clocks;   // (vw, clock_vw, global) after each change
  std::vector<std::array<std::int64_t, 4>> pulls;    // (vw, stage, wave, g) as answered
  std::vector<std::int64_t> pull_clocks;             // clock_vw of the puller, per pull
  std::vector<std::array<std::int64_t, 3>> applied;  // (vw, stage, wave), as applied
  std::vector<std::vector<double>> pushed_sum;       // per layer (log_sums only): sum of pushed deltas
};

// The PS's outer optimizer (python/hetpipe/plan/outer.py): its rule, lr and momentum, how a push's lag
// decays it, whether the gain is sqrt(N), and delayed-nesterov's delay.
enum class OuterRule { kSgd, kNesterov, kDelayedNesterov };
enum class StalenessDecay { kNone, kInverse, kSqrt };  // 1, 1 / (1 + s), 1 / sqrt(1 + s)

struct OuterOptions {
  OuterRule rule = OuterRule::kSgd;
  float lr = 1.0f;
  float momentum = 0.9f;
  StalenessDecay staleness = StalenessDecay::kNone;
  bool sqrt_gain = false;  // divide each push by sqrt(N) instead of the aggregate's N or 1
  int delay = 0;           // delayed-nesterov: pushes of a layer per momentum step; 0: the VW count
  // sgd, lr 1, no staleness decay, no gain: the plain WSP rule, applied with its own kernels.
  bool plain() const noexcept {
    return rule == OuterRule::kSgd && lr == 1.0f && staleness == StalenessDecay::kNone && !sqrt_gain;
  }
  bool has_momentum() const noexcept { return rule != OuterRule::kSgd; }
};

struct ShardPlaneOptions {
  std::vector<std::size_t> buffer_numels;                        // per layer (empty: no synced buffers)
  std::vector<std::vector<std::vector<ReplicaSlice>>> replicas;  // [vw][stage] (empty: none)
  bool mean = false;      // aggregate "mean": each VW's delta is divided by the VW count
  // Minibatches per wave of each VW (empty: all equal). With `mean`, VW v's delta is then divided by
  // float(double(S) / double(n_v)), S the sum over the VWs: deltas weighted by the samples behind them
  // (the VW count, bit for bit, when the waves are equal).
  std::vector<std::int64_t> wave_minibatches;
  bool log_sums = false;  // keep, per layer, the float64 sum of every pushed delta (as applied)
  OuterOptions outer;     // the outer optimizer (default: the plain rule)
};

class ShardPlane {
 public:
  // layer_numels[i]: weights of the shard's i-th layer (in layer order). stage_layers[vw][stage]: the
  // indices i that the stage holds, ascending (empty: none). Throws std::invalid_argument naming the
  // bad field. num_threads: apply_delta threads (<= 0: hardware concurrency, see shard_ops.h).
  ShardPlane(std::vector<std::size_t> layer_numels, std::vector<std::vector<std::vector<int>>> stage_layers,
             int d, int num_threads, ShardPlaneOptions options = {});
  ShardPlane(const ShardPlane&) = delete;
  ShardPlane& operator=(const ShardPlane&) = delete;

  int num_layers() const noexcept { return static_cast<int>(weights_.size()); }
  int num_vws() const noexcept { return clocks_.num_vws(); }
  std::int64_t d() const noexcept { return d_; }
  // Stages of VW vw the plane knows (those holding layers or replicas here, and any before them).
  int num_stages(int vw) const;
  std::size_t layer_numel(int layer) const;
  std::size_t buffer_numel(int layer) const;
  // Floats of a push from the stage (its layers' weights, then their synced buffers); throws
  // std::invalid_argument for a stage holding none of the layers.
  std::size_t stage_numel(int vw, int stage) const;
  // Floats of a pull reply to the stage (weights, replica slices, synced buffers); throws for a
  // stage that pulls nothing here.
  std::size_t reply_numel(int vw, int stage) const;
  bool pushes_from(int vw, int stage) const noexcept;
  bool pulls_from(int vw, int stage) const noexcept;
  // The pieces of a pull reply, in order, as (pointer, floats), adjacent pieces merged (a stage
  // without replicas or buffers gets one piece: its layers' weights lie back to back). For a sender
  // that sends them in place; valid while no wave is applied (the caller keeps the applier out).
  std::vector<std::pair<const float*, std::size_t>> reply_pieces(int vw, int stage) const;
  // The layer's weights / synced buffers, for setting the initial values before the first push and
  // reading them after the last (or while held); not to be touched while pushes are applied.
  float* weights(int layer);
  float* buffers(int layer);
  // The layer's outer momentum buffer (layer_numel floats with "nesterov" or "delayed-nesterov", else
  // none), with the weights' rules: set it before the first push (a checkpoint's), read it after the
  // last or while held.
  float* momentum(int layer);
  std::size_t momentum_numel(int layer) const;
  // The layer's aggregated pushes A (layer_numel floats with "nesterov", zero at every wave boundary,
  // or "delayed-nesterov": the pushes since its last momentum step; else none) and, delayed-nesterov,
  // how many pushes A holds; the momentum's rules.
  float* aggregated(int layer);
  std::size_t aggregated_numel(int layer) const;
  std::int64_t outer_count(int layer) const;
  // Throws std::invalid_argument for a negative count.
  void set_outer_count(int layer, std::int64_t count);

  // Copies `n` floats of delta (must equal stage_numel) and applies the waves it completes. Throws
  // std::invalid_argument for a stage holding none of the layers, a wrong size, a duplicate push or a
  // wave the VW already passed; std::logic_error when the clock bound 0 <= clock_vw - global <= D + 1
  // breaks.
  void push(int vw, int stage, std::int64_t wave, const float* delta, std::size_t n);
  // The pending buffer (stage_numel floats) the push's bytes are to be written into; checks as push.
  float* begin_push(int vw, int stage, std::int64_t wave, std::size_t n);
  // The bytes of begin_push's buffer are complete: the VW's clock advances when its wave is whole.
  // Returns whether a wave is now due to be applied (apply_ready).
  bool end_push(int vw, int stage, std::int64_t wave);
  // Applies every wave the global clock passed (unless held); returns how many it applied.
  std::int64_t apply_ready();
  // Whether apply_ready would apply a wave now.
  bool apply_due() const;

  // Waits up to `timeout` until applied() >= wave - D, then copies the reply (reply_numel floats) into
  // out and returns a; -1 on timeout (nothing copied).
  std::int64_t pull_for(int vw, int stage, std::int64_t wave, float* out, std::size_t n,
                        std::chrono::nanoseconds timeout);
  // Answers a pull the staleness bound allows now (applied() >= wave - D, else std::logic_error): logs
  // it and returns a = applied(); copies the reply into out unless out is null (a sender reading
  // reply_pieces in place, which then keeps the applier out until its send is over).
  std::int64_t serve(int vw, int stage, std::int64_t wave, float* out, std::size_t n);

  // Hold after each applied wave until release (see the header comment). held(): the wave count the
  // applier waits at, -1 when not holding.
  void set_hold(bool hold);
  std::int64_t held() const;
  void release(std::int64_t applied);

  std::int64_t clock(int vw) const { return clocks_.clock(vw); }
  // A push of ``wave`` by VW ``vw`` is possible only within [clock(vw), clock(vw) + D + 1]: a stage pushes
  // wave c after its pull of c was answered (c - D <= global clock <= clock(vw)).
  bool push_in_window(int vw, std::int64_t wave) const {
    const std::int64_t c = clocks_.clock(vw);
    return wave >= c && wave <= c + d_ + 1;
  }
  std::int64_t global_clock() const noexcept { return clocks_.global_clock(); }
  std::int64_t applied() const { return applied_.clock(0); }
  std::int64_t pushed_bytes() const noexcept { return pushed_bytes_.load(std::memory_order_relaxed); }
  ShardPlaneLog log() const;  // a copy

 private:
  // One stage of one VW that pushes or pulls here: its layers and where their parts sit in a push.
  struct StageSlot {
    std::vector<int> layers;
    std::vector<ReplicaSlice> replicas;
    std::size_t weight_numel = 0;  // the weights' part of a push
    std::size_t numel = 0;         // a push: weights then buffers
  };

  const StageSlot& slot(int vw, int stage, bool pulling) const;  // throws naming (vw, stage)
  int slot_id(int vw, int stage) const noexcept { return slot_base_[static_cast<std::size_t>(vw)] + stage; }
  void apply_wave(std::int64_t wave, std::vector<std::unique_ptr<float[]>>& buffers,
                  const std::vector<std::int64_t>& versions);
  // Applies (sgd), sums into aggregated_ (nesterov) or both, then the momentum step when due
  // (delayed-nesterov), one pushed delta of a layer divided by divisor; the delta's buffer may be
  // divided in place. Applier only.
  void apply_push(int layer, float* delta, float divisor);
  // k of the push of `wave` whose pull got `version` (see the header comment; the float32 steps of
  // hetpipe.ps.outer_step.push_divisor).
  float push_divisor(int vw, int stage, std::int64_t wave, std::int64_t version) const;
  // Per slot_id, the version the stage's pull of `wave` got (`wave` where none was recorded), removed.
  std::vector<std::int64_t> take_versions(std::int64_t wave);
  void record_version(int vw, int stage, std::int64_t wave, std::int64_t version);
  void copy_reply(const StageSlot& s, float* out) const;

  // A layer's weights: a view of weight_store_, where the layers lie back to back in order, so the
  // weights of a stage's layers (a contiguous run of them) are one contiguous range.
  struct LayerView {
    float* ptr;
    std::size_t n;
    float* data() const noexcept { return ptr; }
    std::size_t size() const noexcept { return n; }
  };
  std::vector<float> weight_store_;
  std::vector<LayerView> weights_;
  std::vector<std::vector<float>> buffers_;  // synced buffers, per layer
  std::vector<std::vector<float>> momentum_;    // outer momentum M, per layer (a rule with momentum; else empty)
  std::vector<std::vector<float>> aggregated_;  // A, per layer: the wave's (nesterov), the window's (delayed)
  std::vector<std::int64_t> outer_counts_;      // delayed-nesterov: per layer, the pushes in A
  std::vector<StageSlot> slots_;             // by slot_id
  std::vector<int> slot_base_;               // per VW: slot_id of its stage 0
  std::vector<int> num_stages_;              // per VW
  std::vector<std::size_t> stages_holding_;  // per VW: how many of its stages push here
  std::int64_t d_;
  int num_threads_;
  bool mean_;
  // Per VW, its divisor under `mean` (the VW count, or S / n_v with waves of unequal length); set once.
  std::vector<float> mean_divisor_;
  OuterOptions outer_;
  std::int64_t delay_;  // delayed-nesterov: pushes of a layer per momentum step (0 resolved to the VW count)

  ClockTable clocks_;   // per VW: waves whose pushes all arrived
  ClockTable applied_;  // one entry: waves applied to weights_

  // A pending push: uninitialised floats (a fresh buffer is written once, by the push's bytes).
  using Buffer = std::unique_ptr<float[]>;

  mutable std::mutex state_mutex_;  // guards everything below up to apply_mutex_
  std::map<std::int64_t, std::vector<Buffer>> pending_;            // wave -> by slot_id
  std::map<std::pair<int, std::int64_t>, std::set<int>> arrived_;  // (vw, wave) -> stages whose push ended
  std::set<std::tuple<int, int, std::int64_t>> seen_;              // pushes begun
  std::vector<std::vector<Buffer>> spare_;                         // by slot_id, buffers of applied waves
  bool hold_ = false;
  std::int64_t held_ = -1;

  std::mutex apply_mutex_;           // one applier at a time
  std::shared_mutex weights_mutex_;  // exclusive: applying; shared: pulls copying
  std::atomic<std::int64_t> pushed_bytes_{0};

  std::mutex versions_mutex_;  // leaf lock: guards versions_ only
  std::map<std::pair<int, std::int64_t>, std::int64_t> versions_;  // (slot_id, wave) -> version its pull got

  mutable std::mutex log_mutex_;
  ShardPlaneLog log_;
  bool log_sums_;
};

}  // namespace hetpipe
