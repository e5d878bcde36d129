// The one-node launcher behind `ctxtrain --gpus N`: N copies of a program, one per GPU, given
// the torchrun-style rank variables that RankEnvFromEnvironment reads, and supervised as one run.
// CUDA- and NCCL-free.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace ctxplan::dist {

// Runs `ranks` children `executable` args... (args are argv[1..]; argv[0] is `executable`, a
// path: PATH is not searched) and waits for them. Each child's environment is this process's
// plus RANK=i, WORLD_SIZE=ranks, LOCAL_RANK=i, MASTER_ADDR=127.0.0.1, MASTER_PORT=<a port
// FreeLocalPort found>, NCCL_NVLS_ENABLE=0 (always: NVLink multicast must stay off on our GPU
// machines) and CTXPLAN_LOCAL_LAUNCH_REPORT=<a path no file has yet>, these replacing any
// same-named variables inherited. A run that fails says so in one line, whoever says it: a rank
// (or this launcher) prints its error line only after ClaimTheErrorLine() won the path.
//   - All exit 0: returns 0, printing nothing.
//   - As soon as one exits non-zero or dies by a signal, sends the others SIGTERM, then SIGKILL
//     to any still running 10 s later, waits for all of them, and returns the failed rank's exit
//     code (128 + the signal if killed). Unless a rank has claimed the error line (printed its
//     own, naming its rank and the cause), it prints one line to `err`: "ctxtrain: rank 1 failed
//     (exit code 1); stopped the other ranks" or "... (killed by signal 9: SIGKILL); ...".
// While it runs, SIGINT and SIGTERM sent to this process are forwarded to the children (which
// stay in this process's group, so a terminal's Ctrl-C reaches them directly as well; ctxtrain's
// stop handler takes a repeated signal as one); the previous handlers come back on return. One
// call at a time per process (the handler's state is global).
// DistError if a child cannot be started, after killing and reaping the ones that were.
// InternalError unless ranks >= 1.
int LaunchLocalRanks(const std::string& executable, const std::vector<std::string>& args, int ranks,
                     std::ostream& err);

// True in a rank started by LaunchLocalRanks.
bool LaunchedByLocalLauncher();

// In a rank started by LaunchLocalRanks: true for the first of the ranks (and the launcher) to
// ask, false after (the run's error line is said already; the same input error on every rank is
// said once). Elsewhere always true.
bool ClaimTheErrorLine();

// A TCP port of 127.0.0.1 free right now: bound with port 0, read back, closed. Another process
// may take it before the caller binds it (unlikely; rank 0 then fails with "address in use").
// DistError if no socket can be bound.
int FreeLocalPort();

// This program's own path (/proc/self/exe), to start copies of it. DistError if unreadable.
std::string ExecutablePath();

}  // namespace ctxplan::dist
