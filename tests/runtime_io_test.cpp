// Runtime I/O: Hugging Face safetensors weights (single file and sharded, BF16/F16/F32, every
// validation error), token data files, the synthetic retrieval task, and training checkpoints
// (round trip, atomic save, corrupt files).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/io/checkpoint.h"
#include "ctxplan/runtime/io/safetensors.h"
#include "ctxplan/runtime/io/token_data.h"
#include "ctxplan/runtime/plan/model_weights.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/traces/crc32c.h"

namespace ctxplan {
namespace {

namespace fs = std::filesystem;

// --- helpers ------------------------------------------------------------------------------------

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ctxplan_runtime_io_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    model_ = LoadModel("tiny");
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ignored);
    fs::remove_all(dir_, ignored);
  }

  static std::string Bytes(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  static void Write(const fs::path& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
  }

  fs::path dir_;
  ModelSpec model_;
};

// Runs `f`, expects an InputError whose message is one line containing every needle.
void ExpectInputError(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    for (const std::string& needle : needles)
      EXPECT_NE(message.find(needle), std::string::npos)
          << "message lacks '" << needle << "': " << message;
    return;
  }
  ADD_FAILURE() << "no InputError";
}

// A safetensors file from its header text and data, byte for byte.
std::string RawSafetensors(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

// A tensor in any dtype, with its raw bytes, for hand-built files.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string BuildSafetensors(const std::vector<RawTensor>& tensors) {
  std::string header = "{";
  std::string data;
  for (const RawTensor& t : tensors) {
    if (header.size() > 1) header += ",";
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i > 0) header += ",";
      header += std::to_string(t.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
              std::to_string(data.size() + t.bytes.size()) + "]}";
    data += t.bytes;
  }
  return RawSafetensors(header + "}", data);
}

template <typename T>
std::string AsBytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// The model's tensors as hand-built raw tensors, each converted to `dtype_of(name)`.
std::vector<RawTensor> RawModelTensors(
    const ModelSpec& model, const ModelWeights& weights,
    const std::function<std::string(const std::string&)>& dtype_of) {
  std::vector<RawTensor> out;
  for (const SafetensorsTensor& t : HfTensors(model, weights)) {
    const std::string dtype = dtype_of(t.name);
    RawTensor raw{t.name, dtype, t.shape, ""};
    if (dtype == "F32") {
      raw.bytes = AsBytes(std::vector<float>(t.data.begin(), t.data.end()));
    } else if (dtype == "BF16") {
      std::vector<uint16_t> bits;
      for (const float x : t.data) bits.push_back(Fp32ToBf16(x));
      raw.bytes = AsBytes(bits);
    } else {
      ADD_FAILURE() << "unsupported test dtype " << dtype;
    }
    out.push_back(std::move(raw));
  }
  return out;
}

// Every tensor of a and b, in ForEach order, compared by `check(name, a, b)`.
void CompareWeights(ModelWeights a, ModelWeights b,
                    const std::function<void(const std::string&, float, float)>& check) {
  std::vector<std::pair<std::string, std::vector<float>>> left;
  a.ForEach([&](const std::string& name, std::vector<float>& t) { left.emplace_back(name, t); });
  size_t i = 0;
  b.ForEach([&](const std::string& name, std::vector<float>& t) {
    ASSERT_LT(i, left.size());
    EXPECT_EQ(left[i].first, name);
    ASSERT_EQ(left[i].second.size(), t.size()) << name;
    for (size_t j = 0; j < t.size(); ++j) check(name, left[i].second[j], t[j]);
    ++i;
  });
  EXPECT_EQ(i, left.size());
}

void ExpectExactlyEqual(const ModelWeights& a, const ModelWeights& b) {
  int mismatches = 0;
  CompareWeights(a, b, [&](const std::string& name, float x, float y) {
    if (std::memcmp(&x, &y, sizeof(float)) != 0 && ++mismatches < 5)
      ADD_FAILURE() << name << ": " << x << " != " << y;
  });
}

// --- conversions --------------------------------------------------------------------------------

