// CPU reference of the linear layer y = x W^T + b, W in Hugging Face layout [out][in]. Eigen does
// the products on row-major maps of the caller's buffers (no copies).
#include <Eigen/Core>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMatrix>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ConstVectorMap = Eigen::Map<const Eigen::VectorXf>;
using VectorMap = Eigen::Map<Eigen::VectorXf>;

}  // namespace

void LinearForward(const float* x, const float* w, const float* bias, int64_t m, int64_t n,
                   int64_t k, float* y) {
  CTXPLAN_CHECK(m >= 0 && n >= 0 && k >= 0, "negative linear shape");
  const ConstMatrixMap xm(x, m, k);  // [m][k]
  const ConstMatrixMap wm(w, n, k);  // [n][k]
  MatrixMap ym(y, m, n);             // [m][n]
  // noalias: y never overlaps x or W, so Eigen may write the product straight into y.
  ym.noalias() = xm * wm.transpose();
  if (bias != nullptr) ym.rowwise() += ConstVectorMap(bias, n).transpose();
}

void LinearBackward(const float* x, const float* w, const float* dy, int64_t m, int64_t n,
                    int64_t k, float* dx, float* d_w, float* d_bias) {
  CTXPLAN_CHECK(m >= 0 && n >= 0 && k >= 0, "negative linear shape");
  const ConstMatrixMap xm(x, m, k);                             // [m][k]
  const ConstMatrixMap wm(w, n, k);                             // [n][k]
  const ConstMatrixMap dym(dy, m, n);                           // [m][n]
  if (dx != nullptr) MatrixMap(dx, m, k).noalias() = dym * wm;  // [m][k], overwritten
  if (d_w != nullptr) MatrixMap(d_w, n, k).noalias() += dym.transpose() * xm;  // [n][k], added
  if (d_bias != nullptr) {
    // Column sums over the m rows in double: m is a whole chunk of tokens.
    VectorMap(d_bias, n) += dym.cast<double>().colwise().sum().transpose().cast<float>();
  }
}

}  // namespace ctxplan::kernels::cpu
