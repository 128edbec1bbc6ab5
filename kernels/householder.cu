// SPDX-License-Identifier: MIT
// The kernels of the batched blocked Householder QR with explicit Q
// (Backend::qr_q; the backend's qr_q_batched drives them with its batched
// SGEMMs). Every matrix of the batch goes through the same launches, so a
// batch of 12 or 24 square factors costs one chain of launches instead of
// one cuSOLVER geqrf + orgqr per matrix.
//
// The matrices are column-major p x r (ld p, stride p r), p >= r. A panel of
// nb <= 32 columns at column j0 is factored by one CTA per matrix in shared
// memory, reflector by reflector, with LAPACK's larfg convention (beta =
// -sign(alpha) |(alpha, x)|, tau = (beta - alpha) / beta, v = x / (alpha -
// beta) below a unit diagonal, tau = 0 and H = I where x is zero), so that
// the reflectors, and Q's column signs, are those of LAPACK's sgeqrf /
// sorgqr and cuSOLVER's (to rounding). R is not kept: qr_q wants Q only.
//
// Thread (k, g) of a panel's CTA owns the panel's column k and the rows g, g
// + G, g + 2G, ... (G = threads / nb row groups). For reflector c, one pass
// over the rows both applies H_c to the columns k > c and forms, for the
// next reflector c + 1, the dots of its column with every other column of
// the panel (the new column's values reach the other lanes by a shuffle):
// with k > c + 1 they give the next update's w_k, with k = c + 1 the norm,
// and with k < c + 1 the entries S(k, c + 1) of S = V^T V. So a reflector
// costs one pass and two barriers, and the panel's T of the compact WY form
// (H_0 ... H_{b-1} = I - V T V^T) comes from S without another pass over V.
// Each thread sums its products in float (four sums), the threads' sums
// are added in float64, all in a fixed order (no atomics): the same bits on
// every run.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_check.hpp"
#include "core/error.hpp"
#include "kernels/common.cuh"

