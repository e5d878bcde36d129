// Training checkpoints: weights, AdamW moments, step, seed and the run's options, in one
// safetensors file, written atomically.
//
// Format (safetensors, all tensors F32 so a resumed run continues bit for bit):
//   "param.<HF name>"   the weights, unfused Hugging Face names (see HfTensors)
//   "adam_m.<HF name>", "adam_v.<HF name>"   AdamW first and second moments, when present
//   "lora.<PEFT name>", "lora_adam_m.<PEFT name>", "lora_adam_v.<PEFT name>"   LoRA runs: the
//                   adapters (A [r][in], B [out][r]) and their moments; metadata lora_rank
//   "__metadata__": format = "ctxplan-checkpoint", version = "2", model = <ModelSpec name>,
//                   step, seed (decimal), optimizer_state = "adamw" | "none",
//                   "option.<key>" = <value> for every run option,
//                   "crc32c.<tensor>" = CRC-32C of each tensor's bytes (8 hex digits), and
//                   "crc32c.__metadata__" over every other key and value: a flipped bit anywhere
//                   that changes what is loaded fails the load. Version 1 (no checksums) loads.
//                   Several GPUs: each rank writes its own file, of its stage's tensors only,
//                   with pipeline_stage and pipeline_stages (absent with one GPU).
// The data stream and initialisation are pure functions of (seed, step) (see StepSeed), so no
// further RNG state is needed to resume exactly.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/lora.h"
#include "ctxplan/runtime/plan/model_weights.h"

namespace ctxplan {

struct TrainingCheckpoint {
  int64_t step = 0;   // optimizer steps completed: a resumed run's next step is `step`
  uint64_t seed = 0;  // the run's seed
  ModelWeights weights;
  // AdamW moments, shaped like `weights`; both empty (default-constructed) without optimizer
  // state (optimizer none, or before the first step).
  ModelWeights adam_m;
  ModelWeights adam_v;
  std::map<std::string, std::string> options;  // the run's options, as the user gave them
  // LoRA runs: the adapters (rank 0: none), and their AdamW moments (rank 0 without).
  LoraWeights lora, lora_m, lora_v;
  // A pipeline stage's checkpoint (several GPUs): `weights` (and moments) hold that stage's
  // tensors only (KeepStageTensors with PipelineStageFirstLayers' split), the others empty.
  int32_t pipeline_stage = 0;
  int32_t pipeline_stages = 1;

  bool has_optimizer_state() const { return !adam_m.layers.empty() || !adam_m.embedding.empty(); }
};

// Writes `checkpoint` to `path` via "<path>.tmp.<pid>" renamed over it, so a crash or a failed
// write (no space, no permission) leaves any previous checkpoint at `path` intact. InputError if
// it cannot be written; tensors not sized for `model` are a caller bug (InternalError).
void SaveCheckpoint(const std::filesystem::path& path, const ModelSpec& model,
                    const TrainingCheckpoint& checkpoint);

// Reads a checkpoint written by SaveCheckpoint for `model`, validating everything: the file (see
// SafetensorsFile), the format and version, step and seed, every tensor present with the shape
// `model` gives it, no tensor that is not part of the checkpoint. InputError, one line naming the
// file and the key or tensor.
TrainingCheckpoint LoadCheckpoint(const std::filesystem::path& path, const ModelSpec& model);

}  // namespace ctxplan
