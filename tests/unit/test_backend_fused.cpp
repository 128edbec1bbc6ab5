// SPDX-License-Identifier: MIT
//
// The host backend's fused passes over typed buffers (Backend::momentum_multi,
// apply_update_multi, store_slices_multi, decay_add_slices_multi,
// momentum_l1_multi, select_momentum_multi, frob_normalize_bf16) against the op sequences they replace in the Muon
// family and Dion2 (load_multi, the fp32 ops, store_multi), bit for bit: the
// fused ops promise the same fp32 operations in the same order with the same
// roundings, so there is no tolerance. Every dtype of every field (the
// momentum's dtype differing from the parameter's), odd lengths, several
// tensors per table, and a set skip flag (nothing typed is written).
//
// The Backend classes are internal (libdion.so exports only dion_*): this
// suite compiles the host backend's source itself (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/backend.hpp"
#include "core/dtype.hpp"
#include "core/rng.hpp"

namespace {

using namespace dion;

constexpr dion_dtype_t kDtypes[] = {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16};

// `count` tensors whose fields have the given dtypes, held twice (a and b)
// with the same contents, so one copy runs the old sequence and one the
// fused op.
struct Twin {
  std::vector<std::vector<uint8_t>> a[4], b[4];
  std::vector<TensorEntry> la, lb;

  Twin(std::mt19937& rng, int64_t count, int64_t n, const dion_dtype_t (&dt)[4]) {
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (int f = 0; f < 4; ++f) {
      a[f].resize(static_cast<size_t>(count));
      b[f].resize(static_cast<size_t>(count));
    }
    for (int64_t i = 0; i < count; ++i) {
      TensorEntry ea{}, eb{};
      ea.n = eb.n = n;
      for (int f = 0; f < 4; ++f) {
        std::vector<uint8_t>& buf = a[f][static_cast<size_t>(i)];
        buf.resize(static_cast<size_t>(n) * dtype_size(dt[f]));
        for (int64_t k = 0; k < n; ++k) store_elem(buf.data(), dt[f], k, g(rng));
        b[f][static_cast<size_t>(i)] = buf;
        ea.dtype[f] = eb.dtype[f] = dt[f];
        ea.ptr[f] = buf.data();
        eb.ptr[f] = b[f][static_cast<size_t>(i)].data();
      }
      la.push_back(ea);
      lb.push_back(eb);
    }
  }
  bool same(int f) const { return a[f] == b[f]; }
};

bool same_floats(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// k distinct ascending indices of [0, n) per matrix (what topk returns).
std::vector<int32_t> pick(std::mt19937& rng, int64_t batch, int64_t n, int64_t k) {
  std::vector<int32_t> idx, all(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < n; ++i) all[static_cast<size_t>(i)] = static_cast<int32_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + k);
    idx.insert(idx.end(), all.begin(), all.begin() + k);
  }
  return idx;
}

class HostFused : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be{make_host_backend()};
  std::mt19937 rng{20261122u};
};

// split_bf16: hi is store(BF16) of the value and lo = bf16(x - hi), so
// |x - hi - lo| <= 2^-8 |x - hi| <= 2^-16 |x| (round to nearest, 8
// significant bits each: unit roundoff 2^-8) where x - hi is a normal
// number, and at most half the bf16 subnormal spacing (2^-134) beyond
// that. Values over the whole fp32 range, including subnormals and zeros.
TEST_F(HostFused, SplitBf16PartsSumToTheValue) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-140, 120);
  std::vector<float> x = {0.0f, -0.0f, 1.0f, 1.00390625f, 1.005859375f, 3.0e38f, 1e-40f, -1e-45f};
  while (x.size() < 100000) x.push_back(std::ldexp(g(rng), e(rng)));
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint16_t> hi(x.size()), lo(x.size()), st(x.size());
  be->split_bf16(hi.data(), lo.data(), x.data(), n);
  be->store(st.data(), DION_DTYPE_BF16, x.data(), n);
  EXPECT_EQ(hi, st);
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double h = bf16_to_float(hi[i]), l = bf16_to_float(lo[i]), v = x[i];
    const double err = std::fabs(v - h - l);
    if (err > std::max(std::ldexp(std::fabs(v), -16), std::ldexp(1.0, -134)) && ++bad <= 5)
      ADD_FAILURE() << "x = " << v << ": hi " << h << " + lo " << l << " is off by " << err;
  }
  EXPECT_EQ(bad, 0);
}

// Muon's momentum (mu, nesterov) and Dion2's M += G (mu = 1, M not stored).
TEST_F(HostFused, MomentumMultiEqualsLoadAxpbyStore) {
  const int64_t count = 3, n = 37, N = count * n;
  for (dion_dtype_t dm : kDtypes)
    for (dion_dtype_t dg : kDtypes)
      for (int variant = 0; variant < 4; ++variant)
        for (int32_t skip : {0, 1}) {
          const bool nesterov = variant & 1, store_state = !(variant & 2);
          const float mu = store_state ? 0.95f : 1.0f;
          SCOPED_TRACE(::testing::Message() << dtype_name(dm) << " momentum, " << dtype_name(dg) << " grad, nesterov "
                                            << nesterov << ", store " << store_state << ", skip " << skip);
          Twin tw(rng, count, n, {DION_DTYPE_BF16, dg, dm, DION_DTYPE_FP32});
          const std::vector<std::vector<uint8_t>> before = tw.b[kState0];
          // The old sequence on copy a.
          std::vector<float> M(N), G(N), U(N);
          be->load_multi(M.data(), tw.la.data(), count, kState0, n);
          be->load_multi(G.data(), tw.la.data(), count, kGrad, n);
          be->axpby(mu, G.data(), 1.0f, M.data(), N);
          if (store_state) be->store_multi(tw.la.data(), count, kState0, M.data(), n, &skip);
          if (nesterov)
            be->lincomb(mu, M.data(), 1.0f, G.data(), U.data(), N);
          else
            U = M;
          // The fused op on copy b.
          std::vector<float> U2(N, -1.0f);
          be->momentum_multi(tw.lb.data(), count, n, mu, 1.0f, nesterov, store_state, U2.data(), DION_DTYPE_FP32, &skip,
                             nullptr);
          EXPECT_TRUE(same_floats(U, U2));
          for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
          if (skip || !store_state)
            EXPECT_TRUE(tw.b[kState0] == before) << "the momentum must not be written";
          else
            EXPECT_FALSE(tw.b[kState0] == before);
        }
}

// scale_multi: the bits of load_multi, the product in fp32 and store_multi,
// in every dtype (an odd n, and a scale that rounds in each); a set skip
// flag writes nothing, and the other fields are untouched.
TEST_F(HostFused, ScaleMultiEqualsLoadScaleStore) {
  const int64_t count = 3, n = 37, N = count * n;
  for (dion_dtype_t dt : kDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    Twin tw(rng, count, n, {dt, dt, dt, DION_DTYPE_FP32});
    const float a = 0.95f;
    int32_t skip = 1;
    be->scale_multi(tw.lb.data(), count, kState0, n, a, &skip);
    EXPECT_TRUE(tw.same(kState0)) << "a skipped scale must write nothing";
    std::vector<float> x(static_cast<size_t>(N));
    be->load_multi(x.data(), tw.la.data(), count, kState0, n);
    for (float& v : x) v *= a;
    be->store_multi(tw.la.data(), count, kState0, x.data(), n, nullptr);
    skip = 0;
    const std::vector<std::vector<uint8_t>> before = tw.b[kState0];
    be->scale_multi(tw.lb.data(), count, kState0, n, a, &skip);
    EXPECT_FALSE(tw.b[kState0] == before) << "the scale should change the values";
    for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
  }
}

