#include "ctxplan/models/catalog.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "embedded_catalog.h"

namespace ctxplan {
namespace {

constexpr std::string_view kEmbeddedPrefix = "<embedded>/";

// Host memory the planner keeps away from pinned pages on a custom machine: the OS, the process
// and its pageable buffers. The presets say the same in their files.
constexpr double kDefaultHostReservedGiB = 8.0;
constexpr double kDefaultHostMemoryGbs = 200.0;

// --- small string helpers -----------------------------------------------------------------------

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool EndsWithIgnoreCase(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && Lower(s.substr(s.size() - suffix.size())) == suffix;
}

std::string Join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
}

// A user's text inside a one-line message: quoted, newlines escaped, long values cut.
std::string Quote(std::string_view text) {
  std::string out = "'";
  for (char c : text.substr(0, 60)) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r' || c == '\t') {
      out += ' ';
    } else {
      out += c;
    }
  }
  if (text.size() > 60) out += "...";
  return out + "'";
}

// 10000000 -> "10,000,000"; 0.1 -> "0.1"; 1e12 -> "1e+12".
std::string FormatLimit(double value) {
  if (value >= 1 && value < 1e13 && value == std::floor(value)) {
    return FormatCount(static_cast<int64_t>(value));
  }
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

// --- errors: "<file>:<line>: key '<key>': <problem>; <what is accepted>" ------------------------

int LineOf(const YAML::Mark& mark) {
  return mark.line >= 0 ? mark.line + 1 : 1;
}

[[noreturn]] void Fail(std::string_view source, const YAML::Mark& mark, std::string_view key,
                       std::string_view problem, std::string_view accepted) {
  std::string message = std::string(source) + ":" + std::to_string(LineOf(mark)) + ": ";
  if (!key.empty()) message += "key '" + std::string(key) + "': ";
  message += problem;
  if (!accepted.empty()) message += "; " + std::string(accepted);
  throw InputError(message);
}

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return "empty";
    case YAML::NodeType::Scalar:
      return "the scalar " + Quote(node.Scalar());
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a mapping";
  }
  return "unknown";
}

// Parses a whole file and insists on a mapping at the top. yaml-cpp reads JSON too.
YAML::Node ParseDocument(std::string_view text, std::string_view source,
                         std::string_view expected) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    Fail(source, e.mark, "", "malformed YAML: " + e.msg, expected);
  }
  if (root.IsNull()) Fail(source, root.Mark(), "", "the file is empty", expected);
  if (!root.IsMap()) {
    Fail(source, root.Mark(), "", "the top level is " + Describe(root) + ", not a mapping",
         expected);
  }
  return root;
}

// --- typed access to the keys of one mapping ----------------------------------------------------

struct IntLimit {
  int64_t max;
};
struct NumberLimit {
  double max;            // values must be finite, > 0 and <= max
  bool zero_ok = false;  // ... or >= 0 (a fixed cost a calibration may find absent)
};

std::string Accepted(IntLimit limit) {
  return "expected an integer from 1 to " + FormatLimit(static_cast<double>(limit.max));
}
std::string Accepted(NumberLimit limit) {
  if (limit.zero_ok) return "expected a number from 0 to " + FormatLimit(limit.max);
  return "expected a positive number up to " + FormatLimit(limit.max);
}
constexpr std::string_view kBoolAccepted = "expected true or false";
constexpr std::string_view kStringAccepted = "expected a non-empty string";

// The keys of one mapping, read with their types checked. Keys are case-sensitive, as in
// config.json. Every error names the key and its line; `prefix` qualifies keys of a nested
// mapping ("memory_gib." + "value").
class Fields {
 public:
  Fields(const YAML::Node& map, std::string_view source, std::string prefix)
      : map_(map), source_(source), prefix_(std::move(prefix)) {
    // By value: yaml-cpp's iterator yields a temporary pair, so a reference into it would dangle.
    for (const auto& pair : map) {
      const YAML::Node key = pair.first;
      if (!key.IsScalar()) {
        Fail(source_, key.Mark(), "", "a key is " + Describe(key), "expected a plain string key");
      }
      if (Find(key.Scalar()) != nullptr) {
        Fail(source_, key.Mark(), Shown(key.Scalar()), "duplicate key", "expected each key once");
      }
      entries_.push_back({key.Scalar(), key.Mark(), pair.second});
    }
  }

  std::string_view source() const { return source_; }

  // Our own files admit only the keys we read: a typo must not silently become a default.
  void RejectUnknown(std::initializer_list<std::string_view> allowed) const {
    for (const Entry& e : entries_) {
      if (std::find(allowed.begin(), allowed.end(), e.key) != allowed.end()) continue;
      std::vector<std::string> names(allowed.begin(), allowed.end());
      Fail(source_, e.mark, Shown(e.key), "unknown key", "accepted keys: " + Join(names, ", "));
    }
  }

  // Present with a value; a null value (`head_dim: null` in config.json) counts as absent.
  bool Has(std::string_view key) const {
    const Entry* e = Find(key);
    return e != nullptr && !e->value.IsNull();
  }

  // The line of the key, or of the mapping when the key is absent.
  YAML::Mark MarkOf(std::string_view key) const {
    const Entry* e = Find(key);
    return e != nullptr ? e->mark : map_.Mark();
  }

  [[noreturn]] void FailKey(std::string_view key, std::string_view problem,
                            std::string_view accepted) const {
    Fail(source_, MarkOf(key), Shown(key), problem, accepted);
  }

  std::string String(std::string_view key) const {
    const YAML::Node& v = Require(key, kStringAccepted);
    if (!v.IsScalar()) FailKey(key, "the value is " + Describe(v), kStringAccepted);
    if (v.Scalar().empty()) FailKey(key, "the value is an empty string", kStringAccepted);
    return v.Scalar();
  }
  std::optional<std::string> OptionalString(std::string_view key) const {
    if (!Has(key)) return std::nullopt;
    return String(key);
  }

