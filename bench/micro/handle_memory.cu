// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/ENV.md cites its figures): the
// device memory cuSOLVER handles take, measured with cudaMemGetInfo around
// their creation and first use (cuSOLVER's documentation names a 32 MiB
// cuBLAS workspace per handle on compute capability 9.0 and later): the first
// handle, 7 more, their streams, a geqrf + orgqr of 1024 x 1024 on each, a
// ninth handle, and what destroying the 8 gives back. qr_q's lanes (one
// handle each) are counted in dion_get_memory_usage's workspace by the same
// measurement (CudaBackend::handle_bytes_).
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o handle_memory bench/micro/handle_memory.cu -lcusolver && ./handle_memory
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>
#include <cusolverDn.h>

#define CK(x)                                                      \
  do {                                                             \
    if ((x) != 0) {                                                \
      std::fprintf(stderr, "%s failed at line %d\n", #x, __LINE__); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

static double free_mib() {
  size_t f = 0, t = 0;
  CK(cudaDeviceSynchronize());
  CK(cudaMemGetInfo(&f, &t));
  return static_cast<double>(f) / (1 << 20);
}

int main() {
  CK(cudaFree(nullptr));
  const int n = 1024, H = 8;
  float *a = nullptr, *tau = nullptr, *work = nullptr;
  int* info = nullptr;
  CK(cudaMalloc(&a, sizeof(float) * n * n * H));
  CK(cudaMalloc(&tau, sizeof(float) * n * H));
  CK(cudaMalloc(&info, sizeof(int) * H));
  CK(cudaMemset(a, 0, sizeof(float) * n * n * H));
  cusolverDnHandle_t h[H + 1];
  cudaStream_t s[H + 1];
  double f = free_mib(), g = 0;
  auto report = [&](const char* what) {
    g = free_mib();
    std::printf("%-44s %8.1f MiB\n", what, f - g);
    f = g;
  };
  CK(cusolverDnCreate(&h[0]));
  report("first handle created:");
  for (int i = 1; i < H; ++i) CK(cusolverDnCreate(&h[i]));
  report("7 more handles:");
  for (int i = 0; i < H; ++i) {
    CK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
    CK(cusolverDnSetStream(h[i], s[i]));
    CK(cusolverDnSetDeterministicMode(h[i], CUSOLVER_DETERMINISTIC_RESULTS));
  }
  report("8 streams, set, deterministic mode:");
  int lw1 = 0, lw2 = 0;
  CK(cusolverDnSgeqrf_bufferSize(h[0], n, n, a, n, &lw1));
  CK(cusolverDnSorgqr_bufferSize(h[0], n, n, n, a, n, tau, &lw2));
  const int lw = lw1 > lw2 ? lw1 : lw2;
  CK(cudaMalloc(&work, sizeof(float) * static_cast<size_t>(lw) * (H + 1)));
  report("the 8 + 1 workspaces:");
  auto qr = [&](int i) {
    float* ai = a + static_cast<size_t>(i % H) * n * n;
    float* wi = work + static_cast<size_t>(lw) * i;
    CK(cusolverDnSgeqrf(h[i], n, n, ai, n, tau + (i % H) * n, wi, lw, info + i % H));
    CK(cusolverDnSorgqr(h[i], n, n, n, ai, n, tau + (i % H) * n, wi, lw, info + i % H));
  };
  qr(0);
  report("first geqrf + orgqr (handle 0):");
  for (int i = 1; i < H; ++i) qr(i);
  report("geqrf + orgqr on handles 1 to 7:");
  CK(cusolverDnCreate(&h[H]));
  CK(cudaStreamCreateWithFlags(&s[H], cudaStreamNonBlocking));
  CK(cusolverDnSetStream(h[H], s[H]));
  qr(H);
  report("a ninth handle, made and used:");
  for (int i = 0; i < H; ++i) CK(cusolverDnDestroy(h[i]));
  g = free_mib();
  std::printf("%-44s %8.1f MiB\n", "destroying the first 8 gave back:", g - f);
  return 0;
}
