#include "ctxplan/traces/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <streambuf>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ctxplan/models/errors.h"

namespace ctxplan {

// A write-only streambuf over a POSIX file descriptor. std::ofstream would do the writing, but it
// hides both the descriptor (needed for fsync) and errno (needed to say "No space left on
// device" rather than just "failed").
class AtomicFileWriter::FdStreamBuf : public std::streambuf {
 public:
  explicit FdStreamBuf(int fd) : fd_(fd), buffer_(kBufferSize) { ResetPut(); }
  FdStreamBuf(const FdStreamBuf&) = delete;
  FdStreamBuf& operator=(const FdStreamBuf&) = delete;
  // Does not flush: an uncommitted file is discarded anyway.
  ~FdStreamBuf() override { Close(); }

  int fd() const { return fd_; }
  // The errno of the first failed write, or 0.
  int error() const { return error_; }

  // Returns 0 or the errno of a failed close, which is where some file systems (NFS) finally
  // report write errors.
  int Close() {
    if (fd_ < 0) return 0;
    const int result = ::close(fd_);
    fd_ = -1;
    // Even on EINTR the descriptor is gone on Linux; retrying could close someone else's.
    return result == 0 || errno == EINTR ? 0 : errno;
  }

 protected:
  int_type overflow(int_type ch) override {
    if (!FlushBuffer()) return traits_type::eof();
    if (!traits_type::eq_int_type(ch, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(ch);
      pbump(1);
    }
    return traits_type::not_eof(ch);
  }

  std::streamsize xsputn(const char* data, std::streamsize size) override {
    if (size <= epptr() - pptr()) {
      std::memcpy(pptr(), data, static_cast<size_t>(size));
      pbump(static_cast<int>(size));
      return size;
    }
    if (!FlushBuffer()) return 0;
    if (size < static_cast<std::streamsize>(buffer_.size())) {
      std::memcpy(pptr(), data, static_cast<size_t>(size));
      pbump(static_cast<int>(size));
      return size;
    }
    // Large blocks skip the copy.
    return WriteAll(data, static_cast<size_t>(size)) ? size : 0;
  }

  int sync() override { return FlushBuffer() ? 0 : -1; }

 private:
  static constexpr size_t kBufferSize = size_t{1} << 16;

  void ResetPut() { setp(buffer_.data(), buffer_.data() + buffer_.size()); }

  bool FlushBuffer() {
    const bool ok = WriteAll(pbase(), static_cast<size_t>(pptr() - pbase()));
    ResetPut();
    return ok;
  }

  bool WriteAll(const char* data, size_t size) {
    if (error_ != 0) return false;  // The file already has a hole; refuse everything after it.
    if (fd_ < 0) {
      error_ = EBADF;
      return false;
    }
    while (size > 0) {
      const ssize_t written = ::write(fd_, data, size);
      if (written < 0) {
        if (errno == EINTR) continue;
        error_ = errno;
        return false;
      }
      data += written;
      size -= static_cast<size_t>(written);
    }
    return true;
  }

  int fd_;
  int error_ = 0;
  std::vector<char> buffer_;
};

AtomicFileWriter::AtomicFileWriter(std::filesystem::path path)
    : path_(std::move(path)), temp_path_(path_.string() + ".tmp." + std::to_string(::getpid())) {
  // 0666 minus the umask: the same mode a plain std::ofstream would create.
  const int fd = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) Fail(errno);
  buffer_ = std::make_unique<FdStreamBuf>(fd);
  stream_ = std::make_unique<std::ostream>(buffer_.get());
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) Discard();
}

std::ostream& AtomicFileWriter::stream() {
  CTXPLAN_CHECK(stream_ != nullptr,
                "AtomicFileWriter::stream() after Commit() for " + path_.string());
  return *stream_;
}

void AtomicFileWriter::Commit() {
  CTXPLAN_CHECK(!committed_ && stream_ != nullptr,
                "AtomicFileWriter::Commit() called twice for " + path_.string());
  stream_->flush();
  if (buffer_->error() != 0) Fail(buffer_->error());
  // Bad without an errno: a formatting failure, or a caller-set state. Either way, incomplete.
  if (!*stream_) Fail(EIO);
  // Without fsync a crash soon after the rename can leave an empty file under the final name.
  // EINVAL: the target does not support syncing (a FIFO, /dev/null); nothing to lose there.
  if (::fsync(buffer_->fd()) != 0 && errno != EINVAL && errno != EROFS) Fail(errno);
  if (const int error = buffer_->Close(); error != 0) Fail(error);
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) Fail(errno);
  committed_ = true;
  stream_.reset();
  buffer_.reset();

  // Make the rename itself durable. Best effort: the data is complete and in place already.
  std::filesystem::path directory = path_.parent_path();
  if (directory.empty()) directory = ".";
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

void AtomicFileWriter::Fail(int error) {
  Discard();
  throw InputError("cannot write " + path_.string() + ": " + std::system_category().message(error));
}

void AtomicFileWriter::Discard() noexcept {
  stream_.reset();
  if (buffer_ != nullptr) {
    buffer_.reset();  // Closes the descriptor.
    ::unlink(temp_path_.c_str());
  }
}

}  // namespace ctxplan