// u in bf16: the bits of the fp32 u rounded by store (Dion's M + G at matmul
// precision BF16 on the CUDA backend); and store_multi_bf16 equals widening
// its bf16 source and store_multi, into every dtype.
TEST_F(HostFused, MomentumMultiBf16UAndStoreMultiBf16) {
  const int64_t count = 3, n = 37, N = count * n;
  for (dion_dtype_t dm : kDtypes)
    for (dion_dtype_t dg : kDtypes) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dm) << " momentum, " << dtype_name(dg) << " grad");
      Twin tw(rng, count, n, {dm, dg, dm, DION_DTYPE_FP32});
      std::vector<float> U(static_cast<size_t>(N));
      std::vector<uint16_t> want(static_cast<size_t>(N)), got(static_cast<size_t>(N));
      be->momentum_multi(tw.la.data(), count, n, 1.0f, 1.0f, false, false, U.data(), DION_DTYPE_FP32, nullptr, nullptr);
      be->store(want.data(), DION_DTYPE_BF16, U.data(), N);
      be->momentum_multi(tw.lb.data(), count, n, 1.0f, 1.0f, false, false, got.data(), DION_DTYPE_BF16, nullptr,
                         nullptr);
      EXPECT_TRUE(want == got);
      std::vector<float> wide(static_cast<size_t>(N));
      be->load(wide.data(), got.data(), DION_DTYPE_BF16, N);
      int32_t skip = 1;
      const std::vector<std::vector<uint8_t>> before = tw.b[kParam];
      be->store_multi_bf16(tw.lb.data(), count, kParam, got.data(), n, &skip);
      EXPECT_TRUE(tw.b[kParam] == before) << "a skipped store must write nothing";
      skip = 0;
      be->store_multi_bf16(tw.lb.data(), count, kParam, got.data(), n, &skip);
      be->store_multi(tw.la.data(), count, kParam, wide.data(), n, &skip);
      EXPECT_TRUE(tw.same(kParam));
    }
}

// The nonzero flags of u = M + G (mu = 1), in every momentum dtype: a matrix
// all zero, one whose only nonzero is its last element, one of -0 only
// (zero), one with a NaN (nonzero), a random one; equal to nonzero_flags(u).
TEST_F(HostFused, MomentumMultiFlagsNonzeroMatrices) {
  const int64_t count = 5, n = 37;
  for (dion_dtype_t dm : kDtypes) {
    SCOPED_TRACE(dtype_name(dm));
    Twin tw(rng, count, n, {DION_DTYPE_FP32, DION_DTYPE_FP32, dm, DION_DTYPE_FP32});
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t i = 0; i < n; ++i) {
        store_elem(tw.b[kState0][static_cast<size_t>(t)].data(), dm, i, t == 2 ? -0.0f : 0.0f);
        store_elem(tw.b[kGrad][static_cast<size_t>(t)].data(), DION_DTYPE_FP32, i, t == 2 ? -0.0f : 0.0f);
      }
    store_elem(tw.b[kGrad][1].data(), DION_DTYPE_FP32, n - 1, 1.0f);
    store_elem(tw.b[kState0][3].data(), dm, n / 2, std::nanf(""));
    std::vector<float> U(static_cast<size_t>(count * n));
    std::vector<int32_t> flags(static_cast<size_t>(count), 0), ref(static_cast<size_t>(count), -1);
    be->momentum_multi(tw.lb.data(), count, n, 1.0f, 1.0f, false, false, U.data(), DION_DTYPE_FP32, nullptr,
                       flags.data());
    be->nonzero_flags(ConstMatBatch(U.data(), 1, n, n, n, count), ref.data());
    EXPECT_EQ(flags, (std::vector<int32_t>{0, 1, 0, 1, 1}));
    EXPECT_EQ(flags, ref);
  }
}

// u in fp32, or the bf16 iteration's result (the old sequence widened it first).
TEST_F(HostFused, ApplyUpdateMultiEqualsLoadUpdateStore) {
  const int64_t count = 3, n = 29, N = count * n;
  GroupScalars gs{0.02, 0.1, 0.9, 0.99, 3, 0};
  for (dion_dtype_t dx : kDtypes)
    for (dion_dtype_t du : {DION_DTYPE_FP32, DION_DTYPE_BF16})
      for (bool cautious : {false, true})
        for (int32_t skip : {0, 1}) {
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(dx) << " u " << dtype_name(du) << " cautious " << cautious << " skip " << skip);
          Twin tw(rng, count, n, {dx, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_DTYPE_FP32});
          const std::vector<std::vector<uint8_t>> before = tw.a[kParam];
          std::vector<float> U(N), X(N);
          std::normal_distribution<float> g(0.0f, 1.0f);
          for (auto& u : U) u = g(rng);
          std::vector<uint16_t> Ub(N);
          be->store(Ub.data(), DION_DTYPE_BF16, U.data(), N);
          if (du == DION_DTYPE_BF16) be->load(U.data(), Ub.data(), DION_DTYPE_BF16, N);
          be->load_multi(X.data(), tw.la.data(), count, kParam, n);
          be->apply_update(X.data(), U.data(), N, &gs, 0.7f, cautious);
          be->store_multi(tw.la.data(), count, kParam, X.data(), n, &skip);
          const void* u = du == DION_DTYPE_BF16 ? static_cast<const void*>(Ub.data()) : U.data();
          be->apply_update_multi(tw.lb.data(), count, n, u, du, &gs, 0.7f, cautious, &skip);
          EXPECT_TRUE(tw.same(kParam));
          if (skip) EXPECT_TRUE(tw.b[kParam] == before) << "a skipped step wrote the parameters";
        }
}

// The host's randn draws each row of a window from the Philox blocks that
// cover it (four normals per block): every element must equal philox_normal
// of its global index, bit for bit, for windows whose rows start anywhere in
// a block (col0 and global_cols not multiples of 4, rows shorter than a
// block, whole matrices), with the key's tensor and step taken from the
// tensor list and the step pointer when given.
TEST_F(HostFused, RandnWindowsEqualPhiloxNormalPerElement) {
  struct Win {
    int64_t batch, rows, cols, row0, col0, gcols;
  };
  const PhiloxKey key{0x0123456789abcdefull, kRngSketch | (2u << 8), 5, 9};
  std::vector<TensorEntry> list(3);
  for (size_t i = 0; i < list.size(); ++i) list[i].tensor_id = static_cast<uint32_t>(7 * i + 3);
  const int64_t step = 123;
  for (const Win w : {Win{2, 5, 7, 1, 3, 13}, Win{3, 4, 2, 0, 1, 3}, Win{1, 6, 16, 2, 0, 16}, Win{2, 3, 9, 0, 6, 15},
                      Win{3, 8, 1, 3, 2, 5}})
    for (bool keyed : {false, true}) {
      SCOPED_TRACE(::testing::Message() << w.rows << "x" << w.cols << " at (" << w.row0 << ", " << w.col0 << ") of "
                                        << w.gcols << " columns, keyed " << keyed);
      std::vector<float> out(static_cast<size_t>(w.batch * w.rows * w.cols), -1.0f);
      be->randn(out.data(), w.batch, w.rows, w.cols, w.row0, w.col0, w.gcols, key, keyed ? list.data() : nullptr,
                keyed ? &step : nullptr, 0.25f);
      for (int64_t b = 0; b < w.batch; ++b) {
        PhiloxKey k = key;
        if (keyed) {
          k.tensor = list[static_cast<size_t>(b)].tensor_id;
          k.step = static_cast<uint64_t>(step);
        }
        for (int64_t i = 0; i < w.rows; ++i)
          for (int64_t j = 0; j < w.cols; ++j) {
            const float want = 0.25f * philox_normal(k, static_cast<uint64_t>((w.row0 + i) * w.gcols + w.col0 + j));
            const float got = out[static_cast<size_t>((b * w.rows + i) * w.cols + j)];
            ASSERT_EQ(std::memcmp(&want, &got, sizeof(float)), 0) << "matrix " << b << " (" << i << ", " << j << ")";
          }
      }
    }
}

