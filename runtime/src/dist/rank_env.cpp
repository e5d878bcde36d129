#include "ctxplan/runtime/dist/rank_env.h"

#include <charconv>
#include <climits>
#include <cstring>
#include <string>
#include <system_error>

#include "ctxplan/models/errors.h"

namespace ctxplan::dist {

namespace {

// One launcher's names for the three rank variables.
struct Convention {
  const char* rank;
  const char* world_size;
  const char* local_rank;
};

// In precedence order (see the header).
constexpr Convention kConventions[] = {
    {"RANK", "WORLD_SIZE", "LOCAL_RANK"},                                            // torchrun
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},  // Open MPI
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},                               // Slurm
};

constexpr const char* kMasterAddr = "MASTER_ADDR";
constexpr const char* kMasterPort = "MASTER_PORT";

std::string Setting(const char* name, const char* value) {
  return std::string("environment ") + name + "=\"" + value + "\"";
}

// `value` of variable `name` as an integer in [lo, hi]; `accepted` says what is, for the message.
int ParseInt(const char* name, const char* value, int lo, int hi, const std::string& accepted) {
  const char* end = value + std::strlen(value);
  int parsed = 0;
  const auto [stop, error] = std::from_chars(value, end, parsed);
  if (stop != end || error == std::errc::invalid_argument)
    throw InputError(Setting(name, value) + ": not an integer; accepted: " + accepted);
  if (error == std::errc::result_out_of_range || parsed < lo || parsed > hi)
    throw InputError(Setting(name, value) + ": out of range; accepted: " + accepted);
  return parsed;
}

RankEnv Read(const Convention& names, const std::function<const char*(const char*)>& getenv_fn) {
  const char* rank = getenv_fn(names.rank);
  const char* world_size = getenv_fn(names.world_size);
  const char* local_rank = getenv_fn(names.local_rank);
  const char* addr = getenv_fn(kMasterAddr);
  const char* port = getenv_fn(kMasterPort);

  RankEnv env;
  // The world first: the rank's range depends on it.
  if (world_size == nullptr)
    throw InputError(std::string("environment ") + names.world_size + " is not set, but " +
                     names.rank + " is (\"" + rank +
                     "\"); accepted: the number of ranks, 1 or more");
  env.world_size = ParseInt(names.world_size, world_size, 1, INT_MAX, "1 or more");
  const std::string rank_range =
      std::string("0..") + names.world_size + "-1 = 0.." + std::to_string(env.world_size - 1);
  env.rank = ParseInt(names.rank, rank, 0, env.world_size - 1, rank_range);
  // One node launched without a local rank (e.g. a bare mpirun of one host's ranks): the rank is
  // the local rank.
  env.local_rank = local_rank == nullptr
                       ? env.rank
                       : ParseInt(names.local_rank, local_rank, 0, env.world_size - 1, rank_range);

  // The rendezvous: only needed with other ranks to meet.
  const std::string needed = std::string("required when ") + names.world_size + "=" +
                             std::to_string(env.world_size) + " > 1";
  if (addr != nullptr && *addr != '\0') {
    env.master_addr = addr;
  } else if (env.world_size > 1) {
    throw InputError(std::string("environment ") + kMasterAddr +
                     (addr == nullptr ? " is not set" : " is empty") +
                     "; accepted: rank 0's host name or IP address, " + needed);
  }
  if (port != nullptr && *port != '\0') {
    env.master_port = ParseInt(kMasterPort, port, 1, 65535, "a TCP port, 1..65535");
  } else if (env.world_size > 1) {
    throw InputError(std::string("environment ") + kMasterPort +
                     (port == nullptr ? " is not set" : " is empty") +
                     "; accepted: rank 0's rendezvous TCP port, 1..65535, " + needed);
  }
  return env;
}

}  // namespace

std::optional<RankEnv> RankEnvFromEnvironment(
    const std::function<const char*(const char*)>& getenv_fn) {
  for (const Convention& names : kConventions)
    if (getenv_fn(names.rank) != nullptr) return Read(names, getenv_fn);
  return std::nullopt;
}

std::string RendezvousAddress(const RankEnv& env) {
  const bool ipv6 = env.master_addr.find(':') != std::string::npos;
  return (ipv6 ? "[" + env.master_addr + "]" : env.master_addr) + ":" +
         std::to_string(env.master_port);
}

std::string Describe(const RankEnv& env) {
  std::string text = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                     " (local " + std::to_string(env.local_rank) + ")";
  if (!env.master_addr.empty() && env.master_port != 0)
    text += ", rendezvous " + RendezvousAddress(env);
  return text;
}

}  // namespace ctxplan::dist
