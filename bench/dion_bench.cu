// SPDX-License-Identifier: MIT
//
// dion-bench: times one libdion optimizer step on the CUDA backend over the
// weight matrices of GPT blocks and compares it with a roofline-style floor.
//
// Workloads: per layer, one each of qkv (3d, d), out (d, d), fc1 (4d, d) and
// fc2 (d, 4d), shapes (fan_out, fan_in) row-major, all in one group.
//   gpt-160m: d = 768, 12 layers      gpt-1.3b: d = 2048, 24 layers
//
// Timing: warm-up steps, then every timed step is bracketed by its own pair of
// CUDA events on a non-default stream. The steps are enqueued one after the
// other and the stream is synchronised only at the end, so the host never
// stalls the device between steps, yet each step gets its own duration; we
// report the median, min and max.
//
// Floor model (docs/benchmarks.md has the same text):
//   floor = max(FLOPs / GEMM rate at the matmul precision used,
//               bytes / copy bandwidth)
// both rates measured here on the same device: cublasGemmEx at 8192^3
// (fp32: CUBLAS_COMPUTE_32F; tf32: CUBLAS_COMPUTE_32F_FAST_TF32; bf16: bf16
// inputs, fp32 output, CUBLAS_COMPUTE_32F) and cudaMemcpyAsync of 1 GiB device
// to device counted as 2 GiB moved (read + write); the best of 10 runs each,
// which keeps the floor a lower bound.
//
// FLOPs per matrix m x n (fan_out x fan_in):
//   Dion, rank r = min(m, n, ceil(rank_fraction * min(m, n))), power_iters 1,
//   working matrix B a x b with a = max(m, n), b = min(m, n) (a >= b >= r),
//   RCQR sketch rows k = 128 * ceil(1.25 * r / 128) (oversample 1.25):
//     8abr                      P = B Q, R = B^T P, error feedback P R^T,
//                               update P Q^T (2abr each); 6abr at full rank
//                               (r = b), where the library's error feedback
//                               is the decay M <- mu M (DION_FULL_RANK_EF;
//                               its pass is not counted: see the bytes)
//     if a > r (RCQR):
//       + 2kar                  S P
//       + 2kr^2 - 2r^3/3        Householder R factor of S P (k x r)
//       + ar^2                  P R1^-1
//       + 2ar^2                 Gram P^T P
//       + r^3/3                 Cholesky
//       + ar^2                  P R2^-1
//     else (a == r, square at full rank: Householder QR with explicit Q):
//       + 4ar^2 - 4r^3/3
//   Muon / NorMuon: Polar Express, T = 5 iterations on s x l, s = min(m, n),
//     l = max(m, n); per iteration A = X X^T (2s^2 l), B = bA + cA^2 (2s^3),
//     X = aX + BX (2s^2 l):      T * (4 s^2 l + 2 s^3)
//     At matmul precision bf16 with l >= 2 s the library runs the Gram form
//     (src/algo/ns_bf16.hpp; DION_NS_GRAM=0 the form above): in p phases
//     (restarts + 1; DION_NS_GRAM_RESTARTS, by default after steps 1 and 3,
//     p = 3) per phase R = X X^T and X = P X (2s^2 l each), per step Q (2s^3),
//     and within a phase P = Q P and R = Q R Q (2s^3 and 4s^3) after its first
//     step:                      4 p s^2 l + 2 (4T - 3p) s^3
//   Dion2 (fraction f): k = ceil(f * min(m, n)) slices of the shorter dim, so
//     the orthogonalized matrix is k x max(m, n); same polynomial cost with
//     s = k, l = max(m, n).
//   NorDion2 (fraction f): always k = ceil(f * m) rows, matrix k x n; same cost
//     with s = min(k, n), l = max(k, n).
//   AdamW, Lion: 0 (element-wise).
// All FLOPs are charged at the rate of the chosen precision, even the few small
// products the library may run in fp32 (Gram matrix, QR): the floor stays a
// lower bound. One exception, faster than the chosen precision: at fp32 the
// library computes RCQR's sketch S P as two bf16 products (P split in two
// bf16 parts, DION_SKETCH_SPLIT), so there the 2kar FLOPs of S P are charged
// twice at the bf16 rate (measured too) instead of once at the fp32 one.
// The model follows the library's switches as this process sees them:
// DION_SKETCH_SPLIT=0 charges the sketch at fp32, DION_FULL_RANK_EF=0 the
// full-rank error feedback's 2abr.
// Symmetric kernels (syrk-style Gram products) can undercut the 2 s^2 l Gram
// term, so a ratio a little below 1 is possible for Muon.
//
// Bytes per matrix (minimal traffic; e = elements, p = dtype size of the
// parameter, which by default is also that of the gradient and every state):
//   every algorithm: read grad (e p) + read/write param (2 e p)
//   + read/write of each state:
//     Dion:      momentum 2 e p + Q 2 b r p
//     Muon:      momentum 2 e p          Dion2:    momentum 2 e p
//     NorMuon:   momentum 2 e p + variance_neuron 2 m p
//     NorDion2:  momentum 2 e p + variance_neuron 2 m p
//     AdamW:     momentum 2 e p + variance 2 e p   (fp32: 28 bytes/element)
//     Lion:      momentum 2 e p
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dion.h"

