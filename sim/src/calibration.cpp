#include "ctxplan/sim/calibration.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "calibration_internal.h"
#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/sim/kernel_time_model.h"

namespace ctxplan::sim {

using detail::Candidate;
using detail::FitContext;
using detail::Grid;
using detail::ImpliedMedian;
using detail::Require;
using detail::Score;
using detail::Select;

namespace {

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

}  // namespace

namespace detail {

std::vector<const CalibrationSample*> Select(
    const CalibrationSamples& samples, const std::function<bool(const CalibrationSample&)>& keep) {
  std::vector<const CalibrationSample*> out;
  for (const CalibrationSample& s : samples.rows)
    if (keep(s) && s.seconds > 0) out.push_back(&s);
  return out;
}

void Require(const std::vector<const CalibrationSample*>& rows, std::string_view what) {
  if (rows.empty())
    throw InputError("calibration samples have no usable " + std::string(what) +
                     " rows: re-run ctxplan-measure with that group");
}

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

std::vector<double> Grid(double max, double step) {
  std::vector<double> values;
  for (int i = 0; i * step <= max + 1e-9; ++i) values.push_back(i * step);
  return values;
}

void FitContext::Measured(SpecValue& v, double value, const std::string& what) const {
  v.value = value;
  v.provenance = Provenance::kMeasured;
  v.note = what + where;
}

}  // namespace detail

namespace {

std::vector<const CalibrationSample*> Op(const CalibrationSamples& samples, std::string_view op) {
  return Select(samples, [&](const CalibrationSample& s) { return s.op == op; });
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

// A measured profile holding only what the samples' header says: where and when they were taken
// and which kernel variants ctxplan-measure timed.
KernelProfile MeasuredProfileHeader(const CalibrationSamples& samples,
                                    const std::string& samples_name) {
  KernelProfile k;
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
  return k;
}

// Where the samples were taken, for the notes of the spec values they measure.
std::string WhereMeasured(const KernelProfile& k) {
  return " on " + k.gpu_name + ", driver " + k.driver + ", " + k.date + ", ctxplan-measure at " +
         k.commit;
}

// Launches, the device copy and the host link.
void FitLaunchAndLinks(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
  const auto launch = Op(samples, "launch");
  Require(launch, "launch");
  k.launch_us = Median({launch[0]->seconds}) * 1e6;
  const auto d2d = Op(samples, "copy_d2d");
  Require(d2d, "copy_d2d");
  {
    std::vector<double> rates;
    for (const CalibrationSample* s : d2d) rates.push_back(2.0 * s->bytes / s->seconds / 1e9);
    c.Measured(gpu.d2d_copy_gbs, *std::max_element(rates.begin(), rates.end()),
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
  c.Measured(gpu.host_h2d_gbs, link_rate("copy_h2d"), "pinned host to device, 64-256 MiB copies");
  c.Measured(gpu.host_d2h_gbs, link_rate("copy_d2h"), "pinned device to host, 64-256 MiB copies");
  {
    const auto duplex = Op(samples, "copy_duplex");
    Require(duplex, "copy_duplex");
    std::vector<double> rates;
    for (const CalibrationSample* s : duplex) rates.push_back(2.0 * s->bytes / s->seconds / 1e9);
    c.Measured(gpu.host_duplex_gbs,
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
}

void FitHostSide(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  KernelProfile& k = c.k;
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
}

// Starting rates from the datasheet, so the model is defined while each group is fitted in
// turn (each group's timing depends only on its own parameters).
void StartFromDatasheetRates(const FitContext& c) {
  const GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
  k.gemm_tflops = k.gemm_accumulate_tflops = gpu.bf16_gemm_tflops.value;
  k.attention_fwd_tflops_d128 = k.attention_fwd_tflops_d64 = gpu.attention_fwd_tflops.value;
  k.attention_bwd_tflops_d128 = k.attention_bwd_tflops_d64 = gpu.attention_bwd_tflops.value;
}

void FitMemoryKernels(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
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
}

// The GEMMs: the tile, split and wave cost that explain them best, and the rate; then the fused
// loss.
void FitGemms(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
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
  c.Measured(gpu.bf16_gemm_tflops, k.gemm_tflops,
             "cuBLASLt bf16 GEMMs of the calibration grid, rate of a full wave of tiles");
}

// LoRA adapters: their traffic's fraction of the memory-bound rate (an optional group).
void FitLora(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
  if (const auto lora_rows = Select(
          samples,
          [](const CalibrationSample& s) { return s.op.rfind("lora_", 0) == 0 && s.head_dim > 0; });
      !lora_rows.empty()) {
    k.lora_efficiency = ImpliedMedian(
        gpu, k, [](KernelProfile& p, double x) { p.lora_efficiency = x; }, lora_rows, 0.02, 2.0);
  }
}

void FitPageSelection(const FitContext& c) {
  const CalibrationSamples& samples = c.samples;
  GpuSpec& gpu = c.gpu;
  KernelProfile& k = c.k;
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

// How well the profile explains what it was fitted on: the residuals by group; the sustained
// group's median error is the profile's nvml_clock_speed_error.
void ReportResiduals(const FitContext& c, const KernelTimeModel& model, CalibrationFit& fit) {
  const CalibrationSamples& samples = c.samples;
  KernelProfile& k = c.k;
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
  fit.gpu = base;
  KernelProfile& k = fit.gpu.kernels;
  k = MeasuredProfileHeader(samples, samples_name);
  const FitContext c{samples, fit.gpu, k, WhereMeasured(k)};
  FitLaunchAndLinks(c);
  FitHostSide(c);
  StartFromDatasheetRates(c);
  FitMemoryKernels(c);
  FitGemms(c);
  FitLora(c);
  FitAttention(c);
  FitPageSelection(c);
  const KernelTimeModel model(MachineFor(fit.gpu), k);
  ReportResiduals(c, model, fit);
  FitPower(samples, model, k);
  if (k.max_sm_clock_mhz > 0)  // FitPower found the power group
    fit.duty_cycle_power_exponent = DutyCyclePowerExponent(samples, k.idle_w, k.max_sm_clock_mhz);
  return fit;
}

}  // namespace ctxplan::sim
