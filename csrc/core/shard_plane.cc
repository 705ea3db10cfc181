#include "hetpipe/shard_plane.h"

#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "hetpipe/shard_ops.h"

namespace hetpipe {

namespace {

std::string who(int vw, int stage) { return "VW " + std::to_string(vw) + " stage " + std::to_string(stage); }

// std::invalid_argument naming the field unless lr is finite and > 0, momentum lies in [0, 1) and the
// delay is >= 0.
void check_outer(const OuterOptions& outer) {
  if (!std::isfinite(outer.lr) || !(outer.lr > 0.0f)) {
    throw std::invalid_argument("ShardPlane: outer_lr must be a finite number > 0, got " + std::to_string(outer.lr));
  }
  if (!(outer.momentum >= 0.0f && outer.momentum < 1.0f)) {
    throw std::invalid_argument("ShardPlane: outer_momentum must be a number in [0, 1), got " +
                                std::to_string(outer.momentum));
  }
  if (outer.delay < 0) {
    throw std::invalid_argument("ShardPlane: outer_delay must be an integer >= 0 (0: the VW count), got " +
                                std::to_string(outer.delay));
  }
}

}  // namespace

ShardPlane::ShardPlane(std::vector<std::size_t> layer_numels, std::vector<std::vector<std::vector<int>>> stage_layers,
                       int d, int num_threads, ShardPlaneOptions options)
    : d_(d),
      num_threads_(num_threads),
      mean_(options.mean),
      outer_(options.outer),
      delay_(options.outer.delay > 0 ? options.outer.delay : static_cast<std::int64_t>(stage_layers.size())),
      clocks_(stage_layers.empty() ? 1 : static_cast<int>(stage_layers.size())),
      applied_(1),
      log_sums_(options.log_sums) {
  if (stage_layers.empty()) throw std::invalid_argument("ShardPlane: stage_layers names no virtual worker");
  if (d < 0) throw std::invalid_argument("ShardPlane: staleness bound d must be >= 0, got " + std::to_string(d));
  check_outer(outer_);
  const auto& waves = options.wave_minibatches;
  if (!waves.empty() && waves.size() != stage_layers.size()) {
    throw std::invalid_argument("ShardPlane: wave_minibatches has " + std::to_string(waves.size()) + " VWs, stage_layers " +
                                std::to_string(stage_layers.size()));
  }
  std::int64_t samples = 0;
  for (std::size_t vw = 0; vw < waves.size(); ++vw) {
    if (waves[vw] < 1) {
      throw std::invalid_argument("ShardPlane: wave_minibatches of VW " + std::to_string(vw) + " must be >= 1, got " +
                                  std::to_string(waves[vw]));
    }
    samples += waves[vw];
  }
  for (std::size_t vw = 0; vw < stage_layers.size(); ++vw) {
    // S / n_v rounded once to double, then to float: numpy's float32(S / n_v) gives the same bits.
    mean_divisor_.push_back(waves.empty() ? static_cast<float>(stage_layers.size())
                                          : static_cast<float>(static_cast<double>(samples) /
                                                               static_cast<double>(waves[vw])));
  }
  const int layers = static_cast<int>(layer_numels.size());
  std::vector<std::size_t>& bufs = options.buffer_numels;
  if (bufs.empty()) bufs.assign(layer_numels.size(), 0);
  if (bufs.size() != layer_numels.size()) {
    throw std::invalid_argument("ShardPlane: buffer_numels has " + std::to_string(bufs.size()) +
                                " entries for " + std::to_string(layers) + " layers");
  }
  const auto& replicas = options.replicas;
  if (!replicas.empty() && replicas.size() != stage_layers.size()) {
    throw std::invalid_argument("ShardPlane: replicas has " + std::to_string(replicas.size()) + " VWs, stage_layers " +
                                std::to_string(stage_layers.size()));
  }
  for (std::size_t vw = 0; vw < stage_layers.size(); ++vw) {
    std::size_t holding = 0;
    std::vector<bool> held(layer_numels.size(), false);
    const std::size_t stages = std::max(stage_layers[vw].size(), replicas.empty() ? 0 : replicas[vw].size());
    slot_base_.push_back(static_cast<int>(slots_.size()));
    num_stages_.push_back(static_cast<int>(stages));
    for (std::size_t stage = 0; stage < stages; ++stage) {
      StageSlot s;
      if (stage < stage_layers[vw].size()) s.layers = stage_layers[vw][stage];
      if (!replicas.empty() && stage < replicas[vw].size()) s.replicas = replicas[vw][stage];
      int last = -1;
      for (int l : s.layers) {
        if (l <= last || l >= layers) {
          std::ostringstream msg;
          msg << "ShardPlane: stage_layers[" << vw << "][" << stage << "] must name layer indices ascending in [0, "
              << layers << "), got " << l;
          throw std::invalid_argument(msg.str());
        }
        held[static_cast<std::size_t>(l)] = true;
        last = l;
        s.weight_numel += layer_numels[static_cast<std::size_t>(l)];
        s.numel += layer_numels[static_cast<std::size_t>(l)] + bufs[static_cast<std::size_t>(l)];
      }
      for (const ReplicaSlice& r : s.replicas) {
        if (r.layer < 0 || r.layer >= layers || r.offset + r.numel > layer_numels[static_cast<std::size_t>(r.layer)]) {
          std::ostringstream msg;
          msg << "ShardPlane: replica of " << who(static_cast<int>(vw), static_cast<int>(stage)) << " (layer " << r.layer
              << ", offset " << r.offset << ", " << r.numel << " floats) lies outside the shard's layers";
          throw std::invalid_argument(msg.str());
        }
      }
      if (!s.layers.empty()) ++holding;
      slots_.push_back(std::move(s));
    }
    for (int l = 0; l < layers; ++l) {
      const bool empty = layer_numels[static_cast<std::size_t>(l)] == 0 && bufs[static_cast<std::size_t>(l)] == 0;
      if (!held[static_cast<std::size_t>(l)] && !empty) {
        throw std::invalid_argument("ShardPlane: no stage of VW " + std::to_string(vw) + " holds layer " +
                                    std::to_string(l) + " (every VW holds the whole model's weights)");
      }
    }
    stages_holding_.push_back(holding);
  }
  std::size_t total = 0;
  for (std::size_t n : layer_numels) total += n;
  weight_store_.assign(total, 0.0f);
  std::size_t off = 0;
  for (std::size_t l = 0; l < layer_numels.size(); ++l) {
    weights_.push_back({weight_store_.data() + off, layer_numels[l]});
    off += layer_numels[l];
    buffers_.emplace_back(bufs[l], 0.0f);
    momentum_.emplace_back(outer_.has_momentum() ? layer_numels[l] : 0, 0.0f);
    aggregated_.emplace_back(outer_.has_momentum() ? layer_numels[l] : 0, 0.0f);
  }
  outer_counts_.assign(layer_numels.size(), 0);
  spare_.resize(slots_.size());
  if (log_sums_) {
    for (std::size_t n : layer_numels) log_.pushed_sum.emplace_back(n, 0.0);
  }
}

std::size_t ShardPlane::layer_numel(int layer) const {
  if (layer < 0 || layer >= num_layers()) {
    throw std::out_of_range("ShardPlane: layer " + std::to_string(layer) + " out of range (" +
                            std::to_string(num_layers()) + " layers)");
  }
  return weights_[static_cast<std::size_t>(layer)].size();
}

int ShardPlane::num_stages(int vw) const {
  if (vw < 0 || vw >= num_vws()) {
    throw std::out_of_range("ShardPlane: VW " + std::to_string(vw) + " out of range (" + std::to_string(num_vws()) +
                            " VWs)");
  }
  return num_stages_[static_cast<std::size_t>(vw)];
}

std::size_t ShardPlane::buffer_numel(int layer) const {
  layer_numel(layer);
  return buffers_[static_cast<std::size_t>(layer)].size();
}

float* ShardPlane::weights(int layer) {
  layer_numel(layer);
  return weights_[static_cast<std::size_t>(layer)].data();
}

float* ShardPlane::buffers(int layer) {
  layer_numel(layer);
  return buffers_[static_cast<std::size_t>(layer)].data();
}

float* ShardPlane::momentum(int layer) {
  layer_numel(layer);
  return momentum_[static_cast<std::size_t>(layer)].data();
}

std::size_t ShardPlane::momentum_numel(int layer) const {
  layer_numel(layer);
  return momentum_[static_cast<std::size_t>(layer)].size();
}

float* ShardPlane::aggregated(int layer) {
  layer_numel(layer);
  return aggregated_[static_cast<std::size_t>(layer)].data();
}

std::size_t ShardPlane::aggregated_numel(int layer) const {
  layer_numel(layer);
  return aggregated_[static_cast<std::size_t>(layer)].size();
}

std::int64_t ShardPlane::outer_count(int layer) const {
  layer_numel(layer);
  return outer_counts_[static_cast<std::size_t>(layer)];
}

void ShardPlane::set_outer_count(int layer, std::int64_t count) {
  layer_numel(layer);
  if (count < 0) {
    throw std::invalid_argument("ShardPlane: the outer buffer of layer " + std::to_string(layer) + " counts " +
                                std::to_string(count) + " pushes");
  }
  outer_counts_[static_cast<std::size_t>(layer)] = count;
}

bool ShardPlane::pushes_from(int vw, int stage) const noexcept {
  return vw >= 0 && vw < num_vws() && stage >= 0 && stage < num_stages_[static_cast<std::size_t>(vw)] &&
         !slots_[static_cast<std::size_t>(slot_id(vw, stage))].layers.empty();
}

bool ShardPlane::pulls_from(int vw, int stage) const noexcept {
  if (pushes_from(vw, stage)) return true;
  return vw >= 0 && vw < num_vws() && stage >= 0 && stage < num_stages_[static_cast<std::size_t>(vw)] &&
         !slots_[static_cast<std::size_t>(slot_id(vw, stage))].replicas.empty();
}

const ShardPlane::StageSlot& ShardPlane::slot(int vw, int stage, bool pulling) const {
  if (!(pulling ? pulls_from(vw, stage) : pushes_from(vw, stage))) {
    throw std::invalid_argument("ShardPlane: " + who(vw, stage) + " holds none of this shard's layers");
  }
  return slots_[static_cast<std::size_t>(slot_id(vw, stage))];
}

std::size_t ShardPlane::stage_numel(int vw, int stage) const { return slot(vw, stage, false).numel; }

std::size_t ShardPlane::reply_numel(int vw, int stage) const {
  const StageSlot& s = slot(vw, stage, true);
  std::size_t n = s.numel;
  for (const ReplicaSlice& r : s.replicas) n += r.numel;
  return n;
}

std::vector<std::pair<const float*, std::size_t>> ShardPlane::reply_pieces(int vw, int stage) const {
  const StageSlot& s = slot(vw, stage, true);
  std::vector<std::pair<const float*, std::size_t>> pieces;
  auto add = [&](const float* ptr, std::size_t n) {
    if (n == 0) return;
    if (!pieces.empty() && pieces.back().first + pieces.back().second == ptr) {
      pieces.back().second += n;
    } else {
      pieces.emplace_back(ptr, n);
    }
  };
  for (int l : s.layers) add(weights_[static_cast<std::size_t>(l)].data(), weights_[static_cast<std::size_t>(l)].size());
  for (const ReplicaSlice& r : s.replicas) add(weights_[static_cast<std::size_t>(r.layer)].data() + r.offset, r.numel);
  for (int l : s.layers) add(buffers_[static_cast<std::size_t>(l)].data(), buffers_[static_cast<std::size_t>(l)].size());
  return pieces;
}

void ShardPlane::push(int vw, int stage, std::int64_t wave, const float* delta, std::size_t n) {
  float* into = begin_push(vw, stage, wave, n);
  // The copy runs outside every lock: pushes of different stages copy in parallel.
  std::memcpy(into, delta, n * sizeof(float));
  if (end_push(vw, stage, wave)) apply_ready();
}

float* ShardPlane::begin_push(int vw, int stage, std::int64_t wave, std::size_t n) {
  const StageSlot& s = slot(vw, stage, false);
  if (n != s.numel) {
    std::ostringstream msg;
    msg << "ShardPlane: push from " << who(vw, stage) << " wave " << wave << " has " << n << " floats (" << 4 * n
        << " bytes), expected " << s.numel << " (" << 4 * s.numel << " bytes)";
    throw std::invalid_argument(msg.str());
  }
  const int id = slot_id(vw, stage);
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (seen_.count({vw, stage, wave}) != 0) {
    throw std::invalid_argument("ShardPlane: duplicate push of wave " + std::to_string(wave) + " from " +
                                who(vw, stage));
  }
  if (wave < clocks_.clock(vw)) {
    throw std::invalid_argument("ShardPlane: " + who(vw, stage) + " pushed wave " + std::to_string(wave) +
                                " but VW " + std::to_string(vw) + " is already at clock " +
                                std::to_string(clocks_.clock(vw)));
  }
  seen_.insert({vw, stage, wave});
  auto& per_slot = pending_[wave];
  if (per_slot.empty()) per_slot.resize(slots_.size());
  Buffer& buf = per_slot[static_cast<std::size_t>(id)];
  auto& spare = spare_[static_cast<std::size_t>(id)];
  if (!spare.empty()) {
    buf = std::move(spare.back());
    spare.pop_back();
  } else {
    buf.reset(new float[s.numel > 0 ? s.numel : 1]);
  }
  // The buffer stays where it is until its wave is applied, which needs this push's end_push first.
  return buf.get();
}

bool ShardPlane::end_push(int vw, int stage, std::int64_t wave) {
  const StageSlot& s = slot(vw, stage, false);
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (seen_.count({vw, stage, wave}) == 0 || arrived_[{vw, wave}].count(stage) != 0) {
    throw std::logic_error("ShardPlane: end_push of wave " + std::to_string(wave) + " from " + who(vw, stage) +
                           " without its begin_push");
  }
  if (log_sums_) {
    const float* delta = pending_[wave][static_cast<std::size_t>(slot_id(vw, stage))].get();
    const float scale = mean_ ? mean_divisor_[static_cast<std::size_t>(vw)] : 1.0f;
    std::lock_guard<std::mutex> log_lock(log_mutex_);
    std::size_t off = 0;
    for (int l : s.layers) {
      std::vector<double>& sum = log_.pushed_sum[static_cast<std::size_t>(l)];
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += static_cast<double>(delta[off + i] / scale);
      off += sum.size();
    }
  }
  {
    std::lock_guard<std::mutex> log_lock(log_mutex_);
    log_.pushes.push_back({vw, stage, wave});
  }
  arrived_[{vw, wave}].insert(stage);
  pushed_bytes_.fetch_add(static_cast<std::int64_t>(s.numel * sizeof(float)), std::memory_order_relaxed);
  for (;;) {
    const std::int64_t c = clocks_.clock(vw);
    const auto it = arrived_.find({vw, c});
    if (it == arrived_.end() || it->second.size() != stages_holding_[static_cast<std::size_t>(vw)]) break;
    arrived_.erase(it);
    clocks_.advance(vw);
    const std::int64_t g = clocks_.global_clock();
    const std::int64_t cv = clocks_.clock(vw);
    {
      std::lock_guard<std::mutex> log_lock(log_mutex_);
      log_.clocks.push_back({vw, cv, g});
    }
    if (cv - g < 0 || cv - g > d_ + 1) {
      std::ostringstream msg;
      msg << "ShardPlane: VW " << vw << " clock " << cv << " vs global " << g
          << " breaks 0 <= clock - global <= D + 1 with D = " << d_;
      throw std::logic_error(msg.str());
    }
  }
  return held_ < 0 && applied_.clock(0) < clocks_.global_clock();
}

bool ShardPlane::apply_due() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return held_ < 0 && applied_.clock(0) < clocks_.global_clock();
}

