#include "ctxplan/traces/op_trace.h"

#include <span>

#include "ctxplan/traces/crc32c.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/json_reader.h"

namespace ctxplan {

namespace {

constexpr uint8_t kOpTag = 1;
constexpr uint8_t kMemoryTag = 2;
constexpr uint8_t kUnionTag = 3;
constexpr uint8_t kFooterTag = 0xFF;
constexpr size_t kMagicBytes = 8;
constexpr uint32_t kMaxMetadataBytes = 1 << 20;
// The writer's own metadata key: the footer ends with a CRC-32C of every byte before it. A trace
// that says so must have it (a file cut just before it is not an older trace).
constexpr char kChecksumKey[] = "trace_checksum";
constexpr char kChecksumValue[] = "crc32c";

template <typename T>
void Put(std::string& out, T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}

std::string MetadataJson(const TraceMetadata& metadata) {
  std::string json = "{";
  bool first = true;
  for (const auto& [key, value] : metadata) {
    if (!first) json += ',';
    first = false;
    AppendJsonString(json, key);
    json += ':';
    AppendJsonString(json, value);
  }
  return json + "}";
}

// Reads the bytes of a trace with bounds checks that name the offset.
class Cursor {
 public:
  Cursor(std::string_view bytes, std::string path) : bytes_(bytes), path_(std::move(path)) {}

  size_t offset() const { return offset_; }
  bool done() const { return offset_ == bytes_.size(); }