// Dion's update from its factors: update_lowrank equals the fp32 product U
// = A B^T (bf16 A and B widened exactly first), and apply_update_multi of U
// (non-cautious), bit for bit: bf16 factors with fp32 and bf16 parameters,
// fp32 factors with fp32 parameters; nothing on a skipped step.
TEST_F(HostFused, UpdateLowrankEqualsProductThenUpdate) {
  const int64_t count = 3, rows = 7, cols = 5, r = 3, n = rows * cols;
  GroupScalars gs{0.02, 0.1, 0.9, 0.99, 3, 0};
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int variant = 0; variant < 3; ++variant)
    for (int32_t skip : {0, 1}) {
      const dion_dtype_t dx = variant == 1 ? DION_DTYPE_BF16 : DION_DTYPE_FP32;
      const dion_dtype_t dab = variant == 2 ? DION_DTYPE_FP32 : DION_DTYPE_BF16;
      SCOPED_TRACE(::testing::Message() << dtype_name(dab) << " factors, " << dtype_name(dx) << " skip " << skip);
      Twin tw(rng, count, n, {dx, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_DTYPE_FP32});
      const std::vector<std::vector<uint8_t>> before = tw.a[kParam];
      std::vector<float> fa(static_cast<size_t>(count * rows * r)), fb(static_cast<size_t>(count * cols * r));
      for (auto& v : fa) v = g(rng);
      for (auto& v : fb) v = g(rng);
      std::vector<uint16_t> a(fa.size()), b(fb.size());
      be->store(a.data(), DION_DTYPE_BF16, fa.data(), static_cast<int64_t>(fa.size()));
      be->store(b.data(), DION_DTYPE_BF16, fb.data(), static_cast<int64_t>(fb.size()));
      if (dab == DION_DTYPE_BF16) {
        be->load(fa.data(), a.data(), DION_DTYPE_BF16, static_cast<int64_t>(fa.size()));
        be->load(fb.data(), b.data(), DION_DTYPE_BF16, static_cast<int64_t>(fb.size()));
      }
      std::vector<float> U(static_cast<size_t>(count * n));
      be->gemm(false, true, 1.0f, ConstMatBatch(fa.data(), rows, r, r, rows * r, count),
               ConstMatBatch(fb.data(), cols, r, r, cols * r, count), 0.0f,
               MatBatch{U.data(), rows, cols, cols, n, count}, DION_MATMUL_FP32);
      be->apply_update_multi(tw.la.data(), count, n, U.data(), DION_DTYPE_FP32, &gs, 0.7f, false, &skip);
      const float* pa = dab == DION_DTYPE_BF16 ? reinterpret_cast<const float*>(a.data()) : fa.data();
      const float* pb = dab == DION_DTYPE_BF16 ? reinterpret_cast<const float*>(b.data()) : fb.data();
      be->update_lowrank(tw.lb.data(), count, ConstMatBatch(pa, rows, r, r, rows * r, count),
                         ConstMatBatch(pb, cols, r, r, cols * r, count), dab, dx, DION_MATMUL_FP32, &gs, 0.7f, &skip);
      EXPECT_TRUE(tw.same(kParam));
      if (skip)
        EXPECT_TRUE(tw.b[kParam] == before) << "a skipped step wrote the parameters";
      else
        EXPECT_FALSE(tw.b[kParam] == before) << "the parameters were not updated";
    }
}

// Dion2's local scope: M (fp32) stored whole, its selected slices scaled,
// then those stored again, equals scaling then storing all of M.
TEST_F(HostFused, StoreSlicesMultiEqualsStoreMulti) {
  const int64_t count = 2, per = 3, rows = 7, cols = 5, n = per * rows * cols, B = count * per;
  for (dion_dtype_t dm : kDtypes)
    for (Axis axis : {kRows, kCols})
      for (int32_t skip : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dm) << " axis " << axis << " skip " << skip);
        Twin tw(rng, count, n, {DION_DTYPE_FP32, DION_DTYPE_FP32, dm, DION_DTYPE_FP32});
        std::vector<float> M(B * rows * cols);
        be->load_multi(M.data(), tw.la.data(), count, kParam, n);  // any values
        const int32_t no = 0;
        be->store_multi(tw.la.data(), count, kState0, M.data(), n, &no);
        be->store_multi(tw.lb.data(), count, kState0, M.data(), n, &no);
        const std::vector<std::vector<uint8_t>> before = tw.b[kState0];
        const int64_t N = axis == kRows ? rows : cols, k = 2;
        const std::vector<int32_t> idx = pick(rng, B, N, k);
        MatBatch m{M.data(), rows, cols, cols, rows * cols, B};
        be->scale_slices(m, axis, idx.data(), k, 0.25f);
        be->store_multi(tw.la.data(), count, kState0, M.data(), n, &skip);
        be->store_slices_multi(tw.lb.data(), count, kState0, m, axis, idx.data(), k, &skip);
        if (skip)
          EXPECT_TRUE(tw.b[kState0] == before);
        else
          EXPECT_TRUE(tw.same(kState0));
      }
}

