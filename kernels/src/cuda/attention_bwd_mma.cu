// Paged attention backward on mma.sync m16n8k16 (8 warps x 16 keys, FlashAttention-2 style): the
// main kernel of attention_bwd.cu's method before the wgmma one, kept to compare against it
// (CTXPLAN_ATTN_BWD=mma). Same decomposition, key blocks, items and epilogue; dQ by fp32 atomics
// into the [t][H_q][d] accumulator.
#include <algorithm>

#include "attention_bwd_common.cuh"
#include "ctxplan/kernels/cuda/check.h"

namespace ctxplan::kernels::cuda::bwd {
namespace {

template <int HD>
struct BwdSmem {
  static constexpr int kKV = kBwdBN * HD * 2;  // one of K, V
  static constexpr int kQ = kBwdBM * HD * 2;   // one buffer of Q or dO
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKV;
  static constexpr int kQb = kV + kKV;                  // 2 buffers
  static constexpr int kdO = kQb + 2 * kQ;              // 2 buffers
  static constexpr int kdS = kdO + 2 * kQ;              // [128 keys][64 q] bf16
  static constexpr int kL = kdS + kBwdBN * kBwdBM * 2;  // [2][64] fp32
  static constexpr int kD = kL + 2 * kBwdBM * 4;        // [2][64] fp32
  static constexpr int kUnion = kD + 2 * kBwdBM * 4;    // uint32 union, int32 tile count
  static constexpr int kMask = kUnion + 16;             // [sel_tiles] uint32, [n_q_tiles] int32
  static int Bytes(int sel_tiles, int q_tiles) { return kMask + 4 * sel_tiles + 4 * q_tiles; }
};

template <int HD, bool kOverUnion>
__global__ void __launch_bounds__(kBwdThreads, 1) AttnBwdKernel(const BwdParams prm) {
  using L = BwdSmem<HD>;
  constexpr int BN = kBwdBN, BM = kBwdBM;
  constexpr int kDn = HD / 8;  // n-tiles of dK / dV rows
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t s_base = SmemAddr(smem);
  const uint32_t sK = s_base + L::kK, sV = s_base + L::kV;
  const uint32_t sQ = s_base + L::kQb, sdO = s_base + L::kdO, sdS = s_base + L::kdS;
  const uint32_t sL = s_base + L::kL, sD = s_base + L::kD;
  float* sLf = reinterpret_cast<float*>(smem + L::kL);
  float* sDf = reinterpret_cast<float*>(smem + L::kD);
  uint32_t* s_union = reinterpret_cast<uint32_t*>(smem + L::kUnion);
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(smem + L::kMask);
  int* s_count = reinterpret_cast<int*>(smem + L::kUnion + 4);
  int* s_tiles = reinterpret_cast<int*>(smem + L::kMask) + prm.sel_tiles;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const KeyBlock block = LocateKeyBlock<BN, kOverUnion>(prm);
  const int hkv = block.hkv;
  const bool earlier = block.earlier;
  const int kb0 = block.kb0;
  const int t = prm.t;
  const int region_end = block.end;  // valid key index bound
  const int64_t kv_row = static_cast<int64_t>(prm.hkv) * HD;
  const bool sparse = earlier && prm.sel != nullptr;
  const int first_page = earlier ? kb0 / prm.p : 0;

  // Which of the block's pages each selection tile selected (sparse), and their union.
  uint32_t union_mask = 0xffffffffu;
  if (sparse) {
    union_mask = ScanSelections<kBwdThreads, BN>(prm, kb0, region_end, first_page, s_mask, s_union);
    if (union_mask == 0u) return;  // no tile attends these keys
  }
  const int qt_begin = earlier ? 0 : kb0 / BM;
  const int n_tiles =
      sparse ? CollectSelectedTiles(s_mask, prm.n_q_tiles, prm.query_tile / BM, s_tiles, s_count)
             : prm.n_q_tiles - qt_begin;

  // Key rows of this thread in S^T: warp * 16 + g (+ 8).
  const int kr0 = warp * 16 + g;
  bool key_ok[2];
  int key_bit[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int kidx = kb0 + kr0 + hf * 8;
    key_bit[hf] = earlier ? kidx / prm.p - first_page : 0;
    key_ok[hf] = kidx < region_end && ((union_mask >> key_bit[hf]) & 1u);
  }

  // --- K and V of the block (once) ---
  LoadKeyBlockKv<HD, BN, kBwdThreads>(prm, kb0, earlier, region_end, union_mask, first_page, hkv,
                                      kv_row, sK, sV,
                                      [](int row, int c) { return SwzOffset<HD>(row, c); });

  // --- iteration over (query head of the group, 64-query tile) ---
  // Items: every query head of the group, and per head the block's query tiles in ascending order
  // (descending makes blocks running side by side add into the same dQ rows at the same moment:
  // slower, kernels/PERF.md). Item (hl, i) is tile tile_at(i) of head hl.
  auto tile_at = [&](int i) { return sparse ? s_tiles[i] : qt_begin + i; };
  auto advance = [&](int& hl, int& i) {
    if (++i >= n_tiles) {
      i = 0;
      ++hl;
    }
  };
  auto load_item = [&](int hl, int qt, int buf) {
    LoadItemOperands<HD, BM, kBwdThreads, L::kQ>(
        prm, hkv * prm.group + hl, qt * BM, sQ, sdO, sL, sD, buf,
        [](int row, int c) { return SwzOffset<HD>(row, c); });
  };

  int hl = 0, item = 0;
  load_item(hl, tile_at(item), 0);
  CpAsyncCommit();

  float dk[kDn][4], dv[kDn][4];
#pragma unroll
  for (int n = 0; n < kDn; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dk[n][e] = 0.0f;
      dv[n][e] = 0.0f;
    }

  const int a_row = lane & 15, a_chk = lane >> 4;                              // A x4
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_chk = (lane >> 3) & 1;  // B x4
  const int t_row = (lane & 7) + (((lane >> 3) & 1) << 3), t_chk = lane >> 4;  // B x4.trans
  // dQ phase: warp (wm, wn) computes queries wm*16.., d columns wn*HD/2..
  const int wm = warp & 3, wn = warp >> 2;
  const int dsa_row = (lane & 7) + ((lane >> 4) << 3), dsa_chk = (lane >> 3) & 1;  // A^T x4.trans

  for (int n = 0; hl < prm.group; ++n) {
    const int buf = n & 1;
    const int h = hkv * prm.group + hl;
    const int q0 = tile_at(item) * BM;
    CpAsyncWait<0>();
    __syncthreads();
    {  // prefetch the next item
      int nhl = hl, nitem = item;
      advance(nhl, nitem);
      if (nhl < prm.group) load_item(nhl, tile_at(nitem), buf ^ 1);
      CpAsyncCommit();
    }
    const uint32_t qbuf = sQ + buf * L::kQ, dobuf = sdO + buf * L::kQ;
    const float* lrow = sLf + buf * BM;
    const float* drow = sDf + buf * BM;

    // S^T = K Q^T : [16 keys][64 queries] per warp.
    float s[BM / 8][4];
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t ka[4];
      Ldsm4(ka, sK + SwzOffset<HD>(warp * 16 + a_row, kk * 2 + a_chk));
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t qb[4];
        Ldsm4(qb, qbuf + SwzOffset<HD>(np * 16 + b_row, kk * 2 + b_chk));
        Mma(s[2 * np], ka, qb[0], qb[1]);
        Mma(s[2 * np + 1], ka, qb[2], qb[3]);
      }
    }