std::int64_t ShardPlane::apply_ready() {
  // Every thread whose push advanced a clock comes here after advancing, so a wave the global clock
  // passed is applied by that thread or by the applier it queues behind: none is left behind.
  std::lock_guard<std::mutex> one_applier(apply_mutex_);
  std::int64_t count = 0;
  for (;;) {
    std::vector<Buffer> wave;
    std::int64_t a = 0;
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      a = applied_.clock(0);
      if (held_ >= 0 || a >= clocks_.global_clock()) return count;
      const auto it = pending_.find(a);
      if (it != pending_.end()) {
        wave = std::move(it->second);
        pending_.erase(it);
      }
    }
    const std::vector<std::int64_t> versions = take_versions(a);
    {
      std::unique_lock<std::shared_mutex> exclusive(weights_mutex_);
      apply_wave(a, wave, versions);
      applied_.advance(0);
    }
    ++count;
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (hold_) held_ = a + 1;
    for (std::size_t id = 0; id < wave.size(); ++id) {
      if (wave[id]) spare_[id].push_back(std::move(wave[id]));
    }
  }
}

std::vector<std::int64_t> ShardPlane::take_versions(std::int64_t wave) {
  std::vector<std::int64_t> versions(slots_.size(), wave);
  if (outer_.staleness == StalenessDecay::kNone) return versions;
  std::lock_guard<std::mutex> lock(versions_mutex_);
  for (std::size_t id = 0; id < slots_.size(); ++id) {
    const auto it = versions_.find({static_cast<int>(id), wave});
    if (it == versions_.end()) continue;
    versions[id] = it->second;
    versions_.erase(it);
  }
  return versions;
}

