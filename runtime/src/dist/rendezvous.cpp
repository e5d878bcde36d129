#include "ctxplan/runtime/dist/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "ctxplan/models/errors.h"

namespace ctxplan::dist {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Protocol version 1. A peer's hello: kHelloMagic, rank, world size. Rank 0's reply: kReplyMagic,
// payload length, payload. All integers uint32, big-endian. The magics make a stray connection
// (a port scanner, another job on the same port) fail loudly instead of being read as a rank.
constexpr uint32_t kHelloMagic = 0x63747831;  // "ctx1"
constexpr uint32_t kReplyMagic = 0x63747232;  // "ctr2"
constexpr size_t kHelloBytes = 12;
constexpr size_t kReplyHeaderBytes = 8;
constexpr milliseconds kRetryInterval{100};

// Owns one file descriptor: every socket is closed on every path, exceptions included.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_;
};

// The one deadline that every blocking step of a call shares.
struct Deadline {
  Clock::time_point at;
  milliseconds total;

  bool Passed() const { return Clock::now() >= at; }
  // What is left, rounded up (poll() takes whole milliseconds; rounding down would spin).
  int LeftMs() const {
    const auto left = std::chrono::ceil<milliseconds>(at - Clock::now()).count();
    return static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
  }
  // "after 30 s", "after 300 ms".
  std::string After() const {
    const int64_t ms = total.count();
    return "after " +
           (ms % 1000 == 0 ? std::to_string(ms / 1000) + " s" : std::to_string(ms) + " ms");
  }
};

// strerror, lower-cased to read inside a sentence: "connection refused".
std::string Cause(int error) {
  std::string text = std::strerror(error);
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

void Put32(std::byte* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::byte>(value >> (24 - 8 * i));
}
uint32_t Get32(const std::byte* in) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value = (value << 8) | std::to_integer<uint32_t>(in[i]);
  return value;
}

// Waits until `fd` is ready for `events` (or has an error or hang-up, which the next call on it
// reports); false when the deadline passes first. `context` starts any error message.
bool WaitReady(int fd, short events, const Deadline& deadline, const std::string& context) {
  while (true) {
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, deadline.LeftMs());
    if (ready > 0) return true;
    if (ready == 0) {
      if (deadline.Passed()) return false;
      continue;  // woke a little early: wait for the rest
    }
    if (errno != EINTR) throw DistError(context + ": poll failed: " + Cause(errno));
  }
}

// Sends all of `bytes` on the non-blocking socket `fd` before the deadline.
void SendAll(int fd, std::span<const std::byte> bytes, const Deadline& deadline,
             const std::string& context) {
  while (!bytes.empty()) {
    if (!WaitReady(fd, POLLOUT, deadline, context))
      throw DistError(context + ": timed out " + deadline.After());
    // MSG_NOSIGNAL: a peer that went away is an EPIPE here, not a SIGPIPE that kills the process.
    const ssize_t sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw DistError(context + ": " + Cause(errno));
    }
    bytes = bytes.subspan(static_cast<size_t>(sent));
  }
}

