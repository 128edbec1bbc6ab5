// SPDX-License-Identifier: MIT
// The C entry points of include/dion.h (except communicators: comm_api.cpp).
// Each validates its arguments, calls into core and returns a status; no
// exception crosses this boundary (api_call).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "api_util.hpp"
#include "comm.hpp"

using namespace dion;

namespace dion {
std::string& thread_last_error() {
  thread_local std::string s;
  return s;
}
}  // namespace dion

namespace {

Optimizer* check_handle(dion_optimizer_t h, const char* fn) {
  auto* o = reinterpret_cast<Optimizer*>(h);
  if (!o) fail(DION_ERROR_INVALID_ARGUMENT, "%s: optimizer is NULL", fn);
  if (o->magic_head != kMagicHead || o->magic_tail != kMagicTail)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: optimizer is not a valid dion_optimizer_t (destroyed or foreign pointer)", fn);
  return o;
}

// Runs body against a validated handle; errors land on the handle when it is
// valid, else on the calling thread.
template <class F>
dion_status_t handle_call(dion_optimizer_t h, const char* fn, F&& body) {
  Optimizer* o = nullptr;
  dion_status_t s = api_call(nullptr, [&] { o = check_handle(h, fn); });
  if (s != DION_SUCCESS) return s;
  return api_call(o, [&] { body(*o); });
}

// Copies a caller's versioned struct: defaults first, then the caller's first
// struct_size bytes.
template <class T>
void copy_versioned(T& dst, const T* src, const char* fn, const char* arg) {
  if (src->struct_size < sizeof(size_t) + sizeof(uint32_t) || src->struct_size > sizeof(T)) {
    if (src->struct_size > sizeof(T) && src->struct_size <= 65536)
      fail(DION_ERROR_INVALID_ARGUMENT,
           "%s: %s->struct_size = %zu is larger than this libdion's (%zu): the caller was built against a newer "
           "dion.h than libdion %d.%d.%d",
           fn, arg, src->struct_size, sizeof(T), DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH);
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s->struct_size = %zu is not valid (expected %zu; use the *_init function)",
         fn, arg, src->struct_size, sizeof(T));
  }
  if (src->abi_version != DION_ABI_VERSION)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s->abi_version = %u, this libdion has ABI %d", fn, arg,
         static_cast<unsigned>(src->abi_version), DION_ABI_VERSION);
  std::memcpy(&dst, src, src->struct_size);
  dst.struct_size = sizeof(T);
}

// Integer fields holding DION_UNSET_INT take their documented default.
#define DION_DEFAULT_IF_UNSET(dst, def, field) \
  if ((dst).field == DION_UNSET_INT) (dst).field = (def).field

void apply_unset_defaults(dion_options_t& o) {
  dion_options_t d;
  dion_options_init(&d);
  DION_DEFAULT_IF_UNSET(o, d, backend);
  DION_DEFAULT_IF_UNSET(o, d, device);
  DION_DEFAULT_IF_UNSET(o, d, replicate_grad_sync);
  DION_DEFAULT_IF_UNSET(o, d, skip_nonfinite);
}

void apply_unset_defaults(dion_group_options_t& o) {
  dion_group_options_t d;
  dion_group_options_init(&d, DION_ALGO_DION);
  DION_DEFAULT_IF_UNSET(o, d, rank_multiple_of);
  DION_DEFAULT_IF_UNSET(o, d, power_iters);
  DION_DEFAULT_IF_UNSET(o, d, qr_method);
  DION_DEFAULT_IF_UNSET(o, d, cqr_warmup_steps);
  DION_DEFAULT_IF_UNSET(o, d, orthogonalizer);
  DION_DEFAULT_IF_UNSET(o, d, ortho_steps);
  DION_DEFAULT_IF_UNSET(o, d, nesterov);
  DION_DEFAULT_IF_UNSET(o, d, adjust_lr);
  DION_DEFAULT_IF_UNSET(o, d, cautious_wd);
  DION_DEFAULT_IF_UNSET(o, d, selection_scope);
  DION_DEFAULT_IF_UNSET(o, d, flatten);
  DION_DEFAULT_IF_UNSET(o, d, matmul_precision);
  if (o.momentum_dtype == DION_UNSET_INT) o.momentum_dtype = DION_DTYPE_UNSET;
  if (o.q_dtype == DION_UNSET_INT) o.q_dtype = DION_DTYPE_UNSET;
  if (o.variance_dtype == DION_UNSET_INT) o.variance_dtype = DION_DTYPE_UNSET;
}

