// SPDX-License-Identifier: MIT
// dion::Collectives over MPI (src/comm), run under mpiexec with 2, 4 and 8
// ranks. Every rank can compute every rank's input from (rank, index), so
// each collective is checked against a reference computed locally. Inputs are
// small multiples of 0.5, so every sum is exact whatever order MPI reduces
// in, and the results are compared bit for bit.
#include <cmath>
#include <gtest/gtest.h>
#include <mpi.h>

#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "api/comm.hpp"
#include "comm/collectives.hpp"
#include "dion_mpi.h"
#include "rank_printer.hpp"

using dion::CollKind;
using dion::Collectives;
using dion::ReduceOp;

namespace {

int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Rank r's input element i: a multiple of 0.5 in [-5.5, 5.5].
float val(int r, int64_t i) { return static_cast<float>(((r * 131 + i * 7) % 23) - 11) * 0.5f; }

// A dion_comm_t over MPI_COMM_WORLD and the Collectives made from it.
struct World {
  dion_comm_t comm = nullptr;
  std::unique_ptr<Collectives> coll;
  explicit World(const char* mesh = "replicate") {
    EXPECT_EQ(dion_comm_from_mpi(&comm, MPI_COMM_WORLD), DION_SUCCESS) << dion_last_error(nullptr);
    coll = dion::make_collectives(comm, mesh);
  }
  ~World() {
    coll.reset();  // before the dion_comm_t it reads
    dion_comm_destroy(comm);
  }
};

float reduce_ref(int P, int64_t i, ReduceOp op) {
  float s = 0.f, m = val(0, i);
  for (int r = 0; r < P; ++r) {
    s += val(r, i);  // exact: small multiples of 0.5
    m = std::max(m, val(r, i));
  }
  if (op == ReduceOp::kMax) return m;
  return op == ReduceOp::kAvg ? s / static_cast<float>(P) : s;
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

}  // namespace

TEST(MpiCollectives, SizeAndRank) {
  World w;
  EXPECT_EQ(w.coll->size(), world_size());
  EXPECT_EQ(w.coll->rank(), world_rank());
  EXPECT_EQ(w.coll->mesh(), "replicate");
}

TEST(MpiCollectives, AllReduceFloat) {
  World w;
  const int P = world_size(), me = world_rank();
  for (int64_t n : {0, 1, 7, 1001}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      std::vector<float> buf(n);
      for (int64_t i = 0; i < n; ++i) buf[i] = val(me, i);
      w.coll->all_reduce(n ? buf.data() : nullptr, n, op);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(buf[i], reduce_ref(P, i, op)) << "n=" << n << " op=" << dion::reduce_op_name(op) << " i=" << i;
    }
  }
}

TEST(MpiCollectives, AllReduceInt32Flags) {
  World w;
  const int P = world_size(), me = world_rank();
  // Only the last rank saw a non-finite gradient: every rank learns it.
  int32_t flag = me == P - 1 ? 1 : 0;
  w.coll->all_reduce(&flag, 1, ReduceOp::kMax);
  EXPECT_EQ(flag, 1);
  int32_t none = 0;
  w.coll->all_reduce(&none, 1, ReduceOp::kMax);
  EXPECT_EQ(none, 0);
  std::vector<int32_t> v = {me, 1, -me};
  w.coll->all_reduce(v.data(), 3, ReduceOp::kSum);
  EXPECT_EQ(v[0], P * (P - 1) / 2);
  EXPECT_EQ(v[1], P);
  EXPECT_EQ(v[2], -P * (P - 1) / 2);
  expect_error([&] { w.coll->all_reduce(v.data(), 3, ReduceOp::kAvg); }, DION_ERROR_INTERNAL, {"replicate", "avg"});
}