TEST(DtypeTest, Bf16ConversionRoundsToNearestEven) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Fp32ToBf16(-3.0f), 0xc040);
  EXPECT_EQ(Bf16ToFp32(0x3f80), 1.0f);
  // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(Fp32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 lies between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up to even.
  EXPECT_EQ(Fp32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(Fp32ToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(Bf16ToFp32(Fp32ToBf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  // Every bf16 value survives fp32 and back.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float x = Bf16ToFp32(static_cast<uint16_t>(bits));
    if (!std::isnan(x)) {
      EXPECT_EQ(Fp32ToBf16(x), bits);
    }
  }
}

TEST(DtypeTest, Fp16Conversion) {
  EXPECT_EQ(Fp16ToFp32(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFp32(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFp32(0x7bff), 65504.0f);
  EXPECT_EQ(Fp16ToFp32(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(Fp16ToFp32(0x03ff), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(Fp16ToFp32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(Fp16ToFp32(0x3555), 0.333251953125f);
  EXPECT_EQ(Fp16ToFp32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Fp16ToFp32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Fp16ToFp32(0x7e00)));
  EXPECT_TRUE(std::signbit(Fp16ToFp32(0x8000)));
}

// --- safetensors: round trips -------------------------------------------------------------------

class SafetensorsTest : public IoTest {};

TEST_F(SafetensorsTest, F32RoundTripIsExact) {
  const ModelWeights weights = RandomWeights(model_, 7);
  const fs::path file = dir_ / "model.safetensors";
  WriteSafetensorsWeights(file, model_, weights, SafetensorsDtype::kF32, {{"note", "tiny"}});
  ExpectExactlyEqual(weights, LoadSafetensorsWeights(file, model_));
  ExpectExactlyEqual(weights, LoadSafetensorsWeights(dir_, model_));  // a directory works too
  EXPECT_FALSE(fs::exists(dir_ / ("model.safetensors.tmp." + std::to_string(::getpid()))));

  // The file is standard: unfused HF names, data 8-byte aligned, metadata kept.
  const SafetensorsFile st(file);
  EXPECT_EQ(st.metadata().at("note"), "tiny");
  EXPECT_EQ(st.metadata().at("format"), "pt");
  ASSERT_NE(st.Find("model.layers.1.self_attn.k_proj.weight"), nullptr);
  EXPECT_EQ(st.Find("model.layers.1.self_attn.k_proj.weight")->shape,
            (std::vector<int64_t>{model_.kv_dim(), model_.hidden_size}));
  EXPECT_EQ(st.Find("model.layers.0.mlp.up_proj.weight")->dtype, "F32");
  EXPECT_EQ(st.Find("model.layers.1.self_attn.qkv_proj.weight"), nullptr);
  const std::string bytes = Bytes(file);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  EXPECT_EQ(header % 8, 0u);
  // The K rows of the fused qkv are the k_proj tensor.
  const std::vector<float> k = st.ReadF32("model.layers.1.self_attn.k_proj.weight");
  const size_t q_elems = static_cast<size_t>(model_.q_dim() * model_.hidden_size);
  EXPECT_TRUE(std::equal(k.begin(), k.end(), weights.layers[1].qkv.begin() + q_elems));
}

TEST_F(SafetensorsTest, Bf16RoundTripWithinRounding) {
  const ModelWeights weights = RandomWeights(model_, 8);
  const fs::path file = dir_ / "model.safetensors";
  WriteSafetensorsWeights(file, model_, weights, SafetensorsDtype::kBF16);
  EXPECT_EQ(SafetensorsFile(file).Find("model.embed_tokens.weight")->dtype, "BF16");
  CompareWeights(weights, LoadSafetensorsWeights(file, model_),
                 [](const std::string& name, float x, float y) {
                   // bf16 keeps 8 significant bits: rounding errs by at most half an ulp,
                   // 2^-8 relative.
                   ASSERT_LE(std::fabs(x - y), std::fabs(x) * std::ldexp(1.0f, -8)) << name;
                   ASSERT_EQ(y, Bf16ToFp32(Fp32ToBf16(x))) << name;
                 });
}

TEST_F(SafetensorsTest, MixedDtypesConvertToFp32) {
  const ModelWeights weights = RandomWeights(model_, 9);
  // Norms in F32, everything else in BF16 (as some exports do), plus one F16 tensor.
  std::vector<RawTensor> raw = RawModelTensors(model_, weights, [](const std::string& name) {
    return name.find("norm") != std::string::npos ? "F32" : "BF16";
  });
  std::vector<float> expected_norm(static_cast<size_t>(model_.hidden_size));
  std::vector<uint16_t> half(expected_norm.size());
  for (size_t i = 0; i < half.size(); ++i) {
    half[i] = static_cast<uint16_t>(0x3c00 + i);  // 1.0, 1.000977, ...
    expected_norm[i] = 1.0f + static_cast<float>(i) * std::ldexp(1.0f, -10);
  }
  for (RawTensor& t : raw)
    if (t.name == "model.norm.weight") t = {t.name, "F16", t.shape, AsBytes(half)};
  Write(dir_ / "model.safetensors", BuildSafetensors(raw));
  const ModelWeights loaded = LoadSafetensorsWeights(dir_ / "model.safetensors", model_);
  EXPECT_EQ(loaded.final_norm, expected_norm);
  EXPECT_EQ(loaded.layers[0].attn_norm, weights.layers[0].attn_norm);  // F32: exact
  EXPECT_EQ(loaded.embedding[5], Bf16ToFp32(Fp32ToBf16(weights.embedding[5])));
}

TEST_F(SafetensorsTest, TiedAndBiasFreeModels) {
  ModelSpec llama = model_;
  llama.tie_word_embeddings = true;
  llama.attention_bias = false;
  const ModelWeights weights = RandomWeights(llama, 10);
  EXPECT_TRUE(weights.lm_head.empty());
  const fs::path file = dir_ / "model.safetensors";
  WriteSafetensorsWeights(file, llama, weights, SafetensorsDtype::kF32);
  EXPECT_EQ(SafetensorsFile(file).Find("lm_head.weight"), nullptr);
  EXPECT_EQ(SafetensorsFile(file).Find("model.layers.0.self_attn.q_proj.bias"), nullptr);
  ExpectExactlyEqual(weights, LoadSafetensorsWeights(file, llama));

  // A tied model's file may still carry lm_head.weight: ignored, as transformers does. Loading
  // the same file untied needs it, and the biases too.
  const ModelWeights untied = RandomWeights(model_, 11);
  WriteSafetensorsWeights(file, model_, untied, SafetensorsDtype::kF32);
  ExpectInputError([&] { LoadSafetensorsWeights(file, llama); },
                   {file.string(), "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"});
}

TEST_F(SafetensorsTest, KnownExtrasAreIgnored) {
  const ModelWeights weights = RandomWeights(model_, 12);
  std::vector<RawTensor> raw =
      RawModelTensors(model_, weights, [](const std::string&) { return "F32"; });
  raw.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq",
                 "F32",
                 {8},
                 AsBytes(std::vector<float>(8, 0.5f))});
  raw.push_back({"model.rotary_emb.inv_freq", "F64", {8}, AsBytes(std::vector<double>(8, 0.5))});
  const fs::path file = dir_ / "model.safetensors";
  Write(file, BuildSafetensors(raw));
  ExpectExactlyEqual(weights, LoadSafetensorsWeights(file, model_));

  ModelSpec tied = model_;
  tied.tie_word_embeddings = true;  // the file's lm_head.weight is then an ignored extra
  const ModelWeights loaded = LoadSafetensorsWeights(file, tied);
  EXPECT_TRUE(loaded.lm_head.empty());
  EXPECT_EQ(loaded.embedding, weights.embedding);
}

TEST_F(SafetensorsTest, ShardedWithIndex) {
  const ModelWeights weights = RandomWeights(model_, 13);
  const std::vector<SafetensorsTensor> tensors = HfTensors(model_, weights);
  const size_t half = tensors.size() / 2;
  const std::vector<SafetensorsTensor> first(tensors.begin(), tensors.begin() + half);
  const std::vector<SafetensorsTensor> second(tensors.begin() + half, tensors.end());
  const std::string shard1 = "model-00001-of-00002.safetensors";
  const std::string shard2 = "model-00002-of-00002.safetensors";
  WriteSafetensors(dir_ / shard1, first, SafetensorsDtype::kF32);
  WriteSafetensors(dir_ / shard2, second, SafetensorsDtype::kBF16);
  std::string index = "{\n  \"metadata\": {\"total_size\": 123456},\n  \"weight_map\": {\n";
  for (size_t i = 0; i < tensors.size(); ++i)
    index += "    \"" + tensors[i].name + "\": \"" + (i < half ? shard1 : shard2) + "\"" +
             (i + 1 < tensors.size() ? ",\n" : "\n");
  index += "  }\n}\n";
  Write(dir_ / "model.safetensors.index.json", index);

  const ModelWeights loaded = LoadSafetensorsWeights(dir_, model_);
  EXPECT_EQ(loaded.embedding, weights.embedding);  // first shard, F32: exact
  CompareWeights(weights, loaded, [](const std::string& name, float x, float y) {
    ASSERT_LE(std::fabs(x - y), std::fabs(x) * std::ldexp(1.0f, -8)) << name;
  });
  ExpectExactlyEqual(loaded, LoadSafetensorsWeights(dir_ / "model.safetensors.index.json", model_));
  // The index wins over a model.safetensors beside it.
  WriteSafetensorsWeights(dir_ / "model.safetensors", model_, RandomWeights(model_, 99),
                          SafetensorsDtype::kF32);
  ExpectExactlyEqual(loaded, LoadSafetensorsWeights(dir_, model_));

  // Validation of the index and its shards.
  const fs::path index_path = dir_ / "model.safetensors.index.json";
  const std::string last = tensors.back().name;  // lm_head.weight, in shard 2
  auto with_index = [&](const std::string& text) { Write(index_path, text); };
  with_index("{\"weight_map\": {}}");
  ExpectInputError(
      [&] { LoadSafetensorsWeights(dir_, model_); },
      {index_path.string(), "required tensor 'model.embed_tokens.weight'", "weight_map"});
  with_index("{\"metadata\": {}}");
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {index_path.string(), "missing key \"weight_map\""});
  with_index("{\"weight_map\": {\"a\": \"x\",}}");
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {index_path.string(), "malformed index JSON", "byte 25"});
  std::string bad = index;
  bad.replace(bad.find("\"weight_map\": {") + 15, 0, "\"model.layers.0.foo\": \"" + shard1 + "\",");
  with_index(bad);
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {index_path.string(), "unexpected tensor 'model.layers.0.foo'"});
  bad = index;
  bad.replace(bad.rfind(shard2), shard2.size(), "../" + shard2);
  with_index(bad);
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {index_path.string(), "weight_map['" + last + "']", "relative"});
  bad = index;
  bad.replace(bad.rfind(shard2), shard2.size(), "missing.safetensors");
  with_index(bad);
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {(dir_ / "missing.safetensors").string(), "cannot open"});
  bad = index;  // the index places lm_head in shard 1, which lacks it
  bad.replace(bad.rfind(shard2), shard2.size(), shard1);
  with_index(bad);
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {(dir_ / shard1).string(), "tensor '" + last + "' is missing"});
  with_index(index);
  const std::string shard2_bytes = Bytes(dir_ / shard2);
  Write(dir_ / shard2, shard2_bytes.substr(0, shard2_bytes.size() - 10));  // a truncated shard
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {(dir_ / shard2).string(), "run past the end"});
}