void validate_hparam(dion_hparam_t hp, double v, const char* fn) {
  const char* names[] = {"lr", "weight_decay", "mu", "beta1", "beta2", "epsilon", "ef_decay", "muon_beta2"};
  if (hp < DION_HPARAM_LR || hp > DION_HPARAM_MUON_BETA2)
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: hparam = %d is not a known hyperparameter", fn, hp);
  bool unit = hp == DION_HPARAM_BETA1 || hp == DION_HPARAM_BETA2 || hp == DION_HPARAM_MUON_BETA2;
  if (!std::isfinite(v) || v < 0 || (unit && v > 1))
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: %s = %g is out of range %s", fn, names[hp], v, unit ? "[0, 1]" : "[0, inf)");
}

double* hparam_field(dion_group_options_t& o, dion_hparam_t hp) {
  switch (hp) {
    case DION_HPARAM_LR: return &o.lr;
    case DION_HPARAM_WEIGHT_DECAY: return &o.weight_decay;
    case DION_HPARAM_MU: return &o.mu;
    case DION_HPARAM_BETA1: return &o.beta1;
    case DION_HPARAM_BETA2: return &o.beta2;
    case DION_HPARAM_EPSILON: return &o.epsilon;
    case DION_HPARAM_EF_DECAY: return &o.ef_decay;
    case DION_HPARAM_MUON_BETA2: return &o.muon_beta2;
    default: return nullptr;
  }
}

Group& group_at(Optimizer& o, int32_t g, const char* fn) {
  if (g < 0 || static_cast<size_t>(g) >= o.groups.size())
    fail(DION_ERROR_INVALID_USAGE, "%s: group = %d is not a group of this optimizer (it has %zu)", fn, g, o.groups.size());
  return o.groups[static_cast<size_t>(g)];
}

StateBuf& state_at(Optimizer& o, int32_t i, const char* fn) {
  if (i < 0 || static_cast<size_t>(i) >= o.states.size())
    fail(DION_ERROR_INVALID_ARGUMENT, "%s: index = %d is not a state of this optimizer (it has %zu)", fn, i,
         o.states.size());
  return o.states[static_cast<size_t>(i)];
}

}  // namespace

namespace {
// The caller's stream for the duration of one API call only: the backend
// never keeps a stream the caller might destroy afterwards.
class StreamScope {
 public:
  // The mesh collectives (NCCL) are enqueued on the same stream as the
  // backend's work, so they are ordered with it and with the caller's work.
  StreamScope(Optimizer& o, dion_stream_t s) : o_(o) { set(s); }
  ~StreamScope() {
    try {
      set(nullptr);
    } catch (...) {
    }
  }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  void set(dion_stream_t s) {
    o_.backend->set_stream(s);
    for (Collectives* c : o_.meshes())
      if (c) c->set_stream(o_.backend->stream());
  }
  Optimizer& o_;
};
}  // namespace

