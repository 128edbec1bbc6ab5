// SPDX-License-Identifier: MIT
// dion::Collectives: the collectives the algorithms need, one instance per
// mesh communicator (replicate, outer, inner), behind one interface whatever
// carries them (MPI for the host backend, NCCL for the CUDA backend).
//
// The public entry points here are non-virtual: they check the arguments and
// the communicator's aborted flag, call the transport's do_* hook, and count
// the bytes. A transport therefore only moves data; every check, every error
// message and the byte convention are the same for all of them.
//
// Contract for callers (the algorithms):
//  * Every call is collective: every rank of the mesh makes the same calls in
//    the same order, with the same sizes (n, block, root; counts consistent
//    across ranks for the _v forms). An argument error detected locally is
//    raised before any communication; since the arguments agree across ranks,
//    so does the error, and no rank is left waiting.
//  * Element counts are int64_t; a transport that cannot carry a count (MPI:
//    above INT_MAX per count or displacement) refuses it with
//    DION_ERROR_NOT_SUPPORTED before communicating.
//  * Buffers must not overlap except in the documented in-place forms.
//  * Buffers are host memory for MPI, and every call has completed when it
//    returns. For NCCL they are device memory of the communicator's device,
//    and every call is enqueued on the stream given by set_stream and returns
//    without waiting: buffers are read and written in that stream's order
//    (and, with a StreamJoin set, also in the compute stream's order).
//  * Errors are dion::Error: DION_ERROR_MPI / DION_ERROR_NCCL for transport
//    failures (NCCL: the call's result or an asynchronous error of the
//    communicator) and aborted communicators, DION_ERROR_CUDA for a failed
//    copy of the NCCL transport, DION_ERROR_NOT_SUPPORTED for counts
//    the transport cannot carry, DION_ERROR_INTERNAL for misuse (negative
//    counts, NULL buffers, bad root): a bug in libdion, not in the caller.
//    Messages start with "<mesh> mesh: <collective>:".
//  * The dion_comm_t must outlive the Collectives made from it (the aborted
//    flag is read through it at every call).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "../api/comm.hpp"
#include "../core/error.hpp"

namespace dion {

enum class ReduceOp : int32_t { kSum = 0, kAvg = 1, kMax = 2 };

// The kinds the byte counters are kept for (all_gather_v counts as
// kAllGather, the int32 all-reduce as kAllReduce).
enum class CollKind : int32_t {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kAllToAll = 3,
  kBroadcast = 4,
  kCount = 5
};

const char* coll_kind_name(CollKind k);
const char* reduce_op_name(ReduceOp op);

// Brackets each collective of a mesh whose collectives are enqueued on a
// stream of their own (the optimizer's communication stream, see
// Optimizer::step) rather than on the stream that computes their inputs and
// reads their outputs: before() makes the collective's stream wait for the
// work enqueued so far on the compute stream, after() makes the compute
// stream wait for everything enqueued so far on the collective's stream. A
// bracketed call is therefore ordered with the compute stream's work exactly
// as if it had been enqueued there. Both only enqueue waits (no host
// synchronisation).
struct StreamJoin {
  virtual ~StreamJoin() = default;
  virtual void before() = 0;
  virtual void after() = 0;
};

class Collectives {
 public:
  virtual ~Collectives() = default;
  Collectives(const Collectives&) = delete;
  Collectives& operator=(const Collectives&) = delete;

  const std::string& mesh() const { return mesh_; }
  int32_t size() const { return size_; }
  int32_t rank() const { return rank_; }

  // The CUDA stream (a cudaStream_t, passed as void* so that this header
  // needs no CUDA) the following calls are enqueued on, until the next
  // set_stream; nullptr is the legacy default stream, the initial one. The
  // MPI transport works on host buffers and ignores it.
  void set_stream(void* stream) {
    stream_ = stream;
    do_set_stream(stream);
  }
  void* stream() const { return stream_; }
  // Brackets every following call that communicates (all but
  // all_reduce_host, a setup-time call) with join->before() and
  // join->after(), until set_join(nullptr) (the initial state).
  void set_join(StreamJoin* join) { join_ = join; }
  StreamJoin* join() const { return join_; }