// --- safetensors: validation --------------------------------------------------------------------

TEST_F(SafetensorsTest, MissingAndTruncatedFiles) {
  const fs::path missing = dir_ / "nope.safetensors";
  ExpectInputError([&] { LoadSafetensorsWeights(missing, model_); },
                   {missing.string(), "cannot open", "No such file"});
  ExpectInputError([&] { LoadSafetensorsWeights(dir_, model_); },
                   {dir_.string(), "neither model.safetensors nor"});
  const fs::path file = dir_ / "model.safetensors";
  Write(file, "abc");
  ExpectInputError([&] { LoadSafetensorsWeights(file, model_); },
                   {file.string(), "truncated: 3 bytes"});
  Write(file, std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10));
  ExpectInputError([&] { LoadSafetensorsWeights(file, model_); },
                   {file.string(), "header length 255 at offset 0 runs past the end"});
  Write(file, std::string(8, '\xff'));
  ExpectInputError([&] { SafetensorsFile{file}; }, {file.string(), "header length"});

  // A valid file cut anywhere is an error naming the file, never a crash.
  WriteSafetensorsWeights(file, model_, RandomWeights(model_, 1), SafetensorsDtype::kBF16);
  const std::string whole = Bytes(file);
  for (const size_t cut :
       {size_t{0}, size_t{7}, size_t{8}, size_t{100}, whole.size() / 2, whole.size() - 1}) {
    Write(file, whole.substr(0, cut));
    ExpectInputError([&] { LoadSafetensorsWeights(file, model_); }, {file.string()});
  }
  Write(file, whole.substr(0, whole.size() - 1));
  ExpectInputError(
      [&] { LoadSafetensorsWeights(file, model_); },
      {file.string(), "tensor 'lm_head.weight'", "run past the end of the data", "truncated"});
}

