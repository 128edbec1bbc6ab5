// SPDX-License-Identifier: MIT
// The MPI transport of dion::Collectives (host backend): host fp32/int32
// buffers, one MPI collective per call, errors returned rather than fatal.
#if DION_WITH_MPI
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "collectives.hpp"

namespace dion {

namespace {

class MpiCollectives final : public Collectives {
 public:
  MpiCollectives(dion_comm_t comm, const char* mesh) : Collectives(comm, mesh) {
    const char* what = "create";
    require_mpi_running(what);
    // A private duplicate: the library's collectives get their own context
    // (they cannot match messages of another optimizer sharing the
    // dion_comm_t), and MPI_ERRORS_RETURN is set on a communicator this object
    // owns, whoever created the dion_comm_t.
    check(MPI_Comm_dup(*static_cast<MPI_Comm*>(comm->handle), &mc_), what, "MPI_Comm_dup");
    int e = MPI_Comm_set_errhandler(mc_, MPI_ERRORS_RETURN);
    if (e != MPI_SUCCESS) {
      MPI_Comm_free(&mc_);
      check(e, what, "MPI_Comm_set_errhandler");
    }
  }

  ~MpiCollectives() override {
    // After MPI_Finalize no MPI call is allowed; the communicator is gone anyway.
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && mc_ != MPI_COMM_NULL) MPI_Comm_free(&mc_);
  }

 protected:
  void do_all_reduce(float* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce";
    require_mpi_running(what);
    int cnt = to_int(n, what, "n");
    run(MPI_Iallreduce(MPI_IN_PLACE, buf, cnt, MPI_FLOAT, mpi_op(op), mc_, &req_), what, "MPI_Iallreduce");
    if (op == ReduceOp::kAvg) divide(buf, n);
  }

  void do_all_reduce(int32_t* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce(int32)";
    require_mpi_running(what);
    static_assert(sizeof(int) == sizeof(int32_t), "MPI_INT is int32_t");
    int cnt = to_int(n, what, "n");
    run(MPI_Iallreduce(MPI_IN_PLACE, buf, cnt, MPI_INT, mpi_op(op), mc_, &req_), what, "MPI_Iallreduce");
  }

  void do_all_reduce(double* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce(double)";
    require_mpi_running(what);
    int cnt = to_int(n, what, "n");
    run(MPI_Iallreduce(MPI_IN_PLACE, buf, cnt, MPI_DOUBLE, mpi_op(op), mc_, &req_), what, "MPI_Iallreduce");
  }

  void do_reduce_scatter(const float* send, float* recv, int64_t block, ReduceOp op) override {
    const char* what = "reduce_scatter";
    require_mpi_running(what);
    int cnt = to_int(block, what, "block");
    run(MPI_Ireduce_scatter_block(send, recv, cnt, MPI_FLOAT, mpi_op(op), mc_, &req_), what,
        "MPI_Ireduce_scatter_block");
    if (op == ReduceOp::kAvg) divide(recv, block);
  }

  void do_all_gather(const float* send, float* recv, int64_t block) override {
    const char* what = "all_gather";
    require_mpi_running(what);
    int cnt = to_int(block, what, "block");
    const void* s = send == recv + block * rank() ? MPI_IN_PLACE : send;
    run(MPI_Iallgather(s, cnt, MPI_FLOAT, recv, cnt, MPI_FLOAT, mc_, &req_), what, "MPI_Iallgather");
  }

  void do_all_gather_v(const float* send, float* recv, const int64_t* counts, const int64_t* displs) override {
    const char* what = "all_gather_v";
    require_mpi_running(what);
    to_ints(counts, "counts", what, c0_);
    to_ints(displs, "displs", what, d0_);
    // Zero-element buffers may be NULL; MPI implementations that check for
    // aliasing would see two NULLs as the same buffer, so give them distinct
    // dummies (never read or written).
    float dummy_s = 0.f, dummy_r = 0.f;
    const void* s = send == recv + displs[rank()] ? MPI_IN_PLACE : (send ? send : &dummy_s);
    run(MPI_Iallgatherv(s, c0_[rank()], MPI_FLOAT, recv ? recv : &dummy_r, c0_.data(), d0_.data(), MPI_FLOAT, mc_,
                       &req_),
        what, "MPI_Iallgatherv");
  }

  void do_all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs, float* recv,
                       const int64_t* recv_counts, const int64_t* recv_displs) override {
    const char* what = "all_to_all_v";
    require_mpi_running(what);
    to_ints(send_counts, "send_counts", what, c0_);
    to_ints(send_displs, "send_displs", what, d0_);
    to_ints(recv_counts, "recv_counts", what, c1_);
    to_ints(recv_displs, "recv_displs", what, d1_);
    // Open MPI 4.1 treats sendbuf == recvbuf as MPI_IN_PLACE even when every
    // count is zero (and then waits for a matching in-place call): a rank
    // that moves nothing may pass two equal (or NULL) pointers, so give it
    // distinct dummies.
    float dummy_s = 0.f, dummy_r = 0.f;
    if (send && send == recv) {
      // The base class refused overlapping extents, so one side is empty.
      bool sends = false;
      for (int32_t p = 0; p < size(); ++p) sends = sends || c0_[static_cast<size_t>(p)] > 0;
      if (sends)
        recv = &dummy_r;
      else
        send = &dummy_s;
    }
    run(MPI_Ialltoallv(send ? send : &dummy_s, c0_.data(), d0_.data(), MPI_FLOAT, recv ? recv : &dummy_r, c1_.data(),
                       d1_.data(), MPI_FLOAT, mc_, &req_),
        what, "MPI_Ialltoallv");
  }

