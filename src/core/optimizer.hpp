// SPDX-License-Identifier: MIT
// The optimizer object: groups, tensors, state, workspace. Backend-independent.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "dion.h"
#include "../comm/collectives.hpp"

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
  // For a dim sharded over a multi-rank mesh (0: outer, 1: inner): every
  // rank's offset and extent along it, in mesh rank order (filled by the
  // collective check at dion_add_group; empty otherwise).
  std::vector<int64_t> shard_off[2], shard_ext[2];
  int64_t numel_local = 1;
  MatrixGeom geom;
  // Dion
  int64_t rank = 0;
  bool dion_transposed = false;  // working matrix B = logical M^T
  std::vector<int32_t> states;   // indices into Optimizer::states, in creation order
};

// A set of tensors of one group stepped together (DESIGN.md §5): matrix
// algorithms batch tensors of identical shape, sharding and dtypes, so a
// step's kernel count does not grow with the number of same-shape matrices;
// element-wise algorithms (AdamW, Lion) take the whole group as one
// multi-tensor list. `table` (backend memory) lists the tensors that have a
// gradient this step; it is rewritten only when a pointer or that set changes.
struct Bucket {
  std::vector<int32_t> tensors;
  TensorEntry* table = nullptr;     // backend memory, tensors.size() entries
  std::vector<TensorEntry> mirror;   // what `table` holds
  std::vector<TensorEntry> scratch;  // the list being built (capacity reserved, no per-step allocation)
  int32_t first_active = -1;        // a tensor of the active set (shape representative)
  int64_t active = 0;               // entries of `table` in use this step
  int64_t max_n = 0;                // largest n among them
  size_t workspace_floats = 0;
  // The algorithm's pre-pass output (Algorithm::prepass): backend memory,
  // prepass_floats(...) floats for the whole bucket; null: no pre-pass.
  float* pre = nullptr;
  // Every parameter and state pointer of the active set is 16-byte aligned
  // (refresh_table): the pointer-array GEMMs that write parameters or read
  // and write states in place (cuBLAS assumes such alignment there) may run.
  bool aligned16 = true;
};

struct Group {
  dion_group_options_t opt{};
  std::vector<int32_t> tensors;
  std::vector<Bucket> buckets;
  GroupScalars* scalars = nullptr;  // backend memory: lr, weight_decay, beta1, beta2, step
  int64_t host_step = 0;            // the step counter as the host knows it (see Optimizer::step)
};

struct Optimizer;

// What an algorithm's step sees: `count` tensors shaped like `t`, listed in
// `list` (backend memory).
struct Batch {
  const Tensor& t;
  int64_t count;
  const TensorEntry* list;
  int64_t max_n;
  bool aligned16 = false;  // Bucket::aligned16
  const float* pre = nullptr;  // what Algorithm::prepass wrote this step (null: it did not run)
};

// Per-algorithm hooks (src/algo). `workspace_floats` bounds the fp32
// workspace a step of `count` tensors shaped like `t` needs; `init_state`
// creates and initialises one tensor's state; `step` updates a batch.
// Element-wise algorithms step whole groups of mixed shapes at once.
// Optional: `step_group` steps all the active buckets of a group together
// and returns true, or returns false (nothing done) when it does not apply,
// and the buckets are stepped one by one; `group_workspace_floats` is the
// workspace it needs (0: it never applies to this group).
struct Algorithm {
  const char* name;
  bool elementwise;
  void (*init_state)(Optimizer& opt, Group& g, Tensor& t);
  size_t (*workspace_floats)(const Group& g, const Tensor& t, int64_t count);
  void (*step)(Optimizer& opt, Group& g, const Batch& b);
  bool (*step_group)(Optimizer& opt, Group& g) = nullptr;
  size_t (*group_workspace_floats)(const Optimizer& opt, const Group& g) = nullptr;
  // Optional pre-pass, run where the step checks the gradients for NaN/Inf
  // (before any state or parameter is written): `prepass` replaces
  // check_nonfinite for a bucket whose `prepass_floats` (the whole bucket,
  // decided at dion_add_group) is > 0, reading the gradients once for both:
  // it sets *nonfinite like check_nonfinite and writes `out`, which the
  // bucket's step then finds in Batch::pre.
  size_t (*prepass_floats)(const Optimizer& opt, const Group& g, const Tensor& t, int64_t count) = nullptr;
  void (*prepass)(Optimizer& opt, Group& g, const Batch& b, float* out, int32_t* nonfinite) = nullptr;
};
const Algorithm& algorithm_for(dion_algorithm_t algo);

