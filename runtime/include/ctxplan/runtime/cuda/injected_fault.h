// Faults injected for tests (environment CTXPLAN_INJECT_FAULT), each driving a real error path of
// the CUDA runtime end to end through ctxtrain: the error a GPU, its copy engines, the host or a
// peer would raise, raised the same way.
//   pinned-alloc   the page stores ask cudaHostAlloc for a PiB: pinning fails at start-up
//   arena-oom      the GPU arena asks cudaMalloc for a PiB more: its reservation fails
//   cuda-error     a kernel writes to an invalid address after the first attention backward:
//                  a sticky CUDA error mid-step
//   copy-error     the first batch of page copies home (D2H, mid-offload) reads from freed
//                  device memory: the copy fails on the copy engine
//   host-store     the pinned dKV store holds a single page: it runs out mid-step
//   nccl-error     the first NCCL send names a peer outside its communicator: NCCL refuses it
//   kill           the process sends itself SIGKILL after the first attention backward
// CTXPLAN_INJECT_FAULT_RANK=R limits the fault to rank R of a multi-GPU run (else every rank).
#pragma once

namespace ctxplan::gpu {

enum class InjectedFault {
  kNone,
  kPinnedAlloc,
  kArenaOom,
  kCudaError,
  kCopyError,
  kHostStore,
  kNcclError,
  kKill
};

// The fault asked for this rank; kNone when unset or meant for another rank. InputError naming
// the variable and the accepted values when it holds anything else.
InjectedFault InjectedFaultFromEnvironment(int rank);

}  // namespace ctxplan::gpu