  // In place: buf[0..n) becomes the element-wise reduction over the ranks.
  // kAvg is the sum divided by size(). MPI: a division, not a multiplication
  // by 1/size, so it rounds once. NCCL (ncclAvg): every contribution is
  // multiplied by 1/size before the sum; when size() is a power of two that
  // scaling is exact and the result is the same, otherwise it may differ in
  // the last bit.
  void all_reduce(float* buf, int64_t n, ReduceOp op);
  // Flags and small counters (e.g. "this rank saw a non-finite gradient":
  // kMax makes every rank skip the step together). kSum or kMax only.
  void all_reduce(int32_t* buf, int64_t n, ReduceOp op);
  // Sums in double (e.g. Dion's column sums of squares of a sharded R, kept
  // in double as the unsharded path keeps them). kSum or kMax.
  void all_reduce(double* buf, int64_t n, ReduceOp op);

  // The same on a HOST buffer, complete on return (NCCL stages it through
  // device memory and waits for its stream): for the collective checks of
  // dion_add_group, never for a step.
  void all_reduce_host(int32_t* buf, int64_t n, ReduceOp op);

  // send holds size()*block elements, block r going to rank r; recv (block
  // elements) receives the reduction of every rank's block rank(). kSum or
  // kAvg. send and recv must not overlap.
  void reduce_scatter(const float* send, float* recv, int64_t block, ReduceOp op);

  // The same two reductions on bf16 elements (uint16_t bit patterns, device
  // memory), summed in the transport's bf16 arithmetic (NCCL: ncclBfloat16;
  // each partial sum rounded to bf16), at half the bytes. kSum or kAvg.
  // Transports without bf16 arithmetic (MPI; the host backend never asks)
  // fail with DION_ERROR_INTERNAL.
  void all_reduce_bf16(uint16_t* buf, int64_t n, ReduceOp op);
  void reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, int64_t block, ReduceOp op);

  // Each rank contributes block elements; recv (size()*block) holds them in
  // rank order. In place when send == recv + rank()*block.
  void all_gather(const float* send, float* recv, int64_t block);

  // Uneven form: rank r contributes counts[r] elements, placed at recv +
  // displs[r]. counts/displs have size() entries, identical on every rank;
  // send holds counts[rank()] elements (in place when send == recv +
  // displs[rank()]).
  void all_gather_v(const float* send, float* recv, const int64_t* counts, const int64_t* displs);