// Floats Workspace::take(n) uses (rounded up to keep 64-byte alignment);
// the algorithms' workspace bounds add these up.
inline size_t ws_floats(int64_t n) { return (static_cast<size_t>(n) + 15) & ~static_cast<size_t>(15); }

// Bump allocator over the workspace reserved at dion_add_group, so that a
// step allocates nothing.
class Workspace {
 public:
  float* take(int64_t floats);
  void reset() { used_ = 0; }
  // What take() has handed out so far, and a return to such a mark (the
  // buffers taken after it are free again; stream order keeps their reuse
  // behind the work that read them).
  size_t mark() const { return used_; }
  void rewind(size_t m) { used_ = m; }
  void reserve(Backend& be, size_t floats);
  void free(Backend& be);
  size_t capacity_bytes() const { return cap_ * sizeof(float); }
  size_t capacity_floats() const { return cap_; }

 private:
  float* base_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};

struct Optimizer;
// The wait guard of an optimizer with NCCL meshes (see WaitGuard).
struct MeshWaitGuard final : WaitGuard {
  Optimizer* opt = nullptr;
  void poll() override;
  void on_timeout() override;
};

// The StreamJoin of an overlapped step's collectives (see Optimizer::step):
// the backend's comm stream forks from and joins back to the compute stream
// around each collective the algorithms issue.
struct CommJoin final : StreamJoin {
  Backend* backend = nullptr;
  void before() override { backend->comm_wait_main(); }
  void after() override { backend->main_wait_comm(); }
};

struct Optimizer {
  uint64_t magic_head = kMagicHead;
  dion_options_t options{};
  std::unique_ptr<Backend> backend;
  std::vector<Group> groups;
  std::vector<Tensor> tensors;
  std::vector<StateBuf> states;
  Workspace ws;
  StepStatus* status = nullptr;  // backend memory
  // Each mesh's collectives when it has more than one rank, else null.
  std::unique_ptr<Collectives> rep, outer, inner;
  // The multi-rank meshes in the order that reaches the whole grid (rep,
  // outer, inner); absent ones are null.
  std::array<Collectives*, 3> meshes() const { return {rep.get(), outer.get(), inner.get()}; }
  bool has_meshes() const { return rep || outer || inner; }
  MeshWaitGuard wait_guard;  // installed in the backend when a mesh runs on the device (NCCL)
  std::vector<int64_t> coll_idx;  // counts/displacements of uneven collectives (capacity reserved at create)
  // Overlap of the replicate gradient sync with the buckets' compute (see step()).
  bool overlap_allowed = true;  // DION_OVERLAP (unset or not "0") at dion_create, then agreed over the mesh
  bool overlap_decided = false; // the agreement (dion_add_group) has run
  bool overlap = false;         // steps overlap: the agreement allowed it and the backend has a comm
                                // stream (CUDA with a multi-rank replicate mesh and replicate_grad_sync)
  float* stage = nullptr;       // backend memory: the comm stream's staging of non-fp32 gradients
  size_t stage_floats = 0;
  CommJoin comm_join;
  size_t table_bytes = 0;  // backend memory held by tables, scalars and the staging buffer
  int64_t batch_max = 0;   // DION_BATCH_MAX at dion_create: most matrices per batch (0: no limit but the workspace)
  size_t batch_workspace_floats = size_t(1) << 28;  // a batch's workspace cap (init: per backend, or DION_BATCH_WORKSPACE_MIB)
  std::string last_error;
  uint64_t magic_tail = kMagicTail;