// Doubles: values no float holds (2^600) and sums whose last bits a float
// would drop (1 + k 2^-40); every sum is exact in double whatever the order.
TEST(MpiCollectives, AllReduceDouble) {
  World w;
  const int P = world_size(), me = world_rank();
  const double big = std::ldexp(1.0, 600), tiny = std::ldexp(1.0, -40);
  std::vector<double> v = {(me + 1) * big, 1.0 + me * tiny, -0.5 * me};
  w.coll->all_reduce(v.data(), 3, ReduceOp::kSum);
  EXPECT_EQ(v[0], P * (P + 1) / 2 * big);
  EXPECT_EQ(v[1], P + P * (P - 1) / 2 * tiny);
  EXPECT_EQ(v[2], -0.25 * P * (P - 1));
  std::vector<double> m = {(me + 1) * big, -1.0 - me * tiny};
  w.coll->all_reduce(m.data(), 2, ReduceOp::kMax);
  EXPECT_EQ(m[0], P * big);
  EXPECT_EQ(m[1], -1.0);
  w.coll->all_reduce(static_cast<double*>(nullptr), 0, ReduceOp::kSum);
  expect_error([&] { w.coll->all_reduce(v.data(), 3, ReduceOp::kAvg); }, DION_ERROR_INTERNAL, {"replicate", "avg"});
}

TEST(MpiCollectives, ReduceScatter) {
  World w("outer");
  const int P = world_size(), me = world_rank();
  for (int64_t block : {0, 1, 5}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<float> send(block * P), recv(block, -99.f);
      for (int64_t i = 0; i < block * P; ++i) send[i] = val(me, i);
      w.coll->reduce_scatter(block ? send.data() : nullptr, block ? recv.data() : nullptr, block, op);
      for (int64_t j = 0; j < block; ++j)
        ASSERT_EQ(recv[j], reduce_ref(P, me * block + j, op)) << "block=" << block << " j=" << j;
    }
  }
}

TEST(MpiCollectives, AllGather) {
  World w("outer");
  const int P = world_size(), me = world_rank();
  for (int64_t block : {0, 1, 3}) {
    std::vector<float> send(block), recv(block * P, -99.f);
    for (int64_t j = 0; j < block; ++j) send[j] = val(me, j);
    w.coll->all_gather(block ? send.data() : nullptr, block ? recv.data() : nullptr, block);
    for (int r = 0; r < P; ++r)
      for (int64_t j = 0; j < block; ++j) ASSERT_EQ(recv[r * block + j], val(r, j)) << "block=" << block;
    // In place: this rank's block already sits in recv.
    std::vector<float> inplace(block * P, -99.f);
    for (int64_t j = 0; j < block; ++j) inplace[me * block + j] = val(me, j);
    w.coll->all_gather(block ? inplace.data() + me * block : nullptr, block ? inplace.data() : nullptr, block);
    EXPECT_EQ(inplace, recv);
  }
}

TEST(MpiCollectives, AllGatherUneven) {
  World w("inner");
  const int P = world_size(), me = world_rank();
  // Counts 2, 3, 0, 1, 2, 3, 0, 1 ...: zeros included; a one-element gap
  // between blocks checks the displacements are honoured.
  std::vector<int64_t> counts(P), displs(P);
  int64_t off = 0;
  for (int r = 0; r < P; ++r) {
    counts[r] = (r + 2) % 4;
    displs[r] = off;
    off += counts[r] + 1;
  }
  std::vector<float> send(counts[me]);
  for (int64_t j = 0; j < counts[me]; ++j) send[j] = val(me, j);
  std::vector<float> recv(off, -99.f);
  w.coll->all_gather_v(send.empty() ? nullptr : send.data(), recv.data(), counts.data(), displs.data());
  std::vector<float> expect(off, -99.f);
  for (int r = 0; r < P; ++r)
    for (int64_t j = 0; j < counts[r]; ++j) expect[displs[r] + j] = val(r, j);
  EXPECT_EQ(recv, expect);
  // In place.
  std::vector<float> inplace(off, -99.f);
  for (int64_t j = 0; j < counts[me]; ++j) inplace[displs[me] + j] = val(me, j);
  w.coll->all_gather_v(inplace.data() + displs[me], inplace.data(), counts.data(), displs.data());
  EXPECT_EQ(inplace, expect);
  // Every count zero: a valid no-op that still completes on every rank.
  std::vector<int64_t> zeros(P, 0);
  w.coll->all_gather_v(nullptr, nullptr, zeros.data(), zeros.data());
}