// Reads exactly bytes.size() bytes from the non-blocking socket `fd` before the deadline; returns
// how many came before the peer closed the connection (bytes.size() when all did).
size_t RecvAll(int fd, std::span<std::byte> bytes, const Deadline& deadline,
               const std::string& context) {
  size_t done = 0;
  while (done < bytes.size()) {
    if (!WaitReady(fd, POLLIN, deadline, context))
      throw DistError(context + ": timed out " + deadline.After());
    const ssize_t got = ::recv(fd, bytes.data() + done, bytes.size() - done, 0);
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw DistError(context + ": " + Cause(errno));
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

// "10.0.0.5:41234", "[::1]:41234" (IPv4 peers of a dual-stack socket read as IPv4).
std::string NumericAddress(const sockaddr* address, socklen_t length) {
  char host[NI_MAXHOST];
  char port[NI_MAXSERV];
  if (::getnameinfo(address, length, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "an unknown address";
  std::string text = host;
  if (text.rfind("::ffff:", 0) == 0 && text.find('.') != std::string::npos) text.erase(0, 7);
  if (text.find(':') != std::string::npos) text = "[" + text + "]";
  return text + ":" + port;
}

// --- rank 0 ---------------------------------------------------------------------------------

// A listening socket on `port` of every interface. IPv6 with IPv4 mapped in (dual stack), so
// MASTER_ADDR may name rank 0 by either family; IPv4 alone where the kernel has no IPv6.
Fd Listen(int port, int backlog, const std::string& where) {
  bool ipv6 = true;
  Fd socket(::socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!socket.valid() && errno == EAFNOSUPPORT) {
    ipv6 = false;
    socket = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  }
  if (!socket.valid()) throw DistError(where + ": cannot create a socket: " + Cause(errno));
  // SO_REUSEADDR: the previous run's connections in TIME_WAIT must not keep the port.
  const int on = 1;
  const int off = 0;
  if (::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      (ipv6 && ::setsockopt(socket.get(), IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) != 0))
    throw DistError(where + ": cannot set socket options: " + Cause(errno));
  sockaddr_storage address{};
  socklen_t length = 0;
  if (ipv6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&address);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_any;
    in6->sin6_port = htons(static_cast<uint16_t>(port));
    length = sizeof(sockaddr_in6);
  } else {
    auto* in4 = reinterpret_cast<sockaddr_in*>(&address);
    in4->sin_family = AF_INET;
    in4->sin_addr.s_addr = htonl(INADDR_ANY);
    in4->sin_port = htons(static_cast<uint16_t>(port));
    length = sizeof(sockaddr_in);
  }
  if (::bind(socket.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
    const int error = errno;
    throw DistError(where + ": cannot listen: " + Cause(error) +
                    (error == EADDRINUSE ? " (another job on the same MASTER_PORT?)" : ""));
  }
  if (::listen(socket.get(), backlog) != 0)
    throw DistError(where + ": cannot listen: " + Cause(errno));
  return socket;
}

std::vector<std::byte> ServeAsRoot(const RankEnv& env, std::span<const std::byte> payload,
                                   const Deadline& deadline) {
  const std::string port = std::to_string(env.master_port);
  const std::string where = "rank 0: rendezvous on port " + port + " of all interfaces";
  const std::string world = std::to_string(env.world_size);
  Fd listener = Listen(env.master_port, env.world_size, where);

  // Every other rank's connection and address, by rank (rank 0's stay empty).
  std::vector<Fd> peers(static_cast<size_t>(env.world_size));
  std::vector<std::string> addresses(static_cast<size_t>(env.world_size));
  for (int joined = 0; joined < env.world_size - 1;) {
    if (!WaitReady(listener.get(), POLLIN, deadline, where)) {
      std::string missing;
      for (int r = 1; r < env.world_size; ++r)
        if (!peers[r].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      const bool several = env.world_size - 1 - joined > 1;
      throw DistError("rank 0: only " + std::to_string(joined) + " of " +
                      std::to_string(env.world_size - 1) +
                      " other ranks reached the rendezvous on port " + port + " " +
                      deadline.After() + "; missing: rank" + (several ? "s " : " ") + missing);
    }
    sockaddr_storage address{};
    socklen_t length = sizeof address;
    Fd peer(::accept4(listener.get(), reinterpret_cast<sockaddr*>(&address), &length,
                      SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!peer.valid()) {
      // Gone before we took it, or a signal: wait for the next one.
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED)
        continue;
      throw DistError(where + ": accept failed: " + Cause(errno));
    }
    const std::string from = NumericAddress(reinterpret_cast<sockaddr*>(&address), length);

    const std::string reading = "rank 0: reading the hello of a peer at " + from;
    std::array<std::byte, kHelloBytes> hello{};
    if (RecvAll(peer.get(), hello, deadline, reading) != hello.size() ||
        Get32(hello.data()) != kHelloMagic)
      throw DistError("rank 0: the connection from " + from + " to port " + port +
                      " is not a ctxtrain rank (no valid hello; another job on the same "
                      "MASTER_PORT?)");
    const uint32_t rank = Get32(hello.data() + 4);
    const uint32_t peer_world = Get32(hello.data() + 8);
    if (peer_world != static_cast<uint32_t>(env.world_size))
      throw DistError("rank 0: rank " + std::to_string(rank) + " at " + from +
                      " was started with " + std::to_string(peer_world) + " ranks, rank 0 with " +
                      world + "; every rank needs the same world size");
    if (rank == 0 || rank >= static_cast<uint32_t>(env.world_size))
      throw DistError("rank 0: the peer at " + from + " claims rank " + std::to_string(rank) +
                      "; accepted: 1.." + std::to_string(env.world_size - 1));
    if (peers[rank].valid())
      throw DistError("rank 0: rank " + std::to_string(rank) + " came twice, from " +
                      addresses[rank] + " and " + from + "; every rank needs its own number");
    peers[rank] = std::move(peer);
    addresses[rank] = from;
    ++joined;
  }

  // Only now, with every rank in and checked, does anyone get the payload: a rendezvous that
  // fails above fails for all ranks, none goes on to wait in NCCL for the others.
  std::vector<std::byte> reply(kReplyHeaderBytes + payload.size());
  Put32(reply.data(), kReplyMagic);
  Put32(reply.data() + 4, static_cast<uint32_t>(payload.size()));
  std::copy(payload.begin(), payload.end(), reply.begin() + kReplyHeaderBytes);
  for (int r = 1; r < env.world_size; ++r)
    SendAll(peers[r].get(), reply, deadline,
            "rank 0: sending the payload to rank " + std::to_string(r) + " at " + addresses[r]);
  return std::vector<std::byte>(payload.begin(), payload.end());
}

// --- the other ranks ------------------------------------------------------------------------

// Whether `socket` is connected to itself: a connect to a local port nobody listens on, from an
// ephemeral port the kernel happened to pick equal to it, succeeds as a TCP "simultaneous open".
// Launchers pick the rendezvous port from the same ephemeral range, so retries can hit it.
bool ConnectedToItself(int socket) {
  sockaddr_storage self{};
  sockaddr_storage peer{};
  socklen_t self_length = sizeof self;
  socklen_t peer_length = sizeof peer;
  if (::getsockname(socket, reinterpret_cast<sockaddr*>(&self), &self_length) != 0 ||
      ::getpeername(socket, reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0)
    return false;
  return self_length == peer_length && std::memcmp(&self, &peer, self_length) == 0;
}

// A connection to rank 0, retried every kRetryInterval until the deadline.
Fd ConnectToRoot(const RankEnv& env, const Deadline& deadline) {
  const std::string me = "rank " + std::to_string(env.rank);
  const std::string root = RendezvousAddress(env);
  const std::string port = std::to_string(env.master_port);
  std::string cause = "no attempt finished";
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    // Resolved again on every try: a cluster's DNS may learn rank 0's name after this rank starts.
    const int resolved = ::getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &found);
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, &::freeaddrinfo);
    if (resolved != 0) {
      cause = std::string("cannot resolve the address: ") +
              (resolved == EAI_SYSTEM ? Cause(errno) : ::gai_strerror(resolved));
    }
    for (const addrinfo* a = found; resolved == 0 && a != nullptr; a = a->ai_next) {
      Fd socket(
          ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (!socket.valid()) {
        cause = "cannot create a socket: " + Cause(errno);
        continue;
      }
      int error = 0;
      if (::connect(socket.get(), a->ai_addr, a->ai_addrlen) != 0) {
        error = errno;
        if (error == EINPROGRESS) {
          if (!WaitReady(socket.get(), POLLOUT, deadline, me + ": connecting to " + root)) {
            cause = "connection attempt timed out";
            break;
          }
          socklen_t length = sizeof error;
          if (::getsockopt(socket.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
        }
      }
      if (error == 0 && !ConnectedToItself(socket.get())) return socket;
      cause = error == 0 ? "connection refused" : Cause(error);
    }
    if (deadline.Passed()) break;
    // Rank 0 may start later than this rank: try again shortly.
    std::this_thread::sleep_until(std::min(Clock::now() + kRetryInterval, deadline.at));
    if (deadline.Passed()) break;
  }
  throw DistError(me + ": no rendezvous at " + root + " " + deadline.After() + ": " + cause);
}

std::vector<std::byte> JoinRoot(const RankEnv& env, const Deadline& deadline) {
  const std::string me = "rank " + std::to_string(env.rank);
  const std::string root = RendezvousAddress(env);
  Fd socket = ConnectToRoot(env, deadline);

  std::array<std::byte, kHelloBytes> hello{};
  Put32(hello.data(), kHelloMagic);
  Put32(hello.data() + 4, static_cast<uint32_t>(env.rank));
  Put32(hello.data() + 8, static_cast<uint32_t>(env.world_size));
  SendAll(socket.get(), hello, deadline, me + ": sending the hello to rank 0 at " + root);

  const std::string waiting = me + ": waiting for the payload from rank 0 at " + root;
  const std::string closed =
      waiting + ": rank 0 closed the connection (it failed or rejected this rank; see its log)";
  std::array<std::byte, kReplyHeaderBytes> header{};
  if (RecvAll(socket.get(), header, deadline, waiting) != header.size()) throw DistError(closed);
  const uint32_t length = Get32(header.data() + 4);
  if (Get32(header.data()) != kReplyMagic || length > kMaxSharedPayload)
    throw DistError(me + ": " + root + " is not a ctxtrain rendezvous (unexpected reply)");
  std::vector<std::byte> payload(length);
  if (RecvAll(socket.get(), payload, deadline, waiting) != payload.size()) throw DistError(closed);
  return payload;
}

}  // namespace

std::vector<std::byte> ShareFromRankZero(const RankEnv& env, std::span<const std::byte> payload,
                                         std::chrono::milliseconds timeout) {
  CTXPLAN_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
                "rank outside the world");
  CTXPLAN_CHECK(timeout.count() > 0, "rendezvous timeout must be positive");
  if (env.world_size == 1) return std::vector<std::byte>(payload.begin(), payload.end());
  CTXPLAN_CHECK(!env.master_addr.empty() && env.master_port >= 1 && env.master_port <= 65535,
                "rendezvous address missing");
  const Deadline deadline{Clock::now() + timeout, timeout};
  if (env.rank == 0) {
    CTXPLAN_CHECK(payload.size() <= kMaxSharedPayload, "rendezvous payload too large");
    return ServeAsRoot(env, payload, deadline);
  }
  return JoinRoot(env, deadline);
}

}  // namespace ctxplan::dist
