#include "ctxplan/runtime/cuda/injected_fault.h"

#include <cstdlib>
#include <string>
#include <utility>

#include "ctxplan/models/errors.h"

namespace ctxplan::gpu {

InjectedFault InjectedFaultFromEnvironment(int rank) {
  const char* value = std::getenv("CTXPLAN_INJECT_FAULT");
  if (value == nullptr || *value == '\0') return InjectedFault::kNone;
  static constexpr std::pair<const char*, InjectedFault> kFaults[] = {
      {"pinned-alloc", InjectedFault::kPinnedAlloc},
      {"arena-oom", InjectedFault::kArenaOom},
      {"cuda-error", InjectedFault::kCudaError},
      {"copy-error", InjectedFault::kCopyError},
      {"host-store", InjectedFault::kHostStore},
      {"nccl-error", InjectedFault::kNcclError},
      {"kill", InjectedFault::kKill}};
  InjectedFault fault = InjectedFault::kNone;
  std::string accepted;
  for (const auto& [name, f] : kFaults) {
    if (name == std::string(value)) fault = f;
    accepted += (accepted.empty() ? "" : ", ") + std::string(name);
  }
  if (fault == InjectedFault::kNone)
    throw InputError("CTXPLAN_INJECT_FAULT: '" + std::string(value) +
                     "' is not a fault; accepted: " + accepted + " (or unset)");
  const char* only = std::getenv("CTXPLAN_INJECT_FAULT_RANK");
  if (only != nullptr && *only != '\0') {
    char* end = nullptr;
    const long r = std::strtol(only, &end, 10);
    if (*end != '\0' || r < 0)
      throw InputError("CTXPLAN_INJECT_FAULT_RANK: '" + std::string(only) +
                       "' is not a rank; accepted: a non-negative integer (or unset)");
    if (r != rank) return InjectedFault::kNone;
  }
  return fault;
}

}  // namespace ctxplan::gpu
