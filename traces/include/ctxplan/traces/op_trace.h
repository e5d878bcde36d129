// The compact op trace (.ctxtrace): what a run did, op by op, carrying the step plan's op ids so
// `ctxplan replay` can compare prediction and measurement. Written by ctxtrain (measured) and by
// ctxplan (predicted); the Chrome-trace JSON form is for people, this one for long runs.
//
// Layout, little-endian:
//   "CTXTRC01"                       magic and format version
//   u32 n, n bytes                   metadata: a flat JSON object of strings (model, options,
//                                    GPU, driver and CUDA versions, commit, date, plan version;
//                                    from ctxtrain on CUDA also what its allocators held, in
//                                    bytes: gpu_arena_allocated_bytes, gpu_device_used_bytes,
//                                    host_runtime_bytes)
//   records, each a u8 tag then its fields:
//     tag 1, op:     u64 op_id, i64 start_ns, i64 end_ns, u8 kind, u8 stream, u8 phase,
//                    u8 part, i32 chunk, i32 layer                              (36 bytes)
//     tag 2, memory: i64 time_ns, u8 space, u8 category, i64 space_total_bytes   (18 bytes)
//                    (the plan's alloc/free ops, stamped on the measured clock)
//     tag 3, union:  u8 phase, i32 chunk, i32 layer, i32 pages                   (13 bytes)
//                    (a page-sparse layer's union of its query tiles' selections, as the run
//                    drew it; written after the step's ops; absent before 2026-11-25)
//   tag 0xFF, footer: u64 op records, u64 memory records   (a missing footer = truncated file),
//                    then u32 CRC-32C of every byte before it: traces written since 2026-11-25,
//                    whose metadata says trace_checksum = crc32c (the reader checks, drops the key)
// Times share one clock, in nanoseconds from the step's start.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ctxplan {

struct OpRecord {
  uint64_t op_id = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  uint8_t kind = 0;    // OpKind
  uint8_t stream = 0;  // Stream
  uint8_t phase = 0;   // Phase
  uint8_t part = 0;    // OpPart
  int32_t chunk = -1;
  int32_t layer = -1;
};

struct MemoryRecord {
  int64_t time_ns = 0;
  uint8_t space = 0;              // MemSpace
  uint8_t category = 0;           // MemCategory of the event
  int64_t space_total_bytes = 0;  // allocated in that space after the event
};

struct UnionRecord {
  uint8_t phase = 0;  // Phase: the fill's selection, or the recompute's (the backward reuses it)
  int32_t chunk = -1;
  int32_t layer = -1;
  int32_t pages = 0;  // distinct earlier pages the chunk's query tiles selected, sinks included
};

using TraceMetadata = std::map<std::string, std::string>;

struct OpTrace {
  TraceMetadata metadata;
  std::vector<OpRecord> ops;
  std::vector<MemoryRecord> memory;
  std::vector<UnionRecord> unions;
};

inline constexpr char kOpTraceMagic[9] = "CTXTRC01";

// Streams records to a file through AtomicFileWriter: the file appears, whole, on Finish().
class OpTraceWriter {
 public:
  OpTraceWriter(const std::filesystem::path& path, const TraceMetadata& metadata);
  ~OpTraceWriter();
  OpTraceWriter(const OpTraceWriter&) = delete;
  OpTraceWriter& operator=(const OpTraceWriter&) = delete;

  void Op(const OpRecord& record);
  void Memory(const MemoryRecord& record);
  void Union(const UnionRecord& record);
  // Writes the footer and renames the file into place. Without it no file is left behind.
  void Finish();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Reads and validates a whole trace. A missing, truncated or malformed file throws InputError
// naming the file, the byte offset and what was expected.
OpTrace ReadOpTrace(const std::filesystem::path& path);
// The same over a trace's bytes; `name` stands for the file in messages.
OpTrace ParseOpTrace(std::string_view bytes, const std::string& name);

}  // namespace ctxplan
