// SPDX-License-Identifier: MIT
#include "optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "batching.hpp"
#include "error.hpp"
#include "log.hpp"
#include "../algo/rank.hpp"
#include "../api/comm.hpp"

namespace dion {

float* Workspace::take(int64_t floats) {
  // 16-float alignment keeps every carved buffer 64-byte aligned.
  const size_t need = ws_floats(floats);
  DION_REQUIRE(used_ + need <= cap_, DION_ERROR_INTERNAL,
               "workspace overflow (%zu + %zu > %zu floats): a workspace bound is wrong", used_, need, cap_);
  float* p = base_ + used_;
  used_ += need;
  return p;
}

void Workspace::reserve(Backend& be, size_t floats) {
  if (floats <= cap_) return;
  float* p = static_cast<float*>(be.alloc(floats * sizeof(float)));
  if (base_) be.release(base_);
  base_ = p;
  cap_ = floats;
  used_ = 0;
}

void Workspace::free(Backend& be) {
  if (base_) be.release(base_);
  base_ = nullptr;
  cap_ = used_ = 0;
}

void MeshWaitGuard::poll() {
  for (Collectives* c : opt->meshes())
    if (c) c->check_async();
}

void MeshWaitGuard::on_timeout() {
  // The step in flight is treated as skipped before its hung collectives are
  // aborted: its parameter and state writes still queued behind them read
  // the flag and write nothing (writes that ran before the hang stay).
  opt->backend->poke_flag(&opt->status->skip, 1);
  for (Collectives* c : opt->meshes())
    if (c) c->abort_comm();
}

Optimizer::~Optimizer() {
  if (backend) {
    // Work in flight may still read these buffers: wait for it, and never
    // let a device error escape a destructor.
    try {
      backend->synchronize();
    } catch (const Error& e) {
      DION_LOG_WARN("dion_destroy: %s", e.what());
    }
    try {
      for (auto& s : states)
        if (s.data) backend->release(s.data);
      for (auto& g : groups) {
        for (auto& b : g.buckets) release_bucket(b);
        if (g.scalars) backend->release(g.scalars);
      }
      if (status) backend->release(status);
      if (stage) backend->release(stage);
      ws.free(*backend);
    } catch (const Error& e) {
      DION_LOG_WARN("dion_destroy: %s", e.what());
    }
  }
  magic_head = magic_tail = 0;
}

constexpr size_t kHostBatchWorkspaceFloats = size_t(1) << 28;    // 1 GiB of fp32
constexpr size_t kDeviceBatchWorkspaceFloats = size_t(1) << 30;  // 4 GiB of fp32

// A positive integer environment variable (at most `most`), or 0 when it is
// unset; anything else is logged and ignored.
static int64_t env_positive(const char* name, int64_t most) {
  const char* e = std::getenv(name);
  if (!e || !*e) return 0;
  char* end = nullptr;
  const long long v = std::strtoll(e, &end, 10);
  if (end && *end == '\0' && v > 0 && v <= most) return v;
  DION_LOG_WARN("dion_create: %s=\"%s\" is not an integer in [1, %lld]; ignored", name, e, static_cast<long long>(most));
  return 0;
}

void Optimizer::init() {
  // DION_OVERLAP=0 keeps every step sequential (docs/ENV.md); read here, at
  // dion_create, so that each optimizer keeps the mode it was created with.
  const char* ov = std::getenv("DION_OVERLAP");
  overlap_allowed = !(ov && std::strcmp(ov, "0") == 0);
  // DION_BATCH_MAX and DION_BATCH_WORKSPACE_MIB (docs/ENV.md): the caps on
  // a batch, in matrices and in workspace.
  if (const int64_t v = env_positive("DION_BATCH_MAX", int64_t(1) << 40); v > 0) batch_max = v;
  // The default cap: 1 GiB on the host; 4 GiB on a GPU, where the batched
  // factorizations cost per call more than per matrix, so that each class of
  // same-shape matrices of a model like gpt-1.3b is one batch (measured on an
  // H100, docs/benchmarks.md: Dion's step 83 -> 61 ms at bf16, 186 -> 163 ms
  // at fp32 against a 1 GiB cap).
  batch_workspace_floats = backend->host_memory() ? kHostBatchWorkspaceFloats : kDeviceBatchWorkspaceFloats;
  if (const int64_t v = env_positive("DION_BATCH_WORKSPACE_MIB", int64_t(1) << 20); v > 0)
    batch_workspace_floats = static_cast<size_t>(v) << 18;  // MiB of fp32
  comm_join.backend = backend.get();
  status = static_cast<StepStatus*>(backend->alloc(sizeof(StepStatus)));
  StepStatus z{};
  backend->copy_sync(status, &z, sizeof(z));
  table_bytes += sizeof(StepStatus);
}

int64_t Optimizer::read_step(const Group& g) {
  int64_t v = 0;
  backend->copy_sync(&v, &g.scalars->step, sizeof(v));
  return v;
}

void Optimizer::write_step(Group& g, int64_t step) {
  backend->copy_sync(&g.scalars->step, &step, sizeof(step));
  g.host_step = step;
}

StepStatus Optimizer::read_status() {
  StepStatus s{};
  backend->copy_sync(&s, status, sizeof(s));
  return s;
}

void Optimizer::upload_scalars(Group& g) {
  // The step counter is kept: only the hyperparameters are (re)written.
  GroupScalars v{};
  v.lr = g.opt.lr;
  v.weight_decay = g.opt.weight_decay;
  v.beta1 = g.opt.beta1;
  v.beta2 = g.opt.beta2;
  backend->copy_sync(g.scalars, &v, offsetof(GroupScalars, step));
}

void Optimizer::check_buffer(const void* p, size_t bytes, size_t align, const std::string& what) const {
#if DION_WITH_CUDA
  if (options.backend == DION_BACKEND_CUDA) {
    cuda_check_pointer(p, options.device, bytes, align, what.c_str());
    return;
  }
#endif
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s = %p is not aligned to %zu bytes", what.c_str(), p, align);
  (void)bytes;
}

int32_t Optimizer::add_state(Tensor& t, const char* name, dion_dtype_t dtype, int32_t ndim,
                             const int64_t* global_shape, const int64_t* local_shape, const int64_t* local_offset,
                             dion_layout_t layout) {
  StateBuf s;
  s.name = name;
  s.tensor = t.index;
  s.group = t.group;
  s.dtype = dtype;
  s.layout = layout;
  s.ndim = ndim;
  s.numel = 1;
  for (int d = 0; d < ndim; ++d) {
    s.global_shape[d] = global_shape[d];
    s.local_shape[d] = local_shape[d];
    s.local_offset[d] = local_offset ? local_offset[d] : 0;
    s.numel *= local_shape[d];
  }
  if (s.numel > 0) {
    s.data = backend->alloc(s.bytes());
    backend->zero(s.data, s.bytes());
  }
  states.push_back(std::move(s));
  int32_t idx = static_cast<int32_t>(states.size() - 1);
  t.states.push_back(idx);
  return idx;
}

double adjusted_lr(const dion_group_options_t& o, double lr, int64_t fan_out, int64_t fan_in) {
  switch (o.adjust_lr) {
    case DION_ADJUST_LR_SPECTRAL_NORM:
      return lr * std::sqrt(static_cast<double>(fan_out) / static_cast<double>(fan_in));
    case DION_ADJUST_LR_RMS_NORM:
      return lr * 0.2 * std::sqrt(static_cast<double>(fan_out > fan_in ? fan_out : fan_in));
    default:
      return lr;
  }
}

namespace {

bool is_matrix_algo(dion_algorithm_t a) {
  return a == DION_ALGO_DION || a == DION_ALGO_DION2 || a == DION_ALGO_MUON || a == DION_ALGO_NORMUON ||
         a == DION_ALGO_NORDION2;
}

const char* algo_name(dion_algorithm_t a) {
  switch (a) {
    case DION_ALGO_DION: return "dion";
    case DION_ALGO_DION2: return "dion2";
    case DION_ALGO_MUON: return "muon";
    case DION_ALGO_NORMUON: return "normuon";
    case DION_ALGO_NORDION2: return "nordion2";
    case DION_ALGO_ADAMW: return "adamw";
    case DION_ALGO_LION: return "lion";
    default: return "unknown";
  }
}

void check_finite_range(const char* field, double v, double lo, double hi, bool lo_open, bool hi_open) {
  bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok) {
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->%s = %g is out of range %c%g, %g%c", field, v,
         lo_open ? '(' : '[', lo, hi, hi_open ? ')' : ']');
  }
}

