// Parameter-shard arithmetic of the parameter server: apply a pushed delta, the outer optimizer's
// steps, snapshot for a pull.
//
// Both operations split [0, n) statically into equal contiguous chunks (multiples of 16 elements),
// one per thread; the caller's thread takes the first chunk. The operations are elementwise, so the
// result is bitwise identical for every thread count. apply_delta computes shard[i] + scale * delta[i]
// with two float32 roundings (no fused multiply-add; its file is compiled with -ffp-contract=off), so
// it equals numpy's `a += np.float32(scale) * b` bit for bit. Shards are float32.
//
// Threads: callable from any thread; callers must not modify the buffers concurrently.
#pragma once

#include <cstddef>

namespace hetpipe {

// Threads used for n elements: num_threads <= 0 means hardware concurrency capped at 16; never more
// than one thread per 256 Ki elements (small shards stay on the caller's thread).
int shard_threads(int num_threads, std::size_t n) noexcept;

// shard += scale * delta over n elements. shard and delta may be the same buffer but must not
// otherwise overlap (std::invalid_argument).
void apply_delta(float* shard, const float* delta, std::size_t n, float scale, int num_threads);

// shard += delta / divisor over n elements, two float32 roundings: numpy's
// `np.divide(delta, np.float32(divisor), out=delta); apply_delta(shard, delta)` bit for bit (delta is
// left unchanged). Same threading and overlap rules as apply_delta.
void apply_delta_divided(float* shard, const float* delta, std::size_t n, float divisor, int num_threads);

// x[i] = x[i] / divisor over n elements, one float32 rounding: numpy's
// `np.divide(x, np.float32(divisor), out=x)` bit for bit. Same threading as apply_delta.
void divide_in_place(float* x, std::size_t n, float divisor, int num_threads);

// The PS's outer Nesterov step (DiLoCo's) on a wave's aggregated delta `aggregated`, which it then zeroes:
// g = -aggregated; momentum <- mu * momentum + g; shard <- shard - lr * (mu * momentum + g). Every
// product, sum and difference is rounded to float32 once, in this order (no fused multiply-add), so it
// equals the numpy steps of hetpipe.ps.shard.ShardState bit for bit. The three buffers must not overlap
// (std::invalid_argument); same threading as apply_delta.
void outer_nesterov(float* shard, float* momentum, float* aggregated, std::size_t n, float lr, float mu,
                    int num_threads);

// The momentum step of the PS's delayed Nesterov (Async Local-SGD's; python/hetpipe/plan/outer.py) on the
// pushes `accumulated` since the previous one, which it then zeroes: momentum <- mu * momentum - accumulated;
// shard <- shard - lr * (mu * momentum). Every product and difference is rounded to float32 once, in this
// order (no fused multiply-add), so it equals the numpy steps of hetpipe.ps.outer_step bit for bit. The
// three buffers must not overlap (std::invalid_argument); same threading as apply_delta.
void outer_delayed_momentum(float* shard, float* momentum, float* accumulated, std::size_t n, float lr, float mu,
                            int num_threads);

// A stage's wave delta after a local step: delta[i] = delta[i] + (after[i] - before[i]), two float32
// roundings, so it equals torch's `torch.sub(after, before, out=tmp); delta += tmp` bit for bit while
// reading each array once instead of the three passes of those two calls. delta must not overlap after
// or before (std::invalid_argument); after and before may overlap each other (both are only read).
// Same threading as apply_delta.
void accumulate_change(float* delta, const float* after, const float* before, std::size_t n, int num_threads);

// Synced buffers (BatchNorm running statistics) after a wave: b <- b + (sum over k of (pushed[k] - b)) / count,
// float32 throughout and summed in k order (numpy's `change += p - b` per VW, then
// `b += change / np.float32(count)`), so a buffer no VW changed stays bitwise the same. One thread.
void average_buffers(float* b, const float* const* pushed, std::size_t count, std::size_t n);

// out = shard (nbytes bytes); the buffers must not overlap.
void snapshot(const void* shard, void* out, std::size_t nbytes, int num_threads);

}  // namespace hetpipe