namespace dion::kernels {

namespace {

constexpr int kHhThreads = 1024;
constexpr int kUnroll = 4;  // rows per thread in flight in a panel's pass
constexpr int kHhBlock = kHouseholderBlock;  // the outer blocks' width (T of the trailing updates)

// The shared-memory leading dimension of a panel column of m rows: m rounded
// up to 32, plus 32 / nb. A warp's lanes read nb columns at 32 / nb
// consecutive rows; with ld = 32 / nb (mod 32) those 32 words fall in 32
// different banks.
__host__ __device__ inline int panel_ld(int m, int nb) { return (m + 31) / 32 * 32 + 32 / nb; }

// T (n x n, column-major, ld ldt; zeros below the diagonal) of the compact
// WY form H_0 ... H_{n-1} = I - V T V^T, from tau and S = V^T V (only its
// entries above the diagonal are read), by doubling: adjacent blocks A = [a,
// a + s) and B = [a + s, a + s + sb), each already merged, give T_AB =
// -T_AA S_AB T_BB (the product of the two blocks' forms). Every thread of the
// block calls it; X holds N^2 / 4 floats for the power of two N >= n (4096
// for n <= 128), scratch for the levels' T_AA S_AB.
__device__ void form_t(float* T, int ldt, const float* S, int lds, const float* tau, int n, float* X) {
  const int t = threadIdx.x, nt = blockDim.x;
  for (int e = t; e < n * n; e += nt) {
    const int i = e % n, j = e / n;
    T[i + j * ldt] = i == j ? tau[i] : 0.f;
  }
  __syncthreads();
  for (int s = 1; s < n; s *= 2) {
    const int pairs = (n + 2 * s - 1) / (2 * s), ss = s * s;
    for (int e = t; e < pairs * ss; e += nt) {
      const int q = e / ss, i = e % ss % s, j = e % ss / s, a = 2 * q * s, bb = a + s;
      if (bb + j >= n) continue;
      float acc = 0.f;
      for (int l = i; l < s; ++l) acc += T[(a + i) + (a + l) * ldt] * S[(a + l) + (bb + j) * lds];
      X[q * ss + i + j * s] = acc;
    }
    __syncthreads();
    for (int e = t; e < pairs * ss; e += nt) {
      const int q = e / ss, i = e % ss % s, j = e % ss / s, a = 2 * q * s, bb = a + s;
      if (bb + j >= n) continue;
      float acc = 0.f;
      for (int l = 0; l <= j; ++l) acc += X[q * ss + i + l * s] * T[(bb + l) + (bb + j) * ldt];
      T[(a + i) + (bb + j) * ldt] = -acc;
    }
    __syncthreads();
  }
}

// One round of a panel's pass (panel_pass): the kUnroll rows i0, i0 + G,
// ... of thread (k, g), kTail: the last, partial round (rows from end on
// left out).
template <int G, bool kTail>
__device__ __forceinline__ void pass_round(float* yk, const float* xc, float ws, bool upd, int i0, int end, int lc1,
                                           float (&acc)[kUnroll], float& amax) {
  float y[kUnroll], x[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const bool ok = !kTail || i0 + G * u < end;
    y[u] = ok ? yk[i0 + G * u] : 0.f;
    x[u] = ok ? xc[i0 + G * u] : 0.f;
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    y[u] = fmaf(-ws, x[u], y[u]);
    if (upd && (!kTail || i0 + G * u < end)) yk[i0 + G * u] = y[u];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    acc[u] = fmaf(__shfl_sync(0xffffffffu, y[u], lc1), y[u], acc[u]);
    amax = fmaxf(amax, fabsf(y[u]));
  }
}

// The pass of thread (k, g) over the shared-memory rows first .. end - 1 of
// column k (yk): y_k -= ws x_c where upd, then the sums of y_{c1} y_k (the
// value of the lane lc1, holding column c1 at the same row) into
// part[g][k], the largest |y_k| into pmax[g][k]. Four rows at a time, their
// loads first, four float sums. Float64 products took two conversions per
// element: with them a gpt-160m panel of 32 took 186 us under Nsight
// Compute, without them 167 us (7.43 -> 6.87 M warp instructions;
// twenty-fourth session).
template <int NB>
__device__ __forceinline__ void panel_pass(float* yk, const float* xc, float ws, bool upd, int first, int end, int k,
                                           int g, int lc1, double (*part)[NB], float (*pmax)[NB]) {
  constexpr int G = kHhThreads / NB, kRound = G * kUnroll;
  static_assert(kUnroll == 4, "panel_pass sums four accumulators");
  float acc[kUnroll] = {}, amax = 0.f;
  const int rows = end - first, full = rows > 0 ? rows / kRound : 0;
  int i0 = first + g;
  for (int j = 0; j < full; ++j, i0 += kRound) pass_round<G, false>(yk, xc, ws, upd, i0, end, lc1, acc, amax);
  if (rows > 0 && rows % kRound != 0) pass_round<G, true>(yk, xc, ws, upd, i0, end, lc1, acc, amax);
  part[g][k] = (static_cast<double>(acc[0]) + acc[1]) + (static_cast<double>(acc[2]) + acc[3]);
  pmax[g][k] = amax;
}

// Warp 0 of a panel's CTA (lane t): column t % NB's sum of the G partial
// sums of a pass (d) and its largest |value| (am), every (32 / NB)-th of
// them from the (t / NB)-th, in a fixed order; for NB = 16 the two halves
// of the warp are then added.
template <int NB>
__device__ __forceinline__ void panel_sums(const double (*part)[NB], const float (*pmax)[NB], int t, double& d,
                                           float& am) {
  constexpr int G = kHhThreads / NB, H = 32 / NB;
  static_assert(G % (4 * H) == 0, "the partial sums split into four");
  const int k = t % NB;
  double d4[4] = {};
  am = 0.f;
  for (int q = t / NB; q < G; q += 4 * H) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      d4[u] += part[q + u * H][k];
      am = fmaxf(am, pmax[q + u * H][k]);
    }
  }
  d = (d4[0] + d4[1]) + (d4[2] + d4[3]);
  if (H == 2) {
    d += __shfl_xor_sync(0xffffffffu, d, 16);
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 16));
  }
}

