// SPDX-License-Identifier: MIT
// What the mesh harnesses share: tests/mpi/shard_harness.hpp (Dion) and
// tests/mpi/megabatch_harness.hpp (Muon, NorMuon, Dion2, NorDion2), each
// instantiated for the host backend over MPI communicators (tests/mpi/) and
// for the CUDA backend over NCCL communicators (tests/nccl/). ShardEnv holds
// what differs between the backends; the helpers below (the test grid and
// its meshes, the shard arithmetic, backend buffers, state reads and the
// normwise comparison) are the same for both harnesses. The including file
// defines g_rank, g_size and g_env (and fills g_env in main, before the
// tests run).
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dion_mpi.h"
#include "../hash_uniform.h"
#include "../reference/ref_linalg.h"

// What differs between the backends.
struct ShardEnv {
  dion_backend_t backend = DION_BACKEND_HOST;
  int32_t device = 0;
  // A mesh communicator over the ranks of an MPI communicator.
  dion_comm_t (*make_comm)(MPI_Comm) = nullptr;
  // Device memory (all null on the host backend: buffers are host vectors).
  void* (*alloc)(size_t) = nullptr;
  void (*free)(void*) = nullptr;
  void (*h2d)(void*, const void*, size_t) = nullptr;
  void (*d2h)(void*, const void*, size_t) = nullptr;
};
extern ShardEnv g_env;
extern int g_rank, g_size;

namespace {

struct Layout {
  int R, O, I;
};

// This rank's place in the grid and its meshes.
struct Grid {
  Layout L{1, 1, 1};
  int r = 0, o = 0, i = 0;
  MPI_Comm mc[3] = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
  dion_comm_t dc[3] = {nullptr, nullptr, nullptr};
  dion_comm_t self[2] = {nullptr, nullptr};  // 1-rank outer and inner meshes for a reference that wants them
  explicit Grid(Layout l) : L(l) {
    r = g_rank / (L.O * L.I);
    o = (g_rank / L.I) % L.O;
    i = g_rank % L.I;
    MPI_Comm_split(MPI_COMM_WORLD, o * L.I + i, r, &mc[0]);
    MPI_Comm_split(MPI_COMM_WORLD, r * L.I + i, o, &mc[1]);
    MPI_Comm_split(MPI_COMM_WORLD, r * L.O + o, i, &mc[2]);
    const int sizes[3] = {L.R, L.O, L.I};
    for (int k = 0; k < 3; ++k)
      if (sizes[k] > 1) dc[k] = g_env.make_comm(mc[k]);
    for (auto& c : self) EXPECT_EQ(dion_comm_from_mpi(&c, MPI_COMM_SELF), DION_SUCCESS) << dion_last_error(nullptr);
  }
  ~Grid() {
    for (auto& c : self) dion_comm_destroy(c);
    for (int k = 0; k < 3; ++k) {
      if (dc[k]) dion_comm_destroy(dc[k]);
      MPI_Comm_free(&mc[k]);
    }
  }
};

// Options for an optimizer on this backend over the grid's meshes
// (replicate, outer, inner; null where a mesh has one rank).
dion_options_t mesh_options(const Grid& G) {
  dion_options_t o;
  dion_options_init(&o);
  o.backend = g_env.backend;
  o.device = g_env.device;
  o.replicate_comm = G.dc[0];
  o.outer_comm = G.dc[1];
  o.inner_comm = G.dc[2];
  return o;
}

// FSDP chunking over the outer mesh, an even split over the inner mesh.
void outer_shard(int64_t full, int W, int q, int64_t* off, int64_t* ext) {
  const int64_t chunk = (full + W - 1) / W;
  *off = std::min(full, q * chunk);
  *ext = std::min(chunk, full - *off);
}
void inner_shard(int64_t full, int W, int q, int64_t* off, int64_t* ext) {
  *off = q * full / W;
  *ext = (q + 1) * full / W - *off;
}

// A buffer of n floats (at least one), all `fill`, in the backend's memory.
struct Buf {
  std::vector<float> h;
  float* d = nullptr;
  explicit Buf(int64_t n, float fill = 0.0f) : h(static_cast<size_t>(std::max<int64_t>(n, 1)), fill) {
    if (g_env.alloc) {
      d = static_cast<float*>(g_env.alloc(sizeof(float) * h.size()));
      g_env.h2d(d, h.data(), sizeof(float) * h.size());
    }
  }
  ~Buf() {
    if (d) g_env.free(d);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  float* ptr() { return d ? d : h.data(); }
};

// An optimizer and the local shards it steps (each harness's Local: host
// values x, g and, on a device backend, their copies dx, dg), freed together.
template <class LocalT>
struct OptRunOf {
  dion_optimizer_t opt = nullptr;
  std::vector<LocalT> loc;
  ~OptRunOf() {
    dion_destroy(opt);
    for (LocalT& l : loc) {
      if (l.dx) g_env.free(l.dx);
      if (l.dg) g_env.free(l.dg);
    }
  }
  // Gradients to the device before a step; parameters back after.
  void upload_grads() {
    for (LocalT& l : loc)
      if (l.dg) g_env.h2d(l.dg, l.g.data(), sizeof(float) * l.g.size());
  }
  void download_params() {
    for (LocalT& l : loc)
      if (l.dx) g_env.d2h(l.x.data(), l.dx, sizeof(float) * l.x.size());
  }
  dion_status_t step() {
    upload_grads();
    dion_status_t st = dion_step(opt, nullptr);
    download_params();
    return st;
  }
};

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// A state's local shard, read into host memory (dion_state_read accepts a
// host destination on every backend).
std::vector<float> read_state(dion_optimizer_t opt, int32_t tensor, const char* name, dion_state_info_t* info) {
  int32_t idx = -1;
  EXPECT_EQ(dion_state_find(opt, tensor, name, &idx), DION_SUCCESS) << dion_last_error(opt);
  std::memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
  EXPECT_EQ(dion_state_info(opt, idx, info), DION_SUCCESS);
  std::vector<unsigned char> raw(std::max<size_t>(1, info->local_bytes));
  EXPECT_EQ(dion_state_read(opt, idx, raw.data(), info->local_bytes, nullptr), DION_SUCCESS);
  if (info->dtype != DION_DTYPE_BF16) {
    EXPECT_EQ(info->dtype, DION_DTYPE_FP32) << "read_state widens bf16 and reads fp32 states only";
    std::vector<float> b(std::max<size_t>(1, info->local_bytes / sizeof(float)));
    std::memcpy(b.data(), raw.data(), info->local_bytes);
    return b;
  }
  // bf16 elements, widened exactly (the high half of an fp32)
  const size_t n = info->local_bytes / 2;
  std::vector<uint16_t> h(std::max<size_t>(n, 1));
  std::memcpy(h.data(), raw.data(), info->local_bytes);
  std::vector<float> w(std::max<size_t>(n, 1));
  for (size_t i = 0; i < n; ++i) w[i] = dionref::bf16_bits_to_float(h[i]);
  return w;
}

}  // namespace