extern "C" {

DION_API int32_t dion_version(void) { return DION_VERSION_CODE; }

DION_API const char* dion_status_string(dion_status_t s) {
  switch (s) {
    case DION_SUCCESS: return "success";
    case DION_ERROR_INVALID_ARGUMENT: return "invalid argument (dion_last_error() names it; set DION_DEBUG=WARN for a log)";
    case DION_ERROR_INVALID_USAGE: return "invalid usage (dion_last_error() says what; set DION_DEBUG=WARN for a log)";
    case DION_ERROR_NOT_SUPPORTED: return "not supported by this build or backend (see dion_last_error())";
    case DION_ERROR_OUT_OF_MEMORY: return "out of memory";
    case DION_ERROR_CUDA: return "CUDA error (see dion_last_error(); set DION_DEBUG=WARN for details)";
    case DION_ERROR_CUBLAS: return "cuBLAS error (see dion_last_error(); set DION_DEBUG=WARN for details)";
    case DION_ERROR_CUSOLVER: return "cuSOLVER error (see dion_last_error(); set DION_DEBUG=WARN for details)";
    case DION_ERROR_NCCL: return "NCCL error (see dion_last_error(); NCCL_DEBUG=WARN gives NCCL's own log)";
    case DION_ERROR_MPI: return "MPI error (see dion_last_error(); set DION_DEBUG=WARN for details)";
    case DION_ERROR_NUMERICAL: return "numerical error";
    case DION_ERROR_INTERNAL: return "internal error in libdion (please report it with DION_DEBUG=INFO output)";
    default: return "unknown status";
  }
}

DION_API dion_status_t dion_options_init(dion_options_t* o) {
  if (!o) {
    thread_last_error() = "dion_options_init: options is NULL";
    return DION_ERROR_INVALID_ARGUMENT;
  }
  std::memset(o, 0, sizeof(*o));
  o->struct_size = sizeof(*o);
  o->abi_version = DION_ABI_VERSION;
  o->backend = DION_BACKEND_HOST;
  o->device = 0;
  o->replicate_grad_sync = 1;
  o->skip_nonfinite = 1;
  o->seed = 0;
  return DION_SUCCESS;
}
DION_API size_t dion_options_sizeof(void) { return sizeof(dion_options_t); }

DION_API dion_status_t dion_tensor_init(dion_tensor_t* t) {
  if (!t) {
    thread_last_error() = "dion_tensor_init: tensor is NULL";
    return DION_ERROR_INVALID_ARGUMENT;
  }
  std::memset(t, 0, sizeof(*t));
  t->struct_size = sizeof(*t);
  t->param_dtype = DION_DTYPE_FP32;
  t->grad_dtype = DION_DTYPE_UNSET;
  t->layout = DION_LAYOUT_ROW_MAJOR;
  t->outer_shard_dim = -1;
  t->inner_shard_dim = -1;
  return DION_SUCCESS;
}
DION_API size_t dion_tensor_sizeof(void) { return sizeof(dion_tensor_t); }

DION_API dion_status_t dion_group_options_init(dion_group_options_t* o, dion_algorithm_t algorithm) {
  return api_call(nullptr, [&] {
    if (!o) fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_options_init: options is NULL");
    if (algorithm < DION_ALGO_DION || algorithm > DION_ALGO_LION)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_options_init: algorithm = %d is not a known algorithm", algorithm);
    std::memset(o, 0, sizeof(*o));
    o->struct_size = sizeof(*o);
    o->abi_version = DION_ABI_VERSION;
    o->algorithm = algorithm;
    o->lr = 0.01;
    o->weight_decay = 0.01;
    o->mu = 0.95;
    o->beta1 = 0.9;
    o->beta2 = 0.95;
    o->epsilon = 1e-8;
    o->rank_fraction = 1.0;
    o->rank_multiple_of = 1;
    o->power_iters = 1;
    o->qr_method = DION_QR_RCQR;
    o->cqr_warmup_steps = 150;
    o->oversample = 1.25;
    o->orthogonalizer = DION_ORTHO_POLAR_EXPRESS;
    o->ortho_steps = 5;
    o->nesterov = 0;
    o->adjust_lr = DION_ADJUST_LR_SPECTRAL_NORM;
    o->cautious_wd = 0;
    o->fraction = 0.25;
    o->ef_decay = 0.95;
    o->selection_scope = DION_SELECTION_LOCAL;
    o->muon_beta2 = 0.95;
    o->flatten = 0;
    o->momentum_dtype = DION_DTYPE_UNSET;
    o->q_dtype = DION_DTYPE_UNSET;
    o->variance_dtype = DION_DTYPE_UNSET;
    o->matmul_precision = DION_MATMUL_FP32;
  });
}
DION_API size_t dion_group_options_sizeof(void) { return sizeof(dion_group_options_t); }

DION_API dion_status_t dion_create(dion_optimizer_t* out, const dion_options_t* options) {
  return api_call(nullptr, [&] {
    if (!out) fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: optimizer is NULL");
    *out = nullptr;
    dion_options_t o;
    dion_options_init(&o);
    if (options) copy_versioned(o, options, "dion_create", "options");
    apply_unset_defaults(o);
    if (o.backend != DION_BACKEND_HOST && o.backend != DION_BACKEND_CUDA)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->backend = %d is not a known backend", o.backend);
    if (o.replicate_grad_sync != 0 && o.replicate_grad_sync != 1)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->replicate_grad_sync = %d must be 0 or 1", o.replicate_grad_sync);
    if (o.skip_nonfinite != 0 && o.skip_nonfinite != 1)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->skip_nonfinite = %d must be 0 or 1", o.skip_nonfinite);
    if (o.reserved0 != 0) fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->reserved0 must be 0");
    const dion_comm_t comms[3] = {o.replicate_comm, o.outer_comm, o.inner_comm};
    const char* names[3] = {"replicate_comm", "outer_comm", "inner_comm"};
    for (int i = 0; i < 3; ++i) {
      if (!comms[i]) continue;
      if (comms[i]->magic != kCommMagic)
        fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->%s is not a valid dion_comm_t", names[i]);
      for (int j = 0; j < i; ++j)
        if (comms[j] == comms[i])
          fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->%s and options->%s are the same communicator",
               names[j], names[i]);
      // Multi-rank meshes: MPI carries host buffers, NCCL device buffers.
      const bool mpi = comms[i]->kind == CommKind::kMpi;
      const bool mesh_ok = o.backend == DION_BACKEND_HOST ? mpi : !mpi;
      if (comms[i]->size > 1 && !mesh_ok)
        fail(DION_ERROR_INVALID_ARGUMENT,
             "dion_create: options->%s has %d ranks over %s, which cannot carry the %s backend's buffers (the host "
             "backend needs an MPI communicator, the CUDA backend an NCCL one)",
             names[i], comms[i]->size, mpi ? "MPI" : "NCCL", o.backend == DION_BACKEND_HOST ? "host" : "CUDA");
    }
    auto opt = std::make_unique<Optimizer>();
    opt->options = o;
    if (o.backend == DION_BACKEND_CUDA) {
#if DION_WITH_CUDA
      if (o.device < 0) fail(DION_ERROR_INVALID_ARGUMENT, "dion_create: options->device = %d is negative", o.device);
      try {
        opt->backend.reset(make_cuda_backend(o.device));
      } catch (const Error& e) {
        throw Error(e.status(), format("dion_create: %s", e.what()));
      }
#else
      fail(DION_ERROR_NOT_SUPPORTED, "dion_create: this libdion was built without CUDA (use DION_BACKEND_HOST)");
#endif
    } else {
      opt->backend.reset(make_host_backend());
    }
    opt->init();
    if (o.replicate_comm && o.replicate_comm->size > 1) opt->rep = make_collectives(o.replicate_comm, "replicate");
    if (o.outer_comm && o.outer_comm->size > 1) opt->outer = make_collectives(o.outer_comm, "outer");
    if (o.inner_comm && o.inner_comm->size > 1) opt->inner = make_collectives(o.inner_comm, "inner");
    // Blocking waits on the device must not hang on a dead peer's NCCL kernels.
    if (o.backend == DION_BACKEND_CUDA && opt->has_meshes()) {
      opt->wait_guard.opt = opt.get();
      opt->wait_guard.timeout_s = comm_timeout_s();
      opt->backend->set_wait_guard(&opt->wait_guard);
    }
    int32_t max_mesh = 1;
    for (dion_comm_t c : comms)
      if (c) max_mesh = std::max(max_mesh, c->size);
    opt->coll_idx.reserve(4 * static_cast<size_t>(max_mesh));
    DION_LOG_INFO("INIT", "created optimizer (%s backend, seed %llu)", o.backend == DION_BACKEND_CUDA ? "CUDA" : "host",
                  static_cast<unsigned long long>(o.seed));
    *out = reinterpret_cast<dion_optimizer_t>(opt.release());
  });
}