// The panel of matrix blockIdx.x: columns j0 .. j0 + b - 1 (b <= NB), rows j0
// .. p - 1 (m of them). Writes the explicit reflectors V into the panel's
// columns (unit diagonal, v below it, zeros above it from row J0, the outer
// block's first row, so that the outer block's V is explicit too), tau (r
// per matrix) and the panel's T (NB x NB, ld NB, per matrix).
template <int NB>
__global__ void __launch_bounds__(kHhThreads) panel_kernel(float* cm, int p, int r, int J0, int j0, int b, float* tau,
                                                           float* tp) {
  constexpr int G = kHhThreads / NB;
  extern __shared__ float sh[];
  __shared__ double part[G][NB];
  __shared__ float pmax[G][NB];
  __shared__ double s_s[NB];
  __shared__ float ws_s[NB], tau_s[NB], S[NB * NB], T[NB * NB], X[NB * NB / 4];
  const int m = p - j0, ld = panel_ld(m, NB);
  const int t = threadIdx.x, k = t % NB, g = t / NB, lane = t & 31, base = lane - k;
  float* const A = cm + static_cast<int64_t>(blockIdx.x) * p * r + static_cast<int64_t>(j0) * p;  // row 0 of column j0
  // The panel's columns; those at b and beyond (a partial panel) zeros, so
  // that the pass reads no uninitialised memory.
  for (int c = 0; c < NB; ++c)
    for (int i = t; i < m; i += kHhThreads) sh[c * ld + i] = c < b ? A[static_cast<int64_t>(c) * p + j0 + i] : 0.f;
  __syncthreads();

  // Applies H_c (c >= 0) to the rows below c + 1 of the columns k > c, and
  // sums this thread's part of column c1 = c + 1's dots with column k over
  // those rows into part, the largest |value| of column k there into pmax.
  // Row c of the columns k > c (R's row, which qr_q does not keep) is left
  // as it is, and row c1 is updated by reflector(c1), which reads it; so
  // every row the pass visits takes the same arithmetic, with no test per
  // element but in the last, partial round of rows. Lanes that update
  // nothing (k <= c, and c = -1) subtract 0 x.
  const auto pass = [&](int c) {
    const int c1 = c + 1;
    const bool upd = c >= 0 && k > c && k < b;
    panel_pass<NB>(sh + k * ld, sh + (c < 0 ? 0 : c) * ld, upd ? ws_s[k] : 0.f, upd, c1 + 1, m, k, g, base + c1, part,
                   pmax);
  };
  // Forms reflector c1 from the sums of the pass before: its tau and scale
  // (v = s x below the diagonal), w_k s for the next pass (w_k where the
  // column is scaled in place, below), and S(k, c1) for the columns k < c1
  // (their v already final).
  //
  // The float sums are exact enough (each thread sums a few dozen
  // products, the threads' sums are added in float64) while column c1's
  // largest |x| lies in [2^-60, 2^50]: its largest squares are normal
  // floats, their sum below 2^124 for up to 2^24 rows, and s = 1 / (alpha
  // - beta) at most 2^60. Outside it (a column of tiny or huge values: a
  // momentum decayed over thousands of steps of zero gradient, where
  // LAPACK's larfg rescales), warp 0 forms the dots again in float64 from
  // shared memory, and scales column c1 to v = s x in place (its s is then
  // 1), so neither s nor w_k s leaves the float range. A column of zeros
  // needs neither.
  const auto reflector = [&](int c1) {
    if (t >= 32) return;
    if (c1 > 0 && t >= c1 && t < b) {
      // Row c1 of the columns k >= c1 (H_{c1 - 1}'s), which the pass left (see pass).
      sh[t * ld + c1] = fmaf(-ws_s[t], sh[(c1 - 1) * ld + c1], sh[t * ld + c1]);
    }
    __syncwarp();
    double d;
    float am;
    panel_sums<NB>(part, pmax, t, d, am);
    double s2 = __shfl_sync(0xffffffffu, d, c1);
    const float amx = __shfl_sync(0xffffffffu, am, c1);
    const bool rare = amx != 0.f && !(amx >= 0x1p-60f && amx <= 0x1p50f);  // NaN: rare (and NaN stays)
    if (rare) {
      d = 0;
      if (t < b)
        for (int i = c1 + 1; i < m; ++i) d += static_cast<double>(sh[c1 * ld + i]) * sh[t * ld + i];
      s2 = __shfl_sync(0xffffffffu, d, c1);
    }
    const double alpha = sh[c1 * ld + c1];
    float tu = 0.f;
    double s = 0;
    if (s2 > 0) {
      // One division: with q = 1 / (beta (alpha - beta)), tau = (beta -
      // alpha) / beta = -(alpha - beta)^2 q and s = beta q.
      const double beta = -copysign(sqrt(alpha * alpha + s2), alpha), den = alpha - beta, q = 1.0 / (beta * den);
      tu = static_cast<float>(-den * den * q);
      s = beta * q;
    }
    if (t > c1 && t < b) {
      const float w = tu * static_cast<float>(static_cast<double>(sh[t * ld + c1]) + s * d);
      ws_s[t] = rare ? w : static_cast<float>(w * s);
    }
    if (t < c1) S[t + c1 * NB] = static_cast<float>(s_s[t] * (static_cast<double>(sh[t * ld + c1]) + s * d));
    if (rare) {
      __syncwarp();  // every lane's float64 dots read column c1 before it is scaled
      for (int i = c1 + 1 + t; i < m; i += 32) sh[c1 * ld + i] = static_cast<float>(sh[c1 * ld + i] * s);
    }
    if (t == 0) {
      tau_s[c1] = tu;
      s_s[c1] = rare ? 1.0 : s;
    }
  };
  pass(-1);
  __syncthreads();
  reflector(0);
  __syncthreads();
  for (int c = 0; c + 1 < b; ++c) {
    pass(c);
    __syncthreads();
    reflector(c + 1);
    __syncthreads();
  }
  form_t(T, NB, S, NB, tau_s, b, X);
  // V, explicit, from the outer block's first row J0; tau; T (NB x NB).
  for (int c = 0; c < b; ++c) {
    const float s = static_cast<float>(s_s[c]);  // at most 2^60 (else the column holds v and s is 1)
    for (int i = t - (j0 - J0); i < m; i += kHhThreads)
      A[static_cast<int64_t>(c) * p + j0 + i] = i < c ? 0.f : i == c ? 1.f : sh[c * ld + i] * s;
  }
  if (t < b) tau[static_cast<int64_t>(blockIdx.x) * r + j0 + t] = tau_s[t];
  float* const Tg = tp + static_cast<int64_t>(blockIdx.x) * NB * NB;
  for (int e = t; e < NB * NB; e += kHhThreads) Tg[e] = e % NB < b && e / NB < b ? T[e] : 0.f;
}

