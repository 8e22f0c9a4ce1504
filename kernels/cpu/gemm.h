// The register-tiled matrix product the CPU kernels share (tree_attention.cc, weight_grad.cc):
// C[m][n] += A[m][k] B[k][n] with B and C row-major and A read through strides, so a transposed
// operand needs no copy. Header-only: every kernel source compiles it for the same target
// (-march=native).

#pragma once

#include <algorithm>

namespace jtree_cpu {

// The vector type of the machine the library is compiled for (-march=native): its width and how
// many vector registers it has, which bound the micro-kernel's register tile.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64, kRegisters = 32;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32, kRegisters = 16;
#else
constexpr int kVectorBytes = 16, kRegisters = 16;
#endif
constexpr int kLanes = kVectorBytes / 4;

// Values (accumulators, operands) have the vector's natural alignment, so that GCC keeps them in
// registers; memory is read and written through `vf_unaligned`. With an under-aligned value type
// GCC kept every accumulator of `gemm_tile` on the stack and copied each load through it
// (measured: the products ran at about a quarter of their speed).
typedef float vf __attribute__((vector_size(kVectorBytes)));
typedef float vf_unaligned __attribute__((vector_size(kVectorBytes), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }

// A matrix read element by element: A(r, c) = data[r * row_stride + c * col_stride], so a
// transposed operand (dS^T, P^T in the backward) needs no copy.
struct StridedA {
  const float* data;
  long row_stride, col_stride;
  float at(long r, long c) const { return data[r * row_stride + c * col_stride]; }
  StridedA rows_from(long r) const { return {data + r * row_stride, row_stride, col_stride}; }
};

// C[R][kLanes*NV] += A[R][k] B[k][kLanes*NV] (B and C row-major, leading dimensions ldb / ldc).
template <int NV, int R>
inline void gemm_tile(StridedA A, const float* B, long ldb, float* C, long ldc, int k) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = load(C + r * ldc + kLanes * v);
  for (int kk = 0; kk < k; ++kk) {
    vf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(B + kk * ldb + kLanes * v);
    for (int r = 0; r < R; ++r) {
      const float a = A.at(r, kk);
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + kLanes * v, acc[r][v]);
}

// Rows of C[m][kLanes*NV] in tiles of R rows: R * NV accumulators, NV operands and the broadcast
// A value fit in the registers.
template <int NV>
inline void gemm_panel(StridedA A, const float* B, long ldb, float* C, long ldc, int m, int k) {
  constexpr int R = std::max(1, std::min(4, (kRegisters - NV - 1) / NV));
  int i = 0;
  for (; i + R <= m; i += R) gemm_tile<NV, R>(A.rows_from(i), B, ldb, C + i * ldc, ldc, k);
  for (; i < m; ++i) gemm_tile<NV, 1>(A.rows_from(i), B, ldb, C + i * ldc, ldc, k);
}

constexpr int kPanelVectors = 4;  // columns of C per panel: kPanelVectors * kLanes

// C[m][n] += A[m][k] B[k][n]: column panels of up to kPanelVectors vectors over the columns that
// fill whole vectors, a scalar loop over the last n % kLanes.
inline void gemm(StridedA A, const float* B, long ldb, float* C, long ldc, int m, int n, int k) {
  const int vector_cols = n - n % kLanes;
  for (int j = 0; j < vector_cols; j += kPanelVectors * kLanes) {
    switch (std::min(kPanelVectors, (vector_cols - j) / kLanes)) {
      case 1: gemm_panel<1>(A, B + j, ldb, C + j, ldc, m, k); break;
      case 2: gemm_panel<2>(A, B + j, ldb, C + j, ldc, m, k); break;
      case 3: gemm_panel<3>(A, B + j, ldb, C + j, ldc, m, k); break;
      case 4: gemm_panel<4>(A, B + j, ldb, C + j, ldc, m, k); break;
    }
  }
  for (int i = 0; i < m; ++i)
    for (int kk = 0; kk < k; ++kk) {
      const float a = A.at(i, kk);
      for (int j = vector_cols; j < n; ++j) C[i * ldc + j] += a * B[kk * ldb + j];
    }
}

// A row-major matrix with `ld` floats per row, as a gemm operand; `transposed` reads it as A^T.
inline StridedA rows(const float* data, long ld) { return {data, ld, 1}; }
inline StridedA transposed(const float* data, long ld) { return {data, 1, ld}; }

}  // namespace jtree_cpu