namespace {

// ---------------------------------------------------------------------------
// Configurations
// ---------------------------------------------------------------------------

struct Workload {
  const char* name;
  int64_t d;
  int layers;
};

constexpr Workload kWorkloads[] = {{"gpt-160m", 768, 12}, {"gpt-1.3b", 2048, 24}};

struct Algo {
  const char* name;
  dion_algorithm_t algorithm;
  double rank_fraction;  // Dion only
  double fraction;       // Dion2 / NorDion2 only
};

constexpr Algo kAlgos[] = {
    {"dion", DION_ALGO_DION, 0.25, 0.25},     {"dion-r1", DION_ALGO_DION, 1.0, 0.25},
    {"muon", DION_ALGO_MUON, 1.0, 0.25},      {"dion2", DION_ALGO_DION2, 1.0, 0.25},
    {"normuon", DION_ALGO_NORMUON, 1.0, 0.25}, {"nordion2", DION_ALGO_NORDION2, 1.0, 0.25},
    {"adamw", DION_ALGO_ADAMW, 1.0, 0.25},    {"lion", DION_ALGO_LION, 1.0, 0.25},
};

enum class Dtype { kFp32, kBf16 };
enum class Precision { kFp32, kTf32, kBf16, kAuto };

const char* dtype_name(Dtype t) { return t == Dtype::kFp32 ? "fp32" : "bf16"; }
size_t dtype_size(Dtype t) { return t == Dtype::kFp32 ? 4 : 2; }

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kTf32: return "tf32";
    case Precision::kBf16: return "bf16";
    default: return "auto";
  }
}

// auto = the parameter dtype: fp32 matmuls for fp32 parameters, bf16 matmuls
// (fp32 accumulation) for bf16 parameters.
Precision resolve(Precision p, Dtype t) {
  if (p != Precision::kAuto) return p;
  return t == Dtype::kFp32 ? Precision::kFp32 : Precision::kBf16;
}

dion_matmul_precision_t to_dion(Precision p) {
  switch (p) {
    case Precision::kTf32: return DION_MATMUL_TF32;
    case Precision::kBf16: return DION_MATMUL_BF16;
    default: return DION_MATMUL_FP32;
  }
}

struct Shape {
  int64_t m, n;  // fan_out, fan_in
  const char* role;
};

std::vector<Shape> shapes_of(const Workload& w) {
  std::vector<Shape> s;
  const int64_t d = w.d;
  for (int l = 0; l < w.layers; ++l) {
    s.push_back({3 * d, d, "qkv"});
    s.push_back({d, d, "out"});
    s.push_back({4 * d, d, "fc1"});
    s.push_back({d, 4 * d, "fc2"});
  }
  return s;
}

// ---------------------------------------------------------------------------
// Floor model (formulas in the header comment)
// ---------------------------------------------------------------------------

constexpr int kOrthoSteps = 5;        // Polar Express iterations (library default)
constexpr double kOversample = 1.25;  // RCQR oversampling (library default)

// The Gram form's phases as the library takes them (0: the classic form):
// matmul precision bf16, DION_NS_GRAM not "0", DION_NS_GRAM_RESTARTS (a list
// of steps, or "none"; unset or malformed: 1,3) counting the restarts before
// the last step.
int gram_phases(Precision prec) {
  const char* on = std::getenv("DION_NS_GRAM");
  if (prec != Precision::kBf16 || (on && std::strcmp(on, "0") == 0)) return 0;
  const char* r = std::getenv("DION_NS_GRAM_RESTARTS");
  if (!r || !*r) return 3;
  if (std::strcmp(r, "none") == 0) return 1;
  int phases = 1;
  for (const char* c = r; *c;) {
    char* end = nullptr;
    const long k = std::strtol(c, &end, 10);
    if (end == c || k < 1 || k > 31 || (*end && *end != ',') || (*end == ',' && !end[1])) return 3;
    if (k < kOrthoSteps) ++phases;
    c = *end ? end + 1 : end;
  }
  return phases;
}

double poly_flops(double s, double l, int phases) {
  if (phases > 0 && l >= 2 * s)
    return 4.0 * phases * s * s * l + 2.0 * (4.0 * kOrthoSteps - 3.0 * phases) * s * s * s;
  return kOrthoSteps * (4.0 * s * s * l + 2.0 * s * s * s);
}