TEST_F(HostFused, DecayAddSlicesMultiEqualsLoadDecayAddStore) {
  const int64_t count = 3, per = 2, rows = 6, cols = 9, n = per * rows * cols, B = count * per;
  GroupScalars gs{0.05, 0.1, 0.9, 0.99, 3, 0};
  for (dion_dtype_t dx : kDtypes)
    for (Axis axis : {kRows, kCols})
      for (int64_t k : {0, 1, 3})
        for (int32_t skip : {0, 1})
          for (dion_dtype_t ud : {DION_DTYPE_FP32, DION_DTYPE_BF16})
            for (bool scaled : {false, true}) {
            if (scaled && axis != kRows) continue;
            SCOPED_TRACE(::testing::Message() << dtype_name(dx) << " axis " << axis << " k " << k << " skip " << skip
                                              << " u " << dtype_name(ud) << " scaled " << scaled);
            Twin tw(rng, count, n, {dx, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_DTYPE_FP32});
            const std::vector<std::vector<uint8_t>> before = tw.b[kParam];
            const int64_t N = axis == kRows ? rows : cols;
            const std::vector<int32_t> idx = pick(rng, B, N, k);
            // S shaped as gather_slices' out, with padding (ld > its columns);
            // for a bf16 u, S holds bf16 values and Sb their bits in the same
            // layout (the fused op widens them exactly: the same bits).
            const int64_t srows = axis == kRows ? k : rows, scols = axis == kRows ? cols : k, ld = scols + 2;
            std::vector<float> S(static_cast<size_t>(B * srows * ld + 1));
            std::normal_distribution<float> g(0.0f, 1.0f);
            for (auto& v : S) v = ud == DION_DTYPE_BF16 ? bf16_to_float(float_to_bf16(g(rng))) : g(rng);
            std::vector<uint16_t> Sb(S.size());
            for (size_t i = 0; i < S.size(); ++i) Sb[i] = float_to_bf16(S[i]);
            const float* sbp = reinterpret_cast<const float*>(Sb.data());
            ConstMatBatch Su = ud == DION_DTYPE_BF16 ? ConstMatBatch(sbp, srows, scols, ld, srows * ld, B)
                                                     : ConstMatBatch(S.data(), srows, scols, ld, srows * ld, B);
            // scaled: neuron scales (k per matrix, then B rescales); the
            // reference adds the rows normalised as apply_update_neuron_multi
            // writes them, float(u * scale * rescale).
            std::vector<double> sc(static_cast<size_t>(B * k + B));
            std::uniform_real_distribution<double> ur(0.25, 4.0);
            for (auto& v : sc) v = ur(rng);
            std::vector<float> R = S;
            if (scaled)
              for (int64_t b = 0; b < B; ++b)
                for (int64_t s = 0; s < k; ++s)
                  for (int64_t j = 0; j < cols; ++j) {
                    float& e = R[static_cast<size_t>(b * srows * ld + s * ld + j)];
                    e = static_cast<float>(e * sc[b * k + s] * sc[B * k + b]);
                  }
            ConstMatBatch Sm(R.data(), srows, scols, ld, srows * ld, B);
            std::vector<float> X(B * rows * cols);
            be->load_multi(X.data(), tw.la.data(), count, kParam, n);
            be->decay(X.data(), B * rows * cols, &gs);
            if (k > 0)
              be->add_slices(MatBatch{X.data(), rows, cols, cols, rows * cols, B}, axis, idx.data(), k, Sm, &gs, -0.8f);
            be->store_multi(tw.la.data(), count, kParam, X.data(), n, &skip);
            be->decay_add_slices_multi(tw.lb.data(), count, per, rows, cols, axis, k ? idx.data() : nullptr, k, Su, ud,
                                       scaled ? sc.data() : nullptr, &gs, -0.8f, &skip);
            EXPECT_TRUE(tw.same(kParam));
            if (skip) EXPECT_TRUE(tw.b[kParam] == before);
          }
}

// Dion with the momentum state as its products' input: momentum_multi with
// u null stores M + G as with a u (bit for bit) and flags the matrices of M
// as written (a value that rounds to zero in bf16 counts as zero there);
// gemm_field equals load_multi and gemm (or gemm_bf16_f32 on a bf16 field).
TEST_F(HostFused, MomentumInStateAndGemmField) {
  const int64_t count = 4, rows = 5, cols = 7, n = rows * cols, r = 3;
  for (dion_dtype_t dm : {DION_DTYPE_FP32, DION_DTYPE_BF16})
    for (int32_t skip : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dm) << ", skip " << skip);
      Twin tw(rng, count, n, {DION_DTYPE_FP32, DION_DTYPE_FP32, dm, DION_DTYPE_FP32});
      for (auto* side : {&tw.a, &tw.b})
        for (int64_t i = 0; i < n; ++i) {  // matrix 2: zero but for 1e-42 (zero in bf16, not in fp32)
          store_elem((*side)[kState0][2].data(), dm, i, 0.0f);
          store_elem((*side)[kGrad][2].data(), DION_DTYPE_FP32, i, i == 3 ? 1e-42f : 0.0f);
        }
      std::vector<float> U(static_cast<size_t>(count * n));
      std::vector<int32_t> fa(count, 0), fb(count, 0);
      be->momentum_multi(tw.la.data(), count, n, 1.0f, 1.0f, false, true, U.data(), DION_DTYPE_FP32, &skip, fa.data());
      be->momentum_multi(tw.lb.data(), count, n, 1.0f, 1.0f, false, true, nullptr, DION_DTYPE_FP32, &skip, fb.data());
      for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
      EXPECT_EQ(fb, (std::vector<int32_t>{1, 1, dm == DION_DTYPE_FP32 ? 1 : 0, 1}));
      if (dm == DION_DTYPE_FP32) EXPECT_EQ(fa, fb);
      // C = op(M) B from the field, both orientations.
      for (bool trans : {false, true}) {
        const int64_t k = trans ? rows : cols, m = trans ? cols : rows;
        std::vector<float> B(static_cast<size_t>(count * k * r)), C1(static_cast<size_t>(count * m * r)), C2 = C1;
        std::normal_distribution<float> g(0.0f, 1.0f);
        for (auto& v : B) v = dm == DION_DTYPE_BF16 ? bf16_to_float(float_to_bf16(g(rng))) : g(rng);
        std::vector<uint16_t> B16(B.size());
        for (size_t i = 0; i < B.size(); ++i) B16[i] = float_to_bf16(B[i]);
        std::vector<float> X(static_cast<size_t>(count * n));
        be->load_multi(X.data(), tw.lb.data(), count, kState0, n);
        be->gemm(trans, false, 1.0f, ConstMatBatch(X.data(), rows, cols, cols, n, count),
                 ConstMatBatch(B.data(), k, r, r, k * r, count), 0.0f, MatBatch{C1.data(), m, r, r, m * r, count},
                 DION_MATMUL_FP32);
        const float* bp = dm == DION_DTYPE_BF16 ? reinterpret_cast<const float*>(B16.data()) : B.data();
        be->gemm_field(tw.lb.data(), count, kState0, rows, cols, dm, trans, ConstMatBatch(bp, k, r, r, k * r, count),
                       MatBatch{C2.data(), m, r, r, m * r, count}, DION_MATMUL_FP32, DION_DTYPE_FP32, -1);
        EXPECT_TRUE(same_floats(C1, C2)) << "trans " << trans;
        if (dm == DION_DTYPE_FP32) {  // B from each tensor's fp32 field kState1 (b_field), its first k r values
          for (int64_t t = 0; t < count; ++t)
            for (int64_t i = 0; i < k * r; ++i)
              store_elem(tw.b[kState1][t].data(), DION_DTYPE_FP32, i, B[t * k * r + i]);
          std::vector<float> C3(C1.size());
          be->gemm_field(tw.lb.data(), count, kState0, rows, cols, dm, trans,
                         ConstMatBatch(nullptr, k, r, r, k * r, count), MatBatch{C3.data(), m, r, r, m * r, count},
                         DION_MATMUL_FP32, DION_DTYPE_FP32, kState1);
          EXPECT_TRUE(same_floats(C1, C3)) << "B from the fields, trans " << trans;
        }
        if (dm == DION_DTYPE_BF16) {  // bf16 output: store(BF16) of the fp32 product, bit for bit
          std::vector<uint16_t> C16(C1.size()), want(C1.size());
          be->gemm_field(tw.lb.data(), count, kState0, rows, cols, dm, trans,
                         ConstMatBatch(bp, k, r, r, k * r, count),
                         MatBatch{reinterpret_cast<float*>(C16.data()), m, r, r, m * r, count}, DION_MATMUL_FP32,
                         DION_DTYPE_BF16, -1);
          for (size_t i = 0; i < C1.size(); ++i) want[i] = float_to_bf16(C1[i]);
          EXPECT_EQ(C16, want) << "bf16 output, trans " << trans;
        }
      }
    }
}