// The element rank `from` sends to rank `to` at position j: unique and exact.
float a2a_val(int from, int to, int64_t j) { return static_cast<float>(from * 10000 + to * 100 + j); }

void run_all_to_all(Collectives& c, const std::vector<std::vector<int64_t>>& cnt /*[from][to]*/) {
  const int P = c.size(), me = c.rank();
  std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
  int64_t soff = 0, roff = 0;
  for (int p = 0; p < P; ++p) {
    sc[p] = cnt[me][p];
    sd[p] = soff;
    soff += sc[p];
    rc[p] = cnt[p][me];
    rd[p] = roff;
    roff += rc[p];
  }
  std::vector<float> send(soff), recv(roff, -1.f);
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < sc[p]; ++j) send[sd[p] + j] = a2a_val(me, p, j);
  c.all_to_all_v(soff ? send.data() : nullptr, sc.data(), sd.data(), roff ? recv.data() : nullptr, rc.data(), rd.data());
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < rc[p]; ++j) ASSERT_EQ(recv[rd[p] + j], a2a_val(p, me, j)) << "from " << p << " j=" << j;
}

TEST(MpiCollectives, AllToAllUneven) {
  World w("outer");
  const int P = world_size();
  std::vector<std::vector<int64_t>> cnt(P, std::vector<int64_t>(P));
  // Unsharding: a matrix of `rows` rows x 3 columns per destination, its rows
  // split over the ranks as evenly as possible (18 over 8: 3,3,2,2,2,2,2,2;
  // 3 over 4 or 8: some ranks hold no row). Rank p receives every rank's
  // shard of matrix p.
  for (int64_t rows : {18, 3}) {
    for (int r = 0; r < P; ++r)
      for (int p = 0; p < P; ++p) cnt[r][p] = (rows / P + (r < rows % P ? 1 : 0)) * 3;
    run_all_to_all(*w.coll, cnt);
  }
  // An irregular pattern with zeros in both directions.
  for (int r = 0; r < P; ++r)
    for (int p = 0; p < P; ++p) cnt[r][p] = (r * 3 + p * 5) % 4;
  run_all_to_all(*w.coll, cnt);
  // Nothing at all.
  for (auto& row : cnt) std::fill(row.begin(), row.end(), 0);
  run_all_to_all(*w.coll, cnt);
}

TEST(MpiCollectives, Broadcast) {
  World w;
  const int P = world_size(), me = world_rank();
  for (int64_t n : {0, 1, 9}) {
    for (int root : {0, P - 1}) {
      std::vector<float> buf(n);
      for (int64_t i = 0; i < n; ++i) buf[i] = val(me, i);
      w.coll->broadcast(n ? buf.data() : nullptr, n, root);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(buf[i], val(root, i)) << "n=" << n << " root=" << root;
    }
  }
  float x = 0.f;
  expect_error([&] { w.coll->broadcast(&x, 1, P); }, DION_ERROR_INTERNAL, {"replicate mesh: broadcast", "root"});
}

