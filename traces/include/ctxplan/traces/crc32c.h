// CRC-32C (Castagnoli), the checksum of checkpoint tensors and of traces: the SSE4.2 instruction
// where the CPU has it (several GB/s, so a 7B checkpoint's 84 GB check in seconds), else a table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace ctxplan {

// The CRC-32C of `bytes`, continuing from `crc` (0 to start): Crc32c(b, Crc32c(a)) equals the
// checksum of a then b.
uint32_t Crc32c(std::span<const std::byte> bytes, uint32_t crc = 0);

// Eight lower-case hex digits, as checkpoints store a checksum.
std::string Crc32cHex(uint32_t crc);

}  // namespace ctxplan
