#include "ctxplan/runtime/cuda/machine_identity.h"

#include <cuda_runtime_api.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace ctxplan::gpu {

std::string NvidiaDriverVersion() {
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Release Build ...": the version
  // is the first word of digits and dots with a dot in it ("x86_64" has none).
  std::ifstream file("/proc/driver/nvidia/version");
  std::string line, token;
  if (!std::getline(file, line)) return {};
  std::istringstream words(line);
  while (words >> token) {
    const bool version = std::isdigit(static_cast<unsigned char>(token[0])) &&
                         token.find('.') != std::string::npos &&
                         token.find_first_not_of("0123456789.") == std::string::npos;
    if (version) return token;
  }
  return {};
}

std::string GpuUuid(int cuda_device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, cuda_device) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; clear it so the caller's next check is its own
    return {};
  }
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof(text),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return text;
}

std::string HostCpuModel() {
  std::ifstream file("/proc/cpuinfo");
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) return {};
    const size_t first = line.find_first_not_of(" \t", colon + 1);
    return first == std::string::npos ? std::string() : line.substr(first);
  }
  return {};
}

}  // namespace ctxplan::gpu