// A library switch (docs/ENV.md) as the library reads it: on unless "0".
bool env_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e && std::strcmp(e, "0") == 0);
}

struct Cost {
  double flops = 0;
  double bytes = 0;
  double sketch_flops = 0;  // Dion's S P, within flops
};

Cost matrix_cost(const Algo& algo, const Shape& sh, Dtype dt, int phases) {
  const double p = static_cast<double>(dtype_size(dt));
  const int64_t lo = std::min(sh.m, sh.n), hi = std::max(sh.m, sh.n);
  const double e = static_cast<double>(sh.m) * static_cast<double>(sh.n);
  Cost c;
  c.bytes = 3.0 * e * p;  // grad read, param read + write
  switch (algo.algorithm) {
    case DION_ALGO_DION: {
      // r and k in double arithmetic, as the library (spec §2.2, §1.3).
      const int64_t r = std::min<int64_t>(lo, static_cast<int64_t>(std::ceil(algo.rank_fraction * lo)));
      const double a = static_cast<double>(hi), b = static_cast<double>(lo), rr = static_cast<double>(r);
      const double k = 128.0 * std::ceil(kOversample * rr / 128.0);
      c.flops = (r == lo && env_on("DION_FULL_RANK_EF") ? 6.0 : 8.0) * a * b * rr;
      if (hi > r) {
        c.sketch_flops = 2.0 * k * a * rr;
        c.flops += c.sketch_flops + 2.0 * k * rr * rr - 2.0 * rr * rr * rr / 3.0 + 4.0 * a * rr * rr +
                   rr * rr * rr / 3.0;
      } else {
        c.flops += 4.0 * a * rr * rr - 4.0 * rr * rr * rr / 3.0;
      }
      c.bytes += 2.0 * e * p + 2.0 * b * rr * p;
      break;
    }
    case DION_ALGO_MUON:
      c.flops = poly_flops(static_cast<double>(lo), static_cast<double>(hi), phases);
      c.bytes += 2.0 * e * p;
      break;
    case DION_ALGO_NORMUON:
      c.flops = poly_flops(static_cast<double>(lo), static_cast<double>(hi), phases);
      c.bytes += 2.0 * e * p + 2.0 * static_cast<double>(sh.m) * p;
      break;
    case DION_ALGO_DION2: {
      const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(algo.fraction * lo)));
      c.flops = poly_flops(static_cast<double>(std::min(k, hi)), static_cast<double>(std::max(k, hi)), phases);
      c.bytes += 2.0 * e * p;
      break;
    }
    case DION_ALGO_NORDION2: {
      const int64_t k =
          std::min<int64_t>(sh.m, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(algo.fraction * sh.m))));
      c.flops = poly_flops(static_cast<double>(std::min(k, sh.n)), static_cast<double>(std::max(k, sh.n)), phases);
      c.bytes += 2.0 * e * p + 2.0 * static_cast<double>(sh.m) * p;
      break;
    }
    case DION_ALGO_ADAMW:
      c.bytes += 4.0 * e * p;
      break;
    case DION_ALGO_LION:
      c.bytes += 2.0 * e * p;
      break;
    default:
      break;
  }
  return c;
}

Cost workload_cost(const Algo& algo, const std::vector<Shape>& shapes, Dtype dt, Precision prec) {
  Cost total;
  const int phases = gram_phases(prec);
  for (const Shape& s : shapes) {
    Cost c = matrix_cost(algo, s, dt, phases);
    total.flops += c.flops;
    total.bytes += c.bytes;
    total.sketch_flops += c.sketch_flops;
  }
  return total;
}

// ---------------------------------------------------------------------------
// Output helpers
// ---------------------------------------------------------------------------

std::string json_escape(const char* s) {
  std::string out;
  for (const unsigned char* p = reinterpret_cast<const unsigned char*>(s ? s : ""); *p; ++p) {
    switch (*p) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (*p < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", *p);
          out += buf;
        } else {
          out += static_cast<char>(*p);
        }
    }
  }
  return out;
}

struct Config {
  const Workload* workload;
  const Algo* algo;
  Dtype dtype;
  Precision precision;  // resolved
};

std::string config_prefix(const Config& c, const std::string& device) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "{\"workload\":\"%s\",\"algo\":\"%s\",\"dtype\":\"%s\",\"precision\":\"%s\"",
                c.workload->name, c.algo->name, dtype_name(c.dtype), precision_name(c.precision));
  std::string s = buf;
  if (!device.empty()) s += ",\"device\":\"" + json_escape(device.c_str()) + "\"";
  return s;
}