  template <typename T>
  T Get(const char* what) {
    if (bytes_.size() - offset_ < sizeof(T)) Fail(std::string("truncated in ") + what);
    T value;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  std::string_view Take(size_t n, const char* what) {
    if (bytes_.size() - offset_ < n) Fail(std::string("truncated in ") + what);
    std::string_view s = bytes_.substr(offset_, n);
    offset_ += n;
    return s;
  }
  [[noreturn]] void Fail(const std::string& problem) const {
    throw InputError(path_ + ": byte " + std::to_string(offset_) + ": " + problem +
                     "; accepted: a complete ctxplan op trace (" + kOpTraceMagic + ")");
  }

 private:
  std::string_view bytes_;
  std::string path_;
  size_t offset_ = 0;
};

// The metadata is a flat JSON object of strings, as MetadataJson writes it.
TraceMetadata ParseMetadata(std::string_view json, const std::string& path, size_t offset) {
  const JsonValue root =
      JsonParser(json, path + ": metadata", static_cast<uint64_t>(offset)).ParseDocument();
  if (root.kind != JsonValue::Kind::kObject)
    throw InputError(path + ": metadata is " + KindName(root.kind) +
                     "; accepted: a JSON object of strings");
  TraceMetadata metadata;
  for (const auto& [key, value] : root.members) {
    if (value.kind != JsonValue::Kind::kString)
      throw InputError(path + ": metadata key '" + key + "' is " + KindName(value.kind) +
                       "; accepted: a string");
    metadata[key] = value.text;
  }
  return metadata;
}

}  // namespace

class OpTraceWriter::Impl {
 public:
  Impl(const std::filesystem::path& path, TraceMetadata metadata) : file(path) {
    metadata[kChecksumKey] = kChecksumValue;
    const std::string json = MetadataJson(metadata);
    buffer.append(kOpTraceMagic, kMagicBytes);
    Put<uint32_t>(buffer, static_cast<uint32_t>(json.size()));
    buffer += json;
  }
  void Flush(bool force) {
    if (!force && buffer.size() < (1 << 20)) return;
    crc = Crc32c(std::as_bytes(std::span(buffer.data(), buffer.size())), crc);
    file.stream().write(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    buffer.clear();
  }

  AtomicFileWriter file;
  std::string buffer;
  uint32_t crc = 0;  // of every byte written so far
  uint64_t ops = 0;
  uint64_t memory = 0;
  bool finished = false;
};

OpTraceWriter::OpTraceWriter(const std::filesystem::path& path, const TraceMetadata& metadata)
    : impl_(std::make_unique<Impl>(path, metadata)) {}

OpTraceWriter::~OpTraceWriter() = default;

void OpTraceWriter::Op(const OpRecord& r) {
  CTXPLAN_CHECK(!impl_->finished, "op record after Finish()");
  std::string& b = impl_->buffer;
  Put<uint8_t>(b, kOpTag);
  Put(b, r.op_id);
  Put(b, r.start_ns);
  Put(b, r.end_ns);
  Put(b, r.kind);
  Put(b, r.stream);
  Put(b, r.phase);
  Put(b, r.part);
  Put(b, r.chunk);
  Put(b, r.layer);
  ++impl_->ops;
  impl_->Flush(false);
}

void OpTraceWriter::Memory(const MemoryRecord& r) {
  CTXPLAN_CHECK(!impl_->finished, "memory record after Finish()");
  std::string& b = impl_->buffer;
  Put<uint8_t>(b, kMemoryTag);
  Put(b, r.time_ns);
  Put(b, r.space);
  Put(b, r.category);
  Put(b, r.space_total_bytes);
  ++impl_->memory;
  impl_->Flush(false);
}

void OpTraceWriter::Union(const UnionRecord& r) {
  CTXPLAN_CHECK(!impl_->finished, "union record after Finish()");
  std::string& b = impl_->buffer;
  Put<uint8_t>(b, kUnionTag);
  Put(b, r.phase);
  Put(b, r.chunk);
  Put(b, r.layer);
  Put(b, r.pages);
  impl_->Flush(false);
}

void OpTraceWriter::Finish() {
  if (impl_->finished) return;
  Put<uint8_t>(impl_->buffer, kFooterTag);
  Put<uint64_t>(impl_->buffer, impl_->ops);
  Put<uint64_t>(impl_->buffer, impl_->memory);
  impl_->Flush(true);
  // The CRC-32C of every byte before it (absent from traces written before 2026-11-25).
  Put<uint32_t>(impl_->buffer, impl_->crc);
  impl_->Flush(true);
  impl_->file.Commit();
  impl_->finished = true;
}

OpTrace ReadOpTrace(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string() + ": cannot read file");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return ParseOpTrace(bytes, path.string());
}

OpTrace ParseOpTrace(std::string_view bytes, const std::string& name) {
  Cursor cursor(bytes, name);
  if (cursor.Take(std::min(bytes.size(), kMagicBytes), "the magic") !=
      std::string_view(kOpTraceMagic, kMagicBytes))
    throw InputError(name + ": not a ctxplan op trace (no " + kOpTraceMagic +
                     " header); accepted: a .ctxtrace file written by ctxtrain or ctxplan");
  const uint32_t metadata_bytes = cursor.Get<uint32_t>("the metadata length");
  if (metadata_bytes > kMaxMetadataBytes) cursor.Fail("metadata larger than 1 MiB");
  OpTrace trace;
  const size_t metadata_offset = cursor.offset();
  trace.metadata =
      ParseMetadata(cursor.Take(metadata_bytes, "the metadata"), name, metadata_offset);
  while (true) {
    if (cursor.done()) cursor.Fail("ends without its footer (the run stopped while writing?)");
    const uint8_t tag = cursor.Get<uint8_t>("a record tag");
    if (tag == kOpTag) {
      OpRecord r;
      r.op_id = cursor.Get<uint64_t>("an op record");
      r.start_ns = cursor.Get<int64_t>("an op record");
      r.end_ns = cursor.Get<int64_t>("an op record");
      r.kind = cursor.Get<uint8_t>("an op record");
      r.stream = cursor.Get<uint8_t>("an op record");
      r.phase = cursor.Get<uint8_t>("an op record");
      r.part = cursor.Get<uint8_t>("an op record");
      r.chunk = cursor.Get<int32_t>("an op record");
      r.layer = cursor.Get<int32_t>("an op record");
      if (r.end_ns < r.start_ns)
        cursor.Fail("op " + std::to_string(r.op_id) + " ends before it starts");
      trace.ops.push_back(r);
    } else if (tag == kMemoryTag) {
      MemoryRecord r;
      r.time_ns = cursor.Get<int64_t>("a memory record");
      r.space = cursor.Get<uint8_t>("a memory record");
      r.category = cursor.Get<uint8_t>("a memory record");
      r.space_total_bytes = cursor.Get<int64_t>("a memory record");
      if (r.space_total_bytes < 0) cursor.Fail("negative memory total");
      trace.memory.push_back(r);
    } else if (tag == kUnionTag) {
      UnionRecord r;
      r.phase = cursor.Get<uint8_t>("a union record");
      r.chunk = cursor.Get<int32_t>("a union record");
      r.layer = cursor.Get<int32_t>("a union record");
      r.pages = cursor.Get<int32_t>("a union record");
      if (r.pages < 0) cursor.Fail("negative union size");
      trace.unions.push_back(r);
    } else if (tag == kFooterTag) {
      const uint64_t ops = cursor.Get<uint64_t>("the footer");
      const uint64_t memory = cursor.Get<uint64_t>("the footer");
      if (ops != trace.ops.size() || memory != trace.memory.size())
        cursor.Fail("footer counts " + std::to_string(ops) + " ops and " + std::to_string(memory) +
                    " memory records, the file holds " + std::to_string(trace.ops.size()) +
                    " and " + std::to_string(trace.memory.size()));
      const auto declared = trace.metadata.find(kChecksumKey);
      const bool checksummed = declared != trace.metadata.end();
      if (checksummed) {
        if (declared->second != kChecksumValue)
          cursor.Fail(std::string("metadata '") + kChecksumKey + "' is '" + declared->second +
                      "'; accepted: " + kChecksumValue);
        trace.metadata.erase(declared);
        if (cursor.done()) cursor.Fail("ends before its checksum (cut short?)");
      }
      if (!cursor.done()) {
        const size_t checked = cursor.offset();
        const uint32_t stored = cursor.Get<uint32_t>("the footer's checksum");
        if (!cursor.done()) cursor.Fail("bytes after the footer");
        const uint32_t computed = Crc32c(std::as_bytes(std::span(bytes.data(), checked)));
        if (stored != computed)
          throw InputError(name + ": fails its CRC-32C (stored " + Crc32cHex(stored) +
                           ", computed " + Crc32cHex(computed) +
                           "): the trace is corrupt; accepted: an intact .ctxtrace");
      }
      return trace;
    } else {
      cursor.Fail("unknown record tag " + std::to_string(tag));
    }
  }
}

}  // namespace ctxplan