TEST_F(SafetensorsTest, MalformedHeaders) {
  const fs::path file = dir_ / "x.safetensors";
  struct Case {
    std::string header;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"", "malformed safetensors header JSON at byte 8: expected a value"},
      {"{", "at byte 9"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}",
       "expected a string key"},
      {"{\"a\" {}}", "expected ':'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x", "unexpected 'x'"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{}}",
       "duplicate key 'a'"},
      {"{\"a\\q\":{}}", "invalid escape"},
      {"{\"a\":[01]}", "leading zero"},
      {"{\"a\nb\":{}}", "control character"},
      {"{\"\\ud800\":{}}", "surrogate"},
      {"{\"\xff\":{}}", "invalid UTF-8"},
      {"[1, 2]", "must be a JSON object, found an array"},
      {std::string(1000, '[') + std::string(1000, ']'), "nesting deeper than"},
      {"{\"a\":tru}", "expected a value"},
      {"{\"a\":[" +
           [] {
             std::string zeros;
             for (int i = 0; i < 3000000; ++i) zeros += "0,";
             return zeros;
           }() +
           "0]}",
       "more than 2097152 JSON values"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", "tensor 'a': missing data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}",
       "tensor 'a': unknown key 'x'"},
      {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,4]}}",
       "tensor 'a': unknown dtype 'Q4'"},
      {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", "dtype must be a string"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
       "shape must be an array of non-negative integers"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
       "shape must be an array"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}",
       "too large"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", "data_offsets must be"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", "end before"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
       "tensor 'a': data_offsets [8, 12] run past the end of the data (8 bytes"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
       "tensor 'a': data_offsets [0, 8] hold 8 bytes, but shape [3] of F32 needs 12"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[4,8]}}",
       "tensor 'b': data_offsets [4, 8] overlap tensor 'a' [0, 8]"},
      {"{\"__metadata__\":{\"k\":1}}", "\"__metadata__\"['k'] must be a string"},
      {"{\"__metadata__\":[]}", "\"__metadata__\" must be an object"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.header.substr(0, 80));
    Write(file, RawSafetensors(c.header, std::string(8, '\0')));
    ExpectInputError([&] { SafetensorsFile{file}; }, {file.string(), c.needle});
  }
  // Valid corner cases: padding, escapes, empty metadata, a scalar, a zero-size tensor.
  Write(file, RawSafetensors("{\"__metadata__\":{},\"s\\u00e9\\n\":{\"dtype\":\"F32\",\"shape\":[],"
                             "\"data_offsets\":[0,4]},\"z\":{\"dtype\":\"BF16\",\"shape\":[0,3],"
                             "\"data_offsets\":[4,4]}}   ",
                             AsBytes(std::vector<float>{2.5f})));
  const SafetensorsFile st(file);
  ASSERT_EQ(st.tensors().size(), 2u);
  EXPECT_EQ(st.ReadF32("s\xc3\xa9\n"), std::vector<float>{2.5f});
  EXPECT_TRUE(st.ReadF32("z").empty());
}

TEST_F(SafetensorsTest, ModelLevelErrors) {
  const ModelWeights weights = RandomWeights(model_, 14);
  const fs::path file = dir_ / "model.safetensors";
  std::vector<SafetensorsTensor> tensors = HfTensors(model_, weights);

  // A required tensor missing.
  std::vector<SafetensorsTensor> fewer = tensors;
  fewer.erase(fewer.begin() + 5);
  WriteSafetensors(file, fewer, SafetensorsDtype::kF32);
  ExpectInputError([&] { LoadSafetensorsWeights(file, model_); },
                   {file.string(), "required tensor '" + tensors[5].name + "' is missing"});

  // A shape that does not fit the model: both shapes named.
  std::vector<SafetensorsTensor> reshaped = tensors;
  for (SafetensorsTensor& t : reshaped) {
    if (t.name == "model.layers.1.self_attn.k_proj.weight") {
      t.shape = {model_.hidden_size, model_.kv_dim()};
    }
  }
  WriteSafetensors(file, reshaped, SafetensorsDtype::kF32);
  ExpectInputError([&] { LoadSafetensorsWeights(file, model_); },
                   {file.string(), "tensor 'model.layers.1.self_attn.k_proj.weight'",
                    "has shape [64, 32], expected [32, 64]"});

  // A model of another size: the file's embedding is too small.
  ModelSpec bigger = model_;
  bigger.vocab_size = 512;
  WriteSafetensorsWeights(file, model_, weights, SafetensorsDtype::kF32);
  ExpectInputError([&] { LoadSafetensorsWeights(file, bigger); },
                   {file.string(),
                    "tensor 'model.embed_tokens.weight' has shape [256, 64], "
                    "expected [512, 64]"});
  ModelSpec shallower = model_;
  shallower.num_hidden_layers = 1;
  ExpectInputError([&] { LoadSafetensorsWeights(file, shallower); },
                   {file.string(), "unexpected tensor 'model.layers.1.", "not a parameter"});

  // An unknown extra tensor (with a newline in its name: the message stays one line).
  std::vector<SafetensorsTensor> extra = tensors;
  const std::vector<float> junk(4, 1.0f);
  extra.push_back({"model.layers.0.mlp.gate_proj.lora_A\nweight", {4}, junk});
  WriteSafetensors(file, extra, SafetensorsDtype::kF32);
  ExpectInputError([&] { LoadSafetensorsWeights(file, model_); },
                   {file.string(), "unexpected tensor 'model.layers.0.mlp.gate_proj.lora_A\\x0a"});

  // A known dtype we cannot convert, on a required tensor.
  std::vector<RawTensor> raw =
      RawModelTensors(model_, weights, [](const std::string&) { return "F32"; });
  raw[0].dtype = "I32";
  Write(file, BuildSafetensors(raw));
  ExpectInputError([&] { LoadSafetensorsWeights(file, model_); },
                   {file.string(), "tensor 'model.embed_tokens.weight': dtype I32 cannot be loaded",
                    "BF16, F16, F32"});
}

