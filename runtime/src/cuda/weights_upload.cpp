#include "ctxplan/runtime/cuda/weights_upload.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <thread>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/bf16.h"

namespace ctxplan::gpu {

void UploadAsBf16(const std::vector<float>& host, void* device_bf16,
                  std::vector<uint16_t>& staging) {
  // Rounding 7.6B values (7B) on one thread takes tens of seconds: the host's cores share it.
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  staging.resize(host.size());
  const size_t per = (host.size() + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (unsigned p = 0; p < threads && p * per < host.size(); ++p)
    pool.emplace_back([&, p] {
      const size_t end = std::min(host.size(), (p + 1) * per);
      for (size_t j = p * per; j < end; ++j) staging[j] = Fp32ToBf16(host[j]);
    });
  for (std::thread& thread : pool) thread.join();
  CTXPLAN_CUDA_CHECK(cudaMemcpy(device_bf16, staging.data(), staging.size() * sizeof(uint16_t),
                                cudaMemcpyHostToDevice));
}

}  // namespace ctxplan::gpu