void ShardPlane::record_version(int vw, int stage, std::int64_t wave, std::int64_t version) {
  if (outer_.staleness == StalenessDecay::kNone || !pushes_from(vw, stage)) return;
  std::lock_guard<std::mutex> lock(versions_mutex_);
  versions_[{slot_id(vw, stage), wave}] = version;
}

float ShardPlane::push_divisor(int vw, int stage, std::int64_t wave, std::int64_t version) const {
  const float n = static_cast<float>(num_vws());
  // std::sqrt of a float is IEEE's correctly rounded float square root, as numpy's float32 np.sqrt.
  const float gain = outer_.sqrt_gain ? std::sqrt(n) : (mean_ ? mean_divisor_[static_cast<std::size_t>(vw)] : 1.0f);
  if (outer_.staleness == StalenessDecay::kNone) return gain;
  if (version > wave) {
    throw std::logic_error("ShardPlane: " + who(vw, stage) + " pulled wave " + std::to_string(wave) + " at version " +
                           std::to_string(version) + ", after that wave was applied");
  }
  float decay = static_cast<float>(1 + wave - version);
  if (outer_.staleness == StalenessDecay::kSqrt) decay = std::sqrt(decay);
  return gain * decay;
}

void ShardPlane::apply_push(int layer, float* delta, float divisor) {
  const LayerView& w = weights_[static_cast<std::size_t>(layer)];
  if (outer_.plain()) {
    if (divisor > 1.0f) {
      apply_delta_divided(w.data(), delta, w.size(), divisor, num_threads_);
    } else {
      apply_delta(w.data(), delta, w.size(), 1.0f, num_threads_);
    }
    return;
  }
  if (divisor > 1.0f) divide_in_place(delta, w.size(), divisor, num_threads_);
  const auto l = static_cast<std::size_t>(layer);
  if (outer_.rule == OuterRule::kNesterov) {
    apply_delta(aggregated_[l].data(), delta, w.size(), 1.0f, num_threads_);
    return;
  }
  apply_delta(w.data(), delta, w.size(), outer_.lr, num_threads_);
  if (outer_.rule != OuterRule::kDelayedNesterov) return;
  apply_delta(aggregated_[l].data(), delta, w.size(), 1.0f, num_threads_);
  if (++outer_counts_[l] >= delay_) {
    outer_counts_[l] = 0;
    outer_delayed_momentum(w.data(), momentum_[l].data(), aggregated_[l].data(), w.size(), outer_.lr,
                           outer_.momentum, num_threads_);
  }
}

