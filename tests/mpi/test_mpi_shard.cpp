// SPDX-License-Identifier: MIT
// Dion on the shard meshes over MPI on the host backend (spec §2.6; run with
// 2, 4 and 8 ranks). The world is cut into a replicate x outer x inner grid
// (R x O x I = world size); every tensor's matrix dims are sharded over the
// outer (FSDP chunks: ceil(n/O) rows per rank, trailing shards short or
// empty) and inner (even split) meshes, and each replica gets its own
// gradient. Properties asserted against a single-process optimizer on the
// global matrices driven by the replica-averaged gradient:
//  - every rank's parameter shard equals the matching slice of the
//    reference's parameters: the update X - X0 within 1e-4 normwise
//    relative. The sharded run sums P = B Q over the outer mesh, S P, P^T P
//    and R = B^T P over the inner mesh and the column norms over the outer
//    mesh in a different order than the single process: fp32 reassociation
//    (~1e-7 relative per sum) amplified by the orthogonalization's
//    conditioning, which stays well under 1e-4 for these random matrices;
//  - after dion_sync_for_checkpoint, the momentum and Q shards match the
//    reference's slices to the same tolerance (under compressed replicate
//    sync each replica's momentum is its own; their average is the
//    synchronized momentum);
//  - with rank_fraction < 1 and a replicate mesh the replicate traffic is
//    P and R (compressed), and the shard meshes carry the partial sums;
//  - the orthogonalizations of a batch are split over the outer mesh
//    (outer-sharded matrices) or the replicate mesh (unsharded ones), and
//    the small factorizations of the distributed RCQR of inner-sharded
//    matrices (the QR of S P, the Cholesky of the Gram matrix) over the
//    inner mesh: each rank hands the all-gather only its own slots, read off
//    the exact per-rank byte counters (ShardSplit; derivation there);
//  - shards that do not tile a dim, and metadata that differs between the
//    ranks of a shard mesh, fail dion_add_group on every rank with a message
//    naming the problem, and nothing is added.
#include "shard_harness.hpp"
#include "mpi_harness_main.hpp"

int main(int argc, char** argv) { return mpi_harness_main(argc, argv, false); }