// The panel of matrix blockIdx.x / C factored by a cluster of C CTAs (C =
// the cluster's size, 2 to 8; Hopper), the same reflectors as panel_kernel
// (to rounding: the column sums are added CTA by CTA) with the panel's m
// rows spread over the cluster: CTA q holds rows [q mc, (q + 1) mc) (mc >=
// 128, so the diagonal's rows 0 .. NB are CTA 0's). A reflector: every CTA
// runs the pass over its rows, warp 0 sums its threads' partial dots into
// red[parity] (the parity alternates, so that one cluster barrier per
// reflector lets no CTA overwrite sums another still reads), the cluster
// barrier, then warp 0 of every CTA adds the C CTAs' sums in rank order
// and reads row c1 (CTA 0's) through distributed shared memory, so every
// CTA forms the same tau, s and w; H_{c1 - 1} is applied to row c1 in
// registers only (nothing reads that row of the columns k > c1 afterwards).
// The rare columns' float64 dots are summed the same way, behind a second
// cluster barrier. CTA 0 writes tau and T; every CTA its rows of V.
template <int NB>
__global__ void __launch_bounds__(kHhThreads) panel_cluster_kernel(float* cm, int p, int r, int J0, int j0, int b,
                                                                   int mc, float* tau, float* tp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int C = static_cast<int>(cluster.num_blocks()), q = static_cast<int>(cluster.block_rank());
  constexpr int G = kHhThreads / NB;
  extern __shared__ float sh[];
  __shared__ double part[G][NB];
  __shared__ float pmax[G][NB];
  __shared__ double red[2][NB], red2[NB], dl[32];
  __shared__ float redmax[2][NB], rtl[32];
  __shared__ double s_s[NB];
  __shared__ float ws_s[NB], tau_s[NB], S[NB * NB], T[NB * NB], X[NB * NB / 4];
  __shared__ int rare_s;
  const int m = p - j0, ld = panel_ld(mc, NB);
  const int row0 = q * mc, ml = max(0, min(mc, m - row0));  // this CTA's rows of the panel
  const int t = threadIdx.x, k = t % NB, g = t / NB, lane = t & 31, base = lane - k;
  const int64_t mat = blockIdx.x / C;
  float* const A = cm + mat * p * r + static_cast<int64_t>(j0) * p;  // row 0 of column j0
  for (int c = 0; c < NB; ++c)
    for (int i = t; i < ml; i += kHhThreads)
      sh[c * ld + i] = c < b ? A[static_cast<int64_t>(c) * p + j0 + row0 + i] : 0.f;
  __syncthreads();

  // panel_kernel's pass over this CTA's rows (local index li = i - row0).
  const auto pass = [&](int c) {
    const int c1 = c + 1;
    const bool upd = c >= 0 && k > c && k < b;
    panel_pass<NB>(sh + k * ld, sh + (c < 0 ? 0 : c) * ld, upd ? ws_s[k] : 0.f, upd, max(0, c1 + 1 - row0), ml, k, g,
                   base + c1, part, pmax);
  };
  // Warp 0: this CTA's sums of the pass's partial dots (column k's in lane
  // k) into red[par], its largest |value| per column into redmax[par].
  const auto reduce = [&](int par) {
    if (t >= 32) return;
    double d;
    float am;
    panel_sums<NB>(part, pmax, t, d, am);
    if (t < NB) {
      red[par][t] = d;
      redmax[par][t] = am;
    }
  };
  // Warp 0, after the cluster barrier: the cluster's sums (dl), row c1
  // with H_{c1 - 1} applied (rtl), whether column c1 is rare (rare_s); if
  // so, this CTA's float64 dots of column c1 with every column over its
  // rows below c1 (red2).
  const auto gather = [&](int c1, int par) {
    if (t >= 32) return;
    double d = 0;
    float am = 0.f;
    for (int qq = 0; qq < C; ++qq) {
      d += cluster.map_shared_rank(&red[par][0], qq)[k];
      am = fmaxf(am, cluster.map_shared_rank(&redmax[par][0], qq)[k]);
    }
    const float* const sh0 = cluster.map_shared_rank(sh, 0);
    float rt = 0.f;
    if (t < b) {
      rt = sh0[t * ld + c1];
      if (c1 > 0 && t >= c1) rt = fmaf(-ws_s[t], sh0[(c1 - 1) * ld + c1], rt);
    }
    const float amx = __shfl_sync(0xffffffffu, am, c1);
    const bool rare = amx != 0.f && !(amx >= 0x1p-60f && amx <= 0x1p50f);  // NaN: rare (and NaN stays)
    dl[t] = d;
    rtl[t] = rt;
    if (t == 0) rare_s = rare;
    if (rare) {
      double e = 0;
      if (t < b)
        for (int li = max(0, c1 + 1 - row0); li < ml; ++li) e += static_cast<double>(sh[c1 * ld + li]) * sh[t * ld + li];
      if (t < NB) red2[t] = e;
    }
  };
  // Warp 0: reflector c1 from gather's values, as panel_kernel's.
  const auto reflector = [&](int c1) {
    if (t >= 32) return;
    const bool rare = rare_s != 0;
    double d = dl[t];
    if (rare) {
      d = 0;
      for (int qq = 0; qq < C; ++qq) d += cluster.map_shared_rank(&red2[0], qq)[k];
    }
    const double s2 = __shfl_sync(0xffffffffu, d, c1);
    const float rt = rtl[t];
    const double alpha = __shfl_sync(0xffffffffu, rt, c1);
    float tu = 0.f;
    double s = 0;
    if (s2 > 0) {
      const double beta = -copysign(sqrt(alpha * alpha + s2), alpha), den = alpha - beta, qv = 1.0 / (beta * den);
      tu = static_cast<float>(-den * den * qv);
      s = beta * qv;
    }
    if (t > c1 && t < b) {
      const float w = tu * static_cast<float>(static_cast<double>(rt) + s * d);
      ws_s[t] = rare ? w : static_cast<float>(w * s);
    }
    if (t < c1) S[t + c1 * NB] = static_cast<float>(s_s[t] * (static_cast<double>(rt) + s * d));
    if (rare)  // this CTA's rows below c1 (red2 read every row it needed)
      for (int li = max(0, c1 + 1 - row0) + t; li < ml; li += 32) sh[c1 * ld + li] = static_cast<float>(sh[c1 * ld + li] * s);
    if (t == 0) {
      tau_s[c1] = tu;
      s_s[c1] = rare ? 1.0 : s;
    }
  };
  int par = 0;
  const auto step = [&](int c1) {  // after the pass that formed column c1's dots
    __syncthreads();
    reduce(par);
    cluster.sync();  // every CTA's sums; row c1 final before H_{c1 - 1}
    gather(c1, par);
    __syncthreads();
    if (rare_s) cluster.sync();  // every CTA's float64 dots (rare_s is the same in every CTA)
    reflector(c1);
    __syncthreads();
    par ^= 1;
  };
  pass(-1);
  step(0);
  for (int c = 0; c + 1 < b; ++c) {
    pass(c);
    step(c + 1);
  }
  if (q == 0) form_t(T, NB, S, NB, tau_s, b, X);
  // V, explicit, from the outer block's first row J0 (CTA 0 the rows above the panel); tau; T.
  for (int c = 0; c < b; ++c) {
    const float sc = static_cast<float>(s_s[c]);
    for (int i = (q == 0 ? -(j0 - J0) : row0) + t; i < row0 + ml; i += kHhThreads)
      A[static_cast<int64_t>(c) * p + j0 + i] = i < c ? 0.f : i == c ? 1.f : sh[c * ld + (i - row0)] * sc;
  }
  if (q == 0) {
    if (t < b) tau[mat * r + j0 + t] = tau_s[t];
    float* const Tg = tp + mat * NB * NB;
    for (int e = t; e < NB * NB; e += kHhThreads) Tg[e] = e % NB < b && e / NB < b ? T[e] : 0.f;
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

// T (n x n, ld ldt, stride st) of an outer block's n reflectors from S = V^T
// V (n x n, ld lds, stride ss) and tau (from tau + J0, r per matrix).
__global__ void __launch_bounds__(kHhThreads) block_t_kernel(const float* S, int lds, int64_t ss, const float* tau,
                                                             int r, int J0, int n, float* T, int ldt, int64_t st) {
  extern __shared__ float smem[];
  float *Ss = smem, *Ts = Ss + n * n, *taus = Ts + n * n, *X = taus + kHhBlock;
  const float* Sg = S + static_cast<int64_t>(blockIdx.x) * ss;
  for (int e = threadIdx.x; e < n * n; e += blockDim.x) Ss[e] = Sg[e % n + static_cast<int64_t>(e / n) * lds];
  for (int e = threadIdx.x; e < n; e += blockDim.x) taus[e] = tau[static_cast<int64_t>(blockIdx.x) * r + J0 + e];
  __syncthreads();
  form_t(Ts, n, Ss, n, taus, n, X);
  float* const Tg = T + static_cast<int64_t>(blockIdx.x) * st;
  for (int e = threadIdx.x; e < n * n; e += blockDim.x) Tg[e % n + static_cast<int64_t>(e / n) * ldt] = Ts[e];
}
constexpr size_t block_t_smem(int n) { return sizeof(float) * (2 * static_cast<size_t>(n) * n + kHhBlock + 4096); }

__global__ void identity_kernel(MatBatch a) {
  const int64_t per = a.rows * a.cols, n = per * a.batch;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = e / per, i = e % per / a.cols, j = e % a.cols;
    a.p[b * a.stride + i * a.ld + j] = i == j ? 1.f : 0.f;
  }
}

template <int NB>
constexpr size_t panel_static_smem() {
  return sizeof(double) * (kHhThreads + NB) + sizeof(float) * (kHhThreads + 2 * NB + 2 * NB * NB + NB * NB / 4);
}
// panel_cluster_kernel's: panel_kernel's, and the sums handed round the cluster
template <int NB>
constexpr size_t panel_cluster_static_smem() {
  return panel_static_smem<NB>() + sizeof(double) * (3 * NB + 32) + sizeof(float) * (2 * NB + 32) + 16;
}

}  // namespace