void check_enum(const char* field, int32_t v, int32_t lo, int32_t hi) {
  if (v < lo || v > hi) fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->%s = %d is not a valid value", field, v);
}

void check_dtype_opt(const char* field, dion_dtype_t v) {
  if (v != DION_DTYPE_UNSET && !dtype_valid(v))
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->%s = %d is not a valid dtype", field, v);
}

void validate_group_options(const dion_group_options_t& o) {
  if (o.algorithm < DION_ALGO_DION || o.algorithm > DION_ALGO_LION)
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->algorithm = %d is not a known algorithm", o.algorithm);
  const double inf = HUGE_VAL;
  check_finite_range("lr", o.lr, 0, inf, false, true);
  check_finite_range("weight_decay", o.weight_decay, 0, inf, false, true);
  check_finite_range("mu", o.mu, 0, inf, false, true);
  check_finite_range("beta1", o.beta1, 0, 1, false, false);
  check_finite_range("beta2", o.beta2, 0, 1, false, false);
  check_finite_range("epsilon", o.epsilon, 0, inf, false, true);
  check_finite_range("rank_fraction", o.rank_fraction, 0, 1, true, false);
  if (o.rank_multiple_of < 1)
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->rank_multiple_of = %d must be >= 1", o.rank_multiple_of);
  if (o.power_iters < 1)
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->power_iters = %d must be >= 1", o.power_iters);
  check_enum("qr_method", o.qr_method, DION_QR_RCQR, DION_QR_CQR);
  if (o.cqr_warmup_steps < 0)
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->cqr_warmup_steps = %d must be >= 0", o.cqr_warmup_steps);
  check_finite_range("oversample", o.oversample, 1, 64, false, false);
  check_enum("orthogonalizer", o.orthogonalizer, DION_ORTHO_POLAR_EXPRESS, DION_ORTHO_NEWTON_SCHULZ);
  if (o.ortho_steps < 1 || o.ortho_steps > 100)
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options->ortho_steps = %d is out of range [1, 100]", o.ortho_steps);
  check_enum("nesterov", o.nesterov, 0, 1);
  check_enum("adjust_lr", o.adjust_lr, DION_ADJUST_LR_SPECTRAL_NORM, DION_ADJUST_LR_NONE);
  check_enum("cautious_wd", o.cautious_wd, 0, 1);
  check_finite_range("fraction", o.fraction, 0, 1, true, false);
  check_finite_range("ef_decay", o.ef_decay, 0, inf, false, true);
  check_enum("selection_scope", o.selection_scope, DION_SELECTION_LOCAL, DION_SELECTION_GLOBAL);
  check_finite_range("muon_beta2", o.muon_beta2, 0, 1, false, false);
  check_enum("flatten", o.flatten, 0, 1);
  check_dtype_opt("momentum_dtype", o.momentum_dtype);
  check_dtype_opt("q_dtype", o.q_dtype);
  check_dtype_opt("variance_dtype", o.variance_dtype);
  check_enum("matmul_precision", o.matmul_precision, DION_MATMUL_FP32, DION_MATMUL_BF16);
}

// Multiplication with overflow detection for sizes.
int64_t mul_checked(int64_t a, int64_t b, const std::string& what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r))
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: %s: the number of elements overflows int64", what.c_str());
  return r;
}

