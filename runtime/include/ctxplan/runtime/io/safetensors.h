// Hugging Face safetensors: read a model's weights (one file, or shards with an index) into
// ModelWeights, and write ModelWeights (or any fp32 tensors) as one safetensors file.
//
// The format: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {"key": "string", ...},
//    "tensor name": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [begin, end]}, ...}
// (offsets relative to the end of the header), then the tensor data, row-major, little-endian.
//
// Everything read from disk is validated before it is used: a missing, truncated or corrupt file,
// a malformed header, an unknown dtype, offsets out of range, overlapping or disagreeing with
// shape x dtype size, a missing tensor, a shape that does not fit the ModelSpec, an unexpected
// tensor: each throws InputError with one line naming the file and the tensor or offset. Gaps
// between tensors' data are allowed (never read); a header is at most 100 MiB.
//
// Memory: tensor data is streamed (pread in bounded blocks) straight into the fp32 destination,
// one shard at a time, so loading never holds a second full copy of the weights. Not mmap: a file
// truncated by someone else while mapped would kill us with SIGBUS instead of an error.
#pragma once

#include "ctxplan/traces/json_reader.h"  // QuoteName

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/bf16.h"
#include "ctxplan/runtime/plan/model_weights.h"

namespace ctxplan {

// The dtypes we convert to and from fp32. Headers may name any standard safetensors dtype (F64,
// I64, U8, ...) for tensors we ignore; reading one of those as fp32 is an InputError.
enum class SafetensorsDtype : uint8_t { kF32, kF16, kBF16 };

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype);  // "F32", "F16", "BF16"

// One tensor of a safetensors header.
struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype;           // as written: "BF16", "F32", "I64", ...
  int64_t element_bytes = 0;   // of `dtype`
  std::vector<int64_t> shape;  // [] is a scalar
  uint64_t begin = 0;          // byte offsets relative to the start of the data section
  uint64_t end = 0;

  int64_t elements() const;  // product of shape (1 for a scalar)
};

// A safetensors file opened for reading: the header is read and validated in full by the
// constructor; tensor data is read on demand. Move-only (owns a file descriptor).
class SafetensorsFile {
 public:
  // Throws InputError if the file cannot be opened or its header is invalid in any way.
  explicit SafetensorsFile(std::filesystem::path path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::filesystem::path& path() const { return path_; }
  // In the order the header lists them.
  const std::vector<SafetensorsTensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsTensorInfo* Find(std::string_view name) const;  // nullptr if absent

  // Reads tensor `name` converted to fp32 into `out`. InputError if the tensor is missing, its
  // dtype is not F32/F16/BF16, its shape is not `expected_shape` (the message gives both), or
  // the read fails. `out.size()` must be the product of `expected_shape` (a caller bug if not).
  void ReadF32(std::string_view name, std::span<const int64_t> expected_shape,
               std::span<float> out) const;
  // The same with whatever shape the file has.
  std::vector<float> ReadF32(std::string_view name) const;

 private:
  void ParseHeader(std::string_view header);

  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t data_start_ = 0;  // absolute offset of the data section
  uint64_t data_size_ = 0;
  std::vector<SafetensorsTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: fp32 data, row-major, of `shape`.
struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> data;
};

// Writes `tensors` in the given order as one safetensors file of `dtype` (F32 or BF16; BF16
// rounds to nearest even), with `metadata` as "__metadata__". Atomic: a temporary file renamed
// over `path` (see AtomicFileWriter), so a failure leaves any previous file intact. InputError if
// the file cannot be written; a duplicate name or data that does not fit its shape is a caller
// bug (InternalError).
void WriteSafetensors(const std::filesystem::path& path,
                      const std::vector<SafetensorsTensor>& tensors, SafetensorsDtype dtype,
                      const std::map<std::string, std::string>& metadata = {});

// --- model weights in Hugging Face (Qwen2 / Llama) names ---------------------------------------

// The unfused Hugging Face tensors of `weights` for `model`, each a view into `weights` (which
// must outlive the result), with every name prefixed by `prefix`:
//   model.embed_tokens.weight [V, d]
//   model.layers.N.input_layernorm.weight [d]
//   model.layers.N.self_attn.{q,k,v}_proj.weight [q_dim|kv_dim, d]   (rows of the fused qkv)
//   model.layers.N.self_attn.{q,k,v}_proj.bias [q_dim|kv_dim]        (with attention_bias)
//   model.layers.N.self_attn.o_proj.weight [d, q_dim]
//   model.layers.N.post_attention_layernorm.weight [d]
//   model.layers.N.mlp.{gate,up}_proj.weight [I, d]                   (rows of the fused gate_up)
//   model.layers.N.mlp.down_proj.weight [d, I]
//   model.norm.weight [d]
//   lm_head.weight [V, d]                                             (absent when tied)
// Weights not sized for `model` are a caller bug (InternalError). `stage_shaped`: `weights` hold
// one pipeline stage's tensors (KeepStageTensors), the others' empty and left out.
std::vector<SafetensorsTensor> HfTensors(const ModelSpec& model, const ModelWeights& weights,
                                         std::string_view prefix = "", bool stage_shaped = false);

// Where a model's weights are: a directory holding model.safetensors.index.json (sharded; the
// index wins) or model.safetensors; a *.json index file; or a single safetensors file.
//
// The result is sized for `model` (fused qkv and gate_up). Tensors of the file that are not
// parameters of `model` are an error, except known Hugging Face extras (rotary_emb.inv_freq
// buffers) and, for a model with tied embeddings, an lm_head.weight equal to the embedding.
ModelWeights LoadSafetensorsWeights(const std::filesystem::path& path, const ModelSpec& model);

// Reads the named tensors of one file into `weights` (sized for `model`), each name prefixed by
// `prefix`; tensors of the file without the prefix are left for the caller to judge. Used by the
// checkpoint reader, which stores several ModelWeights in one file.
void ReadHfTensors(const SafetensorsFile& file, const ModelSpec& model, std::string_view prefix,
                   ModelWeights& weights, bool stage_shaped = false);

// Writes `weights` as one safetensors file with unfused Hugging Face names (F32 or BF16),
// atomically, with "format": "pt" added to `metadata` as transformers expects: the file loads
// with Qwen2ForCausalLM.from_pretrained (checked against transformers 5.17 and safetensors 0.8).
void WriteSafetensorsWeights(const std::filesystem::path& path, const ModelSpec& model,
                             const ModelWeights& weights, SafetensorsDtype dtype,
                             const std::map<std::string, std::string>& metadata = {});

// fp16 -> fp32 as the files store it (bf16 <-> fp32: bf16.h).
float Fp16ToFp32(uint16_t bits);

}  // namespace ctxplan
