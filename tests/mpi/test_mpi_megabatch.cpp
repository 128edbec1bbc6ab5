// SPDX-License-Identifier: MIT
// Muon, NorMuon, Dion2 and NorDion2 on the meshes over MPI on the host
// backend (spec §7.3; run with 2, 4 and 8 ranks). The world is cut into a
// replicate x outer x inner grid (R x O x I = world size); the group's
// tensors are sharded over the outer mesh in FSDP chunks (ceil(n/O) per
// rank, trailing shards short or empty: 18 rows over 8 ranks are 3,3,3,3,3,
// 3,0,0) and evenly over the inner mesh, along rows, columns, a leading
// (batch) dim, both matrix dims at once (2-D), or not at all (replicated:
// spec §7.3 case B over the replicate mesh); one is COL_MAJOR, and a second
// group flattens 3-D tensors. Each replica gets its own gradient. After
// three steps, every rank's parameter, momentum and variance_neuron shards
// must equal the matching slices of
//  - a single-process optimizer on the global tensors driven by the
//    replica-averaged gradient, for Muon (with and without Nesterov),
//    NorMuon, and Dion2/NorDion2 with selection_scope global (or local on
//    matrices whose selected dim is whole on every rank: there local is
//    global);
//  - an independent float64 emulation of the per-shard selection (spec
//    §5.3's sharded path: each rank of the selecting mesh picks the top
//    min(cap, its slices) of its own shard, cap = max(1, ceil(fraction
//    ceil(N / W))), and the union is orthogonalized as one matrix) for
//    Dion2/NorDion2 with selection_scope local on sharded matrices.
// Tolerances, normwise relative (the update X - X0 for parameters):
//  - vs the single-process run, 1e-4. The owners orthogonalize the very
//    matrices the single process does, with the same fp32 code, so most
//    results come out bit-identical (as measured with DION_TEST_VERBOSE=1).
//    What may differ: the replica average (MPI sums fp32 gradients in
//    another order than the reference's double average: ~1e-7 relative per
//    element, exact for these two-replica sums of 23-bit values) and
//    Dion2's global-scope update, applied densely on each rank (its
//    lr * lr_adj and 1 - lr wd factors rounded by another op: an ulp of X).
//    A gradient's ulps go through the Polar Express polynomials, iterative
//    in fp32, which amplify input perturbations by their condition number
//    (up to ~200 near rank-1 inputs): worst case ~1e-5, 10x under the bound.
//  - vs the float64 emulation, 2e-4: the library's fp32 iterations against
//    exact arithmetic, on matrices assembled from per-shard picks in another
//    row order, with slice norms summed over the other mesh for 2-D shards;
//    five Polar Express steps in fp32 land ~1e-6..2e-5 from fp64 on these
//    small random matrices (measured ~1.3e-5 at worst; the unit suites'
//    bound for one step is 5e-5 times a naive fp32 implementation's error).
// The byte counters must show all_to_all traffic on every multi-rank shard
// mesh (exactly the documented contiguous slot split for Muon on one shard
// mesh), and the one corner the local selection refuses must fail
// dion_add_group with NOT_SUPPORTED naming the tensor.
#include "megabatch_harness.hpp"
#include "mpi_harness_main.hpp"

int main(int argc, char** argv) { return mpi_harness_main(argc, argv, verbose()); }