// Validates one descriptor and fills `t`. `label` names the tensor in messages.
void build_tensor(const Optimizer& opt, const dion_group_options_t& go, const dion_tensor_t& d, size_t i, Tensor& t) {
  t.name = d.name ? std::string(d.name) : format("tensors[%zu]", i);
  std::string L = d.name ? format("tensor '%s' (tensors[%zu])", d.name, i) : format("tensors[%zu]", i);
  const char* fn = "dion_add_group";
  if (d.ndim < 0 || d.ndim > DION_MAX_DIMS)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: ndim = %d is out of range [0, %d]", fn, L.c_str(), d.ndim, DION_MAX_DIMS);
  if (!dtype_valid(d.param_dtype))
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: param_dtype = %d is not a valid dtype", fn, L.c_str(), d.param_dtype);
  dion_dtype_t gdt = d.grad_dtype == DION_DTYPE_UNSET ? d.param_dtype : d.grad_dtype;
  if (!dtype_valid(gdt))
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: grad_dtype = %d is not a valid dtype", fn, L.c_str(), d.grad_dtype);
  if (d.layout != DION_LAYOUT_ROW_MAJOR && d.layout != DION_LAYOUT_COL_MAJOR)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: layout = %d is not a valid layout", fn, L.c_str(), d.layout);
  if (d.layout == DION_LAYOUT_COL_MAJOR && d.ndim != 2)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: DION_LAYOUT_COL_MAJOR needs a 2-D tensor, got ndim = %d", fn, L.c_str(),
         d.ndim);
  for (int k = 0; k < d.ndim; ++k)
    if (d.shape[k] < 1)
      fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: shape[%d] = %lld must be >= 1", fn, L.c_str(), k,
           static_cast<long long>(d.shape[k]));
  if (is_matrix_algo(go.algorithm)) {
    if (go.algorithm == DION_ALGO_DION && d.ndim != 2)
      fail(DION_ERROR_INVALID_ARGUMENT,
           "%s: %s: Dion needs a 2-D tensor, got ndim = %d (put vectors, embeddings and the LM head in an 'adamw' or "
           "'lion' group)",
           fn, L.c_str(), d.ndim);
    if (d.ndim < 2)
      fail(DION_ERROR_INVALID_ARGUMENT,
           "%s: %s: %s needs a tensor of ndim >= 2, got ndim = %d (put vectors in an 'adamw' or 'lion' group)", fn,
           L.c_str(), algo_name(go.algorithm), d.ndim);
    const int64_t rank = go.algorithm == DION_ALGO_DION ? dion_rank(go, d.shape[0], d.shape[1]) : 1;
    if (rank < 1)
      fail(DION_ERROR_INVALID_ARGUMENT,
           "%s: %s: rank_fraction = %g with rank_multiple_of = %d gives rank %lld < 1 for its %lld x %lld matrix "
           "(rank_fraction * min(m, n) / rank_multiple_of underflows)",
           fn, L.c_str(), go.rank_fraction, go.rank_multiple_of, static_cast<long long>(rank),
           static_cast<long long>(d.shape[0]), static_cast<long long>(d.shape[1]));
  }
  // Sharding.
  const int32_t dims[2] = {d.outer_shard_dim, d.inner_shard_dim};
  const int64_t offs[2] = {d.outer_offset, d.inner_offset};
  const int64_t exts[2] = {d.outer_extent, d.inner_extent};
  const char* mesh[2] = {"outer", "inner"};
  dion_comm_t comms[2] = {opt.options.outer_comm, opt.options.inner_comm};
  for (int k = 0; k < d.ndim; ++k) {
    t.shape[k] = d.shape[k];
    t.local_shape[k] = d.shape[k];
    t.local_offset[k] = 0;
  }
  for (int s = 0; s < 2; ++s) {
    if (dims[s] == -1) continue;
    if (dims[s] < 0 || dims[s] >= d.ndim)
      fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: %s_shard_dim = %d is out of range [-1, %d)", fn, L.c_str(), mesh[s],
           dims[s], d.ndim);
    if (!comms[s])
      fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: %s_shard_dim = %d but the optimizer has no %s communicator", fn,
           L.c_str(), mesh[s], dims[s], mesh[s]);
    int64_t full = d.shape[dims[s]];
    if (offs[s] < 0 || exts[s] < 0 || offs[s] > full || exts[s] > full - offs[s])
      fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: %s shard [%lld, %lld + %lld) lies outside dim %d of size %lld", fn,
           L.c_str(), mesh[s], static_cast<long long>(offs[s]), static_cast<long long>(offs[s]),
           static_cast<long long>(exts[s]), dims[s], static_cast<long long>(full));
    // Over a multi-rank mesh, that the shards of all ranks tile the dim is
    // checked collectively once every rank has validated its own tensors
    // (Optimizer::agree_on_group).
    if (comms[s]->size == 1 && (offs[s] != 0 || exts[s] != full))
      fail(DION_ERROR_INVALID_ARGUMENT,
           "%s: %s: %s shard [%lld, %lld + %lld) does not tile dim %d of size %lld over a 1-rank %s mesh", fn,
           L.c_str(), mesh[s], static_cast<long long>(offs[s]), static_cast<long long>(offs[s]),
           static_cast<long long>(exts[s]), dims[s], static_cast<long long>(full), mesh[s]);
    t.local_shape[dims[s]] = exts[s];
    t.local_offset[dims[s]] = offs[s];
  }
  if (dims[0] >= 0 && dims[0] == dims[1])
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: dim %d is sharded over both the outer and the inner mesh", fn, L.c_str(),
         dims[0]);
  t.numel_local = 1;
  for (int k = 0; k < d.ndim; ++k) t.numel_local = mul_checked(t.numel_local, t.local_shape[k], L);
  int64_t global_numel = 1;
  for (int k = 0; k < d.ndim; ++k) global_numel = mul_checked(global_numel, d.shape[k], L);
  if (global_numel > (int64_t(1) << 40))
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: %lld elements is beyond the supported size", fn, L.c_str(),
         static_cast<long long>(global_numel));
  if (!d.param && t.numel_local > 0)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s: param is NULL", fn, L.c_str());
  opt.check_tensor_buffers(d.param, d.grad, t.numel_local, d.param_dtype, gdt, format("%s: %s", fn, L.c_str()));
  t.param = d.param;
  t.grad = d.grad;
  t.param_dtype = d.param_dtype;
  t.grad_dtype = gdt;
  t.layout = d.layout;
  t.ndim = d.ndim;
  t.outer_shard_dim = d.outer_shard_dim;
  t.inner_shard_dim = d.inner_shard_dim;

  // Matrix view (storage orientation).
  MatrixGeom& g = t.geom;
  if (d.ndim >= 2) {
    if (go.flatten && d.ndim >= 3) {
      g.batch = 1;
      g.m = d.shape[0];
      g.n = global_numel / d.shape[0];
      g.srows = t.local_shape[0];
      g.scols = t.numel_local / (t.local_shape[0] ? t.local_shape[0] : 1);
    } else {
      g.m = d.shape[d.ndim - 2];
      g.n = d.shape[d.ndim - 1];
      g.batch = 1;
      for (int k = 0; k < d.ndim - 2; ++k) g.batch *= t.local_shape[k];
      g.srows = t.local_shape[d.ndim - 2];
      g.scols = t.local_shape[d.ndim - 1];
    }
    if (d.layout == DION_LAYOUT_COL_MAJOR) {
      std::swap(g.srows, g.scols);
      g.storage_transposed = true;
    }
  }
}

}  // namespace

