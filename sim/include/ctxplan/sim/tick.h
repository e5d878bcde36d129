// Simulated time. One Tick is one picosecond: fine enough that bandwidth-derived durations
// (a 4 KiB page over a 55 GB/s link is ~74 ns) round with negligible error, and an int64 still
// spans ~106 days of simulated time.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "ctxplan/models/errors.h"

namespace ctxplan::sim {

using Tick = int64_t;

inline constexpr Tick kTicksPerSecond = 1'000'000'000'000;
inline constexpr Tick kTicksPerMillisecond = 1'000'000'000;
inline constexpr Tick kTicksPerMicrosecond = 1'000'000;
inline constexpr Tick kTicksPerNanosecond = 1'000;
inline constexpr Tick kMaxTick = std::numeric_limits<Tick>::max();

// Rounds to the nearest tick. Durations come from our own models, so a non-finite or
// unrepresentable value is a bug (InternalError); the CLI validates user-given times itself.
[[gnu::cold, gnu::noinline]] inline void ThrowUnrepresentableTicks(double seconds) {
  CTXPLAN_CHECK(false, "SecondsToTicks(" + std::to_string(seconds) + ") is not representable");
}

inline Tick SecondsToTicks(double seconds) {
  const double ticks = seconds * static_cast<double>(kTicksPerSecond);
  // 2^63 is exactly representable; every double below it converts without overflow. NaN fails
  // both comparisons.
  constexpr double kLimit = 9223372036854775808.0;
  if (!(ticks > -kLimit && ticks < kLimit)) [[unlikely]]
    ThrowUnrepresentableTicks(seconds);
  // Rounded half away from zero, as std::llround, without its library call (the analytic path
  // converts every op's seconds).
  return static_cast<Tick>(ticks + (ticks >= 0 ? 0.5 : -0.5));
}

// For reports, not for arithmetic: a double holds whole picoseconds only up to 2^53 (~2.5 h).
inline double TicksToSeconds(Tick ticks) {
  return static_cast<double>(ticks) / static_cast<double>(kTicksPerSecond);
}

// Chrome traces count in microseconds.
inline double TicksToMicroseconds(Tick ticks) {
  return static_cast<double>(ticks) / static_cast<double>(kTicksPerMicrosecond);
}

}  // namespace ctxplan::sim