int householder_init(int device, bool* clusters) {
  int optin = 0;
  cuda::check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
              "cudaDeviceGetAttribute (shared memory per block, opt-in)");
  // Panels of up to the device's opt-in limit (less the static arrays); the
  // outer blocks' T at 128 columns (148 KiB).
  cuda::check(cudaFuncSetAttribute(panel_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   optin - static_cast<int>(panel_static_smem<32>())),
              "cudaFuncSetAttribute (householder panel, 32)");
  cuda::check(cudaFuncSetAttribute(panel_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   optin - static_cast<int>(panel_static_smem<16>())),
              "cudaFuncSetAttribute (householder panel, 16)");
  int major = 0;
  cuda::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  *clusters = major >= 9;
  if (*clusters) {
    cuda::check(cudaFuncSetAttribute(panel_cluster_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     optin - static_cast<int>(panel_cluster_static_smem<32>())),
                "cudaFuncSetAttribute (householder cluster panel, 32)");
    cuda::check(cudaFuncSetAttribute(panel_cluster_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     optin - static_cast<int>(panel_cluster_static_smem<16>())),
                "cudaFuncSetAttribute (householder cluster panel, 16)");
  }
  const int bt = static_cast<int>(block_t_smem(kHhBlock));
  if (bt <= optin)
    cuda::check(cudaFuncSetAttribute(block_t_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bt),
                "cudaFuncSetAttribute (householder block T)");
  return optin;
}