    // P^T = exp2(S^T * scale * log2e - LSE2[q]), masked.
    bool row_ok[2] = {key_ok[0], key_ok[1]};
    if (sparse) {
      const uint32_t m = s_mask[q0 / prm.query_tile];
      row_ok[0] = row_ok[0] && ((m >> key_bit[0]) & 1u);
      row_ok[1] = row_ok[1] && ((m >> key_bit[1]) & 1u);
    }
    const bool full = row_ok[0] && row_ok[1] && q0 + BM <= t && (earlier || q0 >= kb0 + BN);
    // Two copies of the loop, the unmasked one without the mask arithmetic (as in the wgmma
    // kernel below, where leaving it to the compiler cost the over-the-union variant 10-19%).
    auto exponentiate = [&](auto masked) {
#pragma unroll
      for (int nt = 0; nt < BM / 8; ++nt) {
        const float2 l2 = *reinterpret_cast<const float2*>(lrow + nt * 8 + 2 * tq);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lv = (e & 1) ? l2.y : l2.x;
          float pv = Exp2(fmaf(s[nt][e], prm.scale_log2, -lv));
          if constexpr (decltype(masked)::value) {
            const int qi = q0 + nt * 8 + 2 * tq + (e & 1);
            const int kidx = kb0 + kr0 + (e >> 1) * 8;
            const bool ok = row_ok[e >> 1] && qi < t && (earlier || kidx <= qi);
            pv = ok ? pv : 0.0f;
          }
          s[nt][e] = pv;
        }
      }
    };
    if (full) {
      exponentiate(std::false_type{});
    } else {
      exponentiate(std::true_type{});
    }