TEST(MpiCollectives, ByteCounters) {
  World w;
  Collectives& c = *w.coll;
  const int P = world_size(), me = world_rank();
  EXPECT_EQ(c.bytes_total(), 0u);
  std::vector<float> buf(64 * P, 1.f), out(64 * P, 0.f);
  int32_t flags[3] = {0, 0, 0};
  c.all_reduce(buf.data(), 10, ReduceOp::kSum);           // 40
  c.all_reduce(flags, 3, ReduceOp::kMax);                 // 12
  c.reduce_scatter(buf.data(), out.data(), 2, ReduceOp::kAvg);  // P * 2 * 4
  c.all_gather(buf.data(), out.data(), 3);                // 12
  std::vector<int64_t> counts(P), displs(P);
  int64_t off = 0;
  for (int r = 0; r < P; ++r) {
    counts[r] = r + 1;
    displs[r] = off;
    off += counts[r];
  }
  c.all_gather_v(buf.data(), out.data(), counts.data(), displs.data());  // (me + 1) * 4
  // all_to_all_v: rank r sends p + 1 elements to rank p, so receives me + 1 from each.
  std::vector<int64_t> sc(P), sd(P), rc(P, me + 1), rd(P);
  off = 0;
  for (int p = 0; p < P; ++p) {
    sc[p] = p + 1;
    sd[p] = off;
    off += sc[p];
    rd[p] = p * (me + 1);
  }
  c.all_to_all_v(buf.data(), sc.data(), sd.data(), out.data(), rc.data(), rd.data());  // P(P+1)/2 * 4
  c.broadcast(buf.data(), 5, 0);  // 20 on the root, 0 elsewhere

  const uint64_t ar = 40 + 12, rs = P * 2 * 4, ag = 12 + (me + 1) * 4, a2a = P * (P + 1) / 2 * 4,
                 bc = me == 0 ? 20 : 0;
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
  for (int k = 0; k < static_cast<int>(CollKind::kCount); ++k)
    EXPECT_EQ(c.bytes_last_step(static_cast<CollKind>(k)), 0u);
  c.all_reduce(buf.data(), 1, ReduceOp::kAvg);
  EXPECT_EQ(c.bytes_last_step(), 4u);
  EXPECT_EQ(c.bytes_last_step(CollKind::kAllReduce), 4u);
  EXPECT_EQ(c.bytes_total(CollKind::kAllReduce), ar + 4);
  EXPECT_EQ(c.bytes_total(), ar + rs + ag + a2a + bc + 4);
  // Zero-sized calls count nothing.
  c.all_reduce(static_cast<float*>(nullptr), 0, ReduceOp::kSum);
  EXPECT_EQ(c.bytes_last_step(), 4u);
}

TEST(MpiCollectives, AbortedCommunicatorFailsEveryCallOnEveryRank) {
  World w("inner");
  Collectives& c = *w.coll;
  const int P = world_size();
  float x[8] = {};
  int32_t f = 0;
  c.all_reduce(x, 1, ReduceOp::kSum);  // works before the abort
  const uint64_t before = c.bytes_total();
  ASSERT_EQ(dion_comm_abort(w.comm), DION_SUCCESS);
  std::vector<int64_t> ones(P, 1), iota(P);
  for (int r = 0; r < P; ++r) iota[r] = r;
  std::vector<float> big(P * 2);
  const std::vector<std::string> frag = {"inner mesh", "aborted"};
  expect_error([&] { c.all_reduce(x, 1, ReduceOp::kSum); }, DION_ERROR_MPI, frag);
  expect_error([&] { c.all_reduce(&f, 1, ReduceOp::kMax); }, DION_ERROR_MPI, frag);
  expect_error([&] { c.reduce_scatter(big.data(), x, 1, ReduceOp::kSum); }, DION_ERROR_MPI, frag);
  expect_error([&] { c.all_gather(x, big.data(), 1); }, DION_ERROR_MPI, frag);
  expect_error([&] { c.all_gather_v(x, big.data(), ones.data(), iota.data()); }, DION_ERROR_MPI, frag);
  expect_error([&] { c.all_to_all_v(big.data(), ones.data(), iota.data(), big.data() + P, ones.data(), iota.data()); },
               DION_ERROR_MPI, frag);
  expect_error([&] { c.broadcast(x, 1, 0); }, DION_ERROR_MPI, frag);
  EXPECT_EQ(c.bytes_total(), before);  // failed calls count nothing
  // A new Collectives on the aborted communicator is refused too (without
  // the collective MPI_Comm_dup a dead peer would never join).
  expect_error([&] { dion::make_collectives(w.comm, "inner"); }, DION_ERROR_MPI, frag);
  // Every rank got here (no rank is stuck in a collective): the world still works.
  int one = 1, sum = 0;
  EXPECT_EQ(MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD), MPI_SUCCESS);
  EXPECT_EQ(sum, P);
}

