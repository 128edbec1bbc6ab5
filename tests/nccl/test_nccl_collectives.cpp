// SPDX-License-Identifier: MIT
// dion::Collectives over NCCL (src/comm/nccl_collectives.cpp), run under
// mpiexec with one rank per GPU (rank r uses device r % device_count; MPI only
// carries the ncclUniqueId and checks the world still works). Skips itself on
// every rank when fewer GPUs than ranks are visible.
//
// As in tests/mpi/test_mpi_collectives.cpp, every rank can compute every
// rank's input from (rank, index), so each collective is checked against a
// reference computed on the host. Inputs are small multiples of 0.5: every
// sum is exact whatever order NCCL reduces in (ring, tree, NVLS), and the
// results are compared bit for bit (avg too: with 2, 4 or 8 ranks ncclAvg's
// scaling by 1/size is exact).
//
// Every operation is enqueued on a non-blocking stream created by the test
// (no implicit ordering with the legacy default stream), inputs are uploaded
// and results downloaded on that stream, and the only host synchronisation is
// cudaStreamSynchronize on it. CallsAreEnqueuedWithoutWaiting holds the
// stream closed while the calls are made, to show that none of them waits for
// the device and that each one runs in stream order.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "api/comm.hpp"
#include "comm/collectives.hpp"
#include "dion.h"
#include "../mpi/rank_printer.hpp"

using dion::CollKind;
using dion::Collectives;
using dion::ReduceOp;

namespace {

// ---- the world: ranks, devices, the stream and a shared NCCL communicator ----

struct World {
  int P = 1, me = 0, ndev = 0, dev = 0;
  bool ready = false;
  bool skipped = false;
  std::string why;  // why not ready (a skip or a setup failure)
  cudaStream_t stream = nullptr;
  dion_comm_t comm = nullptr;  // used by most tests; the abort test makes its own
} g;

#define CUDA_OK(call)                                                                      \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_);                 \
  } while (0)

// A new NCCL communicator over every rank through the public API: rank 0
// makes the unique id, MPI broadcasts it. Collective over MPI_COMM_WORLD.
// Returns nullptr (on every rank) with the reason in *err on failure.
dion_comm_t new_nccl_comm(std::string* err) {
  dion_nccl_unique_id_t id;
  std::memset(&id, 0, sizeof id);
  int st = DION_SUCCESS;
  if (g.me == 0) st = dion_nccl_get_unique_id(&id);
  MPI_Bcast(&st, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (st != DION_SUCCESS) {
    *err = std::string("dion_nccl_get_unique_id on rank 0: ") + dion_status_string(static_cast<dion_status_t>(st));
    return nullptr;
  }
  MPI_Bcast(id.internal, DION_NCCL_UNIQUE_ID_BYTES, MPI_BYTE, 0, MPI_COMM_WORLD);
  dion_comm_t c = nullptr;
  dion_status_t s = dion_comm_init_nccl(&c, &id, g.P, g.me, g.dev);
  int ok = s == DION_SUCCESS, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    *err = ok ? std::string("dion_comm_init_nccl failed on another rank")
              : std::string("dion_comm_init_nccl: ") + dion_last_error(nullptr);
    dion_comm_destroy(c);
    return nullptr;
  }
  return c;
}

// Rank r's input element i: a multiple of 0.5 in [-5.5, 5.5].
float val(int r, int64_t i) { return static_cast<float>(((r * 131 + i * 7) % 23) - 11) * 0.5f; }

float reduce_ref(int P, int64_t i, ReduceOp op) {
  float s = 0.f, m = val(0, i);
  for (int r = 0; r < P; ++r) {
    s += val(r, i);  // exact: small multiples of 0.5
    m = std::max(m, val(r, i));
  }
  if (op == ReduceOp::kMax) return m;
  return op == ReduceOp::kAvg ? s / static_cast<float>(P) : s;
}

bool power_of_two(int p) { return p > 0 && (p & (p - 1)) == 0; }

