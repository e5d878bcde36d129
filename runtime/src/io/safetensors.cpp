#include "ctxplan/runtime/io/safetensors.h"
#include "ctxplan/traces/json_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan {

// Tensor bytes are copied straight into fp32 vectors and written straight from them.
static_assert(std::endian::native == std::endian::little,
              "safetensors I/O assumes a little-endian host");

namespace fs = std::filesystem;

namespace {

// Headers are a few KB per thousand tensors; the reference implementation refuses more than
// 100 MB, and so do we rather than allocate whatever a corrupt length says.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

constexpr size_t kReadBlockBytes = size_t{4} << 20;

[[noreturn]] void Fail(const fs::path& file, const std::string& what) {
  throw InputError(file.string() + ": " + what);
}

}  // namespace

namespace {

std::string Quote(std::string_view text) {
  return QuoteName(text);
}

std::string ShapeString(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// A JSON number that must be a non-negative integer (shape dimensions, offsets).
bool ParseUint64(const JsonValue& value, uint64_t& out) {
  if (value.kind != JsonValue::Kind::kNumber || value.text.empty()) return false;
  uint64_t result = 0;
  for (const char c : value.text) {
    if (c < '0' || c > '9') return false;  // '-', '.', exponent: not a plain non-negative integer
    if (result > (std::numeric_limits<uint64_t>::max() - static_cast<uint64_t>(c - '0')) / 10)
      return false;
    result = result * 10 + static_cast<uint64_t>(c - '0');
  }
  out = result;
  return true;
}

std::string JsonQuote(std::string_view text) {
  std::string out = "\"";
  for (const char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"')
      out += "\\\"";
    else if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// --- file access --------------------------------------------------------------------------------

// Reads exactly `size` bytes at `offset`; false at end of file. Throws on an I/O error.
bool ReadAt(int fd, const fs::path& file, void* data, size_t size, uint64_t offset) {
  char* out = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got =
        ::pread(fd, out, std::min(size, kReadBlockBytes), static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      Fail(file, "read failed at offset " + std::to_string(offset) + ": " + std::strerror(errno));
    }
    if (got == 0) return false;
    out += got;
    size -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return true;
}

// Opens a regular file for reading; returns the descriptor and its size.
std::pair<int, uint64_t> OpenRegular(const fs::path& file, std::string_view what) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Fail(file, "cannot open " + std::string(what) + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    Fail(file, "cannot stat " + std::string(what) + ": " + std::strerror(error));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    Fail(file, std::string(what) + " is not a regular file");
  }
  return {fd, static_cast<uint64_t>(st.st_size)};
}

int64_t DtypeBytes(std::string_view dtype) {
  static constexpr std::pair<std::string_view, int64_t> kDtypes[] = {
      {"F64", 8},  {"F32", 4},     {"F16", 2},     {"BF16", 2},   {"I64", 8}, {"I32", 4},
      {"I16", 2},  {"I8", 1},      {"U64", 8},     {"U32", 4},    {"U16", 2}, {"U8", 1},
      {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}};
  for (const auto& [name, bytes] : kDtypes)
    if (name == dtype) return bytes;
  return 0;
}

// --- Hugging Face names -------------------------------------------------------------------------

// Where one Hugging Face tensor lives in ModelWeights: `count` floats of `tensor` from `offset`.
struct HfSlot {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float>* tensor;
  size_t offset;
};

size_t Product(std::span<const int64_t> shape) {
  size_t n = 1;
  for (const int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

// The slots of `model` in Hugging Face order. The weights must be sized for the model: checked,
// since a slot past the end of a vector would read or write out of bounds.
// `stage_shaped`: `w` holds one pipeline stage's tensors (KeepStageTensors): an empty embedding,
// layer, final norm or LM head is another stage's and has no slot.
std::vector<HfSlot> HfSlots(const ModelSpec& m, ModelWeights& w, std::string_view prefix,
                            bool stage_shaped = false) {
  const int64_t d = m.hidden_size;
  const int64_t q = m.q_dim();
  const int64_t kv = m.kv_dim();
  const int64_t inter = m.intermediate_size;
  const int64_t vocab = m.vocab_size;
  std::vector<HfSlot> slots;
  const std::string p(prefix);
  auto add = [&](std::string name, std::vector<int64_t> shape, std::vector<float>& tensor,
                 size_t offset) {
    slots.push_back({p + std::move(name), std::move(shape), &tensor, offset});
  };
  auto check = [&](const std::vector<float>& tensor, int64_t expected, const std::string& what) {
    CTXPLAN_CHECK(tensor.size() == static_cast<size_t>(expected),
                  "weights tensor " + what + " holds " + std::to_string(tensor.size()) +
                      " floats, model " + m.name + " needs " + std::to_string(expected));
  };
  CTXPLAN_CHECK(w.layers.size() == static_cast<size_t>(m.num_hidden_layers),
                "weights have " + std::to_string(w.layers.size()) + " layers, model " + m.name +
                    " has " + std::to_string(m.num_hidden_layers));
  if (!stage_shaped || !w.embedding.empty()) {
    check(w.embedding, vocab * d, "embedding");
    add("model.embed_tokens.weight", {vocab, d}, w.embedding, 0);
  }
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const std::string lp = "model.layers." + std::to_string(l) + ".";
    LayerWeights& lw = w.layers[l];
    if (stage_shaped && lw.attn_norm.empty() && lw.qkv.empty() && lw.down.empty()) continue;
    check(lw.attn_norm, d, lp + "attn_norm");
    check(lw.qkv, (q + 2 * kv) * d, lp + "qkv");
    check(lw.qkv_bias, m.attention_bias ? q + 2 * kv : 0, lp + "qkv_bias");
    check(lw.o, d * q, lp + "o");
    check(lw.mlp_norm, d, lp + "mlp_norm");
    check(lw.gate_up, 2 * inter * d, lp + "gate_up");
    check(lw.down, d * inter, lp + "down");
    add(lp + "input_layernorm.weight", {d}, lw.attn_norm, 0);
    add(lp + "self_attn.q_proj.weight", {q, d}, lw.qkv, 0);
    add(lp + "self_attn.k_proj.weight", {kv, d}, lw.qkv, static_cast<size_t>(q * d));
    add(lp + "self_attn.v_proj.weight", {kv, d}, lw.qkv, static_cast<size_t>((q + kv) * d));
    if (m.attention_bias) {
      add(lp + "self_attn.q_proj.bias", {q}, lw.qkv_bias, 0);
      add(lp + "self_attn.k_proj.bias", {kv}, lw.qkv_bias, static_cast<size_t>(q));
      add(lp + "self_attn.v_proj.bias", {kv}, lw.qkv_bias, static_cast<size_t>(q + kv));
    }
    add(lp + "self_attn.o_proj.weight", {d, q}, lw.o, 0);
    add(lp + "post_attention_layernorm.weight", {d}, lw.mlp_norm, 0);
    add(lp + "mlp.gate_proj.weight", {inter, d}, lw.gate_up, 0);
    add(lp + "mlp.up_proj.weight", {inter, d}, lw.gate_up, static_cast<size_t>(inter * d));
    add(lp + "mlp.down_proj.weight", {d, inter}, lw.down, 0);
  }
  if (stage_shaped && w.final_norm.empty() && w.lm_head.empty()) return slots;
  check(w.final_norm, d, "final_norm");
  check(w.lm_head, m.tie_word_embeddings ? 0 : vocab * d, "lm_head");
  add("model.norm.weight", {d}, w.final_norm, 0);
  if (!m.tie_word_embeddings) add("lm_head.weight", {vocab, d}, w.lm_head, 0);
  return slots;
}

// Buffers that Hugging Face checkpoints sometimes carry but that are not parameters: they are
// recomputed from the config (rope_theta), so ignoring them loses nothing.
bool IsKnownHfExtra(std::string_view name, const ModelSpec& model) {
  for (const std::string_view suffix :
       {"rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"}) {
    if (name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix)
      return true;
  }
  // transformers re-ties lm_head to the embedding after loading a tied model, ignoring the file's
  // copy; we do the same.
  return model.tie_word_embeddings && name == "lm_head.weight";
}

void CheckTensorExpected(const fs::path& file, std::string_view name,
                         const std::set<std::string, std::less<>>& required,
                         const ModelSpec& model) {
  if (required.count(name) != 0 || IsKnownHfExtra(name, model)) return;
  Fail(file, "unexpected tensor " + Quote(name) + " (not a parameter of model " + model.name +
                 "; of extras only rotary_emb buffers are ignored)");
}

// Resolves a shard name from an index: a plain relative path below the index's directory.
fs::path ShardPath(const fs::path& index, const std::string& tensor, const std::string& shard) {
  const fs::path relative(shard);
  bool ok = !shard.empty() && relative.is_relative();
  for (const fs::path& part : relative)
    if (part == "..") ok = false;
  if (!ok)
    Fail(index, "weight_map[" + Quote(tensor) + "]: shard " + Quote(shard) +
                    " must be a file name relative to the index's directory");
  return index.parent_path() / relative;
}

ModelWeights LoadSharded(const fs::path& index, const ModelSpec& model) {
  const auto [fd, size] = OpenRegular(index, "safetensors index");
  std::string text;
  bool complete = false;
  if (size <= kMaxIndexBytes) {
    text.resize(size);
    complete = ReadAt(fd, index, text.data(), text.size(), 0);
  }
  ::close(fd);
  if (size > kMaxIndexBytes)
    Fail(index, "index of " + std::to_string(size) + " bytes exceeds the " +
                    std::to_string(kMaxIndexBytes >> 20) + " MiB limit");
  if (!complete) Fail(index, "file shrank while being read");
  const JsonValue root =
      JsonParser(text, index.string() + ": malformed index JSON", 0).ParseDocument();
  if (root.kind != JsonValue::Kind::kObject)
    Fail(index, "the index must be a JSON object with a \"weight_map\", found " +
                    std::string(KindName(root.kind)));
  const JsonValue* weight_map = nullptr;
  for (const auto& [key, value] : root.members) {
    if (key == "weight_map")
      weight_map = &value;
    else if (key != "metadata")
      Fail(index, "unknown key " + Quote(key) + " (accepted: \"metadata\", \"weight_map\")");
  }
  if (weight_map == nullptr) Fail(index, "missing key \"weight_map\"");
  if (weight_map->kind != JsonValue::Kind::kObject)
    Fail(index, "\"weight_map\" must be an object of tensor name: shard file, found " +
                    std::string(KindName(weight_map->kind)));

  ModelWeights weights = ZeroWeights(model);
  const std::vector<HfSlot> slots = HfSlots(model, weights, "");
  std::set<std::string, std::less<>> required;
  for (const HfSlot& slot : slots) required.insert(slot.name);

  std::map<std::string, std::string, std::less<>> shard_of;  // tensor -> shard
  std::map<std::string, fs::path> shards;                    // shard name -> path, sorted
  for (const auto& [tensor, shard] : weight_map->members) {
    if (shard.kind != JsonValue::Kind::kString)
      Fail(index, "weight_map[" + Quote(tensor) + "] must be a shard file name, found " +
                      KindName(shard.kind));
    CheckTensorExpected(index, tensor, required, model);
    shard_of[tensor] = shard.text;
    shards.emplace(shard.text, ShardPath(index, tensor, shard.text));
  }
  for (const HfSlot& slot : slots) {
    if (shard_of.count(slot.name) == 0)
      Fail(index, "required tensor " + Quote(slot.name) + " is not in weight_map (model " +
                      model.name + ")");
  }
  // One shard open at a time: its tensors go straight into `weights`.
  for (const auto& [shard, path] : shards) {
    const SafetensorsFile file(path);
    for (const SafetensorsTensorInfo& info : file.tensors())
      CheckTensorExpected(path, info.name, required, model);
    for (const HfSlot& slot : slots) {
      if (shard_of.find(slot.name)->second != shard) continue;
      if (file.Find(slot.name) == nullptr)
        Fail(path, "tensor " + Quote(slot.name) + " is missing, but " + index.filename().string() +
                       " places it in this shard");
      file.ReadF32(slot.name, slot.shape,
                   std::span<float>(slot.tensor->data() + slot.offset, Product(slot.shape)));
    }
  }
  return weights;
}

// Writes `count` fp32 values as `dtype`, converting in bounded blocks.
void WriteData(std::ostream& out, std::span<const float> data, SafetensorsDtype dtype) {
  if (dtype == SafetensorsDtype::kF32) {
    out.write(reinterpret_cast<const char*>(data.data()),
              static_cast<std::streamsize>(data.size() * sizeof(float)));
    return;
  }
  CTXPLAN_CHECK(dtype == SafetensorsDtype::kBF16, "only F32 and BF16 are written");
  std::vector<uint16_t> block(std::min<size_t>(data.size(), size_t{1} << 16));
  for (size_t start = 0; start < data.size(); start += block.size()) {
    const size_t count = std::min(block.size(), data.size() - start);
    for (size_t i = 0; i < count; ++i) block[i] = Fp32ToBf16(data[start + i]);
    out.write(reinterpret_cast<const char*>(block.data()),
              static_cast<std::streamsize>(count * sizeof(uint16_t)));
  }
}

}  // namespace

// --- dtypes -------------------------------------------------------------------------------------

std::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  switch (dtype) {
    case SafetensorsDtype::kF32:
      return "F32";
    case SafetensorsDtype::kF16:
      return "F16";
    case SafetensorsDtype::kBF16:
      return "BF16";
  }
  return "?";
}

float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN (payload kept)
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal half: normalise into fp32's wider exponent range.
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

int64_t SafetensorsTensorInfo::elements() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

// --- reading ------------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(fs::path path) : path_(std::move(path)) {
  uint64_t size = 0;
  std::tie(fd_, size) = OpenRegular(path_, "safetensors file");
  try {
    if (size < 8)
      Fail(path_, "truncated: " + std::to_string(size) +
                      " bytes, but a safetensors file starts with an 8-byte header length");
    unsigned char length_bytes[8];
    if (!ReadAt(fd_, path_, length_bytes, 8, 0)) Fail(path_, "file shrank while being read");
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
    if (header_bytes > size - 8)
      Fail(path_, "header length " + std::to_string(header_bytes) +
                      " at offset 0 runs past the end of the file (" + std::to_string(size) +
                      " bytes; truncated or not a safetensors file)");
    if (header_bytes > kMaxHeaderBytes)
      Fail(path_, "header length " + std::to_string(header_bytes) + " at offset 0 exceeds the " +
                      std::to_string(kMaxHeaderBytes >> 20) + " MiB limit");
    std::string header(header_bytes, '\0');
    if (!ReadAt(fd_, path_, header.data(), header.size(), 8))
      Fail(path_, "file shrank while being read");
    data_start_ = 8 + header_bytes;
    data_size_ = size - data_start_;
    ParseHeader(header);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      data_start_(other.data_start_),
      data_size_(other.data_size_),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    data_start_ = other.data_start_;
    data_size_ = other.data_size_;
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsFile::ParseHeader(std::string_view header) {
  const JsonValue root =
      JsonParser(header, path_.string() + ": malformed safetensors header JSON", 8).ParseDocument();
  if (root.kind != JsonValue::Kind::kObject)
    Fail(path_,
         "the safetensors header must be a JSON object, found " + std::string(KindName(root.kind)));
  auto at = [&](const JsonValue& v) {
    return " (header byte " + std::to_string(8 + v.offset) + ")";
  };
  for (const auto& [name, entry] : root.members) {
    if (name == "__metadata__") {
      if (entry.kind != JsonValue::Kind::kObject)
        Fail(path_, "\"__metadata__\" must be an object of strings" + at(entry));
      for (const auto& [key, value] : entry.members) {
        if (value.kind != JsonValue::Kind::kString)
          Fail(path_, "\"__metadata__\"[" + Quote(key) + "] must be a string, found " +
                          KindName(value.kind) + at(value));
        metadata_[key] = value.text;
      }
      continue;
    }
    const std::string where = "tensor " + Quote(name);
    if (entry.kind != JsonValue::Kind::kObject)
      Fail(path_, where + ": expected an object with dtype, shape and data_offsets" + at(entry));
    const JsonValue* dtype = nullptr;
    const JsonValue* shape = nullptr;
    const JsonValue* offsets = nullptr;
    for (const auto& [key, value] : entry.members) {
      if (key == "dtype")
        dtype = &value;
      else if (key == "shape")
        shape = &value;
      else if (key == "data_offsets")
        offsets = &value;
      else
        Fail(path_, where + ": unknown key " + Quote(key) +
                        " (accepted: dtype, shape, data_offsets)" + at(value));
    }
    if (dtype == nullptr || shape == nullptr || offsets == nullptr)
      Fail(path_, where + ": missing " +
                      (dtype == nullptr   ? "dtype"
                       : shape == nullptr ? "shape"
                                          : "data_offsets") +
                      at(entry));
    SafetensorsTensorInfo info;
    info.name = name;
    if (dtype->kind != JsonValue::Kind::kString)
      Fail(path_, where + ": dtype must be a string" + at(*dtype));
    info.dtype = dtype->text;
    info.element_bytes = DtypeBytes(info.dtype);
    if (info.element_bytes == 0)
      Fail(path_, where + ": unknown dtype " + Quote(info.dtype) +
                      " (accepted: F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, "
                      "BOOL, F8_E4M3, F8_E5M2, F8_E8M0)" +
                      at(*dtype));
    if (shape->kind != JsonValue::Kind::kArray)
      Fail(path_, where + ": shape must be an array of non-negative integers" + at(*shape));
    // Elements times element size must fit in 64 bits, so every product is checked.
    uint64_t bytes = static_cast<uint64_t>(info.element_bytes);
    bool overflow = false;
    for (const JsonValue& dim : shape->items) {
      uint64_t value = 0;
      if (!ParseUint64(dim, value) || value > static_cast<uint64_t>(INT64_MAX))
        Fail(path_, where + ": shape must be an array of non-negative integers" + at(dim));
      overflow = overflow || __builtin_mul_overflow(bytes, value, &bytes);
      info.shape.push_back(static_cast<int64_t>(value));
    }
    if (overflow || bytes > static_cast<uint64_t>(INT64_MAX))
      Fail(path_, where + ": shape " + ShapeString(info.shape) + " is too large" + at(*shape));
    if (offsets->kind != JsonValue::Kind::kArray || offsets->items.size() != 2 ||
        !ParseUint64(offsets->items[0], info.begin) || !ParseUint64(offsets->items[1], info.end))
      Fail(path_,
           where + ": data_offsets must be [begin, end], two non-negative integers" + at(*offsets));
    const std::string range =
        "data_offsets [" + std::to_string(info.begin) + ", " + std::to_string(info.end) + "]";
    if (info.begin > info.end) Fail(path_, where + ": " + range + " end before they begin");
    if (info.end > data_size_)
      Fail(path_, where + ": " + range + " run past the end of the data (" +
                      std::to_string(data_size_) + " bytes after the header; file truncated?)");
    if (info.end - info.begin != bytes)
      Fail(path_, where + ": " + range + " hold " + std::to_string(info.end - info.begin) +
                      " bytes, but shape " + ShapeString(info.shape) + " of " + info.dtype +
                      " needs " + std::to_string(bytes));
    index_.emplace(name, tensors_.size());
    tensors_.push_back(std::move(info));
  }
  // Overlapping tensors would alias each other's bytes: a corrupt (or hostile) file. Gaps are
  // harmless and allowed (the data between is never read).
  std::vector<const SafetensorsTensorInfo*> by_offset;
  for (const SafetensorsTensorInfo& info : tensors_)
    if (info.end > info.begin) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const SafetensorsTensorInfo& a = *by_offset[i - 1];
    const SafetensorsTensorInfo& b = *by_offset[i];
    if (b.begin < a.end)
      Fail(path_, "tensor " + Quote(b.name) + ": data_offsets [" + std::to_string(b.begin) + ", " +
                      std::to_string(b.end) + "] overlap tensor " + Quote(a.name) + " [" +
                      std::to_string(a.begin) + ", " + std::to_string(a.end) + "]");
  }
}

const SafetensorsTensorInfo* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::ReadF32(std::string_view name, std::span<const int64_t> expected_shape,
                              std::span<float> out) const {
  CTXPLAN_CHECK(out.size() == Product(expected_shape),
                "ReadF32 destination does not match the expected shape");
  const SafetensorsTensorInfo* info = Find(name);
  if (info == nullptr) Fail(path_, "tensor " + Quote(name) + " is missing");
  const std::string where = "tensor " + Quote(name);
  if (info->dtype != "F32" && info->dtype != "F16" && info->dtype != "BF16")
    Fail(path_, where + ": dtype " + info->dtype + " cannot be loaded (accepted: BF16, F16, F32)");
  if (!std::equal(info->shape.begin(), info->shape.end(), expected_shape.begin(),
                  expected_shape.end()))
    Fail(path_, where + " has shape " + ShapeString(info->shape) + ", expected " +
                    ShapeString(expected_shape));
  const uint64_t offset = data_start_ + info->begin;
  auto shrank = [&] {
    Fail(path_, where + ": unexpected end of file reading data_offsets [" +
                    std::to_string(info->begin) + ", " + std::to_string(info->end) +
                    "] (file changed while being read?)");
  };
  if (info->dtype == "F32") {
    if (!ReadAt(fd_, path_, out.data(), out.size() * sizeof(float), offset)) shrank();
    return;
  }
  // 16-bit: read a bounded block, widen it into place.
  std::vector<uint16_t> block(std::min<size_t>(out.size(), kReadBlockBytes / 2));
  const bool bf16 = info->dtype == "BF16";
  for (size_t start = 0; start < out.size(); start += block.size()) {
    const size_t count = std::min(block.size(), out.size() - start);
    if (!ReadAt(fd_, path_, block.data(), count * 2, offset + start * 2)) shrank();
    for (size_t i = 0; i < count; ++i)
      out[start + i] = bf16 ? Bf16ToFp32(block[i]) : Fp16ToFp32(block[i]);
  }
}

std::vector<float> SafetensorsFile::ReadF32(std::string_view name) const {
  const SafetensorsTensorInfo* info = Find(name);
  if (info == nullptr) Fail(path_, "tensor " + Quote(name) + " is missing");
  std::vector<float> out(static_cast<size_t>(info->elements()));
  ReadF32(name, info->shape, out);
  return out;
}

// --- writing ------------------------------------------------------------------------------------

void WriteSafetensors(const fs::path& path, const std::vector<SafetensorsTensor>& tensors,
                      SafetensorsDtype dtype, const std::map<std::string, std::string>& metadata) {
  CTXPLAN_CHECK(dtype == SafetensorsDtype::kF32 || dtype == SafetensorsDtype::kBF16,
                "safetensors are written as F32 or BF16");
  const uint64_t element_bytes = dtype == SafetensorsDtype::kF32 ? 4 : 2;
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      header += (first ? "" : ",") + JsonQuote(key) + ":" + JsonQuote(value);
      first = false;
    }
    header += "}";
  }
  std::set<std::string, std::less<>> names;
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    CTXPLAN_CHECK(t.name != "__metadata__" && names.insert(t.name).second,
                  "duplicate or reserved safetensors tensor name " + t.name);
    CTXPLAN_CHECK(t.data.size() == Product(t.shape),
                  "tensor " + t.name + " data does not match shape " + ShapeString(t.shape));
    const uint64_t end = offset + t.data.size() * element_bytes;
    if (header.size() > 1) header += ",";
    header += JsonQuote(t.name) + ":{\"dtype\":\"" + std::string(SafetensorsDtypeName(dtype)) +
              "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i)
      header += (i ? "," : "") + std::to_string(t.shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  header += "}";
  // Pad with spaces (valid JSON whitespace) so the data starts 8-byte aligned, as the reference
  // writer does: readers that map the file can then use the data in place.
  header.append((8 - header.size() % 8) % 8, ' ');

  AtomicFileWriter file(path);
  std::ostream& out = file.stream();
  unsigned char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(header.size() >> (8 * i));
  out.write(reinterpret_cast<const char*>(length), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const SafetensorsTensor& t : tensors) WriteData(out, t.data, dtype);
  file.Commit();
}

// --- model weights ------------------------------------------------------------------------------

std::vector<SafetensorsTensor> HfTensors(const ModelSpec& model, const ModelWeights& weights,
                                         std::string_view prefix, bool stage_shaped) {
  // HfSlots hands out mutable pointers; we only read through them.
  const std::vector<HfSlot> slots =
      HfSlots(model, const_cast<ModelWeights&>(weights), prefix, stage_shaped);
  std::vector<SafetensorsTensor> tensors;
  tensors.reserve(slots.size());
  for (const HfSlot& slot : slots)
    tensors.push_back(
        {slot.name, slot.shape,
         std::span<const float>(slot.tensor->data() + slot.offset, Product(slot.shape))});
  return tensors;
}

void ReadHfTensors(const SafetensorsFile& file, const ModelSpec& model, std::string_view prefix,
                   ModelWeights& weights, bool stage_shaped) {
  for (const HfSlot& slot : HfSlots(model, weights, prefix, stage_shaped)) {
    if (file.Find(slot.name) == nullptr)
      Fail(file.path(),
           "required tensor " + Quote(slot.name) + " is missing (model " + model.name + ")");
    file.ReadF32(slot.name, slot.shape,
                 std::span<float>(slot.tensor->data() + slot.offset, Product(slot.shape)));
  }
}

ModelWeights LoadSafetensorsWeights(const fs::path& path, const ModelSpec& model) {
  std::error_code error;
  if (fs::is_directory(path, error)) {
    const fs::path index = path / "model.safetensors.index.json";
    if (fs::exists(index, error)) return LoadSharded(index, model);
    const fs::path single = path / "model.safetensors";
    if (!fs::exists(single, error))
      Fail(path, "directory holds neither model.safetensors nor model.safetensors.index.json");
    return LoadSafetensorsWeights(single, model);
  }
  if (path.extension() == ".json") return LoadSharded(path, model);

  const SafetensorsFile file(path);
  ModelWeights weights = ZeroWeights(model);
  const std::vector<HfSlot> slots = HfSlots(model, weights, "");
  std::set<std::string, std::less<>> required;
  for (const HfSlot& slot : slots) required.insert(slot.name);
  for (const SafetensorsTensorInfo& info : file.tensors())
    CheckTensorExpected(path, info.name, required, model);
  ReadHfTensors(file, model, "", weights);
  return weights;
}

void WriteSafetensorsWeights(const fs::path& path, const ModelSpec& model,
                             const ModelWeights& weights, SafetensorsDtype dtype,
                             const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");  // what transformers expects of a PyTorch checkpoint
  WriteSafetensors(path, HfTensors(model, weights), dtype, meta);
}

}  // namespace ctxplan