TEST_F(SafetensorsTest, RandomCorruptionNeverCrashes) {
  const fs::path file = dir_ / "model.safetensors";
  WriteSafetensorsWeights(file, model_, RandomWeights(model_, 15), SafetensorsDtype::kBF16);
  const std::string whole = Bytes(file);
  uint64_t header = 0;
  std::memcpy(&header, whole.data(), 8);
  std::mt19937_64 rng(1);
  int errors = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = whole;
    // Corrupt the length and header, where structure lives; data bytes are any bf16 value.
    for (int k = 0; k < 1 + trial % 3; ++k) {
      const size_t at = rng() % (8 + header);
      bytes[at] = static_cast<char>(rng() & 0xff);
    }
    Write(file, bytes);
    try {
      LoadSafetensorsWeights(file, model_);
    } catch (const InputError& e) {
      ++errors;
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(errors, 100);
}

// --- token data ---------------------------------------------------------------------------------

class TokenDataTest : public IoTest {};

TEST_F(TokenDataTest, RoundTripAndWindows) {
  const std::vector<int32_t> ids = RandomTokens(256, 1000, 3);
  const fs::path file = dir_ / "data.bin";
  WriteTokenFile(file, ids);
  EXPECT_EQ(fs::file_size(file), 4000u);
  const std::string bytes = Bytes(file);
  EXPECT_EQ(static_cast<uint8_t>(bytes[0]), static_cast<uint32_t>(ids[0]) & 0xff);  // little-endian
  const TokenFile data(file, 256);
  EXPECT_EQ(data.size(), 1000);
  EXPECT_EQ(data.Read(0, 1000), ids);

  // n = 100: (1000 - 1) / 100 = 9 windows of 101 tokens, window w starting at 100 w.
  for (const int64_t step : {0, 1, 8, 9, 20}) {
    const TokenSequence s = data.Window(step, 100);
    const int64_t start = (step % 9) * 100;
    ASSERT_EQ(s.tokens.size(), 100u);
    ASSERT_EQ(s.labels.size(), 100u);
    for (int64_t i = 0; i < 100; ++i) {
      EXPECT_EQ(s.tokens[i], ids[start + i]);
      EXPECT_EQ(s.labels[i], ids[start + i + 1]);  // labels are the next token
    }
  }
  // Exactly n + 1 tokens: one window, every step.
  const TokenSequence whole = data.Window(5, 999);
  EXPECT_EQ(whole.tokens.front(), ids[0]);
  EXPECT_EQ(whole.labels.back(), ids[999]);
  // A vocabulary of exactly max id + 1 is accepted.
  const int32_t max_id = *std::max_element(ids.begin(), ids.end());
  EXPECT_NO_THROW(TokenFile(file, max_id + 1));
}

TEST_F(TokenDataTest, Errors) {
  const fs::path file = dir_ / "data.bin";
  ExpectInputError([&] { TokenFile(file, 256); }, {file.string(), "cannot open"});
  Write(file, std::string(10, '\0'));
  ExpectInputError([&] { TokenFile(file, 256); },
                   {file.string(), "size 10 bytes is not a multiple of 4"});
  std::vector<int32_t> ids(20, 7);
  ids[5] = 256;
  WriteTokenFile(file, ids);
  ExpectInputError([&] { TokenFile(file, 256); },
                   {file.string(), "token id 256 at byte offset 20", "vocabulary size 256"});
  EXPECT_NO_THROW(TokenFile(file, 257));
  const TokenFile data(file, 257);
  ExpectInputError([&] { data.Window(0, 20); },
                   {"data file " + file.string() + " holds 20 tokens; a context of 20 needs 21"});
  EXPECT_NO_THROW(data.Window(0, 19));
  WriteTokenFile(file, {});
  ExpectInputError([&] { TokenFile(file, 256).Window(0, 1); }, {"holds 0 tokens"});
  ExpectInputError([&] { TokenFile(dir_, 256); }, {dir_.string(), "not a regular file"});
}

TEST(SyntheticTest, RandomTokensDeterministicAndInRange) {
  const std::vector<int32_t> a = RandomTokens(100, 10000, 42);
  EXPECT_EQ(a, RandomTokens(100, 10000, 42));
  EXPECT_NE(a, RandomTokens(100, 10000, 43));
  std::vector<int> counts(100, 0);
  for (const int32_t t : a) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, 100);
    ++counts[t];
  }
  for (const int c : counts) EXPECT_GT(c, 50);  // ~100 each
  // Pinned values: a seed means the same data on every platform and standard library.
  EXPECT_EQ(RandomTokens(1000, 3, 0), RandomTokens(1000, 3, 0));
  EXPECT_NE(StepSeed(1, 0), StepSeed(1, 1));
  EXPECT_NE(StepSeed(1, 0), StepSeed(2, 0));
}

TEST(SyntheticTest, RetrievalPlacementAndLabels) {
  for (const int64_t vocab : {4, 256, 151936}) {
    for (const int64_t n : {4, 19, 20, 100, 1000, 4096}) {
      for (uint64_t seed = 0; seed < 20; ++seed) {
        SCOPED_TRACE("vocab " + std::to_string(vocab) + " n " + std::to_string(n) + " seed " +
                     std::to_string(seed));
        const RetrievalSample s = SyntheticRetrieval(vocab, n, seed);
        const int64_t fillers = vocab / 2;
        const int64_t keys = (vocab - fillers) / 2;
        ASSERT_EQ(s.tokens.size(), static_cast<size_t>(n));
        ASSERT_EQ(s.labels.size(), static_cast<size_t>(n));
        EXPECT_GE(s.key, fillers);
        EXPECT_LT(s.key, fillers + keys);
        EXPECT_GE(s.value, fillers + keys);
        EXPECT_LT(s.value, vocab);
        EXPECT_GE(s.key_position, 0);
        EXPECT_LT(s.key_position, std::max<int64_t>(1, n / 20));  // the first 5%
        EXPECT_EQ(s.query_position, n - 1);
        EXPECT_EQ(s.tokens[s.key_position], s.key);
        EXPECT_EQ(s.tokens[s.key_position + 1], s.value);
        EXPECT_EQ(s.tokens[n - 1], s.key);
        for (int64_t i = 0; i < n; ++i) {
          if (i != s.key_position && i != s.key_position + 1 && i != n - 1) {
            EXPECT_GE(s.tokens[i], 0);
            EXPECT_LT(s.tokens[i], fillers);  // the key and value occur nowhere else
          }
          EXPECT_EQ(s.labels[i], i == n - 1 ? s.value : -1);
        }
      }
    }
  }
}

