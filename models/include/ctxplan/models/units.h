// Byte and token quantities, and the parsing of human-written sizes ("125GiB", "1M").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ctxplan {

inline constexpr int64_t kKiB = int64_t{1} << 10;
inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;
inline constexpr int64_t kGB = 1'000'000'000;

// "125GiB", "512 GiB", "80GB", "4096", "1.5TiB" -> bytes. Throws InputError naming `what`.
int64_t ParseBytes(std::string_view text, std::string_view what);

// "1M" -> 1,048,576; "32K" -> 32,768; "1000000" -> 1,000,000. K/M/G are binary multiples, as
// context lengths are quoted (8K = 8192). Throws InputError naming `what`.
int64_t ParseTokens(std::string_view text, std::string_view what);

std::string FormatBytes(int64_t bytes);    // "15.23 GB (14.18 GiB)"
std::string FormatGiB(int64_t bytes);      // "14.18 GiB"
std::string FormatTokens(int64_t tokens);  // "1,048,576 (1M)"
std::string FormatCount(int64_t value);    // "1,048,576"

}  // namespace ctxplan