  // One of `choices` (lower case), compared case-insensitively; returns the lower-case choice.
  std::string Choice(std::string_view key, const std::vector<std::string>& choices) const {
    const std::string accepted = "expected one of: " + Join(choices, ", ");
    const YAML::Node& v = Require(key, accepted);
    if (!v.IsScalar()) FailKey(key, "the value is " + Describe(v), accepted);
    const std::string value = Lower(v.Scalar());
    if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
      FailKey(key, Quote(v.Scalar()) + " is not accepted", accepted);
    }
    return value;
  }

  bool Bool(std::string_view key) const {
    const YAML::Node& v = Require(key, kBoolAccepted);
    const std::string text = PlainScalar(key, v, "true or false", kBoolAccepted);
    const std::string lower = Lower(text);
    if (lower == "true") return true;
    if (lower == "false") return false;
    FailKey(key, Quote(text) + " is not true or false", kBoolAccepted);
  }
  std::optional<bool> OptionalBool(std::string_view key) const {
    if (!Has(key)) return std::nullopt;
    return Bool(key);
  }

  int64_t Int(std::string_view key, IntLimit limit) const {
    const std::string accepted = Accepted(limit);
    const double value = Number(key, static_cast<double>(limit.max), accepted);
    if (value != std::floor(value)) {
      FailKey(key, Quote(Require(key, accepted).Scalar()) + " is not an integer", accepted);
    }
    return static_cast<int64_t>(value);  // exact: limit.max is far below 2^53
  }
  std::optional<int64_t> OptionalInt(std::string_view key, IntLimit limit) const {
    if (!Has(key)) return std::nullopt;
    return Int(key, limit);
  }

  double Number(std::string_view key, NumberLimit limit) const {
    return Number(key, limit.max, Accepted(limit), limit.zero_ok);
  }
  std::optional<double> OptionalNumber(std::string_view key, NumberLimit limit) const {
    if (!Has(key)) return std::nullopt;
    return Number(key, limit);
  }

  // The keys present, in file order.
  std::vector<std::string> Keys() const {
    std::vector<std::string> keys;
    for (const Entry& e : entries_) keys.push_back(e.key);
    return keys;
  }

  // A nested mapping, to be read with its own Fields.
  Fields Map(std::string_view key, std::string_view accepted) const {
    const YAML::Node& v = Require(key, accepted);
    if (!v.IsMap()) FailKey(key, "the value is " + Describe(v) + ", not a mapping", accepted);
    return Fields(v, source_, Shown(key) + ".");
  }

 private:
  struct Entry {
    std::string key;
    YAML::Mark mark;
    YAML::Node value;
  };

  std::string Shown(std::string_view key) const { return prefix_ + std::string(key); }

  const Entry* Find(std::string_view key) const {
    for (const Entry& e : entries_) {
      if (e.key == key) return &e;
    }
    return nullptr;
  }

  const YAML::Node& Require(std::string_view key, std::string_view accepted) const {
    const Entry* e = Find(key);
    if (e == nullptr) Fail(source_, map_.Mark(), Shown(key), "missing", accepted);
    if (e->value.IsNull()) FailKey(key, "no value", accepted);
    return e->value;
  }

  // The text of an unquoted scalar: a quoted "3584" is a string, not a number, in YAML and JSON.
  std::string PlainScalar(std::string_view key, const YAML::Node& v, std::string_view type,
                          std::string_view accepted) const {
    if (!v.IsScalar()) {
      FailKey(key, "the value is " + Describe(v) + ", not " + std::string(type), accepted);
    }
    if (v.Tag() == "!") {
      FailKey(key,
              "the value is the quoted string " + Quote(v.Scalar()) + ", not " + std::string(type),
              accepted);
    }
    return v.Scalar();
  }

  double Number(std::string_view key, double max, const std::string& accepted,
                bool zero_ok = false) const {
    const YAML::Node& v = Require(key, accepted);
    const std::string text = PlainScalar(key, v, "a number", accepted);
    const std::string lower = Lower(text);
    if (lower == ".inf" || lower == "+.inf" || lower == "-.inf" || lower == ".nan") {
      FailKey(key, Quote(text) + " is not finite", accepted);
    }
    double value = 0.0;
    const char* end = text.data() + text.size();
    const auto [ptr, ec] = std::from_chars(text.data(), end, value);
    if (ec == std::errc::result_out_of_range)
      FailKey(key, Quote(text) + " is out of range", accepted);
    if (ec != std::errc() || ptr != end) FailKey(key, Quote(text) + " is not a number", accepted);
    if (!std::isfinite(value)) FailKey(key, Quote(text) + " is not finite", accepted);
    if (value < 0 || (value == 0 && !zero_ok))
      FailKey(key, Quote(text) + (zero_ok ? " is negative" : " is not positive"), accepted);
    if (value > max) FailKey(key, Quote(text) + " is absurdly large", accepted);
    return value;
  }

  YAML::Node map_;
  std::string source_;
  std::string prefix_;
  std::vector<Entry> entries_;
};

// --- models -------------------------------------------------------------------------------------