DION_API dion_status_t dion_destroy(dion_optimizer_t h) {
  if (!h) return DION_SUCCESS;
  return api_call(nullptr, [&] {
    Optimizer* o = check_handle(h, "dion_destroy");
    delete o;
  });
}

DION_API const char* dion_last_error(dion_optimizer_t h) {
  if (!h) return thread_last_error().c_str();
  auto* o = reinterpret_cast<Optimizer*>(h);
  if (o->magic_head != kMagicHead || o->magic_tail != kMagicTail) {
    thread_last_error() = "dion_last_error: optimizer is not a valid dion_optimizer_t";
    return thread_last_error().c_str();
  }
  return o->last_error.c_str();
}

DION_API dion_status_t dion_add_group(dion_optimizer_t h, const dion_group_options_t* options,
                                      const dion_tensor_t* tensors, size_t count, int32_t* group_index) {
  return handle_call(h, "dion_add_group", [&](Optimizer& o) {
    if (!options) fail(DION_ERROR_INVALID_ARGUMENT, "dion_add_group: options is NULL");
    dion_group_options_t go;
    dion_group_options_init(&go, DION_ALGO_DION);
    copy_versioned(go, options, "dion_add_group", "options");
    apply_unset_defaults(go);
    o.add_group(go, tensors, count, group_index);
  });
}

