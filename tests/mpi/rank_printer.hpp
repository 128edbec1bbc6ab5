// SPDX-License-Identifier: MIT
// For the MPI-launched GoogleTest programs: rank 0 prints the usual progress;
// the other ranks print only their failures, tagged with the rank (without
// it, a failure on one rank alone shows only as a non-zero exit status).
#pragma once
#include <gtest/gtest.h>

#include <cstdio>

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

// Call after InitGoogleTest: ranks other than 0 swap the default printer for
// a RankFailurePrinter.
inline void print_failures_only_unless_rank0(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}