// Dion2's selection on the typed momentum: the L1 norms of M + G's slices,
// then M <- M + G with the selected slices decayed and S <- those slices,
// against momentum_multi into fp32 and the fp32 calls (slice_l1,
// gather_slices, scale_slices, store_slices_multi).
TEST_F(HostFused, MomentumL1AndSelectMomentumEqualTheFp32Sequence) {
  const int64_t count = 3, per = 2, rows = 6, cols = 9, n = per * rows * cols, B = count * per;
  for (dion_dtype_t dm : kDtypes)
    for (dion_dtype_t dg : {DION_DTYPE_FP32, DION_DTYPE_BF16})
      for (Axis axis : {kRows, kCols})
        for (int64_t k : {1, 4})
          for (int32_t skip : {0, 1}) {
            SCOPED_TRACE(::testing::Message() << dtype_name(dm) << " momentum, " << dtype_name(dg) << " grad, axis "
                                              << axis << ", k " << k << ", skip " << skip);
            Twin tw(rng, count, n, {DION_DTYPE_FP32, dg, dm, DION_DTYPE_FP32});
            const std::vector<std::vector<uint8_t>> before = tw.b[kState0];
            const int64_t N = axis == kRows ? rows : cols;
            const std::vector<int32_t> idx = pick(rng, B, N, k);
            // S shaped as gather_slices' out, with padding (ld > its columns).
            const int64_t srows = axis == kRows ? k : rows, scols = axis == kRows ? cols : k, ld = scols + 2;
            std::vector<float> S1(static_cast<size_t>(B * srows * ld), 7.0f), S2 = S1;
            // The sequence on copy a.
            std::vector<float> M(B * rows * cols), L1(B * N);
            be->momentum_multi(tw.la.data(), count, n, 1.0f, 1.0f, false, true, M.data(), DION_DTYPE_FP32, &skip,
                               nullptr);
            const MatBatch m{M.data(), rows, cols, cols, rows * cols, B};
            be->slice_l1(m, axis, L1.data());
            be->gather_slices(m, axis, idx.data(), k, MatBatch{S1.data(), srows, scols, ld, srows * ld, B});
            be->scale_slices(m, axis, idx.data(), k, 0.9f);
            be->store_slices_multi(tw.la.data(), count, kState0, m, axis, idx.data(), k, &skip);
            // The fused ops on copy b: the norms write nothing typed.
            std::vector<float> L2(B * N, -1.0f);
            be->momentum_l1_multi(tw.lb.data(), count, per, rows, cols, axis, L2.data(), nullptr);
            EXPECT_TRUE(tw.b[kState0] == before);
            EXPECT_TRUE(same_floats(L1, L2));
            be->select_momentum_multi(tw.lb.data(), count, per, rows, cols, axis, idx.data(), k, 0.9f,
                                      MatBatch{S2.data(), srows, scols, ld, srows * ld, B}, DION_DTYPE_FP32, &skip,
                                      nullptr);
            EXPECT_TRUE(same_floats(S1, S2)) << "the selected slices (and the padding) as gather_slices writes them";
            for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
            if (skip)
              EXPECT_TRUE(tw.b[kState0] == before);
            else
              EXPECT_FALSE(tw.b[kState0] == before);
          }
}

// The selection's sums of squares (one matrix per tensor): select_momentum_parts
// of them per matrix, totalling the squared Frobenius norm of each selected
// matrix; frob_normalize_bf16_parts from them gives frob_normalize_bf16's bits
// (the host sums in the same order); with several matrices per tensor the
// host gives none.
TEST_F(HostFused, SelectMomentumSumsOfSquaresNormalizeAsFrobNormalizeBf16) {
  const int64_t count = 3, rows = 6, cols = 9, n = rows * cols;
  EXPECT_EQ(be->select_momentum_parts(count, 2, rows, cols), 0);
  const int64_t parts = be->select_momentum_parts(count, 1, rows, cols);
  ASSERT_GE(parts, 1);
  ASSERT_LE(parts, Backend::select_parts_max(rows, cols));
  for (Axis axis : {kRows, kCols}) {
    SCOPED_TRACE(::testing::Message() << "axis " << axis);
    Twin tw(rng, count, n, {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP32, DION_DTYPE_FP32});
    const int64_t N = axis == kRows ? rows : cols, k = 3;
    const std::vector<int32_t> idx = pick(rng, count, N, k);
    const int64_t srows = axis == kRows ? k : rows, scols = axis == kRows ? cols : k;
    std::vector<float> S(static_cast<size_t>(count * srows * scols));
    std::vector<double> sums(static_cast<size_t>(count * parts), -1.0);
    const int32_t skip = 0;
    const MatBatch Sm{S.data(), srows, scols, scols, srows * scols, count};
    be->select_momentum_multi(tw.lb.data(), count, 1, rows, cols, axis, idx.data(), k, 0.9f, Sm, DION_DTYPE_FP32, &skip,
                              sums.data());
    for (int64_t b = 0; b < count; ++b) {
      double want = 0, got = 0;
      const float* sb = S.data() + b * srows * scols;
      for (int64_t i = 0; i < srows * scols; ++i) want += static_cast<double>(sb[i]) * sb[i];
      for (int64_t c = 0; c < parts; ++c) got += sums[b * parts + c];
      EXPECT_NEAR(got, want, 1e-12 * want) << "matrix " << b;
    }
    std::vector<uint16_t> o1(S.size()), o2(S.size());
    be->frob_normalize_bf16(ConstMatBatch(Sm), 1.02f, 1e-7f, o1.data());
    be->frob_normalize_bf16_parts(ConstMatBatch(Sm), sums.data(), parts, 1.02f, 1e-7f, o2.data());
    EXPECT_TRUE(o1 == o2);
  }
}

// momentum_multi_sums: momentum_multi's state and u (fp32 and bf16 u, with
// and without a skipped step), and one sum per tensor of the squares of u
// as written, in element order (the host's order: exact equality).
TEST_F(HostFused, MomentumMultiSumsIsMomentumMultiAndTheSquaresOfU) {
  const int64_t count = 3, n = 37;
  EXPECT_EQ(be->momentum_parts(count, n), 1);
  for (dion_dtype_t ud : {DION_DTYPE_FP32, DION_DTYPE_BF16})
    for (int32_t skip : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "u dtype " << ud << ", skip " << skip);
      Twin tw(rng, count, n, {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_BF16, DION_DTYPE_FP32});
      std::vector<float> U1(static_cast<size_t>(count * n)), U2(U1.size());
      std::vector<double> sums(static_cast<size_t>(count), -1.0);
      be->momentum_multi(tw.la.data(), count, n, 0.9f, 1.0f, true, true, U1.data(), ud, &skip, nullptr);
      be->momentum_multi_sums(tw.lb.data(), count, n, 0.9f, 1.0f, true, U2.data(), ud, &skip, sums.data());
      for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
      const size_t bytes = static_cast<size_t>(count * n) * dtype_size(ud);
      EXPECT_EQ(std::memcmp(U1.data(), U2.data(), bytes), 0) << "u as momentum_multi writes it";
      for (int64_t t = 0; t < count; ++t) {
        double want = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double v = load_elem(U2.data(), ud, t * n + i);
          want += v * v;
        }
        EXPECT_EQ(sums[static_cast<size_t>(t)], want) << "tensor " << t;
        EXPECT_GT(want, 0.0);
      }
    }
}