// Shape fields: a million-wide hidden size is already absurd; 1e7 leaves room and still keeps
// every derived size far from int64 overflow (see the parameter-count check below).
constexpr IntLimit kShapeLimit{10'000'000};
constexpr IntLimit kPositionsLimit{10'000'000'000};
constexpr NumberLimit kRopeThetaLimit{1e12};
constexpr NumberLimit kNormEpsLimit{0.1};
constexpr double kMaxParams = 1e15;

const std::vector<std::string> kModelTypes = {"qwen2", "llama", "mistral"};
constexpr std::string_view kModelExpected =
    "expected a model: a mapping of Hugging Face config.json keys (hidden_size: 3584, ...)";

// Reads the shape. Our YAML requires every field; a config.json (`hf`) may omit those whose
// Hugging Face defaults are unambiguous for the Qwen2 / Llama / Mistral classes.
void ReadShape(const Fields& f, bool hf, ModelSpec* m) {
  m->hidden_size = f.Int("hidden_size", kShapeLimit);
  m->intermediate_size = f.Int("intermediate_size", kShapeLimit);
  m->num_hidden_layers = f.Int("num_hidden_layers", kShapeLimit);
  m->num_attention_heads = f.Int("num_attention_heads", kShapeLimit);
  // Hugging Face: no num_key_value_heads means multi-head attention (one KV head per Q head).
  m->num_key_value_heads =
      hf ? f.OptionalInt("num_key_value_heads", kShapeLimit).value_or(m->num_attention_heads)
         : f.Int("num_key_value_heads", kShapeLimit);
  const std::optional<int64_t> head_dim = f.OptionalInt("head_dim", kShapeLimit);
  m->vocab_size = f.Int("vocab_size", kShapeLimit);
  m->max_position_embeddings = f.Int("max_position_embeddings", kPositionsLimit);
  if (hf) {
    // The Qwen2, Llama and Mistral config classes all default to untied embeddings, and
    // save_pretrained() writes the key whenever it differs from the PretrainedConfig default.
    m->tie_word_embeddings = f.OptionalBool("tie_word_embeddings").value_or(false);
    // Qwen2 hard-codes Q/K/V biases; Llama and Mistral default to none.
    m->attention_bias = f.OptionalBool("attention_bias").value_or(m->model_type == "qwen2");
    std::optional<double> rope_theta = f.OptionalNumber("rope_theta", kRopeThetaLimit);
    // transformers 5 moved rope_theta into rope_parameters.
    if (!rope_theta && f.Has("rope_parameters")) {
      const Fields rope = f.Map("rope_parameters", "expected a mapping with rope_theta");
      rope_theta = rope.OptionalNumber("rope_theta", kRopeThetaLimit);
    }
    m->rope_theta = rope_theta.value_or(10000.0);
    m->rms_norm_eps = f.OptionalNumber("rms_norm_eps", kNormEpsLimit).value_or(1e-6);
    if (f.OptionalBool("mlp_bias").value_or(false)) {
      f.FailKey("mlp_bias", "MLP biases are not modelled", "expected false or absent");
    }
  } else {
    m->tie_word_embeddings = f.Bool("tie_word_embeddings");
    m->attention_bias = f.Bool("attention_bias");
    m->rope_theta = f.Number("rope_theta", kRopeThetaLimit);
    m->rms_norm_eps = f.Number("rms_norm_eps", kNormEpsLimit);
  }

  if (m->num_attention_heads % m->num_key_value_heads != 0) {
    f.FailKey("num_key_value_heads",
              "num_attention_heads " + std::to_string(m->num_attention_heads) +
                  " is not divisible by num_key_value_heads " +
                  std::to_string(m->num_key_value_heads),
              "expected a divisor of num_attention_heads (grouped-query attention)");
  }
  if (head_dim) {
    m->head_dim = *head_dim;  // may differ from hidden / heads (Gemma-7B: 16 * 256 != 3072)
  } else if (m->hidden_size % m->num_attention_heads != 0) {
    f.FailKey("hidden_size",
              "hidden_size " + std::to_string(m->hidden_size) +
                  " is not a multiple of num_attention_heads " +
                  std::to_string(m->num_attention_heads) + " and head_dim is not given",
              "expected head_dim to be given when hidden_size != num_attention_heads * head_dim");
  } else {
    m->head_dim = m->hidden_size / m->num_attention_heads;
  }

  // Each field is bounded alone; their product must be too, or derived sizes overflow int64.
  const double d = static_cast<double>(m->hidden_size);
  const double q = static_cast<double>(m->num_attention_heads) * m->head_dim;
  const double kv = static_cast<double>(m->num_key_value_heads) * m->head_dim;
  const double params =
      static_cast<double>(m->num_hidden_layers) *
          (2 * d * q + 2 * d * kv + 3 * d * m->intermediate_size + 2 * d + q + 2 * kv) +
      2 * d * m->vocab_size;
  if (params > kMaxParams) {
    char problem[96];
    std::snprintf(problem, sizeof(problem), "the shape gives %.3g parameters", params);
    Fail(f.source(), f.MarkOf("num_hidden_layers"), "num_hidden_layers", problem,
         "expected a model of at most 1e15 parameters");
  }
}

// --- GPUs and machines --------------------------------------------------------------------------

constexpr NumberLimit kMemoryGiBLimit{1e5};
constexpr NumberLimit kDeviceGbsLimit{1e6};
constexpr NumberLimit kTflopsLimit{1e6};
constexpr NumberLimit kHostGbsLimit{1e5};
constexpr NumberLimit kContextGiBLimit{1e3};
constexpr IntLimit kSmCountLimit{1'000'000};

constexpr std::string_view kSpecAccepted =
    "expected a mapping {value: <number>, source: measured|datasheet|estimate, note: \"...\"}";
constexpr std::string_view kGpuExpected =
    "expected a GPU: a mapping of name, display_name, sm_count, host_link and spec values";
constexpr std::string_view kMachineExpected =
    "expected a machine: a mapping of name, gpu, host_ram_gib, host_reserved_gib, "
    "host_memory_gbs, gpus, peer_gbs, network_gbs, peer_latency_us, host_links_h2d_gbs, "
    "host_links_d2h_gbs, selection_read_back_us, selection_read_back_ns_per_entry, "
    "selection_read_back_ns_per_page, note";

constexpr NumberLimit kProfileLimit{1e7};
constexpr IntLimit kMachineGpusLimit{1024};
constexpr NumberLimit kLinkGbsLimit{1e5};
// A machine that names no links: PCIe Gen5 between its GPUs (~50 GB/s one way, as the pinned
// host copies measure), a 400 Gb/s NIC a GPU between machines, NCCL's few microseconds a call.
constexpr double kDefaultPeerGbs = 50.0;
constexpr double kDefaultNetworkGbs = 50.0;
constexpr double kDefaultPeerLatencyUs = 10.0;
constexpr NumberLimit kFixedCostLimit{1e7, true};        // microseconds or nanoseconds, 0 allowed
constexpr NumberLimit kNvmlClockErrorLimit{10.0, true};  // a fraction; 0 allowed
constexpr IntLimit kPageTokensLimit{1 << 20};
constexpr std::string_view kKernelModelExpected =
    "expected a mapping of the kernel-time model's parameters (source: measured|estimate, "
    "launch_us, gemm_tflops, ...; see models/gpu/h200.yaml)";
constexpr std::string_view kPageTableExpected =
    "expected a mapping of page size in tokens to a fraction in (0, 2], e.g. {64: 0.95, 128: 1}";

std::map<int64_t, double> ReadPageTable(const Fields& f, std::string_view key) {
  const Fields table = f.Map(key, kPageTableExpected);
  std::map<int64_t, double> out;
  for (const std::string& page : table.Keys()) {
    char* end = nullptr;
    const long long tokens = std::strtoll(page.c_str(), &end, 10);
    if (end == page.c_str() || *end != '\0' || tokens <= 0 || tokens > kPageTokensLimit.max)
      table.FailKey(page, "not a page size", kPageTableExpected);
    const double fraction = table.Number(page, NumberLimit{2.0});
    if (fraction <= 0) table.FailKey(page, "not positive", kPageTableExpected);
    out[tokens] = fraction;
  }
  if (out.empty()) f.FailKey(key, "the table is empty", kPageTableExpected);
  return out;
}

// A memory-bound kernel table: {rmsnorm_fwd: 2.8, ...}, the names of cost.h MemoryKernelName.
// zero_ok: a fixed cost may be 0 (a warm launch whose latency the L2 hides).
std::map<std::string, double> ReadMemoryKernelTable(const Fields& f, std::string_view key,
                                                    NumberLimit limit, bool zero_ok = false) {
  constexpr std::string_view kExpected =
      "a map of memory-bound kernel names (rmsnorm_fwd, rope, ...) to positive numbers";
  const auto& names = kMemoryKernelNames;
  const Fields table = f.Map(key, kExpected);
  std::map<std::string, double> out;
  for (const std::string& name : table.Keys()) {
    if (std::find(names.begin(), names.end(), name) == names.end())
      table.FailKey(name, "not a memory-bound kernel", kExpected);
    const double value = table.Number(name, limit);
    if (value < 0 || (value == 0 && !zero_ok)) table.FailKey(name, "not positive", kExpected);
    out[name] = value;
  }
  return out;
}

KernelProfile ReadKernelProfile(const Fields& f) {
  f.RejectUnknown({"source",
                   "gpu_name",
                   "driver",
                   "date",
                   "commit",
                   "samples",
                   "derived_from",
                   "launch_us",
                   "gemm_tflops",
                   "gemm_tile_rows",
                   "gemm_tile_cols",
                   "gemm_split_max",
                   "gemm_wave_us",
                   "gemm_accumulate_tflops",
                   "gemm_accumulate_tile_rows",
                   "gemm_accumulate_tile_cols",
                   "gemm_accumulate_wave_us_per_byte",
                   "loss_efficiency",
                   "attention_fwd_tflops_d128",
                   "attention_fwd_tflops_d64",
                   "attention_bwd_tflops_d128",
                   "attention_bwd_tflops_d64",
                   "attention_fwd_item_us",
                   "attention_bwd_item_us",
                   "attention_fwd_rows128_efficiency_d64",
                   "attention_fwd_slices_d64",
                   "page_fwd_efficiency",
                   "page_bwd_efficiency",
                   "page_fwd_efficiency_d64",
                   "page_bwd_efficiency_d64",
                   "sparse_fwd_efficiency",
                   "sparse_bwd_efficiency",
                   "sparse_fwd_page_efficiency",
                   "sparse_bwd_page_efficiency",
                   "sparse_fwd_page_efficiency_d64",
                   "sparse_bwd_page_efficiency_d64",
                   "sparse_bwd_gathered",
                   "own_bwd_split",
                   "attention_bwd_gathered_item_us",
                   "attention_bwd_gathered_item_us_d64",
                   "attention_bwd_union_block_us",
                   "sparse_bwd_union_efficiency",
                   "attention_bwd_union64_block_us",
                   "sparse_bwd_union64_efficiency",
                   "sparse_bwd_union64_efficiency_d64",
                   "attention_bwd_own_item_us",
                   "memory_efficiency",
                   "memory_kernel_fixed_us",
                   "memory_kernel_efficiency",
                   "memory_kernel_warm_fixed_us",
                   "memory_kernel_warm_efficiency",
                   "l2_cache_mib",
                   "lora_efficiency",
                   "page_score_fixed_us",
                   "page_score_ns_per_tile_page",
                   "page_score_ns_per_tile_element",
                   "page_topk_fixed_us",
                   "page_topk_ns_per_page",
                   "copy_call_us",
                   "pin_gbs",
                   "host_memcpy_gbs",
                   "host_adamw_gparams",
                   "weights_init_gparams",
                   "device_alloc_gbs",
                   "max_sm_clock_mhz",
                   "power_limit_w",
                   "idle_w",
                   "gemm_w",
                   "attention_fwd_w",
                   "attention_bwd_w",
                   "attention_fwd_w_d64",
                   "attention_bwd_w_d64",
                   "memory_w",
                   "nvml_clock_speed_error",
                   "loss_ns_per_logit",
                   "weights_upload_gparams"});
  KernelProfile k;
  const std::string source = f.Choice("source", {"measured", "estimate"});
  k.provenance = source == "measured" ? Provenance::kMeasured : Provenance::kEstimate;
  if (k.provenance == Provenance::kEstimate) {
    // Scaled from a calibrated sibling at load time: only the sibling is named here.
    f.RejectUnknown({"source", "derived_from"});
    k.derived_from = f.String("derived_from");
    return k;
  }
  k.gpu_name = f.String("gpu_name");
  k.driver = f.String("driver");
  k.date = f.String("date");
  k.commit = f.String("commit");
  k.samples = f.OptionalString("samples").value_or("");
  k.launch_us = f.Number("launch_us", kFixedCostLimit);
  k.gemm_tflops = f.Number("gemm_tflops", kTflopsLimit);
  k.gemm_tile_rows = f.Int("gemm_tile_rows", kPageTokensLimit);
  k.gemm_tile_cols = f.Int("gemm_tile_cols", kPageTokensLimit);
  k.gemm_split_max = f.Int("gemm_split_max", kPageTokensLimit);
  k.gemm_wave_us = f.Number("gemm_wave_us", kFixedCostLimit);
  k.gemm_accumulate_tflops = f.Number("gemm_accumulate_tflops", kTflopsLimit);
  k.gemm_accumulate_tile_rows = f.Int("gemm_accumulate_tile_rows", kPageTokensLimit);
  k.gemm_accumulate_tile_cols = f.Int("gemm_accumulate_tile_cols", kPageTokensLimit);
  k.gemm_accumulate_wave_us_per_byte =
      f.Number("gemm_accumulate_wave_us_per_byte", kFixedCostLimit);
  k.loss_efficiency = f.Number("loss_efficiency", NumberLimit{2.0});
  k.loss_ns_per_logit = f.OptionalNumber("loss_ns_per_logit", NumberLimit{1.0, true}).value_or(0.0);
  k.attention_fwd_tflops_d128 = f.Number("attention_fwd_tflops_d128", kTflopsLimit);
  k.attention_fwd_tflops_d64 = f.Number("attention_fwd_tflops_d64", kTflopsLimit);
  k.attention_bwd_tflops_d128 = f.Number("attention_bwd_tflops_d128", kTflopsLimit);
  k.attention_bwd_tflops_d64 = f.Number("attention_bwd_tflops_d64", kTflopsLimit);
  k.attention_fwd_item_us = f.Number("attention_fwd_item_us", kFixedCostLimit);
  k.attention_bwd_item_us = f.Number("attention_bwd_item_us", kFixedCostLimit);
  k.attention_fwd_rows128_efficiency_d64 =
      f.OptionalNumber("attention_fwd_rows128_efficiency_d64", NumberLimit{2.0}).value_or(0.0);
  k.page_fwd_efficiency = ReadPageTable(f, "page_fwd_efficiency");
  k.page_bwd_efficiency = ReadPageTable(f, "page_bwd_efficiency");
  if (f.Has("page_fwd_efficiency_d64"))
    k.page_fwd_efficiency_d64 = ReadPageTable(f, "page_fwd_efficiency_d64");
  if (f.Has("page_bwd_efficiency_d64"))
    k.page_bwd_efficiency_d64 = ReadPageTable(f, "page_bwd_efficiency_d64");
  k.sparse_fwd_efficiency = f.Number("sparse_fwd_efficiency", NumberLimit{2.0});
  k.sparse_bwd_efficiency = f.Number("sparse_bwd_efficiency", NumberLimit{2.0});
  if (f.Has("sparse_fwd_page_efficiency"))
    k.sparse_fwd_page_efficiency = ReadPageTable(f, "sparse_fwd_page_efficiency");
  if (f.Has("sparse_bwd_page_efficiency"))
    k.sparse_bwd_page_efficiency = ReadPageTable(f, "sparse_bwd_page_efficiency");
  if (f.Has("sparse_fwd_page_efficiency_d64"))
    k.sparse_fwd_page_efficiency_d64 = ReadPageTable(f, "sparse_fwd_page_efficiency_d64");
  if (f.Has("sparse_bwd_page_efficiency_d64"))
    k.sparse_bwd_page_efficiency_d64 = ReadPageTable(f, "sparse_bwd_page_efficiency_d64");
  k.attention_fwd_slices_d64 = f.OptionalBool("attention_fwd_slices_d64").value_or(false);
  k.sparse_bwd_gathered = f.OptionalBool("sparse_bwd_gathered").value_or(false);
  k.own_bwd_split = f.OptionalBool("own_bwd_split").value_or(false);
  k.attention_bwd_gathered_item_us =
      f.OptionalNumber("attention_bwd_gathered_item_us", kFixedCostLimit).value_or(0.0);
  k.attention_bwd_gathered_item_us_d64 =
      f.OptionalNumber("attention_bwd_gathered_item_us_d64", kFixedCostLimit).value_or(0.0);
  k.attention_bwd_union_block_us =
      f.OptionalNumber("attention_bwd_union_block_us", kFixedCostLimit).value_or(0.0);
  k.sparse_bwd_union_efficiency =
      f.OptionalNumber("sparse_bwd_union_efficiency", NumberLimit{2.0}).value_or(1.0);
  k.attention_bwd_union64_block_us =
      f.OptionalNumber("attention_bwd_union64_block_us", kFixedCostLimit).value_or(0.0);
  k.sparse_bwd_union64_efficiency =
      f.OptionalNumber("sparse_bwd_union64_efficiency", NumberLimit{2.0}).value_or(1.0);
  k.sparse_bwd_union64_efficiency_d64 =
      f.OptionalNumber("sparse_bwd_union64_efficiency_d64", NumberLimit{2.0}).value_or(0.0);
  k.attention_bwd_own_item_us =
      f.OptionalNumber("attention_bwd_own_item_us", kFixedCostLimit).value_or(0.0);
  k.memory_efficiency = f.Number("memory_efficiency", NumberLimit{2.0});
  if (f.Has("memory_kernel_fixed_us"))
    k.memory_kernel_fixed_us =
        ReadMemoryKernelTable(f, "memory_kernel_fixed_us", kFixedCostLimit, true);
  if (f.Has("memory_kernel_efficiency"))
    k.memory_kernel_efficiency =
        ReadMemoryKernelTable(f, "memory_kernel_efficiency", NumberLimit{2.0});
  if (f.Has("memory_kernel_warm_efficiency"))
    k.memory_kernel_warm_efficiency =
        ReadMemoryKernelTable(f, "memory_kernel_warm_efficiency", NumberLimit{20.0});
  if (f.Has("memory_kernel_warm_fixed_us"))
    k.memory_kernel_warm_fixed_us =
        ReadMemoryKernelTable(f, "memory_kernel_warm_fixed_us", kFixedCostLimit, true);
  k.l2_cache_mib = f.OptionalNumber("l2_cache_mib", NumberLimit{4096.0}).value_or(0.0);
  for (const auto& [name, warm] : k.memory_kernel_warm_efficiency)
    if (!k.memory_kernel_fixed_us.contains(name) || !k.memory_kernel_warm_fixed_us.contains(name) ||
        k.l2_cache_mib <= 0)
      f.FailKey("memory_kernel_warm_efficiency", "has " + name + " without its cold fit",
                "kernels of memory_kernel_fixed_us and memory_kernel_warm_fixed_us, with "
                "l2_cache_mib given");
  for (const auto& [name, fixed] : k.memory_kernel_fixed_us)
    if (!k.memory_kernel_efficiency.contains(name))
      f.FailKey("memory_kernel_efficiency", "has no " + name,
                "the kernels of memory_kernel_fixed_us, each with its fraction");
  k.lora_efficiency = f.OptionalNumber("lora_efficiency", NumberLimit{2.0}).value_or(1.0);
  k.page_score_fixed_us = f.Number("page_score_fixed_us", kFixedCostLimit);
  k.page_score_ns_per_tile_page = f.Number("page_score_ns_per_tile_page", kFixedCostLimit);
  k.page_score_ns_per_tile_element =
      f.OptionalNumber("page_score_ns_per_tile_element", kFixedCostLimit).value_or(0.0);
  k.page_topk_fixed_us = f.Number("page_topk_fixed_us", kFixedCostLimit);
  k.page_topk_ns_per_page = f.Number("page_topk_ns_per_page", kFixedCostLimit);
  k.copy_call_us = f.Number("copy_call_us", kFixedCostLimit);
  k.pin_gbs = f.Number("pin_gbs", kHostGbsLimit);
  k.host_memcpy_gbs = f.Number("host_memcpy_gbs", kHostGbsLimit);
  k.host_adamw_gparams = f.Number("host_adamw_gparams", kProfileLimit);
  k.weights_init_gparams = f.Number("weights_init_gparams", kProfileLimit);
  k.device_alloc_gbs = f.Number("device_alloc_gbs", kDeviceGbsLimit);
  k.weights_upload_gparams =
      f.OptionalNumber("weights_upload_gparams", kProfileLimit).value_or(0.0);
  // Power (optional: a profile measured without NVML has none).
  k.max_sm_clock_mhz = f.OptionalNumber("max_sm_clock_mhz", kProfileLimit).value_or(0.0);
  k.power_limit_w = f.OptionalNumber("power_limit_w", kProfileLimit).value_or(0.0);
  k.idle_w = f.OptionalNumber("idle_w", kProfileLimit).value_or(0.0);
  k.gemm_w = f.OptionalNumber("gemm_w", kProfileLimit).value_or(0.0);
  k.attention_fwd_w = f.OptionalNumber("attention_fwd_w", kProfileLimit).value_or(0.0);
  k.attention_bwd_w = f.OptionalNumber("attention_bwd_w", kProfileLimit).value_or(0.0);
  k.attention_fwd_w_d64 = f.OptionalNumber("attention_fwd_w_d64", kProfileLimit).value_or(0.0);
  k.attention_bwd_w_d64 = f.OptionalNumber("attention_bwd_w_d64", kProfileLimit).value_or(0.0);
  k.memory_w = f.OptionalNumber("memory_w", kProfileLimit).value_or(0.0);
  k.nvml_clock_speed_error =
      f.OptionalNumber("nvml_clock_speed_error", kNvmlClockErrorLimit).value_or(-1.0);
  for (const auto& [key, value] :
       {std::pair<const char*, double>{"gemm_tflops", k.gemm_tflops},
        {"gemm_accumulate_tflops", k.gemm_accumulate_tflops},
        {"gemm_split_max", static_cast<double>(k.gemm_split_max)},
        {"gemm_tile_rows", static_cast<double>(k.gemm_tile_rows)},
        {"gemm_tile_cols", static_cast<double>(k.gemm_tile_cols)},
        {"gemm_accumulate_tile_rows", static_cast<double>(k.gemm_accumulate_tile_rows)},
        {"gemm_accumulate_tile_cols", static_cast<double>(k.gemm_accumulate_tile_cols)},
        {"attention_fwd_tflops_d128", k.attention_fwd_tflops_d128},
        {"attention_fwd_tflops_d64", k.attention_fwd_tflops_d64},
        {"attention_bwd_tflops_d128", k.attention_bwd_tflops_d128},
        {"attention_bwd_tflops_d64", k.attention_bwd_tflops_d64},
        {"memory_efficiency", k.memory_efficiency},
        {"lora_efficiency", k.lora_efficiency},
        {"pin_gbs", k.pin_gbs},
        {"host_memcpy_gbs", k.host_memcpy_gbs},
        {"host_adamw_gparams", k.host_adamw_gparams},
        {"device_alloc_gbs", k.device_alloc_gbs}}) {
    if (value <= 0) f.FailKey(key, "not positive", "expected a positive number");
  }
  return k;
}

SpecValue ReadSpec(const Fields& f, std::string_view key, NumberLimit limit) {
  const Fields s = f.Map(key, kSpecAccepted);
  s.RejectUnknown({"value", "source", "note"});
  SpecValue v;
  v.value = s.Number("value", limit);
  const std::string source = s.Choice("source", {"measured", "datasheet", "estimate"});
  v.provenance = source == "measured"    ? Provenance::kMeasured
                 : source == "datasheet" ? Provenance::kDatasheet
                                         : Provenance::kEstimate;
  v.note = s.String("note");
  return v;
}

// An achieved rate above its ceiling is a typo (a sparse peak, a wrong unit), never a measurement.
void CheckAtMost(const Fields& f, std::string_view key, const SpecValue& value,
                 std::string_view ceiling_key, double ceiling) {
  if (value.value <= ceiling) return;
  f.FailKey(key,
            "value " + FormatLimit(value.value) + " exceeds " + std::string(ceiling_key) + " " +
                FormatLimit(ceiling),
            "expected at most " + std::string(ceiling_key));
}

// --- the embedded catalogue ---------------------------------------------------------------------

// Catalogue entries of one folder ("llm"), by name (the file stem), sorted.
std::vector<std::pair<std::string, const detail::EmbeddedFile*>> Entries(std::string_view folder) {
  std::vector<std::pair<std::string, const detail::EmbeddedFile*>> out;
  const std::string prefix = std::string(folder) + "/";
  for (const detail::EmbeddedFile& file : detail::EmbeddedCatalog()) {
    if (file.path.substr(0, prefix.size()) != prefix || !file.path.ends_with(".yaml")) continue;
    std::string_view stem = file.path.substr(prefix.size());
    stem.remove_suffix(5);
    out.emplace_back(std::string(stem), &file);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Names(std::string_view folder) {
  std::vector<std::string> names;
  for (const auto& entry : Entries(folder)) names.push_back(entry.first);
  return names;
}

const detail::EmbeddedFile* FindEmbedded(std::string_view folder, std::string_view name) {
  const std::string wanted = Lower(name);
  for (const auto& [stem, file] : Entries(folder)) {
    if (stem == wanted) return file;
  }
  return nullptr;
}

std::string EmbeddedSource(const detail::EmbeddedFile& file) {
  return std::string(kEmbeddedPrefix) + std::string(file.path);
}

std::string UnknownName(std::string_view kind, std::string_view name,
                        const std::vector<std::string>& names, std::string_view or_path) {
  return "unknown " + std::string(kind) + " " + Quote(name) + "; expected one of the catalogue " +
         std::string(kind) + "s (" + Join(names, ", ") + ") or " + std::string(or_path);
}

// Embedded files are named after their `name:`; a mismatch is our bug, not the user's.
template <typename Spec>
Spec CheckEmbeddedName(Spec spec, std::string_view name) {
  CTXPLAN_CHECK(Lower(spec.name) == Lower(name),
                "catalogue file for '" + std::string(name) + "' names itself '" + spec.name + "'");
  return spec;
}

}  // namespace

std::string ReadTextFile(std::string_view path) {
  const std::filesystem::path p{std::string(path)};
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) {
    throw InputError(std::string(path) + ": cannot read file (it is a directory)");
  }
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    throw InputError(std::string(path) + ": cannot read file (" + std::strerror(errno) + ")");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(std::string(path) + ": cannot read file (read error)");
  return text.str();
}

bool NamesAFile(std::string_view name_or_path) {
  return name_or_path.find('/') != std::string_view::npos ||
         EndsWithIgnoreCase(name_or_path, ".yaml") || EndsWithIgnoreCase(name_or_path, ".yml") ||
         EndsWithIgnoreCase(name_or_path, ".json");
}

// --- public API ---------------------------------------------------------------------------------

ModelSpec ParseModelYaml(std::string_view text, std::string_view source) {
  const YAML::Node root = ParseDocument(text, source, kModelExpected);
  const Fields f(root, source, "");
  f.RejectUnknown({"name", "model_type", "hf_repo", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "vocab_size", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
                   "rope_theta", "rms_norm_eps"});
  ModelSpec m;
  m.name = f.String("name");
  m.source_path = std::string(source);
  m.model_type = f.Choice("model_type", kModelTypes);
  m.hf_repo = f.OptionalString("hf_repo").value_or("");
  ReadShape(f, /*hf=*/false, &m);
  return m;
}

ModelSpec ParseHfConfigJson(std::string_view text, std::string_view source) {
  const YAML::Node root = ParseDocument(text, source, kModelExpected);
  // Real config.json files carry dozens of keys we do not use (token ids, dtype, dropout, ...):
  // those are ignored; the ones we read are checked as strictly as in our own files.
  const Fields f(root, source, "");
  ModelSpec m;
  m.name = std::string(source);
  m.source_path = std::string(source);
  m.model_type = f.Choice("model_type", kModelTypes);
  ReadShape(f, /*hf=*/true, &m);
  return m;
}

GpuSpec ParseGpuYaml(std::string_view text, std::string_view source) {
  const YAML::Node root = ParseDocument(text, source, kGpuExpected);
  const Fields f(root, source, "");
  f.RejectUnknown({"name", "display_name", "sm_count", "host_link", "memory_gib",
                   "memory_bandwidth_gbs", "d2d_copy_gbs", "bf16_dense_tflops", "bf16_gemm_tflops",
                   "attention_fwd_tflops", "attention_bwd_tflops", "host_h2d_gbs", "host_d2h_gbs",
                   "host_duplex_gbs", "cuda_context_gib", "boost_clock_mhz", "tdp_w",
                   "kernel_model"});
  GpuSpec g;
  g.name = f.String("name");
  g.display_name = f.String("display_name");
  g.source_path = std::string(source);
  g.sm_count = f.Int("sm_count", kSmCountLimit);
  g.host_link = f.String("host_link");
  g.memory_gib = ReadSpec(f, "memory_gib", kMemoryGiBLimit);
  g.memory_bandwidth_gbs = ReadSpec(f, "memory_bandwidth_gbs", kDeviceGbsLimit);
  g.d2d_copy_gbs = ReadSpec(f, "d2d_copy_gbs", kDeviceGbsLimit);
  g.bf16_dense_tflops = ReadSpec(f, "bf16_dense_tflops", kTflopsLimit);
  g.bf16_gemm_tflops = ReadSpec(f, "bf16_gemm_tflops", kTflopsLimit);
  g.attention_fwd_tflops = ReadSpec(f, "attention_fwd_tflops", kTflopsLimit);
  g.attention_bwd_tflops = ReadSpec(f, "attention_bwd_tflops", kTflopsLimit);
  g.host_h2d_gbs = ReadSpec(f, "host_h2d_gbs", kHostGbsLimit);
  g.host_d2h_gbs = ReadSpec(f, "host_d2h_gbs", kHostGbsLimit);
  g.host_duplex_gbs = ReadSpec(f, "host_duplex_gbs", kHostGbsLimit);
  g.cuda_context_gib = ReadSpec(f, "cuda_context_gib", kContextGiBLimit);
  g.boost_clock_mhz = f.OptionalNumber("boost_clock_mhz", kProfileLimit).value_or(0.0);
  g.tdp_w = f.OptionalNumber("tdp_w", kProfileLimit).value_or(0.0);
  if (f.Has("kernel_model")) {
    g.kernels = ReadKernelProfile(f.Map("kernel_model", kKernelModelExpected));
    if (g.kernels.provenance == Provenance::kEstimate) {
      // The sibling must be measured: estimates are never chained.
      const std::string& sibling_name = g.kernels.derived_from;
      const detail::EmbeddedFile* file = FindEmbedded("gpu", sibling_name);
      if (file == nullptr || sibling_name == g.name)
        f.FailKey("kernel_model", "derived_from names no other catalogue GPU",
                  "expected the name of a calibrated catalogue GPU, e.g. h200");
      const GpuSpec sibling = ParseGpuYaml(file->text, EmbeddedSource(*file));
      if (sibling.kernels.provenance != Provenance::kMeasured || sibling.kernels.empty())
        f.FailKey("kernel_model", "the sibling " + Quote(sibling_name) + " is not calibrated",
                  "expected a GPU whose kernel_model is measured");
      g.kernels = ScaleKernelProfile(sibling, g);
    }
  }

  const double dense = g.bf16_dense_tflops.value;
  CheckAtMost(f, "bf16_gemm_tflops", g.bf16_gemm_tflops, "bf16_dense_tflops", dense);
  CheckAtMost(f, "attention_fwd_tflops", g.attention_fwd_tflops, "bf16_dense_tflops", dense);
  CheckAtMost(f, "attention_bwd_tflops", g.attention_bwd_tflops, "bf16_dense_tflops", dense);
  CheckAtMost(f, "d2d_copy_gbs", g.d2d_copy_gbs, "memory_bandwidth_gbs",
              g.memory_bandwidth_gbs.value);
  CheckAtMost(f, "host_duplex_gbs", g.host_duplex_gbs, "host_h2d_gbs + host_d2h_gbs",
              g.host_h2d_gbs.value + g.host_d2h_gbs.value);
  if (g.cuda_context_gib.value >= g.memory_gib.value) {
    f.FailKey("cuda_context_gib",
              "value " + FormatLimit(g.cuda_context_gib.value) + " is not below memory_gib " +
                  FormatLimit(g.memory_gib.value),
              "expected less than memory_gib");
  }
  return g;
}

MachineSpec ParseMachineYaml(std::string_view text, std::string_view source) {
  const YAML::Node root = ParseDocument(text, source, kMachineExpected);
  const Fields f(root, source, "");
  f.RejectUnknown({"name", "gpu", "host_ram_gib", "host_reserved_gib", "host_memory_gbs", "gpus",
                   "peer_gbs", "network_gbs", "peer_latency_us", "host_links_h2d_gbs",
                   "host_links_d2h_gbs", "selection_read_back_us",
                   "selection_read_back_ns_per_entry", "selection_read_back_ns_per_page", "note"});
  MachineSpec m;
  m.name = f.String("name");
  const std::string gpu = f.String("gpu");
  if (NamesAFile(gpu)) {
    // A relative path is relative to the machine file, as in any config that names another.
    std::filesystem::path path(gpu);
    if (path.is_relative() && !source.starts_with(kEmbeddedPrefix)) {
      path = std::filesystem::path(std::string(source)).parent_path() / path;
    }
    m.gpu = LoadGpu(path.string());
  } else if (const detail::EmbeddedFile* file = FindEmbedded("gpu", gpu)) {
    m.gpu = CheckEmbeddedName(ParseGpuYaml(file->text, EmbeddedSource(*file)), gpu);
  } else {
    f.FailKey("gpu", "unknown GPU " + Quote(gpu),
              "expected one of " + Join(CatalogGpuNames(), ", ") + " or a path to a GPU .yaml");
  }
  const double ram_gib = f.Number("host_ram_gib", kMemoryGiBLimit);
  const double reserved_gib = f.Number("host_reserved_gib", kMemoryGiBLimit);
  if (reserved_gib >= ram_gib) {
    f.FailKey("host_reserved_gib",
              FormatLimit(reserved_gib) + " is not below host_ram_gib " + FormatLimit(ram_gib),
              "expected less than host_ram_gib (the rest holds pinned pages)");
  }
  m.host_ram_bytes = std::llround(ram_gib * static_cast<double>(kGiB));
  m.host_reserved_bytes = std::llround(reserved_gib * static_cast<double>(kGiB));
  m.host_memory_gbs = f.Number("host_memory_gbs", kHostGbsLimit);
  m.gpus = static_cast<int32_t>(f.OptionalInt("gpus", kMachineGpusLimit).value_or(1));
  m.peer_gbs = f.OptionalNumber("peer_gbs", kLinkGbsLimit).value_or(kDefaultPeerGbs);
  m.network_gbs = f.OptionalNumber("network_gbs", kLinkGbsLimit).value_or(kDefaultNetworkGbs);
  m.peer_latency_us =
      f.OptionalNumber("peer_latency_us", kFixedCostLimit).value_or(kDefaultPeerLatencyUs);
  m.host_links_h2d_gbs = f.OptionalNumber("host_links_h2d_gbs", kLinkGbsLimit).value_or(0.0);
  m.host_links_d2h_gbs = f.OptionalNumber("host_links_d2h_gbs", kLinkGbsLimit).value_or(0.0);
  m.selection_read_back_us =
      f.OptionalNumber("selection_read_back_us", kFixedCostLimit).value_or(0.0);
  m.selection_read_back_ns_per_entry =
      f.OptionalNumber("selection_read_back_ns_per_entry", kFixedCostLimit).value_or(0.0);
  m.selection_read_back_ns_per_page =
      f.OptionalNumber("selection_read_back_ns_per_page", kFixedCostLimit).value_or(0.0);
  m.note = f.OptionalString("note").value_or("");
  return m;
}

ModelSpec LoadModel(std::string_view name_or_path) {
  if (NamesAFile(name_or_path)) {
    const std::string text = ReadTextFile(name_or_path);
    if (EndsWithIgnoreCase(name_or_path, ".json")) return ParseHfConfigJson(text, name_or_path);
    return ParseModelYaml(text, name_or_path);
  }
  const detail::EmbeddedFile* file = FindEmbedded("llm", name_or_path);
  if (file == nullptr) {
    throw InputError(UnknownName("model", name_or_path, CatalogModelNames(),
                                 "a path to a model .yaml or a Hugging Face config.json"));
  }
  return CheckEmbeddedName(ParseModelYaml(file->text, EmbeddedSource(*file)), name_or_path);
}

GpuSpec LoadGpu(std::string_view name_or_path) {
  if (NamesAFile(name_or_path)) return ParseGpuYaml(ReadTextFile(name_or_path), name_or_path);
  const detail::EmbeddedFile* file = FindEmbedded("gpu", name_or_path);
  if (file == nullptr) {
    throw InputError(UnknownName("GPU", name_or_path, CatalogGpuNames(), "a path to a GPU .yaml"));
  }
  return CheckEmbeddedName(ParseGpuYaml(file->text, EmbeddedSource(*file)), name_or_path);
}

MachineSpec LoadMachine(std::string_view name_or_path) {
  if (NamesAFile(name_or_path)) return ParseMachineYaml(ReadTextFile(name_or_path), name_or_path);
  const detail::EmbeddedFile* file = FindEmbedded("machine", name_or_path);
  if (file == nullptr) {
    throw InputError(UnknownName("machine", name_or_path, CatalogMachineNames(),
                                 "a path to a machine .yaml (or --gpu with --host-ram)"));
  }
  return CheckEmbeddedName(ParseMachineYaml(file->text, EmbeddedSource(*file)), name_or_path);
}

MachineSpec MakeMachine(const GpuSpec& gpu, int64_t host_ram_bytes) {
  const int64_t reserved = static_cast<int64_t>(kDefaultHostReservedGiB * kGiB);
  const double ram_gib = static_cast<double>(host_ram_bytes) / static_cast<double>(kGiB);
  if (host_ram_bytes <= reserved) {
    throw InputError("host RAM " + FormatGiB(host_ram_bytes) + " is not more than the " +
                     FormatGiB(reserved) +
                     " reserved for the OS and the process; expected more, e.g. 125GiB");
  }
  if (ram_gib > kMemoryGiBLimit.max) {
    throw InputError("host RAM " + FormatGiB(host_ram_bytes) + " is absurdly large; expected at " +
                     "most " + FormatLimit(kMemoryGiBLimit.max) + " GiB");
  }
  MachineSpec m;
  // "h200+125GiB", or "h200+1396.98GiB" for a size that is not whole GiB.
  char ram[32];
  if (host_ram_bytes % kGiB == 0) {
    std::snprintf(ram, sizeof(ram), "%lldGiB", static_cast<long long>(host_ram_bytes / kGiB));
  } else {
    std::snprintf(ram, sizeof(ram), "%.2fGiB", ram_gib);
  }
  m.name = gpu.name + "+" + ram;
  m.gpu = gpu;
  m.host_ram_bytes = host_ram_bytes;
  m.host_reserved_bytes = reserved;
  m.host_memory_gbs = kDefaultHostMemoryGbs;
  m.peer_gbs = kDefaultPeerGbs;
  m.network_gbs = kDefaultNetworkGbs;
  m.peer_latency_us = kDefaultPeerLatencyUs;
  return m;
}

std::vector<std::string> CatalogModelNames() {
  return Names("llm");
}
std::vector<std::string> CatalogGpuNames() {
  return Names("gpu");
}
std::vector<std::string> CatalogMachineNames() {
  return Names("machine");
}

}  // namespace ctxplan
