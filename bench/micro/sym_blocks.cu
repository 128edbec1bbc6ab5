// SPDX-License-Identifier: MIT
// Micro-benchmark (not built by CMake; docs/benchmarks.md cites its figures):
// the symmetric products of the Newton-Schulz / Polar Express iteration
// (A = X X^T, and A A for a symmetric A) computed as the nb (nb + 1) / 2
// blocks on and below the diagonal of an nb x nb grid, one pointer-array
// bf16 GEMM for all blocks of all matrices, then the blocks above the
// diagonal mirrored (a transposing copy), against the full strided product.
// Build and run on the GPU machine:
//   nvcc -arch=sm_90 -O2 -o sym_blocks bench/micro/sym_blocks.cu -lcublas && ./sym_blocks
#include <cmath>
#include <random>

#include "micro_util.cuh"

// Column-major s x s matrices: C[r, c] = C[c, r] for r < c (the upper triangle
// from the lower), 32 x 32 tiles through shared memory, tiles above the diagonal only.
__global__ void mirror(__nv_bfloat16* C, int s, long stride) {
  __shared__ __nv_bfloat16 t[32][33];
  const int bx = blockIdx.x, by = blockIdx.y;  // tile column bx, tile row by; work where by < bx... and diagonal
  if (by > bx) return;
  __nv_bfloat16* m = C + blockIdx.z * stride;
  // read the tile at (row block bx, col block by) = below the diagonal
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int r = bx * 32 + threadIdx.x, c = by * 32 + k;
    if (r < s && c < s) t[k][threadIdx.x] = m[(long)c * s + r];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < 32; k += blockDim.y) {
    const int r = by * 32 + threadIdx.x, c = bx * 32 + k;  // write (r, c) = old (c, r)
    if (r < s && c < s && r < c) m[(long)c * s + r] = t[threadIdx.x][k];
  }
}

struct Case {
  const char* name;
  int s, l, batch;
  bool square;  // A A for a symmetric A (l = s) instead of X X^T
};