// out_dtype BF16: the slices rounded once into bf16 elements (a padded out:
// ld and stride count bf16 elements, the padding untouched), the state as
// with fp32 slices, and the sums those of the rounded values.
TEST_F(HostFused, SelectMomentumIntoBf16RoundsTheSlicesOnce) {
  const int64_t count = 3, rows = 6, cols = 9, n = rows * cols, k = 4, ld_pad = 3;
  for (Axis axis : {kRows, kCols}) {
    SCOPED_TRACE(::testing::Message() << "axis " << axis);
    Twin tw(rng, count, n, {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP32, DION_DTYPE_FP32});
    const int64_t N = axis == kRows ? rows : cols;
    const std::vector<int32_t> idx = pick(rng, count, N, k);
    const int64_t srows = axis == kRows ? k : rows, scols = axis == kRows ? cols : k, ld = scols + ld_pad;
    std::vector<float> S(static_cast<size_t>(count * srows * scols));
    std::vector<uint16_t> S16(static_cast<size_t>(count * srows * ld), 0x7777);
    std::vector<double> sums(static_cast<size_t>(count), -1.0), sums16(static_cast<size_t>(count), -1.0);
    const int32_t skip = 0;
    be->select_momentum_multi(tw.la.data(), count, 1, rows, cols, axis, idx.data(), k, 0.9f,
                              MatBatch{S.data(), srows, scols, scols, srows * scols, count}, DION_DTYPE_FP32, &skip,
                              sums.data());
    be->select_momentum_multi(tw.lb.data(), count, 1, rows, cols, axis, idx.data(), k, 0.9f,
                              MatBatch{reinterpret_cast<float*>(S16.data()), srows, scols, ld, srows * ld, count},
                              DION_DTYPE_BF16, &skip, sums16.data());
    for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
    for (int64_t b = 0; b < count; ++b) {
      double want = 0;
      for (int64_t i = 0; i < srows; ++i)
        for (int64_t j = 0; j < ld; ++j) {
          const uint16_t got = S16[(b * srows + i) * ld + j];
          if (j >= scols) {
            EXPECT_EQ(got, 0x7777) << "padding " << i << ", " << j;
            continue;
          }
          const float v = S[(b * srows + i) * scols + j];
          EXPECT_EQ(got, float_to_bf16(v)) << "matrix " << b << " (" << i << ", " << j << ")";
          const double r = bf16_to_float(float_to_bf16(v));
          want += r * r;
        }
      EXPECT_EQ(sums16[b], want) << "matrix " << b << ": the host sums in the element order";
      EXPECT_NE(sums16[b], sums[b]) << "the rounded values' sums, not the fp32 ones";
    }
  }
}

// frob_scale_bf16 against its definition, with the norm from given parts:
// bf16(sc (m + diag I)) in fp32, sc = inv or inv^2, on a padded batch of
// non-square matrices (the diagonal is min(rows, cols) long; padding kept).
TEST_F(HostFused, FrobScaleBf16ScalesAndShiftsTheDiagonal) {
  const int64_t rows = 5, cols = 7, ld = 9, batch = 2, nparts = 3;
  std::vector<double> parts(static_cast<size_t>(batch * nparts));
  for (double& p : parts) p = std::uniform_real_distribution<double>(0.5, 4.0)(rng);
  for (int power : {1, 2})
    for (float diag : {0.0f, 3.25f}) {
      SCOPED_TRACE(::testing::Message() << "power " << power << ", diag " << diag);
      std::vector<uint16_t> m(static_cast<size_t>(batch * rows * ld));
      for (uint16_t& e : m) e = float_to_bf16(std::normal_distribution<float>()(rng));
      const std::vector<uint16_t> before = m;
      be->frob_scale_bf16(MatBatch{reinterpret_cast<float*>(m.data()), rows, cols, ld, rows * ld, batch},
                          FrobScale{parts.data(), nparts, 1.02f, 1e-7f, power}, diag);
      for (int64_t b = 0; b < batch; ++b) {
        const double t = parts[b * nparts] + parts[b * nparts + 1] + parts[b * nparts + 2];
        const float inv = static_cast<float>(1.0 / (1.02f * std::sqrt(t) + 1e-7f));
        const float sc = power == 2 ? inv * inv : inv;
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < ld; ++j) {
            const size_t at = static_cast<size_t>((b * rows + i) * ld + j);
            const float x = bf16_to_float(before[at]) + (i == j ? diag : 0.0f);
            EXPECT_EQ(m[at], j < cols ? float_to_bf16(x * sc) : before[at]) << b << ": " << i << ", " << j;
          }
      }
    }
}

// ns_shift_bf16 against its definition on padded matrices (ld > n; the
// padding kept): without a scale, b = bf16(coef x + diag [i == j]) and a
// untouched; with one, a = bf16(inv^2 x), a3 = bf16(inv^3 x) (dense) and b =
// bf16((coef a + diag [i == j]) inv), inv from the parts as frob_scale_bf16
// takes them, every operation in fp32 in the order of the contract.
TEST_F(HostFused, NsShiftBf16ScalesShiftsAndCopies) {
  const int64_t n = 6, ld = 9, batch = 2, nparts = 3;
  std::vector<double> parts(static_cast<size_t>(batch * nparts));
  for (double& p : parts) p = std::uniform_real_distribution<double>(0.5, 4.0)(rng);
  const uint16_t kPad = 0x7fc3;
  for (bool scaled : {false, true}) {
    SCOPED_TRACE(scaled ? "scaled" : "not scaled");
    std::vector<uint16_t> a(static_cast<size_t>(batch * n * ld), kPad), b = a,
                                                                        a3(static_cast<size_t>(batch * n * n), kPad);
    for (int64_t q = 0; q < batch; ++q)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j)
          a[static_cast<size_t>((q * n + i) * ld + j)] = float_to_bf16(std::normal_distribution<float>()(rng));
    const std::vector<uint16_t> before = a;
    const FrobScale sc{parts.data(), nparts, 1.02f, 1e-7f, 1};
    be->ns_shift_bf16(MatBatch{reinterpret_cast<float*>(a.data()), n, n, ld, n * ld, batch},
                      MatBatch{reinterpret_cast<float*>(b.data()), n, n, ld, n * ld, batch}, -2.5f, 3.25f,
                      scaled ? &sc : nullptr, scaled ? a3.data() : nullptr);
    for (int64_t q = 0; q < batch; ++q) {
      const double t = parts[q * nparts] + parts[q * nparts + 1] + parts[q * nparts + 2];
      const float inv = static_cast<float>(1.0 / (1.02f * std::sqrt(t) + 1e-7f));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < ld; ++j) {
          const size_t at = static_cast<size_t>((q * n + i) * ld + j);
          if (j >= n) {
            EXPECT_EQ(a[at], kPad);
            EXPECT_EQ(b[at], kPad);
            continue;
          }
          const float x = bf16_to_float(before[at]);
          const uint16_t a1 = scaled ? float_to_bf16(x * (inv * inv)) : before[at];
          EXPECT_EQ(a[at], a1) << q << ": " << i << ", " << j;
          if (scaled)
            EXPECT_EQ(a3[static_cast<size_t>((q * n + i) * n + j)], float_to_bf16(x * (inv * inv * inv)));
          float v = -2.5f * bf16_to_float(a1);
          if (i == j) v += 3.25f;
          EXPECT_EQ(b[at], float_to_bf16(v * (scaled ? inv : 1.0f))) << q << ": " << i << ", " << j;
        }
    }
  }
}

