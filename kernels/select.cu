// SPDX-License-Identifier: MIT
// Dion2's slice selection: top-k of score vectors, and gather / scale / add
// of the selected rows or columns.
//
// topk: one block per vector. A radix select over the scores' bits (4 passes
// of 8 bits, counting with integer shared-memory atomics) finds the k-th
// largest key T and how many elements equal to T are taken; one ordered pass
// then emits every element above T and the first (lowest-index) elements equal
// to T, in ascending index order, through block-wide prefix sums. The result
// is the host's (partial_sort with ties to the lower index, then sorted).
#include <cub/block/block_scan.cuh>

#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

constexpr int kTopkThreads = 512;

// A key whose unsigned order is the float order (-0 and +0 equal, like the
// host's comparison; NaN above +inf).
__device__ __forceinline__ uint32_t order_key(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kTopkThreads) topk_kernel(const float* scores, int64_t batch, int64_t n, int64_t k,
                                                            int32_t* idx) {
  using Scan = cub::BlockScan<int, kTopkThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t sh_prefix;
  __shared__ int sh_remaining;
  const int tid = threadIdx.x;
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    const float* s = scores + b * n;
    int32_t* out = idx + b * k;
    if (k >= n) {  // everything is selected
      for (int64_t i = tid; i < n; i += blockDim.x) out[i] = static_cast<int32_t>(i);
      continue;
    }
    // Radix select, most significant digit first: after the pass at `shift`,
    // `prefix` holds the top bits of T and `remaining` the number of elements
    // with that prefix still to take.
    uint32_t prefix = 0, mask = 0;
    int remaining = static_cast<int>(k);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
      __syncthreads();
      for (int64_t i = tid; i < n; i += blockDim.x) {
        const uint32_t key = order_key(s[i]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int cum = 0, d = 255;
        for (; d > 0; --d) {
          if (cum + hist[d] >= remaining) break;
          cum += hist[d];
        }
        sh_prefix = prefix | (static_cast<uint32_t>(d) << shift);
        sh_remaining = remaining - cum;
      }
      __syncthreads();
      prefix = sh_prefix;
      remaining = sh_remaining;
      mask |= 0xffu << shift;
    }
    // Ordered pass: running counts of keys equal to T seen and of indices written.
    const uint32_t T = prefix;
    int eq_seen = 0, written = 0;
    for (int64_t base = 0; base < n; base += blockDim.x) {
      const int64_t i = base + tid;
      const uint32_t key = i < n ? order_key(s[i]) : 0u;
      const int eq = (i < n && key == T) ? 1 : 0;
      int eq_before, eq_total;
      Scan(scan_tmp).ExclusiveSum(eq, eq_before, eq_total);
      __syncthreads();
      const int sel = (i < n && (key > T || (eq && eq_seen + eq_before < remaining))) ? 1 : 0;
      int pos, sel_total;
      Scan(scan_tmp).ExclusiveSum(sel, pos, sel_total);
      __syncthreads();
      if (sel) out[written + pos] = static_cast<int32_t>(i);
      eq_seen += eq_total;
      written += sel_total;
      if (written >= k) break;  // uniform: every thread holds the same totals
    }
    __syncthreads();  // hist and scan_tmp are reused by the next vector
  }
}

// Row/column addressing of slice s of matrix b (axis kRows: rows idx[s]).
struct Gather {
  ConstMatBatch m;
  MatBatch out;
  const int32_t* idx;
  int64_t k;
  bool rows;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const int32_t* ix = idx + b * k;
    const float* p = mat_at(m, b);
    mat_at(out, b)[i * out.ld + j] = rows ? p[ix[i] * m.ld + j] : p[i * m.ld + ix[j]];
  }
};

struct ScaleSlices {
  MatBatch m;
  const int32_t* idx;
  int64_t k;
  bool rows;
  float s;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    const int32_t* ix = idx + b * k;
    float* p = mat_at(m, b);
    p[rows ? ix[i] * m.ld + j : i * m.ld + ix[j]] *= s;
  }
};

struct AddSlices {
  MatBatch m;
  ConstMatBatch u;
  const int32_t* idx;
  int64_t k;
  bool rows;
  const GroupScalars* gs;
  float mult;
  __device__ void operator()(int64_t b, int64_t i, int64_t j) const {
    // alpha from the device-side lr, so a captured graph follows lr changes.
    const float alpha = gs ? static_cast<float>(mult * gs->lr) : mult;
    const int32_t* ix = idx + b * k;
    float* p = mat_at(m, b);
    p[rows ? ix[i] * m.ld + j : i * m.ld + ix[j]] += alpha * mat_at(u, b)[i * u.ld + j];
  }
};

}  // namespace

void topk(const Ctx& c, const float* scores, int64_t batch, int64_t n, int64_t k, int32_t* idx) {
  if (batch <= 0 || n <= 0 || k <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(batch, 1 << 30));
  topk_kernel<<<blocks, kTopkThreads, 0, c.stream>>>(scores, batch, n, k, idx);
  cuda::check_launch("topk kernel");
}

void gather_slices(const Ctx& c, ConstMatBatch m, Axis axis, const int32_t* idx, int64_t k, MatBatch out) {
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k, Gather{m, out, idx, k, rows}, "gather_slices kernel");
}

void scale_slices(const Ctx& c, MatBatch m, Axis axis, const int32_t* idx, int64_t k, float s) {
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k, ScaleSlices{m, idx, k, rows, s},
              "scale_slices kernel");
}

void add_slices(const Ctx& c, MatBatch m, Axis axis, const int32_t* idx, int64_t k, ConstMatBatch u,
                const GroupScalars* gs, float mult) {
  const bool rows = axis == kRows;
  for_each_2d(c, m.batch, rows ? k : m.rows, rows ? m.cols : k, AddSlices{m, u, idx, k, rows, gs, mult},
              "add_slices kernel");
}

}  // namespace dion::kernels
