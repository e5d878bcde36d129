// All-or-nothing output files: a reader of <path> sees the previous file or the complete new one,
// never a prefix, even if we crash, are killed, or the disk fills up mid-write.
//
// Writes go to "<path>.tmp.<pid>" in the same directory (so the final rename cannot cross file
// systems); Commit() flushes, checks every write, fsyncs, and renames it over <path>. Without
// Commit() the destructor removes the temporary file.
//
//   AtomicFileWriter file(path);
//   WriteReport(file.stream());
//   file.Commit();
//
// Errors are the user's to fix (a missing directory, no permission, a full disk), so they throw
// InputError: "cannot write <path>: <strerror>". POSIX only.
#pragma once

#include <filesystem>
#include <memory>
#include <ostream>

namespace ctxplan {

class AtomicFileWriter {
 public:
  // Creates the temporary file; throws InputError if it cannot.
  explicit AtomicFileWriter(std::filesystem::path path);
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  // Without Commit(): closes and removes the temporary file. Never throws.
  ~AtomicFileWriter();

  // Valid until Commit(). A failed write sets badbit; Commit() then reports the cause.
  std::ostream& stream();

  // Publishes the file. Throws InputError on any write, sync or rename failure, and removes the
  // temporary file in that case. Calling it twice is a bug (InternalError).
  void Commit();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& temp_path() const { return temp_path_; }
  bool committed() const { return committed_; }

 private:
  class FdStreamBuf;

  [[noreturn]] void Fail(int error);  // Discards the temporary file and throws InputError.
  void Discard() noexcept;

  std::filesystem::path path_;
  std::filesystem::path temp_path_;
  std::unique_ptr<FdStreamBuf> buffer_;
  std::unique_ptr<std::ostream> stream_;
  bool committed_ = false;
};

}  // namespace ctxplan
