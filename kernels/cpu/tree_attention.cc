// Block-sparse tree attention for the CPU backend, as XLA FFI custom calls: forward and backward.
//
// Why it exists: XLA:CPU runs a `while` loop on one thread, so the `xla` kernel's block loop keeps
// one core busy while the other waits (measured: ~62 GFLOP/s per block pair, process CPU time =
// wall time). Here the (q-block, kv-head) work items are spread over threads, and each block's
// matmuls are small register-tiled GEMMs over GCC vector types.
//
// Layouts (the `xla` kernel's block layout, see kernels/attention_xla.py):
//   q, dq             : [NQ, H, M, D]   M = g * bq rows; row m is query head h*g + m / bq at
//                                       position m % bq of the q-block
//   out, d_out        : [NQ, H, M, DV]
//   k, dk             : [NK, H, bk, D]  global kv-block ids (row r's blocks are r*nk .. r*nk+nk-1)
//   v, dv             : [NK, H, bk, DV] DV: the value head dim, D's or not (MLA)
//   lse, delta        : [NQ, H, M]
//   end               : [NK, bk]        subtree end of every key (row coordinates)
//   q_pos             : [NQ, bq]        key position of every query
//   kv_index, kv_kind : [NQ, L]         the kv-blocks each q-block visits, and FULL (2) / PARTIAL
//   count             : [NQ]            how many of them
//   k_path            : [NK, bk]        path position of every key (sliding window)
//   q_path            : [NQ, bq]        path position of every query
// Query i sees key j iff j <= q_pos[i] < end[j], and with a window W > 0 (attribute `window`,
// 0: none) also q_path[i] - k_path[j] < W; FULL blocks skip the element test.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.h"
#include "threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jtree_cpu::StridedA;
using jtree_cpu::gemm;
using jtree_cpu::rows;
using jtree_cpu::thread_count;
using jtree_cpu::transposed;

constexpr float kMasked = -1e30f;  // finite, as in the xla kernel: exp(m_old - m_new) stays defined
constexpr int32_t kFull = 2;

