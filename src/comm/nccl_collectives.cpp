// SPDX-License-Identifier: MIT
// The NCCL transport of dion::Collectives (CUDA backend): device fp32/int32
// buffers, every operation enqueued on the stream given by set_stream, and no
// host synchronisation anywhere (a call returns once NCCL has enqueued it).
//
// The caller's ncclComm_t is used as it is. The MPI transport duplicates its
// communicator; an NCCL communicator has no cheap duplicate (ncclCommSplit is
// a collective that builds a whole new communicator, with its own buffers and
// connections, per mesh and per optimizer). So the library's operations join
// the communicator's one sequence: they are issued from the thread that calls
// the library, in the same order on every rank, and ordered on the stream the
// library is given. A caller that makes its own NCCL calls on the same
// communicator must make them at the same points on every rank and never from
// another thread while the library is using it.
//
// The stream: the caller's, or during an overlapped step the optimizer's
// communication stream for every mesh at once (Optimizer::step explains
// why one stream for all: each rank's GPU then runs the NCCL operations in
// the host's order, the same on every rank); the base class brackets each
// call with the waits that order it with the compute (StreamJoin).
//
// Non-blocking communicators (ncclConfig_t.blocking = 0) return ncclInProgress
// until NCCL has put the operation on the stream; the transport then polls
// ncclCommGetAsyncError until it has, which waits for NCCL's host-side launch
// only, never for the device (and stops when the communicator is aborted).
#if DION_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <thread>

#include "collectives.hpp"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "libdion's NCCL transport needs NCCL 2.14 or newer (ncclAvg, ncclGetLastError, non-blocking communicators)"
#endif

namespace dion {

namespace {

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(dion_comm_t comm, const char* mesh)
      : Collectives(comm, mesh), nc_(static_cast<ncclComm_t>(comm->handle)) {}

  // A communicator still initialising (non-blocking) or already failed is
  // refused here rather than at the first collective.
  void check_healthy(const char* what) {
    ncclResult_t state = settle(what);
    if (state != ncclSuccess) fail_nccl(state, what, "the communicator is in error");
  }

  void check_async() override {
    if (comm_->aborted.load(std::memory_order_acquire)) return;
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(nc_, &state) == ncclSuccess && state != ncclSuccess && state != ncclInProgress)
      fail_nccl(state, "wait", "ncclCommGetAsyncError");
  }

  void abort_comm() override {
    if (!comm_->aborted.exchange(true) && comm_->kind == CommKind::kNcclOwned) ncclCommAbort(nc_);
  }

 protected:
  void do_set_stream(void* stream) override { stream_ = static_cast<cudaStream_t>(stream); }