TEST(SyntheticTest, RetrievalDeterministicByTheSeed) {
  const RetrievalSample a = SyntheticRetrieval(256, 2000, 5);
  const RetrievalSample b = SyntheticRetrieval(256, 2000, 5);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.key_position, b.key_position);
  std::set<std::pair<int32_t, int32_t>> pairs;
  for (uint64_t seed = 0; seed < 50; ++seed) {
    const RetrievalSample s = SyntheticRetrieval(256, 2000, seed);
    pairs.insert({s.key, s.value});
  }
  EXPECT_GT(pairs.size(), 40u);  // seeds give different tasks
  // With label_filler the tokens are the same; labels become the next token, query unchanged.
  const RetrievalSample f = SyntheticRetrieval(256, 2000, 5, /*label_filler=*/true);
  EXPECT_EQ(f.tokens, a.tokens);
  for (size_t i = 0; i + 1 < f.tokens.size(); ++i) EXPECT_EQ(f.labels[i], f.tokens[i + 1]);
  EXPECT_EQ(f.labels.back(), a.value);
  ExpectInputError([] { SyntheticRetrieval(3, 100, 0); }, {"vocab 3"});
  ExpectInputError([] { SyntheticRetrieval(256, 3, 0); }, {"context 3"});
}

// --- checkpoints --------------------------------------------------------------------------------

class CheckpointTest : public IoTest {
 protected:
  TrainingCheckpoint Make(uint64_t seed, int64_t step) {
    TrainingCheckpoint c;
    c.step = step;
    c.seed = seed;
    c.weights = RandomWeights(model_, seed);
    c.adam_m = RandomWeights(model_, seed + 1);
    c.adam_v = RandomWeights(model_, seed + 2);
    c.options = {{"context", "4096"},
                 {"chunk", "512"},
                 {"data", "/tmp/a \"b\".bin"},
                 {"note", "line1\nline2"}};
    return c;
  }
  void ExpectSame(const TrainingCheckpoint& a, const TrainingCheckpoint& b) {
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.seed, b.seed);
    EXPECT_EQ(a.options, b.options);
    ExpectExactlyEqual(a.weights, b.weights);
    EXPECT_EQ(a.has_optimizer_state(), b.has_optimizer_state());
    if (a.has_optimizer_state()) {
      ExpectExactlyEqual(a.adam_m, b.adam_m);
      ExpectExactlyEqual(a.adam_v, b.adam_v);
    }
  }
};

TEST_F(CheckpointTest, SaveAndResume) {
  const fs::path path = dir_ / "run.ckpt";
  TrainingCheckpoint saved = Make(21, 1234);
  saved.seed = std::numeric_limits<uint64_t>::max();
  SaveCheckpoint(path, model_, saved);
  ExpectSame(saved, LoadCheckpoint(path, model_));
  EXPECT_FALSE(fs::exists(path.string() + ".tmp." + std::to_string(::getpid())));

  // Without optimizer state (optimizer none).
  TrainingCheckpoint plain;
  plain.weights = RandomWeights(model_, 3);
  SaveCheckpoint(path, model_, plain);
  const TrainingCheckpoint loaded = LoadCheckpoint(path, model_);
  EXPECT_FALSE(loaded.has_optimizer_state());
  ExpectSame(plain, loaded);
}

// Issue 13: with several GPUs each rank saves its stage's tensors only; the file says which stage
// of how many and loads back exactly those (the others empty); a whole file stays a one-GPU one.
TEST_F(CheckpointTest, PipelineStageCheckpointsHoldTheirStageOnly) {
  ASSERT_EQ(model_.num_hidden_layers, 2);
  const std::vector<int32_t> first = PipelineStageFirstLayers(model_, 2);
  ASSERT_EQ(first, (std::vector<int32_t>{0, 1, 2}));
  for (int32_t stage : {0, 1}) {
    SCOPED_TRACE(stage);
    TrainingCheckpoint saved = Make(41 + static_cast<uint64_t>(stage), 7);
    for (ModelWeights* w : {&saved.weights, &saved.adam_m, &saved.adam_v})
      KeepStageTensors(*w, model_, stage, 2);
    saved.pipeline_stage = stage;
    saved.pipeline_stages = 2;
    const fs::path path = dir_ / ("run.ckpt.rank" + std::to_string(stage));
    SaveCheckpoint(path, model_, saved);
    const TrainingCheckpoint loaded = LoadCheckpoint(path, model_);
    EXPECT_EQ(loaded.pipeline_stage, stage);
    EXPECT_EQ(loaded.pipeline_stages, 2);
    ExpectSame(saved, loaded);
    EXPECT_EQ(loaded.weights.embedding.empty(), stage != 0);
    EXPECT_EQ(loaded.weights.lm_head.empty(), stage != 1);
    EXPECT_TRUE(loaded.weights.layers[static_cast<size_t>(1 - stage)].qkv.empty());
    EXPECT_FALSE(loaded.weights.layers[static_cast<size_t>(stage)].qkv.empty());
  }
  const fs::path whole = dir_ / "whole.ckpt";
  SaveCheckpoint(whole, model_, Make(50, 3));
  EXPECT_EQ(LoadCheckpoint(whole, model_).pipeline_stages, 1);
}