DION_API dion_status_t dion_group_count(dion_optimizer_t h, int32_t* count) {
  return handle_call(h, "dion_group_count", [&](Optimizer& o) {
    if (!count) fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_count: count is NULL");
    *count = static_cast<int32_t>(o.groups.size());
  });
}

DION_API dion_status_t dion_tensor_count(dion_optimizer_t h, int32_t* count) {
  return handle_call(h, "dion_tensor_count", [&](Optimizer& o) {
    if (!count) fail(DION_ERROR_INVALID_ARGUMENT, "dion_tensor_count: count is NULL");
    *count = static_cast<int32_t>(o.tensors.size());
  });
}

DION_API dion_status_t dion_group_set_hparam(dion_optimizer_t h, int32_t group, dion_hparam_t hp, double value) {
  return handle_call(h, "dion_group_set_hparam", [&](Optimizer& o) {
    Group& g = group_at(o, group, "dion_group_set_hparam");
    validate_hparam(hp, value, "dion_group_set_hparam");
    *hparam_field(g.opt, hp) = value;
    // lr, weight_decay and the betas live in backend memory too, where a
    // replayed CUDA graph reads them.
    o.upload_scalars(g);
  });
}

DION_API dion_status_t dion_group_get_hparam(dion_optimizer_t h, int32_t group, dion_hparam_t hp, double* value) {
  return handle_call(h, "dion_group_get_hparam", [&](Optimizer& o) {
    Group& g = group_at(o, group, "dion_group_get_hparam");
    if (!value) fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_get_hparam: value is NULL");
    double* f = hparam_field(g.opt, hp);
    if (!f) fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_get_hparam: hparam = %d is not a known hyperparameter", hp);
    *value = *f;
  });
}

DION_API dion_status_t dion_group_get_step(dion_optimizer_t h, int32_t group, int64_t* step) {
  return handle_call(h, "dion_group_get_step", [&](Optimizer& o) {
    Group& g = group_at(o, group, "dion_group_get_step");
    if (!step) fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_get_step: step is NULL");
    *step = o.read_step(g);
  });
}

DION_API dion_status_t dion_group_set_step(dion_optimizer_t h, int32_t group, int64_t step) {
  return handle_call(h, "dion_group_set_step", [&](Optimizer& o) {
    Group& g = group_at(o, group, "dion_group_set_step");
    // 2^53: the counter must be able to advance without overflow and stays
    // exact in the double arithmetic of the bias corrections.
    if (step < 0 || step > (int64_t(1) << 53))
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_group_set_step: step = %lld is out of range [0, 2^53]",
           static_cast<long long>(step));
    o.write_step(g, step);
  });
}