// A device buffer; ptr() is nullptr when it has no element (zero-sized
// collectives take NULL buffers). Transfers are on the test stream.
template <class T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    if (n_ && cudaMalloc(&p_, n_ * sizeof(T)) != cudaSuccess) {
      (void)cudaGetLastError();
      p_ = nullptr;
      ADD_FAILURE() << "cudaMalloc of " << n_ << " elements failed";
    }
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { put(h); }
  ~Dev() {
    if (p_) cudaFree(p_);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  T* ptr() const { return p_; }
  size_t size() const { return n_; }
  // Uploads on the stream (ordered before any collective enqueued after it).
  void put(const std::vector<T>& h) {
    ASSERT_EQ(h.size(), n_);
    if (n_) CUDA_OK(cudaMemcpyAsync(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice, g.stream));
  }
  // Downloads on the stream after everything enqueued so far, then waits for
  // the stream: the test's only host synchronisation.
  std::vector<T> get() const {
    std::vector<T> h(n_);
    if (n_) {
      cudaError_t e = cudaMemcpyAsync(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost, g.stream);
      EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    }
    cudaError_t e = cudaStreamSynchronize(g.stream);
    EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

std::unique_ptr<Collectives> make(const char* mesh, dion_comm_t comm = nullptr) {
  auto c = dion::make_collectives(comm ? comm : g.comm, mesh);
  c->set_stream(g.stream);
  return c;
}

// Runs body, expects a dion::Error with the status and every fragment in its message.
template <class F>
void expect_error(F&& body, dion_status_t status, std::vector<std::string> fragments) {
  try {
    body();
    ADD_FAILURE() << "no error thrown";
  } catch (const dion::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

class Nccl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (g.ready) return;
    if (g.skipped) GTEST_SKIP() << g.why;
    FAIL() << g.why;
  }
};

// ---- the uneven patterns shared by the tests ----

// all_gather_v layout: counts 2, 3, 0, 1, 2, 3, 0, 1 ... (zeros included),
// a one-element gap between blocks so the displacements matter.
struct Layout {
  std::vector<int64_t> counts, displs;
  int64_t extent = 0;
};

Layout uneven_layout(int P, int64_t scale) {
  Layout l;
  l.counts.resize(P);
  l.displs.resize(P);
  for (int r = 0; r < P; ++r) {
    l.counts[r] = ((r + 2) % 4) * scale;
    l.displs[r] = l.extent;
    l.extent += l.counts[r] + 1;
  }
  return l;
}

std::vector<float> gathered(const Layout& l, int P) {
  std::vector<float> e(l.extent, -99.f);
  for (int r = 0; r < P; ++r)
    for (int64_t j = 0; j < l.counts[r]; ++j) e[l.displs[r] + j] = val(r, j);
  return e;
}

// The element rank `from` sends to rank `to` at position j: unique and exact.
float a2a_val(int from, int to, int64_t j) { return static_cast<float>(from * 100000 + to * 10000 + j % 10000); }

// all_to_all_v with cnt[from][to] elements, blocks packed in rank order.
struct A2A {
  std::vector<int64_t> sc, sd, rc, rd;
  std::vector<float> send, expect;
};

A2A a2a_pattern(int P, int me, const std::vector<std::vector<int64_t>>& cnt) {
  A2A a;
  a.sc.resize(P);
  a.sd.resize(P);
  a.rc.resize(P);
  a.rd.resize(P);
  int64_t soff = 0, roff = 0;
  for (int p = 0; p < P; ++p) {
    a.sc[p] = cnt[me][p];
    a.sd[p] = soff;
    soff += a.sc[p];
    a.rc[p] = cnt[p][me];
    a.rd[p] = roff;
    roff += a.rc[p];
  }
  a.send.resize(soff);
  a.expect.resize(roff);
  for (int p = 0; p < P; ++p) {
    for (int64_t j = 0; j < a.sc[p]; ++j) a.send[a.sd[p] + j] = a2a_val(me, p, j);
    for (int64_t j = 0; j < a.rc[p]; ++j) a.expect[a.rd[p] + j] = a2a_val(p, me, j);
  }
  return a;
}

void run_all_to_all(Collectives& c, const std::vector<std::vector<int64_t>>& cnt, const char* label) {
  A2A a = a2a_pattern(c.size(), c.rank(), cnt);
  Dev<float> send(a.send), recv(std::vector<float>(a.expect.size(), -1.f));
  c.all_to_all_v(send.ptr(), a.sc.data(), a.sd.data(), recv.ptr(), a.rc.data(), a.rd.data());
  EXPECT_EQ(recv.get(), a.expect) << label;
}

}  // namespace

TEST_F(Nccl, SizeRankAndMesh) {
  auto c = make("replicate");
  EXPECT_EQ(c->size(), g.P);
  EXPECT_EQ(c->rank(), g.me);
  EXPECT_EQ(c->mesh(), "replicate");
}

TEST_F(Nccl, AllReduceFloatInPlace) {
  auto c = make("replicate");
  const int P = g.P, me = g.me;
  // 1 << 20 + 3: several NCCL chunks and a ragged tail.
  for (int64_t n : {0, 1, 7, 1001, (1 << 20) + 3}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      std::vector<float> h(n);
      for (int64_t i = 0; i < n; ++i) h[i] = val(me, i);
      Dev<float> buf(h);
      c->all_reduce(buf.ptr(), n, op);
      std::vector<float> got = buf.get();
      for (int64_t i = 0; i < n; ++i) {
        const float want = reduce_ref(P, i, op);
        if (op == ReduceOp::kAvg && !power_of_two(P))  // ncclAvg pre-multiplies by 1/P
          ASSERT_NEAR(got[i], want, 1e-6f * std::max(1.f, std::abs(want))) << "n=" << n << " i=" << i;
        else
          ASSERT_EQ(got[i], want) << "n=" << n << " op=" << dion::reduce_op_name(op) << " i=" << i;
      }
    }
  }
}