  // Rank r sends send_counts[p] elements from send + send_displs[p] to each
  // rank p, and receives recv_counts[p] elements from p at recv +
  // recv_displs[p]. Counts may be zero; recv_counts[p] on this rank must
  // equal send_counts[rank()] on rank p. send and recv must not overlap.
  void all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs, float* recv,
                    const int64_t* recv_counts, const int64_t* recv_displs);

  // buf[0..n) on root is copied to every rank.
  void broadcast(float* buf, int64_t n, int32_t root);

  // ---- health ----
  // Throws DION_ERROR_NCCL if the transport reports an asynchronous error
  // (NCCL: ncclCommGetAsyncError); never blocks. MPI reports errors per call.
  virtual void check_async() {}
  // Marks the communicator failed, as dion_comm_abort does (NCCL: aborts a
  // communicator libdion created, which ends its kernels in flight).
  virtual void abort_comm();

  // ---- byte counters ----
  // Convention: the bytes of payload this rank hands to a collective, i.e.
  // its send buffer, whatever the transport does on the wire (a ring
  // all-reduce moves about 2(P-1)/P of that per rank, a tree differs):
  //   all_reduce      n * elem           reduce_scatter  size()*block * elem
  //   all_gather      block * 4          all_gather_v    counts[rank()] * 4
  //   all_to_all_v    sum(send_counts) * 4 (own block included)
  //   broadcast       n * 4 on root, 0 on the other ranks
  // That is the figure the algorithms choose between (Dion's compressed sync
  // sends P and R instead of G), independent of the transport. A call is
  // counted once it has succeeded.
  //
  // reset_step() starts a new step: bytes_last_step() is what was counted
  // since the last reset_step() (since construction if none), bytes_total()
  // everything since construction.
  void reset_step();
  uint64_t bytes_last_step(CollKind k) const;
  uint64_t bytes_last_step() const;
  uint64_t bytes_total(CollKind k) const;
  uint64_t bytes_total() const;

 protected:
  Collectives(dion_comm_t comm, std::string mesh);

  // The stream of set_stream; a transport without streams keeps the default.
  virtual void do_set_stream(void* /*stream*/) {}

  // Transport hooks: arguments already checked (non-negative, non-NULL where
  // the count is positive, root in range, communicator not aborted). Throw
  // dion::Error through fail_transport on failure.
  virtual void do_all_reduce(float* buf, int64_t n, ReduceOp op) = 0;
  virtual void do_all_reduce(int32_t* buf, int64_t n, ReduceOp op) = 0;
  virtual void do_all_reduce(double* buf, int64_t n, ReduceOp op) = 0;
  // Host buffer; transports on host memory need not override it.
  virtual void do_all_reduce_host(int32_t* buf, int64_t n, ReduceOp op) { do_all_reduce(buf, n, op); }
  virtual void do_reduce_scatter(const float* send, float* recv, int64_t block, ReduceOp op) = 0;
  virtual void do_all_reduce_bf16(uint16_t* buf, int64_t n, ReduceOp op);
  virtual void do_reduce_scatter_bf16(const uint16_t* send, uint16_t* recv, int64_t block, ReduceOp op);
  virtual void do_all_gather(const float* send, float* recv, int64_t block) = 0;
  virtual void do_all_gather_v(const float* send, float* recv, const int64_t* counts, const int64_t* displs) = 0;
  virtual void do_all_to_all_v(const float* send, const int64_t* send_counts, const int64_t* send_displs,
                               float* recv, const int64_t* recv_counts, const int64_t* recv_displs) = 0;
  virtual void do_broadcast(float* buf, int64_t n, int32_t root) = 0;

  // DION_ERROR_MPI or DION_ERROR_NCCL, from the communicator's kind.
  dion_status_t transport_status() const;
  // Throws dion::Error(status, "<mesh> mesh: <what>: <message>").
  [[noreturn]] void fail_coll(dion_status_t status, const char* what, const std::string& message) const;

  dion_comm_t comm_;

 private:
  void check_usable(const char* what) const;
  // A reduce-scatter's checks (elements of `elem` bytes); returns size()*block.
  void check_all_reduce(const char* what, const void* buf, int64_t n) const;
  int64_t check_reduce_scatter(const char* what, const void* send, const void* recv, int64_t block, size_t elem) const;
  void all_reduce_int(int32_t* buf, int64_t n, ReduceOp op, bool host);
  void count(CollKind k, uint64_t bytes);
  // Runs a transport hook, bracketed by the StreamJoin if one is set.
  template <class F>
  void joined(F&& hook);

  StreamJoin* join_ = nullptr;
  void* stream_ = nullptr;  // set_stream's
  std::string mesh_;
  int32_t size_;
  int32_t rank_;
  uint64_t step_[static_cast<int>(CollKind::kCount)] = {};
  uint64_t total_[static_cast<int>(CollKind::kCount)] = {};
};

// The Collectives for one mesh. mesh_name names it in error messages
// ("replicate", "outer", "inner"). MPI communicators get the MPI transport,
// which duplicates the communicator (a collective call), so the library's
// traffic has its own context and returns errors. NCCL communicators get the
// NCCL transport (DION_ERROR_NOT_SUPPORTED in a build without NCCL), which
// uses the ncclComm_t itself: the library's NCCL operations and the caller's
// share its one sequence, so the caller must order them the same way on
// every rank and never issue NCCL calls on that communicator from another
// thread while the library uses it.
std::unique_ptr<Collectives> make_collectives(dion_comm_t comm, const char* mesh_name);

// How long a wait on a mesh may last before the library gives up with an
// error: DION_COMM_TIMEOUT in seconds (0 or negative: forever), default 600
// as torch.distributed's default collective timeout.
double comm_timeout_s();

}  // namespace dion
