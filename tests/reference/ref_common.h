// SPDX-License-Identifier: MIT
//
// tests/reference/ref_common.h — types shared by the reference optimizers:
// hyperparameters, storage dtypes of each state, the per-tensor state, the
// matrix view of an N-d tensor (spec §7.4) and the learning-rate scaling of the
// Muon family (spec §1.1).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ref_linalg.h"
#include "ref_orthogonalize.h"

namespace dionref {

enum class Algo { kDion, kDion2, kMuon, kNorMuon, kNorDion2, kAdamW, kLion };

inline const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kDion:
      return "Dion";
    case Algo::kDion2:
      return "Dion2";
    case Algo::kMuon:
      return "Muon";
    case Algo::kNorMuon:
      return "NorMuon";
    case Algo::kNorDion2:
      return "NorDion2";
    case Algo::kAdamW:
      return "AdamW";
    case Algo::kLion:
      return "Lion";
  }
  return "?";
}

inline bool is_matrix_algo(Algo a) { return a != Algo::kAdamW && a != Algo::kLion; }

enum class AdjustLr { kSpectralNorm, kRmsNorm, kNone };

// Group hyperparameters, one field per mathematical knob of the spec. The
// defaults are microsoft/dion's (spec §2.1, §3.1, §5.1, §1.4). Knobs that only
// choose HOW the library computes the same math (QR method, CQR warm-up, RCQR
// oversampling) are not here: the reference has one exact method for each.
struct Hyper {
  double lr = 0.01;
  double weight_decay = 0.01;
  double mu = 0.95;  // Dion error-feedback keep factor / Muon momentum / NorDion2 ef decay
  double beta1 = 0.9;
  double beta2 = 0.95;
  double epsilon = 1e-8;
  // Dion
  double rank_fraction = 1.0;
  int rank_multiple_of = 1;
  int power_iters = 1;
  // Muon family
  Ortho ortho = Ortho::kPolarExpress;
  int ortho_steps = 5;
  bool nesterov = false;
  AdjustLr adjust_lr = AdjustLr::kSpectralNorm;
  bool cautious_wd = false;
  double fraction = 0.25;  // Dion2 / NorDion2
  double ef_decay = 0.95;  // Dion2
  double muon_beta2 = 0.95;
  bool flatten = false;
};

// Storage dtype of the parameter and of each state (the library's defaults make
// them all the parameter dtype).
struct Dtypes {
  Dtype param = Dtype::kF32;
  Dtype momentum = Dtype::kF32;
  Dtype q = Dtype::kF32;         // Dion's Q
  Dtype variance = Dtype::kF32;  // AdamW's variance; NorMuon/NorDion2's variance_neuron uses `param`
  static Dtypes all(Dtype d) { return Dtypes{d, d, d, d}; }
};

// Everything the reference keeps for one tensor between steps. All vectors are
// flat row-major over the tensor's logical shape and hold values exactly
// representable in their storage dtype.
struct TensorState {
  std::vector<int64_t> shape;
  std::vector<double> x;                // the parameter
  std::vector<double> momentum;         // every algorithm
  std::vector<double> variance;         // AdamW
  std::vector<double> variance_neuron;  // NorMuon / NorDion2: one entry per matrix row
  Matrix<double> q;                     // Dion: (b, r)
};

// How an N-d tensor is seen as a batch of matrices (spec §7.4, libdion's
// per-tensor flatten): the last two dims form the matrix and the leading dims are
// a batch, or with `flatten` (ndim >= 3) the tensor is one (shape[0], prod(rest))
// matrix.
struct MatrixView {
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

inline MatrixView matrix_view(const std::vector<int64_t>& shape, bool flatten) {
  MatrixView v;
  const size_t nd = shape.size();
  if (nd < 2) throw std::invalid_argument("matrix_view: ndim < 2");
  if (flatten && nd >= 3) {
    v.rows = shape[0];
    v.cols = numel(shape) / shape[0];
    return v;
  }
  v.rows = shape[nd - 2];
  v.cols = shape[nd - 1];
  v.batch = numel(shape) / (v.rows * v.cols);
  return v;
}

// Spec §1.1: the learning rate of the orthogonal update of the Muon family, from
// the (global) matrix shape fan_out x fan_in. Weight decay always uses lr.
inline double adjusted_lr(double lr, AdjustLr mode, int64_t fan_out, int64_t fan_in) {
  switch (mode) {
    case AdjustLr::kSpectralNorm:
      return lr * std::sqrt(static_cast<double>(fan_out) / static_cast<double>(fan_in));
    case AdjustLr::kRmsNorm:
      return lr * 0.2 * std::sqrt(static_cast<double>(std::max(fan_out, fan_in)));
    case AdjustLr::kNone:
      return lr;
  }
  return lr;
}

// NorMuon's hard-coded constant (spec §4.2: not the group epsilon).
constexpr double kNeuronEps = 1e-8;

}  // namespace dionref
