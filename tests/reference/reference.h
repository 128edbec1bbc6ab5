// SPDX-License-Identifier: MIT
//
// tests/reference/reference.h — the float64 "textbook" oracles of every libdion
// algorithm (STYLE.md §D.16), behind one small class per tensor:
//
//   dionref::TensorReference<double> ref(Algo::kMuon, hyper, shape, dtypes, x0);
//   ref.step(grad);          // one optimizer step; the step counter advances
//   ref.state().x / .momentum / .variance / .variance_neuron / .q
//
// The algorithms live one per header (ref_dion.h, ref_muon.h, ref_dion2.h,
// ref_scalar.h); each states the equations it implements at its top. The
// references compute in T and round every value kept between steps
// (parameter and states) to its storage dtype, exactly where the library
// stores it; within a step the unrounded working values are used.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ref_common.h"
#include "ref_dion.h"
#include "ref_dion2.h"
#include "ref_linalg.h"
#include "ref_muon.h"
#include "ref_orthogonalize.h"
#include "ref_scalar.h"

namespace dionref {

template <class T>
class TensorReference {
 public:
  // `x0` must already be representable in dtypes.param (it is rounded again
  // anyway). For Dion, `q0` is the initial (b x r) Q as read from the library.
  TensorReference(Algo algo, const Hyper& hyper, std::vector<int64_t> shape, const Dtypes& dtypes,
                  const std::vector<double>& x0, const Matrix<double>& q0 = Matrix<double>())
      : algo_(algo), hyper_(hyper), dtypes_(dtypes) {
    s_.shape = std::move(shape);
    const int64_t n = numel(s_.shape);
    if (static_cast<int64_t>(x0.size()) != n) throw std::invalid_argument("TensorReference: x0 size");
    s_.x = x0;
    round_all(dtypes_.param, s_.x);
    s_.momentum.assign(static_cast<size_t>(n), 0.0);
    if (algo == Algo::kAdamW) s_.variance.assign(static_cast<size_t>(n), 0.0);
    if (algo == Algo::kNorMuon || algo == Algo::kNorDion2) {
      const MatrixView mv = matrix_view(s_.shape, hyper_.flatten);
      s_.variance_neuron.assign(static_cast<size_t>(mv.batch * mv.rows), 0.0);
    }
    if (algo == Algo::kDion) {
      if (s_.shape.size() != 2) throw std::invalid_argument("TensorReference: Dion needs 2-D");
      int64_t b = 0, r = 0;
      dion_q_shape(s_.shape[0], s_.shape[1], hyper_.rank_fraction, hyper_.rank_multiple_of, &b, &r);
      if (q0.rows != b || q0.cols != r) throw std::invalid_argument("TensorReference: q0 shape");
      s_.q = q0;
      round_all(dtypes_.q, s_.q.v);
    }
  }

  // One step: the group step counter advances first (AdamW uses the new value).
  void step(const std::vector<double>& g) {
    if (g.size() != s_.x.size()) throw std::invalid_argument("TensorReference::step: grad size");
    ++step_;
    switch (algo_) {
      case Algo::kDion:
        dion_step<T>(s_, g, hyper_, dtypes_, cholesky_after_ >= 0 && step_ > cholesky_after_);
        break;
      case Algo::kMuon:
        muon_step<T>(s_, g, hyper_, dtypes_, false);
        break;
      case Algo::kNorMuon:
        muon_step<T>(s_, g, hyper_, dtypes_, true);
        break;
      case Algo::kDion2:
        dion2_step<T>(s_, g, hyper_, dtypes_, false);
        break;
      case Algo::kNorDion2:
        dion2_step<T>(s_, g, hyper_, dtypes_, true);
        break;
      case Algo::kAdamW:
        adamw_step<T>(s_, g, hyper_, dtypes_, step_);
        break;
      case Algo::kLion:
        lion_step<T>(s_, g, hyper_, dtypes_);
        break;
    }
  }

  Hyper& hyper() { return hyper_; }  // change lr etc.; takes effect at the next step
  // Dion: orthogonalize by Cholesky QR (ref_linalg.h) at the steps after
  // `step` (-1: never), as the library's CQR does after its warm-up; for the
  // naive fp32 run only.
  void use_cholesky_qr_after(int64_t step) { cholesky_after_ = step; }
  const TensorState& state() const { return s_; }
  int64_t step_count() const { return step_; }

 private:
  Algo algo_;
  Hyper hyper_;
  Dtypes dtypes_;
  TensorState s_;
  int64_t step_ = 0;
  int64_t cholesky_after_ = -1;
};

}  // namespace dionref