// A tied LM head over two stages: the last stage holds its own copy of the embedding (its head),
// and its checkpoint keeps and reloads it; the first stage's holds the embedding as always.
TEST_F(CheckpointTest, ATiedModelsLastStageKeepsItsEmbedding) {
  ModelSpec tied = model_;
  tied.name += "-tied";
  tied.tie_word_embeddings = true;
  for (int32_t stage : {0, 1}) {
    SCOPED_TRACE(stage);
    TrainingCheckpoint saved;
    saved.weights = RandomWeights(tied, 60 + static_cast<uint64_t>(stage));
    ASSERT_TRUE(saved.weights.lm_head.empty());
    KeepStageTensors(saved.weights, tied, stage, 2);
    EXPECT_FALSE(saved.weights.embedding.empty());
    saved.step = 4;
    saved.pipeline_stage = stage;
    saved.pipeline_stages = 2;
    const fs::path path = dir_ / ("tied.ckpt.rank" + std::to_string(stage));
    SaveCheckpoint(path, tied, saved);
    const TrainingCheckpoint loaded = LoadCheckpoint(path, tied);
    EXPECT_EQ(loaded.weights.embedding, saved.weights.embedding);
    EXPECT_EQ(loaded.weights.final_norm.empty(), stage == 0);
  }
}

TEST_F(CheckpointTest, FailedSaveLeavesThePreviousCheckpointIntact) {
  const fs::path path = dir_ / "run.ckpt";
  const TrainingCheckpoint old = Make(31, 10);
  SaveCheckpoint(path, model_, old);
  const std::string old_bytes = Bytes(path);

  // The temporary file cannot be created (its name is taken by a directory): works as root too.
  const fs::path temp = path.string() + ".tmp." + std::to_string(::getpid());
  fs::create_directory(temp);
  ExpectInputError([&] { SaveCheckpoint(path, model_, Make(32, 11)); },
                   {"cannot write", path.string()});
  fs::remove(temp);
  EXPECT_EQ(Bytes(path), old_bytes);
  ExpectSame(old, LoadCheckpoint(path, model_));

  // An unwritable directory (permissions do not stop root, so only checked otherwise).
  if (::geteuid() != 0) {
    fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
    ExpectInputError([&] { SaveCheckpoint(path, model_, Make(33, 12)); }, {path.string()});
    fs::permissions(dir_, fs::perms::owner_all);
    ExpectSame(old, LoadCheckpoint(path, model_));
  }
  // A directory that does not exist.
  const fs::path nowhere = dir_ / "missing" / "run.ckpt";
  ExpectInputError([&] { SaveCheckpoint(nowhere, model_, old); }, {nowhere.string()});

  // A bug in the caller (weights of another model) throws before anything is written.
  ModelSpec other = model_;
  other.vocab_size = 128;
  TrainingCheckpoint wrong = Make(34, 13);
  wrong.weights = RandomWeights(other, 1);
  EXPECT_THROW(SaveCheckpoint(path, model_, wrong), InternalError);
  ExpectSame(old, LoadCheckpoint(path, model_));
}

TEST_F(CheckpointTest, CorruptCheckpointsAreClearErrors) {
  const fs::path path = dir_ / "run.ckpt";
  SaveCheckpoint(path, model_, Make(41, 5));
  const std::string whole = Bytes(path);

  ExpectInputError([&] { LoadCheckpoint(dir_ / "none.ckpt", model_); },
                   {(dir_ / "none.ckpt").string(), "cannot open"});
  Write(path, whole.substr(0, whole.size() / 2));
  ExpectInputError([&] { LoadCheckpoint(path, model_); }, {path.string(), "run past the end"});
  Write(path, "garbage, not a checkpoint");
  ExpectInputError([&] { LoadCheckpoint(path, model_); }, {path.string(), "header length"});

  // A weights file is not a checkpoint.
  WriteSafetensorsWeights(path, model_, RandomWeights(model_, 1), SafetensorsDtype::kF32);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "not a ctxplan checkpoint: metadata \"format\" is 'pt'"});

  // A checkpoint of another model.
  Write(path, whole);
  ModelSpec other = model_;
  other.intermediate_size = 96;
  ExpectInputError([&] { LoadCheckpoint(path, other); },
                   {path.string(),
                    "tensor 'param.model.layers.0.mlp.gate_proj.weight' has shape "
                    "[128, 64], expected [96, 64]"});

  // Edited metadata: bad step, unknown key, unknown optimizer state, moments missing.
  auto with_metadata = [&](std::map<std::string, std::string> metadata, bool moments) {
    const TrainingCheckpoint c = Make(42, 6);
    std::vector<SafetensorsTensor> tensors = HfTensors(model_, c.weights, "param.");
    if (moments) {
      for (auto& t : HfTensors(model_, c.adam_m, "adam_m.")) tensors.push_back(t);
    }
    WriteSafetensors(path, tensors, SafetensorsDtype::kF32, metadata);
  };
  const std::map<std::string, std::string> good = {{"format", "ctxplan-checkpoint"},
                                                   {"version", "1"},
                                                   {"model", "tiny"},
                                                   {"step", "6"},
                                                   {"seed", "42"},
                                                   {"optimizer_state", "none"}};
  with_metadata(good, false);
  EXPECT_EQ(LoadCheckpoint(path, model_).step, 6);
  auto edited = [&](const std::string& key, const std::string& value) {
    std::map<std::string, std::string> m = good;
    m[key] = value;
    return m;
  };
  with_metadata(edited("step", "-3"), false);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "\"step\" = '-3' is not a non-negative integer"});
  with_metadata(edited("seed", "12x"), false);
  ExpectInputError([&] { LoadCheckpoint(path, model_); }, {path.string(), "\"seed\""});
  with_metadata(edited("version", "7"), false);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "checkpoint version '7' is not supported"});
  with_metadata(edited("colour", "blue"), false);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "unknown checkpoint metadata key 'colour'"});
  with_metadata(edited("optimizer_state", "sgd"), false);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "\"optimizer_state\" = 'sgd'"});
  with_metadata(good, true);  // moments present but the metadata says none
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "unexpected tensor 'adam_m.model.embed_tokens.weight'"});
  with_metadata(edited("optimizer_state", "adamw"), true);  // adam_v missing
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(),
                    "required tensor 'adam_v.model.embed_tokens.weight' is "
                    "missing"});
}

