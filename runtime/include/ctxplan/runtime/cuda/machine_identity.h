// Which machine a measurement came from: the NVIDIA driver, the GPU's UUID and the host's CPU.
// Lent machines of one kind differ (a GPU's power draw, a host's memory bandwidth by 30%), so
// ctxtrain's traces and ctxplan-measure's samples name the very GPU and host they ran on.
// Each returns "" where it cannot tell; none throws.
#pragma once

#include <string>

namespace ctxplan::gpu {

// The NVIDIA kernel module's version ("580.95.05"), from /proc/driver/nvidia/version.
// (cudaDriverGetVersion gives the CUDA version the driver supports, not this.)
std::string NvidiaDriverVersion();

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it.
std::string GpuUuid(int cuda_device);

// The host CPU's model name from /proc/cpuinfo, e.g. "Intel(R) Xeon(R) Platinum 8480+".
std::string HostCpuModel();

}  // namespace ctxplan::gpu