int main() {
  MicroRig rig(32u << 20);
  cublasHandle_t h = rig.h;
  cudaStream_t st = rig.st;
  const Case cases[] = {
      {"gram s768 l3072 x12", 768, 3072, 12, false},   {"gram s768 l2304 x12", 768, 2304, 12, false},
      {"gram s768 l768 x12", 768, 768, 12, false},     {"A^2 s768 x12", 768, 768, 12, true},
      {"gram s2048 l8192 x24", 2048, 8192, 24, false}, {"gram s2048 l6144 x24", 2048, 6144, 24, false},
      {"gram s2048 l2048 x24", 2048, 2048, 24, false}, {"A^2 s2048 x24", 2048, 2048, 24, true},
      {"gram s512 l8192 x24 (dion2)", 512, 8192, 24, false}, {"A^2 s512 x24 (dion2)", 512, 512, 24, true},
  };
  printf("%-30s %8s | %8s %8s %8s %8s | %8s %8s %8s %8s | %s\n", "case", "full", "nb2", "nb3", "nb4", "nb6",
         "+mir2", "+mir3", "+mir4", "+mir6", "max |blk - full| (nb2..6)");
  for (const Case& c : cases) {
    const long sx = (long)c.s * c.l, sc = (long)c.s * c.s;
    __nv_bfloat16 *X, *C, *C2;
    CK(cudaMalloc(&X, 2 * sx * c.batch));
    CK(cudaMalloc(&C, 2 * sc * c.batch));
    CK(cudaMalloc(&C2, 2 * sc * c.batch));
    fill_bf16<<<1024, 256, 0, st>>>(X, sx * c.batch, 7);
    if (c.square) {  // a symmetric X: X X^T of a random one
      __nv_bfloat16* R;
      CK(cudaMalloc(&R, 2 * sx * c.batch));
      fill_bf16<<<1024, 256, 0, st>>>(R, sx * c.batch, 9);
      const float one = 1, zero = 0;
      CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, c.s, c.s, c.l, &one, R, CUDA_R_16BF, c.l, sx, R,
                                    CUDA_R_16BF, c.l, sx, &zero, X, CUDA_R_16BF, c.s, sc, c.batch, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
      CK(cudaStreamSynchronize(st));
      cudaFree(R);
    }
    const float one = 1, zero = 0;
    auto time_it = [&](auto&& fn) { return rig.median_ms(fn, 11); };
    auto full = [&] {
      if (c.square)
        CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, c.s, c.s, c.s, &one, X, CUDA_R_16BF, c.s, sc, X,
                                      CUDA_R_16BF, c.s, sc, &zero, C, CUDA_R_16BF, c.s, sc, c.batch,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      else
        CK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, c.s, c.s, c.l, &one, X, CUDA_R_16BF, c.l, sx, X,
                                      CUDA_R_16BF, c.l, sx, &zero, C, CUDA_R_16BF, c.s, sc, c.batch,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const float t_full = time_it(full);
    std::vector<__nv_bfloat16> ref(sc * c.batch), got(sc * c.batch);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(ref.data(), C, 2 * sc * c.batch, cudaMemcpyDeviceToHost));
    float tb[4], tm[4];
    double dmax[4];
    const int nbs[4] = {2, 3, 4, 6};
    for (int q = 0; q < 4; ++q) {
      const int nb = nbs[q];
      tb[q] = tm[q] = NAN;
      dmax[q] = NAN;
      if (c.s % nb) continue;
      const int bs = c.s / nb, nblk = nb * (nb + 1) / 2;
      const long cnt = (long)nblk * c.batch;
      std::vector<const void*> ha(cnt), hb(cnt);
      std::vector<void*> hc(cnt);
      long e = 0;
      for (int b = 0; b < c.batch; ++b)
        for (int j = 0; j < nb; ++j)
          for (int i = j; i < nb; ++i, ++e) {
            if (c.square) {
              ha[e] = X + b * sc + (long)i * bs;            // rows of block i, all columns (ld s)
              hb[e] = X + b * sc + (long)j * bs * c.s;      // all rows, columns of block j
            } else {
              ha[e] = X + b * sx + (long)i * bs * c.l;      // X_cm columns of block i
              hb[e] = X + b * sx + (long)j * bs * c.l;
            }
            hc[e] = C2 + b * sc + (long)j * bs * c.s + (long)i * bs;
          }
      void** dp;
      CK(cudaMalloc(&dp, sizeof(void*) * 3 * cnt));
      CK(cudaMemcpy(dp, ha.data(), sizeof(void*) * cnt, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dp + cnt, hb.data(), sizeof(void*) * cnt, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dp + 2 * cnt, hc.data(), sizeof(void*) * cnt, cudaMemcpyHostToDevice));
      auto blocks = [&] {
        if (c.square)
          CK(cublasGemmBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, bs, bs, c.s, &one, (const void**)dp, CUDA_R_16BF, c.s,
                                 (const void**)(dp + cnt), CUDA_R_16BF, c.s, &zero, dp + 2 * cnt, CUDA_R_16BF, c.s,
                                 (int)cnt, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        else
          CK(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, bs, bs, c.l, &one, (const void**)dp, CUDA_R_16BF, c.l,
                                 (const void**)(dp + cnt), CUDA_R_16BF, c.l, &zero, dp + 2 * cnt, CUDA_R_16BF, c.s,
                                 (int)cnt, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      const dim3 mg((c.s + 31) / 32, (c.s + 31) / 32, c.batch), mb(32, 8);
      tb[q] = time_it(blocks);
      tm[q] = time_it([&] {
        blocks();
        mirror<<<mg, mb, 0, st>>>(C2, c.s, sc);
      });
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaMemcpy(got.data(), C2, 2 * sc * c.batch, cudaMemcpyDeviceToHost));
      double d = 0, scale = 0;
      for (long i = 0; i < sc * c.batch; ++i) {
        d = std::max(d, (double)std::fabs(__bfloat162float(got[i]) - __bfloat162float(ref[i])));
        scale = std::max(scale, (double)std::fabs(__bfloat162float(ref[i])));
      }
      dmax[q] = d / scale;
      cudaFree(dp);
    }
    printf("%-30s %8.3f | %8.3f %8.3f %8.3f %8.3f | %8.3f %8.3f %8.3f %8.3f | %.1e %.1e %.1e %.1e\n", c.name, t_full,
           tb[0], tb[1], tb[2], tb[3], tm[0], tm[1], tm[2], tm[3], dmax[0], dmax[1], dmax[2], dmax[3]);
    cudaFree(X);
    cudaFree(C);
    cudaFree(C2);
  }
  printf("ms, median of 11, whole batch; +mir: the block product and the mirror; diffs relative to max |full|\n");
  return 0;
}
