// Which rank this process is in a multi-process (one process per GPU) run, read from the
// environment its launcher set. CUDA- and NCCL-free.
#pragma once

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

namespace ctxplan::dist {

struct RankEnv {
  int rank = 0;             // 0..world_size-1; rank 0 hosts the rendezvous
  int world_size = 1;       // processes in the run
  int local_rank = 0;       // rank among the processes of this node: picks the GPU
  std::string master_addr;  // rank 0's host name or IP address; may be empty when world_size 1
  int master_port = 0;      // rank 0's rendezvous TCP port, 1..65535; 0 = none (world_size 1)
};

// Reads the first launcher convention whose rank variable is set, in this order:
//   torchrun   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//   Open MPI   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   Slurm      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
// (so torchrun inside an mpirun or srun job wins, and mpirun inside a Slurm allocation). mpirun
// and srun set no rendezvous address: MASTER_ADDR and MASTER_PORT are read under those names in
// every convention, required when the world has more than one rank, optional (but checked when
// set) with one. The local rank defaults to the rank when its variable is missing (one node).
// nullopt when no convention's rank variable is set: a plain one-process run.
// InputError, one line naming the variable, its value and what is accepted, for anything else:
// "environment RANK=\"x\": not an integer; accepted: 0..WORLD_SIZE-1 = 0..1".
// A Slurm batch script run without srun sees SLURM_PROCID=0 and the job's SLURM_NTASKS: it is
// rank 0 of the job, and waits for ranks nobody started until its rendezvous times out.
// `getenv_fn` is the process environment unless a test passes its own.
std::optional<RankEnv> RankEnvFromEnvironment(
    const std::function<const char*(const char*)>& getenv_fn = [](const char* name) {
      return static_cast<const char*>(std::getenv(name));
    });

// "127.0.0.1:29500", "[fe80::1]:29500" (an IPv6 address bracketed): the rendezvous as messages
// name it.
std::string RendezvousAddress(const RankEnv& env);

// "rank 1 of 2 (local 1), rendezvous 127.0.0.1:29500"; "rank 0 of 1 (local 0)" without one.
std::string Describe(const RankEnv& env);

}  // namespace ctxplan::dist