void ShardPlane::apply_wave(std::int64_t wave, std::vector<Buffer>& buffers, const std::vector<std::int64_t>& versions) {
  std::vector<std::array<std::int64_t, 3>> applied;
  for (int vw = 0; vw < num_vws(); ++vw) {  // VW 0 first, then 1, ...; stages and layers in order
    for (int stage = 0; stage < num_stages_[static_cast<std::size_t>(vw)]; ++stage) {
      const std::size_t id = static_cast<std::size_t>(slot_id(vw, stage));
      const StageSlot& s = slots_[id];
      if (s.layers.empty()) continue;
      float* delta = buffers.size() > id ? buffers[id].get() : nullptr;
      if (delta == nullptr) {
        throw std::logic_error("ShardPlane: wave " + std::to_string(wave) + " of " + who(vw, stage) +
                               " is applied but never arrived");
      }
      const float divisor = push_divisor(vw, stage, wave, versions[id]);
      std::size_t off = 0;
      for (int l : s.layers) {
        apply_push(l, delta + off, divisor);
        off += weights_[static_cast<std::size_t>(l)].size();
      }
      applied.push_back({vw, stage, wave});
    }
  }
  if (outer_.rule == OuterRule::kNesterov) {
    for (std::size_t l = 0; l < weights_.size(); ++l) {
      outer_nesterov(weights_[l].data(), momentum_[l].data(), aggregated_[l].data(), weights_[l].size(), outer_.lr,
                     outer_.momentum, num_threads_);
    }
  }
  // Synced buffers: B <- B + (sum over VWs of (P - B)) / VWs, VWs summed in order (one VW: B <- P).
  for (std::size_t l = 0; l < buffers_.size(); ++l) {
    std::vector<float>& b = buffers_[l];
    if (b.empty()) continue;
    std::vector<const float*> pushed;
    for (int vw = 0; vw < num_vws(); ++vw) {
      for (int stage = 0; stage < num_stages_[static_cast<std::size_t>(vw)]; ++stage) {
        const std::size_t id = static_cast<std::size_t>(slot_id(vw, stage));
        const StageSlot& s = slots_[id];
        std::size_t off = s.weight_numel;
        for (int held : s.layers) {
          if (static_cast<std::size_t>(held) == l) pushed.push_back(buffers[id].get() + off);
          off += buffers_[static_cast<std::size_t>(held)].size();
        }
      }
    }
    if (pushed.size() == 1) {
      std::memcpy(b.data(), pushed[0], b.size() * sizeof(float));
      continue;
    }
    average_buffers(b.data(), pushed.data(), pushed.size(), b.size());
  }
  std::lock_guard<std::mutex> log_lock(log_mutex_);
  log_.applied.insert(log_.applied.end(), applied.begin(), applied.end());
}