void Optimizer::add_group(const dion_group_options_t& go, const dion_tensor_t* descs, size_t count,
                          int32_t* group_index) {
  const int32_t gi = static_cast<int32_t>(groups.size());
  std::vector<Tensor> built;
  // With a replicate mesh the validation's outcome is agreed on collectively:
  // a rank whose arguments fail locally still takes part in the comparison,
  // so the others fail too instead of waiting for it.
  try {
    validate_group_options(go);
    DION_REQUIRE(count == 0 || descs, DION_ERROR_INVALID_ARGUMENT, "dion_add_group: tensors is NULL but count = %zu",
                 count);
    DION_REQUIRE(count <= (1u << 24), DION_ERROR_INVALID_ARGUMENT, "dion_add_group: count = %zu is too large", count);
    // The array stride is the caller's sizeof(dion_tensor_t), read from the first element.
    size_t stride = count ? descs[0].struct_size : 0;
    if (count) {
      // An array's stride is a multiple of the struct's alignment; anything
      // else is a corrupt struct_size (and would make the reads misaligned).
      DION_REQUIRE(stride >= offsetof(dion_tensor_t, inner_extent) + sizeof(int64_t) && stride <= 4096 &&
                       stride % alignof(dion_tensor_t) == 0,
                   DION_ERROR_INVALID_ARGUMENT,
                   "dion_add_group: tensors[0].struct_size = %zu is not a valid dion_tensor_t size (expected %zu)",
                   stride, sizeof(dion_tensor_t));
    }
    built.resize(count);
    for (size_t i = 0; i < count; ++i) {
      const dion_tensor_t* dp =
          reinterpret_cast<const dion_tensor_t*>(reinterpret_cast<const char*>(descs) + i * stride);
      DION_REQUIRE(dp->struct_size == stride, DION_ERROR_INVALID_ARGUMENT,
                   "dion_add_group: tensors[%zu].struct_size = %zu differs from tensors[0].struct_size = %zu", i,
                   dp->struct_size, stride);
      dion_tensor_t d;
      dion_tensor_init(&d);
      std::memcpy(&d, dp, stride < sizeof(d) ? stride : sizeof(d));
      build_tensor(*this, go, d, i, built[i]);
      built[i].index = static_cast<int32_t>(tensors.size() + i);
      built[i].group = gi;
    }
  } catch (const Error&) {
    agree_on_group(go, built, true);
    throw;
  }
  // Every rank must add the same group: a cheap collective comparison of a
  // hash of the options and the tensor metadata catches a mismatch on every
  // rank here, instead of a hang or silent garbage in a later collective.
  agree_on_group(go, built, false);
  // Whether steps overlap (see step()) is decided once, at the first group
  // with a multi-rank replicate mesh whose gradients are synchronised on a
  // backend with device memory, and collectively: an overlapped and a
  // sequential rank would issue their NCCL operations in different orders,
  // so DION_OVERLAP=0 on any rank of the replicate mesh turns overlap off on
  // all of them. The comm stream itself is made in the commit below.
  if (rep && options.replicate_grad_sync && !backend->host_memory() && !overlap_decided) {
    int32_t off = overlap_allowed ? 0 : 1;
    rep->all_reduce_host(&off, 1, ReduceOp::kMax);
    if (off && overlap_allowed)
      DION_LOG_WARN("dion_add_group: DION_OVERLAP=0 on another rank of the replicate mesh: overlap is off here too");
    overlap_allowed = !off;
    overlap_decided = true;
  }
  const Algorithm& algo = algorithm_for(go.algorithm);
  // Everything is validated: commit. Allocation may still fail (out of
  // memory); roll back in that case so a failed call adds nothing.
  const size_t tensors_before = tensors.size(), states_before = states.size();
  Group g;
  g.opt = go;
  size_t pre_bytes = 0;  // the buckets' pre-pass outputs (Bucket::pre)
  try {
    for (auto& t : built) {
      tensors.push_back(std::move(t));
      Tensor& tt = tensors.back();
      try {
        algo.init_state(*this, g, tt);
      } catch (const Error& e) {
        throw Error(e.status(), format("dion_add_group: tensor '%s' (tensor %d): %s", tt.name.c_str(), tt.index, e.what()));
      }
      g.tensors.push_back(tt.index);
    }
    plan_buckets(g, algo);
    size_t ws_need = 0;
    for (Bucket& b : g.buckets) {
      b.table = static_cast<TensorEntry*>(backend->alloc(sizeof(TensorEntry) * b.tensors.size()));
      b.mirror.reserve(b.tensors.size());
      b.scratch.reserve(b.tensors.size());
      ws_need = std::max(ws_need, b.workspace_floats);
      const size_t pf = options.skip_nonfinite && algo.prepass_floats
                            ? algo.prepass_floats(*this, g, tensors[static_cast<size_t>(b.tensors[0])],
                                                  static_cast<int64_t>(b.tensors.size()))
                            : 0;
      if (pf > 0) {
        b.pre = static_cast<float*>(backend->alloc(pf * sizeof(float)));
        pre_bytes += pf * sizeof(float);
      }
    }
    if (algo.group_workspace_floats) ws_need = std::max(ws_need, algo.group_workspace_floats(*this, g));
    g.scalars = static_cast<GroupScalars*>(backend->alloc(sizeof(GroupScalars)));
    GroupScalars zero{};
    backend->copy_sync(g.scalars, &zero, sizeof(zero));
    upload_scalars(g);
    // Overlapped steps need the backend's comm stream (made once); so does
    // the overlap of an algorithm's own collectives with its compute (Dion's
    // phased step) on any multi-rank mesh. DION_OVERLAP=0 turns both off.
    if (overlap_decided && overlap_allowed && !overlap) overlap = backend->make_comm_stream();
    if (has_meshes() && overlap_allowed && !backend->host_memory() && !backend->comm_stream())
      (void)backend->make_comm_stream();
    // The replicate averages stage one tensor at a time: in the workspace
    // for the states (dion_sync_for_checkpoint) and for the gradients of a
    // sequential step; an overlapped step averages fp32 gradients in place
    // and stages the others in `stage`, used by the comm stream only.
    size_t stage_need = 0;
    if (rep)
      for (const Tensor& t : tensors)
        if (t.group == gi) {
          if (!overlap)
            ws_need = std::max(ws_need, ws_floats(t.numel_local));
          else if (t.grad_dtype != DION_DTYPE_FP32 && !dion_compressed(t, go.algorithm))
            stage_need = std::max(stage_need, ws_floats(t.numel_local));
          for (int32_t si : t.states) ws_need = std::max(ws_need, ws_floats(states[static_cast<size_t>(si)].numel));
        }
    ws.reserve(*backend, ws_need);
    if (stage_need > stage_floats) {
      float* p = static_cast<float*>(backend->alloc(stage_need * sizeof(float)));
      if (stage) backend->release(stage);
      table_bytes += (stage_need - stage_floats) * sizeof(float);
      stage = p;
      stage_floats = stage_need;
    }
  } catch (...) {
    for (size_t s = states_before; s < states.size(); ++s)
      if (states[s].data) backend->release(states[s].data);
    for (Bucket& b : g.buckets) release_bucket(b);
    if (g.scalars) backend->release(g.scalars);
    states.resize(states_before);
    tensors.resize(tensors_before);
    throw;
  }
  for (const Bucket& b : g.buckets) table_bytes += sizeof(TensorEntry) * b.tensors.size();
  table_bytes += sizeof(GroupScalars) + pre_bytes;
  const size_t nb = g.buckets.size();
  groups.push_back(std::move(g));
  if (group_index) *group_index = gi;
  DION_LOG_INFO("INIT", "added group %d: %s, %zu tensors in %zu batches", gi, algo.name, count, nb);
}

