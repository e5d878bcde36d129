#include "ctxplan/runtime/io/checkpoint.h"

#include "ctxplan/runtime/plan/plan_geometry.h"

#include <charconv>
#include <set>
#include <string_view>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/io/safetensors.h"
#include "ctxplan/traces/crc32c.h"

namespace ctxplan {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kFormat = "ctxplan-checkpoint";
// Version 2 adds a CRC-32C per tensor and one over the metadata; version 1 still loads.
constexpr std::string_view kVersion = "2";
constexpr std::string_view kVersionWithoutChecksums = "1";
constexpr std::string_view kChecksumPrefix = "crc32c.";
const std::string kMetadataChecksum = "crc32c.__metadata__";
constexpr std::string_view kParamPrefix = "param.";
constexpr std::string_view kMomentPrefixes[] = {"adam_m.", "adam_v."};
constexpr std::string_view kOptionPrefix = "option.";
constexpr std::string_view kLoraPrefixes[] = {"lora.", "lora_adam_m.", "lora_adam_v."};

// The adapters as safetensors tensors, named after `prefix`.
std::vector<SafetensorsTensor> LoraTensors(const LoraWeights& lora, std::string_view prefix) {
  std::vector<SafetensorsTensor> out;
  // ForEachShaped only reads here.
  const_cast<LoraWeights&>(lora).ForEachShaped(
      [&](const std::string& name, const std::array<int64_t, 2>& shape, std::vector<float>& t) {
        out.push_back({std::string(prefix) + name, {shape[0], shape[1]}, t});
      });
  return out;
}

[[noreturn]] void Fail(const fs::path& file, const std::string& what) {
  throw InputError(file.string() + ": " + what);
}

template <typename T>
T ParseInteger(const fs::path& file, const std::map<std::string, std::string>& metadata,
               const std::string& key) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) Fail(file, "checkpoint metadata lacks \"" + key + "\"");
  const std::string& text = it->second;
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty() || value < T{0})
    Fail(file, "checkpoint metadata \"" + key + "\" = " + QuoteName(text) +
                   " is not a non-negative integer");
  return value;
}

uint32_t TensorChecksum(std::span<const float> data) {
  return Crc32c(std::as_bytes(data));
}

// Over every metadata key and value but its own entry, in key order.
uint32_t MetadataChecksum(const std::map<std::string, std::string>& metadata) {
  uint32_t crc = 0;
  for (const auto& [key, value] : metadata) {
    if (key == kMetadataChecksum) continue;
    for (const std::string* text : {&key, &value}) {
      crc = Crc32c(std::as_bytes(std::span(text->data(), text->size())), crc);
      const std::byte separator{0};
      crc = Crc32c(std::span(&separator, 1), crc);
    }
  }
  return crc;
}

}  // namespace

void SaveCheckpoint(const fs::path& path, const ModelSpec& model,
                    const TrainingCheckpoint& checkpoint) {
  CTXPLAN_CHECK(checkpoint.step >= 0, "checkpoint step must be non-negative");
  // A LoRA run's optimizer state is its adapters' moments; the frozen base has none.
  const bool lora = checkpoint.lora.rank > 0;
  const bool base_moments = checkpoint.has_optimizer_state();
  CTXPLAN_CHECK(
      base_moments == (!checkpoint.adam_v.layers.empty() || !checkpoint.adam_v.embedding.empty()),
      "checkpoint has one AdamW moment without the other");
  CTXPLAN_CHECK(!(lora && base_moments), "checkpoint: a LoRA run keeps no base moments");
  CTXPLAN_CHECK((checkpoint.lora_m.rank > 0) == (checkpoint.lora_v.rank > 0),
                "checkpoint has one LoRA moment without the other");
  const bool moments = lora ? checkpoint.lora_m.rank > 0 : base_moments;
  const bool staged = checkpoint.pipeline_stages > 1;
  CTXPLAN_CHECK(
      checkpoint.pipeline_stage >= 0 && checkpoint.pipeline_stage < checkpoint.pipeline_stages,
      "checkpoint of stage " + std::to_string(checkpoint.pipeline_stage) + " of " +
          std::to_string(checkpoint.pipeline_stages));
  std::vector<SafetensorsTensor> tensors =
      HfTensors(model, checkpoint.weights, std::string(kParamPrefix), staged);
  if (base_moments) {
    for (const auto& [prefix, state] : {std::pair{kMomentPrefixes[0], &checkpoint.adam_m},
                                        std::pair{kMomentPrefixes[1], &checkpoint.adam_v}}) {
      std::vector<SafetensorsTensor> more = HfTensors(model, *state, prefix, staged);
      tensors.insert(tensors.end(), std::make_move_iterator(more.begin()),
                     std::make_move_iterator(more.end()));
    }
  }
  std::map<std::string, std::string> metadata = {
      {"format", std::string(kFormat)},
      {"version", std::string(kVersion)},
      {"model", model.name},
      {"step", std::to_string(checkpoint.step)},
      {"seed", std::to_string(checkpoint.seed)},
      {"optimizer_state", moments ? "adamw" : "none"},
  };
  for (const auto& [key, value] : checkpoint.options)
    metadata[std::string(kOptionPrefix) + key] = value;
  if (staged) {
    metadata["pipeline_stage"] = std::to_string(checkpoint.pipeline_stage);
    metadata["pipeline_stages"] = std::to_string(checkpoint.pipeline_stages);
  }
  if (checkpoint.lora.rank > 0) {
    metadata["lora_rank"] = std::to_string(checkpoint.lora.rank);
    for (int i = 0; i < (moments ? 3 : 1); ++i) {
      const LoraWeights& state = i == 0   ? checkpoint.lora
                                 : i == 1 ? checkpoint.lora_m
                                          : checkpoint.lora_v;
      std::vector<SafetensorsTensor> more = LoraTensors(state, kLoraPrefixes[i]);
      tensors.insert(tensors.end(), std::make_move_iterator(more.begin()),
                     std::make_move_iterator(more.end()));
    }
  }
  for (const SafetensorsTensor& t : tensors)
    metadata[std::string(kChecksumPrefix) + t.name] = Crc32cHex(TensorChecksum(t.data));
  metadata[kMetadataChecksum] = Crc32cHex(MetadataChecksum(metadata));
  // WriteSafetensors goes through AtomicFileWriter: "<path>.tmp.<pid>", fsync, rename.
  WriteSafetensors(path, tensors, SafetensorsDtype::kF32, metadata);
}