DION_API dion_status_t dion_tensor_rebind(dion_optimizer_t h, int32_t tensor, void* param, const void* grad) {
  return handle_call(h, "dion_tensor_rebind", [&](Optimizer& o) {
    if (tensor < 0 || static_cast<size_t>(tensor) >= o.tensors.size())
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_tensor_rebind: tensor = %d is not a tensor of this optimizer (it has %zu)",
           tensor, o.tensors.size());
    Tensor& t = o.tensors[static_cast<size_t>(tensor)];
    if (!param && t.numel_local > 0)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_tensor_rebind: tensor '%s': param is NULL", t.name.c_str());
    o.check_tensor_buffers(param, grad, t.numel_local, t.param_dtype, t.grad_dtype,
                           format("dion_tensor_rebind: tensor '%s' (tensor %d)", t.name.c_str(), tensor));
    t.param = param;
    t.grad = grad;
  });
}

DION_API dion_status_t dion_step(dion_optimizer_t h, dion_stream_t stream) {
  // Host backend: the step completes before returning. CUDA: it is enqueued
  // on `stream` and this returns without waiting.
  return handle_call(h, "dion_step", [&](Optimizer& o) {
    StreamScope ss(o, stream);
    o.step();
    o.backend->end_step();
  });
}

DION_API dion_status_t dion_sync_for_checkpoint(dion_optimizer_t h, dion_stream_t stream) {
  // Without a multi-rank replicate mesh every state is already the replica's
  // only copy: averaging over one rank is the identity.
  return handle_call(h, "dion_sync_for_checkpoint", [&](Optimizer& o) {
    StreamScope ss(o, stream);
    o.sync_states();
    o.backend->end_step();
  });
}

DION_API dion_status_t dion_get_skipped_steps(dion_optimizer_t h, int64_t* skipped, int32_t* last_skipped,
                                              dion_stream_t stream) {
  return handle_call(h, "dion_get_skipped_steps", [&](Optimizer& o) {
    if (!skipped && !last_skipped)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_get_skipped_steps: skipped and last_skipped are both NULL");
    StreamScope ss(o, stream);
    const StepStatus st = o.read_status();
    if (skipped) *skipped = st.skipped_steps;
    if (last_skipped) *last_skipped = st.skip;
  });
}

DION_API dion_status_t dion_get_async_error(dion_optimizer_t h, dion_status_t* status) {
  return handle_call(h, "dion_get_async_error", [&](Optimizer&) {
    if (!status) fail(DION_ERROR_INVALID_ARGUMENT, "dion_get_async_error: status is NULL");
    *status = DION_SUCCESS;  // the host backend reports every error synchronously
  });
}

DION_API dion_status_t dion_get_comm_bytes(dion_optimizer_t h, dion_mesh_t mesh, uint64_t* last_step,
                                           uint64_t* total) {
  return handle_call(h, "dion_get_comm_bytes", [&](Optimizer& o) {
    if (mesh < DION_MESH_REPLICATE || mesh > DION_MESH_INNER)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_get_comm_bytes: mesh = %d is not a known mesh", mesh);
    if (!last_step && !total) fail(DION_ERROR_INVALID_ARGUMENT, "dion_get_comm_bytes: last_step and total are both NULL");
    // Bytes this rank handed to the mesh's collectives; single-rank meshes move nothing.
    const Collectives* c = mesh == DION_MESH_REPLICATE ? o.rep.get()
                           : mesh == DION_MESH_OUTER   ? o.outer.get()
                                                       : o.inner.get();
    if (last_step) *last_step = c ? static_cast<uint64_t>(c->bytes_last_step()) : 0;
    if (total) *total = c ? static_cast<uint64_t>(c->bytes_total()) : 0;
  });
}

DION_API dion_status_t dion_get_memory_usage(dion_optimizer_t h, uint64_t* state_bytes, uint64_t* workspace_bytes) {
  return handle_call(h, "dion_get_memory_usage", [&](Optimizer& o) {
    if (!state_bytes && !workspace_bytes)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_get_memory_usage: state_bytes and workspace_bytes are both NULL");
    uint64_t s = 0;
    for (const StateBuf& b : o.states) s += b.bytes();
    if (state_bytes) *state_bytes = s;
    if (workspace_bytes) *workspace_bytes = o.ws.capacity_bytes() + o.table_bytes + o.backend->scratch_bytes();
  });
}

