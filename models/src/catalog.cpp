#include "ctxplan/models/catalog.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "embedded_catalog.h"
#include "kernel_profile_reader.h"
#include "yaml_fields.h"

namespace ctxplan {
namespace {

using detail::Describe;
using detail::Fail;
using detail::Fields;
using detail::FormatLimit;
using detail::IntLimit;
using detail::Join;
using detail::kDeviceGbsLimit;
using detail::kFixedCostLimit;
using detail::kHostGbsLimit;
using detail::kProfileLimit;
using detail::kTflopsLimit;
using detail::Lower;
using detail::NumberLimit;
using detail::ParseDocument;
using detail::Quote;
using detail::ReadKernelProfile;

constexpr std::string_view kEmbeddedPrefix = "<embedded>/";

// Host memory the planner keeps away from pinned pages on a custom machine: the OS, the process
// and its pageable buffers. The presets say the same in their files.
constexpr double kDefaultHostReservedGiB = 8.0;
constexpr double kDefaultHostMemoryGbs = 200.0;

// --- small string helpers -----------------------------------------------------------------------

bool EndsWithIgnoreCase(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && Lower(s.substr(s.size() - suffix.size())) == suffix;
}

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

constexpr IntLimit kMachineGpusLimit{1024};
constexpr NumberLimit kLinkGbsLimit{1e5};
// A machine that names no links: PCIe Gen5 between its GPUs (~50 GB/s one way, as the pinned
// host copies measure), a 400 Gb/s NIC a GPU between machines, NCCL's few microseconds a call.
constexpr double kDefaultPeerGbs = 50.0;
constexpr double kDefaultNetworkGbs = 50.0;
constexpr double kDefaultPeerLatencyUs = 10.0;
constexpr std::string_view kKernelModelExpected =
    "expected a mapping of the kernel-time model's parameters (source: measured|estimate, "
    "launch_us, gemm_tflops, ...; see models/gpu/h200.yaml)";

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
