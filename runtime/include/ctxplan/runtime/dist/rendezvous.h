// The rendezvous of a multi-process run: rank 0 hands one small opaque blob (the ncclUniqueId,
// 128 bytes) to every other rank over plain TCP, before NCCL exists to do it. CUDA- and NCCL-free.
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ctxplan/runtime/dist/rank_env.h"

namespace ctxplan::dist {

// A run-time failure between ranks: a rank that never came, dropped its connection, or was
// started with another world size. Neither the user's input (InputError) nor our bug
// (InternalError): the other ranks' logs usually hold the cause.
class DistError : public std::runtime_error {
 public:
  explicit DistError(const std::string& message) : std::runtime_error(message) {}
};

// The most bytes ShareFromRankZero carries: it is meant for a small blob, and a peer rejects a
// larger announced length as not coming from a ctxtrain rank 0.
inline constexpr size_t kMaxSharedPayload = size_t{1} << 20;

// Rank 0's `payload`, on every rank of `env`. Collective: every rank calls it once.
//   rank 0      listens on TCP master_port on all interfaces (IPv4, and IPv6 where the kernel has
//               it), accepts world_size - 1 connections, reads each one's hello (protocol magic,
//               rank, world size), and once every rank has come, sends each the payload; returns
//               its own payload.
//   other ranks connect to master_addr:master_port, retrying every 100 ms (rank 0 may start
//               later), send their hello, and return the payload they receive; `payload` is
//               ignored on them.
// With world_size 1 it returns `payload` at once, touching no network.
// `timeout` bounds the whole call on every rank (each blocking step waits in poll() for what is
// left of it), except host name resolution: getaddrinfo() cannot be bounded, so a MASTER_ADDR
// whose DNS hangs can exceed it.
// DistError, one line naming this rank, the rendezvous address and the cause, e.g.
// "rank 1: no rendezvous at 10.0.0.1:29500 after 30 s: connection refused"; on rank 0 also a
// peer whose world size differs from rank 0's, a rank claimed twice, or a connection that is not
// a ctxtrain rank. A rank 0 that fails closes every connection, so the others fail at once too.
// InternalError if `env` is inconsistent (RankEnvFromEnvironment's are not), `payload` is larger
// than kMaxSharedPayload on rank 0, or `timeout` is not positive.
std::vector<std::byte> ShareFromRankZero(const RankEnv& env, std::span<const std::byte> payload,
                                         std::chrono::milliseconds timeout);

}  // namespace ctxplan::dist