  void do_broadcast(float* buf, int64_t n, int32_t root) override {
    const char* what = "broadcast";
    require_mpi_running(what);
    int cnt = to_int(n, what, "n");
    run(MPI_Ibcast(buf, cnt, MPI_FLOAT, root, mc_, &req_), what, "MPI_Ibcast");
  }

 private:
  // Every collective is started non-blocking and waited for here, with a
  // deadline: a rank that died, hung or stopped calling the library would
  // otherwise leave the others blocked forever. On timeout the communicator
  // is marked failed (as dion_comm_abort does), so every later call through
  // it, on any optimizer, fails at once; the pending request cannot be
  // cancelled (MPI has no cancel for collectives) and is abandoned. A
  // dion_comm_abort from another thread also ends the wait.
  void run(int err, const char* what, const char* fn) {
    check(err, what, fn);
    using clock = std::chrono::steady_clock;
    const clock::time_point start = clock::now();
    int done = 0;
    for (long polls = 0;; ++polls) {
      check(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), what, fn);
      if (done) return;
      if (comm_->aborted.load(std::memory_order_acquire))
        fail_coll(DION_ERROR_MPI, what, format("%s: the communicator was aborted (dion_comm_abort) while waiting", fn));
      // Spin while a collective is likely to finish quickly, then yield the core.
      if (polls < 20000) continue;
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      if (timeout_s_ > 0 && waited > timeout_s_) {
        comm_->aborted.store(true, std::memory_order_release);
        fail_coll(DION_ERROR_MPI, what,
                  format("%s did not complete within %g s (DION_COMM_TIMEOUT): a rank of the mesh may have died, hung "
                         "or stopped calling the library; the communicator is now marked failed and every later call "
                         "through it fails at once",
                         fn, timeout_s_));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void check(int err, const char* what, const char* fn) const {
    if (err == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    if (MPI_Error_string(err, msg, &len) != MPI_SUCCESS) std::snprintf(msg, sizeof msg, "MPI error code %d", err);
    fail_coll(DION_ERROR_MPI, what, format("%s failed: %s", fn, msg));
  }

  // Every MPI call between MPI_Init and MPI_Finalize only; afterwards MPI
  // behaviour is undefined, so refuse before calling.
  void require_mpi_running(const char* what) const {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
      fail_coll(DION_ERROR_INVALID_USAGE, what,
                init ? "MPI has been finalized (destroy the optimizer before MPI_Finalize)" : "MPI is not initialized");
  }

  // MPI-3 counts and displacements are int. Refused rather than split into
  // chunks: no matrix the algorithms move comes near 2^31 elements per rank,
  // and a clear error beats a silent truncation.
  int to_int(int64_t v, const char* what, const char* name) const {
    if (v > INT_MAX)
      fail_coll(DION_ERROR_NOT_SUPPORTED, what,
                format("%s = %lld exceeds the MPI count limit INT_MAX = %d", name, static_cast<long long>(v), INT_MAX));
    return static_cast<int>(v);
  }

  void to_ints(const int64_t* v, const char* name, const char* what, std::vector<int>& out) {
    out.resize(static_cast<size_t>(size()));
    for (int32_t r = 0; r < size(); ++r) out[r] = to_int(v[r], what, name);
  }

  // avg = sum / size: division rounds once, as the float64 references expect.
  void divide(float* buf, int64_t n) const {
    const float p = static_cast<float>(size());
    for (int64_t i = 0; i < n; ++i) buf[i] /= p;
  }

  static MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

  MPI_Comm mc_ = MPI_COMM_NULL;
  MPI_Request req_ = MPI_REQUEST_NULL;
  double timeout_s_ = comm_timeout_s();
  // Scratch for the int counts/displacements, kept to avoid an allocation per call.
  std::vector<int> c0_, d0_, c1_, d1_;
};

}  // namespace

std::unique_ptr<Collectives> make_mpi_collectives(dion_comm_t comm, const char* mesh_name) {
  if (comm->aborted.load(std::memory_order_acquire))
    throw Error(DION_ERROR_MPI, format("%s mesh: create: the communicator was aborted (dion_comm_abort)", mesh_name));
  if (!comm->handle)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: create: the MPI communicator has no handle", mesh_name));
  return std::make_unique<MpiCollectives>(comm, mesh_name);
}

}  // namespace dion

#endif  // DION_WITH_MPI