// Tensors of a matrix algorithm share a batch when everything their step
// depends on is equal; a batch is cut so that its workspace stays under
// batch_workspace_floats (a batch of one is always allowed) and it holds at
// most batch_max matrices.
void Optimizer::plan_buckets(Group& g, const Algorithm& algo) {
  if (algo.elementwise) {
    Bucket b;
    b.tensors = g.tensors;
    if (!b.tensors.empty()) g.buckets.push_back(std::move(b));
    return;
  }
  auto same = [&](const Tensor& a, const Tensor& b) {
    if (a.ndim != b.ndim || a.param_dtype != b.param_dtype || a.grad_dtype != b.grad_dtype || a.layout != b.layout ||
        a.outer_shard_dim != b.outer_shard_dim || a.inner_shard_dim != b.inner_shard_dim || a.rank != b.rank ||
        a.dion_transposed != b.dion_transposed || a.numel_local != b.numel_local || a.states.size() != b.states.size())
      return false;
    // Equal on every rank only if the whole tilings are equal: two tensors
    // whose shards match here but not on another rank must not share a batch
    // here (the ranks would issue different collectives).
    for (int m = 0; m < 2; ++m)
      if (a.shard_off[m] != b.shard_off[m] || a.shard_ext[m] != b.shard_ext[m]) return false;
    for (int d = 0; d < a.ndim; ++d)
      if (a.shape[d] != b.shape[d] || a.local_shape[d] != b.local_shape[d] || a.local_offset[d] != b.local_offset[d])
        return false;
    for (size_t k = 0; k < a.states.size(); ++k) {
      const StateBuf &sa = states[static_cast<size_t>(a.states[k])], &sb = states[static_cast<size_t>(b.states[k])];
      if (sa.dtype != sb.dtype || sa.numel != sb.numel) return false;
    }
    return true;
  };
  std::vector<std::vector<int32_t>> classes;
  for (int32_t ti : g.tensors) {
    const Tensor& t = tensors[static_cast<size_t>(ti)];
    bool placed = false;
    for (auto& c : classes)
      if (same(tensors[static_cast<size_t>(c[0])], t)) {
        c.push_back(ti);
        placed = true;
        break;
      }
    if (!placed) classes.push_back({ti});
  }
  // A batch's size is capped by its workspace, which depends on the local
  // shard; every rank must cut the same batches, so the caps are agreed on
  // (the smallest over the meshes' ranks: rep, then outer, then inner reach
  // the whole grid).
  std::vector<int32_t> neg_cap(classes.size());
  for (size_t k = 0; k < classes.size(); ++k) {
    const size_t one = algo.workspace_floats(g, tensors[static_cast<size_t>(classes[k][0])], 1);
    size_t cap = std::max<size_t>(1, batch_workspace_floats / std::max<size_t>(one, 1));
    if (batch_max > 0) cap = std::min(cap, static_cast<size_t>(batch_max));
    neg_cap[k] = -static_cast<int32_t>(std::min<size_t>(cap, size_t(1) << 30));
  }
  if (!neg_cap.empty())
    for (Collectives* c : meshes())
      if (c) c->all_reduce_host(neg_cap.data(), static_cast<int64_t>(neg_cap.size()), ReduceOp::kMax);
  for (size_t k = 0; k < classes.size(); ++k) {
    const std::vector<int32_t>& c = classes[k];
    const Tensor& t0 = tensors[static_cast<size_t>(c[0])];
    // The mesh a batch of this class is split over (Dion's orthogonalization,
    // the megabatch family's matrices): the outer mesh for outer-sharded
    // tensors, the inner mesh for inner-sharded ones, else the replicas.
    // Its size is the same on every rank, so are the cuts.
    Collectives* split = t0.outer_shard_dim >= 0 ? outer.get() : t0.inner_shard_dim >= 0 ? inner.get() : rep.get();
    const int64_t granule = split ? split->size() : 1;
    size_t i = 0;
    for (int64_t size : cut_batches(static_cast<int64_t>(c.size()), -static_cast<int64_t>(neg_cap[k]), granule)) {
      Bucket b;
      b.tensors.assign(c.begin() + static_cast<std::ptrdiff_t>(i),
                       c.begin() + static_cast<std::ptrdiff_t>(i + static_cast<size_t>(size)));
      i += static_cast<size_t>(size);
      b.workspace_floats = algo.workspace_floats(g, t0, size);
      g.buckets.push_back(std::move(b));
    }
  }
}

// Rewrites the bucket's table if the set of tensors with a gradient or any
// pointer changed since the last step (steady state: nothing to do).
void Optimizer::refresh_table(Bucket& b) {
  // Both host lists keep the capacity reserved at add_group: no allocation here.
  std::vector<TensorEntry>& list = b.scratch;
  list.clear();
  b.max_n = 0;
  b.first_active = -1;
  for (int32_t ti : b.tensors) {
    const Tensor& t = tensors[static_cast<size_t>(ti)];
    // An empty shard of a tensor sharded over several ranks still takes part
    // in its batch's collectives (its gradient pointer may be NULL).
    if (t.numel_local == 0 ? !sharded(t) : !t.grad) continue;
    TensorEntry e{};
    e.ptr[kParam] = t.param;
    e.dtype[kParam] = t.param_dtype;
    e.ptr[kGrad] = const_cast<void*>(t.grad);
    e.dtype[kGrad] = t.grad_dtype;
    for (size_t k = 0; k < t.states.size() && k < 2; ++k) {
      const StateBuf& sb = states[static_cast<size_t>(t.states[k])];
      e.ptr[kState0 + k] = sb.data;
      e.dtype[kState0 + k] = sb.dtype;
    }
    e.n = t.numel_local;
    e.tensor_id = static_cast<uint32_t>(t.index);
    b.max_n = std::max(b.max_n, t.numel_local);
    if (b.first_active < 0) b.first_active = ti;
    list.push_back(e);
  }
  b.active = static_cast<int64_t>(list.size());
  b.aligned16 = true;
  for (const TensorEntry& e : list)
    for (int f : {static_cast<int>(kParam), static_cast<int>(kState0), static_cast<int>(kState1)})
      if (reinterpret_cast<uintptr_t>(e.ptr[f]) & 15) b.aligned16 = false;
  if (list.size() == b.mirror.size() &&
      (list.empty() || std::memcmp(list.data(), b.mirror.data(), sizeof(TensorEntry) * list.size()) == 0))
    return;
  if (!list.empty()) backend->copy_sync(b.table, list.data(), sizeof(TensorEntry) * list.size());
  b.mirror.swap(list);
}

