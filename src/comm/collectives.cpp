// SPDX-License-Identifier: MIT
// The transport-independent half of dion::Collectives: argument checks, the
// aborted-communicator guard, byte counters, and the factory.
#include "collectives.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>

namespace dion {

#if DION_WITH_MPI
// mpi_collectives.cpp
std::unique_ptr<Collectives> make_mpi_collectives(dion_comm_t comm, const char* mesh_name);
#endif
#if DION_WITH_NCCL
// nccl_collectives.cpp
std::unique_ptr<Collectives> make_nccl_collectives(dion_comm_t comm, const char* mesh_name);
#endif

const char* coll_kind_name(CollKind k) {
  switch (k) {
    case CollKind::kAllReduce: return "all_reduce";
    case CollKind::kReduceScatter: return "reduce_scatter";
    case CollKind::kAllGather: return "all_gather";
    case CollKind::kAllToAll: return "all_to_all";
    case CollKind::kBroadcast: return "broadcast";
    default: return "?";
  }
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    default: return "?";
  }
}

Collectives::Collectives(dion_comm_t comm, std::string mesh)
    : comm_(comm), mesh_(std::move(mesh)), size_(comm->size), rank_(comm->rank) {}

dion_status_t Collectives::transport_status() const {
  return comm_->kind == CommKind::kMpi ? DION_ERROR_MPI : DION_ERROR_NCCL;
}

void Collectives::fail_coll(dion_status_t status, const char* what, const std::string& message) const {
  throw Error(status, format("%s mesh: %s: %s", mesh_.c_str(), what, message.c_str()));
}

// Checked before anything else so that an aborted mesh fails fast on every
// rank (each rank's flag is set by its own dion_comm_abort) instead of
// entering a collective that a dead peer will never join.
void Collectives::check_usable(const char* what) const {
  if (comm_->aborted.load(std::memory_order_acquire))
    fail_coll(transport_status(), what,
              "the communicator was aborted (dion_comm_abort); no communication was attempted");
}

double comm_timeout_s() {
  const char* v = std::getenv("DION_COMM_TIMEOUT");
  if (!v || !*v) return 600.0;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  return end && *end == '\0' ? t : 600.0;
}

void Collectives::abort_comm() { comm_->aborted.store(true, std::memory_order_release); }

void Collectives::count(CollKind k, uint64_t bytes) {
  step_[static_cast<int>(k)] += bytes;
  total_[static_cast<int>(k)] += bytes;
}

namespace {

// Misuse by the algorithms, not by the library's caller: INTERNAL.
void check_count(const Collectives& c, const char* what, const char* name, int64_t v) {
  if (v < 0)
    throw Error(DION_ERROR_INTERNAL,
                format("%s mesh: %s: %s = %lld is negative", c.mesh().c_str(), what, name, static_cast<long long>(v)));
}

void check_ptr(const Collectives& c, const char* what, const char* name, const void* p, int64_t n) {
  if (n > 0 && p == nullptr)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: %s is NULL with %lld elements", c.mesh().c_str(), what, name,
                                            static_cast<long long>(n)));
}

// size * block must fit: the send (reduce_scatter) or receive (all_gather)
// buffer spans it.
void check_blocks(const Collectives& c, const char* what, int64_t block) {
  if (block > std::numeric_limits<int64_t>::max() / c.size())
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: %d blocks of %lld elements overflow int64", c.mesh().c_str(),
                                            what, c.size(), static_cast<long long>(block)));
}

void check_vector(const Collectives& c, const char* what, const char* cname, const int64_t* counts,
                  const char* dname, const int64_t* displs) {
  if (!counts || !displs)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: %s is NULL", c.mesh().c_str(), what, counts ? dname : cname));
  for (int32_t r = 0; r < c.size(); ++r) {
    check_count(c, what, cname, counts[r]);
    check_count(c, what, dname, displs[r]);
  }
}

// Whether na and nb elements of `elem` bytes at a and b overlap (floats
// unless said otherwise).
bool overlap(const void* a, int64_t na, const void* b, int64_t nb, size_t elem = sizeof(float)) {
  if (na == 0 || nb == 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(nb) * elem && pb < pa + static_cast<uintptr_t>(na) * elem;
}

}  // namespace

// A hook that throws leaves the join undone: the step fails, and
// Optimizer::step joins the streams itself on its way out.
template <class F>
void Collectives::joined(F&& hook) {
  if (join_) join_->before();
  hook();
  if (join_) join_->after();
}