void print_error(const Config& c, const std::string& device, const std::string& msg) {
  std::printf("%s,\"error\":\"%s\"}\n", config_prefix(c, device).c_str(), json_escape(msg.c_str()).c_str());
  std::fflush(stdout);
}

// A CUDA error that poisons the context makes every later configuration fail,
// so the bench stops there instead of printing a wall of identical errors.
// Non-sticky errors (a failed cudaMalloc) are cleared first; a sticky one
// survives cudaGetLastError and is returned again by the synchronisation.
bool context_is_dead() {
  cudaGetLastError();
  return cudaDeviceSynchronize() != cudaSuccess;
}

// ---------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  // splitmix64 finaliser: a stateless hash, so any element can be filled
  // independently and the init needs no curand state.
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// Uniform values in [-scale, scale).
template <typename T>
__global__ void fill_uniform(T* p, size_t n, uint64_t seed, float scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t h = mix64(seed ^ mix64(static_cast<uint64_t>(i)));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    put(p + i, (2.0f * u - 1.0f) * scale);
  }
}

template <typename T>
void fill(T* p, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  fill_uniform<T><<<1024, 256, 0, stream>>>(p, n, seed, scale);
}

void fill_bytes(void* p, size_t n_elems, Dtype dt, uint64_t seed, float scale, cudaStream_t stream) {
  if (dt == Dtype::kFp32)
    fill(static_cast<float*>(p), n_elems, seed, scale, stream);
  else
    fill(static_cast<__nv_bfloat16*>(p), n_elems, seed, scale, stream);
}

#define BENCH_CUDA(call)                                                                   \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "dion-bench: %s failed: %s\n", #call, cudaGetErrorString(e_));  \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

#define BENCH_CUBLAS(call)                                                        \
  do {                                                                            \
    cublasStatus_t s_ = (call);                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                            \
      std::fprintf(stderr, "dion-bench: %s failed: status %d\n", #call, (int)s_); \
      std::exit(2);                                                               \
    }                                                                             \
  } while (0)

// ---------------------------------------------------------------------------
// Device rates (measured once per run, on the benchmarked device)
// ---------------------------------------------------------------------------

constexpr int kRateReps = 10;

// Best time (ms) of kRateReps launches of `op`, each bracketed by its own
// events, after a warm-up.
template <typename Op>
float best_ms(cudaStream_t stream, Op op) {
  for (int i = 0; i < 3; ++i) op();
  std::vector<cudaEvent_t> ev(2 * kRateReps);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < kRateReps; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
    op();
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  float best = 1e30f;
  for (int i = 0; i < kRateReps; ++i) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    best = std::min(best, ms);
  }
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));
  return best;
}

// FLOP/s of an n^3 GEMM at the given precision.
double measure_gemm_rate(Precision prec, cudaStream_t stream) {
  constexpr int n = 8192;
  const size_t elems = static_cast<size_t>(n) * n;
  const bool bf16 = prec == Precision::kBf16;
  const size_t in_size = bf16 ? 2 : 4;
  void *A = nullptr, *B = nullptr, *C = nullptr;
  BENCH_CUDA(cudaMalloc(&A, elems * in_size));
  BENCH_CUDA(cudaMalloc(&B, elems * in_size));
  BENCH_CUDA(cudaMalloc(&C, elems * 4));
  const Dtype in_dt = bf16 ? Dtype::kBf16 : Dtype::kFp32;
  fill_bytes(A, elems, in_dt, 1, 1.0f, stream);
  fill_bytes(B, elems, in_dt, 2, 1.0f, stream);
  BENCH_CUDA(cudaGetLastError());
  cublasHandle_t h = nullptr;
  BENCH_CUBLAS(cublasCreate(&h));
  BENCH_CUBLAS(cublasSetStream(h, stream));
  const cudaDataType_t ab_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute =
      prec == Precision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const float alpha = 1.0f, beta = 0.0f;
  float ms = best_ms(stream, [&] {
    BENCH_CUBLAS(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, A, ab_type, n, B, ab_type, n, &beta, C,
                              CUDA_R_32F, n, compute, CUBLAS_GEMM_DEFAULT));
  });
  BENCH_CUBLAS(cublasDestroy(h));
  BENCH_CUDA(cudaFree(A));
  BENCH_CUDA(cudaFree(B));
  BENCH_CUDA(cudaFree(C));
  return 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3);
}

// Bytes/s of a device-to-device copy of 1 GiB, counting read + write.
double measure_copy_bw(cudaStream_t stream) {
  constexpr size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMalloc(&dst, bytes));
  BENCH_CUDA(cudaMemsetAsync(src, 1, bytes, stream));
  float ms = best_ms(stream, [&] { BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); });
  BENCH_CUDA(cudaFree(src));
  BENCH_CUDA(cudaFree(dst));
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