  // Setup-time only: a temporary device buffer on the communicator's device,
  // and a wait for the stream.
  void do_all_reduce_host(int32_t* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce(int32, host)";
    int dev = 0, prev = 0;
    check(ncclCommCuDevice(nc_, &dev), what, "ncclCommCuDevice");
    const size_t bytes = static_cast<size_t>(n) * sizeof(int32_t);
    auto cuda = [&](cudaError_t e, const char* fn) {
      if (e != cudaSuccess) {
        cudaGetLastError();
        fail_coll(DION_ERROR_CUDA, what, format("%s failed: %s", fn, cudaGetErrorString(e)));
      }
    };
    cuda(cudaGetDevice(&prev), "cudaGetDevice");
    cuda(cudaSetDevice(dev), "cudaSetDevice");
    int32_t* d = nullptr;
    try {
      cuda(cudaMalloc(&d, bytes), "cudaMalloc");
      cuda(cudaMemcpyAsync(d, buf, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
      do_all_reduce(d, n, op);
      cuda(cudaMemcpyAsync(buf, d, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync");
      cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    } catch (...) {
      if (d) cudaFree(d);
      cudaSetDevice(prev);
      throw;
    }
    cudaFree(d);
    cudaSetDevice(prev);
  }

  // NCCL's all-reduce is in place when sendbuff == recvbuff.
  void do_all_reduce(float* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce";
    check(ncclAllReduce(buf, buf, elems(n), ncclFloat32, nccl_op(op), nc_, stream_), what, "ncclAllReduce");
  }

  void do_all_reduce(int32_t* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce(int32)";
    check(ncclAllReduce(buf, buf, elems(n), ncclInt32, nccl_op(op), nc_, stream_), what, "ncclAllReduce");
  }

  void do_all_reduce(double* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce(double)";
    check(ncclAllReduce(buf, buf, elems(n), ncclFloat64, nccl_op(op), nc_, stream_), what, "ncclAllReduce");
  }

  void do_reduce_scatter(const float* send, float* recv, int64_t block, ReduceOp op) override {
    const char* what = "reduce_scatter";
    check(ncclReduceScatter(send, recv, elems(block), ncclFloat32, nccl_op(op), nc_, stream_), what,
          "ncclReduceScatter");
  }

  void do_all_reduce_bf16(uint16_t* buf, int64_t n, ReduceOp op) override {
    const char* what = "all_reduce(bf16)";
    check(ncclAllReduce(buf, buf, elems(n), ncclBfloat16, nccl_op(op), nc_, stream_), what, "ncclAllReduce");
  }

  void do_reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, int64_t block, ReduceOp op) override {
    const char* what = "reduce_scatter(bf16)";
    check(ncclReduceScatter(send, recv, elems(block), ncclBfloat16, nccl_op(op), nc_, stream_), what,
          "ncclReduceScatter");
  }

  void do_all_gather(const float* send, float* recv, int64_t block) override {
    all_gather_blocks(send, recv, block, "all_gather");
  }

  void do_all_gather_v(const float* send, float* recv, const int64_t* counts, const int64_t* displs) override {
    const char* what = "all_gather_v";
    const int32_t P = size(), me = rank();
    // Equal blocks laid end to end (an even split): one all-gather, which
    // NCCL runs as a ring, instead of P-1 point-to-point pairs per rank. The
    // choice reads only counts/displs, identical on every rank, so every rank
    // takes the same branch. The in-place form maps onto NCCL's (send ==
    // recv + rank*block).
    bool even = true;
    for (int32_t r = 0; r < P && even; ++r) even = counts[r] == counts[0] && displs[r] == r * counts[0];
    if (even) {
      if (counts[0] > 0) all_gather_blocks(send, recv, counts[0], what);
      return;
    }
    const int64_t mine = counts[me];
    // This rank's own block: nothing to do in place, else a device copy.
    if (mine > 0 && send != recv + displs[me]) copy(recv + displs[me], send, mine, what);
    // Zero-element transfers are left out on both sides (counts agree across
    // ranks), so every posted send has its receive.
    Group g(*this, what);
    for (int32_t p = 0; p < P; ++p) {
      if (p == me) continue;
      if (mine > 0) g.send(send, mine, p);
      if (counts[p] > 0) g.recv(recv + displs[p], counts[p], p);
    }
    g.end();
  }

  void do_all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs, float* recv,
                       const int64_t* recv_counts, const int64_t* recv_displs) override {
    const char* what = "all_to_all_v";
    const int32_t P = size(), me = rank();
    // The block this rank sends itself is a device copy; its two counts are
    // the one number the contract ties together on a single rank.
    if (send_counts[me] != recv_counts[me])
      throw Error(DION_ERROR_INTERNAL,
                  format("%s mesh: %s: send_counts[%d] = %lld but recv_counts[%d] = %lld", mesh().c_str(), what, me,
                         static_cast<long long>(send_counts[me]), me, static_cast<long long>(recv_counts[me])));
    if (send_counts[me] > 0) copy(recv + recv_displs[me], send + send_displs[me], send_counts[me], what);
    Group g(*this, what);
    for (int32_t p = 0; p < P; ++p) {
      if (p == me) continue;
      if (send_counts[p] > 0) g.send(send + send_displs[p], send_counts[p], p);
      if (recv_counts[p] > 0) g.recv(recv + recv_displs[p], recv_counts[p], p);
    }
    g.end();
  }

  // In place (sendbuff == recvbuff), as the interface's broadcast is.
  void do_broadcast(float* buf, int64_t n, int32_t root) override {
    const char* what = "broadcast";
    check(ncclBroadcast(buf, buf, elems(n), ncclFloat32, root, nc_, stream_), what, "ncclBroadcast");
  }

 private:
  // ncclSend/ncclRecv between ncclGroupStart and ncclGroupEnd: NCCL matches
  // them as one operation, so the order they are posted in cannot deadlock.
  // The group is always closed, even after a failed call inside it (an open
  // group would swallow the caller's next NCCL calls on this thread); the
  // first failure is reported once it is.
  class Group {
   public:
    Group(NcclCollectives& c, const char* what) : c_(c), what_(what) {}
    ~Group() {
      if (open_) ncclGroupEnd();  // only on an exception thrown between start and end
    }
    void send(const float* buf, int64_t n, int32_t peer) {
      start();
      keep(ncclSend(buf, elems(n), ncclFloat32, peer, c_.nc_, c_.stream_), "ncclSend");
    }
    void recv(float* buf, int64_t n, int32_t peer) {
      start();
      keep(ncclRecv(buf, elems(n), ncclFloat32, peer, c_.nc_, c_.stream_), "ncclRecv");
    }
    // Nothing was posted (one rank, or every count zero): no group at all.
    void end() {
      if (!open_) return;
      open_ = false;
      ncclResult_t r = ncclGroupEnd();
      if (first_ != ncclSuccess) c_.fail_nccl(first_, what_, first_fn_);
      c_.check(r, what_, "ncclGroupEnd");
    }

   private:
    void start() {
      if (open_) return;
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) c_.fail_nccl(r, what_, "ncclGroupStart");
      open_ = true;
    }
    // Inside a group a call only records the operation (a non-blocking
    // communicator may still answer ncclInProgress).
    void keep(ncclResult_t r, const char* fn) {
      if (r != ncclSuccess && r != ncclInProgress && first_ == ncclSuccess) {
        first_ = r;
        first_fn_ = fn;
      }
    }

    NcclCollectives& c_;
    const char* what_;
    bool open_ = false;
    ncclResult_t first_ = ncclSuccess;
    const char* first_fn_ = "";
  };

  void all_gather_blocks(const float* send, float* recv, int64_t block, const char* what) {
    check(ncclAllGather(send, recv, elems(block), ncclFloat32, nc_, stream_), what, "ncclAllGather");
  }

  // Device-to-device copy of n floats, ordered on the stream.
  void copy(float* dst, const float* src, int64_t n, const char* what) {
    cudaError_t e = cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice,
                                    stream_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: leave no stale error for the caller's next check
      fail_coll(DION_ERROR_CUDA, what, format("cudaMemcpyAsync of this rank's own block failed: %s",
                                              cudaGetErrorString(e)));
    }
  }