int householder_panel_width(int64_t p, int smem_optin) {
  if (p <= 0 || p > (1 << 24) || static_cast<int>(block_t_smem(kHhBlock)) > smem_optin) return 0;
  const auto fits = [&](int nb, size_t st) {
    return sizeof(float) * nb * static_cast<size_t>(panel_ld(static_cast<int>(p), nb)) + st <=
           static_cast<size_t>(smem_optin);
  };
  if (fits(32, panel_static_smem<32>())) return 32;
  if (fits(16, panel_static_smem<16>())) return 16;
  return 0;
}

int householder_panel_cluster(const Ctx& c, int64_t p, int64_t j0, int nb, int64_t batch) {
  const int64_t per = nb == 32 ? 128 : 256;  // rows of one round of a CTA's pass
  int C = 1;
  while (C < 8 && (p - j0) >= 2 * C * per && batch * 2 * C <= c.sms) C *= 2;
  return C;
}

void householder_panel(const Ctx& c, float* cm, int64_t p, int64_t r, int64_t J0, int64_t j0, int64_t b, int nb,
                       float* tau, float* t, int64_t batch, int cluster) {
  DION_REQUIRE(batch > 0 && batch <= INT32_MAX && (nb == 16 || nb == 32) && b > 0 && b <= nb && J0 <= j0 &&
                   j0 + b <= r && r <= p,
               DION_ERROR_INTERNAL, "householder_panel: bad shape (p %lld, r %lld, j0 %lld, b %lld, nb %d)",
               static_cast<long long>(p), static_cast<long long>(r), static_cast<long long>(j0),
               static_cast<long long>(b), nb);
  const int m = static_cast<int>(p - j0);
  const size_t smem = sizeof(float) * nb * static_cast<size_t>(panel_ld(m, nb));
  const unsigned grid = static_cast<unsigned>(batch);
  const int P = static_cast<int>(p), R = static_cast<int>(r), JJ = static_cast<int>(J0), J = static_cast<int>(j0),
            Bc = static_cast<int>(b);
  if (cluster >= 2) {
    DION_REQUIRE(cluster <= 8 && batch * cluster <= INT32_MAX, DION_ERROR_INTERNAL,
                 "householder_panel: bad cluster size %d", cluster);
    const int mc = (m + cluster - 1) / cluster;
    DION_REQUIRE(mc >= nb + 2, DION_ERROR_INTERNAL, "householder_panel: %d rows over %d CTAs", m, cluster);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(batch * cluster));
    cfg.blockDim = dim3(kHhThreads);
    cfg.dynamicSmemBytes = sizeof(float) * nb * static_cast<size_t>(panel_ld(mc, nb));
    cfg.stream = c.stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = nb == 32 ? cudaLaunchKernelEx(&cfg, panel_cluster_kernel<32>, cm, P, R, JJ, J, Bc, mc, tau, t)
                                   : cudaLaunchKernelEx(&cfg, panel_cluster_kernel<16>, cm, P, R, JJ, J, Bc, mc, tau, t);
    cuda::check(e, "cudaLaunchKernelEx (householder cluster panel)");
    cuda::check_launch("householder cluster panel kernel");
    return;
  }
  if (nb == 32)
    panel_kernel<32><<<grid, kHhThreads, smem, c.stream>>>(cm, P, R, JJ, J, Bc, tau, t);
  else
    panel_kernel<16><<<grid, kHhThreads, smem, c.stream>>>(cm, P, R, JJ, J, Bc, tau, t);
  cuda::check_launch("householder panel kernel");
}

void householder_block_t(const Ctx& c, const float* s, int64_t lds, int64_t ss, const float* tau, int64_t r,
                         int64_t J0, int64_t n, float* t, int64_t ldt, int64_t st, int64_t batch) {
  DION_REQUIRE(n > 0 && n <= kHhBlock && batch > 0 && batch <= INT32_MAX, DION_ERROR_INTERNAL,
               "householder_block_t: bad shape (n %lld)", static_cast<long long>(n));
  block_t_kernel<<<static_cast<unsigned>(batch), kHhThreads, block_t_smem(kHhBlock), c.stream>>>(
      s, static_cast<int>(lds), ss, tau, static_cast<int>(r), static_cast<int>(J0), static_cast<int>(n), t,
      static_cast<int>(ldt), st);
  cuda::check_launch("householder block T kernel");
}

void identity(const Ctx& c, MatBatch a) {
  if (a.rows <= 0 || a.cols <= 0 || a.batch <= 0) return;
  identity_kernel<<<blocks_1d(c, a.rows * a.cols * a.batch), kThreads, 0, c.stream>>>(a);
  cuda::check_launch("identity kernel");
}

}  // namespace dion::kernels
