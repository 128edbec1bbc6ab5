// SPDX-License-Identifier: MIT
// Dion's error feedback and update products at matmul precision FP32 on
// Hopper's tensor cores (lowrank_gemm's path for fp32 factors into fp32 C):
//
//   C_g (m x n fp32, row-major, ldc) = alpha A_g B_g^T + beta C_g,
//   A_g m x k, B_g n x k fp32 (Dion's P and R or Q: k is the rank),
//
// with alpha = coef[0], beta = coef[1] read on the device (alpha 0, beta 1:
// a skipped step, C keeps its bits; beta 0: C is not read).
//
// Each factor is split into two TF32 parts, x = hi + lo: hi is x rounded to
// TF32's 11 significant bits (to nearest), lo the remainder x - hi (exact
// in fp32) rounded the same way, so hi + lo is x to 2^-22. The product is
// Ah Bh + Ah Bl + Al Bh (Al Bl, at most 2^-22 of |A| |B|, is left out):
// three TF32 MMAs (wgmma) per term. The tensor cores' own accumulation does
// not round to nearest (accumulated there over k = 512, the error reached 5
// to 10 times SGEMM's, bench/micro/lowrank_3xtf32.cu), so the three
// products of two k-steps of 8 go into a scratch accumulator T, zeroed by
// their first MMA, which the threads add into the running sum D with fp32
// additions (round to nearest): the promotion of Ootomo and Yokota (2022).
// The promotions go by pairs: the second two k-steps' MMAs (into a second
// scratch accumulator) are issued before the first's sum is waited for, so
// the first's additions overlap them and the tensor cores drain once per
// stage of 32 (twenty-second session: gpt-1.3b Dion r = 1.0 fp32 -1.8 %).
// Measured against float64 (max |C - C64| / (|alpha| sum |a b| + |beta c|)
// per element, signed and positive data, k up to 2048), the result's error
// was 0.2 to 1.0 times cuBLAS's SGEMM's on the same inputs, at 1.6 to 1.8
// times SGEMM's speed (an H200: gpt-1.3b's 24 products 8192 x 2048 of rank
// 512, 8.81 -> 4.88 ms with the splits).
//
// The kernel (sm_90a only): a CTA per multiprocessor, each taking 128 x 128
// tiles of C in turn, two warpgroups (rows 0-63 and 64-127 of the tile),
// three stages of four 128 x 32 fp32 tiles (Ah, Al, Bh, Bl: 64 KiB) loaded
// by the tensor memory accelerator with the 128-byte swizzle wgmma's
// descriptors expect (zeros outside the matrices), the next tile's first
// stages while a tile ends, then the epilogue from the registers. The split parts are
// written to scratch by split passes (packed, rows of kpad = k rounded up to
// 4 elements, so every tensor map stride is a multiple of 16 bytes), a
// chunk of the batch at a time where the whole would not fit the scratch.
//
// field_tf32x3 (further down) does Dion's P = M Q and R = M^T P the same
// way, with M read in place from each tensor and split by the kernel itself
// (kernels/lowrank_tf32x3.cuh has how), and the backend's other large FP32
// products (the solves' and the Gram matrices) from strided batches; against
// float64 its error was 0.07 to 1.3 times SGEMM's (66 cases), and on an H200
// gpt-1.3b Dion fp32 ran 101.3 -> 81.3 ms per step (docs/benchmarks.md,
// twentieth session).
#include <algorithm>

#include "backend/cuda/cuda_check.hpp"
#include "kernels/launch.hpp"
#include "kernels/lowrank_tf32x3.cuh"

#ifndef DION_SM90A
#define DION_SM90A 0
#endif