void ShardPlane::copy_reply(const StageSlot& s, float* out) const {
  std::size_t off = 0;
  for (int l : s.layers) {
    const LayerView& w = weights_[static_cast<std::size_t>(l)];
    snapshot(w.data(), out + off, w.size() * sizeof(float), num_threads_);
    off += w.size();
  }
  for (const ReplicaSlice& r : s.replicas) {
    std::memcpy(out + off, weights_[static_cast<std::size_t>(r.layer)].data() + r.offset, r.numel * sizeof(float));
    off += r.numel;
  }
  for (int l : s.layers) {
    const std::vector<float>& b = buffers_[static_cast<std::size_t>(l)];
    std::memcpy(out + off, b.data(), b.size() * sizeof(float));
    off += b.size();
  }
}

std::int64_t ShardPlane::serve(int vw, int stage, std::int64_t wave, float* out, std::size_t n) {
  const StageSlot& s = slot(vw, stage, true);
  if (out != nullptr && n != reply_numel(vw, stage)) {
    std::ostringstream msg;
    msg << "ShardPlane: pull for " << who(vw, stage) << " has room for " << n << " floats, expected "
        << reply_numel(vw, stage);
    throw std::invalid_argument(msg.str());
  }
  std::shared_lock<std::shared_mutex> shared(weights_mutex_);
  const std::int64_t a = applied_.clock(0);
  if (a < wave - d_) {
    std::ostringstream msg;
    msg << "ShardPlane: pull of wave " << wave << " for " << who(vw, stage) << " answered at version " << a
        << ", below wave - D = " << wave - d_;
    throw std::logic_error(msg.str());
  }
  if (out != nullptr) copy_reply(s, out);
  record_version(vw, stage, wave, a);
  std::lock_guard<std::mutex> log_lock(log_mutex_);
  log_.pulls.push_back({vw, stage, wave, a});
  log_.pull_clocks.push_back(clocks_.clock(vw));
  return a;
}

std::int64_t ShardPlane::pull_for(int vw, int stage, std::int64_t wave, float* out, std::size_t n,
                                  std::chrono::nanoseconds timeout) {
  const std::size_t expected = reply_numel(vw, stage);
  if (n != expected) {
    std::ostringstream msg;
    msg << "ShardPlane: pull for " << who(vw, stage) << " has room for " << n << " floats, expected " << expected;
    throw std::invalid_argument(msg.str());
  }
  if (!applied_.wait_until_for(wave, d_, timeout)) return -1;
  return serve(vw, stage, wave, out, n);
}

void ShardPlane::set_hold(bool hold) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  hold_ = hold;
  if (!hold) held_ = -1;
}

std::int64_t ShardPlane::held() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return held_;
}

void ShardPlane::release(std::int64_t applied) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (held_ != applied) {
    throw std::invalid_argument("ShardPlane: release(" + std::to_string(applied) + ") but the applier holds at " +
                                std::to_string(held_));
  }
  held_ = -1;
}

ShardPlaneLog ShardPlane::log() const {
  std::lock_guard<std::mutex> lock(log_mutex_);
  return log_;
}

}  // namespace hetpipe
