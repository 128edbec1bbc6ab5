// SPDX-License-Identifier: MIT
// The optimizer object: groups, tensors, state, workspace. Backend-independent.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "dion.h"

namespace dion {

constexpr uint64_t kMagicHead = 0x44494f4e4f505431ull;  // "DIONOPT1"
constexpr uint64_t kMagicTail = 0x31544f504e4f4944ull;

// One state buffer of one tensor (momentum, Q, variance, variance_neuron).
struct StateBuf {
  std::string name;
  int32_t tensor = -1;
  int32_t group = -1;
  dion_dtype_t dtype = DION_DTYPE_FP32;
  dion_layout_t layout = DION_LAYOUT_ROW_MAJOR;
  int32_t ndim = 0;
  int64_t global_shape[DION_MAX_DIMS] = {0, 0, 0, 0};
  int64_t local_shape[DION_MAX_DIMS] = {0, 0, 0, 0};
  int64_t local_offset[DION_MAX_DIMS] = {0, 0, 0, 0};
  int64_t numel = 0;
  void* data = nullptr;  // backend memory
  size_t bytes() const { return static_cast<size_t>(numel) * dtype_size(dtype); }
};

// Geometry of a tensor seen as a batch of matrices, in STORAGE orientation:
// the local buffer is `batch` dense row-major (srows x scols) matrices. For a
// COL_MAJOR tensor the storage matrix is the transpose of the logical one.
struct MatrixGeom {
  int64_t batch = 1;
  int64_t m = 1, n = 1;          // logical global matrix shape (fan_out, fan_in)
  int64_t srows = 1, scols = 1;  // local storage shape
  bool storage_transposed = false;
};

struct Tensor {
  std::string name;
  int32_t index = -1;
  int32_t group = -1;
  void* param = nullptr;
  const void* grad = nullptr;
  dion_dtype_t param_dtype = DION_DTYPE_FP32;
  dion_dtype_t grad_dtype = DION_DTYPE_FP32;
  dion_layout_t layout = DION_LAYOUT_ROW_MAJOR;
  int32_t ndim = 0;
  int64_t shape[DION_MAX_DIMS] = {1, 1, 1, 1};
  int64_t local_shape[DION_MAX_DIMS] = {1, 1, 1, 1};
  int64_t local_offset[DION_MAX_DIMS] = {0, 0, 0, 0};
  int32_t outer_shard_dim = -1, inner_shard_dim = -1;
  int64_t numel_local = 1;
  MatrixGeom geom;
  // Dion
  int64_t rank = 0;
  bool dion_transposed = false;  // working matrix B = logical M^T
  std::vector<int32_t> states;   // indices into Optimizer::states, in creation order
};

struct Group {
  dion_group_options_t opt{};
  std::vector<int32_t> tensors;
  int64_t step = 0;
};

struct Optimizer;

// Per-algorithm hooks (src/algo). `workspace_floats` bounds the fp32
// workspace one tensor's step needs; `init_state` creates and initialises its
// state; `step` updates one tensor that has a gradient.
struct Algorithm {
  const char* name;
  void (*init_state)(Optimizer& opt, Group& g, Tensor& t);
  size_t (*workspace_floats)(const Group& g, const Tensor& t);
  void (*step)(Optimizer& opt, Group& g, Tensor& t);
};
const Algorithm& algorithm_for(dion_algorithm_t algo);

// Bump allocator over the workspace reserved at dion_add_group, so that a
// step allocates nothing.
class Workspace {
 public:
  float* take(int64_t floats);
  void reset() { used_ = 0; }
  void reserve(Backend& be, size_t floats);
  void free(Backend& be);
  size_t capacity_bytes() const { return cap_ * sizeof(float); }

 private:
  float* base_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};

struct Optimizer {
  uint64_t magic_head = kMagicHead;
  dion_options_t options{};
  std::unique_ptr<Backend> backend;
  std::vector<Group> groups;
  std::vector<Tensor> tensors;
  std::vector<StateBuf> states;
  Workspace ws;
  std::string last_error;
  int64_t skipped_steps = 0;
  int32_t last_skipped = 0;
  uint64_t magic_tail = kMagicTail;

  ~Optimizer();
  // Creates a state buffer for tensor t (zero-filled) and returns its index.
  int32_t add_state(Tensor& t, const char* name, dion_dtype_t dtype, int32_t ndim, const int64_t* global_shape,
                    const int64_t* local_shape, const int64_t* local_offset, dion_layout_t layout);
  void add_group(const dion_group_options_t& opt, const dion_tensor_t* tensors, size_t count, int32_t* group_index);
  void step();
};

// Shared helpers for the algorithms.
double adjusted_lr(const dion_group_options_t& o, double lr, int64_t fan_out, int64_t fan_in);

}  // namespace dion