namespace {

// FNV-1a over what every rank of mesh `m` (0 rep, 1 outer, 2 inner) must
// agree on: the options, and each tensor's global metadata and its shard
// along the OTHER meshes (ranks of one mesh hold pieces of the same slice;
// replicas hold the same shard).
uint64_t group_hash(const dion_group_options_t& go, const std::vector<Tensor>& built, int m) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  auto mix_v = [&mix](auto v) { mix(&v, sizeof v); };
  mix_v(go.algorithm);
  for (double v : {go.lr, go.weight_decay, go.mu, go.beta1, go.beta2, go.epsilon, go.rank_fraction, go.oversample,
                   go.fraction, go.ef_decay, go.muon_beta2})
    mix_v(v);
  for (int32_t v : {go.rank_multiple_of, go.power_iters, static_cast<int32_t>(go.qr_method), go.cqr_warmup_steps,
                    static_cast<int32_t>(go.orthogonalizer), go.ortho_steps, go.nesterov,
                    static_cast<int32_t>(go.adjust_lr), go.cautious_wd, static_cast<int32_t>(go.selection_scope),
                    go.flatten, static_cast<int32_t>(go.momentum_dtype), static_cast<int32_t>(go.q_dtype),
                    static_cast<int32_t>(go.variance_dtype), static_cast<int32_t>(go.matmul_precision)})
    mix_v(v);
  mix_v(static_cast<uint64_t>(built.size()));
  for (const Tensor& t : built) {
    mix_v(t.ndim);
    mix_v(static_cast<int32_t>(t.param_dtype));
    mix_v(static_cast<int32_t>(t.grad_dtype));
    mix_v(static_cast<int32_t>(t.layout));
    mix_v(t.outer_shard_dim);
    mix_v(t.inner_shard_dim);
    for (int d = 0; d < t.ndim; ++d) mix_v(t.shape[d]);
    const int32_t sd[2] = {t.outer_shard_dim, t.inner_shard_dim};
    for (int s = 0; s < 2; ++s)
      if (sd[s] >= 0 && s + 1 != m) {
        mix_v(t.local_offset[sd[s]]);
        mix_v(t.local_shape[sd[s]]);
      }
  }
  return h;
}

}  // namespace

bool Optimizer::sharded(const Tensor& t) const {
  return (outer && t.outer_shard_dim >= 0) || (inner && t.inner_shard_dim >= 0);
}

void Optimizer::agree_on_group(const dion_group_options_t& go, std::vector<Tensor>& built, bool failed_here) {
  const std::array<Collectives*, 3> mesh = meshes();
  bool failed = failed_here;
  std::string why;
  // Round 1, mesh by mesh: compare the hashes, pass on a failure, and check
  // that each sharded dim's shards tile it in rank order.
  for (int m = 0; m < 3; ++m) {
    Collectives* c = mesh[static_cast<size_t>(m)];
    if (!c) continue;
    const uint64_t h = group_hash(go, built, m);
    // max and -min of two 30-bit pieces: equal on every rank iff the hashes agree.
    const int32_t a = static_cast<int32_t>(h & 0x3fffffff), b = static_cast<int32_t>((h >> 30) & 0x3fffffff);
    int32_t v[5] = {a, b, -a, -b, failed ? 1 : 0};
    c->all_reduce_host(v, 5, ReduceOp::kMax);
    const bool mismatch = v[0] != -v[2] || v[1] != -v[3];
    if (!failed && v[4]) {
      failed = true;
      why = format("dion_add_group: the call failed on another rank of the %s mesh (see that rank's error); nothing "
                   "was added",
                   c->mesh().c_str());
    } else if (!failed && mismatch) {
      failed = true;
      why = format("dion_add_group: the group's options or tensor metadata differ between the ranks of the %s mesh "
                   "(every rank must add the same groups, in the same order, with the same options, shapes and "
                   "shard dims)",
                   c->mesh().c_str());
    }
    if (m == 0 || v[4] || mismatch) continue;  // the same decision on every rank of this mesh
    // Every rank's (offset, extent) along the dim sharded over this mesh, as
    // 31-bit pieces summed into per-rank slots.
    const int W = c->size(), me = c->rank();
    const size_t nt = built.size();
    std::vector<int32_t> buf(nt * static_cast<size_t>(W) * 4, 0);
    for (size_t i = 0; i < nt; ++i) {
      const Tensor& t = built[i];
      const int32_t sd = m == 1 ? t.outer_shard_dim : t.inner_shard_dim;
      if (sd < 0) continue;
      int32_t* slot = &buf[(i * static_cast<size_t>(W) + static_cast<size_t>(me)) * 4];
      slot[0] = static_cast<int32_t>(t.local_offset[sd] & 0x7fffffff);
      slot[1] = static_cast<int32_t>(t.local_offset[sd] >> 31);
      slot[2] = static_cast<int32_t>(t.local_shape[sd] & 0x7fffffff);
      slot[3] = static_cast<int32_t>(t.local_shape[sd] >> 31);
    }
    c->all_reduce_host(buf.data(), static_cast<int64_t>(buf.size()), ReduceOp::kSum);
    for (size_t i = 0; i < nt && !failed; ++i) {
      Tensor& t = built[i];
      const int32_t sd = m == 1 ? t.outer_shard_dim : t.inner_shard_dim;
      if (sd < 0) continue;
      std::vector<int64_t>& off = t.shard_off[m - 1];
      std::vector<int64_t>& ext = t.shard_ext[m - 1];
      off.resize(static_cast<size_t>(W));
      ext.resize(static_cast<size_t>(W));
      int64_t next = 0;
      std::string seen;
      bool ok = true;
      for (int q = 0; q < W; ++q) {
        const int32_t* slot = &buf[(i * static_cast<size_t>(W) + static_cast<size_t>(q)) * 4];
        off[static_cast<size_t>(q)] = static_cast<int64_t>(slot[0]) | (static_cast<int64_t>(slot[1]) << 31);
        ext[static_cast<size_t>(q)] = static_cast<int64_t>(slot[2]) | (static_cast<int64_t>(slot[3]) << 31);
        ok = ok && off[static_cast<size_t>(q)] == next;
        next = off[static_cast<size_t>(q)] + ext[static_cast<size_t>(q)];
        seen += format("%s[%lld, %lld)", q ? " " : "", static_cast<long long>(off[static_cast<size_t>(q)]),
                       static_cast<long long>(next));
      }
      if (!ok || next != t.shape[sd]) {
        failed = true;
        why = format("dion_add_group: tensor '%s' (tensors[%zu]): its shards along dim %d (size %lld) over the %d "
                     "ranks of the %s mesh do not tile it in rank order: %s",
                     t.name.c_str(), i, sd, static_cast<long long>(t.shape[sd]), W, c->mesh().c_str(), seen.c_str());
      }
    }
  }
  // Round 2: a failure seen on one mesh reaches every rank of every mesh
  // (rep, then outer, then inner reach the whole grid).
  for (int m = 0; m < 3; ++m) {
    Collectives* c = mesh[static_cast<size_t>(m)];
    if (!c) continue;
    int32_t f = failed ? 1 : 0;
    c->all_reduce_host(&f, 1, ReduceOp::kMax);
    if (f && !failed) {
      failed = true;
      why = format("dion_add_group: the call failed on another rank (of the %s mesh or beyond; see that rank's "
                   "error); nothing was added",
                   c->mesh().c_str());
    }
  }
  if (failed_here) return;  // the caller rethrows its own error
  if (failed) fail(DION_ERROR_INVALID_ARGUMENT, "%s", why.c_str());
}

void Optimizer::check_tensor_buffers(const void* param, const void* grad, int64_t numel, dion_dtype_t param_dtype,
                                     dion_dtype_t grad_dtype, const std::string& what) const {
  if (numel <= 0) return;
  const size_t n = static_cast<size_t>(numel);
  check_buffer(param, n * dtype_size(param_dtype), dtype_size(param_dtype), what + ": param");
  if (grad) check_buffer(grad, n * dtype_size(grad_dtype), dtype_size(grad_dtype), what + ": grad");
}