  // The result of an enqueueing call, then the communicator's asynchronous
  // state (a non-blocking query): an error a previous operation left behind
  // on the device or in a proxy thread surfaces at the next call instead of
  // as a hang later.
  void check(ncclResult_t r, const char* what, const char* fn) {
    if (r == ncclInProgress) r = settle(what);
    if (r != ncclSuccess) fail_nccl(r, what, fn);
    ncclResult_t state = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(nc_, &state);
    if (q != ncclSuccess) fail_nccl(q, what, "ncclCommGetAsyncError");
    if (state != ncclSuccess && state != ncclInProgress)
      fail_nccl(state, what, "the communicator reports an asynchronous error");
  }

  // Waits for a non-blocking communicator to leave ncclInProgress (NCCL is
  // still launching on the host) and returns its state; a blocking one
  // answers at once. dion_comm_abort from another thread ends the wait.
  ncclResult_t settle(const char* what) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(nc_, &state);
      if (q != ncclSuccess) fail_nccl(q, what, "ncclCommGetAsyncError");
      if (state != ncclInProgress) return state;
      if (comm_->aborted.load(std::memory_order_acquire))
        fail_coll(transport_status(), what, "the communicator was aborted (dion_comm_abort) while NCCL was launching");
      std::this_thread::yield();
    }
  }

  // "<fn> failed: <NCCL's text for the code> (<NCCL's last message>)"; the
  // last message, when NCCL kept one, names the cause (a peer gone, a CUDA
  // error) where the code alone says only "unhandled system error".
  [[noreturn]] void fail_nccl(ncclResult_t r, const char* what, const char* fn) const {
    const char* last = ncclGetLastError(nc_);
    std::string msg = format("%s failed: %s", fn, ncclGetErrorString(r));
    if (last && *last) msg += format(" (%s)", last);
    fail_coll(transport_status(), what, msg);
  }

  // NCCL counts are size_t: any non-negative int64_t fits.
  static size_t elems(int64_t n) { return static_cast<size_t>(n); }

  // kAvg is ncclAvg (NCCL 2.10+): the division happens inside the reduction,
  // with no kernel of ours after it. Float contributions are pre-multiplied
  // by 1/size (see all_reduce in collectives.hpp).
  static ncclRedOp_t nccl_op(ReduceOp op) {
    switch (op) {
      case ReduceOp::kAvg: return ncclAvg;
      case ReduceOp::kMax: return ncclMax;
      default: return ncclSum;
    }
  }

  ncclComm_t nc_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Collectives> make_nccl_collectives(dion_comm_t comm, const char* mesh_name) {
  if (comm->aborted.load(std::memory_order_acquire))
    throw Error(DION_ERROR_NCCL, format("%s mesh: create: the communicator was aborted (dion_comm_abort)", mesh_name));
  if (!comm->handle)
    throw Error(DION_ERROR_INTERNAL, format("%s mesh: create: the NCCL communicator has no handle", mesh_name));
  auto c = std::make_unique<NcclCollectives>(comm, mesh_name);
  c->check_healthy("create");
  return c;
}

}  // namespace dion

#endif  // DION_WITH_NCCL