DION_API dion_status_t dion_state_count(dion_optimizer_t h, int32_t* count) {
  return handle_call(h, "dion_state_count", [&](Optimizer& o) {
    if (!count) fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_count: count is NULL");
    *count = static_cast<int32_t>(o.states.size());
  });
}

DION_API dion_status_t dion_state_info(dion_optimizer_t h, int32_t index, dion_state_info_t* info) {
  return handle_call(h, "dion_state_info", [&](Optimizer& o) {
    if (!info) fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_info: info is NULL");
    if (info->struct_size < offsetof(dion_state_info_t, local_bytes) + sizeof(uint64_t) ||
        info->struct_size > 65536)
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_info: info->struct_size = %zu is not valid (expected %zu)",
           info->struct_size, sizeof(dion_state_info_t));
    StateBuf& s = state_at(o, index, "dion_state_info");
    dion_state_info_t r;
    std::memset(&r, 0, sizeof(r));
    r.struct_size = sizeof(r) < info->struct_size ? sizeof(r) : info->struct_size;
    r.tensor = s.tensor;
    r.group = s.group;
    r.name = s.name.c_str();
    r.dtype = s.dtype;
    r.layout = s.layout;
    r.ndim = s.ndim;
    for (int d = 0; d < DION_MAX_DIMS; ++d) {
      r.global_shape[d] = s.global_shape[d];
      r.local_shape[d] = s.local_shape[d];
      r.local_offset[d] = s.local_offset[d];
    }
    r.local_bytes = s.bytes();
    std::memcpy(info, &r, r.struct_size);
  });
}

DION_API dion_status_t dion_state_find(dion_optimizer_t h, int32_t tensor, const char* name, int32_t* index) {
  return handle_call(h, "dion_state_find", [&](Optimizer& o) {
    if (!name) fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_find: name is NULL");
    if (!index) fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_find: index is NULL");
    if (tensor < 0 || static_cast<size_t>(tensor) >= o.tensors.size())
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_find: tensor = %d is not a tensor of this optimizer (it has %zu)",
           tensor, o.tensors.size());
    const Tensor& t = o.tensors[static_cast<size_t>(tensor)];
    for (int32_t si : t.states)
      if (o.states[static_cast<size_t>(si)].name == name) {
        *index = si;
        return;
      }
    fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_find: tensor '%s' (tensor %d) has no state named '%s'", t.name.c_str(),
         tensor, name);
  });
}

DION_API dion_status_t dion_state_read(dion_optimizer_t h, int32_t index, void* dst, uint64_t bytes,
                                       dion_stream_t stream) {
  return handle_call(h, "dion_state_read", [&](Optimizer& o) {
    StateBuf& s = state_at(o, index, "dion_state_read");
    if (!dst && s.bytes() > 0) fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_read: dst is NULL");
    if (bytes < s.bytes())
      fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_read: bytes = %llu is smaller than state '%s' of tensor %d (%zu bytes)",
           static_cast<unsigned long long>(bytes), s.name.c_str(), s.tensor, s.bytes());
    StreamScope ss(o, stream);
    if (s.bytes()) o.backend->copy_sync(dst, s.data, s.bytes());
  });
}

DION_API dion_status_t dion_state_write(dion_optimizer_t h, int32_t index, const void* src, uint64_t bytes,
                                        dion_stream_t stream) {
  return handle_call(h, "dion_state_write", [&](Optimizer& o) {
    StateBuf& s = state_at(o, index, "dion_state_write");
    if (!src && s.bytes() > 0) fail(DION_ERROR_INVALID_ARGUMENT, "dion_state_write: src is NULL");
    if (bytes < s.bytes())
      fail(DION_ERROR_INVALID_ARGUMENT,
           "dion_state_write: bytes = %llu is smaller than state '%s' of tensor %d (%zu bytes)",
           static_cast<unsigned long long>(bytes), s.name.c_str(), s.tensor, s.bytes());
    StreamScope ss(o, stream);
    if (s.bytes()) o.backend->copy_sync(s.data, src, s.bytes());
  });
}

}  // extern "C"
