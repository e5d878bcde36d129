#include "ctxplan/sim/calibration.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/sim/kernel_time_model.h"

namespace ctxplan::sim {

namespace {

constexpr std::string_view kSamplesColumns =
    "op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,flops,"
    "copies,seconds,sm_clock_mhz,watts";
// Samples written before ctxplan-measure recorded clock and power.
constexpr std::string_view kSamplesColumnsWithoutClock =
    "op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,grad_bytes,bytes,flops,"
    "copies,seconds";
constexpr int64_t kQueryTile = 128;  // ctxplan-measure's page selections use query tiles of 128
// Copies at least this large measure the link's bandwidth (their call cost is under 1%).
constexpr double kBandwidthCopyBytes = 64.0 * (1 << 20);
// GEMM output tiles cuBLASLt's Hopper kernels use; the fit keeps the one that explains the
// samples best.
constexpr std::array<std::pair<int64_t, int64_t>, 4> kGemmTiles = {
    {{128, 128}, {128, 256}, {256, 128}, {256, 256}}};
// The grid searched for the discrete and fixed-cost parameters (each with its rate implied).
constexpr int64_t kGemmSplitMax = 4;
constexpr double kGemmWaveUsMax = 3.0, kGemmWaveUsStep = 0.25;
constexpr double kAccumulateWaveUsMax = 6.0, kAccumulateWaveUsStep = 0.25;  // per output byte
// An item's fixed cost: up to 40 us (the backward's own launches, timed heaviest first, fit 28 us
// on the H200 and 32 on the H100).
constexpr double kAttentionItemUsMax = 40.0, kAttentionItemUsStep = 0.5;
constexpr double kGatheredItemUsMax = 48.0;
constexpr double kUnionBlockUsMax = 120.0;
constexpr double kLaunchUsStep = 0.1;
// A fitted power exponent outside this range is a failed measurement, not physics.
constexpr double kPowerExponentMin = 1.0, kPowerExponentMax = 4.0;
constexpr double kPageScoreFixedUsMax = 40.0, kPageScoreFixedUsStep = 0.5;
constexpr double kMemoryKernelFixedUsMax = 20.0, kMemoryKernelFixedUsStep = 0.1;
constexpr double kPageScoreNsPerTileElementMax = 2.0, kPageScoreNsPerTileElementStep = 0.02;
constexpr double kPageTopKFixedUsMax = 40.0, kPageTopKFixedUsStep = 0.5;
constexpr int kBisections = 40;

double Median(std::vector<double> v) {
  CTXPLAN_CHECK(!v.empty(), "median of nothing");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

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

bool IsMemoryOp(const std::string& op) {
  static const std::array<std::string_view, 13> kOps = {
      "rmsnorm_fwd", "rmsnorm_bwd",   "rmsnorm_bwd_final", "rope",     "swiglu_fwd",
      "swiglu_bwd",  "embedding_fwd", "embedding_bwd",     "kv_write", "dkv_accumulate",
      "zero_fill",   "adamw",         "page_summary"};
  return std::find(kOps.begin(), kOps.end(), op) != kOps.end();
}

// A memory-bound kernel timed right after the kernel that wrote its input ("rope_warm"): its
// kernel's name, else empty.
std::string WarmMemoryOp(const std::string& op) {
  constexpr std::string_view kSuffix = "_warm";
  if (op.size() <= kSuffix.size() || !op.ends_with(kSuffix)) return "";
  std::string base = op.substr(0, op.size() - kSuffix.size());
  return IsMemoryOp(base) ? base : "";
}

// The op(s) the planner would time for a sample, and how many launches they stand for.
struct SampleCosts {
  std::vector<OpCost> costs;
  Phase phase = Phase::kFill;
  int merged_launches = 0;  // launches the model counts beyond the one the kernel makes
};

SampleCosts CostsOf(const CalibrationSample& s) {
  SampleCosts out;
  const int64_t kv_dim = s.kv_heads * s.head_dim;
  const int64_t grad_bytes = s.grad_bytes > 0 ? s.grad_bytes : kBf16Bytes;
  if (s.op == "gemm_fwd") {
    out.costs.push_back(LinearForwardCost(s.m, s.n, s.k));
  } else if (s.op == "gemm_bwd_input") {
    out.costs.push_back(LinearBackwardInputCost(s.m, s.n, s.k));
  } else if (s.op == "gemm_bwd_weight") {
    out.costs.push_back(LinearBackwardWeightCost(s.m, s.n, s.k, {}, grad_bytes));
  } else if (s.op == "lora_fwd" || s.op == "lora_bwd_input" || s.op == "lora_bwd_weight") {
    // heads: the projections, head_dim: the rank (measure_kernels.cpp MeasureLora).
    const LoraAdapters lora{s.head_dim, static_cast<int32_t>(s.heads)};
    out.costs.push_back(s.op == "lora_fwd" ? LoraForwardCost(s.m, s.n, s.k, lora)
                        : s.op == "lora_bwd_input"
                            ? LoraBackwardInputCost(s.m, s.n, s.k, lora)
                            : LoraBackwardWeightCost(s.m, s.n, s.k, lora, grad_bytes));
  } else if (s.op == "loss") {
    out.costs.push_back(LossForwardBackwardCost(s.m, s.k, s.n, true, grad_bytes));
  } else if (s.op == "attention_fwd" || s.op == "attention_bwd") {
    const bool backward = s.op == "attention_bwd";
    const double t = static_cast<double>(s.m);
    const double pairs_own = t * (t + 1.0) / 2.0;
    out.costs.push_back(
        backward
            ? AttentionBackwardCost(pairs_own, s.m, s.m, s.heads, kv_dim, s.head_dim, grad_bytes)
            : AttentionForwardCost(pairs_own, s.m, s.m, s.heads, kv_dim, s.head_dim));
    if (s.pages > 0) {
      const bool sparse = s.pages_per_tile > 0 && s.pages_per_tile < s.pages;
      const int64_t tile_pages = sparse ? s.pages_per_tile : s.pages;
      const double pairs = t * static_cast<double>(tile_pages * s.page_tokens);
      const int64_t tiles = (s.m + kQueryTile - 1) / kQueryTile;
      const int64_t read = (sparse ? tiles : 1) * tile_pages * s.page_tokens;
      // ctxplan-measure's selections are random: the pages some tile selected, expected.
      const double untouched =
          std::pow(1.0 - static_cast<double>(tile_pages) / static_cast<double>(s.pages),
                   static_cast<double>(tiles));
      const int64_t key_pages =
          sparse ? std::max<int64_t>(tile_pages, std::llround(s.pages * (1.0 - untouched)))
                 : s.pages;
      out.costs.push_back(
          backward ? AttentionBackwardCost(pairs, s.m, read, s.heads, kv_dim, s.head_dim,
                                           grad_bytes, sparse, s.page_tokens, tile_pages, key_pages)
                   : AttentionForwardCost(pairs, s.m, read, s.heads, kv_dim, s.head_dim, sparse,
                                          s.page_tokens, tile_pages, key_pages));
      out.costs[0].shape.merged = true;  // the kernel runs the own and paged parts as one launch
      out.merged_launches = 1;
    }
  } else if (s.op == "page_score") {
    out.costs.push_back(PageScoreCost(s.m, kQueryTile, s.pages, s.heads * s.head_dim, kv_dim));
  } else if (s.op == "page_topk") {
    out.costs.push_back(PageTopKCost(s.m, s.pages, s.pages_per_tile));
  } else if (IsMemoryOp(s.op) || !WarmMemoryOp(s.op).empty()) {
    const std::string warm = WarmMemoryOp(s.op);
    const std::string kernel = warm.empty() ? s.op : warm;
    OpCost cost{0.0, s.bytes, RateClass::kMemoryBound, {}};
    for (int i = 1; i < static_cast<int>(MemoryKernel::kCount_); ++i)
      if (MemoryKernelName(static_cast<MemoryKernel>(i)) == kernel)
        cost.shape.memory_kernel = static_cast<MemoryKernel>(i);
    cost.shape.warm_input = !warm.empty();
    out.costs.push_back(cost);
  } else if (s.op == "copy_h2d" || s.op == "copy_d2h" || s.op == "copy_batch_h2d" ||
             s.op == "copy_batch_d2h") {
    const int64_t copies = std::max<int64_t>(1, s.copies);
    const bool h2d = s.op == "copy_h2d" || s.op == "copy_batch_h2d";
    out.costs.push_back(CopyCost(static_cast<int64_t>(s.bytes) * copies, h2d, copies));
  }
  return out;
}

}  // namespace

double PredictedSeconds(const KernelTimeModel& model, const CalibrationSample& s) {
  const SampleCosts c = CostsOf(s);
  double seconds = 0;
  for (const OpCost& cost : c.costs) seconds += model.Seconds(cost, c.phase);
  return seconds - c.merged_launches * model.profile().launch_us * 1e-6;
}

namespace {

MachineSpec MachineFor(const GpuSpec& gpu) {
  MachineSpec m;
  m.name = gpu.name;
  m.gpu = gpu;
  m.host_ram_bytes = 1;
  m.host_memory_gbs = 100;
  return m;
}

// Rows of the samples that `keep` accepts.
std::vector<const CalibrationSample*> Select(
    const CalibrationSamples& samples, const std::function<bool(const CalibrationSample&)>& keep) {
  std::vector<const CalibrationSample*> out;
  for (const CalibrationSample& s : samples.rows)
    if (keep(s) && s.seconds > 0) out.push_back(&s);
  return out;
}

std::vector<const CalibrationSample*> Op(const CalibrationSamples& samples, std::string_view op) {
  return Select(samples, [&](const CalibrationSample& s) { return s.op == op; });
}

void Require(const std::vector<const CalibrationSample*>& rows, std::string_view what) {
  if (rows.empty())
    throw InputError("calibration samples have no usable " + std::string(what) +
                     " rows: re-run ctxplan-measure with that group");
}

std::string Describe(const CalibrationSample& s) {
  std::ostringstream o;
  o << s.op << " m " << s.m;
  if (s.n) o << " n " << s.n;
  if (s.k) o << " k " << s.k;
  if (s.head_dim) o << " heads " << s.heads << "/" << s.kv_heads << " d_h " << s.head_dim;
  if (s.page_tokens) o << " p " << s.page_tokens << " pages " << s.pages;
  if (s.pages_per_tile) o << " per tile " << s.pages_per_tile;
  if (s.bytes && !s.flops) o << " bytes " << s.bytes;
  if (s.copies > 1) o << " x" << s.copies;
  return o.str();
}

FitResidual Residual(const KernelTimeModel& model, std::string group,
                     const std::vector<const CalibrationSample*>& rows) {
  FitResidual r;
  r.group = std::move(group);
  std::vector<double> errors;
  for (const CalibrationSample* s : rows) {
    const double predicted = PredictedSeconds(model, *s);
    r.each.push_back({*s, predicted});
    const double error = std::abs(predicted / s->seconds - 1.0);
    errors.push_back(error);
    if (error >= r.max_error) {
      r.max_error = error;
      r.worst = Describe(*s);
    }
  }
  r.samples = static_cast<int>(rows.size());
  if (!errors.empty()) r.median_error = Median(errors);
  return r;
}

}  // namespace

void WriteFitReport(std::ostream& out, const std::vector<FitResidual>& residuals) {
  out << "group,op,m,n,k,heads,kv_heads,head_dim,page_tokens,pages,pages_per_tile,copies,"
         "measured_s,predicted_s,predicted_over_measured\n";
  char numbers[96];
  for (const FitResidual& r : residuals) {
    for (const SampleFit& f : r.each) {
      const CalibrationSample& s = f.sample;
      std::snprintf(numbers, sizeof(numbers), "%.9g,%.9g,%.5f", s.seconds, f.predicted_seconds,
                    s.seconds > 0 ? f.predicted_seconds / s.seconds : 0.0);
      out << r.group << "," << s.op << "," << s.m << "," << s.n << "," << s.k << "," << s.heads
          << "," << s.kv_heads << "," << s.head_dim << "," << s.page_tokens << "," << s.pages << ","
          << s.pages_per_tile << "," << s.copies << "," << numbers << "\n";
    }
  }
}

namespace {

using Setter = std::function<void(KernelProfile&, double)>;

// The value of one profile parameter at which the model reproduces each sample, by bisection on
// a log scale between lo and hi (the model's time falls as the parameter, a rate or a fraction,
// rises); the median over the samples, robust to the odd slow repetition or off-model shape.
double ImpliedMedian(const GpuSpec& gpu, const KernelProfile& base, const Setter& set,
                     const std::vector<const CalibrationSample*>& rows, double lo, double hi) {
  const MachineSpec machine = MachineFor(gpu);
  KernelProfile trial = base;
  auto predict = [&](const CalibrationSample& s, double x) {
    set(trial, x);
    return PredictedSeconds(KernelTimeModel(machine, trial), s);
  };
  std::vector<double> implied;
  for (const CalibrationSample* s : rows) {
    double a = std::log(lo), b = std::log(hi);
    if (predict(*s, hi) > s->seconds) {
      implied.push_back(hi);
      continue;
    }
    if (predict(*s, lo) < s->seconds) {
      implied.push_back(lo);
      continue;
    }
    for (int i = 0; i < kBisections; ++i) {
      const double mid = 0.5 * (a + b);
      (predict(*s, std::exp(mid)) > s->seconds ? a : b) = mid;
    }
    implied.push_back(std::exp(0.5 * (a + b)));
  }
  return Median(implied);
}

// How badly a profile explains samples: the median and a quarter of the worst |log error|.
double Score(const GpuSpec& gpu, const KernelProfile& k,
             const std::vector<const CalibrationSample*>& rows) {
  const KernelTimeModel model(MachineFor(gpu), k);
  std::vector<double> errors;
  for (const CalibrationSample* s : rows)
    errors.push_back(std::abs(std::log(PredictedSeconds(model, *s) / s->seconds)));
  return Median(errors) + 0.25 * *std::max_element(errors.begin(), errors.end());
}

// The fused loss: its GEMMs at loss_efficiency of the GEMM model and its softmax at
// loss_ns_per_logit, by least squares on the relative error, where the rows span two hidden sizes
// or more (the two terms are otherwise one); else the GEMMs' share alone, their median.
void FitLoss(const GpuSpec& gpu, const std::vector<const CalibrationSample*>& rows,
             KernelProfile& k) {
  std::set<int64_t> hidden;
  for (const CalibrationSample* s : rows) hidden.insert(s->k);
  k.loss_ns_per_logit = 0;
  if (hidden.size() >= 2) {
    KernelProfile unit = k;
    unit.loss_efficiency = 1;
    const KernelTimeModel model(MachineFor(gpu), unit);
    // Minimise sum ((a g + b l) / t - 1)^2: g the GEMMs' seconds at efficiency 1, l the logits.
    double gg = 0, gl = 0, ll = 0, g1 = 0, l1 = 0;
    for (const CalibrationSample* s : rows) {
      const double g = PredictedSeconds(model, *s) / s->seconds;
      const double l = static_cast<double>(s->m) * static_cast<double>(s->n) / s->seconds;
      gg += g * g;
      gl += g * l;
      ll += l * l;
      g1 += g;
      l1 += l;
    }
    const double det = gg * ll - gl * gl;
    const double a = (g1 * ll - l1 * gl) / det, b = (gg * l1 - gl * g1) / det;
    if (det > 0 && a > 0 && b >= 0) {
      k.loss_efficiency = std::clamp(1.0 / a, 0.02, 2.0);
      k.loss_ns_per_logit = b * 1e9;
      return;
    }
  }
  k.loss_efficiency = ImpliedMedian(
      gpu, k, [](KernelProfile& p, double x) { p.loss_efficiency = x; }, rows, 0.02, 2.0);
}

// 0, step, 2 step, ... up to max: the values a grid search tries (exact multiples, no drift).
std::vector<double> Grid(double max, double step) {
  std::vector<double> values;
  for (int i = 0; i * step <= max + 1e-9; ++i) values.push_back(i * step);
  return values;
}

// The best of a grid search's trials.
struct Candidate {
  KernelProfile profile;
  double score = -1;
  void Consider(const KernelProfile& trial, double trial_score) {
    if (score < 0 || trial_score < score) {
      profile = trial;
      score = trial_score;
    }
  }
};

// A fixed cost (a grid) and a cost per unit of work (implied): the pair that explains `rows` best.
KernelProfile FitFixedAndPerUnit(const GpuSpec& gpu, const KernelProfile& k,
                                 const std::vector<const CalibrationSample*>& rows,
                                 double KernelProfile::*fixed_cost, double KernelProfile::*per_unit,
                                 double fixed_max, double fixed_step) {
  Candidate best;
  for (const double fixed : Grid(fixed_max, fixed_step)) {
    KernelProfile trial = k;
    trial.*fixed_cost = fixed;
    // The model's time rises with the cost: bisect on its inverse, a rate.
    trial.*per_unit =
        1.0 / ImpliedMedian(
                  gpu, trial, [per_unit](KernelProfile& p, double x) { p.*per_unit = 1.0 / x; },
                  rows, 1e-6, 1e6);
    best.Consider(trial, Score(gpu, trial, rows));
  }
  return best.profile;
}

// One memory-bound kernel's fixed cost (a grid) and fraction of the device copy rate (implied,
// at most `max_fraction`) in the tables `fixed_us` and `fraction` under `key`: the pair that
// explains `rows` best.
using KernelTable = std::map<std::string, double>;
KernelProfile FitKernelFixedAndFraction(const GpuSpec& gpu, const KernelProfile& k,
                                        const std::vector<const CalibrationSample*>& rows,
                                        const std::string& key,
                                        KernelTable KernelProfile::*fixed_us,
                                        KernelTable KernelProfile::*fraction, double max_fraction) {
  Candidate best;
  for (const double fixed : Grid(kMemoryKernelFixedUsMax, kMemoryKernelFixedUsStep)) {
    KernelProfile trial = k;
    (trial.*fixed_us)[key] = fixed;
    (trial.*fraction)[key] = 1.0;
    (trial.*fraction)[key] = ImpliedMedian(
        gpu, trial, [&](KernelProfile& p, double x) { (p.*fraction)[key] = x; }, rows, 0.02,
        max_fraction);
    best.Consider(trial, Score(gpu, trial, rows));
  }
  return best.profile;
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

namespace {

double HeaderNumber(const CalibrationSamples& samples, const char* key) {
  auto it = samples.header.find(key);
  if (it == samples.header.end()) return 0;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    return 0;
  }
}

// The kernels whose time goes as 1 / SM clock (clock_model.h).
bool IsClockBound(std::string_view op) {
  return op.rfind("gemm_", 0) == 0 || op == "loss" || op == "attention_fwd" ||
         op == "attention_bwd";
}

// The samples with every compute-bound kernel's seconds scaled from the clock it was timed at to
// the maximum SM clock, at which the profile's rates hold. Samples without a clock stay as
// they are.
CalibrationSamples AtMaxClock(const CalibrationSamples& measured) {
  CalibrationSamples out = measured;
  const double max_mhz = HeaderNumber(measured, "max_sm_clock_mhz");
  if (max_mhz <= 0) return out;
  for (CalibrationSample& s : out.rows) {
    std::string_view op = s.op;
    if (op.rfind("power_", 0) == 0) op.remove_prefix(6);
    if (IsClockBound(op) && s.sm_clock_mhz > 0) s.seconds *= s.sm_clock_mhz / max_mhz;
  }
  return out;
}

// The exponent of power against clock, from the GEMM run sustained alone and with idle gaps
// ("power_duty_gemm_fwd": seconds of a GEMM and its gap, `copies` the gap in us). With the gaps
// the board's limit allows a higher clock x; the GEMM runs a fraction f of the time and draws
// P - idle = f * G * x^g above idle. A least-squares line through log((P - idle) / f) against
// log x gives g. 0 where the rows do not span enough clocks to tell. Reported, not used: see
// clock_model.h.
double DutyCyclePowerExponent(const CalibrationSamples& samples, double idle, double max_mhz) {
  std::vector<std::pair<double, double>> points;  // (log x, log((P - idle) / f))
  auto add = [&](const CalibrationSample& s, double gemm_seconds) {
    if (s.watts <= idle || s.sm_clock_mhz <= 0 || s.seconds <= 0 || gemm_seconds <= 0) return;
    const double fraction = std::min(1.0, gemm_seconds / s.seconds);
    points.emplace_back(std::log(std::min(1.0, s.sm_clock_mhz / max_mhz)),
                        std::log((s.watts - idle) / fraction));
  };
  const auto duty = Op(samples, "power_duty_gemm_fwd");
  if (duty.empty()) return 0;
  for (const CalibrationSample* s : duty)
    add(*s, s->seconds - static_cast<double>(s->copies) * 1e-6);
  for (const CalibrationSample* s : Op(samples, "power_gemm_fwd"))
    if (s->m == duty.front()->m && s->n == duty.front()->n && s->k == duty.front()->k)
      add(*s, s->seconds);
  if (points.size() < 2) return 0;
  double mx = 0, my = 0;
  for (const auto& [x, y] : points) {
    mx += x;
    my += y;
  }
  mx /= static_cast<double>(points.size());
  my /= static_cast<double>(points.size());
  double sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    sxx += (x - mx) * (x - mx);
    sxy += (x - mx) * (y - my);
  }
  // Clocks within ~5% of each other: the slope is noise.
  if (sxx < static_cast<double>(points.size()) * 0.0005) return 0;
  return std::clamp(sxy / sxx, kPowerExponentMin, kPowerExponentMax);
}

// The power group: idle watts, the power limit, and each kind's watts above idle at the maximum
// clock, from its sustained draw at the clock it held (P - idle) / x^kPowerExponent. The clock
// x is the kernel's speed there against the profile's at the maximum clock (`model`, fitted on
// the timed rows), not the SM clock NVML reports: under the limit an H100 reports 6-11% less
// clock than an H200 doing the same work a second at the same draw (GEMM 1.43 ms at 1340 MHz
// against 1.45 ms at 1429; attention forward 4.38 ms at 1512 against 4.39 at 1669), and 1 / its
// reported clock misses its sustained kernels' times by 10.7% (median; the H200's by 4.4%).
// The step's clock the planner finds is then the speed its compute-bound kernels keep.
void FitPower(const CalibrationSamples& samples, const KernelTimeModel& model, KernelProfile& k) {
  const double max_mhz = HeaderNumber(samples, "max_sm_clock_mhz");
  const double limit = HeaderNumber(samples, "power_limit_w");
  double idle = 0;  // the idle row has no time, only watts
  for (const CalibrationSample& s : samples.rows)
    if (s.op == "power_idle") idle = s.watts;
  if (max_mhz <= 0 || limit <= 0 || idle <= 0) return;
  // Watts above idle at the maximum clock, per second of the kind's work at its full rate
  // (`tflops`, the head dim's for attention): what an op draws goes with its FLOPs
  // (kernel_time_model.cpp). The sustained compute-bound rows' seconds were scaled to the maximum
  // clock by NVML's reading (AtMaxClock); undone here to give the time they took.
  auto kind = [&](std::string_view op, std::function<double(const CalibrationSample&)> tflops,
                  std::function<bool(const CalibrationSample&)> keep = nullptr) {
    std::vector<double> watts;
    for (const CalibrationSample* s : Op(samples, op)) {
      if (s->watts <= 0 || s->sm_clock_mhz <= 0 || s->seconds <= 0) continue;
      if (keep && !keep(*s)) continue;
      CalibrationSample timed = *s;
      timed.op = std::string(op.substr(6));
      const double nvml_x = std::min(1.0, s->sm_clock_mhz / max_mhz);
      // A memory-bound kernel's time tells nothing of the clock: NVML's reading stands.
      const bool clock_bound = IsClockBound(timed.op);
      const double at_max = clock_bound ? PredictedSeconds(model, timed) : s->seconds;
      const double took = clock_bound ? s->seconds / nvml_x : s->seconds;
      const double x = clock_bound ? std::clamp(at_max / took, kMinClockFraction, 1.0) : nvml_x;
      const double drawn = std::max(0.0, s->watts - idle) / std::pow(x, kPowerExponent);
      const double full_seconds = tflops ? s->flops / (tflops(*s) * 1e12) : at_max;
      watts.push_back(drawn * std::min(1.0, at_max / full_seconds));
    }
    return watts.empty() ? 0.0 : Median(watts);
  };
  auto d64 = [](const CalibrationSample& s) { return s.head_dim > 0 && s.head_dim <= 64; };
  k.max_sm_clock_mhz = max_mhz;
  k.power_limit_w = limit;
  k.idle_w = idle;
  k.gemm_w = kind("power_gemm_fwd", [&](const CalibrationSample&) { return k.gemm_tflops; });
  // Attention by head dim where the group timed both: at its full rate head dim 64's kernels
  // draw 0.6-0.7 of 128's (the H200's and H100's rows; sim/MODEL-LOG.md). A group of one head
  // dim gives one value for both.
  for (const bool backward : {false, true}) {
    const std::string op = backward ? "power_attention_bwd" : "power_attention_fwd";
    auto tflops = [&](const CalibrationSample& s) { return k.attention_tflops(backward, d64(s)); };
    const double d128_w = kind(op, tflops, [&](const CalibrationSample& s) { return !d64(s); });
    const double d64_w = kind(op, tflops, d64);
    const bool apart = d128_w > 0 && d64_w > 0;
    (backward ? k.attention_bwd_w : k.attention_fwd_w) = apart ? d128_w : kind(op, tflops);
    (backward ? k.attention_bwd_w_d64 : k.attention_fwd_w_d64) = apart ? d64_w : 0.0;
  }
  k.memory_w = kind("power_swiglu_fwd", nullptr);
}

}  // namespace

HostLinkSums FitHostLinkSums(const CalibrationSamples& samples) {
  HostLinkSums sums;
  for (const CalibrationSample& s : samples.rows)
    if ((s.op == "links_h2d" || s.op == "links_d2h") && s.n == 0 && s.seconds > 0)
      sums.gpus = std::max(sums.gpus, static_cast<int>(s.m));
  if (sums.gpus < 2) return {};
  for (const CalibrationSample& s : samples.rows) {
    if (s.m != sums.gpus || s.n != 0 || s.seconds <= 0) continue;
    // A row's GPUs each moved `copies` copies of `bytes` in `seconds`.
    const double gbs = static_cast<double>(s.m * s.copies) * s.bytes / s.seconds / 1e9;
    if (s.op == "links_h2d") sums.h2d_gbs = gbs;
    if (s.op == "links_d2h") sums.d2h_gbs = gbs;
  }
  return sums;
}

SelectionReadBackFit FitSelectionReadBack(const CalibrationSamples& samples) {
  struct Row {
    double entries, pages, seconds;
  };
  std::vector<Row> rows;
  for (const CalibrationSample& s : samples.rows)
    if (s.op == "selection_read_back" && s.seconds > 0)
      rows.push_back(
          {static_cast<double>(s.m * s.pages_per_tile), static_cast<double>(s.pages), s.seconds});
  SelectionReadBackFit best;
  if (rows.empty()) return best;
  // Least squares over the fixed term and the terms asked for (normal equations, at most 3x3,
  // by Gaussian elimination); nullopt where a coefficient comes out negative or the system is
  // singular (a term the rows do not vary).
  auto solve = [&rows](bool entries, bool pages) -> std::optional<std::array<double, 3>> {
    std::vector<int> terms = {0};
    if (entries) terms.push_back(1);
    if (pages) terms.push_back(2);
    const size_t n = terms.size();
    auto x = [](const Row& r, int term) {
      return term == 0 ? 1.0 : term == 1 ? r.entries : r.pages;
    };
    std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0.0));
    for (const Row& r : rows)
      for (size_t i = 0; i < n; ++i) {
        for (size_t j = 0; j < n; ++j) a[i][j] += x(r, terms[i]) * x(r, terms[j]);
        a[i][n] += x(r, terms[i]) * r.seconds;
      }
    for (size_t col = 0; col < n; ++col) {
      size_t pivot = col;
      for (size_t i = col + 1; i < n; ++i)
        if (std::abs(a[i][col]) > std::abs(a[pivot][col])) pivot = i;
      if (std::abs(a[pivot][col]) < 1e-30) return std::nullopt;
      std::swap(a[col], a[pivot]);
      for (size_t i = 0; i < n; ++i) {
        if (i == col) continue;
        const double f = a[i][col] / a[col][col];
        for (size_t j = col; j <= n; ++j) a[i][j] -= f * a[col][j];
      }
    }
    std::array<double, 3> c{};
    for (size_t i = 0; i < n; ++i) {
      c[static_cast<size_t>(terms[i])] = a[i][n] / a[i][i];
      if (c[static_cast<size_t>(terms[i])] < 0) return std::nullopt;
    }
    return c;
  };
  double best_sse = INFINITY;
  for (const auto& [entries, pages] : {std::pair{true, true}, std::pair{true, false},
                                       std::pair{false, true}, std::pair{false, false}}) {
    const std::optional<std::array<double, 3>> c = solve(entries, pages);
    if (!c) continue;
    double sse = 0, worst = 0;
    for (const Row& r : rows) {
      const double predicted = (*c)[0] + (*c)[1] * r.entries + (*c)[2] * r.pages;
      sse += (predicted - r.seconds) * (predicted - r.seconds);
      worst = std::max(worst, std::abs(predicted / r.seconds - 1.0));
    }
    if (sse >= best_sse) continue;
    best_sse = sse;
    best = {static_cast<int>(rows.size()), (*c)[0] * 1e6, (*c)[1] * 1e9, (*c)[2] * 1e9, worst};
  }
  return best;
}

