// Exception types of the core that have no standard-library equivalent.
#pragma once

#include <stdexcept>

namespace hetpipe {

// A bounded wait ran out of time (pool exhaustion, a clock that did not advance). Python: TimeoutError.
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace hetpipe