TEST_F(Nccl, AllReduceInt32) {
  auto c = make("replicate");
  const int P = g.P, me = g.me;
  // Only the last rank saw a non-finite gradient: every rank learns it.
  Dev<int32_t> flag(std::vector<int32_t>{me == P - 1 ? 1 : 0});
  c->all_reduce(flag.ptr(), 1, ReduceOp::kMax);
  EXPECT_EQ(flag.get(), std::vector<int32_t>{1});
  Dev<int32_t> none(std::vector<int32_t>{0});
  c->all_reduce(none.ptr(), 1, ReduceOp::kMax);
  EXPECT_EQ(none.get(), std::vector<int32_t>{0});
  // Max over negative and large values (not a float max in disguise), and sums.
  const int32_t big = 1 << 30;
  Dev<int32_t> m(std::vector<int32_t>{-me - 5, big - P + me, me * 3 - 7});
  c->all_reduce(m.ptr(), 3, ReduceOp::kMax);
  EXPECT_EQ(m.get(), (std::vector<int32_t>{-5, big - 1, (P - 1) * 3 - 7}));
  Dev<int32_t> s(std::vector<int32_t>{me, 1, -me});
  c->all_reduce(s.ptr(), 3, ReduceOp::kSum);
  EXPECT_EQ(s.get(), (std::vector<int32_t>{P * (P - 1) / 2, P, -P * (P - 1) / 2}));
  expect_error([&] { c->all_reduce(s.ptr(), 3, ReduceOp::kAvg); }, DION_ERROR_INTERNAL, {"replicate", "avg"});
}

// Doubles (ncclFloat64): values no float holds (2^600) and sums whose last
// bits a float would drop (1 + k 2^-40); every sum is exact in double.
TEST_F(Nccl, AllReduceDouble) {
  auto c = make("outer");
  const int P = g.P, me = g.me;
  const double big = std::ldexp(1.0, 600), tiny = std::ldexp(1.0, -40);
  Dev<double> v(std::vector<double>{(me + 1) * big, 1.0 + me * tiny, -0.5 * me});
  c->all_reduce(v.ptr(), 3, ReduceOp::kSum);
  EXPECT_EQ(v.get(), (std::vector<double>{P * (P + 1) / 2 * big, P + P * (P - 1) / 2 * tiny, -0.25 * P * (P - 1)}));
  Dev<double> m(std::vector<double>{(me + 1) * big, -1.0 - me * tiny});
  c->all_reduce(m.ptr(), 2, ReduceOp::kMax);
  EXPECT_EQ(m.get(), (std::vector<double>{P * big, -1.0}));
  EXPECT_EQ(c->bytes_last_step(CollKind::kAllReduce), 5u * sizeof(double));
  expect_error([&] { c->all_reduce(v.ptr(), 3, ReduceOp::kAvg); }, DION_ERROR_INTERNAL, {"outer", "avg"});
}

TEST_F(Nccl, ReduceScatter) {
  auto c = make("outer");
  const int P = g.P, me = g.me;
  for (int64_t block : {0, 1, 5, 4097}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<float> h(block * P);
      for (int64_t i = 0; i < block * P; ++i) h[i] = val(me, i);
      Dev<float> send(h), recv(std::vector<float>(block, -99.f));
      c->reduce_scatter(send.ptr(), recv.ptr(), block, op);
      std::vector<float> got = recv.get();
      for (int64_t j = 0; j < block; ++j) {
        const float want = reduce_ref(P, me * block + j, op);
        if (op == ReduceOp::kAvg && !power_of_two(P))
          ASSERT_NEAR(got[j], want, 1e-6f * std::max(1.f, std::abs(want))) << "block=" << block << " j=" << j;
        else
          ASSERT_EQ(got[j], want) << "block=" << block << " j=" << j;
      }
    }
  }
}

TEST_F(Nccl, AllGatherOutOfPlaceAndInPlace) {
  auto c = make("outer");
  const int P = g.P, me = g.me;
  for (int64_t block : {0, 1, 3, 70001}) {
    std::vector<float> mine(block), expect(block * P);
    for (int64_t j = 0; j < block; ++j) mine[j] = val(me, j);
    for (int r = 0; r < P; ++r)
      for (int64_t j = 0; j < block; ++j) expect[r * block + j] = val(r, j);
    Dev<float> send(mine), recv(std::vector<float>(block * P, -99.f));
    c->all_gather(send.ptr(), recv.ptr(), block);
    EXPECT_EQ(recv.get(), expect) << "block=" << block;
    // In place: this rank's block already sits in recv.
    std::vector<float> h(block * P, -99.f);
    std::copy(mine.begin(), mine.end(), h.begin() + me * block);
    Dev<float> inplace(h);
    c->all_gather(block ? inplace.ptr() + me * block : nullptr, inplace.ptr(), block);
    EXPECT_EQ(inplace.get(), expect) << "in place, block=" << block;
  }
}