// x = exp(x), a loop of nothing else so that GCC calls the vector exp (glibc libmvec); fused into a
// loop with a compare or a select it fell back to scalar expf, 6-8x slower (measured).
__attribute__((noinline)) void exp_in_place(float* x, long n) {
  for (long i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

// Exponent floor before exp: far below any kept probability, and above the range where the
// vector exp takes its slow special-case path (results that underflow).
constexpr float kExpFloor = -80.f;


// dst[c][r] = src[r][c] for a rows x cols matrix.
void transpose(const float* src, int rows, int cols, float* dst) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

struct Shape {
  int64_t nq, h, m, d, nk, bk, bq, max_kv, nk_row;
  int64_t dv;  // the value head dim (MLA: not d)
};

// Runs fn(item, thread) over items 0..n-1 (heaviest first by `cost`) on up to `threads` threads.
template <typename Fn>
void parallel_items(int64_t n, const std::vector<int64_t>& cost, int threads, Fn fn) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  auto work = [&](int t) {
    for (int64_t i = next++; i < n; i = next++) fn(order[i], t);
  };
  jtree_cpu::run_on_threads(threads, work);
}

// Runs fn(item, thread) over items 0..n-1 on `threads` threads, each running a fixed list: heaviest
// item first (by `cost`, ties by index) to the thread with the least cost so far (ties to the
// lowest thread). Unlike `parallel_items`, which thread runs an item, and in which order each thread
// runs its items, is a function of the costs and the thread count alone, never of timing: the
// backward sums every item's dk/dv into its thread's accumulator, and floating-point addition in an
// order that varied from call to call made the gradients differ in their last bits between
// identical runs.
template <typename Fn>
void parallel_items_fixed(int64_t n, const std::vector<int64_t>& cost, int threads, Fn fn) {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<int64_t>> lists(threads);
  std::vector<int64_t> load(threads, 0);
  for (int64_t i : order) {
    const int t = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    lists[t].push_back(i);
    load[t] += std::max<int64_t>(cost[i], 1);  // an empty list still costs its setup
  }
  auto work = [&](int t) {
    for (int64_t i : lists[t]) fn(i, t);
  };
  jtree_cpu::run_on_threads(threads, work);
}

// The visible-score mask of one (q-block, kv-block) pair applied to scores S[M][bk] in place:
// masked entries become kMasked.
void apply_mask(float* S, const Shape& s, const int32_t* qpos, const int32_t* end_k, int64_t kid,
                const int32_t* qpath, const int32_t* kpath, int64_t window) {
  const int64_t kbase = (kid % s.nk_row) * s.bk;
  for (int64_t i = 0; i < s.m; ++i) {
    const int32_t qp = qpos[i % s.bq];
    float* row = S + i * s.bk;
    for (int64_t j = 0; j < s.bk; ++j) {
      const bool visible = kbase + j <= qp && qp < end_k[j];
      row[j] = visible ? row[j] : kMasked;
    }
    if (window > 0) {
      const int64_t qh = qpath[i % s.bq];
      for (int64_t j = 0; j < s.bk; ++j)
        row[j] = qh - kpath[j] < window ? row[j] : kMasked;
    }
  }
}

// What both passes read: the shape, the operands' data, and the work items' costs (list lengths).
struct Operands {
  Shape s;
  const float *Q, *K, *V;
  const int32_t *E, *QP, *KI, *KK, *C, *KP, *QH;
  std::vector<int64_t> cost;  // per (q-block, kv-head) item
};

Operands operands_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                     ffi::Buffer<ffi::S32>& end, ffi::Buffer<ffi::S32>& q_pos,
                     ffi::Buffer<ffi::S32>& kv_index, ffi::Buffer<ffi::S32>& kv_kind,
                     ffi::Buffer<ffi::S32>& count, ffi::Buffer<ffi::S32>& k_path,
                     ffi::Buffer<ffi::S32>& q_path, int64_t nk_row) {
  auto qd = q.dimensions(), kd = k.dimensions();
  const Shape s{qd[0], qd[1], qd[2], qd[3], kd[0], kd[2], q_pos.dimensions()[1],
                kv_index.dimensions()[1], nk_row, v.dimensions()[3]};
  const int32_t* C = count.typed_data();
  std::vector<int64_t> cost(s.nq * s.h);
  for (int64_t i = 0; i < s.nq * s.h; ++i) cost[i] = C[i / s.h];
  return {s, q.typed_data(), k.typed_data(), v.typed_data(), end.typed_data(),
          q_pos.typed_data(), kv_index.typed_data(), kv_kind.typed_data(), C,
          k_path.typed_data(), q_path.typed_data(), std::move(cost)};
}

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> end, ffi::Buffer<ffi::S32> q_pos,
                   ffi::Buffer<ffi::S32> kv_index, ffi::Buffer<ffi::S32> kv_kind,
                   ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> k_path,
                   ffi::Buffer<ffi::S32> q_path, float scale, int64_t nk_row, int64_t threads,
                   int64_t window, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  const auto [s, Q, K, V, E, QP, KI, KK, C, KP, QH, cost] =
      operands_of(q, k, v, end, q_pos, kv_index, kv_kind, count, k_path, q_path, nk_row);
  float* O = out->typed_data();
  float* L = lse->typed_data();
  const int64_t items = s.nq * s.h;
  const int nt = thread_count(threads, items);
  std::vector<std::vector<float>> scratch(nt);
  parallel_items(items, cost, nt, [&](int64_t item, int t) {
    const int64_t qb = item / s.h, h = item % s.h;
    auto& buf = scratch[t];
    buf.resize(s.d * s.bk + 2 * s.m * s.bk + s.m * s.d + s.m * s.dv + 3 * s.m);  // per thread
    float* qs = buf.data();  // the q-block times `scale`: scores come out of the matmul scaled
    float* kt = qs + s.m * s.d;
    float* sc = kt + s.d * s.bk;
    float* visible = sc + s.m * s.bk;
    float* acc = visible + s.m * s.bk;
    float* mx = acc + s.m * s.dv;
    float* sum = mx + s.m;
    float* alpha = sum + s.m;
    std::fill(mx, mx + s.m, kMasked);
    std::fill(acc, acc + s.m * s.dv, 0.f);
    std::fill(sum, sum + s.m, 0.f);
    const float* qblk = Q + (qb * s.h + h) * s.m * s.d;
    for (int64_t i = 0; i < s.m * s.d; ++i) qs[i] = qblk[i] * scale;
    for (int32_t n = 0; n < C[qb]; ++n) {
      const int64_t kid = KI[qb * s.max_kv + n];
      const float* kblk = K + (kid * s.h + h) * s.bk * s.d;
      const float* vblk = V + (kid * s.h + h) * s.bk * s.dv;
      transpose(kblk, s.bk, s.d, kt);
      std::fill(sc, sc + s.m * s.bk, 0.f);
      gemm(rows(qs, s.d), kt, s.bk, sc, s.bk, s.m, s.bk, s.d);
      const bool full = KK[qb * s.max_kv + n] == kFull;
      if (!full)
        apply_mask(sc, s, QP + qb * s.bq, E + kid * s.bk, kid, QH + qb * s.bq, KP + kid * s.bk,
                   window);
      // Online softmax of the block, in passes the compiler vectorizes: new row maxima, shifted
      // scores, exp over the whole block, then the mask (scores at kMasked) and row sums.
      for (int64_t i = 0; i < s.m; ++i) {
        float* row = sc + i * s.bk;
        float m_new = mx[i];
        for (int64_t j = 0; j < s.bk; ++j) m_new = std::max(m_new, row[j]);
        alpha[i] = mx[i] - m_new;
        mx[i] = m_new;
        if (!full)
          for (int64_t j = 0; j < s.bk; ++j) visible[i * s.bk + j] = row[j] > 0.5f * kMasked;
        for (int64_t j = 0; j < s.bk; ++j) row[j] = std::max(row[j] - m_new, kExpFloor);
      }
      exp_in_place(sc, s.m * s.bk);
      exp_in_place(alpha, s.m);
      for (int64_t i = 0; i < s.m; ++i) {
        float* row = sc + i * s.bk;
        const float* vis = visible + i * s.bk;
        float total = 0.f;
        if (!full)
          for (int64_t j = 0; j < s.bk; ++j) row[j] *= vis[j];
        for (int64_t j = 0; j < s.bk; ++j) total += row[j];
        if (alpha[i] != 1.f)
          for (int64_t c = 0; c < s.dv; ++c) acc[i * s.dv + c] *= alpha[i];
        sum[i] = alpha[i] * sum[i] + total;
      }
      gemm(rows(sc, s.bk), vblk, s.dv, acc, s.dv, s.m, s.dv, s.bk);
    }
    float* oblk = O + (qb * s.h + h) * s.m * s.dv;
    float* lblk = L + (qb * s.h + h) * s.m;
    for (int64_t i = 0; i < s.m; ++i) {
      const float l = sum[i] > 0.f ? sum[i] : 1.f;
      for (int64_t c = 0; c < s.dv; ++c) oblk[i * s.dv + c] = acc[i * s.dv + c] / l;
      lblk[i] = mx[i] + std::log(l);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::S32> end, ffi::Buffer<ffi::S32> q_pos,
                    ffi::Buffer<ffi::S32> kv_index, ffi::Buffer<ffi::S32> kv_kind,
                    ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> k_path,
                    ffi::Buffer<ffi::S32> q_path, ffi::Buffer<ffi::F32> d_out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta, float scale,
                    int64_t nk_row, int64_t threads, int64_t window,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv) {
  const auto [s, Q, K, V, E, QP, KI, KK, C, KP, QH, cost] =
      operands_of(q, k, v, end, q_pos, kv_index, kv_kind, count, k_path, q_path, nk_row);
  const float* DO = d_out.typed_data();
  const float* LS = lse.typed_data();
  const float* DL = delta.typed_data();
  const int64_t items = s.nq * s.h;
  const int nt = thread_count(threads, items);
  const int64_t k_size = s.nk * s.h * s.bk * s.d, v_size = s.nk * s.h * s.bk * s.dv;
  // dk / dv: thread 0 writes the outputs, the others their own accumulators, summed at the end in
  // thread order; with the items' fixed assignment (`parallel_items_fixed`) every sum runs in the
  // same order on every call with the same thread count.
  std::vector<std::vector<float>> dk_part(nt - 1), dv_part(nt - 1);
  float* DK = dk->typed_data();
  float* DV = dv->typed_data();
  std::fill(DK, DK + k_size, 0.f);
  std::fill(DV, DV + v_size, 0.f);
  std::vector<std::vector<float>> scratch(nt);
  parallel_items_fixed(items, cost, nt, [&](int64_t item, int t) {
    const int64_t qb = item / s.h, h = item % s.h;
    if (t > 0 && dk_part[t - 1].empty()) {
      dk_part[t - 1].assign(k_size, 0.f);
      dv_part[t - 1].assign(v_size, 0.f);
    }
    float* dk_acc = t == 0 ? DK : dk_part[t - 1].data();
    float* dv_acc = t == 0 ? DV : dv_part[t - 1].data();
    auto& buf = scratch[t];
    buf.resize((s.d + s.dv) * s.bk + 3 * s.m * s.bk + 2 * s.m * s.d);  // once per thread
    float* qs = buf.data();  // the q-block times `scale`, for the scores
    float* kt = qs + s.m * s.d;
    float* vt = kt + s.d * s.bk;
    float* p = vt + s.dv * s.bk;
    float* ds = p + s.m * s.bk;
    float* visible = ds + s.m * s.bk;
    float* dq_acc = visible + s.m * s.bk;
    const int64_t off = (qb * s.h + h);
    const float* qblk = Q + off * s.m * s.d;
    const float* doblk = DO + off * s.m * s.dv;
    const float* lblk = LS + off * s.m;
    const float* dlblk = DL + off * s.m;
    for (int64_t i = 0; i < s.m * s.d; ++i) qs[i] = qblk[i] * scale;
    std::fill(dq_acc, dq_acc + s.m * s.d, 0.f);
    for (int32_t n = 0; n < C[qb]; ++n) {
      const int64_t kid = KI[qb * s.max_kv + n];
      const int64_t koff = (kid * s.h + h) * s.bk * s.d;
      const int64_t voff = (kid * s.h + h) * s.bk * s.dv;
      transpose(K + koff, s.bk, s.d, kt);
      transpose(V + voff, s.bk, s.dv, vt);
      std::fill(p, p + 2 * s.m * s.bk, 0.f);  // p and ds (ds holds dP first)
      gemm(rows(qs, s.d), kt, s.bk, p, s.bk, s.m, s.bk, s.d);
      const bool full = KK[qb * s.max_kv + n] == kFull;
      if (!full)
        apply_mask(p, s, QP + qb * s.bq, E + kid * s.bk, kid, QH + qb * s.bq, KP + kid * s.bk,
                   window);
      gemm(rows(doblk, s.dv), vt, s.bk, ds, s.bk, s.m, s.bk, s.dv);
      for (int64_t i = 0; i < s.m; ++i) {  // p = exp(score - lse) where visible, in passes
        float* prow = p + i * s.bk;
        if (!full)
          for (int64_t j = 0; j < s.bk; ++j) visible[i * s.bk + j] = prow[j] > 0.5f * kMasked;
        for (int64_t j = 0; j < s.bk; ++j) prow[j] = std::max(prow[j] - lblk[i], kExpFloor);
      }
      exp_in_place(p, s.m * s.bk);
      for (int64_t i = 0; i < s.m; ++i) {
        float* prow = p + i * s.bk;
        float* drow = ds + i * s.bk;
        const float* vis = visible + i * s.bk;
        if (!full)
          for (int64_t j = 0; j < s.bk; ++j) prow[j] *= vis[j];
        for (int64_t j = 0; j < s.bk; ++j) drow[j] = prow[j] * (drow[j] - dlblk[i]) * scale;
      }
      gemm(rows(ds, s.bk), K + koff, s.d, dq_acc, s.d, s.m, s.d, s.bk);
      gemm(transposed(ds, s.bk), qblk, s.d, dk_acc + koff, s.d, s.bk, s.d, s.m);
      gemm(transposed(p, s.bk), doblk, s.dv, dv_acc + voff, s.dv, s.bk, s.dv, s.m);
    }
    std::memcpy(dq->typed_data() + off * s.m * s.d, dq_acc, sizeof(float) * s.m * s.d);
  });
  for (auto& part : dk_part)
    if (!part.empty())
      for (int64_t i = 0; i < k_size; ++i) DK[i] += part[i];
  for (auto& part : dv_part)
    if (!part.empty())
      for (int64_t i = 0; i < v_size; ++i) DV[i] += part[i];
  return ffi::Error::Success();
}

}  // namespace

namespace {

// The operands both passes read: q, k, v, end, q_pos, kv_index, kv_kind, count, k_path, q_path.
auto BindBlocks() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtreeTreeAttentionForward, Forward,
                              BindBlocks()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("nk_row")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>());  // lse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtreeTreeAttentionBackward, Backward,
                              BindBlocks()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d_out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("nk_row")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dv