bool Optimizer::dion_compressed(const Tensor& t) const {
  return dion_compressed(t, groups[static_cast<size_t>(t.group)].opt.algorithm);
}

bool Optimizer::dion_compressed(const Tensor& t, dion_algorithm_t algo) const {
  if (!rep || !options.replicate_grad_sync) return false;
  if (algo != DION_ALGO_DION) return false;
  const double m = static_cast<double>(t.geom.m), n = static_cast<double>(t.geom.n);
  return (m + n) * static_cast<double>(t.rank) < m * n;
}

// Replaces n typed elements with their average over the replicate mesh:
// fp32 in place, other dtypes staged in the workspace as fp32 (sized for it
// at dion_add_group). Enqueued on the current stream, as are
// the mesh's collectives outside an overlapped step.
void Optimizer::average_in_place(void* data, dion_dtype_t dt, int64_t n) {
  if (n == 0) return;
  float* stage = nullptr;
  if (dt != DION_DTYPE_FP32) {
    ws.reset();
    stage = ws.take(n);
  }
  average_staged(data, dt, n, stage, false);
}

// The average itself: an fp32 buffer in place (staging would only copy it
// there and back), another dtype converted into `stage` (n floats), averaged
// and converted back, on the compute stream or (on_comm) the comm stream.
void Optimizer::average_staged(void* data, dion_dtype_t dt, int64_t n, float* stage, bool on_comm) {
  if (dt == DION_DTYPE_FP32) {
    rep->all_reduce(static_cast<float*>(data), n, ReduceOp::kAvg);
    return;
  }
  if (on_comm)
    backend->load_comm(stage, data, dt, n);
  else
    backend->load(stage, data, dt, n);
  rep->all_reduce(stage, n, ReduceOp::kAvg);
  if (on_comm)
    backend->store_comm(data, dt, stage, n);
  else
    backend->store(data, dt, stage, n);
}

void Optimizer::sync_states() {
  if (!rep || !options.replicate_grad_sync) return;
  for (StateBuf& s : states) average_in_place(s.data, s.dtype, s.numel);
}

// With a multi-rank replicate mesh and replicate_grad_sync, gradients are
// averaged over the mesh in place, as DDP does, except those of compressed
// Dion tensors, whose P and R are averaged inside the step instead (spec
// §2.6: exact by linearity). The sequential form: every gradient, one tensor
// at a time, before any bucket computes (the host backend, DION_OVERLAP=0).
static void average_gradients(Optimizer& o) {
  for (const Tensor& t : o.tensors)
    if (t.grad && !o.dion_compressed(t)) o.average_in_place(const_cast<void*>(t.grad), t.grad_dtype, t.numel_local);
}

// The overlapped form, one bucket's gradients on the comm stream. The same
// tensors, each averaged by its own all-reduce of the same elements as in
// average_gradients (so with the same result bit for bit; only the order of
// the tensors differs, bucket order instead of tensor order, the same on
// every rank), by average_staged as average_in_place does, on the comm
// stream, whose order alone keeps consecutive tensors from sharing the
// staging buffer.
bool Optimizer::average_bucket_on_comm(const Bucket& b, int slot) {
  // The pipeline orders these itself (step()): no join with the compute stream.
  rep->set_join(nullptr);
  bool any = false;
  for (int32_t ti : b.tensors) {
    const Tensor& t = tensors[static_cast<size_t>(ti)];
    if (!t.grad || !grad_averaged(t, groups[static_cast<size_t>(t.group)].opt.algorithm)) continue;
    DION_REQUIRE(t.grad_dtype == DION_DTYPE_FP32 || static_cast<size_t>(t.numel_local) <= stage_floats,
                 DION_ERROR_INTERNAL,
                 "overlapped step: tensor %d's gradient (%lld elements) exceeds the staging buffer (%zu floats)",
                 t.index, static_cast<long long>(t.numel_local), stage_floats);
    average_staged(const_cast<void*>(t.grad), t.grad_dtype, t.numel_local, stage, true);
    any = true;
  }
  rep->set_join(&comm_join);
  if (any) backend->comm_mark(slot);
  return any;
}

bool Optimizer::grad_averaged(const Tensor& t, dion_algorithm_t algo) const {
  return rep && options.replicate_grad_sync && t.numel_local > 0 && !dion_compressed(t, algo);
}

bool Optimizer::group_grads_averaged(const Group& g) const {
  for (int32_t ti : g.tensors) {
    const Tensor& t = tensors[static_cast<size_t>(ti)];
    if (t.grad && grad_averaged(t, g.opt.algorithm)) return true;
  }
  return false;
}

void Optimizer::release_bucket(Bucket& b) {
  if (b.table) backend->release(b.table);
  if (b.pre) backend->release(b.pre);
  b.table = nullptr;
  b.pre = nullptr;
}

Batch Optimizer::batch_of(const Bucket& b) const {
  // The pre-pass ran this step wherever the bucket has one (step checks the
  // gradients of every active bucket first when skip_nonfinite is on, the
  // only case in which dion_add_group gives a bucket a pre-pass).
  return Batch{tensors[static_cast<size_t>(b.first_active)], b.active, b.table, b.max_n, b.aligned16, b.pre};
}

void Optimizer::step_whole_group(Group& g) {
  const Algorithm& algo = algorithm_for(g.opt.algorithm);
  if (algo.step_group && algo.step_group(*this, g)) return;
  for (Bucket& b : g.buckets) step_bucket(g, b);
}

void Optimizer::step_bucket(Group& g, Bucket& b) {
  if (!b.active) return;
  ws.reset();
  algorithm_for(g.opt.algorithm).step(*this, g, batch_of(b));
}

namespace {

// For one overlapped step: every mesh's collectives go to the backend's comm
// stream, each bracketed by the optimizer's CommJoin; afterwards (however
// the step ends) they go back to the compute stream, unbracketed, where the
// API call's StreamScope left them.
class CommRoute {
 public:
  CommRoute(Optimizer& o, bool on) : o_(on ? &o : nullptr) {
    if (!o_) return;
    for (Collectives* c : o.meshes())
      if (c) {
        c->set_stream(o.backend->comm_stream());
        c->set_join(&o.comm_join);
      }
  }
  ~CommRoute() {
    if (!o_) return;
    for (Collectives* c : o_->meshes())
      if (c) {
        c->set_join(nullptr);
        c->set_stream(o_->backend->stream());
      }
  }
  CommRoute(const CommRoute&) = delete;
  CommRoute& operator=(const CommRoute&) = delete;

 private:
  Optimizer* o_;
};

}  // namespace