TEST_F(Nccl, AllGatherVUnevenWithZeros) {
  auto c = make("inner");
  const int P = g.P, me = g.me;
  for (int64_t scale : {1, 5000}) {
    Layout l = uneven_layout(P, scale);
    const std::vector<float> expect = gathered(l, P);
    std::vector<float> mine(l.counts[me]);
    for (int64_t j = 0; j < l.counts[me]; ++j) mine[j] = val(me, j);
    // Out of place; a rank with nothing to send passes NULL.
    Dev<float> send(mine), recv(std::vector<float>(l.extent, -99.f));
    c->all_gather_v(send.ptr(), recv.ptr(), l.counts.data(), l.displs.data());
    EXPECT_EQ(recv.get(), expect) << "scale=" << scale;
    // In place.
    std::vector<float> h(l.extent, -99.f);
    std::copy(mine.begin(), mine.end(), h.begin() + l.displs[me]);
    Dev<float> inplace(h);
    c->all_gather_v(inplace.ptr() + l.displs[me], inplace.ptr(), l.counts.data(), l.displs.data());
    EXPECT_EQ(inplace.get(), expect) << "in place, scale=" << scale;
  }
  // Every count zero: a valid no-op that still completes on every rank.
  std::vector<int64_t> zeros(P, 0);
  c->all_gather_v(nullptr, nullptr, zeros.data(), zeros.data());
  // Only one rank (the last) contributes.
  std::vector<int64_t> one(P, 0), at(P, 0);
  one[P - 1] = 3;
  Dev<float> src(me == P - 1 ? std::vector<float>{val(me, 0), val(me, 1), val(me, 2)} : std::vector<float>{});
  Dev<float> dst(std::vector<float>(3, -99.f));
  c->all_gather_v(src.ptr(), dst.ptr(), one.data(), at.data());
  EXPECT_EQ(dst.get(), (std::vector<float>{val(P - 1, 0), val(P - 1, 1), val(P - 1, 2)}));
}

TEST_F(Nccl, AllGatherVEvenLayoutOutOfPlaceAndInPlace) {
  // Equal counts laid end to end: the transport's all-gather path.
  auto c = make("inner");
  const int P = g.P, me = g.me;
  const int64_t block = 33;
  std::vector<int64_t> counts(P, block), displs(P);
  for (int r = 0; r < P; ++r) displs[r] = r * block;
  std::vector<float> mine(block), expect(block * P);
  for (int64_t j = 0; j < block; ++j) mine[j] = val(me, j);
  for (int r = 0; r < P; ++r)
    for (int64_t j = 0; j < block; ++j) expect[r * block + j] = val(r, j);
  Dev<float> send(mine), recv(std::vector<float>(block * P, -99.f));
  c->all_gather_v(send.ptr(), recv.ptr(), counts.data(), displs.data());
  EXPECT_EQ(recv.get(), expect);
  std::vector<float> h(block * P, -99.f);
  std::copy(mine.begin(), mine.end(), h.begin() + me * block);
  Dev<float> inplace(h);
  c->all_gather_v(inplace.ptr() + me * block, inplace.ptr(), counts.data(), displs.data());
  EXPECT_EQ(inplace.get(), expect);
  EXPECT_EQ(c->bytes_total(CollKind::kAllGather), 2u * block * sizeof(float));
}

TEST_F(Nccl, AllToAllUnevenWithZeros) {
  auto c = make("outer");
  const int P = g.P;
  std::vector<std::vector<int64_t>> cnt(P, std::vector<int64_t>(P));
  // Unsharding: a matrix of `rows` rows x 3 columns per destination, its rows
  // split over the ranks as evenly as possible (3 over 4: one rank holds no
  // row). Rank p receives every rank's shard of matrix p.
  for (int64_t rows : {4099, 18, 3}) {
    for (int r = 0; r < P; ++r)
      for (int p = 0; p < P; ++p) cnt[r][p] = (rows / P + (r < rows % P ? 1 : 0)) * 3;
    run_all_to_all(*c, cnt, "rows");
  }
  // An irregular pattern with zeros in both directions (the diagonal too).
  for (int r = 0; r < P; ++r)
    for (int p = 0; p < P; ++p) cnt[r][p] = (r * 3 + p * 5) % 4;
  run_all_to_all(*c, cnt, "irregular");
  // Only the self blocks: no point-to-point traffic at all.
  for (int r = 0; r < P; ++r)
    for (int p = 0; p < P; ++p) cnt[r][p] = r == p ? 7 : 0;
  run_all_to_all(*c, cnt, "diagonal");
  // Nothing at all.
  for (auto& row : cnt) std::fill(row.begin(), row.end(), 0);
  run_all_to_all(*c, cnt, "empty");
}

TEST_F(Nccl, BroadcastFromEveryKindOfRoot) {
  auto c = make("replicate");
  const int P = g.P, me = g.me;
  for (int64_t n : {0, 1, 9, 300001}) {
    for (int root : {P - 1, 1, 0}) {  // a non-zero root first
      std::vector<float> h(n);
      for (int64_t i = 0; i < n; ++i) h[i] = val(me, i);
      Dev<float> buf(h);
      c->broadcast(buf.ptr(), n, root);
      std::vector<float> got = buf.get();
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], val(root, i)) << "n=" << n << " root=" << root;
    }
  }
  float* none = nullptr;
  Dev<float> x(1);
  expect_error([&] { c->broadcast(x.ptr(), 1, P); }, DION_ERROR_INTERNAL, {"replicate mesh: broadcast", "root"});
  expect_error([&] { c->broadcast(none, 1, 0); }, DION_ERROR_INTERNAL, {"replicate mesh: broadcast", "NULL"});
}