CalibrationFit FitCalibration(const CalibrationSamples& timed, const GpuSpec& base,
                              const std::string& samples_name) {
  const CalibrationSamples samples = AtMaxClock(timed);
  CalibrationFit fit;
  GpuSpec& gpu = fit.gpu;
  gpu = base;
  KernelProfile& k = gpu.kernels;
  k = KernelProfile{};
  k.provenance = Provenance::kMeasured;
  auto header = [&](const char* key) {
    auto it = samples.header.find(key);
    return it == samples.header.end() || it->second.empty() ? std::string("unknown") : it->second;
  };
  k.gpu_name = header("gpu_name");
  k.driver = header("driver");
  k.date = header("date");
  k.commit = header("commit");
  k.samples = samples_name;
  k.sparse_bwd_gathered = header("sparse_bwd") == "gathered";
  k.own_bwd_split = header("own_bwd") == "split";
  // 1 until fitted with the attention rates; 0: the forward ran 128-row blocks only.
  k.attention_fwd_rows128_efficiency_d64 = header("fwd_rows_d64") == "by waves" ? 1.0 : 0.0;
  k.attention_fwd_slices_d64 = header("fwd_sparse_d64") == "by waves";
  const std::string where = " on " + k.gpu_name + ", driver " + k.driver + ", " + k.date +
                            ", ctxplan-measure at " + k.commit;
  auto measured = [&](SpecValue& v, double value, const std::string& what) {
    v.value = value;
    v.provenance = Provenance::kMeasured;
    v.note = what + where;
  };

  // --- launches, device copy, the host link ----------------------------------------------------
  const auto launch = Op(samples, "launch");
  Require(launch, "launch");
  k.launch_us = Median({launch[0]->seconds}) * 1e6;
  const auto d2d = Op(samples, "copy_d2d");
  Require(d2d, "copy_d2d");
  {
    std::vector<double> rates;
    for (const CalibrationSample* s : d2d) rates.push_back(2.0 * s->bytes / s->seconds / 1e9);
    measured(gpu.d2d_copy_gbs, *std::max_element(rates.begin(), rates.end()),
             "cudaMemcpyAsync device to device, read + write");
    // An HBM figure a profile calls achieved must not exceed the datasheet's.
    gpu.d2d_copy_gbs.value = std::min(gpu.d2d_copy_gbs.value, gpu.memory_bandwidth_gbs.value);
  }
  auto link_rate = [&](std::string_view op) {
    std::vector<double> rates;
    for (const CalibrationSample* s : Op(samples, op))
      if (s->copies <= 1 && s->bytes >= kBandwidthCopyBytes)
        rates.push_back(s->bytes / s->seconds / 1e9);
    if (rates.empty())
      throw InputError("calibration samples have no " + std::string(op) +
                       " rows of 64 MiB or more");
    return Median(rates);
  };
  measured(gpu.host_h2d_gbs, link_rate("copy_h2d"), "pinned host to device, 64-256 MiB copies");
  measured(gpu.host_d2h_gbs, link_rate("copy_d2h"), "pinned device to host, 64-256 MiB copies");
  {
    const auto duplex = Op(samples, "copy_duplex");
    Require(duplex, "copy_duplex");
    std::vector<double> rates;
    for (const CalibrationSample* s : duplex) rates.push_back(2.0 * s->bytes / s->seconds / 1e9);
    measured(gpu.host_duplex_gbs,
             std::min(Median(rates), gpu.host_h2d_gbs.value + gpu.host_d2h_gbs.value),
             "both directions at once, sum");
  }
  {
    // The per-call cost of a copy: many small copies, less their bytes at the link's rate. The
    // runtime hands a layer's page copies to the driver as one batch: the batched rows where
    // the samples have them, else the copies issued one call each.
    const bool batched = !Op(samples, "copy_batch_h2d").empty();
    std::vector<double> calls;
    for (const CalibrationSample* s : Select(samples, [&](const CalibrationSample& s) {
           return batched ? s.op == "copy_batch_h2d" || s.op == "copy_batch_d2h"
                          : (s.op == "copy_h2d" || s.op == "copy_d2h") && s.copies > 1;
         })) {
      const bool h2d = s->op == "copy_h2d" || s->op == "copy_batch_h2d";
      const double rate = (h2d ? gpu.host_h2d_gbs : gpu.host_d2h_gbs).value * 1e9;
      const double per_call = (s->seconds - s->bytes * s->copies / rate) / s->copies;
      calls.push_back(std::max(per_call, 0.0) * 1e6);
    }
    k.copy_call_us = calls.empty() ? 0.0 : Median(calls);
  }

  // --- host side ---------------------------------------------------------------------------------
  auto host_rate = [&](std::string_view op, double scale) {
    std::vector<double> rates;
    for (const CalibrationSample* s : Op(samples, op))
      rates.push_back((op == "host_adamw" || op.rfind("weights_", 0) == 0
                           ? static_cast<double>(s->m)
                           : s->bytes) /
                      s->seconds * scale);
    return rates.empty() ? 0.0 : Median(rates);
  };
  k.weights_init_gparams = host_rate("weights_init", 1e-9);
  k.weights_upload_gparams = host_rate("weights_upload", 1e-9);
  k.pin_gbs = host_rate("pin", 1e-9);
  k.host_memcpy_gbs = host_rate("host_memcpy", 1e-9);
  k.host_adamw_gparams = host_rate("host_adamw", 1e-9);
  k.device_alloc_gbs = host_rate("device_alloc", 1e-9);
  if (k.pin_gbs <= 0 || k.host_memcpy_gbs <= 0 || k.device_alloc_gbs <= 0 ||
      k.weights_init_gparams <= 0)
    throw InputError(
        "calibration samples lack the host group (pin, host_memcpy, device_alloc, weights_init)");
  if (k.host_adamw_gparams <= 0) k.host_adamw_gparams = k.host_memcpy_gbs / 28.0;  // bytes/param

  // Starting rates from the datasheet, so the model is defined while each group is fitted in
  // turn (each group's timing depends only on its own parameters).
  k.gemm_tflops = k.gemm_accumulate_tflops = gpu.bf16_gemm_tflops.value;
  k.attention_fwd_tflops_d128 = k.attention_fwd_tflops_d64 = gpu.attention_fwd_tflops.value;
  k.attention_bwd_tflops_d128 = k.attention_bwd_tflops_d64 = gpu.attention_bwd_tflops.value;

  // --- memory-bound kernels ----------------------------------------------------------------
  const auto memory_rows =
      Select(samples, [](const CalibrationSample& s) { return IsMemoryOp(s.op) && s.bytes > 0; });
  Require(memory_rows, "memory-bound kernel");
  {
    // An empty kernel launched back to back measures the launch rate of the host thread; a
    // kernel's fixed cost inside a stream is less. It and the bandwidth fraction are fitted
    // together on the memory-bound kernels (fixed cost + bytes at the fraction).
    const double launch_rate_us = k.launch_us;
    k.memory_kernel_fixed_us.clear();
    k.memory_kernel_efficiency.clear();
    Candidate best;
    for (const double fixed : Grid(launch_rate_us, kLaunchUsStep)) {
      KernelProfile trial = k;
      trial.launch_us = fixed;
      trial.memory_efficiency = ImpliedMedian(
          gpu, trial, [](KernelProfile& p, double x) { p.memory_efficiency = x; }, memory_rows,
          0.02, 2.0);
      best.Consider(trial, Score(gpu, trial, memory_rows));
    }
    k = best.profile;
  }
  // Each kernel with samples at several sizes apart: its own fixed cost and fraction, kept
  // where they explain its samples better than the common pair.
  for (const std::string_view name : kMemoryKernelNames) {
    const auto rows = Op(samples, name);
    if (rows.size() < 2 || std::all_of(rows.begin(), rows.end(), [&](const auto* s) {
          return s->bytes == rows.front()->bytes;
        }))
      continue;
    const KernelProfile own = FitKernelFixedAndFraction(
        gpu, k, rows, std::string(name), &KernelProfile::memory_kernel_fixed_us,
        &KernelProfile::memory_kernel_efficiency, 2.0);
    if (Score(gpu, own, rows) < Score(gpu, k, rows)) k = own;
  }

  // The kernels timed right after the kernel that wrote their input, their traffic within the L2
  // (ctxplan-measure's "<kernel>_warm" rows): their own fixed cost and fraction there.
  k.l2_cache_mib = HeaderNumber(samples, "l2_bytes") / (1024.0 * 1024.0);
  for (const std::string_view name : kMemoryKernelNames) {
    const std::string key(name);
    const auto rows = Op(samples, key + "_warm");
    if (rows.empty() || k.l2_cache_mib <= 0) continue;
    if (!k.memory_kernel_fixed_us.contains(key)) {  // cold at the common pair, said so
      k.memory_kernel_fixed_us[key] = k.launch_us;
      k.memory_kernel_efficiency[key] = k.memory_efficiency;
    }
    // Its own fixed cost too: loads that hit the L2 shorten the latency a small launch waits on.
    k = FitKernelFixedAndFraction(gpu, k, rows, key, &KernelProfile::memory_kernel_warm_fixed_us,
                                  &KernelProfile::memory_kernel_warm_efficiency, 20.0);
  }

  // --- GEMMs: the tile, split and wave cost that explain them best, and the rate --------------
  const auto gemm_rows = Select(samples, [](const CalibrationSample& s) {
    return s.op == "gemm_fwd" || s.op == "gemm_bwd_input";
  });
  Require(gemm_rows, "gemm_fwd / gemm_bwd_input");
  {
    Candidate best;
    for (const auto& [rows, cols] : kGemmTiles)
      for (int64_t split = 1; split <= kGemmSplitMax; ++split)
        for (const double wave : Grid(kGemmWaveUsMax, kGemmWaveUsStep)) {
          KernelProfile trial = k;
          trial.gemm_tile_rows = rows;
          trial.gemm_tile_cols = cols;
          trial.gemm_split_max = split;
          trial.gemm_wave_us = wave;
          trial.gemm_tflops = ImpliedMedian(
              gpu, trial, [](KernelProfile& p, double x) { p.gemm_tflops = x; }, gemm_rows, 1, 1e5);
          best.Consider(trial, Score(gpu, trial, gemm_rows));
        }
    k = best.profile;
  }
  {
    const auto weight_rows = Op(samples, "gemm_bwd_weight");
    Require(weight_rows, "gemm_bwd_weight");
    Candidate best;
    for (const auto& [rows, cols] : kGemmTiles)
      for (const double wave : Grid(kAccumulateWaveUsMax, kAccumulateWaveUsStep)) {
        KernelProfile trial = k;
        trial.gemm_accumulate_tile_rows = rows;
        trial.gemm_accumulate_tile_cols = cols;
        trial.gemm_accumulate_wave_us_per_byte = wave;
        trial.gemm_accumulate_tflops = ImpliedMedian(
            gpu, trial, [](KernelProfile& p, double x) { p.gemm_accumulate_tflops = x; },
            weight_rows, 1, 1e5);
        best.Consider(trial, Score(gpu, trial, weight_rows));
      }
    k = best.profile;
    const auto loss_rows = Op(samples, "loss");
    Require(loss_rows, "loss");
    FitLoss(gpu, loss_rows, k);
  }
  // --- LoRA adapters: their traffic's fraction of the memory-bound rate (optional group) -----
  if (const auto lora_rows = Select(
          samples,
          [](const CalibrationSample& s) { return s.op.rfind("lora_", 0) == 0 && s.head_dim > 0; });
      !lora_rows.empty()) {
    k.lora_efficiency = ImpliedMedian(
        gpu, k, [](KernelProfile& p, double x) { p.lora_efficiency = x; }, lora_rows, 0.02, 2.0);
  }
  measured(gpu.bf16_gemm_tflops, k.gemm_tflops,
           "cuBLASLt bf16 GEMMs of the calibration grid, rate of a full wave of tiles");

  // --- attention ---------------------------------------------------------------------------
  // Per direction: the item cost that, with a rate per head dim, explains the launches over the
  // chunk's own positions best; then each page size's fraction (dense launches over pages,
  // their own part included as the kernel runs it); then the sparse fraction.
  k.page_fwd_efficiency.clear();
  k.page_bwd_efficiency.clear();
  k.page_fwd_efficiency_d64.clear();
  k.page_bwd_efficiency_d64.clear();
  k.sparse_fwd_efficiency = k.sparse_bwd_efficiency = 1.0;
  k.sparse_fwd_page_efficiency.clear();
  k.sparse_bwd_page_efficiency.clear();
  k.sparse_fwd_page_efficiency_d64.clear();
  k.sparse_bwd_page_efficiency_d64.clear();
  for (const bool backward : {false, true}) {
    const std::string op = backward ? "attention_bwd" : "attention_fwd";
    auto own_rows = [&](int64_t head_dim) {
      auto rows = Select(samples, [&](const CalibrationSample& s) {
        return s.op == op && s.pages == 0 && s.head_dim == head_dim;
      });
      Require(rows, op + " (own positions, d_h " + std::to_string(head_dim) + ")");
      return rows;
    };
    const auto own128 = own_rows(128), own64 = own_rows(64);
    auto rate = [backward](KernelProfile& p, bool d64) -> double& {
      return backward ? (d64 ? p.attention_bwd_tflops_d64 : p.attention_bwd_tflops_d128)
                      : (d64 ? p.attention_fwd_tflops_d64 : p.attention_fwd_tflops_d128);
    };
    auto fit_own = [&] {
      Candidate best;
      for (const double item : Grid(kAttentionItemUsMax, kAttentionItemUsStep)) {
        KernelProfile trial = k;
        (backward ? trial.attention_bwd_own_item_us : trial.attention_fwd_item_us) = item;
        for (const bool d64 : {false, true})
          rate(trial, d64) = ImpliedMedian(
              gpu, trial, [&](KernelProfile& p, double x) { rate(p, d64) = x; },
              d64 ? own64 : own128, 1, 1e5);
        best.Consider(trial, Score(gpu, trial, own128) + Score(gpu, trial, own64));
      }
      k = best.profile;
    };
    fit_own();
    if (!backward && k.attention_fwd_rows128_efficiency_d64 > 0) {
      // The d_h 64 rate is the 192-row blocks' (the rule gives most own launches 192 rows): the
      // launches it leaves at 128 rows imply their fraction, then the rate and item cost refit.
      std::vector<const CalibrationSample*> rows128;
      for (const CalibrationSample* s : own64)
        if (AttentionForwardQueryRows(s->m, s->heads, 64, false, gpu.sm_count) == 128)
          rows128.push_back(s);
      if (!rows128.empty()) {
        k.attention_fwd_rows128_efficiency_d64 = ImpliedMedian(
            gpu, k, [](KernelProfile& p, double x) { p.attention_fwd_rows128_efficiency_d64 = x; },
            rows128, 0.3, 2.0);
        fit_own();
      }
    }

    // One page table: each page size's fraction, the implied median of its rows with the other
    // sizes held (each starting at `start`). False when no row is of this head dim.
    auto fit_page_table = [&](bool d64, bool sparse,
                              const std::vector<const CalibrationSample*>& rows, double start) {
      std::map<int64_t, std::vector<const CalibrationSample*>> by_page;
      for (const CalibrationSample* s : rows)
        if ((s->head_dim <= 64) == d64) by_page[s->page_tokens].push_back(s);
      for (const auto& [p, page_rows] : by_page) k.page_table(backward, d64, sparse)[p] = start;
      for (const auto& [p, page_rows] : by_page) {
        const int64_t page = p;
        k.page_table(backward, d64, sparse)[p] = ImpliedMedian(
            gpu, k,
            [=](KernelProfile& q, double x) { q.page_table(backward, d64, sparse)[page] = x; },
            page_rows, 0.02, 2.0);
      }
      return !by_page.empty();
    };
    // Head dim 64 runs its own kernel path over pages: its own table where it has samples.
    const auto dense = Select(samples, [&](const CalibrationSample& s) {
      return s.op == op && s.pages > 0 && s.pages_per_tile == 0;
    });
    auto fit_dense = [&] {
      for (const bool d64 : {false, true})
        if (!fit_page_table(d64, false, dense, 1.0) && !d64)
          throw InputError("calibration samples have no dense paged " + op + " rows");
    };
    // A fixed cost: the grid value whose fit (the rest implied by `fit`) explains `rows` best.
    auto fit_fixed_cost = [&](double KernelProfile::*cost, double max, const auto& fit,
                              const std::vector<const CalibrationSample*>& rows) {
      const KernelProfile before = k;
      Candidate best;
      for (const double us : Grid(max, kAttentionItemUsStep)) {
        k = before;
        k.*cost = us;
        fit();
        best.Consider(k, Score(gpu, k, rows));
      }
      k = best.profile;
    };
    if (backward) {
      // The backward's items over pages: their own fixed cost, with the page tables that explain
      // the dense paged rows (its own launches fitted theirs above).
      fit_fixed_cost(&KernelProfile::attention_bwd_item_us, kAttentionItemUsMax, fit_dense, dense);
    } else {
      fit_dense();
    }
    // Page-sparse rows; those at GQA groups 1-2 whose backward takes key blocks over the union
    // (AttentionBackwardOverUnion) fit the union's block cost alone, below.
    auto page_sparse = [&](const CalibrationSample& s) {
      return s.op == op && s.pages > 0 && s.pages_per_tile > 0 && s.pages_per_tile < s.pages;
    };
    auto by_union = [](const CalibrationSample& s) {
      return AttentionBackwardOverUnion(s.m, s.heads, s.kv_heads, s.head_dim, s.page_tokens,
                                        /*dkv_f32=*/s.grad_bytes == 4);
    };
    const auto sparse =
        Select(samples, [&](const CalibrationSample& s) { return page_sparse(s) && !by_union(s); });
    Require(sparse, op + " sparse");
    // The sparse fraction overall, then per page size where a size has its own sparse rows; per
    // head dim, head dim 64 having its own backward blocks (its table only where it has rows).
    auto fit_sparse = [&] {
      (backward ? k.sparse_bwd_efficiency : k.sparse_fwd_efficiency) = ImpliedMedian(
          gpu, k,
          [backward](KernelProfile& q, double x) {
            (backward ? q.sparse_bwd_efficiency : q.sparse_fwd_efficiency) = x;
          },
          sparse, 0.02, 2.0);
      const double overall = backward ? k.sparse_bwd_efficiency : k.sparse_fwd_efficiency;
      for (const bool d64 : {false, true}) fit_page_table(d64, true, sparse, overall);
    };
    // GQA groups among the backward's sparse rows at a head dim: two tell a gathered block's
    // fixed cost apart from the per-pair rate (samples before c15c0e7's grid hold one at head dim
    // 128, before 2026-11-28's one at head dim 64).
    auto groups_at = [&](int64_t head_dim) {
      std::set<int64_t> groups;
      if (backward && k.sparse_bwd_gathered)
        for (const CalibrationSample* s : sparse)
          if (s->head_dim == head_dim && s->kv_heads > 0) groups.insert(s->heads / s->kv_heads);
      return groups.size();
    };
    if (groups_at(128) >= 2) {
      // Gathered blocks: their own fixed cost, with the fractions that explain the sparse rows.
      fit_fixed_cost(&KernelProfile::attention_bwd_gathered_item_us, kGatheredItemUsMax, fit_sparse,
                     sparse);
    } else {
      fit_sparse();
    }
    if (groups_at(64) >= 2) {
      // Then head dim 64's own, the fractions refitted with each candidate (their overall median
      // is both head dims': judged on every sparse row).
      fit_fixed_cost(&KernelProfile::attention_bwd_gathered_item_us_d64, kGatheredItemUsMax,
                     fit_sparse, sparse);
    }
    // The union's rows by its blocks (UnionKeyBlocksOf): whole 128-key pages fit the block cost
    // and per-pair rate; 64-key blocks (pages of 48 and 64) their own rate after; part-full
    // blocks (96) and halves (192) are timed from these, not fitted.
    auto union_keys = [](const CalibrationSample& s) {
      return s.page_tokens % 128 == 0                                 ? int64_t{128}
             : UnionKeyBlocksOf(s.page_tokens, s.head_dim).keys == 64 ? int64_t{64}
                                                                      : int64_t{0};
    };
    // A union block size's rows: their block cost, and with each candidate the per-pair rate
    // that explains them (against the dense backward's; the 64-key blocks' against the 128-key
    // ones'), with rate_d64 head dim 64's apart where the rows hold both (each from its own).
    auto fit_union_blocks = [&](int64_t keys, double KernelProfile::*cost,
                                double KernelProfile::*rate, double KernelProfile::*rate_d64) {
      const auto rows = Select(samples, [&](const CalibrationSample& s) {
        return page_sparse(s) && by_union(s) && union_keys(s) == keys;
      });
      if (rows.empty()) return false;
      std::vector<const CalibrationSample*> at[2];  // [d64]
      for (const CalibrationSample* s : rows) at[s->head_dim <= 64].push_back(s);
      const bool apart = rate_d64 != nullptr && !at[0].empty() && !at[1].empty();
      auto implied = [&](double KernelProfile::*member,
                         const std::vector<const CalibrationSample*>& of) {
        k.*member = ImpliedMedian(
            gpu, k, [member](KernelProfile& q, double x) { q.*member = x; }, of, 0.3, 2.0);
      };
      fit_fixed_cost(
          cost, kUnionBlockUsMax,
          [&] {
            implied(rate, apart ? at[0] : rows);
            if (apart) implied(rate_d64, at[1]);
          },
          rows);
      return true;
    };
    if (backward && fit_union_blocks(128, &KernelProfile::attention_bwd_union_block_us,
                                     &KernelProfile::sparse_bwd_union_efficiency, nullptr)) {
      fit_union_blocks(64, &KernelProfile::attention_bwd_union64_block_us,
                       &KernelProfile::sparse_bwd_union64_efficiency,
                       &KernelProfile::sparse_bwd_union64_efficiency_d64);
    }
  }
  measured(gpu.attention_fwd_tflops, k.attention_fwd_tflops_d128,
           "ctxtrain's attention forward, d_h 128, a full wave of items");
  measured(gpu.attention_bwd_tflops, k.attention_bwd_tflops_d128,
           "ctxtrain's attention backward, d_h 128, a full wave of items");

  // --- page selection ------------------------------------------------------------------------
  {
    const auto score =
        Select(samples, [](const CalibrationSample& s) { return s.op == "page_score"; });
    Require(score, "page_score");
    // The per-tile cost by grid where the samples span chunk sizes, else the memory rate alone.
    // Their summed queries are all 512 wide (Qwen2.5-7B's 4 x 128, Llama-3.2-1B's 8 x 64):
    // where the two run alike (ctxplan-measure's select group) the width, not the queries'
    // bytes (7 : 4), is what the tile's cost goes with.
    const bool chunk_sizes = std::any_of(score.begin(), score.end(),
                                         [&](const auto* s) { return s->m != score.front()->m; });
    Candidate best;
    for (const double per_tile :
         chunk_sizes ? Grid(kPageScoreNsPerTileElementMax, kPageScoreNsPerTileElementStep)
                     : Grid(0, 1)) {
      KernelProfile trial = k;
      trial.page_score_ns_per_tile_element = per_tile;
      trial = FitFixedAndPerUnit(gpu, trial, score, &KernelProfile::page_score_fixed_us,
                                 &KernelProfile::page_score_ns_per_tile_page, kPageScoreFixedUsMax,
                                 kPageScoreFixedUsStep);
      best.Consider(trial, Score(gpu, trial, score));
    }
    k = best.profile;
    const auto topk = Op(samples, "page_topk");
    Require(topk, "page_topk");
    k = FitFixedAndPerUnit(gpu, k, topk, &KernelProfile::page_topk_fixed_us,
                           &KernelProfile::page_topk_ns_per_page, kPageTopKFixedUsMax,
                           kPageTopKFixedUsStep);
  }

  // --- how well the profile explains what it was fitted on
  // ---------------------------------------------
  const KernelTimeModel model(MachineFor(gpu), k);
  auto group = [&](std::string name, std::function<bool(const CalibrationSample&)> keep) {
    const auto rows = Select(samples, keep);
    if (!rows.empty()) fit.residuals.push_back(Residual(model, std::move(name), rows));
  };
  group("gemm", [](const CalibrationSample& s) { return s.op.rfind("gemm_", 0) == 0; });
  group("loss", [](const CalibrationSample& s) { return s.op == "loss"; });
  group("lora", [](const CalibrationSample& s) { return s.op.rfind("lora_", 0) == 0; });
  group("attention_fwd", [](const CalibrationSample& s) { return s.op == "attention_fwd"; });
  group("attention_bwd", [](const CalibrationSample& s) { return s.op == "attention_bwd"; });
  group("memory", [](const CalibrationSample& s) { return IsMemoryOp(s.op); });
  group("memory_warm", [](const CalibrationSample& s) { return !WarmMemoryOp(s.op).empty(); });
  group("page_score", [](const CalibrationSample& s) { return s.op == "page_score"; });
  group("page_topk", [](const CalibrationSample& s) { return s.op == "page_topk"; });
  group("copy", [](const CalibrationSample& s) {
    return s.op.rfind("copy_", 0) == 0 && s.op != "copy_duplex" && s.op != "copy_d2d";
  });
  // The sustained kernels of the power group, timed at the clock the power limit left them,
  // scaled to the maximum clock: how well 1 / clock explains a kernel under the limit.
  {
    CalibrationSamples sustained;
    for (const CalibrationSample& s : samples.rows) {
      if (s.op.rfind("power_", 0) != 0 || s.op == "power_idle" || s.op == "power_duty_gemm_fwd")
        continue;
      sustained.rows.push_back(s);
      sustained.rows.back().op = s.op.substr(6);
    }
    const auto rows = Select(sustained, [](const CalibrationSample& s) { return s.seconds > 0; });
    if (!rows.empty()) {
      fit.residuals.push_back(Residual(model, "sustained", rows));
      k.nvml_clock_speed_error = fit.residuals.back().median_error;
    }
  }
  FitPower(samples, model, k);
  if (k.max_sm_clock_mhz > 0)  // FitPower found the power group
    fit.duty_cycle_power_exponent = DutyCyclePowerExponent(samples, k.idle_w, k.max_sm_clock_mhz);
  return fit;
}