namespace dion::kernels {

using namespace x3;

namespace {

void x3_split(const Ctx& c, const float* a, int64_t rows, int64_t k, int64_t ld, int64_t stride, int64_t count,
              int64_t kpad, float* hi, float* lo, const char* what) {
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(8) * std::max(1, c.sms), (count * rows + 7) / 8)));
  if (reinterpret_cast<uintptr_t>(a) % 16 == 0 && k % 4 == 0 && ld % 4 == 0 && stride % 4 == 0)
    split_tf32_kernel<true><<<blocks, 256, 0, c.stream>>>(a, rows, k, ld, stride, count, kpad, hi, lo);
  else
    split_tf32_kernel<false><<<blocks, 256, 0, c.stream>>>(a, rows, k, ld, stride, count, kpad, hi, lo);
  cuda::check_launch(what);
}

}  // namespace

bool lowrank_tf32x3_init(int device) {
  if (!DION_SM90A) return false;
  int major = 0, minor = 0, optin = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  cuda::check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  cuda::check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute");
  if (major != 9 || minor != 0 || static_cast<size_t>(optin) < kX3SmemBytes || !x3_encoder()) return false;
  cuda::check(cudaFuncSetAttribute(lowrank_tf32x3_kernel<kX3Promote>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(kX3SmemBytes)),
              "cudaFuncSetAttribute (lowrank_tf32x3)");
  if (static_cast<size_t>(optin) < fx_smem_bytes<128>()) return false;
  const auto smem = [](auto kernel, size_t bytes) {
    cuda::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
                "cudaFuncSetAttribute (field_tf32x3)");
  };
  smem(field_tf32x3_kernel<false, 128>, fx_smem_bytes<128>());
  smem(field_tf32x3_kernel<true, 128>, fx_smem_bytes<128>());
  smem(field_tf32x3_kernel<false, 96>, fx_smem_bytes<96>());
  smem(field_tf32x3_kernel<true, 96>, fx_smem_bytes<96>());
  return true;
}

size_t lowrank_tf32x3_scratch(int64_t count, int64_t m, int64_t n, int64_t k) {
  return sizeof(float) * 2 * static_cast<size_t>(count * (m + n) * x3_kpad(k));
}

bool lowrank_tf32x3(const Ctx& c, ConstMatBatch a, ConstMatBatch b, void* const* cptr, const float* coef,
                    int64_t ldc, void* scratch, size_t scratch_bytes) {
  const int64_t m = a.rows, n = b.rows, k = a.cols, count = a.batch;
  if (count <= 0 || m <= 0 || n <= 0) return true;
  const int64_t kpad = x3_kpad(k);
  // the tensor maps' coordinates (k, rows, matrix) are 32-bit
  if (k <= 0 || b.cols != k || k > 0x7fffffff || m > 0x7fffffff || n > 0x7fffffff) return false;
  const int64_t chunk = std::min<int64_t>(
      count, std::min<int64_t>(65535, static_cast<int64_t>(scratch_bytes / lowrank_tf32x3_scratch(1, m, n, k))));
  if (chunk < 1) return false;
  // The parts of a chunk, packed: Ah, Al (chunk x m x kpad), Bh, Bl (chunk x n x kpad).
  float* ah = static_cast<float*>(scratch);
  float* al = ah + chunk * m * kpad;
  float* bh = al + chunk * m * kpad;
  float* bl = bh + chunk * n * kpad;
  CUtensorMap t[4];  // the same for every chunk: only C's pointers move
  if (!x3_map(&t[0], ah, m, k, kpad, chunk) || !x3_map(&t[1], al, m, k, kpad, chunk) ||
      !x3_map(&t[2], bh, n, k, kpad, chunk) || !x3_map(&t[3], bl, n, k, kpad, chunk))
    return false;
  for (int64_t g0 = 0; g0 < count; g0 += chunk) {
    const int64_t cn = std::min(chunk, count - g0);
    x3_split(c, a.p + g0 * a.stride, m, k, a.ld, a.stride, cn, kpad, ah, al, "split_tf32 kernel (A)");
    x3_split(c, b.p + g0 * b.stride, n, k, b.ld, b.stride, cn, kpad, bh, bl, "split_tf32 kernel (B)");
    lowrank_tf32x3_kernel<kX3Promote><<<x3_lowrank_grid(cn, m, n, c.sms), kX3Threads, kX3SmemBytes, c.stream>>>(
        t[0], t[1], t[2], t[3], cptr + g0, coef, cn, m, n, k, ldc);
    cuda::check_launch("lowrank_tf32x3 kernel");
  }
  return true;
}

