#include "hetpipe/shard_plane.h"

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "hetpipe/shard_ops.h"

namespace hetpipe {

ShardPlane::ShardPlane(std::vector<std::size_t> layer_numels, std::vector<std::vector<std::vector<int>>> stage_layers,
                       int d, int num_threads)
    : stage_layers_(std::move(stage_layers)),
      d_(d),
      num_threads_(num_threads),
      clocks_(stage_layers_.empty() ? 1 : static_cast<int>(stage_layers_.size())),
      applied_(1) {
  if (stage_layers_.empty()) throw std::invalid_argument("ShardPlane: stage_layers names no virtual worker");
  if (d < 0) throw std::invalid_argument("ShardPlane: staleness bound d must be >= 0, got " + std::to_string(d));
  const int layers = static_cast<int>(layer_numels.size());
  for (std::size_t vw = 0; vw < stage_layers_.size(); ++vw) {
    std::size_t holding = 0;
    std::vector<bool> held(layer_numels.size(), false);
    for (std::size_t stage = 0; stage < stage_layers_[vw].size(); ++stage) {
      int last = -1;
      for (int l : stage_layers_[vw][stage]) {
        if (l <= last || l >= layers) {
          std::ostringstream msg;
          msg << "ShardPlane: stage_layers[" << vw << "][" << stage << "] must name layer indices ascending in [0, "
              << layers << "), got " << l;
          throw std::invalid_argument(msg.str());
        }
        held[static_cast<std::size_t>(l)] = true;
        last = l;
      }
      if (!stage_layers_[vw][stage].empty()) ++holding;
    }
    for (int l = 0; l < layers; ++l) {
      if (!held[static_cast<std::size_t>(l)]) {
        throw std::invalid_argument("ShardPlane: no stage of VW " + std::to_string(vw) + " holds layer " +
                                    std::to_string(l) + " (every VW holds the whole model)");
      }
    }
    stages_holding_.push_back(holding);
  }
  for (std::size_t n : layer_numels) weights_.emplace_back(n, 0.0f);
  spare_.resize(weights_.size());
}

std::size_t ShardPlane::layer_numel(int layer) const {
  if (layer < 0 || layer >= num_layers()) {
    throw std::out_of_range("ShardPlane: layer " + std::to_string(layer) + " out of range (" +
                            std::to_string(num_layers()) + " layers)");
  }
  return weights_[static_cast<std::size_t>(layer)].size();
}

float* ShardPlane::weights(int layer) {
  layer_numel(layer);
  return weights_[static_cast<std::size_t>(layer)].data();
}

const std::vector<int>& ShardPlane::holds(int vw, int stage) const {
  if (vw < 0 || vw >= num_vws() || stage < 0 || stage >= static_cast<int>(stage_layers_[vw].size()) ||
      stage_layers_[vw][stage].empty()) {
    throw std::invalid_argument("ShardPlane: VW " + std::to_string(vw) + " stage " + std::to_string(stage) +
                                " holds none of this shard's layers");
  }
  return stage_layers_[vw][stage];
}

std::size_t ShardPlane::stage_numel(int vw, int stage) const {
  std::size_t n = 0;
  for (int l : holds(vw, stage)) n += weights_[static_cast<std::size_t>(l)].size();
  return n;
}

void ShardPlane::push(int vw, int stage, std::int64_t wave, const float* delta, std::size_t n) {
  const std::vector<int>& mine = holds(vw, stage);
  const std::size_t expected = stage_numel(vw, stage);
  if (n != expected) {
    std::ostringstream msg;
    msg << "ShardPlane: push from VW " << vw << " stage " << stage << " wave " << wave << " has " << n
        << " floats, expected " << expected;
    throw std::invalid_argument(msg.str());
  }
  std::vector<Buffer> parts(mine.size());
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (!seen_.insert({vw, stage, wave}).second) {
      throw std::invalid_argument("ShardPlane: duplicate push of wave " + std::to_string(wave) + " from VW " +
                                  std::to_string(vw) + " stage " + std::to_string(stage));
    }
    if (wave < clocks_.clock(vw)) {
      seen_.erase({vw, stage, wave});
      throw std::invalid_argument("ShardPlane: VW " + std::to_string(vw) + " stage " + std::to_string(stage) +
                                  " pushed wave " + std::to_string(wave) + " but VW " + std::to_string(vw) +
                                  " is already at clock " + std::to_string(clocks_.clock(vw)));
    }
    for (std::size_t i = 0; i < mine.size(); ++i) {
      auto& spare = spare_[static_cast<std::size_t>(mine[i])];
      if (!spare.empty()) {
        parts[i] = std::move(spare.back());
        spare.pop_back();
      }
    }
  }
  // The copy runs outside every lock: pushes of different stages copy in parallel.
  std::size_t off = 0;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const std::size_t numel = weights_[static_cast<std::size_t>(mine[i])].size();
    if (!parts[i]) parts[i].reset(new float[numel]);
    std::memcpy(parts[i].get(), delta + off, numel * sizeof(float));
    off += numel;
  }
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    auto& per_vw = pending_[wave];
    if (per_vw.empty()) per_vw.resize(static_cast<std::size_t>(num_vws()));
    for (std::size_t i = 0; i < mine.size(); ++i) per_vw[static_cast<std::size_t>(vw)][mine[i]] = std::move(parts[i]);
    arrived_[{vw, wave}].insert(stage);
    for (;;) {
      const std::int64_t c = clocks_.clock(vw);
      const auto it = arrived_.find({vw, c});
      if (it == arrived_.end() || it->second.size() != stages_holding_[static_cast<std::size_t>(vw)]) break;
      arrived_.erase(it);
      clocks_.advance(vw);
      const std::int64_t g = clocks_.global_clock();
      const std::int64_t cv = clocks_.clock(vw);
      if (cv - g < 0 || cv - g > d_ + 1) {
        std::ostringstream msg;
        msg << "ShardPlane: VW " << vw << " clock " << cv << " vs global " << g
            << " breaks 0 <= clock - global <= D + 1 with D = " << d_;
        throw std::logic_error(msg.str());
      }
    }
  }
  pushed_bytes_.fetch_add(static_cast<std::int64_t>(n * sizeof(float)), std::memory_order_relaxed);
  apply_ready();
}