std::string GpuProfileYaml(const GpuSpec& g) {
  std::ostringstream o;
  o.precision(6);
  auto spec = [&](const char* key, const SpecValue& v) {
    std::string note = v.note;
    std::replace(note.begin(), note.end(), '"', '\'');
    o << key << ": {value: " << v.value << ", source: " << ProvenanceName(v.provenance)
      << ", note: \"" << note << "\"}\n";
  };
  const KernelProfile& k = g.kernels;
  o << "# " << g.display_name << ". Written by `ctxplan calibrate` from ctxplan-measure's samples";
  if (!k.samples.empty()) o << " (" << k.samples << ")";
  o << ";\n# values marked measured come from them, the others from the catalogue entry.\n";
  o << "name: " << g.name << "\n";
  o << "display_name: " << g.display_name << "\n";
  o << "sm_count: " << g.sm_count << "\n";
  if (g.boost_clock_mhz > 0) o << "boost_clock_mhz: " << g.boost_clock_mhz << "\n";
  if (g.tdp_w > 0) o << "tdp_w: " << g.tdp_w << "\n";
  o << "host_link: " << g.host_link << "\n";
  spec("memory_gib", g.memory_gib);
  spec("memory_bandwidth_gbs", g.memory_bandwidth_gbs);
  spec("d2d_copy_gbs", g.d2d_copy_gbs);
  spec("bf16_dense_tflops", g.bf16_dense_tflops);
  spec("bf16_gemm_tflops", g.bf16_gemm_tflops);
  spec("attention_fwd_tflops", g.attention_fwd_tflops);
  spec("attention_bwd_tflops", g.attention_bwd_tflops);
  spec("host_h2d_gbs", g.host_h2d_gbs);
  spec("host_d2h_gbs", g.host_d2h_gbs);
  spec("host_duplex_gbs", g.host_duplex_gbs);
  spec("cuda_context_gib", g.cuda_context_gib);
  if (k.empty()) return o.str();
  auto table = [&](const std::map<int64_t, double>& t) {
    std::string s = "{";
    for (const auto& [p, f] : t) {
      if (s.size() > 1) s += ", ";
      std::ostringstream v;
      v.precision(4);
      v << p << ": " << f;
      s += v.str();
    }
    return s + "}";
  };
  o << "kernel_model:\n";
  o << "  source: " << ProvenanceName(k.provenance) << "\n";
  if (k.provenance != Provenance::kMeasured) {
    o << "  derived_from: " << k.derived_from << "\n";
    return o.str();
  }
  o << "  gpu_name: \"" << k.gpu_name << "\"\n";
  o << "  driver: \"" << k.driver << "\"\n";
  o << "  date: \"" << k.date << "\"\n";
  o << "  commit: \"" << k.commit << "\"\n";
  if (!k.samples.empty()) o << "  samples: \"" << k.samples << "\"\n";
  o << "  launch_us: " << k.launch_us << "\n";
  o << "  gemm_tflops: " << k.gemm_tflops << "\n";
  o << "  gemm_tile_rows: " << k.gemm_tile_rows << "\n";
  o << "  gemm_tile_cols: " << k.gemm_tile_cols << "\n";
  o << "  gemm_split_max: " << k.gemm_split_max << "\n";
  o << "  gemm_wave_us: " << k.gemm_wave_us << "\n";
  o << "  gemm_accumulate_tflops: " << k.gemm_accumulate_tflops << "\n";
  o << "  gemm_accumulate_tile_rows: " << k.gemm_accumulate_tile_rows << "\n";
  o << "  gemm_accumulate_tile_cols: " << k.gemm_accumulate_tile_cols << "\n";
  o << "  gemm_accumulate_wave_us_per_byte: " << k.gemm_accumulate_wave_us_per_byte << "\n";
  o << "  loss_efficiency: " << k.loss_efficiency << "\n";
  if (k.loss_ns_per_logit > 0) o << "  loss_ns_per_logit: " << k.loss_ns_per_logit << "\n";
  o << "  attention_fwd_tflops_d128: " << k.attention_fwd_tflops_d128 << "\n";
  o << "  attention_fwd_tflops_d64: " << k.attention_fwd_tflops_d64 << "\n";
  o << "  attention_bwd_tflops_d128: " << k.attention_bwd_tflops_d128 << "\n";
  o << "  attention_bwd_tflops_d64: " << k.attention_bwd_tflops_d64 << "\n";
  o << "  attention_fwd_item_us: " << k.attention_fwd_item_us << "\n";
  if (k.attention_fwd_rows128_efficiency_d64 > 0)
    o << "  attention_fwd_rows128_efficiency_d64: " << k.attention_fwd_rows128_efficiency_d64
      << "\n";
  if (k.attention_fwd_slices_d64) o << "  attention_fwd_slices_d64: true\n";
  o << "  attention_bwd_item_us: " << k.attention_bwd_item_us << "\n";
  o << "  page_fwd_efficiency: " << table(k.page_fwd_efficiency) << "\n";
  o << "  page_bwd_efficiency: " << table(k.page_bwd_efficiency) << "\n";
  if (!k.page_fwd_efficiency_d64.empty())
    o << "  page_fwd_efficiency_d64: " << table(k.page_fwd_efficiency_d64) << "\n";
  if (!k.page_bwd_efficiency_d64.empty())
    o << "  page_bwd_efficiency_d64: " << table(k.page_bwd_efficiency_d64) << "\n";
  o << "  sparse_fwd_efficiency: " << k.sparse_fwd_efficiency << "\n";
  o << "  sparse_bwd_efficiency: " << k.sparse_bwd_efficiency << "\n";
  if (k.sparse_bwd_gathered) o << "  sparse_bwd_gathered: true\n";
  if (k.own_bwd_split) o << "  own_bwd_split: true\n";
  if (k.attention_bwd_gathered_item_us > 0)
    o << "  attention_bwd_gathered_item_us: " << k.attention_bwd_gathered_item_us << "\n";
  if (k.attention_bwd_gathered_item_us_d64 > 0)
    o << "  attention_bwd_gathered_item_us_d64: " << k.attention_bwd_gathered_item_us_d64 << "\n";
  if (k.attention_bwd_union_block_us > 0) {
    o << "  attention_bwd_union_block_us: " << k.attention_bwd_union_block_us << "\n";
    o << "  sparse_bwd_union_efficiency: " << k.sparse_bwd_union_efficiency << "\n";
    if (k.attention_bwd_union64_block_us > 0) {
      o << "  attention_bwd_union64_block_us: " << k.attention_bwd_union64_block_us << "\n";
      o << "  sparse_bwd_union64_efficiency: " << k.sparse_bwd_union64_efficiency << "\n";
      if (k.sparse_bwd_union64_efficiency_d64 > 0)
        o << "  sparse_bwd_union64_efficiency_d64: " << k.sparse_bwd_union64_efficiency_d64 << "\n";
    }
  }
  if (k.attention_bwd_own_item_us > 0)
    o << "  attention_bwd_own_item_us: " << k.attention_bwd_own_item_us << "\n";
  if (!k.sparse_fwd_page_efficiency.empty())
    o << "  sparse_fwd_page_efficiency: " << table(k.sparse_fwd_page_efficiency) << "\n";
  if (!k.sparse_bwd_page_efficiency.empty())
    o << "  sparse_bwd_page_efficiency: " << table(k.sparse_bwd_page_efficiency) << "\n";
  if (!k.sparse_fwd_page_efficiency_d64.empty())
    o << "  sparse_fwd_page_efficiency_d64: " << table(k.sparse_fwd_page_efficiency_d64) << "\n";
  if (!k.sparse_bwd_page_efficiency_d64.empty())
    o << "  sparse_bwd_page_efficiency_d64: " << table(k.sparse_bwd_page_efficiency_d64) << "\n";
  o << "  memory_efficiency: " << k.memory_efficiency << "\n";
  if (!k.memory_kernel_fixed_us.empty()) {
    auto names = [](const std::map<std::string, double>& m) {
      std::ostringstream t;
      t << "{";
      for (auto it = m.begin(); it != m.end(); ++it)
        t << (it == m.begin() ? "" : ", ") << it->first << ": " << it->second;
      t << "}";
      return t.str();
    };
    o << "  memory_kernel_fixed_us: " << names(k.memory_kernel_fixed_us) << "\n";
    o << "  memory_kernel_efficiency: " << names(k.memory_kernel_efficiency) << "\n";
    if (!k.memory_kernel_warm_efficiency.empty()) {
      o << "  memory_kernel_warm_fixed_us: " << names(k.memory_kernel_warm_fixed_us) << "\n";
      o << "  memory_kernel_warm_efficiency: " << names(k.memory_kernel_warm_efficiency) << "\n";
    }
  }
  if (k.l2_cache_mib > 0) o << "  l2_cache_mib: " << k.l2_cache_mib << "\n";
  if (k.lora_efficiency != 1.0)  // 1: the samples had no lora group
    o << "  lora_efficiency: " << k.lora_efficiency << "\n";
  o << "  page_score_fixed_us: " << k.page_score_fixed_us << "\n";
  o << "  page_score_ns_per_tile_element: " << k.page_score_ns_per_tile_element << "\n";
  o << "  page_score_ns_per_tile_page: " << k.page_score_ns_per_tile_page << "\n";
  o << "  page_topk_fixed_us: " << k.page_topk_fixed_us << "\n";
  o << "  page_topk_ns_per_page: " << k.page_topk_ns_per_page << "\n";
  o << "  copy_call_us: " << k.copy_call_us << "\n";
  o << "  pin_gbs: " << k.pin_gbs << "\n";
  o << "  host_memcpy_gbs: " << k.host_memcpy_gbs << "\n";
  o << "  host_adamw_gparams: " << k.host_adamw_gparams << "\n";
  o << "  weights_init_gparams: " << k.weights_init_gparams << "\n";
  if (k.weights_upload_gparams > 0)
    o << "  weights_upload_gparams: " << k.weights_upload_gparams << "\n";
  o << "  device_alloc_gbs: " << k.device_alloc_gbs << "\n";
  if (k.has_power()) {
    o << "  max_sm_clock_mhz: " << k.max_sm_clock_mhz << "\n";
    o << "  power_limit_w: " << k.power_limit_w << "\n";
    o << "  idle_w: " << k.idle_w << "\n";
    o << "  gemm_w: " << k.gemm_w << "\n";
    o << "  attention_fwd_w: " << k.attention_fwd_w << "\n";
    o << "  attention_bwd_w: " << k.attention_bwd_w << "\n";
    if (k.attention_fwd_w_d64 > 0) o << "  attention_fwd_w_d64: " << k.attention_fwd_w_d64 << "\n";
    if (k.attention_bwd_w_d64 > 0) o << "  attention_bwd_w_d64: " << k.attention_bwd_w_d64 << "\n";
    o << "  memory_w: " << k.memory_w << "\n";
    if (k.nvml_clock_speed_error >= 0)
      o << "  nvml_clock_speed_error: " << k.nvml_clock_speed_error << "\n";
  }
  return o.str();
}

}  // namespace ctxplan::sim
