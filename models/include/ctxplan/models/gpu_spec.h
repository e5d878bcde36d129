// A GPU and its host link, from datasheets, with measured values where we have them.
#pragma once

#include <cstdint>
#include <string>

namespace ctxplan {

// Where a number comes from. A measured value was read on one of our machines (DESIGN.md);
// a datasheet value is the vendor's and is usually optimistic; an estimate is derived from other
// values (e.g. a GEMM rate assumed as 75% of the datasheet peak for a GPU we never measured).
enum class Provenance { kDatasheet, kMeasured, kEstimate };

// "datasheet", "measured", "estimate": the spelling used in the catalogue's `source:` fields.
const char* ProvenanceName(Provenance provenance);

struct SpecValue {
  double value = 0.0;
  Provenance provenance = Provenance::kDatasheet;
  std::string note;  // how or where it was measured, or which datasheet
};

struct GpuSpec {
  std::string name;          // catalogue name ("h200")
  std::string display_name;  // "NVIDIA H200 SXM 141GB"
  std::string source_path;

  SpecValue memory_gib;            // usable device memory, GiB
  SpecValue memory_bandwidth_gbs;  // HBM bandwidth, GB/s (datasheet: read+write peak)
  SpecValue d2d_copy_gbs;          // device-to-device copy, GB/s counted read + write
  SpecValue bf16_dense_tflops;     // dense bf16 tensor-core peak, TFLOP/s
  SpecValue bf16_gemm_tflops;      // achieved bf16 GEMM at LLM shapes, TFLOP/s
  SpecValue attention_fwd_tflops;  // achieved attention forward (flash class), TFLOP/s
  SpecValue attention_bwd_tflops;  // achieved attention backward, TFLOP/s
  SpecValue host_h2d_gbs;          // pinned host-to-device, one direction alone, GB/s
  SpecValue host_d2h_gbs;          // pinned device-to-host, one direction alone, GB/s
  SpecValue host_duplex_gbs;       // both directions at once, sum, GB/s
  SpecValue cuda_context_gib;      // CUDA context + library workspaces, GiB
  int64_t sm_count = 0;
  std::string host_link;  // "pcie-gen5-x16", "nvlink-c2c"

  int64_t memory_bytes() const;
};

// A GPU in a host with some RAM: what `--machine` or `--gpu` + `--host-ram` select.
struct MachineSpec {
  std::string name;  // preset name ("h200-125g") or "<gpu>+<ram>" for a custom one
  GpuSpec gpu;
  int64_t host_ram_bytes = 0;       // installed host RAM
  int64_t host_reserved_bytes = 0;  // kept for the OS, the process and its pageable buffers
  double host_memory_gbs = 0.0;     // host DRAM bandwidth, for an optimizer step on the host
  std::string note;                 // what the preset describes; empty for a custom machine

  int64_t host_usable_bytes() const { return host_ram_bytes - host_reserved_bytes; }
};

}  // namespace ctxplan