// What the iteration builds from ns_shift_bf16: the product c a3 a + b
// (gemm_bf16, beta 1) equals inv (a I + b A + c A A) of the scaled A = inv^2 X
// X^T (float64, from the bf16 X), within bf16 rounding: each of the three
// roundings of A, a3 and b and the product's is at most 2^-8 relative, on
// terms bounded by |b| |A| + |c| |A|^2 + |a| with |A| <= 1 (the spectral
// norm of a normalised X's Gram matrix), so 4 x 2^-8 of that, times inv.
TEST_F(HostFused, NsShiftBf16GivesTheScaledPolynomial) {
  const int64_t n = 16, l = 40, batch = 2;
  const double ca = 3.4445, cb = -4.775, cc = 2.0315;
  std::vector<uint16_t> x(static_cast<size_t>(batch * n * l));
  for (uint16_t& e : x) e = float_to_bf16(3.0f * std::normal_distribution<float>()(rng));
  std::vector<double> parts(static_cast<size_t>(batch), 0.0);  // ||X||_F^2 in one part
  for (int64_t q = 0; q < batch; ++q)
    for (int64_t e = 0; e < n * l; ++e) {
      const double v = bf16_to_float(x[static_cast<size_t>(q * n * l + e)]);
      parts[static_cast<size_t>(q)] += v * v;
    }
  std::vector<uint16_t> a(static_cast<size_t>(batch * n * n)), b(a.size()), a3(a.size());
  auto mb = [&](std::vector<uint16_t>& v, int64_t r, int64_t c) {
    return MatBatch{reinterpret_cast<float*>(v.data()), r, c, c, r * c, batch};
  };
  be->gemm_bf16(false, true, 1.0f, mb(x, n, l), mb(x, n, l), 0.0f, mb(a, n, n));
  const FrobScale sc{parts.data(), 1, 1.0f, 0.0f, 1};
  be->ns_shift_bf16(mb(a, n, n), mb(b, n, n), static_cast<float>(cb), static_cast<float>(ca), &sc, a3.data());
  be->gemm_bf16(false, false, static_cast<float>(cc), mb(a3, n, n), mb(a, n, n), 1.0f, mb(b, n, n));
  for (int64_t q = 0; q < batch; ++q) {
    const double inv = 1.0 / std::sqrt(parts[static_cast<size_t>(q)]);
    std::vector<double> g(static_cast<size_t>(n * n), 0.0);  // inv^2 X X^T in float64
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t t = 0; t < l; ++t)
          s += static_cast<double>(bf16_to_float(x[static_cast<size_t>((q * n + i) * l + t)])) *
               bf16_to_float(x[static_cast<size_t>((q * n + j) * l + t)]);
        g[static_cast<size_t>(i * n + j)] = s * inv * inv;
      }
    const double bound = 4.0 * std::ldexp(1.0, -8) * (std::fabs(cb) + std::fabs(cc) + std::fabs(ca)) * inv;
    double worst = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double gg = 0;
        for (int64_t t = 0; t < n; ++t) gg += g[static_cast<size_t>(i * n + t)] * g[static_cast<size_t>(t * n + j)];
        const double want = inv * ((i == j ? ca : 0.0) + cb * g[static_cast<size_t>(i * n + j)] + cc * gg);
        worst = std::max(worst, std::fabs(bf16_to_float(b[static_cast<size_t>((q * n + i) * n + j)]) - want));
      }
    EXPECT_LE(worst, bound) << "matrix " << q;
    EXPECT_GT(worst, 0.0) << "bf16 roundings leave some error";
  }
}

// NorMuon's fused pair (neuron_scales, then apply_update_neuron_multi from
// the bf16 matrices) against the sequence it replaces: load(BF16) into an
// fp32 U, neuron_normalize, apply_update_multi. Bit for bit (the host sums
// in the same order either way): the parameters of every dtype and the
// variances, on both axes, cautious or not, and a set skip flag (the
// variances still move, as neuron_normalize moves them; no parameter is
// written).
TEST_F(HostFused, NeuronScalesAndUpdateEqualNormalizeThenUpdate) {
  const int64_t count = 3, rows = 5, cols = 7, n = rows * cols;
  GroupScalars gs{0.02, 0.1, 0.9, 0.99, 3, 0};
  std::vector<uint16_t> in(static_cast<size_t>(count * n));
  for (uint16_t& e : in) e = float_to_bf16(std::normal_distribution<float>()(rng));
  for (dion_dtype_t dx : kDtypes)
    for (Axis ax : {kRows, kCols})
      for (bool cautious : {false, true})
        for (int32_t skip : {0, 1}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(dx) << (ax == kRows ? " rows" : " cols") << " cautious "
                                            << cautious << " skip " << skip);
          const int64_t N = ax == kRows ? rows : cols;
          std::vector<float> v(static_cast<size_t>(count * N));
          for (float& x : v) x = std::uniform_real_distribution<float>(0.0f, 2.0f)(rng);
          std::vector<float> v2 = v, U(static_cast<size_t>(count * n));
          Twin tw(rng, count, n, {dx, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_DTYPE_FP32});
          const std::vector<std::vector<uint8_t>> before = tw.a[kParam];
          be->load(U.data(), in.data(), DION_DTYPE_BF16, count * n);
          be->neuron_normalize(MatBatch{U.data(), rows, cols, cols, n, count}, ax, v.data(), N, 0.9f, nullptr);
          be->apply_update_multi(tw.la.data(), count, n, U.data(), DION_DTYPE_FP32, &gs, 0.7f, cautious, &skip);
          std::vector<double> sc(static_cast<size_t>(count * N + count));
          be->neuron_scales(count, rows, cols, ax, in.data(), v2.data(), N, 0.9f, sc.data());
          be->apply_update_neuron_multi(tw.lb.data(), count, rows, cols, in.data(), DION_DTYPE_BF16, sc.data(), ax,
                                        &gs, 0.7f, cautious, &skip);
          EXPECT_TRUE(same_floats(v, v2)) << "variances";
          EXPECT_TRUE(tw.same(kParam));
          if (skip) EXPECT_TRUE(tw.b[kParam] == before) << "a skipped step wrote the parameters";
          else EXPECT_FALSE(tw.b[kParam] == before) << "the parameters were updated";
        }
}