// The checks every all_reduce takes: a usable communicator, n >= 0 and a
// buffer where n > 0.
void Collectives::check_all_reduce(const char* what, const void* buf, int64_t n) const {
  check_usable(what);
  check_count(*this, what, "n", n);
  check_ptr(*this, what, "buf", buf, n);
}

void Collectives::all_reduce(float* buf, int64_t n, ReduceOp op) {
  const char* what = "all_reduce";
  check_all_reduce(what, buf, n);
  if (n == 0) return;  // n agrees across ranks: every rank returns here
  joined([&] { do_all_reduce(buf, n, op); });
  count(CollKind::kAllReduce, static_cast<uint64_t>(n) * sizeof(float));
}

void Collectives::all_reduce(int32_t* buf, int64_t n, ReduceOp op) { all_reduce_int(buf, n, op, false); }

void Collectives::all_reduce(double* buf, int64_t n, ReduceOp op) {
  const char* what = "all_reduce(double)";
  check_all_reduce(what, buf, n);
  if (op == ReduceOp::kAvg)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: sum or max only, not avg", mesh_.c_str(), what));
  if (n == 0) return;
  joined([&] { do_all_reduce(buf, n, op); });
  count(CollKind::kAllReduce, static_cast<uint64_t>(n) * sizeof(double));
}

void Collectives::all_reduce_host(int32_t* buf, int64_t n, ReduceOp op) { all_reduce_int(buf, n, op, true); }

void Collectives::all_reduce_int(int32_t* buf, int64_t n, ReduceOp op, bool host) {
  const char* what = host ? "all_reduce(int32, host)" : "all_reduce(int32)";
  check_all_reduce(what, buf, n);
  if (op == ReduceOp::kAvg)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: avg is not defined on integers", mesh_.c_str(), what));
  if (n == 0) return;
  if (host)
    do_all_reduce_host(buf, n, op);
  else
    joined([&] { do_all_reduce(buf, n, op); });
  count(CollKind::kAllReduce, static_cast<uint64_t>(n) * sizeof(int32_t));
}

int64_t Collectives::check_reduce_scatter(const char* what, const void* send, const void* recv, int64_t block,
                                          size_t elem) const {
  check_usable(what);
  check_count(*this, what, "block", block);
  check_blocks(*this, what, block);
  const int64_t total = block * size_;
  check_ptr(*this, what, "send", send, total);
  check_ptr(*this, what, "recv", recv, block);
  if (overlap(send, total, recv, block, elem))
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: send and recv overlap", mesh_.c_str(), what));
  return total;
}

void Collectives::reduce_scatter(const float* send, float* recv, int64_t block, ReduceOp op) {
  const int64_t total = check_reduce_scatter("reduce_scatter", send, recv, block, sizeof(float));
  if (block == 0) return;
  joined([&] { do_reduce_scatter(send, recv, block, op); });
  count(CollKind::kReduceScatter, static_cast<uint64_t>(total) * sizeof(float));
}

void Collectives::all_reduce_bf16(uint16_t* buf, int64_t n, ReduceOp op) {
  const char* what = "all_reduce(bf16)";
  check_all_reduce(what, buf, n);
  if (op == ReduceOp::kMax) throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: sum or avg only", mesh_.c_str(), what));
  if (n == 0) return;
  joined([&] { do_all_reduce_bf16(buf, n, op); });
  count(CollKind::kAllReduce, static_cast<uint64_t>(n) * sizeof(uint16_t));
}

void Collectives::reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, int64_t block, ReduceOp op) {
  const int64_t total = check_reduce_scatter("reduce_scatter(bf16)", send, recv, block, sizeof(uint16_t));
  if (block == 0) return;
  joined([&] { do_reduce_scatter_bf16(send, recv, block, op); });
  count(CollKind::kReduceScatter, static_cast<uint64_t>(total) * sizeof(uint16_t));
}

void Collectives::do_all_reduce_bf16(uint16_t*, int64_t, ReduceOp) {
  throw Error(DION_ERROR_INTERNAL, format("%s mesh: all_reduce(bf16): this transport has no bf16 arithmetic", mesh_.c_str()));
}

void Collectives::do_reduce_scatter_bf16(const uint16_t*, uint16_t*, int64_t, ReduceOp) {
  throw Error(DION_ERROR_INTERNAL,
              format("%s mesh: reduce_scatter(bf16): this transport has no bf16 arithmetic", mesh_.c_str()));
}