namespace {

// 96-column tiles where they cover n with fewer columns than 128-column ones.
int fx_bn(int64_t n) { return (n + 95) / 96 * 96 < (n + 127) / 128 * 128 ? 96 : 128; }

// Splits of the inner dimension (a power of two, at most 8, each at least
// 8 stages of 32): the one with the least time in units of one unsplit
// tile's, ceil(waves) / S, the CTAs one per multiprocessor, counting 3% per
// split for each CTA's pipeline fill and the partial sums' pass. gpt-160m's
// P = B Q for fc2 (12 products 768 x 3072 by 3072 x 192: 144 tiles on 132
// multiprocessors, half of the second wave idle) takes 4.
// lower: only the tiles that hold an element on or below the diagonal (a
// symmetric result) are formed.
int64_t fx_splits(const Ctx& c, int64_t count, int64_t m, int64_t n, int64_t k, bool lower) {
  const int bn = fx_bn(n);
  const int64_t tm = (m + kX3Tile - 1) / kX3Tile, tn = (n + bn - 1) / bn;
  int64_t per = lower ? 0 : tm * tn;
  for (int64_t i = 0; lower && i < tm; ++i)
    for (int64_t j = 0; j < tn; ++j) per += x3_tile_lower(i, j, bn);
  const int64_t tiles = count * per;
  const int64_t kt = (k + 31) / 32, sms = std::max(1, c.sms);
  int64_t best = 1;
  double best_cost = 0;
  for (int64_t S = 1; S <= 8 && (S == 1 || kt >= 8 * S); S *= 2) {
    const double cost = static_cast<double>((tiles * S + sms - 1) / sms) / static_cast<double>(S) * (1.0 + 0.03 * S);
    if (S == 1 || cost < best_cost) {
      best = S;
      best_cost = cost;
    }
  }
  return best;
}

template <bool kTransX, int BN>
void fx_launch(const Ctx& c, const CUtensorMap (&t)[2], const void* const* xptr, const float* xbase, int64_t xstride,
               float* cbase, int64_t cstride_g, int64_t cstride_s, int64_t cn, int64_t S, int64_t ksplit, int64_t m,
               int64_t n, int64_t k, int64_t ldx, int64_t ldc, bool vec_ok, bool lower, float alpha) {
  const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN), static_cast<unsigned>((m + kX3Tile - 1) / kX3Tile),
                  static_cast<unsigned>(std::min<int64_t>(cn * S, 65535)));
  field_tf32x3_kernel<kTransX, BN><<<grid, kX3Threads, fx_smem_bytes<BN>(), c.stream>>>(
      t[0], t[1], xptr, xbase, xstride, cbase, cstride_g, cstride_s, cn, static_cast<int>(S), ksplit, m, n, k, ldx,
      ldc, vec_ok, lower, alpha);
}

// Whether the kernel writes partial sums that sum_parts then adds into the
// result: with S > 1 splits, or a symmetric result (summed from its lower
// triangle and mirrored).
bool fx_via_parts(int64_t S, bool symmetric) { return S > 1 || symmetric; }

// Scratch bytes per product with S splits: B's two parts, and the partial
// sums where there are (fx_via_parts).
size_t fx_product_bytes(int64_t S, int64_t m, int64_t n, int64_t k, bool symmetric) {
  return sizeof(float) * static_cast<size_t>(2 * n * x3_kpad(k) + (fx_via_parts(S, symmetric) ? S * m * n : 0));
}

}  // namespace

