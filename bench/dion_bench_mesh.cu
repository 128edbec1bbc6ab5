// SPDX-License-Identifier: MIT
// dion-bench-mesh: times the distributed optimizer step on several GPUs
// (CUDA backend, NCCL meshes), one MPI rank per GPU:
//
//   mpiexec -n 4 dion-bench-mesh --mesh 2x2x1 --workload gpt-1.3b --algo dion
//
// --mesh RxOxI cuts the world into replicate x outer x inner (rank =
// (r * O + o) * I + i; MPI splits it, libdion NCCL communicators carry the
// meshes). The workload is the weight matrices of GPT blocks (qkv 3d x d, out
// d x d, fc1 4d x d, fc2 d x 4d per layer), sharded as FSDP2 and Megatron TP
// shard them: the inner (TP) mesh splits qkv and fc1 by output rows
// (column-parallel, dim 0) and out and fc2 by input columns (row-parallel,
// dim 1); the outer (FSDP) mesh chunks the other dim (ceil(n / O) per rank).
// Every replica gets its own gradients; replicate_grad_sync is on, so Dion
// averages P and R (compressed) or the gradients over the replicate mesh.
//
// Each rank times dion_step on its own stream with CUDA events (warm-up,
// then --iters timed steps); the figure is the median over steps of the
// slowest rank's time (a step is as slow as its slowest rank). Rank 0 prints
// one JSON line with it and the bytes each mesh moved per step per rank
// (dion_get_comm_bytes).
//
// The share of the replicate mesh's communication that overlap hides (with
// a multi-rank replicate mesh; --hidden-share 0 skips it): the same step is
// also timed, each time by a fresh optimizer over the same (refilled)
// tensors, (a) sequential (DION_OVERLAP=0: every gradient averaged before any
// bucket computes) and (b) without the replicate sync (replicate_grad_sync =
// 0, so neither gradients nor Dion's P and R are averaged over the replicate
// mesh; every other collective and all the compute stay). Since the
// sequential step serialises that sync with the compute, comm_ms =
// t_sequential - t_nosync is the time the sync costs when nothing hides it,
// and hidden_share = (t_sequential - t_overlapped) / comm_ms the part of it
// the overlapped step (the default, step_ms_*) hides.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dion_mpi.h"

namespace {

int g_rank = 0, g_size = 1;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "dion-bench-mesh: rank %d: %s\n", g_rank, msg.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}
void dion_ok(dion_status_t s, const char* what, dion_optimizer_t opt = nullptr) {
  if (s != DION_SUCCESS) {
    const char* m = dion_last_error(opt);
    if (!m || !*m) m = dion_last_error(nullptr);
    die(std::string(what) + ": " + dion_status_string(s) + ": " + (m ? m : ""));
  }
}

__global__ void fill_kernel(float* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = scale * static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
}
__global__ void to_bf16_kernel(const float* s, __nv_bfloat16* d, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    d[i] = __float2bfloat16(s[i]);
}

struct Shape {
  int64_t m, n;
  int inner_dim;  // TP: 0 column-parallel, 1 row-parallel
};

dion_comm_t nccl_over(MPI_Comm c, int device) {
  int r = 0, n = 1;
  MPI_Comm_rank(c, &r);
  MPI_Comm_size(c, &n);
  if (n == 1) return nullptr;
  dion_nccl_unique_id_t id;
  std::memset(&id, 0, sizeof id);
  if (r == 0) dion_ok(dion_nccl_get_unique_id(&id), "dion_nccl_get_unique_id");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, c);
  dion_comm_t out = nullptr;
  dion_ok(dion_comm_init_nccl(&out, &id, n, r, device), "dion_comm_init_nccl");
  return out;
}