TEST_F(Nccl, ByteCounters) {
  auto cp = make("replicate");
  Collectives& c = *cp;
  const int P = g.P, me = g.me;
  EXPECT_EQ(c.bytes_total(), 0u);
  Dev<float> buf(std::vector<float>(64 * P, 1.f)), out(std::vector<float>(64 * P, 0.f));
  Dev<int32_t> flags(std::vector<int32_t>(3, 0));
  c.all_reduce(buf.ptr(), 10, ReduceOp::kSum);                  // 40
  c.all_reduce(flags.ptr(), 3, ReduceOp::kMax);                 // 12
  c.reduce_scatter(buf.ptr(), out.ptr(), 2, ReduceOp::kAvg);    // P * 2 * 4
  c.all_gather(buf.ptr(), out.ptr(), 3);                        // 12
  std::vector<int64_t> counts(P), displs(P);
  int64_t off = 0;
  for (int r = 0; r < P; ++r) {
    counts[r] = r + 1;
    displs[r] = off;
    off += counts[r];
  }
  c.all_gather_v(buf.ptr(), out.ptr(), counts.data(), displs.data());  // (me + 1) * 4
  // all_to_all_v: rank r sends p + 1 elements to rank p, so receives me + 1 from each.
  std::vector<int64_t> sc(P), sd(P), rc(P, me + 1), rd(P);
  off = 0;
  for (int p = 0; p < P; ++p) {
    sc[p] = p + 1;
    sd[p] = off;
    off += sc[p];
    rd[p] = p * (me + 1);
  }
  c.all_to_all_v(buf.ptr(), sc.data(), sd.data(), out.ptr(), rc.data(), rd.data());  // P(P+1)/2 * 4
  c.broadcast(buf.ptr(), 5, P - 1);  // 20 on the root, 0 elsewhere
  out.get();                         // everything completed without error

  const uint64_t ar = 40 + 12, rs = P * 2 * 4, ag = 12 + (me + 1) * 4, a2a = P * (P + 1) / 2 * 4,
                 bc = me == P - 1 ? 20 : 0;
  EXPECT_EQ(c.bytes_last_step(CollKind::kAllReduce), ar);
  EXPECT_EQ(c.bytes_last_step(CollKind::kReduceScatter), rs);
  EXPECT_EQ(c.bytes_last_step(CollKind::kAllGather), ag);
  EXPECT_EQ(c.bytes_last_step(CollKind::kAllToAll), a2a);
  EXPECT_EQ(c.bytes_last_step(CollKind::kBroadcast), bc);
  EXPECT_EQ(c.bytes_last_step(), ar + rs + ag + a2a + bc);
  EXPECT_EQ(c.bytes_total(), ar + rs + ag + a2a + bc);

  // A new step: the step counters restart, the totals keep going.
  c.reset_step();
  EXPECT_EQ(c.bytes_last_step(), 0u);
  c.all_reduce(buf.ptr(), 1, ReduceOp::kAvg);
  EXPECT_EQ(c.bytes_last_step(), 4u);
  EXPECT_EQ(c.bytes_total(CollKind::kAllReduce), ar + 4);
  EXPECT_EQ(c.bytes_total(), ar + rs + ag + a2a + bc + 4);
  // Zero-sized calls count nothing.
  c.all_reduce(static_cast<float*>(nullptr), 0, ReduceOp::kSum);
  EXPECT_EQ(c.bytes_last_step(), 4u);
  buf.get();
}

