// bf16 <-> fp32 on the host, by bit operations: round to nearest even, NaN stays NaN. Inline:
// the safetensors reader and writer and the CUDA backend's host optimizer call them per element.
#pragma once

#include <bit>
#include <cstdint>

namespace ctxplan {

inline uint16_t Fp32ToBf16(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFp32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

}  // namespace ctxplan