// ---------------------------------------------------------------------------
// One configuration
// ---------------------------------------------------------------------------

struct Options {
  std::vector<const Workload*> workloads;
  std::vector<const Algo*> algos;
  std::vector<Dtype> dtypes;
  Precision precision = Precision::kAuto;
  int iters = 30;
  int warmup = 5;
  int device = 0;
  bool list = false;
  bool graph = false;  // also time the step captured in a CUDA graph and replayed
};

struct Rates {
  double gemm[3] = {0, 0, 0};  // FLOP/s by Precision (fp32, tf32, bf16)
  double copy = 0;             // bytes/s
};

// Everything one configuration allocates; released by the destructor so that
// every exit path frees it before the next configuration.
struct Run {
  dion_optimizer_t opt = nullptr;
  void* params = nullptr;
  void* grads = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> events;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Run() {
    if (stream) cudaStreamSynchronize(stream);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    dion_destroy(opt);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
    cudaFree(params);
    cudaFree(grads);
  }
};

// Runs one configuration and prints its JSON line; false on error.
bool run_config(const Config& c, const Options& o, const Rates& rates, const std::string& device) {
  const std::vector<Shape> shapes = shapes_of(*c.workload);
  const size_t esize = dtype_size(c.dtype);
  const dion_dtype_t ddt = c.dtype == Dtype::kFp32 ? DION_DTYPE_FP32 : DION_DTYPE_BF16;

  // One allocation each for params and grads, every tensor 256-byte aligned.
  std::vector<size_t> offset(shapes.size());
  size_t total_bytes = 0;
  int64_t total_elems = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    offset[i] = total_bytes;
    const size_t n = static_cast<size_t>(shapes[i].m * shapes[i].n);
    total_elems += static_cast<int64_t>(n);
    total_bytes += (n * esize + 255) & ~size_t{255};
  }

  Run run;
  auto cuda_fail = [&](const char* what, cudaError_t e) {
    print_error(c, device, std::string(what) + ": " + cudaGetErrorString(e));
    return false;
  };
  cudaError_t e;
  if ((e = cudaStreamCreateWithFlags(&run.stream, cudaStreamNonBlocking)) != cudaSuccess)
    return cuda_fail("cudaStreamCreateWithFlags", e);
  if ((e = cudaMalloc(&run.params, total_bytes)) != cudaSuccess) return cuda_fail("cudaMalloc(params)", e);
  if ((e = cudaMalloc(&run.grads, total_bytes)) != cudaSuccess) return cuda_fail("cudaMalloc(grads)", e);
  // Parameters like a 0.02-std init, gradients of a typical magnitude; the
  // values only need to be finite and not degenerate (all-zero momentum would
  // take Dion's shortcut path).
  for (size_t i = 0; i < shapes.size(); ++i) {
    const size_t n = static_cast<size_t>(shapes[i].m * shapes[i].n);
    fill_bytes(static_cast<char*>(run.params) + offset[i], n, c.dtype, 0x1000 + 2 * i, 0.035f, run.stream);
    fill_bytes(static_cast<char*>(run.grads) + offset[i], n, c.dtype, 0x1001 + 2 * i, 0.01f, run.stream);
  }
  if ((e = cudaGetLastError()) != cudaSuccess) return cuda_fail("fill_uniform", e);
  if ((e = cudaStreamSynchronize(run.stream)) != cudaSuccess) return cuda_fail("cudaStreamSynchronize", e);

  auto dion_fail = [&](const char* what, dion_status_t st) {
    const char* msg = dion_last_error(run.opt);
    if (!msg || !*msg) msg = dion_last_error(nullptr);
    print_error(c, device, std::string(what) + ": " + dion_status_string(st) + (msg && *msg ? ": " : "") +
                               (msg ? msg : ""));
    return false;
  };
  dion_options_t opts;
  dion_status_t st = dion_options_init(&opts);
  if (st != DION_SUCCESS) return dion_fail("dion_options_init", st);
  opts.backend = DION_BACKEND_CUDA;
  opts.device = o.device;
  if ((st = dion_create(&run.opt, &opts)) != DION_SUCCESS) return dion_fail("dion_create", st);

  dion_group_options_t go;
  if ((st = dion_group_options_init(&go, c.algo->algorithm)) != DION_SUCCESS)
    return dion_fail("dion_group_options_init", st);
  if (c.algo->algorithm == DION_ALGO_DION) go.rank_fraction = c.algo->rank_fraction;
  if (c.algo->algorithm == DION_ALGO_DION2 || c.algo->algorithm == DION_ALGO_NORDION2)
    go.fraction = c.algo->fraction;
  go.matmul_precision = to_dion(c.precision);

  std::vector<std::string> names(shapes.size());
  std::vector<dion_tensor_t> tensors(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    names[i] = "layers." + std::to_string(i / 4) + "." + shapes[i].role;
    dion_tensor_t& t = tensors[i];
    if ((st = dion_tensor_init(&t)) != DION_SUCCESS) return dion_fail("dion_tensor_init", st);
    t.name = names[i].c_str();
    t.param = static_cast<char*>(run.params) + offset[i];
    t.grad = static_cast<const char*>(run.grads) + offset[i];
    t.param_dtype = ddt;
    t.grad_dtype = ddt;
    t.ndim = 2;
    t.shape[0] = shapes[i].m;
    t.shape[1] = shapes[i].n;
  }
  if ((st = dion_add_group(run.opt, &go, tensors.data(), tensors.size(), nullptr)) != DION_SUCCESS)
    return dion_fail("dion_add_group", st);

  dion_stream_t ds = reinterpret_cast<dion_stream_t>(run.stream);
  for (int i = 0; i < o.warmup; ++i)
    if ((st = dion_step(run.opt, ds)) != DION_SUCCESS) return dion_fail("dion_step (warm-up)", st);
  if ((e = cudaStreamSynchronize(run.stream)) != cudaSuccess) return cuda_fail("warm-up", e);

  run.events.resize(2 * static_cast<size_t>(o.iters));
  for (cudaEvent_t& ev : run.events)
    if ((e = cudaEventCreate(&ev)) != cudaSuccess) return cuda_fail("cudaEventCreate", e);
  std::vector<double> host_ms(static_cast<size_t>(o.iters));
  for (int i = 0; i < o.iters; ++i) {
    cudaEventRecord(run.events[2 * i], run.stream);
    const auto t0 = std::chrono::steady_clock::now();
    if ((st = dion_step(run.opt, ds)) != DION_SUCCESS) return dion_fail("dion_step", st);
    host_ms[static_cast<size_t>(i)] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    cudaEventRecord(run.events[2 * i + 1], run.stream);
  }
  if ((e = cudaStreamSynchronize(run.stream)) != cudaSuccess) return cuda_fail("timed steps", e);
  dion_status_t async_st = DION_SUCCESS;
  if ((st = dion_get_async_error(run.opt, &async_st)) != DION_SUCCESS) return dion_fail("dion_get_async_error", st);
  if (async_st != DION_SUCCESS) return dion_fail("asynchronous error", async_st);

  std::vector<float> ms(static_cast<size_t>(o.iters));
  for (int i = 0; i < o.iters; ++i)
    if ((e = cudaEventElapsedTime(&ms[i], run.events[2 * i], run.events[2 * i + 1])) != cudaSuccess)
      return cuda_fail("cudaEventElapsedTime", e);
  auto median_of = [](auto v) {
    std::sort(v.begin(), v.end());
    const size_t h = v.size() / 2;
    return v.size() % 2 ? static_cast<double>(v[h]) : 0.5 * (static_cast<double>(v[h - 1]) + v[h]);
  };
  std::sort(ms.begin(), ms.end());
  const double median = median_of(ms);
  // The host's time to enqueue a step (when it is not below the step's
  // device time, the device waits for the host), and with --graph the step
  // captured once in a CUDA graph and replayed (no host work per step).
  const double host_median = median_of(host_ms);
  double graph_median = -1;
  if (o.graph) {
    if ((e = cudaStreamBeginCapture(run.stream, cudaStreamCaptureModeThreadLocal)) != cudaSuccess)
      return cuda_fail("cudaStreamBeginCapture", e);
    st = dion_step(run.opt, ds);
    if ((e = cudaStreamEndCapture(run.stream, &run.graph)) != cudaSuccess) return cuda_fail("cudaStreamEndCapture", e);
    if (st != DION_SUCCESS) return dion_fail("dion_step (capture)", st);
    if ((e = cudaGraphInstantiate(&run.exec, run.graph, 0)) != cudaSuccess) return cuda_fail("cudaGraphInstantiate", e);
    for (int i = 0; i < 2; ++i) cudaGraphLaunch(run.exec, run.stream);
    for (int i = 0; i < o.iters; ++i) {
      cudaEventRecord(run.events[2 * i], run.stream);
      cudaGraphLaunch(run.exec, run.stream);
      cudaEventRecord(run.events[2 * i + 1], run.stream);
    }
    if ((e = cudaStreamSynchronize(run.stream)) != cudaSuccess) return cuda_fail("graph replays", e);
    std::vector<float> gms(static_cast<size_t>(o.iters));
    for (int i = 0; i < o.iters; ++i)
      if ((e = cudaEventElapsedTime(&gms[i], run.events[2 * i], run.events[2 * i + 1])) != cudaSuccess)
        return cuda_fail("cudaEventElapsedTime", e);
    graph_median = median_of(gms);
  }

  // Skipped steps (non-finite gradients) would time a different code path.
  int64_t skipped = 0;
  int32_t last_skipped = 0;
  if ((st = dion_get_skipped_steps(run.opt, &skipped, &last_skipped, ds)) != DION_SUCCESS)
    return dion_fail("dion_get_skipped_steps", st);
  uint64_t state_bytes = 0, ws_bytes = 0;
  if ((st = dion_get_memory_usage(run.opt, &state_bytes, &ws_bytes)) != DION_SUCCESS)
    return dion_fail("dion_get_memory_usage", st);

  const Cost cost = workload_cost(*c.algo, shapes, c.dtype, c.precision);
  const double gemm_rate = rates.gemm[static_cast<int>(c.precision)];
  // FP32: the sketch as two bf16 products (see the floor model above)
  const bool split =
      c.precision == Precision::kFp32 && cost.sketch_flops > 0 && rates.gemm[2] > 0 && env_on("DION_SKETCH_SPLIT");
  const double flop_s = split ? (cost.flops - cost.sketch_flops) / gemm_rate + 2 * cost.sketch_flops / rates.gemm[2]
                              : cost.flops / gemm_rate;
  const double floor_s = std::max(flop_s, cost.bytes / rates.copy);
  const double floor_ms = floor_s * 1e3;

  std::printf(
      "%s,\"tensors\":%zu,\"params\":%lld,\"step_ms_median\":%.4f,\"step_ms_min\":%.4f,\"step_ms_max\":%.4f,"
      "\"iters\":%d,\"floor_ms\":%.4f,\"ratio\":%.3f,\"gemm_tflops\":%.2f,\"copy_gbps\":%.1f,\"flops\":%.6g,"
      "\"bytes\":%.6g,\"state_bytes\":%llu,\"workspace_bytes\":%llu",
      config_prefix(c, device).c_str(), shapes.size(), static_cast<long long>(total_elems), median,
      static_cast<double>(ms.front()), static_cast<double>(ms.back()), o.iters, floor_ms, median / floor_ms,
      gemm_rate * 1e-12, rates.copy * 1e-9, cost.flops, cost.bytes, static_cast<unsigned long long>(state_bytes),
      static_cast<unsigned long long>(ws_bytes));
  std::printf(",\"host_ms_median\":%.4f", host_median);
  if (graph_median >= 0) std::printf(",\"graph_ms_median\":%.4f", graph_median);
  if (skipped > 0) std::printf(",\"skipped_steps\":%lld", static_cast<long long>(skipped));
  std::printf("}\n");
  std::fflush(stdout);
  return true;
}

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