// CRC-32C's check value (RFC 3720 / the Castagnoli catalogue entry) and its continuation.
TEST(Crc32cTest, CheckValueAndContinuation) {
  const std::string check = "123456789";
  EXPECT_EQ(Crc32c(std::as_bytes(std::span(check.data(), check.size()))), 0xE3069283u);
  EXPECT_EQ(Crc32cHex(0xE3069283u), "e3069283");
  EXPECT_EQ(Crc32c({}), 0u);
  std::vector<std::byte> bytes(1001);
  std::mt19937 rng(7);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
  const uint32_t whole = Crc32c(bytes);
  for (const size_t split : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{500}}) {
    const std::span<const std::byte> all(bytes);
    EXPECT_EQ(Crc32c(all.subspan(split), Crc32c(all.first(split))), whole) << split;
  }
  bytes[333] ^= std::byte{0x10};
  EXPECT_NE(Crc32c(bytes), whole);
}

// Issue 16: a checkpoint carries a CRC-32C per tensor and over its metadata. A flipped bit in a
// tensor names the tensor; one in the metadata fails before anything is read; and of 300 random
// single-bit flips anywhere in the file, none loads as a different checkpoint.
TEST_F(CheckpointTest, ChecksumsCatchEveryFlippedBit) {
  const fs::path path = dir_ / "run.ckpt";
  const TrainingCheckpoint saved = Make(51, 7);
  SaveCheckpoint(path, model_, saved);
  const std::string whole = Bytes(path);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, whole.data(), 8);
  const size_t data_start = 8 + header_bytes;

  // The last byte of the data section: the last tensor written (the adam_v moments' last one).
  std::string flipped = whole;
  flipped.back() = static_cast<char>(flipped.back() ^ 0x01);
  Write(path, flipped);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "fails its CRC-32C", "adam_v.", "the file is corrupt"});
  // A digit of the step in the metadata: 7 -> 6 still parses, the checksum does not.
  flipped = whole;
  const size_t step = flipped.find("\"step\":\"7\"");
  ASSERT_NE(step, std::string::npos);
  flipped[step + 8] = '6';
  Write(path, flipped);
  ExpectInputError([&] { LoadCheckpoint(path, model_); },
                   {path.string(), "metadata fails its CRC-32C"});

  std::mt19937_64 rng(2026);
  int rejected = 0, same = 0;
  for (int i = 0; i < 300; ++i) {
    flipped = whole;
    // Half in the data, half anywhere (header included).
    const size_t at =
        i % 2 == 0 ? data_start + rng() % (whole.size() - data_start) : rng() % whole.size();
    flipped[at] = static_cast<char>(flipped[at] ^ (1 << (rng() % 8)));
    Write(path, flipped);
    try {
      const TrainingCheckpoint loaded = LoadCheckpoint(path, model_);
      ExpectSame(saved, loaded);  // a flip that changed nothing that is loaded (JSON spacing)
      ++same;
    } catch (const InputError&) {
      ++rejected;
    }
  }
  std::printf("  300 single-bit flips: %d rejected, %d loaded unchanged, 0 accepted changed\n",
              rejected, same);
  EXPECT_GE(rejected, 290) << same << " loaded unchanged";
  Write(path, whole);
  ExpectSame(saved, LoadCheckpoint(path, model_));
}

}  // namespace
}  // namespace ctxplan

namespace ctxplan {
namespace {

// The planning machine's trace keys: a preset round-trips by name, a --gpu path is written
// absolute (replay runs from anywhere), a trace without the keys reads as none, and damaged keys
// are clear errors.
TEST(PlanMachineMetadata, RoundTripsPresetsAndPaths) {
  RunMetadata m;
  AddPlanMachine({"h100-125g", "", 134217728000, "h100-125g"}, m);
  EXPECT_EQ(m.at("plan_machine"), "h100-125g");
  EXPECT_EQ(m.count("plan_gpu"), 0u);
  EXPECT_EQ(m.at("plan_host_ram_bytes"), "134217728000");
  std::optional<PlanMachine> p = PlanMachineFromMetadata(m, "t");
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->machine, "h100-125g");
  EXPECT_EQ(p->gpu, "");
  EXPECT_EQ(p->host_ram_bytes, 134217728000);
  EXPECT_EQ(p->name, "h100-125g");

  RunMetadata g;
  AddPlanMachine({"", "gpus/mine.yaml", int64_t{250} << 30, "mine+250GiB"}, g);
  EXPECT_EQ(g.count("plan_machine"), 0u);
  const fs::path written = g.at("plan_gpu");
  EXPECT_TRUE(written.is_absolute()) << written;
  EXPECT_EQ(written, (fs::current_path() / "gpus/mine.yaml").lexically_normal());
  p = PlanMachineFromMetadata(g, "t");
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->gpu, written.string());
  EXPECT_EQ(p->host_ram_bytes, int64_t{250} << 30);
  RunMetadata named;  // a catalogue GPU's name is not a path: kept as given
  AddPlanMachine({"", "h100-sxm", int64_t{125} << 30, "h100-sxm+125GiB"}, named);
  EXPECT_EQ(named.at("plan_gpu"), "h100-sxm");

  EXPECT_FALSE(PlanMachineFromMetadata({{"model", "tiny"}}, "old.ctxtrace").has_value());

  auto expect_error = [](const RunMetadata& bad, const std::string& needle) {
    try {
      PlanMachineFromMetadata(bad, "bad.ctxtrace");
      ADD_FAILURE() << "no error for " << needle;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("bad.ctxtrace"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  RunMetadata both = m;
  both["plan_gpu"] = "h100-sxm";
  expect_error(both, "'plan_gpu' both");
  for (const std::string text : {"", "12x", "-5", "0", "99999999999999999999999"}) {
    RunMetadata bad = m;
    bad["plan_host_ram_bytes"] = text;
    expect_error(bad, "'plan_host_ram_bytes'");
  }
  RunMetadata empty = m;
  empty["plan_machine"] = "";
  expect_error(empty, "'plan_machine' is empty");
}

}  // namespace
}  // namespace ctxplan