// Dion's finish of R: finish_r then col_scale_store against nan_to_num,
// the fix-up (R = Q where the flag is 0), col_normalize, the bf16 copies
// and store_multi, bit for bit; with NaN, +-inf and a column of 1e30s (its
// squares overflow fp32, not the double sums), a flagged matrix, every
// dtype of the stored field and a set skip flag. finish_p is checked
// against the same sequence's P half, its bf16 copy starting as bf16(P)
// (its contract: only the changed elements are rewritten there).
TEST_F(HostFused, FinishRAndColScaleStoreEqualFixupAndColNormalize) {
  const int64_t T = 3, rows = 7, cols = 5, n = rows * cols;
  const float kInf = std::numeric_limits<float>::infinity();
  for (dion_dtype_t dq : kDtypes)
    for (int32_t skip : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dq) << " state, skip " << skip);
      Twin tw(rng, T, n, {DION_DTYPE_FP32, DION_DTYPE_FP32, DION_DTYPE_FP32, dq});
      const std::vector<std::vector<uint8_t>> before = tw.b[kState1];
      std::normal_distribution<float> g(0.0f, 1.0f);
      std::vector<float> R(T * n), Q(T * n), P(T * n);
      for (auto* v : {&R, &Q, &P})
        for (auto& x : *v) x = g(rng);
      R[3] = std::nanf("");
      R[n + 4] = kInf;
      R[n + 6] = -kInf;
      P[2] = std::nanf("");
      P[5] = -kInf;
      for (int64_t i = 0; i < rows; ++i) R[2 * n + i * cols + 1] = 1e30f;
      const int32_t flags[T] = {1, 0, 1};
      // The sequence.
      std::vector<float> R1 = R, P1 = P;
      std::vector<uint16_t> rb1(T * n), rb2(T * n, 7), pb1(T * n), pb2(T * n, 7);
      MatBatch r1{R1.data(), rows, cols, cols, n, T}, p1{P1.data(), rows, cols, cols, n, T};
      const ConstMatBatch q(Q.data(), rows, cols, cols, n, T);
      be->nan_to_num(R1.data(), T * n);
      be->nan_to_num(P1.data(), T * n);
      be->zero_fixup_flagged(flags, p1, r1, q);
      be->store(pb1.data(), DION_DTYPE_BF16, P1.data(), T * n);
      be->col_normalize(r1, 0.5f);
      be->store(rb1.data(), DION_DTYPE_BF16, R1.data(), T * n);
      be->store_multi(tw.la.data(), T, kState1, R1.data(), n, &skip);
      // The fused calls.
      std::vector<float> R2 = R, P2 = P;
      std::vector<double> ss(T * cols);
      MatBatch r2{R2.data(), rows, cols, cols, n, T}, p2{P2.data(), rows, cols, cols, n, T};
      be->store(pb2.data(), DION_DTYPE_BF16, P2.data(), T * n);
      be->finish_p(p2, flags, pb2.data(), false);
      be->finish_r(r2, flags, q, nullptr, kState1, nullptr, ss.data());
      const std::vector<float> R2fixed = R2;
      const std::vector<double> ss2 = ss;
      be->col_scale_store(r2, ss.data(), 0.5f, rb2.data(), tw.lb.data(), kState1, &skip, true);
      EXPECT_TRUE(same_floats(P1, P2));
      EXPECT_TRUE(pb1 == pb2);
      EXPECT_TRUE(same_floats(R1, R2));
      EXPECT_TRUE(rb1 == rb2);
      for (int f = 0; f < 4; ++f) EXPECT_TRUE(tw.same(f)) << "field " << f;
      if (skip) EXPECT_TRUE(tw.b[kState1] == before);
      // The fix-up took Q's matrix (normalised), the 1e30 column came out
      // finite with unit norm.
      double q0 = 0.0;
      for (int64_t i = 0; i < rows; ++i) q0 += static_cast<double>(Q[n + i * cols]) * Q[n + i * cols];
      EXPECT_EQ(R2[n], static_cast<float>(Q[n] * (1.0 / (std::sqrt(q0) + 0.5))));
      EXPECT_NEAR(R2[2 * n + 1], 1.0 / std::sqrt(static_cast<double>(rows)), 1e-6);
      // The variants the bf16 path takes, against the calls above:
      // finish_p with pb_all writes every element of a pb holding garbage;
      std::vector<float> P3 = P;
      std::vector<uint16_t> pb3(T * n, 7);
      be->finish_p(MatBatch{P3.data(), rows, cols, cols, n, T}, flags, pb3.data(), true);
      EXPECT_TRUE(same_floats(P1, P3));
      EXPECT_TRUE(pb1 == pb3);
      // finish_r's fix-up from a field (the typed state, kState1 of lb, as
      // loaded) instead of q; load_multi_bf16 is store(BF16) of load_multi;
      std::vector<float> Qs(T * n), R3 = R;
      be->load_multi(Qs.data(), tw.lb.data(), T, kState1, n);
      std::vector<uint16_t> qs16(T * n), want16(T * n);
      be->load_multi_bf16(qs16.data(), tw.lb.data(), T, kState1, n);
      be->store(want16.data(), DION_DTYPE_BF16, Qs.data(), T * n);
      EXPECT_TRUE(qs16 == want16);
      std::vector<float> R4 = R;
      std::vector<double> ss3(T * cols), ss4(T * cols);
      std::vector<uint16_t> rb3(T * n), rb4(T * n, 7);
      be->finish_r(MatBatch{R3.data(), rows, cols, cols, n, T}, flags, ConstMatBatch(Qs.data(), rows, cols, cols, n, T),
                   nullptr, kState1, rb3.data(), ss3.data());
      be->finish_r(MatBatch{R4.data(), rows, cols, cols, n, T}, flags, ConstMatBatch(nullptr, rows, cols, cols, n, T),
                   tw.lb.data(), kState1, rb4.data(), ss4.data());
      EXPECT_TRUE(same_floats(R3, R4));
      EXPECT_TRUE(rb3 == rb4);
      EXPECT_EQ(ss3, ss4);
      // col_scale_store with write_r false: the same copies, r untouched.
      std::vector<float> R5 = R2fixed;
      std::vector<uint16_t> rb5(T * n, 7);
      be->col_scale_store(MatBatch{R5.data(), rows, cols, cols, n, T}, ss2.data(), 0.5f, rb5.data(), nullptr, kState1,
                          nullptr, false);
      EXPECT_TRUE(same_floats(R5, R2fixed));
      EXPECT_TRUE(rb5 == rb2);
    }
}

// orthogonalize_bf16's start: frob_normalize then store to bf16, from a
// padded batch (ld > cols), for both factors the orthogonalizers use.
TEST_F(HostFused, FrobNormalizeBf16EqualsNormalizeThenStore) {
  const int64_t rows = 9, cols = 13, ld = 16, batch = 3, stride = rows * ld + 4;
  std::normal_distribution<float> g(0.0f, 3.0f);
  for (float factor : {1.0f, 1.02f}) {
    std::vector<float> x(static_cast<size_t>(stride * batch));
    for (auto& v : x) v = g(rng);
    std::vector<float> y = x;
    be->frob_normalize(MatBatch{y.data(), rows, cols, ld, stride, batch}, factor, 1e-7f);
    std::vector<uint16_t> want(static_cast<size_t>(rows * cols * batch)), got(want.size(), 0xffff);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < rows; ++i)
        be->store(want.data() + (b * rows + i) * cols, DION_DTYPE_BF16, y.data() + b * stride + i * ld, cols);
    const std::vector<float> x0 = x;
    be->frob_normalize_bf16(ConstMatBatch(x.data(), rows, cols, ld, stride, batch), factor, 1e-7f, got.data());
    EXPECT_EQ(want, got) << "factor " << factor;
    EXPECT_TRUE(same_floats(x0, x)) << "the input must be left alone";
  }
}

}  // namespace