namespace {

// A host function that holds the stream closed until the test opens it (or
// 30 s pass: then some call waited for the stream, and the test fails
// instead of hanging).
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  bool timed_out = false;
  static void CUDART_CB hold(void* p) {
    auto* gate = static_cast<Gate*>(p);
    std::unique_lock<std::mutex> lock(gate->m);
    gate->timed_out = !gate->cv.wait_for(lock, std::chrono::seconds(30), [&] { return gate->open; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(m);
      open = true;
    }
    cv.notify_all();
  }
};

// Page-locked host memory: copies from it are truly asynchronous (a copy from
// pageable memory may wait for the stream, which the gate holds).
template <class T>
struct Pinned {
  T* p = nullptr;
  size_t n;
  explicit Pinned(size_t n_) : n(n_) {
    if (cudaMallocHost(&p, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
      ADD_FAILURE() << "cudaMallocHost failed";
    }
  }
  ~Pinned() {
    if (p) cudaFreeHost(p);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

}  // namespace

TEST_F(Nccl, CallsAreEnqueuedWithoutWaitingAndRunInStreamOrder) {
  auto c = make("outer");
  const int P = g.P, me = g.me;
  const int64_t n = 4099, block = 257;
  Layout l = uneven_layout(P, 3);
  std::vector<std::vector<int64_t>> cnt(P, std::vector<int64_t>(P));
  for (int r = 0; r < P; ++r)
    for (int p = 0; p < P; ++p) cnt[r][p] = 1 + (r * 3 + p * 5) % 4;  // every pair talks
  A2A a = a2a_pattern(P, me, cnt);

  // Device buffers filled with a sentinel, and the real inputs in pinned memory.
  Dev<float> ar(std::vector<float>(n, -1.f)), rs_in(std::vector<float>(block * P, -1.f)),
      rs_out(std::vector<float>(block, -1.f)), ag(std::vector<float>(block * P, -1.f)),
      agv(std::vector<float>(l.extent, -1.f)), a2a_in(std::vector<float>(a.send.size(), -1.f)),
      a2a_out(std::vector<float>(a.expect.size(), -1.f)), bc(std::vector<float>(n, -1.f));
  Dev<int32_t> flag(std::vector<int32_t>{0});
  Pinned<float> h_ar(n), h_rs(block * P), h_ag(block), h_agv(l.counts[me]), h_a2a(a.send.size()), h_bc(n);
  Pinned<int32_t> h_flag(1);
  for (int64_t i = 0; i < n; ++i) h_ar.p[i] = h_bc.p[i] = val(me, i);
  for (int64_t i = 0; i < block * P; ++i) h_rs.p[i] = val(me, i);
  for (int64_t j = 0; j < block; ++j) h_ag.p[j] = val(me, j);
  for (int64_t j = 0; j < l.counts[me]; ++j) h_agv.p[j] = val(me, j);
  std::copy(a.send.begin(), a.send.end(), h_a2a.p);
  h_flag.p[0] = me == 0 ? 3 : 1;

  // Warm-up: NCCL connects peers at their first operation (a host-side
  // handshake); do it for every pattern before the stream is held.
  {
    ar.get();
    c->all_reduce(ar.ptr(), n, ReduceOp::kSum);
    c->all_reduce(flag.ptr(), 1, ReduceOp::kMax);
    c->reduce_scatter(rs_in.ptr(), rs_out.ptr(), block, ReduceOp::kSum);
    c->all_gather(ag.ptr() + me * block, ag.ptr(), block);
    c->all_gather_v(agv.ptr() + l.displs[me], agv.ptr(), l.counts.data(), l.displs.data());
    c->all_to_all_v(a2a_in.ptr(), a.sc.data(), a.sd.data(), a2a_out.ptr(), a.rc.data(), a.rd.data());
    c->broadcast(bc.ptr(), n, P - 1);
    ar.put(std::vector<float>(n, -1.f));
    bc.put(std::vector<float>(n, -1.f));
    flag.put(std::vector<int32_t>{0});
    ar.get();
  }
  MPI_Barrier(MPI_COMM_WORLD);

  Gate gate;
  CUDA_OK(cudaLaunchHostFunc(g.stream, &Gate::hold, &gate));
  // Inputs land after the gate: a collective not ordered on the stream would
  // read the sentinels.
  const auto up = [&](void* dst, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream);
  };
  CUDA_OK(up(ar.ptr(), h_ar.p, n * 4));
  CUDA_OK(up(rs_in.ptr(), h_rs.p, block * P * 4));
  CUDA_OK(up(ag.ptr() + me * block, h_ag.p, block * 4));
  if (l.counts[me]) CUDA_OK(up(agv.ptr() + l.displs[me], h_agv.p, l.counts[me] * 4));
  CUDA_OK(up(a2a_in.ptr(), h_a2a.p, a.send.size() * 4));
  CUDA_OK(up(bc.ptr(), h_bc.p, n * 4));
  CUDA_OK(up(flag.ptr(), h_flag.p, 4));

  c->all_reduce(ar.ptr(), n, ReduceOp::kAvg);
  c->all_reduce(flag.ptr(), 1, ReduceOp::kMax);
  c->reduce_scatter(rs_in.ptr(), rs_out.ptr(), block, ReduceOp::kSum);
  c->all_gather(ag.ptr() + me * block, ag.ptr(), block);
  c->all_gather_v(agv.ptr() + l.displs[me], agv.ptr(), l.counts.data(), l.displs.data());
  c->all_to_all_v(a2a_in.ptr(), a.sc.data(), a.sd.data(), a2a_out.ptr(), a.rc.data(), a.rd.data());
  c->broadcast(bc.ptr(), n, P - 1);
  // Stream order between collectives too: the broadcast result is reduced.
  c->all_reduce(bc.ptr(), n, ReduceOp::kSum);

  // Every call returned while the stream was still held.
  EXPECT_EQ(cudaStreamQuery(g.stream), cudaErrorNotReady);
  gate.release();

  std::vector<float> got_ar = ar.get();  // synchronises the stream
  {
    std::lock_guard<std::mutex> lock(gate.m);
    EXPECT_FALSE(gate.timed_out) << "a call waited for the stream";
  }
  for (int64_t i = 0; i < n; ++i) {
    const float want = reduce_ref(P, i, ReduceOp::kAvg);
    if (power_of_two(P))
      ASSERT_EQ(got_ar[i], want) << "all_reduce i=" << i;
    else
      ASSERT_NEAR(got_ar[i], want, 1e-6f * std::max(1.f, std::abs(want))) << "all_reduce i=" << i;
  }
  EXPECT_EQ(flag.get(), std::vector<int32_t>{3});
  std::vector<float> got_rs = rs_out.get();
  for (int64_t j = 0; j < block; ++j) ASSERT_EQ(got_rs[j], reduce_ref(P, me * block + j, ReduceOp::kSum));
  std::vector<float> got_ag = ag.get();
  for (int r = 0; r < P; ++r)
    for (int64_t j = 0; j < block; ++j) ASSERT_EQ(got_ag[r * block + j], val(r, j)) << "all_gather r=" << r;
  // The gaps between blocks keep the sentinel of this test (-1).
  std::vector<float> want_agv = gathered(l, P);
  for (auto& v : want_agv)
    if (v == -99.f) v = -1.f;
  EXPECT_EQ(agv.get(), want_agv);
  EXPECT_EQ(a2a_out.get(), a.expect);
  std::vector<float> got_bc = bc.get();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got_bc[i], P * val(P - 1, i)) << "broadcast then all_reduce i=" << i;
}

TEST_F(Nccl, AdoptedCommunicator) {
  // The caller's ncclComm_t wrapped, not owned: the adopted kind of the
  // factory. Destroying the wrapper leaves the NCCL communicator alone.
  dion_comm_t adopted = nullptr;
  ASSERT_EQ(dion_comm_adopt_nccl(&adopted, static_cast<ncclComm*>(g.comm->handle)), DION_SUCCESS)
      << dion_last_error(nullptr);
  ASSERT_EQ(adopted->kind, dion::CommKind::kNcclAdopted);
  {
    auto c = make("replicate", adopted);
    EXPECT_EQ(c->size(), g.P);
    EXPECT_EQ(c->rank(), g.me);
    Dev<float> x(std::vector<float>{1.f, static_cast<float>(g.me)});
    c->all_reduce(x.ptr(), 2, ReduceOp::kSum);
    EXPECT_EQ(x.get(), (std::vector<float>{static_cast<float>(g.P), static_cast<float>(g.P * (g.P - 1) / 2)}));
  }
  EXPECT_EQ(dion_comm_destroy(adopted), DION_SUCCESS);
  auto c = make("replicate");
  Dev<float> y(std::vector<float>{2.f});
  c->all_reduce(y.ptr(), 1, ReduceOp::kMax);
  EXPECT_EQ(y.get(), std::vector<float>{2.f});
}

namespace {

ncclResult_t wait_nccl(ncclComm_t nc) {
  ncclResult_t state = ncclInProgress;
  for (;;) {
    ncclResult_t q = ncclCommGetAsyncError(nc, &state);
    if (q != ncclSuccess) return q;
    if (state != ncclInProgress) return state;
    std::this_thread::yield();
  }
}

}  // namespace

TEST_F(Nccl, AdoptedNonBlockingCommunicator) {
  // A communicator created with blocking = 0 answers ncclInProgress until
  // NCCL has launched an operation; the transport waits for the launch (not
  // for the device) so that its calls are on the stream when they return.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  int st = ncclSuccess;
  if (g.me == 0) st = ncclGetUniqueId(&id);
  MPI_Bcast(&st, 1, MPI_INT, 0, MPI_COMM_WORLD);
  ASSERT_EQ(st, ncclSuccess) << ncclGetErrorString(static_cast<ncclResult_t>(st));
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nc = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&nc, g.P, id, g.me, &config);
  if (r == ncclInProgress || r == ncclSuccess) r = wait_nccl(nc);
  int ok = r == ncclSuccess, all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  ASSERT_TRUE(all) << "ncclCommInitRankConfig(blocking = 0): " << ncclGetErrorString(r);