size_t field_tf32x3_scratch(const Ctx& c, int64_t count, int64_t m, int64_t n, int64_t k, int64_t products,
                            bool symmetric) {
  return static_cast<size_t>(products) * fx_product_bytes(fx_splits(c, count, m, n, k, symmetric), m, n, k, symmetric);
}

bool field_tf32x3(const Ctx& c, X3Operand b, X3Operand x, bool trans_x, MatBatch out, int64_t k, float alpha,
                  void* scratch, size_t scratch_bytes, bool symmetric) {
  const int64_t ldb = b.ld, ldx = x.ld;
  const int64_t m = out.rows, n = out.cols, count = out.batch;
  if (count <= 0 || m <= 0 || n <= 0) return true;
  const int64_t kpad = x3_kpad(k), tiles_m = (m + kX3Tile - 1) / kX3Tile;
  if (k <= 0 || tiles_m > 65535 || n > 0x7fffffff || k > 0x7fffffff) return false;
  const int64_t S = fx_splits(c, count, m, n, k, symmetric);
  const int64_t chunk = std::min<int64_t>(
      count,
      std::min<int64_t>(65535 / S, static_cast<int64_t>(scratch_bytes / fx_product_bytes(S, m, n, k, symmetric))));
  if (chunk < 1) return false;
  // B's parts of a chunk, packed: Bh, Bl (chunk x n x kpad); then the
  // partial sums (chunk x S x m x n) where the inner dimension is split or
  // the result is symmetric (summed then from the lower triangle and
  // mirrored: the same bits on both sides of the diagonal, which the
  // products' order of the split parts' terms would not give).
  float* bh = static_cast<float*>(scratch);
  float* bl = bh + chunk * n * kpad;
  float* parts = bl + chunk * n * kpad;
  const int bn = fx_bn(n);
  CUtensorMap t[2];
  if (!x3_map(&t[0], bh, n, k, kpad, chunk, bn) || !x3_map(&t[1], bl, n, k, kpad, chunk, bn)) return false;
  const bool vec_ok = ldx % 4 == 0 && (trans_x ? m : k) % 4 == 0;
  const auto launch = trans_x ? (bn == 96 ? fx_launch<true, 96> : fx_launch<true, 128>)
                              : (bn == 96 ? fx_launch<false, 96> : fx_launch<false, 128>);
  const int64_t ksplit = ((k + 31) / 32 + S - 1) / S * 32;
  const bool via_parts = fx_via_parts(S, symmetric);
  for (int64_t g0 = 0; g0 < count; g0 += chunk) {
    const int64_t cn = std::min(chunk, count - g0);
    const int64_t tiles = cn * ((k + 31) / 32) * ((n + 31) / 32);
    const unsigned blocks =
        static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(16 * std::max(1, c.sms), tiles)));
    split_tf32_t_kernel<<<blocks, dim3(32, 8), 0, c.stream>>>(b.ptr ? b.ptr + g0 : nullptr, b.base + g0 * b.stride,
                                                              b.stride, k, n, ldb, cn, kpad, bh, bl);
    cuda::check_launch("split_tf32_t kernel (B)");
    const MatBatch o{out.p + g0 * out.stride, m, n, out.ld, out.stride, cn};
    float* cb = via_parts ? parts : o.p;
    const int64_t csg = via_parts ? S * m * n : o.stride, css = via_parts ? m * n : 0, ldc = via_parts ? n : o.ld;
    launch(c, t, x.ptr ? x.ptr + g0 : nullptr, x.base + g0 * x.stride, x.stride, cb, csg, css, cn, S, ksplit, m, n, k,
           ldx, ldc, vec_ok, symmetric, alpha);
    cuda::check_launch("field_tf32x3 kernel");
    if (via_parts) sum_parts(c, parts, S, o, symmetric ? 1 : 0);
  }
  return true;
}

}  // namespace dion::kernels