void Collectives::all_gather(const float* send, float* recv, int64_t block) {
  const char* what = "all_gather";
  check_usable(what);
  check_count(*this, what, "block", block);
  check_blocks(*this, what, block);
  check_ptr(*this, what, "send", send, block);
  check_ptr(*this, what, "recv", recv, block * size_);
  if (send != recv + block * rank_ && overlap(send, block, recv, block * size_))
    throw Error(DION_ERROR_INTERNAL,
                format("%s mesh: %s: send overlaps recv without being this rank's block", mesh_.c_str(), what));
  if (block == 0) return;
  joined([&] { do_all_gather(send, recv, block); });
  count(CollKind::kAllGather, static_cast<uint64_t>(block) * sizeof(float));
}

void Collectives::all_gather_v(const float* send, float* recv, const int64_t* counts, const int64_t* displs) {
  const char* what = "all_gather_v";
  check_usable(what);
  check_vector(*this, what, "counts", counts, "displs", displs);
  int64_t extent = 0;  // the receive buffer must span every rank's block
  for (int32_t r = 0; r < size_; ++r)
    if (counts[r] > 0) extent = std::max(extent, displs[r] + counts[r]);
  check_ptr(*this, what, "send", send, counts[rank_]);
  check_ptr(*this, what, "recv", recv, extent);
  // No early return when this rank's count is 0: others may still send to it.
  joined([&] { do_all_gather_v(send, recv, counts, displs); });
  count(CollKind::kAllGather, static_cast<uint64_t>(counts[rank_]) * sizeof(float));
}

void Collectives::all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs, float* recv,
                               const int64_t* recv_counts, const int64_t* recv_displs) {
  const char* what = "all_to_all_v";
  check_usable(what);
  check_vector(*this, what, "send_counts", send_counts, "send_displs", send_displs);
  check_vector(*this, what, "recv_counts", recv_counts, "recv_displs", recv_displs);
  int64_t sent = 0, send_extent = 0, recv_extent = 0;
  for (int32_t r = 0; r < size_; ++r) {
    sent += send_counts[r];
    if (send_counts[r] > 0) send_extent = std::max(send_extent, send_displs[r] + send_counts[r]);
    if (recv_counts[r] > 0) recv_extent = std::max(recv_extent, recv_displs[r] + recv_counts[r]);
  }
  check_ptr(*this, what, "send", send, send_extent);
  check_ptr(*this, what, "recv", recv, recv_extent);
  if (overlap(send, send_extent, recv, recv_extent))
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: send and recv overlap", mesh_.c_str(), what));
  joined([&] { do_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs); });
  count(CollKind::kAllToAll, static_cast<uint64_t>(sent) * sizeof(float));
}

void Collectives::broadcast(float* buf, int64_t n, int32_t root) {
  const char* what = "broadcast";
  check_usable(what);
  check_count(*this, what, "n", n);
  check_ptr(*this, what, "buf", buf, n);
  if (root < 0 || root >= size_)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: %s: root %d is not in [0, %d)", mesh_.c_str(), what, root, size_));
  if (n == 0) return;
  joined([&] { do_broadcast(buf, n, root); });
  count(CollKind::kBroadcast, rank_ == root ? static_cast<uint64_t>(n) * sizeof(float) : 0);
}

void Collectives::reset_step() {
  for (auto& b : step_) b = 0;
}

uint64_t Collectives::bytes_last_step(CollKind k) const { return step_[static_cast<int>(k)]; }
uint64_t Collectives::bytes_total(CollKind k) const { return total_[static_cast<int>(k)]; }

uint64_t Collectives::bytes_last_step() const {
  uint64_t s = 0;
  for (auto b : step_) s += b;
  return s;
}

uint64_t Collectives::bytes_total() const {
  uint64_t s = 0;
  for (auto b : total_) s += b;
  return s;
}

std::unique_ptr<Collectives> make_collectives(dion_comm_t comm, const char* mesh_name) {
  const char* mesh = mesh_name ? mesh_name : "?";
  if (!comm || comm->magic != kCommMagic)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: make_collectives: not a valid dion_comm_t", mesh));
  switch (comm->kind) {
    case CommKind::kMpi:
#if DION_WITH_MPI
      return make_mpi_collectives(comm, mesh);
#else
      throw Error(DION_ERROR_NOT_SUPPORTED, format("%s mesh: this libdion was built without MPI", mesh));
#endif
    case CommKind::kNcclOwned:
    case CommKind::kNcclAdopted:
#if DION_WITH_NCCL
      return make_nccl_collectives(comm, mesh);
#else
      throw Error(DION_ERROR_NOT_SUPPORTED, format("%s mesh: this libdion was built without NCCL", mesh));
#endif
  }
  throw Error(DION_ERROR_INTERNAL, format("%s mesh: make_collectives: unknown communicator kind %d", mesh,
                                          static_cast<int>(comm->kind)));
}

}  // namespace dion
