#include "ctxplan/sim/calibration.h"

#include <cmath>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/errors.h"

namespace ctxplan::sim {

namespace {

constexpr std::string_view kSamplesColumns =
    "op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,flops,"
    "copies,seconds,sm_clock_mhz,watts";
// Samples written before ctxplan-measure recorded clock and power.
constexpr std::string_view kSamplesColumnsWithoutClock =
    "op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,flops,"
    "copies,seconds";

[[noreturn]] void Bad(const std::filesystem::path& path, int line, const std::string& problem) {
  throw InputError(path.string() + ":" + std::to_string(line) + ": " + problem +
                   " (expected the CSV of ctxplan-measure: " + std::string(kSamplesColumns) + ")");
}

std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream fields(line);
  for (std::string cell; std::getline(fields, cell, ',');) out.push_back(cell);
  if (!line.empty() && line.back() == ',') out.emplace_back();
  return out;
}

}  // namespace

CalibrationSamples ReadCalibrationSamples(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw InputError(path.string() + ": cannot open the calibration samples");
  CalibrationSamples out;
  std::string line;
  int number = 0;
  bool header_seen = false;
  size_t columns = 0;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line[0] == '#') {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string key = line.substr(1, colon - 1), value = line.substr(colon + 1);
        auto trim = [](std::string& v) {
          v.erase(0, v.find_first_not_of(' '));
          v.erase(v.find_last_not_of(' ') + 1);
        };
        trim(key);
        trim(value);
        out.header[key] = value;
      }
      continue;
    }
    if (!header_seen) {
      if (line == kSamplesColumns)
        columns = 17;
      else if (line == kSamplesColumnsWithoutClock)
        columns = 15;
      else
        Bad(path, number, "unexpected header line");
      header_seen = true;
      continue;
    }
    const std::vector<std::string> f = SplitCsv(line);
    if (f.size() != columns)
      Bad(path, number, std::to_string(f.size()) + " fields, not " + std::to_string(columns));
    CalibrationSample s;
    s.op = f[0];
    auto integer = [&](size_t i) -> int64_t {
      try {
        size_t used = 0;
        const long long v = std::stoll(f[i], &used);
        if (used != f[i].size() || v < 0) throw std::invalid_argument("");
        return v;
      } catch (const std::exception&) {
        Bad(path, number, "field " + std::to_string(i + 1) + " " + f[i] + " is not a count");
      }
    };
    auto number_at = [&](size_t i) -> double {
      try {
        size_t used = 0;
        const double v = std::stod(f[i], &used);
        if (used != f[i].size() || !std::isfinite(v) || v < 0) throw std::invalid_argument("");
        return v;
      } catch (const std::exception&) {
        Bad(path, number, "field " + std::to_string(i + 1) + " " + f[i] + " is not a number");
      }
    };
    s.m = integer(1);
    s.n = integer(2);
    s.k = integer(3);
    s.heads = integer(4);
    s.kv_heads = integer(5);
    s.head_dim = integer(6);
    s.page_tokens = integer(7);
    s.pages = integer(8);
    s.pages_per_tile = integer(9);
    s.grad_bytes = integer(10);
    s.bytes = number_at(11);
    s.flops = number_at(12);
    s.copies = integer(13);
    s.seconds = number_at(14);
    if (columns == 17) {
      s.sm_clock_mhz = number_at(15);
      s.watts = number_at(16);
    }
    out.rows.push_back(std::move(s));
  }
  if (!header_seen) Bad(path, number, "no header line");
  return out;
}

}  // namespace ctxplan::sim