void usage(FILE* f) {
  std::fprintf(f,
               "usage: dion-bench [--workload gpt-160m|gpt-1.3b|all] "
               "[--algo dion|dion-r1|muon|dion2|normuon|nordion2|adamw|lion|all]\n"
               "                  [--dtype fp32|bf16|all] [--precision fp32|tf32|bf16|auto] [--iters N] "
               "[--warmup N]\n"
               "                  [--device N] [--graph] [--list]\n"
               "Times one optimizer step (CUDA backend) and prints one JSON line per configuration.\n"
               "  --precision auto (default): fp32 matmuls for fp32 parameters, bf16 for bf16 parameters\n"
               "  --iters N   timed steps (default 30; the median needs >= 20 to be meaningful)\n"
               "  --warmup N  untimed steps first (default 5)\n"
               "  --graph     also time the step captured in a CUDA graph and replayed (graph_ms_median);\n"
               "              host_ms_median is always the host's time to enqueue one step\n"
               "  --list      print the configurations and their FLOP/byte model without a GPU\n");
}

bool parse_int(const char* s, int lo, int* out) {
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (!s[0] || *end || v < lo || v > 1000000) return false;
  *out = static_cast<int>(v);
  return true;
}

bool parse_args(int argc, char** argv, Options* o) {
  std::string workload = "all", algo = "all", dtype = "all", precision = "auto";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char** v) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "dion-bench: %s needs a value\n", a.c_str());
        return false;
      }
      *v = argv[++i];
      return true;
    };
    const char* v = nullptr;
    if (a == "-h" || a == "--help") {
      usage(stdout);
      std::exit(0);
    } else if (a == "--list") {
      o->list = true;
    } else if (a == "--graph") {
      o->graph = true;
    } else if (a == "--workload") {
      if (!value(&v)) return false;
      workload = v;
    } else if (a == "--algo") {
      if (!value(&v)) return false;
      algo = v;
    } else if (a == "--dtype") {
      if (!value(&v)) return false;
      dtype = v;
    } else if (a == "--precision") {
      if (!value(&v)) return false;
      precision = v;
    } else if (a == "--iters" || a == "--warmup" || a == "--device") {
      if (!value(&v)) return false;
      int* dst = a == "--iters" ? &o->iters : a == "--warmup" ? &o->warmup : &o->device;
      if (!parse_int(v, a == "--iters" ? 1 : 0, dst)) {
        std::fprintf(stderr, "dion-bench: bad value for %s: %s\n", a.c_str(), v);
        return false;
      }
    } else {
      std::fprintf(stderr, "dion-bench: unknown argument %s\n", a.c_str());
      return false;
    }
  }
  for (const Workload& w : kWorkloads)
    if (workload == "all" || workload == w.name) o->workloads.push_back(&w);
  for (const Algo& al : kAlgos)
    if (algo == "all" || algo == al.name) o->algos.push_back(&al);
  if (dtype == "all" || dtype == "fp32") o->dtypes.push_back(Dtype::kFp32);
  if (dtype == "all" || dtype == "bf16") o->dtypes.push_back(Dtype::kBf16);
  if (precision == "fp32") o->precision = Precision::kFp32;
  else if (precision == "tf32") o->precision = Precision::kTf32;
  else if (precision == "bf16") o->precision = Precision::kBf16;
  else if (precision == "auto") o->precision = Precision::kAuto;
  else {
    std::fprintf(stderr, "dion-bench: unknown precision %s\n", precision.c_str());
    return false;
  }
  if (o->workloads.empty() || o->algos.empty() || o->dtypes.empty()) {
    std::fprintf(stderr, "dion-bench: unknown %s\n",
                 o->workloads.empty() ? "workload" : o->algos.empty() ? "algo" : "dtype");
    return false;
  }
  if (o->iters < 20)
    std::fprintf(stderr, "dion-bench: warning: --iters %d < 20, the median is not a benchmark figure\n", o->iters);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse_args(argc, argv, &o)) {
    usage(stderr);
    return 2;
  }
  std::vector<Config> configs;
  for (const Workload* w : o.workloads)
    for (const Algo* a : o.algos)
      for (Dtype dt : o.dtypes) configs.push_back({w, a, dt, resolve(o.precision, dt)});

  if (o.list) {
    // The model only: no device is touched, so this works on any machine.
    for (const Config& c : configs) {
      const std::vector<Shape> shapes = shapes_of(*c.workload);
      int64_t params = 0;
      for (const Shape& s : shapes) params += s.m * s.n;
      const Cost cost = workload_cost(*c.algo, shapes, c.dtype, c.precision);
      std::printf("%s,\"tensors\":%zu,\"params\":%lld,\"flops\":%.6g,\"bytes\":%.6g}\n",
                  config_prefix(c, "").c_str(), shapes.size(), static_cast<long long>(params), cost.flops,
                  cost.bytes);
    }
    return 0;
  }

  int ndev = 0;
  BENCH_CUDA(cudaGetDeviceCount(&ndev));
  if (o.device >= ndev) {
    std::fprintf(stderr, "dion-bench: --device %d but %d device(s) visible\n", o.device, ndev);
    return 2;
  }
  BENCH_CUDA(cudaSetDevice(o.device));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, o.device));
  const std::string device = prop.name;

  // Rates first, while the device holds nothing else; only the precisions the
  // chosen configurations use are measured.
  Rates rates;
  {
    cudaStream_t s = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    bool need[3] = {false, false, false};
    for (const Config& c : configs) {
      need[static_cast<int>(c.precision)] = true;
      // fp32 Dion's sketch runs at the bf16 rate (the floor model above)
      if (c.precision == Precision::kFp32 && c.algo->algorithm == DION_ALGO_DION) need[2] = true;
    }
    for (int p = 0; p < 3; ++p)
      if (need[p]) rates.gemm[p] = measure_gemm_rate(static_cast<Precision>(p), s);
    rates.copy = measure_copy_bw(s);
    BENCH_CUDA(cudaStreamDestroy(s));
    std::fprintf(stderr, "dion-bench: %s: gemm fp32 %.1f / tf32 %.1f / bf16 %.1f TFLOP/s (0 = not measured), "
                 "copy %.0f GB/s\n", device.c_str(), rates.gemm[0] * 1e-12, rates.gemm[1] * 1e-12,
                 rates.gemm[2] * 1e-12, rates.copy * 1e-9);
  }

  int failures = 0;
  for (const Config& c : configs) {
    if (!run_config(c, o, rates, device)) {
      ++failures;
      if (context_is_dead()) {
        std::fprintf(stderr, "dion-bench: the CUDA context is unusable, stopping\n");
        return 1;
      }
    }
  }
  return failures ? 1 : 0;
}