void ShardPlane::apply_ready() {
  // Every thread whose push advanced a clock comes here after advancing, so a wave the global clock
  // passed is applied by that thread or by the applier it queues behind: none is left behind.
  std::lock_guard<std::mutex> one_applier(apply_mutex_);
  for (;;) {
    std::vector<std::map<int, Buffer>> wave;
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      const std::int64_t a = applied_.clock(0);
      if (a >= clocks_.global_clock()) return;
      const auto it = pending_.find(a);
      if (it != pending_.end()) {
        wave = std::move(it->second);
        pending_.erase(it);
      }
    }
    {
      std::unique_lock<std::shared_mutex> exclusive(weights_mutex_);
      for (auto& layers : wave) {  // VW 0 first, then 1, ...; layers in order (std::map)
        for (auto& [l, delta] : layers) {
          std::vector<float>& w = weights_[static_cast<std::size_t>(l)];
          apply_delta(w.data(), delta.get(), w.size(), 1.0f, num_threads_);
        }
      }
      applied_.advance(0);
    }
    std::lock_guard<std::mutex> lock(state_mutex_);
    for (auto& layers : wave) {
      for (auto& [l, delta] : layers) spare_[static_cast<std::size_t>(l)].push_back(std::move(delta));
    }
  }
}

std::int64_t ShardPlane::pull_for(int vw, int stage, std::int64_t wave, float* out, std::size_t n,
                                  std::chrono::nanoseconds timeout) {
  const std::vector<int>& mine = holds(vw, stage);
  const std::size_t expected = stage_numel(vw, stage);
  if (n != expected) {
    std::ostringstream msg;
    msg << "ShardPlane: pull for VW " << vw << " stage " << stage << " has room for " << n << " floats, expected "
        << expected;
    throw std::invalid_argument(msg.str());
  }
  if (!applied_.wait_until_for(wave, d_, timeout)) return -1;
  std::shared_lock<std::shared_mutex> shared(weights_mutex_);
  const std::int64_t a = applied_.clock(0);
  std::size_t off = 0;
  for (int l : mine) {
    const std::vector<float>& w = weights_[static_cast<std::size_t>(l)];
    snapshot(w.data(), out + off, w.size() * sizeof(float), num_threads_);
    off += w.size();
  }
  return a;
}

}  // namespace hetpipe
