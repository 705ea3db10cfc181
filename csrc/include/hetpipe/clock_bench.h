// Test and benchmark drivers for ClockTable: loops that run in C++ threads, because a Python loop of
// 10^6 operations measures the interpreter, not the table. Not used on the training path.
#pragma once

#include <cstdint>
#include <string>

#include "hetpipe/clock_table.h"

namespace hetpipe {

enum class ClockOp { advance, clock, global_clock, wait_check };

// "advance" | "clock" | "global_clock" | "wait_check"; throws std::invalid_argument otherwise.
ClockOp parse_clock_op(const std::string& name);

// Starts `threads` threads together; thread t performs its share of `ops` operations (ops split as
// evenly as possible) on VW t % num_vws. wait_check is a wait_until that is already satisfied.
// Returns the wall time in seconds from the common start to the last thread's end.
double clock_bench(ClockTable& table, ClockOp op, int threads, std::int64_t ops);

// The same loop over a baseline: a std::mutex-protected vector of counters.
double mutex_clock_bench(int num_vws, ClockOp op, int threads, std::int64_t ops);

// Contention test: `threads` threads perform `ops` advances in total, operation i of thread t on
// VW (t + i) % num_vws, so every VW is advanced concurrently by several threads. Returns seconds.
double clock_stress(ClockTable& table, int threads, std::int64_t ops);

}  // namespace hetpipe
