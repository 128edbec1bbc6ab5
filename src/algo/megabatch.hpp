// SPDX-License-Identifier: MIT
// The megabatch engine of Muon, NorMuon, Dion2 and NorDion2 (spec §7.3):
// moves the matrices of a batch so that each rank holds whole matrices of
// its share of the batch, and moves the results back.
//
// A batch holds B matrices ("slots", slot-major in every buffer). Sharded
// over the outer (FSDP) and/or inner (TP) mesh, it is unsharded one mesh at
// a time ("levels"): first over the inner mesh, then over the outer one.
// At each level the slots are split into contiguous, balanced ranges over
// the mesh's W ranks (rank q owns slots [q B / W, (q+1) B / W); the
// reference pads the batch to W ceil(B/W) slots instead), one all_to_all_v
// sends every rank's piece of each slot to the slot's owner, and the owner
// pastes the pieces along the sharded dim in mesh rank order (copy2d). The
// pieces may be uneven or empty (Tensor::shard_ext): nothing is padded. The
// next level splits the slots the rank now owns over the next mesh; every
// rank of that mesh owns the same slots, since the meshes form a grid (its
// ranks share their position on the other mesh). After the last level the
// rank owns whole matrices; backward() undoes each level with a second
// all_to_all_v, so every rank gets its pieces of the results.
//
// Matrices that are whole on every rank but replicated over a multi-rank
// replicate mesh (spec §7.3 case B) have one "replicated" level: each rank
// works in place on its range of slots, and backward() all-gathers them.
// A sharded tensor does not split its work over the replicate mesh too: its
// replicas each unshard over the shard meshes.
//
// A buffer crossing the levels is described by its piece of one slot
// (MbPiece): row-major dims, and per level the dim sharded over that level's
// mesh (or none: the piece is replicated over that mesh, each rank already
// holds it whole; backward() all-gathers the owner's version).
#pragma once
#include <cstdint>
#include <limits>
#include <vector>

#include "common.hpp"

namespace dion {

struct MbLevel {
  Collectives* comm = nullptr;  // null when only sizing workspace
  int32_t size = 1, rank = 0;
  int32_t mesh = -1;  // index into Tensor::shard_off/shard_ext (0 outer, 1 inner); -1: the replicate mesh
  int32_t tdim = -1;  // the tensor dim sharded over the mesh; -1: replicated
};

struct MbPlan {
  int levels = 0;
  MbLevel lv[2];
  bool sharded() const { return levels > 0 && lv[0].tdim >= 0; }
};

// The levels of a batch of `slots` matrices shaped like tensor t (a matrix
// dim sharded over a multi-rank outer or inner mesh: inner first, then
// outer; batch dims need no communication, spec §7.1), or the replicate mesh
// alone when no matrix dim is sharded and there are several matrices (one
// is orthogonalized redundantly, spec §7.3 case C). opt == nullptr sizes the
// shard levels from t's tables and adds no replicate level (it needs no
// workspace).
MbPlan megabatch_plan(const Optimizer* opt, const Tensor& t, bool flatten, int64_t slots);

// Workspace bounds must be the same on every rank (a batch is cut by its
// bound, and every rank must cut it alike): the largest local extent of dim
// d over the ranks of the meshes sharding it, and the sizes built from it.
int64_t max_local_extent(const Tensor& t, int d);
int64_t max_local_numel(const Tensor& t);
int64_t max_local_batch(const Tensor& t, bool flatten);  // matrices per tensor

// Whether the logical dim `tdim` of t indexes the rows of its matrices
// (flatten: dim 0; otherwise dim ndim - 2).
inline bool is_row_dim(const Tensor& t, bool flatten, int32_t tdim) {
  return tdim == ((flatten && t.ndim >= 3) ? 0 : t.ndim - 2);
}

struct MbPiece {
  int32_t nd = 0;
  int64_t dims[DION_MAX_DIMS] = {1, 1, 1, 1};  // this rank's piece of one slot, row-major
  int32_t axis[2] = {-1, -1};                  // per level: the dim sharded over its mesh, -1: replicated
  // Per level: mesh rank q's extent of that dim is min(cap, mult * (*ext)[q]).
  const std::vector<int64_t>* ext[2] = {nullptr, nullptr};
  int64_t mult[2] = {1, 1};
  int64_t cap[2] = {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max()};

  int64_t extent(int l, int q) const;
  int64_t numel() const;
  // The piece as a matrix: dims[0] x prod(dims[1..]).
  int64_t rows() const { return dims[0]; }
  int64_t cols() const { return numel() / (dims[0] ? dims[0] : 1); }
};

// Pieces of the usual buffers. matrix_piece: one matrix of the tensor
// (storage srows x scols; with flatten, the tensor's local dims), sharded at
// each level along the level's dim. neuron_piece: one value per logical row
// (NorMuon's variance_neuron), sharded where the rows are and replicated
// over a mesh that shards the columns.
MbPiece matrix_piece(const Tensor& t, const MbPlan& plan, bool flatten);
MbPiece neuron_piece(const Tensor& t, const MbPlan& plan, bool flatten);

// The piece with every sharded dim at its largest extent over the ranks.
MbPiece largest_piece(const MbPlan& plan, const MbPiece& piece);

// What an exchange of `slots` pieces needs on the rank that needs the most.
struct MbSizes {
  size_t ws_floats = 0;  // the engine's own workspace
  int64_t owned = 0;     // slots owned after the last level
  MbPiece whole;         // dims of an owned slot
};
MbSizes megabatch_sizes(const MbPlan& plan, const MbPiece& piece, int64_t slots);

// One buffer's trip through the levels. Workspace is taken in forward().
class Unshard {
 public:
  Unshard(Optimizer& opt, const MbPlan& plan, const MbPiece& piece, int64_t slots)
      : opt_(opt), plan_(plan), piece_(piece), slots_(slots) {}
  // `local` holds this rank's `slots` pieces. Returns the owned slots, whole
  // (count() of them, dims whole().dims): workspace, or for a replicated
  // level a range of `local` itself. Collective over the levels' meshes.
  float* forward(float* local);
  int64_t count() const { return owned_; }
  const MbPiece& whole() const { return whole_; }
  // Sends the owned slots, as modified since forward(), back: every rank's
  // pieces land in `local` (laid out as forward's input; it may be another
  // buffer than forward's). May be called more than once (with the owned
  // slots rewritten in between). Collective.
  void backward(float* local);
  // forward() and backward() in two parts each, for a step that defers the
  // collectives (SideComm): send() takes the workspace and runs every level
  // but the last one's paste, paste() pastes the last level's pieces and
  // returns the owned slots (forward = send + paste); cut() stages the last
  // level's pieces for the way back, send_back() runs its collective and the
  // other levels whole (backward = cut + send_back). With one level, send()
  // and send_back() issue collectives only; paste() and cut() compute only.
  void send(float* local);
  float* paste();
  void cut(float* local);
  void send_back(float* local);

 private:
  float* paste_level(int l);
  void back_counts(int l);
  void cut_level(int l, float* local);
  void send_level_back(int l, float* local);
  struct Lv {
    float* out = nullptr;    // the owned slots after this level
    float* stage = nullptr;  // the all_to_all_v receive / send buffer
    int64_t slots = 0, first = 0, count = 0;
    int64_t P = 1, Q = 1, full = 0, in_piece = 0;
  };
  Optimizer& opt_;
  MbPlan plan_;
  MbPiece piece_, whole_;
  int64_t slots_, owned_ = 0;
  Lv lv_[2];
};

}  // namespace dion
