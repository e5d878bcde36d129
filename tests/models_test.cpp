// The model / GPU / machine catalogue and its loaders: real values from the catalogue, a Hugging
// Face config.json, and one test per validation error (file, line and key in a one-line message).
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"

namespace ctxplan {
namespace {

namespace fs = std::filesystem;

// A fresh directory for the files a test writes, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("ctxplan_models_test_" + std::to_string(::getpid()) + "_" +
                                         info->test_suite_name() + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) const {
    const fs::path file = path_ / name;
    std::ofstream(file, std::ios::binary) << text;
    return file.string();
  }
  std::string Path(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// Runs `load` and returns the message of the InputError it must throw.
std::string InputErrorOf(const std::function<void()>& load) {
  try {
    load();
  } catch (const InputError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    return message;
  }
  ADD_FAILURE() << "no InputError thrown";
  return "";
}

// The message names the file and line ("<file>:<line>: ") and the key.
void ExpectLocated(const std::string& message, const std::string& file, int line,
                   const std::string& key) {
  EXPECT_EQ(message.rfind(file + ":" + std::to_string(line) + ": ", 0), 0u) << message;
  if (!key.empty()) {
    EXPECT_NE(message.find("key '" + key + "'"), std::string::npos) << message;
  }
  EXPECT_NE(message.find("; "), std::string::npos)
      << "says nothing of what is accepted: " << message;
}

std::string Lines(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

// Replaces the line that starts with `key:`; an empty replacement drops the line.
std::vector<std::string> With(std::vector<std::string> lines, const std::string& key,
                              const std::string& replacement) {
  for (auto it = lines.begin(); it != lines.end(); ++it) {
    if (it->rfind(key + ":", 0) == 0) {
      if (replacement.empty()) {
        lines.erase(it);
      } else {
        *it = replacement;
      }
      return lines;
    }
  }
  ADD_FAILURE() << "no line for " << key;
  return lines;
}

// --- units --------------------------------------------------------------------------------------

TEST(Units, ParseBytesAcceptsUnitsAndSpaces) {
  EXPECT_EQ(ParseBytes("125GiB", "--host-ram"), 125 * kGiB);
  EXPECT_EQ(ParseBytes("512 GiB", "--host-ram"), 512 * kGiB);
  EXPECT_EQ(ParseBytes("1.5TB", "--host-ram"), 1'500'000'000'000);
  EXPECT_EQ(ParseBytes("80GB", "x"), 80 * kGB);
  EXPECT_EQ(ParseBytes("4096", "x"), 4096);
  EXPECT_EQ(ParseBytes("4096B", "x"), 4096);
  EXPECT_EQ(ParseBytes("2kib", "x"), 2048);
  EXPECT_EQ(ParseBytes("3 MB", "x"), 3'000'000);
  EXPECT_EQ(ParseBytes(" 1.5TiB ", "x"), 3 * kGiB * 512);
  EXPECT_EQ(ParseBytes("0.5GiB", "x"), kGiB / 2);
}

TEST(Units, ParseBytesRejectsWithWhatAndAccepted) {
  for (const char* bad : {"", "  ", "-1GiB", "0", "0GiB", "abc", "12XB", "1.5", "1e6", "5.GiB",
                          ".5GiB", "99999999999TiB", "9223372036854775808", "1 2GiB", "GiB"}) {
    const std::string message = InputErrorOf([&] { ParseBytes(bad, "--host-ram"); });
    EXPECT_EQ(message.rfind("--host-ram: '", 0), 0u) << bad << " -> " << message;
    EXPECT_NE(message.find("accepted: "), std::string::npos) << message;
  }
}

TEST(Units, ParseTokensBinarySuffixes) {
  EXPECT_EQ(ParseTokens("1M", "--context"), 1'048'576);
  EXPECT_EQ(ParseTokens("32K", "--context"), 32'768);
  EXPECT_EQ(ParseTokens("8k", "--context"), 8'192);
  EXPECT_EQ(ParseTokens("1G", "--context"), kGiB);
  EXPECT_EQ(ParseTokens("1000000", "--context"), 1'000'000);
  EXPECT_EQ(ParseTokens("1.5M", "--context"), 1'572'864);
  EXPECT_EQ(ParseTokens("1.3K", "--context"), 1'331);  // 1331.2, rounded
  EXPECT_EQ(ParseTokens("4 M", "--context"), 4 * kMiB);
}

TEST(Units, ParseTokensRejects) {
  for (const char* bad : {"", "-5", "-1M", "0", "0K", "1.5", "1MB", "abc", "99999999999G",
                          "0.0001K", "1e6", "1,000"}) {
    const std::string message = InputErrorOf([&] { ParseTokens(bad, "--context"); });
    EXPECT_EQ(message.rfind("--context: '", 0), 0u) << bad << " -> " << message;
    EXPECT_NE(message.find("accepted: "), std::string::npos) << message;
  }
}

TEST(Units, Format) {
  EXPECT_EQ(FormatBytes(15'231'233'024), "15.23 GB (14.19 GiB)");
  EXPECT_EQ(FormatBytes(57'344), "57.34 KB (56.00 KiB)");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatGiB(14 * kGiB + kGiB / 4), "14.25 GiB");
  EXPECT_EQ(FormatTokens(1'048'576), "1,048,576 (1M)");
  EXPECT_EQ(FormatTokens(8'192), "8,192 (8K)");
  EXPECT_EQ(FormatTokens(3 * kGiB), "3,221,225,472 (3G)");
  EXPECT_EQ(FormatTokens(1'000'000), "1,000,000");
  EXPECT_EQ(FormatTokens(1'536), "1,536");
  EXPECT_EQ(FormatCount(0), "0");
  EXPECT_EQ(FormatCount(999), "999");
  EXPECT_EQ(FormatCount(1'000), "1,000");
  EXPECT_EQ(FormatCount(-1'234'567), "-1,234,567");
}

// --- the catalogue's real values ----------------------------------------------------------------

TEST(Catalog, Qwen25_7B) {
  const ModelSpec m = LoadModel("qwen2.5-7b");
  EXPECT_EQ(m.name, "qwen2.5-7b");
  EXPECT_EQ(m.source_path, "<embedded>/llm/qwen2.5-7b.yaml");
  EXPECT_EQ(m.hf_repo, "Qwen/Qwen2.5-7B");
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_EQ(m.gqa_group(), 7);
  EXPECT_EQ(m.kv_bytes_per_token(), 57'344);  // 56 KiB per token (DESIGN.md)
  EXPECT_EQ(m.total_params(), 7'615'616'512);
  const double weight_bytes = 2.0 * m.total_params();
  EXPECT_GT(weight_bytes, 15.22e9);
  EXPECT_LT(weight_bytes, 15.24e9);
  EXPECT_TRUE(m.attention_bias);
  EXPECT_FALSE(m.tie_word_embeddings);
  EXPECT_EQ(m.max_position_embeddings, 131'072);
  EXPECT_DOUBLE_EQ(m.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-6);
  // Matmul weights: 28 layers x 233,046,016 + the LM head.
  EXPECT_EQ(m.layer_matmul_params(), 233'046'016);
  EXPECT_EQ(m.matmul_params(), 28 * 233'046'016LL + 152'064LL * 3'584);
}

TEST(Catalog, ParameterCountsMatchHuggingFace) {
  // Counts as Hugging Face reports them (sum of numel over the checkpoint's parameters).
  EXPECT_EQ(LoadModel("qwen2.5-0.5b").total_params(), 494'032'768);  // tied
  EXPECT_EQ(LoadModel("qwen2.5-1.5b").total_params(), 1'543'714'304);
  EXPECT_EQ(LoadModel("qwen2.5-3b").total_params(), 3'085'938'688);
  EXPECT_EQ(LoadModel("qwen2.5-14b").total_params(), 14'770'033'664);
  EXPECT_EQ(LoadModel("qwen2.5-32b").total_params(), 32'763'876'352);
  EXPECT_EQ(LoadModel("llama-3.1-8b").total_params(), 8'030'261'248);
  EXPECT_EQ(LoadModel("llama-3.2-1b").total_params(), 1'235'814'400);
  EXPECT_EQ(LoadModel("llama-3.2-3b").total_params(), 3'212'749'824);
  EXPECT_EQ(LoadModel("mistral-7b-v0.3").total_params(), 7'248'023'552);
  EXPECT_EQ(LoadModel("llama-2-7b").total_params(), 6'738'415'616);
  const ModelSpec tied = LoadModel("qwen2.5-0.5b");
  EXPECT_TRUE(tied.tie_word_embeddings);
  EXPECT_EQ(tied.lm_head_params(), 0);
  // A tied head is still a matmul per token.
  EXPECT_EQ(tied.matmul_params(), 24 * tied.layer_matmul_params() + 151'936LL * 896);
}

TEST(Catalog, TinyModel) {
  const ModelSpec m = LoadModel("tiny");
  EXPECT_EQ(m.hidden_size, 64);
  EXPECT_EQ(m.num_hidden_layers, 2);
  EXPECT_EQ(m.num_attention_heads, 4);
  EXPECT_EQ(m.num_key_value_heads, 2);
  EXPECT_EQ(m.head_dim, 16);
  EXPECT_EQ(m.intermediate_size, 128);
  EXPECT_EQ(m.vocab_size, 256);
  EXPECT_TRUE(m.attention_bias);
  // embeddings 16384 + 2 x (q 4096 + kv 2048 + o 4096 + mlp 24576 + norms 128 + bias 128)
  // + final norm 64 + LM head 16384.
  EXPECT_EQ(m.total_params(), 107'072);
}

TEST(Catalog, EveryEntryLoadsAndNamesItsFile) {
  const std::vector<std::string> models = CatalogModelNames();
  EXPECT_EQ(models.size(), 12u);
  for (const std::string& name : models) {
    SCOPED_TRACE(name);
    const ModelSpec m = LoadModel(name);
    EXPECT_EQ(m.name, name);
    EXPECT_EQ(m.source_path, "<embedded>/llm/" + name + ".yaml");
    EXPECT_EQ(m.num_attention_heads % m.num_key_value_heads, 0);
    // The embedded copy is the file in the source tree.
    const ModelSpec on_disk =
        LoadModel(std::string(CTXPLAN_SOURCE_DIR) + "/models/llm/" + name + ".yaml");
    EXPECT_EQ(on_disk.total_params(), m.total_params());
    EXPECT_EQ(on_disk.kv_bytes_per_token(), m.kv_bytes_per_token());
    EXPECT_EQ(on_disk.max_position_embeddings, m.max_position_embeddings);
  }
  const std::vector<std::string> gpus = CatalogGpuNames();
  EXPECT_EQ(gpus,
            (std::vector<std::string>{"a100-80gb-sxm", "b200", "gh200", "h100-pcie", "h100-sxm",
                                      "h100-sxm-estimate", "h200", "l40s", "rtx-4090"}));
  for (const std::string& name : gpus) {
    SCOPED_TRACE(name);
    const GpuSpec g = LoadGpu(name);
    EXPECT_EQ(g.name, name);
    EXPECT_EQ(g.source_path, "<embedded>/gpu/" + name + ".yaml");
    EXPECT_FALSE(g.display_name.empty());
    EXPECT_FALSE(g.memory_gib.note.empty());
    EXPECT_LE(g.bf16_gemm_tflops.value, g.bf16_dense_tflops.value);
    EXPECT_LT(g.attention_fwd_tflops.value, g.bf16_gemm_tflops.value);
    EXPECT_GT(g.memory_bytes(), 20 * kGiB);
    const GpuSpec on_disk =
        LoadGpu(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/" + name + ".yaml");
    EXPECT_EQ(on_disk.memory_bytes(), g.memory_bytes());
  }
  const std::vector<std::string> machines = CatalogMachineNames();
  EXPECT_EQ(machines, (std::vector<std::string>{"h100-125g", "h100-x4", "h100-x8", "h200-125g",
                                                "h200-512g", "h200-x2", "h200-x4", "h200-x8"}));
  for (const std::string& name : machines) {
    SCOPED_TRACE(name);
    const MachineSpec m = LoadMachine(name);
    EXPECT_EQ(m.name, name);
    EXPECT_GT(m.host_usable_bytes(), 0);
  }
}

TEST(Catalog, H200MeasuredValues) {
  const GpuSpec g = LoadGpu("h200");
  EXPECT_EQ(g.sm_count, 132);
  EXPECT_DOUBLE_EQ(g.memory_gib.value, 139.8);
  EXPECT_EQ(g.memory_gib.provenance, Provenance::kMeasured);
  EXPECT_EQ(g.memory_bytes(), std::llround(139.8 * kGiB));
  // Written by `ctxplan calibrate` (calibration_test checks they are the fit of the committed
  // samples): plausible Hopper figures, under the datasheet's peaks.
  EXPECT_EQ(g.bf16_gemm_tflops.provenance, Provenance::kMeasured);
  EXPECT_GT(g.bf16_gemm_tflops.value, 700);
  EXPECT_LT(g.bf16_gemm_tflops.value, g.bf16_dense_tflops.value);
  EXPECT_DOUBLE_EQ(g.bf16_dense_tflops.value, 989);
  EXPECT_EQ(g.bf16_dense_tflops.provenance, Provenance::kDatasheet);
  EXPECT_GT(g.attention_fwd_tflops.value, g.attention_bwd_tflops.value);
  EXPECT_NEAR(g.host_h2d_gbs.value, 55, 3);
  EXPECT_NEAR(g.host_d2h_gbs.value, 55, 3);
  EXPECT_NEAR(g.host_duplex_gbs.value, 96, 5);
  EXPECT_LE(g.d2d_copy_gbs.value, g.memory_bandwidth_gbs.value);
  EXPECT_EQ(g.kernels.provenance, Provenance::kMeasured);
  EXPECT_EQ(g.cuda_context_gib.provenance, Provenance::kEstimate);
  EXPECT_STREQ(ProvenanceName(Provenance::kMeasured), "measured");
  EXPECT_STREQ(ProvenanceName(Provenance::kDatasheet), "datasheet");
  EXPECT_STREQ(ProvenanceName(Provenance::kEstimate), "estimate");
  EXPECT_EQ(LoadGpu("h100-sxm").kernels.provenance, Provenance::kMeasured);
  EXPECT_EQ(LoadGpu("h100-sxm-estimate").bf16_gemm_tflops.provenance, Provenance::kEstimate);
  EXPECT_EQ(LoadGpu("h100-sxm-estimate").kernels.derived_from, "h200");
  // Scaled by what the datasheets say differs: compute rates by dense TFLOP/s (the same here),
  // an accumulating GEMM's per-wave output traffic by the device copy rate (HBM).
  const GpuSpec h200 = LoadGpu("h200"), estimate = LoadGpu("h100-sxm-estimate");
  EXPECT_DOUBLE_EQ(estimate.kernels.gemm_tflops, h200.kernels.gemm_tflops);
  EXPECT_DOUBLE_EQ(estimate.kernels.gemm_wave_us, h200.kernels.gemm_wave_us);
  EXPECT_NEAR(estimate.kernels.gemm_accumulate_wave_us_per_byte,
              h200.kernels.gemm_accumulate_wave_us_per_byte * h200.d2d_copy_gbs.value /
                  estimate.d2d_copy_gbs.value,
              1e-12);
}

TEST(Catalog, Machines) {
  const MachineSpec m = LoadMachine("h200-125g");
  EXPECT_EQ(m.gpu.name, "h200");
  EXPECT_EQ(m.host_ram_bytes, 125 * kGiB);
  EXPECT_EQ(m.host_reserved_bytes, 8 * kGiB);
  EXPECT_EQ(m.host_usable_bytes(), 117 * kGiB);
  EXPECT_DOUBLE_EQ(m.host_memory_gbs, 50);  // measured: host AdamW at 7B
  EXPECT_EQ(LoadMachine("h200-512g").host_ram_bytes, 512 * kGiB);
  EXPECT_EQ(LoadMachine("h100-125g").gpu.name, "h100-sxm");
  // The host links measured on the lent four-GPU H100 and H200 hosts; a machine that names none
  // has 0.
  EXPECT_DOUBLE_EQ(LoadMachine("h100-x4").host_links_h2d_gbs, 160.4);
  EXPECT_DOUBLE_EQ(LoadMachine("h100-x4").host_links_d2h_gbs, 120.1);
  EXPECT_DOUBLE_EQ(LoadMachine("h200-x4").host_links_h2d_gbs, 169.3);
  EXPECT_DOUBLE_EQ(LoadMachine("h200-x4").host_links_d2h_gbs, 133.8);
  EXPECT_DOUBLE_EQ(LoadMachine("h200-x8").host_links_h2d_gbs, 0);

  const MachineSpec custom = MakeMachine(LoadGpu("h200"), ParseBytes("125GiB", "--host-ram"));
  EXPECT_EQ(custom.name, "h200+125GiB");
  EXPECT_EQ(custom.host_reserved_bytes, 8 * kGiB);
  EXPECT_DOUBLE_EQ(custom.host_memory_gbs, 200);
  EXPECT_EQ(MakeMachine(LoadGpu("b200"), ParseBytes("1.5TB", "x")).name, "b200+1396.98GiB");
  EXPECT_NE(InputErrorOf([] { MakeMachine(LoadGpu("h200"), 4 * kGiB); }).find("reserved"),
            std::string::npos);
}

TEST(Catalog, NamesAreCaseInsensitive) {
  EXPECT_EQ(LoadModel("Qwen2.5-7B").name, "qwen2.5-7b");
  EXPECT_EQ(LoadGpu("H200").name, "h200");
  EXPECT_EQ(LoadMachine("H200-125G").name, "h200-125g");
}

TEST(Catalog, UnknownNamesListTheCatalogue) {
  std::string message = InputErrorOf([] { LoadModel("qwen9-7b"); });
  EXPECT_NE(message.find("unknown model 'qwen9-7b'"), std::string::npos) << message;
  EXPECT_NE(message.find("qwen2.5-7b"), std::string::npos) << message;
  EXPECT_NE(message.find("llama-3.1-8b"), std::string::npos) << message;
  message = InputErrorOf([] { LoadGpu("h300"); });
  EXPECT_NE(message.find("unknown GPU 'h300'"), std::string::npos) << message;
  EXPECT_NE(message.find("rtx-4090"), std::string::npos) << message;
  message = InputErrorOf([] { LoadMachine("dgx"); });
  EXPECT_NE(message.find("h200-125g"), std::string::npos) << message;
}

TEST(Catalog, MissingFile) {
  TempDir dir;
  const std::string path = dir.Path("absent.yaml");
  EXPECT_EQ(InputErrorOf([&] { LoadModel(path); }).rfind(path + ": cannot read file", 0), 0u);
  EXPECT_EQ(InputErrorOf([&] { LoadGpu(path); }).rfind(path + ": cannot read file", 0), 0u);
  EXPECT_EQ(InputErrorOf([&] { LoadMachine(path); }).rfind(path + ": cannot read file", 0), 0u);
  const std::string json = dir.Path("config.json");
  EXPECT_EQ(InputErrorOf([&] { LoadModel(json); }).rfind(json + ": cannot read file", 0), 0u);
  const std::string folder = dir.Path("");
  EXPECT_NE(InputErrorOf([&] { LoadModel(folder); }).find("cannot read file"), std::string::npos);
}

// The power model's values in a GPU profile are checked like the rest: a wrong one names its key
// and what is accepted.
TEST(Catalog, PowerValuesAreChecked) {
  std::ifstream in(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/h200.yaml");
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_NE(good.find("  power_limit_w: 700"), std::string::npos);
  ASSERT_NE(good.find("tdp_w: 700"), std::string::npos);
  TempDir dir;
  const GpuSpec loaded = LoadGpu(dir.Write("good.yaml", good));
  EXPECT_DOUBLE_EQ(loaded.tdp_w, 700);
  EXPECT_TRUE(loaded.kernels.has_power());
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    text.replace(text.find(from), from.size(), to);
    return dir.Write("bad.yaml", text);
  };
  const std::string negative = with("  power_limit_w: 700", "  power_limit_w: -700");
  EXPECT_NE(InputErrorOf([&] { LoadGpu(negative); }).find("power_limit_w"), std::string::npos);
  const std::string word = with("tdp_w: 700", "tdp_w: lots");
  EXPECT_NE(InputErrorOf([&] { LoadGpu(word); }).find("tdp_w"), std::string::npos);
}

// The union's key blocks at GQA groups 1-2: the H200's profile has timed them; a wrong value names
// its key, and a profile without them reads as untimed (0) at the gathered blocks' rate (1).
TEST(Catalog, UnionBlockValuesAreChecked) {
  std::ifstream in(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/h200.yaml");
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t cost_at = good.find("  attention_bwd_union_block_us: ");
  const size_t rate_at = good.find("  sparse_bwd_union_efficiency: ");
  ASSERT_NE(cost_at, std::string::npos);
  ASSERT_NE(rate_at, std::string::npos);
  TempDir dir;
  const GpuSpec loaded = LoadGpu(dir.Write("good.yaml", good));
  EXPECT_GT(loaded.kernels.attention_bwd_union_block_us, 0.0);
  EXPECT_GT(loaded.kernels.sparse_bwd_union_efficiency, 0.3);
  EXPECT_LT(loaded.kernels.sparse_bwd_union_efficiency, 2.0);
  auto replaced = [&](size_t at, const std::string& line) {
    std::string text = good;
    text.replace(at, text.find('\n', at) - at, line);
    return dir.Write("bad.yaml", text);
  };
  const std::string fast = replaced(rate_at, "  sparse_bwd_union_efficiency: 5");
  EXPECT_NE(InputErrorOf([&] { LoadGpu(fast); }).find("sparse_bwd_union_efficiency"),
            std::string::npos);
  const std::string word = replaced(cost_at, "  attention_bwd_union_block_us: slow");
  EXPECT_NE(InputErrorOf([&] { LoadGpu(word); }).find("attention_bwd_union_block_us"),
            std::string::npos);
  // The 64-key blocks' own cost and rate, checked the same way.
  const size_t cost64_at = good.find("  attention_bwd_union64_block_us: ");
  const size_t rate64_at = good.find("  sparse_bwd_union64_efficiency: ");
  ASSERT_NE(cost64_at, std::string::npos);
  ASSERT_NE(rate64_at, std::string::npos);
  EXPECT_GT(loaded.kernels.attention_bwd_union64_block_us, 0.0);
  EXPECT_GT(loaded.kernels.sparse_bwd_union64_efficiency, 0.3);
  EXPECT_NE(InputErrorOf([&] {
              LoadGpu(replaced(rate64_at, "  sparse_bwd_union64_efficiency: -1"));
            }).find("sparse_bwd_union64_efficiency"),
            std::string::npos);
  EXPECT_NE(InputErrorOf([&] {
              LoadGpu(replaced(cost64_at, "  attention_bwd_union64_block_us: [1]"));
            }).find("attention_bwd_union64_block_us"),
            std::string::npos);
  std::string without = good;
  without.erase(rate64_at, without.find('\n', rate64_at) + 1 - rate64_at);
  without.erase(cost64_at, without.find('\n', cost64_at) + 1 - cost64_at);
  without.erase(rate_at, without.find('\n', rate_at) + 1 - rate_at);
  without.erase(cost_at, without.find('\n', cost_at) + 1 - cost_at);
  const GpuSpec old = LoadGpu(dir.Write("old.yaml", without));
  EXPECT_EQ(old.kernels.attention_bwd_union_block_us, 0.0);
  EXPECT_EQ(old.kernels.sparse_bwd_union_efficiency, 1.0);
  EXPECT_EQ(old.kernels.attention_bwd_union64_block_us, 0.0);
  EXPECT_EQ(old.kernels.sparse_bwd_union64_efficiency, 1.0);
}

// --- Hugging Face config.json -------------------------------------------------------------------

// Qwen/Qwen2.5-7B's config.json, keys we do not use included.
constexpr const char* kQwen7bConfigJson = R"({
  "architectures": [
    "Qwen2ForCausalLM"
  ],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 131072,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_mrope": false,
  "use_sliding_window": false,
  "vocab_size": 152064
}
)";

TEST(HfConfig, Qwen25_7BEqualsTheCatalogue) {
  TempDir dir;
  const std::string path = dir.Write("config.json", kQwen7bConfigJson);
  const ModelSpec hf = LoadModel(path);
  const ModelSpec cat = LoadModel("qwen2.5-7b");
  EXPECT_EQ(hf.name, path);
  EXPECT_EQ(hf.source_path, path);
  EXPECT_EQ(hf.model_type, "qwen2");
  EXPECT_EQ(hf.hidden_size, cat.hidden_size);
  EXPECT_EQ(hf.intermediate_size, cat.intermediate_size);
  EXPECT_EQ(hf.num_hidden_layers, cat.num_hidden_layers);
  EXPECT_EQ(hf.num_attention_heads, cat.num_attention_heads);
  EXPECT_EQ(hf.num_key_value_heads, cat.num_key_value_heads);
  EXPECT_EQ(hf.head_dim, cat.head_dim);
  EXPECT_EQ(hf.vocab_size, cat.vocab_size);
  EXPECT_EQ(hf.max_position_embeddings, cat.max_position_embeddings);
  EXPECT_EQ(hf.tie_word_embeddings, cat.tie_word_embeddings);
  EXPECT_EQ(hf.attention_bias, cat.attention_bias);  // qwen2: true without the key
  EXPECT_DOUBLE_EQ(hf.rope_theta, cat.rope_theta);
  EXPECT_DOUBLE_EQ(hf.rms_norm_eps, cat.rms_norm_eps);
  EXPECT_EQ(hf.total_params(), cat.total_params());
  EXPECT_EQ(hf.kv_bytes_per_token(), 57'344);
}

TEST(HfConfig, DefaultsOfTheLlamaFamily) {
  // An old-style Llama config: no num_key_value_heads (multi-head), no attention_bias, no
  // tie_word_embeddings, head_dim null, rope_theta only in transformers 5's rope_parameters.
  const ModelSpec m = ParseHfConfigJson(R"({
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "head_dim": null,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "quantization_config": {"bits": 4}, "mlp_bias": false
  })",
                                        "llama2.json");
  EXPECT_EQ(m.num_key_value_heads, 32);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_FALSE(m.attention_bias);
  EXPECT_FALSE(m.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(m.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-6);
  EXPECT_EQ(m.total_params(), 6'738'415'616);  // Llama-2-7B
}

TEST(HfConfig, KeysWeUseAreTypeChecked) {
  TempDir dir;
  const std::string text = kQwen7bConfigJson;
  struct Case {
    std::string from, to, key;
    int line;
  };
  const std::vector<Case> cases = {
      {"\"hidden_size\": 3584", "\"hidden_size\": \"3584\"", "hidden_size", 9},
      {"\"num_key_value_heads\": 4", "\"num_key_value_heads\": 5", "num_key_value_heads", 17},
      {"\"model_type\": \"qwen2\"", "\"model_type\": \"qwen3\"", "model_type", 14},
      {"\"tie_word_embeddings\": false", "\"tie_word_embeddings\": \"no\"", "tie_word_embeddings",
       22},
      {"\"vocab_size\": 152064", "\"vocab_size\": 152064.5", "vocab_size", 28},
      {"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": -1e-06", "rms_norm_eps", 18},
      {"\"use_cache\": true", "\"mlp_bias\": true", "mlp_bias", 25},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.to);
    std::string broken = text;
    ASSERT_NE(broken.find(c.from), std::string::npos);
    broken.replace(broken.find(c.from), c.from.size(), c.to);
    const std::string path = dir.Write("config.json", broken);
    ExpectLocated(InputErrorOf([&] { LoadModel(path); }), path, c.line, c.key);
  }
  std::string no_hidden = text;
  no_hidden.replace(no_hidden.find("\"hidden_size\": 3584,"), 20, "");
  const std::string path = dir.Write("config.json", no_hidden);
  ExpectLocated(InputErrorOf([&] { LoadModel(path); }), path, 1, "hidden_size");
}

// --- model YAML validation ----------------------------------------------------------------------

const std::vector<std::string> kModel = {
    "name: test-model",               // 1
    "model_type: qwen2",              // 2
    "hidden_size: 64",                // 3
    "intermediate_size: 128",         // 4
    "num_hidden_layers: 2",           // 5
    "num_attention_heads: 4",         // 6
    "num_key_value_heads: 2",         // 7
    "head_dim: 16",                   // 8
    "vocab_size: 256",                // 9
    "max_position_embeddings: 4096",  // 10
    "tie_word_embeddings: false",     // 11
    "attention_bias: true",           // 12
    "rope_theta: 10000.0",            // 13
    "rms_norm_eps: 1.0e-6",           // 14
};

TEST(ModelYaml, TheBaseCaseLoads) {
  TempDir dir;
  const ModelSpec m = LoadModel(dir.Write("m.yaml", Lines(kModel)));
  EXPECT_EQ(m.name, "test-model");
  EXPECT_EQ(m.total_params(), 107'072);  // the shape of `tiny`
  // head_dim may differ from hidden / heads when it is given explicitly.
  const ModelSpec wide =
      LoadModel(dir.Write("w.yaml", Lines(With(kModel, "head_dim", "head_dim: 32"))));
  EXPECT_EQ(wide.q_dim(), 128);
  // Without head_dim it is hidden / heads.
  EXPECT_EQ(LoadModel(dir.Write("n.yaml", Lines(With(kModel, "head_dim", "")))).head_dim, 16);
}

struct ErrorCase {
  std::string description;
  std::vector<std::string> lines;
  int line;
  std::string key;
  std::string problem;  // a part of the message
};

void ExpectErrors(const std::vector<ErrorCase>& cases,
                  const std::function<void(const std::string&)>& load) {
  TempDir dir;
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.description);
    const std::string path = dir.Write("case.yaml", Lines(c.lines));
    const std::string message = InputErrorOf([&] { load(path); });
    ExpectLocated(message, path, c.line, c.key);
    EXPECT_NE(message.find(c.problem), std::string::npos) << message;
  }
}

std::vector<std::string> Plus(std::vector<std::string> lines, const std::string& extra) {
  lines.push_back(extra);
  return lines;
}

TEST(ModelYaml, ValidationErrors) {
  const auto m = [](const std::string& key, const std::string& line) {
    return With(kModel, key, line);
  };
  ExpectErrors(
      {
          {"unknown key", Plus(kModel, "hiden_size: 64"), 15, "hiden_size", "unknown key"},
          {"duplicate key", Plus(kModel, "hidden_size: 64"), 15, "hidden_size", "duplicate"},
          {"missing key", m("vocab_size", ""), 1, "vocab_size", "missing"},
          {"missing name", m("name", ""), 1, "name", "missing"},
          {"no value", m("hidden_size", "hidden_size:"), 3, "hidden_size", "no value"},
          {"quoted number", m("hidden_size", "hidden_size: \"64\""), 3, "hidden_size",
           "quoted string"},
          {"word for number", m("hidden_size", "hidden_size: sixty-four"), 3, "hidden_size",
           "not a number"},
          {"list for number", m("rope_theta", "rope_theta: [1]"), 13, "rope_theta", "sequence"},
          {"number for bool", m("tie_word_embeddings", "tie_word_embeddings: 1"), 11,
           "tie_word_embeddings", "not true or false"},
          {"yes for bool", m("attention_bias", "attention_bias: yes"), 12, "attention_bias",
           "not true or false"},
          {"zero", m("num_hidden_layers", "num_hidden_layers: 0"), 5, "num_hidden_layers",
           "not positive"},
          {"negative", m("num_hidden_layers", "num_hidden_layers: -2"), 5, "num_hidden_layers",
           "not positive"},
          {"negative double", m("rope_theta", "rope_theta: -1.0"), 13, "rope_theta",
           "not positive"},
          {"infinity", m("rope_theta", "rope_theta: .inf"), 13, "rope_theta", "not finite"},
          {"nan", m("rms_norm_eps", "rms_norm_eps: .nan"), 14, "rms_norm_eps", "not finite"},
          {"bare nan", m("rms_norm_eps", "rms_norm_eps: nan"), 14, "rms_norm_eps", "not finite"},
          {"overflowing double", m("rope_theta", "rope_theta: 1e999"), 13, "rope_theta",
           "out of range"},
          {"fractional integer", m("intermediate_size", "intermediate_size: 128.5"), 4,
           "intermediate_size", "not an integer"},
          {"heads not divisible", m("num_key_value_heads", "num_key_value_heads: 3"), 7,
           "num_key_value_heads", "not divisible"},
          {"hidden not a multiple of heads",
           With(m("head_dim", ""), "hidden_size", "hidden_size: 66"), 3, "hidden_size",
           "head_dim is not given"},
          {"absurd layers", m("num_hidden_layers", "num_hidden_layers: 20000000"), 5,
           "num_hidden_layers", "absurdly large"},
          {"absurd hidden", m("hidden_size", "hidden_size: 1e8"), 3, "hidden_size",
           "absurdly large"},
          {"absurd eps", m("rms_norm_eps", "rms_norm_eps: 0.5"), 14, "rms_norm_eps",
           "absurdly large"},
          {"absurd product",
           With(With(m("hidden_size", "hidden_size: 9000000"), "intermediate_size",
                     "intermediate_size: 9000000"),
                "num_hidden_layers", "num_hidden_layers: 9000000"),
           5, "num_hidden_layers", "parameters"},
          {"unsupported model_type", m("model_type", "model_type: gemma"), 2, "model_type",
           "qwen2, llama, mistral"},
          {"empty string", m("name", "name: \"\""), 1, "name", "empty string"},
      },
      [](const std::string& path) { LoadModel(path); });
}

TEST(ModelYaml, DocumentErrors) {
  TempDir dir;
  // Malformed YAML: yaml-cpp's message and line, in our one-line form.
  std::string path = dir.Write("bad.yaml", Lines(With(kModel, "hidden_size", "hidden_size: [64")));
  std::string message = InputErrorOf([&] { LoadModel(path); });
  EXPECT_EQ(message.rfind(path + ":", 0), 0u) << message;
  EXPECT_NE(message.find("malformed YAML"), std::string::npos) << message;
  const int line = std::stoi(message.substr(path.size() + 1));
  EXPECT_GE(line, 3) << message;
  EXPECT_LE(line, 5) << message;

  path = dir.Write("list.yaml", "- name: x\n- hidden_size: 64\n");
  message = InputErrorOf([&] { LoadModel(path); });
  ExpectLocated(message, path, 1, "");
  EXPECT_NE(message.find("not a mapping"), std::string::npos) << message;

  path = dir.Write("scalar.yaml", "qwen2.5-7b\n");
  ExpectLocated(InputErrorOf([&] { LoadModel(path); }), path, 1, "");

  path = dir.Write("empty.yaml", "# nothing\n");
  message = InputErrorOf([&] { LoadModel(path); });
  ExpectLocated(message, path, 1, "");
  EXPECT_NE(message.find("empty"), std::string::npos) << message;

  // Parse*() name the source they are given.
  message = InputErrorOf([] { ParseModelYaml("name: x\n", "<flag>"); });
  EXPECT_EQ(message.rfind("<flag>:1: key 'model_type': missing", 0), 0u) << message;
}

// --- GPU and machine YAML validation ------------------------------------------------------------

const std::vector<std::string> kGpu = {
    "name: test-gpu",                                                         // 1
    "display_name: Test GPU",                                                 // 2
    "sm_count: 132",                                                          // 3
    "host_link: pcie-gen5-x16",                                               // 4
    "memory_gib: {value: 79.1, source: estimate, note: \"80 GB less 0.9\"}",  // 5
    "memory_bandwidth_gbs: {value: 3350, source: datasheet, note: \"ds\"}",   // 6
    "d2d_copy_gbs: {value: 2880, source: estimate, note: \"0.86x\"}",         // 7
    "bf16_dense_tflops: {value: 989, source: datasheet, note: \"ds\"}",       // 8
    "bf16_gemm_tflops: {value: 740, source: measured, note: \"cuBLAS\"}",     // 9
    "attention_fwd_tflops: {value: 330, source: measured, note: \"SDPA\"}",   // 10
    "attention_bwd_tflops: {value: 315, source: measured, note: \"SDPA\"}",   // 11
    "host_h2d_gbs: {value: 55.2, source: measured, note: \"pinned\"}",        // 12
    "host_d2h_gbs: {value: 55.2, source: measured, note: \"pinned\"}",        // 13
    "host_duplex_gbs: {value: 97, source: measured, note: \"both\"}",         // 14
    "cuda_context_gib: {value: 0.6, source: estimate, note: \"guess\"}",      // 15
};

TEST(GpuYaml, TheBaseCaseLoads) {
  TempDir dir;
  const GpuSpec g = LoadGpu(dir.Write("g.yaml", Lines(kGpu)));
  EXPECT_EQ(g.name, "test-gpu");
  EXPECT_EQ(g.memory_gib.provenance, Provenance::kEstimate);
  EXPECT_EQ(g.memory_gib.note, "80 GB less 0.9");
  EXPECT_EQ(g.bf16_gemm_tflops.provenance, Provenance::kMeasured);
  // Block style works as well as flow style.
  const GpuSpec block = LoadGpu(dir.Write(
      "b.yaml", Lines(With(kGpu, "memory_gib",
                           "memory_gib:\n  value: 79.1\n  source: datasheet\n  note: block"))));
  EXPECT_DOUBLE_EQ(block.memory_gib.value, 79.1);
}

TEST(GpuYaml, ValidationErrors) {
  const auto g = [](const std::string& key, const std::string& line) {
    return With(kGpu, key, line);
  };
  ExpectErrors(
      {
          {"bad source", g("memory_gib", "memory_gib: {value: 79.1, source: guessed, note: \"x\"}"),
           5, "memory_gib.source", "measured, datasheet, estimate"},
          {"quoted value",
           g("memory_gib", "memory_gib: {value: \"79.1\", source: estimate, note: x}"), 5,
           "memory_gib.value", "quoted string"},
          {"bare number", g("memory_gib", "memory_gib: 79.1"), 5, "memory_gib", "not a mapping"},
          {"missing note", g("memory_gib", "memory_gib: {value: 79.1, source: estimate}"), 5,
           "memory_gib.note", "missing"},
          {"unknown sub-key",
           g("memory_gib", "memory_gib: {value: 79.1, source: estimate, note: x, unit: GiB}"), 5,
           "memory_gib.unit", "unknown key"},
          {"absurd memory", g("memory_gib", "memory_gib: {value: 2e5, source: estimate, note: x}"),
           5, "memory_gib.value", "absurdly large"},
          {"zero bandwidth",
           g("memory_bandwidth_gbs",
             "memory_bandwidth_gbs: {value: 0, source: datasheet, note: x}"),
           6, "memory_bandwidth_gbs.value", "not positive"},
          {"gemm above peak",
           g("bf16_gemm_tflops",
             "bf16_gemm_tflops: {value: 1979, source: datasheet, note: sparse}"),
           9, "bf16_gemm_tflops", "exceeds bf16_dense_tflops"},
          {"copy above bandwidth",
           g("d2d_copy_gbs", "d2d_copy_gbs: {value: 5000, source: measured, note: x}"), 7,
           "d2d_copy_gbs", "exceeds memory_bandwidth_gbs"},
          {"context above memory",
           g("cuda_context_gib", "cuda_context_gib: {value: 80, source: estimate, note: x}"), 15,
           "cuda_context_gib", "not below memory_gib"},
          {"fractional sm_count", g("sm_count", "sm_count: 13.5"), 3, "sm_count", "not an integer"},
          {"missing host_link", g("host_link", ""), 1, "host_link", "missing"},
          {"missing spec", g("host_duplex_gbs", ""), 1, "host_duplex_gbs", "missing"},
          {"unknown key", Plus(kGpu, "fp8_tflops: {value: 1979, source: datasheet, note: x}"), 16,
           "fp8_tflops", "unknown key"},
      },
      [](const std::string& path) { LoadGpu(path); });
}

const std::vector<std::string> kMachine = {
    "name: test-machine",    // 1
    "gpu: h200",             // 2
    "host_ram_gib: 125",     // 3
    "host_reserved_gib: 8",  // 4
    "host_memory_gbs: 200",  // 5
    "note: \"a test\"",      // 6
};

TEST(MachineYaml, LoadsWithCatalogueOrRelativeGpu) {
  TempDir dir;
  const MachineSpec m = LoadMachine(dir.Write("m.yaml", Lines(kMachine)));
  EXPECT_EQ(m.gpu.name, "h200");
  EXPECT_EQ(m.host_usable_bytes(), 117 * kGiB);
  EXPECT_EQ(m.note, "a test");
  // A GPU file next to the machine file.
  dir.Write("g.yaml", Lines(kGpu));
  const MachineSpec local =
      LoadMachine(dir.Write("local.yaml", Lines(With(kMachine, "gpu", "gpu: ./g.yaml"))));
  EXPECT_EQ(local.gpu.name, "test-gpu");
}

TEST(MachineYaml, ValidationErrors) {
  const auto m = [](const std::string& key, const std::string& line) {
    return With(kMachine, key, line);
  };
  ExpectErrors(
      {
          {"unknown gpu", m("gpu", "gpu: h300"), 2, "gpu", "h200, l40s, rtx-4090"},
          {"reserved above ram", m("host_reserved_gib", "host_reserved_gib: 200"), 4,
           "host_reserved_gib", "not below host_ram_gib"},
          {"absurd ram", m("host_ram_gib", "host_ram_gib: 1e6"), 3, "host_ram_gib",
           "absurdly large"},
          {"ram as size string", m("host_ram_gib", "host_ram_gib: 125GiB"), 3, "host_ram_gib",
           "not a number"},
          {"missing bandwidth", m("host_memory_gbs", ""), 1, "host_memory_gbs", "missing"},
          {"unknown key", Plus(kMachine, "gpu_count: 4"), 7, "gpu_count", "unknown key"},
          {"no gpus", Plus(kMachine, "gpus: 0"), 7, "gpus", "gpus"},
          {"negative links", Plus(kMachine, "host_links_h2d_gbs: -5"), 7, "host_links_h2d_gbs",
           "host_links_h2d_gbs"},
          {"negative read-back", Plus(kMachine, "selection_read_back_ns_per_entry: -1"), 7,
           "selection_read_back_ns_per_entry", "selection_read_back_ns_per_entry"},
          {"read-back as text", Plus(kMachine, "selection_read_back_us: fast"), 7,
           "selection_read_back_us", "not a number"},
      },
      [](const std::string& path) { LoadMachine(path); });
}

}  // namespace
}  // namespace ctxplan