// One step (DESIGN.md §5).
//
// Overlap (CUDA backend with NCCL, a multi-rank replicate mesh,
// replicate_grad_sync, DION_OVERLAP not 0): the replicate gradient average
// of bucket k+1 runs on the backend's comm stream while bucket k's algorithm
// computes on the caller's stream. The host enqueues, in this order:
//
//   avg(0) mark   avg(1) mark   wait(0) step(0)   avg(2) mark   wait(1) step(1)   ...   join
//
// where avg(k) is bucket k's gradient all-reduces (comm stream), mark
// records event k % 2 after them, wait(k) makes the caller's stream wait for
// that event only (so step(k) does not wait for avg(k+1), enqueued after the
// mark), and the final join makes the caller's stream wait for all the comm
// stream's work: when dion_step returns, the caller's stream is ordered
// after the whole step, as before. Event k % 2 is recorded again for bucket
// k + 2 only after wait(k) was enqueued (a wait uses the latest record at
// the time it is enqueued), so two events serve any number of buckets.
//
// Ordering with the algorithms' own collectives (P/R averages, outer and
// inner reductions, the megabatch engine's all-to-alls and all-gathers, and
// the non-finite flag's reduction): NCCL needs every rank to issue the
// operations of a communicator in one order, and two streams carrying
// operations of one communicator (or of two communicators, whose kernels
// may wait for each other's peers) can deadlock, since each rank's GPU may
// run them in another order. So during an overlapped step EVERY collective
// of every mesh is enqueued on the one comm stream, in the host's program
// order, which is the same on every rank; those the algorithms issue are
// bracketed by a fork (the comm stream waits for the caller's stream so far:
// their inputs) and a join (the caller's stream waits for the comm stream:
// their outputs), so each is ordered with the compute exactly as when it was
// enqueued on the caller's stream, and queues behind the gradient averages
// already enqueued (avg(k+1) before step(k)'s collectives). No second
// communicator is needed (an ncclCommSplit per mesh and per optimizer would
// cost its own buffers and connections, and need the caller's communicator
// to be splittable), and a single comm stream keeps the per-rank order of
// NCCL kernels the host's, as a single stream did before.
//
// Every result is bit-identical to the sequential step: the same
// all-reduces of the same elements (see average_bucket_on_comm), and every
// other kernel reads the same inputs. Nothing here allocates or waits for
// the device (events and the staging buffer are made at dion_add_group), and
// every cross-stream dependency is an event record + stream wait, so a
// CUDA-graph capture of the step forks onto the comm stream and joins back
// into the captured stream. The skip flag and the wait guard keep working:
// the flag is reduced (on the comm stream, joined) before any parameter or
// state write reads it, and the blocking waits (done_ recorded at end_step,
// after the final join) cover the comm stream.
//
// The non-finite check writes a flag in backend memory that every later
// write of a parameter or state reads (a skipped step computes and
// discards); the host backend reads the flag directly and returns early.
void Optimizer::step() {
  for (Group& g : groups)
    for (Bucket& b : g.buckets) refresh_table(b);
  for (Collectives* c : meshes())
    if (c) c->reset_step();
  const bool overlapped = overlap && rep && options.replicate_grad_sync;
  CommRoute route(*this, overlapped);
  try {
    backend->zero(&status->skip, sizeof(int32_t));
    if (options.skip_nonfinite)
      for (Group& g : groups) {
        const Algorithm& algo = algorithm_for(g.opt.algorithm);
        for (Bucket& b : g.buckets) {
          if (!b.active) continue;
          if (b.pre)  // the algorithm's pre-pass reads the gradients and flags them in one pass
            algo.prepass(*this, g, batch_of(b), b.pre, &status->skip);
          else
            backend->check_nonfinite(b.table, b.active, b.max_n, kGrad, &status->skip);
        }
      }
    // Every rank skips together (a NaN on one rank would otherwise reach the
    // others through the collectives): rep, then outer, then inner reach the
    // whole grid.
    // The reduction runs on a copy that is then OR-ed into the flag the writes
    // read: a collective aborted mid-flight (a dead peer, DION_COMM_TIMEOUT)
    // may leave garbage in its buffer, and must not clear the skip that the
    // wait guard set to stop this step's writes.
    if (options.skip_nonfinite && has_meshes()) {
      backend->copy(&status->skip_mesh, &status->skip, sizeof(int32_t));
      for (Collectives* c : meshes())
        if (c) c->all_reduce(&status->skip_mesh, 1, ReduceOp::kMax);
      backend->merge_skip(status);
    }
    if (backend->host_memory() && status->skip) {
      ++status->skipped_steps;
      DION_LOG_WARN("step skipped: a gradient holds NaN or Inf");
      return;
    }
    for (Group& g : groups) {
      backend->advance_step(g.scalars, status);
      // The host backend knows the counter; on the device, the host's copy
      // counts enqueued steps (it only chooses Dion's CQR warm-up method).
      g.host_step = backend->host_memory() ? g.scalars->step : g.host_step + 1;
    }
    backend->count_skip(status);
    if (!overlapped) {
      if (rep && options.replicate_grad_sync) average_gradients(*this);
      for (Group& g : groups) step_whole_group(g);
      return;
    }
    // The gradients are final (the caller's work before dion_step) and
    // checked: from here the comm stream may average them in place.
    backend->comm_wait_main();
    // Cursor over the buckets in group order: (gi, bi), gi == groups.size() at the end.
    auto settle = [this](size_t& gi, size_t& bi) {
      while (gi < groups.size() && bi >= groups[gi].buckets.size()) {
        ++gi;
        bi = 0;
      }
    };
    size_t gi = 0, bi = 0;
    settle(gi, bi);
    static_assert(Backend::kCommMarks == 2, "the pipeline alternates two marks");
    bool marked[Backend::kCommMarks] = {false, false};
    if (gi < groups.size()) marked[0] = average_bucket_on_comm(groups[gi].buckets[bi], 0);
    for (int k = 0; gi < groups.size(); ++k) {
      // A group none of whose gradients is averaged (Dion's compressed
      // tensors) is one step of the pipeline: its algorithm may step it whole
      // (Dion's phased step), else bucket by bucket.
      Group& g = groups[gi];
      const Algorithm& algo = algorithm_for(g.opt.algorithm);
      const bool whole = bi == 0 && algo.step_group && !group_grads_averaged(g);
      size_t ng = whole ? gi + 1 : gi, nb = whole ? 0 : bi + 1;
      settle(ng, nb);
      const int cur = k % 2, nxt = (k + 1) % 2;
      if (ng < groups.size()) marked[nxt] = average_bucket_on_comm(groups[ng].buckets[nb], nxt);
      if (marked[cur]) backend->main_wait_mark(cur);
      if (whole)
        step_whole_group(g);
      else
        step_bucket(g, g.buckets[bi]);
      gi = ng;
      bi = nb;
    }
    backend->main_wait_comm();
  } catch (...) {
    // A failed overlapped step still leaves the caller's stream after the
    // comm stream's work (best effort: the original error is the one reported).
    if (overlapped) {
      try {
        backend->main_wait_comm();
      } catch (...) {
      }
    }
    throw;
  }
}

}  // namespace dion