TEST(MpiCollectives, CountAboveIntMaxIsRefusedWithoutCommunicating) {
  World w;
  Collectives& c = *w.coll;
  const int P = world_size(), me = world_rank();
  const int64_t huge = static_cast<int64_t>(INT_MAX) + 1;
  // The buffers are one element: the count is refused before anything reads them.
  float x = 0.f;
  int32_t f = 0;
  const std::vector<std::string> frag = {"replicate mesh", "INT_MAX"};
  expect_error([&] { c.all_reduce(&x, huge, ReduceOp::kSum); }, DION_ERROR_NOT_SUPPORTED, frag);
  expect_error([&] { c.all_reduce(&f, huge, ReduceOp::kMax); }, DION_ERROR_NOT_SUPPORTED, frag);
  expect_error([&] { c.broadcast(&x, huge, 0); }, DION_ERROR_NOT_SUPPORTED, frag);
  // Uneven forms: one other rank's count is too large.
  std::vector<int64_t> counts(P, 0), displs(P, 0);
  counts[(me + 1) % P] = huge;
  expect_error([&] { c.all_gather_v(nullptr, &x, counts.data(), displs.data()); }, DION_ERROR_NOT_SUPPORTED, frag);
  std::vector<int64_t> zeros(P, 0);
  expect_error([&] { c.all_to_all_v(&x, counts.data(), zeros.data(), nullptr, zeros.data(), zeros.data()); },
               DION_ERROR_NOT_SUPPORTED, frag);
  EXPECT_EQ(c.bytes_total(), 0u);
  // Negative counts are a libdion bug, reported as such.
  expect_error([&] { c.all_reduce(&x, -1, ReduceOp::kSum); }, DION_ERROR_INTERNAL, {"replicate mesh", "negative"});
  // The communicator is still in step on every rank.
  x = 1.f;
  c.all_reduce(&x, 1, ReduceOp::kSum);
  EXPECT_EQ(x, static_cast<float>(P));
}

// The bf16 reductions (Dion's phased step on the CUDA backend's bf16 path)
// have no MPI transport: a call fails with DION_ERROR_INTERNAL naming the
// mesh and the operation, communicates nothing, and leaves the communicator
// in step (the host backend never asks for them).
TEST(MpiCollectives, Bf16ReductionsAreRefusedWithoutCommunicating) {
  World w;
  Collectives& c = *w.coll;
  const int P = world_size();
  std::vector<uint16_t> send(static_cast<size_t>(P) * 4, 0x3f80), recv(4, 0);
  expect_error([&] { c.all_reduce_bf16(send.data(), 4, ReduceOp::kSum); }, DION_ERROR_INTERNAL,
               {"replicate mesh", "all_reduce(bf16)", "no bf16 arithmetic"});
  expect_error([&] { c.reduce_scatter_bf16(send.data(), recv.data(), 4, ReduceOp::kAvg); }, DION_ERROR_INTERNAL,
               {"replicate mesh", "reduce_scatter(bf16)", "no bf16 arithmetic"});
  expect_error([&] { c.all_reduce_bf16(send.data(), 4, ReduceOp::kMax); }, DION_ERROR_INTERNAL, {"sum or avg only"});
  EXPECT_EQ(c.bytes_total(), 0u);
  float x = 1.f;
  c.all_reduce(&x, 1, ReduceOp::kSum);
  EXPECT_EQ(x, static_cast<float>(P));
}

TEST(MpiCollectives, NcclCommunicatorsNeedAnNcclBuild) {
  // A stand-in for a wrapped NCCL communicator. This suite's copy of src/comm
  // (dion_comm_internal) is built without NCCL, so the factory refuses it by
  // kind, before touching the handle (tests/nccl drives the NCCL transport).
  dion_comm_s fake;
  fake.kind = dion::CommKind::kNcclAdopted;
  fake.size = 2;
  expect_error([&] { dion::make_collectives(&fake, "outer"); }, DION_ERROR_NOT_SUPPORTED,
               {"outer mesh", "built without NCCL"});
  expect_error([&] { dion::make_collectives(nullptr, "outer"); }, DION_ERROR_INTERNAL, {"outer mesh"});
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  print_failures_only_unless_rank0(world_rank());
  int rc = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