    // dV += P^T dO.
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      uint32_t pa[4];
      pa[0] = PackBf16(s[2 * kq][0], s[2 * kq][1]);
      pa[1] = PackBf16(s[2 * kq][2], s[2 * kq][3]);
      pa[2] = PackBf16(s[2 * kq + 1][0], s[2 * kq + 1][1]);
      pa[3] = PackBf16(s[2 * kq + 1][2], s[2 * kq + 1][3]);
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t ob[4];
        Ldsm4T(ob, dobuf + SwzOffset<HD>(kq * 16 + t_row, dp * 2 + t_chk));
        Mma(dv[2 * dp], pa, ob[0], ob[1]);
        Mma(dv[2 * dp + 1], pa, ob[2], ob[3]);
      }
    }

    // dP^T = V dO^T.
    float dp_[BM / 8][4];
#pragma unroll
    for (int nt = 0; nt < BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp_[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t va[4];
      Ldsm4(va, sV + SwzOffset<HD>(warp * 16 + a_row, kk * 2 + a_chk));
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        uint32_t ob[4];
        Ldsm4(ob, dobuf + SwzOffset<HD>(np * 16 + b_row, kk * 2 + b_chk));
        Mma(dp_[2 * np], va, ob[0], ob[1]);
        Mma(dp_[2 * np + 1], va, ob[2], ob[3]);
      }
    }

    // dS^T = P^T (dP^T - D[q]); packed bf16, stored to shared for dQ; dK += dS^T Q.
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      uint32_t da[4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int nt = 2 * kq + half;
        const float2 d2 = *reinterpret_cast<const float2*>(drow + nt * 8 + 2 * tq);
        const float x0 = s[nt][0] * (dp_[nt][0] - d2.x);
        const float x1 = s[nt][1] * (dp_[nt][1] - d2.y);
        const float x2 = s[nt][2] * (dp_[nt][2] - d2.x);
        const float x3 = s[nt][3] * (dp_[nt][3] - d2.y);
        da[half * 2 + 0] = PackBf16(x0, x1);  // key row g
        da[half * 2 + 1] = PackBf16(x2, x3);  // key row g + 8
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sdS + SwzOffset<BM>(kr0, nt) + tq * 4),
                     "r"(da[half * 2 + 0])
                     : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sdS + SwzOffset<BM>(kr0 + 8, nt) + tq * 4),
                     "r"(da[half * 2 + 1])
                     : "memory");
      }
      // A fragment order: (g, q lo), (g+8, q lo), (g, q hi), (g+8, q hi).
      const uint32_t a[4] = {da[0], da[1], da[2], da[3]};
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t qb[4];
        Ldsm4T(qb, qbuf + SwzOffset<HD>(kq * 16 + t_row, dp * 2 + t_chk));
        Mma(dk[2 * dp], a, qb[0], qb[1]);
        Mma(dk[2 * dp + 1], a, qb[2], qb[3]);
      }
    }
    __syncthreads();

    // dQ[64 q][HD] += dS K, warp (wm, wn): 16 queries x HD/2 columns; fp32 atomics.
    {
      float dqa[HD / 16][4];
#pragma unroll
      for (int nt = 0; nt < HD / 16; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dqa[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[4];
        Ldsm4T(a, sdS + SwzOffset<BM>(kk * 16 + dsa_row, wm * 2 + dsa_chk));
#pragma unroll
        for (int dp = 0; dp < HD / 32; ++dp) {
          uint32_t kb[4];
          Ldsm4T(kb, sK + SwzOffset<HD>(kk * 16 + t_row, wn * (HD / 16) + dp * 2 + t_chk));
          Mma(dqa[2 * dp], a, kb[0], kb[1]);
          Mma(dqa[2 * dp + 1], a, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int qi = q0 + wm * 16 + g + hf * 8;
        if (qi < t) {
          float* dst =
              prm.dq_acc + (static_cast<int64_t>(qi) * prm.hq + h) * HD + wn * (HD / 2) + 2 * tq;
#pragma unroll
          for (int nt = 0; nt < HD / 16; ++nt)
            atomicAdd(reinterpret_cast<float2*>(dst + nt * 8),
                      make_float2(dqa[nt][2 * hf], dqa[nt][2 * hf + 1]));
        }
      }
    }
    advance(hl, item);
  }
  CpAsyncWait<0>();

  // --- epilogue: dK (scaled) and dV of the block's keys ---
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    if (!key_ok[hf]) continue;
    const int kidx = kb0 + kr0 + hf * 8;
    if (!earlier) {
      StoreOwnRow<kDn>(
          prm, kidx, hkv * HD + 2 * tq,
          [&](int nt) {
            return make_float2(dk[nt][2 * hf] * prm.scale, dk[nt][2 * hf + 1] * prm.scale);
          },
          [&](int nt) { return make_float2(dv[nt][2 * hf], dv[nt][2 * hf + 1]); });
    } else {
      const int pg = kidx / prm.p, off = kidx - pg * prm.p;
      const int64_t slot = __ldg(prm.dkv_slot + pg);
      const int64_t kofs = slot * prm.page_elems + off * kv_row + hkv * HD + 2 * tq;
      const int64_t vofs = kofs + prm.p * kv_row;
      auto dk_pair = [&](int nt) {
        return make_float2(dk[nt][2 * hf] * prm.scale, dk[nt][2 * hf + 1] * prm.scale);
      };
      auto dv_pair = [&](int nt) { return make_float2(dv[nt][2 * hf], dv[nt][2 * hf + 1]); };
      if (prm.dkv_f32) {
        AddRowIntoPool<kDn>(static_cast<float*>(prm.dkv_pool), kofs, vofs, dk_pair, dv_pair);
      } else {
        AddRowIntoPool<kDn>(static_cast<bf16*>(prm.dkv_pool), kofs, vofs, dk_pair, dv_pair);
      }
    }
  }
}

}  // namespace

template <int HD>
void LaunchMmaKernel(const BwdParams& prm, dim3 grid, int sel_tiles, int q_tiles,
                     cudaStream_t stream) {
  const int smem = BwdSmem<HD>::Bytes(sel_tiles, q_tiles);
  Require(smem <= kMaxBwdSmem, "too many selection tiles for the backward's shared memory");
  auto launch = [&](auto kernel) {
    CTXPLAN_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, kBwdThreads, smem, stream>>>(prm);
    CTXPLAN_CUDA_CHECK_LAUNCH();
  };
  if (prm.union_pages != nullptr) {
    launch(AttnBwdKernel<HD, true>);
  } else {
    launch(AttnBwdKernel<HD, false>);
  }
}

template void LaunchMmaKernel<64>(const BwdParams&, dim3, int, int, cudaStream_t);
template void LaunchMmaKernel<128>(const BwdParams&, dim3, int, int, cudaStream_t);

}  // namespace ctxplan::kernels::cuda::bwd