void chunk(int64_t full, int W, int q, int64_t* off, int64_t* ext) {
  const int64_t c = (full + W - 1) / W;
  *off = std::min(full, q * c);
  *ext = std::min(c, full - *off);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  int R = 1, O = g_size, I = 1, iters = 20, warmup = 5;
  std::string workload = "gpt-1.3b", algo = "dion", dtype = "bf16";
  double rank_fraction = 0.25;
  bool hidden_share = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&] {
      if (i + 1 >= argc) die("missing value after " + a);
      return std::string(argv[++i]);
    };
    if (a == "--mesh") {
      if (std::sscanf(val().c_str(), "%dx%dx%d", &R, &O, &I) != 3) die("--mesh wants RxOxI, e.g. 2x2x1");
    } else if (a == "--workload") {
      workload = val();
    } else if (a == "--algo") {
      algo = val();
    } else if (a == "--dtype") {
      dtype = val();
    } else if (a == "--rank-fraction") {
      rank_fraction = std::atof(val().c_str());
    } else if (a == "--iters") {
      iters = std::atoi(val().c_str());
    } else if (a == "--warmup") {
      warmup = std::atoi(val().c_str());
    } else if (a == "--hidden-share") {
      hidden_share = std::atoi(val().c_str()) != 0;
    } else {
      die("unknown argument " + a +
          " (usage: dion-bench-mesh --mesh RxOxI [--workload gpt-160m|gpt-1.3b] [--algo dion|muon|dion2|normuon] "
          "[--dtype fp32|bf16] [--rank-fraction F] [--iters N] [--warmup N] [--hidden-share 0|1])");
    }
  }
  if (R * O * I != g_size || R < 1 || O < 1 || I < 1)
    die("--mesh " + std::to_string(R) + "x" + std::to_string(O) + "x" + std::to_string(I) + " does not multiply to " +
        std::to_string(g_size) + " ranks");
  const int64_t d = workload == "gpt-160m" ? 768 : 2048;
  const int layers = workload == "gpt-160m" ? 12 : 24;
  if (workload != "gpt-160m" && workload != "gpt-1.3b") die("unknown workload " + workload);
  if (iters < 1 || warmup < 0) die("--iters must be >= 1 and --warmup >= 0");
  dion_algorithm_t al = DION_ALGO_DION;
  if (algo == "muon") al = DION_ALGO_MUON;
  else if (algo == "dion2") al = DION_ALGO_DION2;
  else if (algo == "normuon") al = DION_ALGO_NORMUON;
  else if (algo != "dion") die("unknown algo " + algo);
  const bool bf16 = dtype == "bf16";

  int ndev = 0;
  cuda_ok(cudaGetDeviceCount(&ndev), "cudaGetDeviceCount");
  if (ndev < 1) die("no CUDA device");
  const int device = g_rank % ndev;
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  const int r = g_rank / (O * I), o = (g_rank / I) % O, in = g_rank % I;
  MPI_Comm mc[3];
  MPI_Comm_split(MPI_COMM_WORLD, o * I + in, r, &mc[0]);
  MPI_Comm_split(MPI_COMM_WORLD, r * I + in, o, &mc[1]);
  MPI_Comm_split(MPI_COMM_WORLD, r * O + o, in, &mc[2]);
  dion_comm_t dc[3];
  for (int k = 0; k < 3; ++k) dc[k] = nccl_over(mc[k], device);

  std::vector<Shape> shapes;
  for (int l = 0; l < layers; ++l) {
    shapes.push_back({3 * d, d, 0});
    shapes.push_back({d, d, 1});
    shapes.push_back({4 * d, d, 0});
    shapes.push_back({d, 4 * d, 1});
  }
  dion_group_options_t go;
  dion_group_options_init(&go, al);
  if (al == DION_ALGO_DION) go.rank_fraction = rank_fraction;
  go.matmul_precision = bf16 ? DION_MATMUL_BF16 : DION_MATMUL_FP32;

  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<dion_tensor_t> ts(shapes.size());
  std::vector<void*> bufs;
  std::vector<std::string> names(shapes.size());
  std::vector<size_t> sizes(shapes.size());
  int64_t local_elems = 0, global_elems = 0;
  const size_t es = bf16 ? 2 : 4;
  float* tmp = nullptr;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const Shape& s = shapes[k];
    dion_tensor_t& t = ts[k];
    dion_tensor_init(&t);
    names[k] = "layers." + std::to_string(k / 4) + "." + std::to_string(k % 4);
    t.name = names[k].c_str();
    t.ndim = 2;
    t.shape[0] = s.m;
    t.shape[1] = s.n;
    t.param_dtype = bf16 ? DION_DTYPE_BF16 : DION_DTYPE_FP32;
    int64_t ext[2] = {s.m, s.n};
    if (I > 1) {
      t.inner_shard_dim = s.inner_dim;
      chunk(ext[s.inner_dim], I, in, &t.inner_offset, &t.inner_extent);
      ext[s.inner_dim] = t.inner_extent;
    }
    if (O > 1) {
      const int od = I > 1 ? 1 - s.inner_dim : 0;  // FSDP2 chunks dim 0 unless TP took it
      t.outer_shard_dim = od;
      chunk(od ? s.n : s.m, O, o, &t.outer_offset, &t.outer_extent);
      ext[od] = t.outer_extent;
    }
    const size_t n = static_cast<size_t>(ext[0] * ext[1]);
    sizes[k] = n;
    local_elems += static_cast<int64_t>(n);
    global_elems += s.m * s.n;
    void *p = nullptr, *g = nullptr;
    cuda_ok(cudaMalloc(&p, std::max<size_t>(n, 1) * es), "cudaMalloc");
    cuda_ok(cudaMalloc(&g, std::max<size_t>(n, 1) * es), "cudaMalloc");
    if (!tmp) cuda_ok(cudaMalloc(&tmp, sizeof(float) * static_cast<size_t>(16 * d * d)), "cudaMalloc");
    bufs.push_back(p);
    bufs.push_back(g);
    t.param = p;
    t.grad = g;
  }
  // The same parameters and per-rank gradients for every timed optimizer
  // (a step updates the parameters, and the replicate sync averages the
  // gradients in place).
  auto fill = [&] {
    for (size_t k = 0; k < shapes.size(); ++k) {
      const uint64_t seed = 1000 * k + static_cast<uint64_t>(g_rank);
      for (int which = 0; which < 2; ++which) {
        void* dst = which ? const_cast<void*>(ts[k].grad) : ts[k].param;
        float* f = bf16 ? tmp : static_cast<float*>(dst);
        fill_kernel<<<1024, 256, 0, stream>>>(f, sizes[k], seed * 2 + which, which ? 0.01f : 0.035f);
        if (bf16) to_bf16_kernel<<<1024, 256, 0, stream>>>(tmp, static_cast<__nv_bfloat16*>(dst), sizes[k]);
        cuda_ok(cudaStreamSynchronize(stream), "fill");
      }
    }
  };

  struct Timing {
    double median = 0, min = 0, max = 0;
    uint64_t bytes[3] = {0, 0, 0};  // largest over ranks
    uint64_t state = 0, ws = 0;     // rank 0
  };
  dion_stream_t ds = reinterpret_cast<dion_stream_t>(stream);
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters));
  for (auto& e : ev) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  // One fresh optimizer: replicate_grad_sync = sync; DION_OVERLAP is read at
  // dion_create (unset: overlapped where possible; "0": sequential).
  auto measure = [&](bool sync, bool overlap) {
    fill();
    if (overlap)
      unsetenv("DION_OVERLAP");
    else
      setenv("DION_OVERLAP", "0", 1);
    dion_options_t opts;
    dion_options_init(&opts);
    opts.backend = DION_BACKEND_CUDA;
    opts.device = device;
    opts.replicate_comm = dc[0];
    opts.outer_comm = dc[1];
    opts.inner_comm = dc[2];
    opts.replicate_grad_sync = sync ? 1 : 0;
    dion_optimizer_t opt = nullptr;
    dion_ok(dion_create(&opt, &opts), "dion_create");
    unsetenv("DION_OVERLAP");
    dion_ok(dion_add_group(opt, &go, ts.data(), ts.size(), nullptr), "dion_add_group", opt);
    for (int i = 0; i < warmup; ++i) dion_ok(dion_step(opt, ds), "dion_step", opt);
    cuda_ok(cudaStreamSynchronize(stream), "warm-up");
    // Steps start together (a barrier each), so each rank's time is its step,
    // not time spent waiting for a late peer's previous step.
    std::vector<float> ms(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      cudaEventRecord(ev[2 * i], stream);
      dion_ok(dion_step(opt, ds), "dion_step", opt);
      cudaEventRecord(ev[2 * i + 1], stream);
      cuda_ok(cudaStreamSynchronize(stream), "step");
      cuda_ok(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], ev[2 * i], ev[2 * i + 1]), "elapsed");
    }
    std::vector<float> worst(ms.size());
    MPI_Allreduce(ms.data(), worst.data(), iters, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    std::sort(worst.begin(), worst.end());
    Timing t;
    t.median = worst[worst.size() / 2];
    t.min = worst.front();
    t.max = worst.back();
    uint64_t bytes[3] = {0, 0, 0};
    const dion_mesh_t meshes[3] = {DION_MESH_REPLICATE, DION_MESH_OUTER, DION_MESH_INNER};
    for (int k = 0; k < 3; ++k) dion_ok(dion_get_comm_bytes(opt, meshes[k], &bytes[k], nullptr), "comm_bytes", opt);
    MPI_Allreduce(bytes, t.bytes, 3, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    dion_ok(dion_get_memory_usage(opt, &t.state, &t.ws), "memory", opt);
    dion_destroy(opt);
    return t;
  };

  const Timing main_run = measure(true, true);  // the library's default: overlapped
  const bool share = hidden_share && R > 1;
  Timing seq, nosync;
  if (share) {
    seq = measure(true, false);
    nosync = measure(false, false);
  }
  if (g_rank == 0) {
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, device);
    // null where not measured (no multi-rank replicate mesh, or --hidden-share 0)
    // or where the sync cost no measurable time (comm_ms <= 0).
    char extra[256] = "\"step_ms_sequential\":null,\"step_ms_nosync\":null,\"comm_ms\":null,\"hidden_share\":null";
    if (share) {
      const double comm = seq.median - nosync.median;
      char hs[32] = "null";
      if (comm > 0) std::snprintf(hs, sizeof hs, "%.3f", (seq.median - main_run.median) / comm);
      std::snprintf(extra, sizeof extra,
                    "\"step_ms_sequential\":%.3f,\"step_ms_nosync\":%.3f,\"comm_ms\":%.3f,\"hidden_share\":%s",
                    seq.median, nosync.median, comm, hs);
    }
    std::printf(
        "{\"bench\":\"dion-bench-mesh\",\"device\":\"%s\",\"gpus\":%d,\"mesh\":\"%dx%dx%d\",\"workload\":\"%s\","
        "\"algo\":\"%s\",\"rank_fraction\":%g,\"dtype\":\"%s\",\"params\":%lld,\"local_params_rank0\":%lld,"
        "\"iters\":%d,\"step_ms_median\":%.3f,\"step_ms_min\":%.3f,\"step_ms_max\":%.3f,"
        "\"bytes_per_step_replicate\":%llu,\"bytes_per_step_outer\":%llu,\"bytes_per_step_inner\":%llu,"
        "\"state_bytes_rank0\":%llu,\"workspace_bytes_rank0\":%llu,%s}\n",
        prop.name, g_size, R, O, I, workload.c_str(), algo.c_str(), al == DION_ALGO_DION ? rank_fraction : 1.0,
        dtype.c_str(), static_cast<long long>(global_elems), static_cast<long long>(local_elems), iters,
        main_run.median, main_run.min, main_run.max, static_cast<unsigned long long>(main_run.bytes[0]),
        static_cast<unsigned long long>(main_run.bytes[1]), static_cast<unsigned long long>(main_run.bytes[2]),
        static_cast<unsigned long long>(main_run.state), static_cast<unsigned long long>(main_run.ws), extra);
    std::fflush(stdout);
  }
  for (void* b : bufs) cudaFree(b);
  cudaFree(tmp);
  for (auto& e : ev) cudaEventDestroy(e);
  cudaStreamDestroy(stream);
  for (int k = 0; k < 3; ++k) {
    if (dc[k]) dion_comm_destroy(dc[k]);
    MPI_Comm_free(&mc[k]);
  }
  MPI_Finalize();
  return 0;
}