  dion_comm_t adopted = nullptr;
  ASSERT_EQ(dion_comm_adopt_nccl(&adopted, nc), DION_SUCCESS) << dion_last_error(nullptr);
  {
    auto c = make("outer", adopted);
    const int P = g.P, me = g.me;
    std::vector<float> h(1001);
    for (int64_t i = 0; i < 1001; ++i) h[i] = val(me, i);
    Dev<float> buf(h);
    c->all_reduce(buf.ptr(), 1001, ReduceOp::kSum);
    std::vector<float> got = buf.get();
    for (int64_t i = 0; i < 1001; ++i) ASSERT_EQ(got[i], reduce_ref(P, i, ReduceOp::kSum)) << "i=" << i;

    Layout l = uneven_layout(P, 2);
    std::vector<float> mine(l.counts[me]);
    for (int64_t j = 0; j < l.counts[me]; ++j) mine[j] = val(me, j);
    Dev<float> send(mine), recv(std::vector<float>(l.extent, -99.f));
    c->all_gather_v(send.ptr(), recv.ptr(), l.counts.data(), l.displs.data());
    EXPECT_EQ(recv.get(), gathered(l, P));

    std::vector<std::vector<int64_t>> cnt(P, std::vector<int64_t>(P));
    for (int s = 0; s < P; ++s)
      for (int p = 0; p < P; ++p) cnt[s][p] = (s * 3 + p * 5) % 4;
    run_all_to_all(*c, cnt, "non-blocking");
  }
  EXPECT_EQ(dion_comm_destroy(adopted), DION_SUCCESS);
  // Finalize (non-blocking too), then free.
  r = ncclCommFinalize(nc);
  if (r == ncclInProgress || r == ncclSuccess) r = wait_nccl(nc);
  EXPECT_EQ(r, ncclSuccess) << ncclGetErrorString(r);
  r = ncclCommDestroy(nc);  // local once finalized
  EXPECT_TRUE(r == ncclSuccess || r == ncclInProgress) << ncclGetErrorString(r);
}