  ~Optimizer();
  // Allocates the step status; called once the backend is set.
  void init();
  // Creates a state buffer for tensor t (zero-filled) and returns its index.
  int32_t add_state(Tensor& t, const char* name, dion_dtype_t dtype, int32_t ndim, const int64_t* global_shape,
                    const int64_t* local_shape, const int64_t* local_offset, dion_layout_t layout);
  void add_group(const dion_group_options_t& opt, const dion_tensor_t* tensors, size_t count, int32_t* group_index);
  void step();
  void plan_buckets(Group& g, const Algorithm& algo);
  void refresh_table(Bucket& b);
  // The pointer stores take to honour the non-finite guard (null when it is
  // off and there is no mesh).
  // With meshes it is always read: the wait guard sets it to stop the writes
  // of a step whose collectives were aborted.
  const int32_t* skip_flag() const {
    return options.skip_nonfinite || has_meshes() ? &status->skip : nullptr;
  }
  // Reads the group's step counter / skipped-step status (waits for the device).
  int64_t read_step(const Group& g);
  void write_step(Group& g, int64_t step);
  // Checks a tensor's param (and grad, if not null) for this backend;
  // `what` names the tensor in messages ("...: param" / "...: grad" appended).
  void check_tensor_buffers(const void* param, const void* grad, int64_t numel, dion_dtype_t param_dtype,
                            dion_dtype_t grad_dtype, const std::string& what) const;
  void average_in_place(void* data, dion_dtype_t dt, int64_t n);
  void average_staged(void* data, dion_dtype_t dt, int64_t n, float* stage, bool on_comm);
  // Enqueues on the comm stream the replicate average of the gradients of
  // bucket b that the step averages, then records mark `slot` after them if
  // there were any (returns whether there were). Overlapped steps only.
  bool average_bucket_on_comm(const Bucket& b, int slot);
  // Whether a step with replicate_grad_sync averages tensor t's gradient
  // over a multi-rank replicate mesh (not a compressed Dion tensor's; `algo`
  // its group's algorithm, usable before the group is added to `groups`),
  // and whether it averages any gradient of group g this step.
  bool grad_averaged(const Tensor& t, dion_algorithm_t algo) const;
  bool group_grads_averaged(const Group& g) const;
  // Whether steps run the overlapped pipeline (rep, replicate_grad_sync and
  // the comm stream; at dion_add_group, once the overlap is decided, before
  // the stream is made).
  bool steps_overlap() const {
    return rep && options.replicate_grad_sync && (overlap || (overlap_decided && overlap_allowed));
  }
  // Runs one bucket's algorithm step on the compute stream (nothing if no
  // tensor of it has a gradient this step).
  void step_bucket(Group& g, Bucket& b);
  // Every bucket of group g: by the algorithm's step_group where it takes
  // the group (Dion's phased step), else bucket by bucket.
  void step_whole_group(Group& g);
  Batch batch_of(const Bucket& b) const;  // a bucket's active set, as its step sees it
  void release_bucket(Bucket& b);         // its backend memory (table, pre-pass output)
  // A Dion tensor with a multi-rank replicate mesh and replicate_grad_sync:
  // true when its P and R are averaged instead of its gradient ((m+n) r < m n).
  bool dion_compressed(const Tensor& t) const;
  // The same for a tensor of a group of algorithm `algo` (usable before the
  // group is added to `groups`).
  bool dion_compressed(const Tensor& t, dion_algorithm_t algo) const;
  // Collective over every multi-rank mesh: fails on every rank of every mesh
  // if this rank's group differs from another rank's, if the shards of a
  // tensor do not tile its dim, or if the call failed on any rank
  // (failed_here: this rank's own validation failed; it only takes part).
  // Fills Tensor::shard_off/shard_ext.
  void agree_on_group(const dion_group_options_t& go, std::vector<Tensor>& built, bool failed_here);
  // True if tensor t is sharded over a multi-rank outer or inner mesh.
  bool sharded(const Tensor& t) const;
  // Averages every state over the replicate mesh (dion_sync_for_checkpoint).
  void sync_states();
  StepStatus read_status();
  // Writes the hyperparameters kept in backend memory from g.opt.
  void upload_scalars(Group& g);
  // Checks a caller's buffer for this optimizer's backend (device, alignment, size).
  void check_buffer(const void* p, size_t bytes, size_t align, const std::string& what) const;
};

// Shared helpers for the algorithms.
double adjusted_lr(const dion_group_options_t& o, double lr, int64_t fan_out, int64_t fan_in);

}  // namespace dion