TrainingCheckpoint LoadCheckpoint(const fs::path& path, const ModelSpec& model) {
  const SafetensorsFile file(path);
  const std::map<std::string, std::string>& metadata = file.metadata();
  auto get = [&](const std::string& key) -> const std::string& {
    const auto it = metadata.find(key);
    if (it == metadata.end())
      Fail(path, "not a ctxplan checkpoint: metadata lacks \"" + key + "\"");
    return it->second;
  };
  if (get("format") != kFormat)
    Fail(path, "not a ctxplan checkpoint: metadata \"format\" is " + QuoteName(get("format")) +
                   ", expected \"" + std::string(kFormat) + "\"");
  const bool checksummed = get("version") == kVersion;
  if (!checksummed && get("version") != kVersionWithoutChecksums)
    Fail(path, "checkpoint version " + QuoteName(get("version")) + " is not supported (accepted: " +
                   std::string(kVersionWithoutChecksums) + ", " + std::string(kVersion) + ")");
  // Before anything is read from it: a flipped bit in the metadata (a step, an option) fails here.
  if (checksummed) {
    const std::string stored = get(kMetadataChecksum);
    const std::string computed = Crc32cHex(MetadataChecksum(metadata));
    if (stored != computed)
      Fail(path, "the checkpoint's metadata fails its CRC-32C (stored " + QuoteName(stored) +
                     ", computed " + computed + "): the file is corrupt");
  }
  const std::string& optimizer_state = get("optimizer_state");
  if (optimizer_state != "adamw" && optimizer_state != "none")
    Fail(path, "checkpoint metadata \"optimizer_state\" = " + QuoteName(optimizer_state) +
                   " (accepted: adamw, none)");
  get("model");  // informational: the shapes below decide whether the checkpoint fits

  TrainingCheckpoint checkpoint;
  checkpoint.step = ParseInteger<int64_t>(path, metadata, "step");
  checkpoint.seed = ParseInteger<uint64_t>(path, metadata, "seed");
  for (const auto& [key, value] : metadata) {
    if (key.starts_with(kOptionPrefix)) {
      checkpoint.options[key.substr(kOptionPrefix.size())] = value;
    } else if (checksummed && key.starts_with(kChecksumPrefix)) {
      // Checked against the tensors below.
    } else if (key != "format" && key != "version" && key != "model" && key != "step" &&
               key != "seed" && key != "optimizer_state" && key != "lora_rank" &&
               key != "pipeline_stage" && key != "pipeline_stages") {
      Fail(path, "unknown checkpoint metadata key " + QuoteName(key));
    }
  }

  const bool moments = optimizer_state == "adamw";
  const bool lora = metadata.count("lora_rank") > 0;
  // Every tensor of the file must be one we read: anything else means a different model or a
  // file we do not understand, and silently dropping it could lose state.
  std::set<std::string, std::less<>> expected;
  // A pipeline stage's file holds that stage's tensors: shaped so, the others left empty.
  const bool staged = metadata.count("pipeline_stages") > 0;
  auto shaped = [&] {
    ModelWeights w = ZeroWeights(model);
    if (!staged) return w;
    KeepStageTensors(w, model, checkpoint.pipeline_stage, checkpoint.pipeline_stages);
    return w;
  };
  if (staged) {
    checkpoint.pipeline_stages = ParseInteger<int32_t>(path, metadata, "pipeline_stages");
    checkpoint.pipeline_stage = ParseInteger<int32_t>(path, metadata, "pipeline_stage");
    if (checkpoint.pipeline_stages < 2 || checkpoint.pipeline_stages > model.num_hidden_layers ||
        checkpoint.pipeline_stage >= checkpoint.pipeline_stages)
      Fail(path, "checkpoint metadata: stage " + std::to_string(checkpoint.pipeline_stage) +
                     " of " + std::to_string(checkpoint.pipeline_stages) +
                     " pipeline stages (accepted: stage 0 to stages - 1, 2 to " +
                     std::to_string(model.num_hidden_layers) + " stages for model " + model.name +
                     ")");
  }
  checkpoint.weights = shaped();
  std::vector<std::pair<std::string_view, ModelWeights*>> parts = {
      {kParamPrefix, &checkpoint.weights}};
  if (moments && !lora) {
    checkpoint.adam_m = shaped();
    checkpoint.adam_v = shaped();
    parts.emplace_back(kMomentPrefixes[0], &checkpoint.adam_m);
    parts.emplace_back(kMomentPrefixes[1], &checkpoint.adam_v);
  }
  for (const auto& [prefix, weights] : parts)
    for (const SafetensorsTensor& t : HfTensors(model, *weights, prefix, staged))
      expected.insert(t.name);
  std::vector<std::pair<std::string_view, LoraWeights*>> lora_parts;
  if (lora) {
    const auto rank = ParseInteger<int64_t>(path, metadata, "lora_rank");
    if (rank < 1 || rank > (int64_t{1} << 20))
      Fail(path, "checkpoint metadata \"lora_rank\" = " + std::to_string(rank) +
                     " is out of range (accepted: 1 to 1048576)");
    checkpoint.lora = ZeroLora(model, rank);
    lora_parts.emplace_back(kLoraPrefixes[0], &checkpoint.lora);
    if (moments) {
      checkpoint.lora_m = ZeroLora(model, rank);
      checkpoint.lora_v = ZeroLora(model, rank);
      lora_parts.emplace_back(kLoraPrefixes[1], &checkpoint.lora_m);
      lora_parts.emplace_back(kLoraPrefixes[2], &checkpoint.lora_v);
    }
    for (const auto& [prefix, state] : lora_parts)
      for (const SafetensorsTensor& t : LoraTensors(*state, prefix)) expected.insert(t.name);
  }
  for (const SafetensorsTensorInfo& info : file.tensors()) {
    if (expected.count(info.name) == 0)
      Fail(path, "unexpected tensor " + QuoteName(info.name) + " in a checkpoint of model " +
                     model.name + " (optimizer_state " + optimizer_state + ")");
    if (info.dtype != "F32")
      Fail(path, "tensor " + QuoteName(info.name) + " is " + info.dtype + "; checkpoints are F32");
  }
  for (const auto& [prefix, weights] : parts) ReadHfTensors(file, model, prefix, *weights, staged);
  for (const auto& part : lora_parts) {
    const std::string prefix(
        part.first);  // a lambda may not capture a structured binding (clang 14)
    part.second->ForEachShaped(
        [&](const std::string& name, const std::array<int64_t, 2>& shape, std::vector<float>& t) {
          file.ReadF32(prefix + name, shape, t);
        });
  }
  if (checksummed) {
    // The tensors as read, laid out as they were written (F32 round trips exactly), against the
    // checksums taken when they were written.
    std::vector<SafetensorsTensor> read;
    for (const auto& [prefix, weights] : parts) {
      std::vector<SafetensorsTensor> more = HfTensors(model, *weights, std::string(prefix), staged);
      read.insert(read.end(), std::make_move_iterator(more.begin()),
                  std::make_move_iterator(more.end()));
    }
    for (const auto& [prefix, state] : lora_parts) {
      std::vector<SafetensorsTensor> more = LoraTensors(*state, prefix);
      read.insert(read.end(), std::make_move_iterator(more.begin()),
                  std::make_move_iterator(more.end()));
    }
    size_t checksums = 0;
    for (const auto& [key, value] : metadata)
      if (key.starts_with(kChecksumPrefix) && key != kMetadataChecksum) ++checksums;
    if (checksums != read.size())
      Fail(path, "the checkpoint has " + std::to_string(checksums) + " tensor checksums for " +
                     std::to_string(read.size()) + " tensors: the file is corrupt");
    for (const SafetensorsTensor& t : read) {
      const std::string& stored = get(std::string(kChecksumPrefix) + t.name);
      const std::string computed = Crc32cHex(TensorChecksum(t.data));
      if (stored != computed)
        Fail(path, "tensor " + QuoteName(t.name) + " fails its CRC-32C (stored " +
                       QuoteName(stored) + ", computed " + computed + "): the file is corrupt");
    }
  }
  return checkpoint;
}

}  // namespace ctxplan