TEST_F(Nccl, AbortedCommunicatorFailsEveryCallOnEveryRankWithoutHanging) {
  // A communicator of its own: aborting it leaves the shared one usable.
  std::string err;
  dion_comm_t comm = new_nccl_comm(&err);
  ASSERT_NE(comm, nullptr) << err;
  const int P = g.P;
  {
    auto cp = make("inner", comm);
    Collectives& c = *cp;
    Dev<float> x(std::vector<float>(8, 1.f)), big(std::vector<float>(P * 2, 0.f));
    Dev<int32_t> f(std::vector<int32_t>{0});
    c.all_reduce(x.ptr(), 1, ReduceOp::kSum);  // works before the abort
    EXPECT_EQ(x.get()[0], static_cast<float>(P));
    const uint64_t before = c.bytes_total();
    // Every rank aborts (ncclCommAbort: local, it waits for no peer).
    ASSERT_EQ(dion_comm_abort(comm), DION_SUCCESS) << dion_last_error(nullptr);
    std::vector<int64_t> ones(P, 1), iota(P);
    for (int r = 0; r < P; ++r) iota[r] = r;
    const std::vector<std::string> frag = {"inner mesh", "aborted"};
    expect_error([&] { c.all_reduce(x.ptr(), 1, ReduceOp::kSum); }, DION_ERROR_NCCL, frag);
    expect_error([&] { c.all_reduce(f.ptr(), 1, ReduceOp::kMax); }, DION_ERROR_NCCL, frag);
    expect_error([&] { c.reduce_scatter(big.ptr(), x.ptr(), 1, ReduceOp::kSum); }, DION_ERROR_NCCL, frag);
    expect_error([&] { c.all_gather(x.ptr(), big.ptr(), 1); }, DION_ERROR_NCCL, frag);
    expect_error([&] { c.all_gather_v(x.ptr(), big.ptr(), ones.data(), iota.data()); }, DION_ERROR_NCCL, frag);
    expect_error(
        [&] { c.all_to_all_v(big.ptr(), ones.data(), iota.data(), big.ptr() + P, ones.data(), iota.data()); },
        DION_ERROR_NCCL, frag);
    expect_error([&] { c.broadcast(x.ptr(), 1, 0); }, DION_ERROR_NCCL, frag);
    EXPECT_EQ(c.bytes_total(), before);  // failed calls count nothing
    // A new Collectives on the aborted communicator is refused too.
    expect_error([&] { dion::make_collectives(comm, "inner"); }, DION_ERROR_NCCL, frag);
    EXPECT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);  // nothing was left on the stream
  }
  EXPECT_EQ(dion_comm_destroy(comm), DION_SUCCESS);
  // Every rank got here (no rank is stuck in a collective): MPI and the
  // shared NCCL communicator still work.
  int one = 1, sum = 0;
  EXPECT_EQ(MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(sum, P);
  auto c = make("replicate");
  Dev<float> y(std::vector<float>{1.f});
  c->all_reduce(y.ptr(), 1, ReduceOp::kSum);
  EXPECT_EQ(y.get(), std::vector<float>{static_cast<float>(P)});
}

namespace {


// Rank 0 first prints the library, CUDA, NCCL and the world it runs on.
void banner() {
  if (g.me != 0) return;
  const int32_t v = dion_version();
  int rt = 0, drv = 0, nccl = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  ncclGetVersion(&nccl);
  std::printf("libdion %d.%d.%d, NCCL transport suite; CUDA runtime %d, driver %d, NCCL %d\n", v / 10000,
              v / 100 % 100, v % 100, rt, drv, nccl);
  std::printf("%d MPI rank(s), %d CUDA device(s) visible to rank 0\n", g.P, g.ndev);
  cudaDeviceProp p;
  if (g.ndev > 0 && cudaGetDeviceProperties(&p, 0) == cudaSuccess)
    std::printf("device 0: %s (sm_%d%d, %d SMs, %.1f GiB)\n", p.name, p.major, p.minor, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1ull << 30));
  std::fflush(stdout);
}

void set_up_world() {
  MPI_Comm_size(MPI_COMM_WORLD, &g.P);
  MPI_Comm_rank(MPI_COMM_WORLD, &g.me);
  if (cudaGetDeviceCount(&g.ndev) != cudaSuccess) {
    (void)cudaGetLastError();
    g.ndev = 0;
  }
  banner();
  // Every rank must agree: a rank that skipped would leave the others
  // waiting in ncclCommInitRank.
  int enough = g.ndev >= g.P, all = 0;
  MPI_Allreduce(&enough, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all) {
    g.skipped = true;
    g.why = "needs one GPU per rank: " + std::to_string(g.P) + " ranks, " + std::to_string(g.ndev) +
            " GPU(s) visible" + (enough ? " to this rank (fewer to another)" : "");
    return;
  }
  g.dev = g.me % g.ndev;
  cudaError_t e = cudaSetDevice(g.dev);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking);
  int ok = e == cudaSuccess;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!ok) {
    g.why = std::string("CUDA setup failed: ") + cudaGetErrorString(e);
    return;
  }
  std::string err;
  g.comm = new_nccl_comm(&err);
  if (!g.comm) {
    g.why = err;
    return;
  }
  g.ready = true;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  set_up_world();
  print_failures_only_unless_rank0(g.me);
  int rc = RUN_ALL_TESTS();
  if (g.comm) dion_comm_destroy(g.comm);
  if (g.stream) cudaStreamDestroy(g.stream);
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
