// SPDX-License-Identifier: MIT
// CUDA backend against host backend: memory, conversions, multi-tensor
// kernels, reductions, optimizer updates, random numbers and slice selection.
//
// Tolerances. The CUDA kernels perform the host's fp32 operations in the
// host's order and are compiled without FMA contraction (-fmad=false), so
// most of them agree bit for bit; the checks allow a few ulps (rtol 1e-6,
// 2^-20 ~ 8 ulps) so that a host compiler contracting a*b+c on an FMA target
// still passes. Reductions sum in double on both sides (in different orders:
// the difference is ~1e-16 relative, far below one fp32 ulp), except the
// host's slice_l1, which sums in fp32: n terms give up to n * 2^-24 relative,
// hence its rtol of 1e-5 for n <= 100.
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <tuple>
#include <utility>

#include "ops_util.h"

namespace dion_ops_test {
namespace {

constexpr double kUlps = 1e-6;

TEST_F(OpsTest, MemoryCalls) {
  EXPECT_FALSE(cuda->host_memory());
  EXPECT_TRUE(host->host_memory());
  const size_t n = 1000;
  std::vector<float> src = univ(n), back(n, 0.0f);
  float* a = static_cast<float*>(cuda->alloc(n * sizeof(float)));
  float* b = static_cast<float*>(cuda->alloc(n * sizeof(float)));
  cuda->copy_sync(a, src.data(), n * sizeof(float));  // host -> device
  cuda->copy(b, a, n * sizeof(float));                // device -> device, enqueued
  cuda->zero(a, 10 * sizeof(float));
  cuda->synchronize();
  cuda->copy_sync(back.data(), b, n * sizeof(float));
  EXPECT_TRUE(same_bits(src, back));
  cuda->copy_sync(back.data(), a, n * sizeof(float));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(back[i], 0.0f);
  EXPECT_EQ(back[10], src[10]);
  cuda->release(a);
  cuda->release(b);
  cuda->release(nullptr);
  // A stream of our own, then back to the legacy default stream.
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  cuda->set_stream(s);
  Dev<float> x(src), y(n);
  cuda->axpby(0.0f, x.p(), 1.0f, y.p(), static_cast<int64_t>(n));
  cuda->synchronize();
  EXPECT_TRUE(same_bits(src, y.get()));
  cuda->set_stream(nullptr);
  cudaStreamDestroy(s);
}

TEST_F(OpsTest, AllocFailureIsOutOfMemory) {
  try {
    cuda->alloc(size_t(1) << 52);
    FAIL() << "a 4 PiB allocation succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), DION_ERROR_OUT_OF_MEMORY);
    EXPECT_NE(std::string(e.what()).find("4503599627370496 bytes"), std::string::npos) << e.what();
  }
}

// Values that exercise every rounding path of bf16/fp16: specials,
// subnormals of both formats, overflow of fp16, ties.
std::vector<float> conversion_inputs(std::mt19937& rng) {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, 65504.0f, 65520.0f, 1e6f, -1e6f,
                          6e-8f, 3e-8f, 1e-5f, 1e-40f, 3.0e38f, 1.00390625f, 1.01171875f, 1.0009765625f};
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-30, 30);
  while (v.size() < 4099) v.push_back(std::ldexp(g(rng), e(rng)));
  return v;
}

TEST_F(OpsTest, LoadStoreAllDtypes) {
  const std::vector<float> in = conversion_inputs(rng);
  const int64_t n = static_cast<int64_t>(in.size());
  for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16}) {
    SCOPED_TRACE(dtype_name(dt));
    const size_t es = dtype_size(dt);
    std::vector<uint8_t> th(n * es), td;
    host->store(th.data(), dt, in.data(), n);
    Dev<float> din(in);
    Dev<uint8_t> dtyped(n * es);
    cuda->store(dtyped.p(), dt, din.p(), n);
    td = dtyped.get();
    EXPECT_TRUE(same_bits(th, td));
    std::vector<float> lh(n);
    host->load(lh.data(), th.data(), dt, n);
    Dev<float> dl(n);
    cuda->load(dl.p(), dtyped.p(), dt, n);
    EXPECT_TRUE(same_bits(lh, dl.get()));
  }
}

// split_bf16 (RCQR's split sketch at FP32): the host's bits for hi and lo,
// where the buffers are 16-byte aligned (chunks of eight, a tail of three)
// and where they are not (element by element). hi is store(BF16)'s; for
// Inf and NaN inputs lo is a NaN on both (inf - inf), whose payload the
// two processors may set differently, so only its NaN-ness is compared.
TEST_F(OpsTest, SplitBf16MatchesHost) {
  const std::vector<float> in = conversion_inputs(rng);
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> hh(static_cast<size_t>(n)), hl(static_cast<size_t>(n)), hs(static_cast<size_t>(n));
  host->split_bf16(hh.data(), hl.data(), in.data(), n);
  host->store(hs.data(), DION_DTYPE_BF16, in.data(), n);
  EXPECT_TRUE(same_bits(hs, hh));
  for (int64_t off : {int64_t(0), int64_t(1)}) {
    SCOPED_TRACE(off ? "misaligned" : "aligned");
    Dev<float> din(static_cast<size_t>(n + off));
    Dev<uint16_t> dh(static_cast<size_t>(n + off)), dl(static_cast<size_t>(n + 2 * off));
    cuda_ok(cudaMemcpy(din.p() + off, in.data(), sizeof(float) * static_cast<size_t>(n), cudaMemcpyHostToDevice),
            "upload");
    cuda->split_bf16(dh.p() + off, dl.p() + 2 * off, din.p() + off, n);
    const std::vector<uint16_t> gh = dh.get(), gl = dl.get();
    const std::vector<uint16_t> dhv(gh.begin() + off, gh.begin() + off + n);
    const std::vector<uint16_t> dlv(gl.begin() + 2 * off, gl.begin() + 2 * off + n);
    EXPECT_TRUE(same_bits(hh, dhv));
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(i);
      if (std::isfinite(in[k]))
        bad += hl[k] != dlv[k];
      else
        bad += !(std::isnan(bf16_to_float(hl[k])) && std::isnan(bf16_to_float(dlv[k])));
    }
    EXPECT_EQ(bad, 0) << "lo parts that differ from the host's";
  }
}

// store to bf16 and fp16 of a buffer long enough that every thread walks
// several chunks of eight (24M elements: more than 4 chunks per thread on a
// device of up to 146 SMs), with a tail of 5 elements past the last whole
// chunk: the host's bits.
TEST_F(OpsTest, StoreLongBuffers) {
  const int64_t n = 24000005;
  std::vector<float> in(static_cast<size_t>(n));
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& v : in) v = g(rng);
  Dev<float> din(in);
  for (dion_dtype_t dt : {DION_DTYPE_BF16, DION_DTYPE_FP16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<uint16_t> th(static_cast<size_t>(n));
    host->store(th.data(), dt, in.data(), n);
    Dev<uint16_t> dtyped(static_cast<size_t>(n));
    cuda->store(dtyped.p(), dt, din.p(), n);
    EXPECT_TRUE(same_bits(th, dtyped.get()));
  }
}

// The relative distance two sums of the same n nonnegative doubles, each
// term exact (squares of floats), may lie apart when they are added in
// different orders: each is within (n - 1) u of the exact sum (u = 2^-53,
// recursive or any tree summation of nonnegative terms), so 2 n u. (At n =
// 3.6M that is 8e-10; the sequential sum of a test's reference then lies
// 1.5e-12 from the device's tree, beyond a fixed 1e-12.)
double sums_bound(int64_t n) { return 2.0 * static_cast<double>(n) * 0x1p-53; }

// Three tensors of different dtypes and lengths, with their host and device tables.
struct Tensors {
  struct One {
    std::vector<uint8_t> h[4];
    Dev<uint8_t> d[4];
  };
  std::vector<One> t;
  std::vector<TensorEntry> host_list, dev_list;
  Dev<TensorEntry> dev_table;

  int64_t shift = 0;  // device buffers start this many elements past a 256-byte boundary

  // dtypes[i][f] (DION_DTYPE_UNSET: field absent), n[i] elements each.
  // shift > 0 misaligns the device tensors (the kernels' element paths).
  Tensors(std::mt19937& rng, const std::vector<std::vector<int>>& dtypes, const std::vector<int64_t>& n,
          int64_t shift_elems = 0)
      : shift(shift_elems) {
    std::normal_distribution<float> g(0.0f, 1.0f);
    t.resize(dtypes.size());
    for (size_t i = 0; i < dtypes.size(); ++i) {
      TensorEntry he{}, de{};
      he.n = de.n = n[i];
      he.tensor_id = de.tensor_id = static_cast<uint32_t>(3 * i + 1);
      for (int f = 0; f < 4; ++f) {
        const int dt = dtypes[i][f];
        he.dtype[f] = de.dtype[f] = dt;
        if (dt == DION_DTYPE_UNSET) continue;
        std::vector<float> vals(n[i]);
        for (auto& v : vals) v = f == kState1 ? std::fabs(g(rng)) * 0.1f : g(rng);
        t[i].h[f].resize(n[i] * dtype_size(static_cast<dion_dtype_t>(dt)));
        for (int64_t k = 0; k < n[i]; ++k) store_elem(t[i].h[f].data(), static_cast<dion_dtype_t>(dt), k, vals[k]);
        const size_t off = static_cast<size_t>(shift) * dtype_size(static_cast<dion_dtype_t>(dt));
        t[i].d[f] = Dev<uint8_t>(t[i].h[f].size() + off);
        cuda_ok(cudaMemcpy(t[i].d[f].p() + off, t[i].h[f].data(), t[i].h[f].size(), cudaMemcpyHostToDevice),
                "upload");
        he.ptr[f] = t[i].h[f].data();
        de.ptr[f] = t[i].d[f].p() + off;
      }
      host_list.push_back(he);
      dev_list.push_back(de);
    }
    dev_table = Dev<TensorEntry>(dev_list);
  }
  int64_t count() const { return static_cast<int64_t>(t.size()); }
  int64_t max_n() const {
    int64_t m = 0;
    for (const auto& e : host_list) m = std::max(m, e.n);
    return m;
  }
  // Field f of tensor i, host and device, as floats.
  std::vector<float> host_vals(size_t i, int f) const {
    std::vector<float> v(host_list[i].n);
    for (int64_t k = 0; k < host_list[i].n; ++k)
      v[k] = load_elem(t[i].h[f].data(), static_cast<dion_dtype_t>(host_list[i].dtype[f]), k);
    return v;
  }
  std::vector<float> dev_vals(size_t i, int f) const {
    const std::vector<uint8_t> raw = dev_raw(i, f);
    std::vector<float> v(host_list[i].n);
    for (int64_t k = 0; k < host_list[i].n; ++k)
      v[k] = load_elem(raw.data(), static_cast<dion_dtype_t>(host_list[i].dtype[f]), k);
    return v;
  }
  std::vector<uint8_t> dev_raw(size_t i, int f) const {
    std::vector<uint8_t> all = t[i].d[f].get();
    const size_t off = static_cast<size_t>(shift) * dtype_size(static_cast<dion_dtype_t>(host_list[i].dtype[f]));
    return std::vector<uint8_t>(all.begin() + static_cast<std::ptrdiff_t>(off), all.end());
  }
};

// n = 776 takes the 16-byte vector path (every row of the fp32 buffer
// aligned) with no tail, 777 the vector path with a tail and rows that
// alternate in alignment, and a shifted tensor the element path.
class LoadStoreMultiTest : public OpsTest, public ::testing::WithParamInterface<std::tuple<int64_t, int64_t>> {};

TEST_P(LoadStoreMultiTest, MatchesHost) {
  const int64_t n = std::get<0>(GetParam());
  Tensors ts(rng, {{0, 1, 2, 0}, {1, 2, 0, 1}, {2, 0, 1, 2}}, {n, n, n}, std::get<1>(GetParam()));
  for (int f = 0; f < 4; ++f) {
    SCOPED_TRACE(f);
    std::vector<float> lh(3 * n);
    host->load_multi(lh.data(), ts.host_list.data(), 3, static_cast<Field>(f), n);
    Dev<float> ld(3 * n);
    cuda->load_multi(ld.p(), ts.dev_table.p(), 3, static_cast<Field>(f), n);
    EXPECT_TRUE(same_bits(lh, ld.get()));
  }
  // store_multi: a set skip flag writes nothing; a clear one writes all.
  const std::vector<float> src = univ(3 * n, -4.0f, 4.0f);
  Dev<float> dsrc(src);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  const std::vector<uint8_t> before = ts.dev_raw(1, kGrad);
  cuda->store_multi(ts.dev_table.p(), 3, kGrad, dsrc.p(), n, skip.p());
  EXPECT_TRUE(same_bits(before, ts.dev_raw(1, kGrad)));
  skip.put({0});
  cuda->store_multi(ts.dev_table.p(), 3, kGrad, dsrc.p(), n, skip.p());
  int32_t hskip = 0;
  host->store_multi(ts.host_list.data(), 3, kGrad, src.data(), n, &hskip);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(same_bits(ts.t[i].h[kGrad], ts.dev_raw(i, kGrad))) << i;
  cuda->store_multi(ts.dev_table.p(), 3, kParam, dsrc.p(), n, nullptr);
  host->store_multi(ts.host_list.data(), 3, kParam, src.data(), n, nullptr);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(same_bits(ts.t[i].h[kParam], ts.dev_raw(i, kParam))) << i;
}

// scale_multi (Dion's full-rank error feedback, M <- mu M) on every field
// dtype (kState0 is fp16, fp32 and bf16 in the three tensors): the host's
// bits; a set skip flag writes nothing.
TEST_P(LoadStoreMultiTest, ScaleMultiMatchesHost) {
  const int64_t n = std::get<0>(GetParam());
  Tensors ts(rng, {{0, 1, 2, 0}, {1, 2, 0, 1}, {2, 0, 1, 2}}, {n, n, n}, std::get<1>(GetParam()));
  Dev<int32_t> skip(std::vector<int32_t>{1});
  const std::vector<uint8_t> before = ts.dev_raw(0, kState0);
  cuda->scale_multi(ts.dev_table.p(), 3, kState0, n, 0.95f, skip.p());
  EXPECT_TRUE(same_bits(before, ts.dev_raw(0, kState0)));
  skip.put({0});
  cuda->scale_multi(ts.dev_table.p(), 3, kState0, n, 0.95f, skip.p());
  int32_t hskip = 0;
  host->scale_multi(ts.host_list.data(), 3, kState0, n, 0.95f, &hskip);
  EXPECT_FALSE(same_bits(before, ts.dev_raw(0, kState0))) << "the scale should change the values";
  for (size_t i = 0; i < 3; ++i)
    for (int f = 0; f < 4; ++f)
      EXPECT_TRUE(same_bits(ts.t[i].h[f], ts.dev_raw(i, static_cast<Field>(f)))) << "tensor " << i << " field " << f;
}

// store_multi_bf16 (bf16 elements in, every field dtype out): the same bits
// as widening the bf16 source and store_multi, on the device and the host;
// a set skip flag writes nothing.
TEST_P(LoadStoreMultiTest, StoreMultiBf16EqualsWidenThenStoreMulti) {
  const int64_t n = std::get<0>(GetParam());
  Tensors ts(rng, {{0, 1, 2, 0}, {1, 2, 0, 1}, {2, 0, 1, 2}}, {n, n, n}, std::get<1>(GetParam()));
  Tensors tw(rng, {{0, 1, 2, 0}, {1, 2, 0, 1}, {2, 0, 1, 2}}, {n, n, n}, std::get<1>(GetParam()));
  std::vector<uint16_t> src(static_cast<size_t>(3 * n));
  std::vector<float> wide(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = float_to_bf16(uni(-4.0f, 4.0f));
    wide[i] = bf16_to_float(src[i]);
  }
  Dev<uint16_t> dsrc(src);
  Dev<float> dwide(wide);
  Dev<int32_t> skip(std::vector<int32_t>{1});
  const std::vector<uint8_t> before = ts.dev_raw(1, kState0);
  cuda->store_multi_bf16(ts.dev_table.p(), 3, kState0, dsrc.p(), n, skip.p());
  EXPECT_TRUE(same_bits(before, ts.dev_raw(1, kState0)));
  skip.put({0});
  cuda->store_multi_bf16(ts.dev_table.p(), 3, kState0, dsrc.p(), n, skip.p());
  cuda->store_multi(tw.dev_table.p(), 3, kState0, dwide.p(), n, nullptr);
  int32_t hskip = 0;
  host->store_multi_bf16(ts.host_list.data(), 3, kState0, src.data(), n, &hskip);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(same_bits(tw.dev_raw(i, kState0), ts.dev_raw(i, kState0))) << i;
    EXPECT_TRUE(same_bits(ts.t[i].h[kState0], ts.dev_raw(i, kState0))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, LoadStoreMultiTest,
                         ::testing::Combine(::testing::Values(int64_t{776}, int64_t{777}, int64_t{5}),
                                            ::testing::Values(int64_t{0}, int64_t{1})));

TEST_F(OpsTest, CheckNonfinite) {
  Tensors ts(rng, {{0, 0, -1, -1}, {1, 1, -1, -1}, {2, 2, -1, -1}}, {5000, 70001, 3});
  Dev<int32_t> flag(std::vector<int32_t>{7});
  cuda->check_nonfinite(ts.dev_table.p(), 3, ts.max_n(), kGrad, flag.p());
  EXPECT_EQ(flag.get()[0], 7) << "a clean check must leave the flag alone";
  // One bad element at a time, in each dtype, at the start, middle and end.
  struct Bad {
    size_t tensor;
    int64_t at;
    float value;
  } cases[] = {{0, 4999, NAN}, {1, 0, INFINITY}, {1, 70000, -INFINITY}, {2, 1, NAN}, {0, 2500, -INFINITY}};
  for (const Bad& c : cases) {
    const auto dt = static_cast<dion_dtype_t>(ts.host_list[c.tensor].dtype[kGrad]);
    std::vector<uint8_t> raw = ts.t[c.tensor].h[kGrad];
    store_elem(raw.data(), dt, c.at, c.value);
    ts.t[c.tensor].d[kGrad].put(raw);
    flag.put({0});
    cuda->check_nonfinite(ts.dev_table.p(), 3, ts.max_n(), kGrad, flag.p());
    int32_t hflag = 0;
    TensorEntry he = ts.host_list[c.tensor];
    he.ptr[kGrad] = raw.data();
    std::vector<TensorEntry> hl = ts.host_list;
    hl[c.tensor] = he;
    host->check_nonfinite(hl.data(), 3, ts.max_n(), kGrad, &hflag);
    EXPECT_EQ(flag.get()[0], 1) << "tensor " << c.tensor << " element " << c.at;
    EXPECT_EQ(hflag, 1);
    ts.t[c.tensor].d[kGrad].put(ts.t[c.tensor].h[kGrad]);  // clean again
  }
}

// The check reads the aligned body of a tensor with 16-byte loads and the
// misaligned head and the tail element by element: a tensor that starts at
// any element offset, of any length, must have its bad element found in
// every one of those parts, and a clean one must leave the flag alone.
TEST_F(OpsTest, CheckNonfiniteHeadBodyTail) {
  for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16}) {
    const int64_t esz = dt == DION_DTYPE_FP32 ? 4 : 2;
    const int64_t cap = 1200;
    const uint32_t inf_bits = dt == DION_DTYPE_FP32 ? 0x7f800000u : dt == DION_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
    const uint32_t nan_bits = dt == DION_DTYPE_FP32 ? 0xffc00001u : dt == DION_DTYPE_BF16 ? 0xffc1u : 0xfe01u;
    const uint32_t one_bits = dt == DION_DTYPE_FP32 ? 0x3f800000u : dt == DION_DTYPE_BF16 ? 0x3f80u : 0x3c00u;
    auto put_bits = [&](std::vector<uint8_t>& raw, int64_t i, uint32_t bits) {
      std::memcpy(raw.data() + i * esz, &bits, static_cast<size_t>(esz));  // little endian
    };
    std::vector<uint8_t> clean(static_cast<size_t>(cap * esz));
    for (int64_t i = 0; i < cap; ++i) put_bits(clean, i, one_bits);
    Dev<uint8_t> buf(clean);
    Dev<int32_t> flag(std::vector<int32_t>{0});
    for (int64_t off : {0, 1, 2, 3, 5}) {
      for (int64_t len : {1, 2, 7, 8, 9, 33, 1001}) {
        TensorEntry e{};
        e.ptr[kGrad] = buf.p() + off * esz;
        e.dtype[kGrad] = dt;
        e.n = len;
        Dev<TensorEntry> table(std::vector<TensorEntry>{e});
        flag.put({5});
        cuda->check_nonfinite(table.p(), 1, len, kGrad, flag.p());
        ASSERT_EQ(flag.get()[0], 5) << dtype_name(dt) << " offset " << off << " length " << len << ": clean";
        for (int64_t at : {int64_t{0}, int64_t{1}, int64_t{3}, len / 2, len - 2, len - 1}) {
          if (at < 0 || at >= len) continue;
          for (uint32_t bad : {inf_bits, nan_bits}) {
            std::vector<uint8_t> raw = clean;
            put_bits(raw, off + at, bad);
            buf.put(raw);
            flag.put({0});
            cuda->check_nonfinite(table.p(), 1, len, kGrad, flag.p());
            EXPECT_EQ(flag.get()[0], 1) << dtype_name(dt) << " offset " << off << " length " << len << " bad at " << at;
          }
        }
        // A bad element just outside the tensor (before and after) is not its business.
        std::vector<uint8_t> raw = clean;
        if (off > 0) put_bits(raw, off - 1, nan_bits);
        if (off + len < cap) put_bits(raw, off + len, nan_bits);
        buf.put(raw);
        flag.put({0});
        cuda->check_nonfinite(table.p(), 1, len, kGrad, flag.p());
        EXPECT_EQ(flag.get()[0], 0) << dtype_name(dt) << " offset " << off << " length " << len << ": neighbours";
        buf.put(clean);
      }
    }
  }
}

// The Muon family's bf16 iteration folds a X into the polynomial's s x s
// matrix: B += a I on bf16 storage. Only the diagonal moves, each entry
// rounded as the host rounds it; padding and gaps are untouched.
TEST_F(OpsTest, AddDiagBf16) {
  for (auto dims : {std::vector<int64_t>{7, 7, 3}, std::vector<int64_t>{5, 9, 2}, std::vector<int64_t>{64, 64, 1}}) {
    const int64_t rows = dims[0], cols = dims[1], batch = dims[2], ld = cols + 3, stride = rows * ld + 5;
    std::vector<uint16_t> h(static_cast<size_t>(stride * batch));
    for (auto& e : h) e = float_to_bf16(gauss());
    Dev<uint16_t> d(h);
    const float v = 2.3465413f;
    cuda->add_diag_bf16(MatBatch{reinterpret_cast<float*>(d.p()), rows, cols, ld, stride, batch}, v);
    std::vector<uint16_t> want = h;
    host->add_diag_bf16(MatBatch{reinterpret_cast<float*>(want.data()), rows, cols, ld, stride, batch}, v);
    const std::vector<uint16_t> got = d.get();
    int moved = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      EXPECT_EQ(got[i], want[i]) << "element " << i;
      moved += want[i] != h[i];
    }
    EXPECT_GT(moved, 0);
    EXPECT_LE(moved, std::min(rows, cols) * batch) << "only diagonal entries may change";
  }
}

TEST_F(OpsTest, StepCounters) {
  GroupScalars gs{0.1, 0.01, 0.9, 0.99, 5, 0};
  for (int skip : {0, 1}) {
    StepStatus st{skip, 0, 3};
    Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
    Dev<StepStatus> dst(std::vector<StepStatus>{st});
    cuda->advance_step(dgs.p(), dst.p());
    cuda->count_skip(dst.p());
    GroupScalars hgs = gs;
    host->advance_step(&hgs, &st);
    host->count_skip(&st);
    EXPECT_EQ(dgs.get()[0].step, hgs.step);
    EXPECT_EQ(hgs.step, skip ? 5 : 6);
    EXPECT_EQ(dst.get()[0].skipped_steps, st.skipped_steps);
    EXPECT_EQ(st.skipped_steps, skip ? 4 : 3);
  }
}

TEST_F(OpsTest, VectorOps) {
  const int64_t n = 100003;
  std::vector<float> x = univ(n, -3, 3), y = univ(n, -3, 3);
  x[5] = NAN;
  x[6] = INFINITY;
  x[7] = -INFINITY;
  Dev<float> dx(x), dy(y), dz(n);
  std::vector<float> hy = y, hz(n);
  cuda->axpby(0.75f, dx.p(), -1.25f, dy.p(), n);
  host->axpby(0.75f, x.data(), -1.25f, hy.data(), n);
  EXPECT_TRUE(close(hy, dy.get(), kUlps));
  cuda->lincomb(0.3f, dx.p(), 1.7f, dy.p(), dz.p(), n);
  host->lincomb(0.3f, x.data(), 1.7f, hy.data(), hz.data(), n);
  EXPECT_TRUE(close(hz, dz.get(), kUlps));
  std::vector<float> hx = x;
  cuda->nan_to_num(dx.p(), n);
  host->nan_to_num(hx.data(), n);
  EXPECT_TRUE(same_bits(hx, dx.get()));
  EXPECT_EQ(hx[5], 0.0f);
  EXPECT_EQ(hx[6], FLT_MAX);
}

TEST_F(OpsTest, ZeroFixup) {
  const int64_t B = 3;
  Mat m = Mat::padded(20, 30, B), p = Mat::padded(20, 6, B), r = Mat::padded(30, 6, B, 2, 1),
      q = Mat::padded(30, 6, B, 1, 0);
  m.fill([&] { return uni(); });
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) m.at(1, i, j) = (i + j) % 2 ? 0.0f : -0.0f;  // all zero
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) m.at(2, i, j) = 0.0f;
  m.at(2, 19, 29) = NAN;  // not zero
  m.sync();
  p.fill([&] { return uni(); });
  r.fill([&] { return uni(); });
  q.fill([&] { return uni(); });
  cuda->zero_fixup(m.D(), p.D(), r.D(), q.D());
  host->zero_fixup(m.H(), p.H(), r.H(), q.H());
  EXPECT_TRUE(same_bits(p.h, p.dev()));
  EXPECT_TRUE(same_bits(r.h, r.dev()));
  EXPECT_EQ(p.h[p.stride + 3], 0.0f);
  EXPECT_EQ(r.h[r.stride + 2 * r.ld], q.h[q.stride + 2 * q.ld]);
}

// The sharded halves of zero_fixup (flags, then the fix-up) agree with the
// host and with the one-call form.
TEST_F(OpsTest, NonzeroFlagsAndFlaggedFixup) {
  const int64_t B = 3;
  Mat m = Mat::padded(20, 30, B), p = Mat::padded(20, 6, B), r = Mat::padded(30, 6, B, 2, 1),
      q = Mat::padded(30, 6, B, 1, 0);
  m.fill([&] { return uni(); });
  for (int64_t i = 0; i < m.rows; ++i)
    for (int64_t j = 0; j < m.cols; ++j) m.at(1, i, j) = (i + j) % 2 ? 0.0f : -0.0f;  // all zero
  m.sync();
  p.fill([&] { return uni(); });
  r.fill([&] { return uni(); });
  q.fill([&] { return uni(); });
  Dev<int32_t> dflags(static_cast<size_t>(B));
  std::vector<int32_t> hflags(static_cast<size_t>(B), -5);
  cuda->nonzero_flags(m.D(), dflags.p());
  host->nonzero_flags(m.H(), hflags.data());
  EXPECT_EQ(hflags, dflags.get());
  EXPECT_EQ(hflags, (std::vector<int32_t>{1, 0, 1}));
  Mat p2 = Mat::padded(20, 6, B), r2 = Mat::padded(30, 6, B, 2, 1);
  p2.h = p.h;
  r2.h = r.h;
  cuda->zero_fixup_flagged(dflags.p(), p.D(), r.D(), q.D());
  host->zero_fixup_flagged(hflags.data(), p.H(), r.H(), q.H());
  EXPECT_TRUE(same_bits(p.h, p.dev()));
  EXPECT_TRUE(same_bits(r.h, r.dev()));
  host->zero_fixup(m.H(), p2.H(), r2.H(), q.H());
  EXPECT_TRUE(same_bits(p.h, p2.h));
  EXPECT_TRUE(same_bits(r.h, r2.h));
}

// An empty shard of R (0 rows: the FSDP rank with no rows of B's columns)
// gives zero column sums in finish_r, and col_scale_store leaves everything
// alone, on both backends.
TEST_F(OpsTest, FinishREmptyShardGivesZeroSums) {
  const int64_t T = 2, cols = 50;
  const std::vector<int32_t> flags = {1, 0};
  Dev<int32_t> dflags(flags);
  Dev<double> dss(std::vector<double>(T * cols, -1.0));
  std::vector<double> hss(T * cols, -1.0);
  std::vector<float> none(1);
  Dev<float> dnone(none);
  const MatBatch dr{dnone.p(), 0, cols, cols, 0, T}, hr{none.data(), 0, cols, cols, 0, T};
  cuda->finish_r(dr, dflags.p(), ConstMatBatch(dnone.p(), 0, cols, cols, 0, T), nullptr, kState1, nullptr, dss.p());
  host->finish_r(hr, flags.data(), ConstMatBatch(none.data(), 0, cols, cols, 0, T), nullptr, kState1, nullptr,
                 hss.data());
  EXPECT_EQ(dss.get(), std::vector<double>(T * cols, 0.0));
  EXPECT_EQ(hss, std::vector<double>(T * cols, 0.0));
  cuda->col_scale_store(dr, dss.p(), 1e-7f, nullptr, nullptr, kState1, nullptr, true);
  host->col_scale_store(hr, hss.data(), 1e-7f, nullptr, nullptr, kState1, nullptr, true);
  EXPECT_TRUE(same_bits(none, dnone.get()));
}

// copy2d moves a strided block and leaves the rest of the destination alone.
TEST_F(OpsTest, Copy2d) {
  const std::vector<float> src = univ(7 * 9);
  std::vector<float> hdst(5 * 12, kPad);
  Dev<float> dsrc(src), ddst(hdst);
  // rows 1..4 (4 rows) of src, columns 2..7 (6 floats), to dst at column 3
  cuda->copy2d(ddst.p() + 3, 12 * 4, dsrc.p() + 9 + 2, 9 * 4, 6 * 4, 4);
  host->copy2d(hdst.data() + 3, 12 * 4, src.data() + 9 + 2, 9 * 4, 6 * 4, 4);
  EXPECT_TRUE(same_bits(hdst, ddst.get()));
  EXPECT_EQ(hdst[12 + 3], src[2 * 9 + 2]);
  EXPECT_EQ(hdst[2], kPad);
}

TEST_F(OpsTest, FrobAndColumnNormalize) {
  for (int64_t rows : {70, 1, 700}) {
    SCOPED_TRACE(rows);
    Mat m = Mat::padded(rows, 50, 3);
    m.fill([&] { return gauss(); });
    for (int64_t i = 0; i < m.rows; ++i)  // matrix 2: all zero (eps keeps it finite)
      for (int64_t j = 0; j < m.cols; ++j) m.at(2, i, j) = 0.0f;
    m.sync();
    Mat c = Mat::padded(rows, 50, 3);
    c.h = m.h;
    c.sync();
    cuda->frob_normalize(m.D(), 1.3f, 1e-7f);
    host->frob_normalize(m.H(), 1.3f, 1e-7f);
    EXPECT_TRUE(close(m.h, m.dev(), kUlps));
    cuda->col_normalize(c.D(), 1e-7f);
    host->col_normalize(c.H(), 1e-7f);
    EXPECT_TRUE(close(c.h, c.dev(), kUlps));
  }
}

TEST_F(OpsTest, FrobNormalizeIsDeterministic) {
  // Large enough for many chunks per matrix: every run must give the same bits.
  Mat m = Mat::padded(1024, 1000, 4, 24, 0);
  m.fill([&] { return gauss(); });
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    m.sync();
    cuda->frob_normalize(m.D(), 1.0f, 1e-7f);
    if (run == 0)
      first = m.dev();
    else
      EXPECT_TRUE(same_bits(first, m.dev()));
  }
  host->frob_normalize(m.H(), 1.0f, 1e-7f);
  EXPECT_TRUE(close(m.h, first, kUlps));
}

// The shape Dion's and Muon's normalisations see on a large model: checks
// the result and reports the time (a memory-bound two-pass kernel: it reads
// the batch twice and writes it once).
TEST_F(OpsTest, FrobNormalizeLarge) {
  const int64_t B = 24, rows = 8192, cols = 2048, n = B * rows * cols;
  Dev<float> m(static_cast<size_t>(n));
  const PhiloxKey key{1, kRngInitQ, 0, 0};
  cuda->randn(m.p(), B, rows, cols, 0, 0, cols, key, nullptr, nullptr, 3.0f);
  cuda->frob_normalize(MatBatch{m.p(), rows, cols, cols, rows * cols, B}, 1.0f, 0.0f);  // warm-up
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0);
  const int reps = 5;
  for (int i = 0; i < reps; ++i) cuda->frob_normalize(MatBatch{m.p(), rows, cols, cols, rows * cols, B}, 1.0f, 0.0f);
  cudaEventRecord(t1);
  ASSERT_EQ(cudaEventSynchronize(t1), cudaSuccess);
  float ms = 0;
  cudaEventElapsedTime(&ms, t0, t1);
  ms /= reps;
  std::printf("frob_normalize 24 x 8192 x 2048: %.3f ms, %.0f GB/s (3 passes over %.2f GB)\n", ms,
              3.0 * n * 4 / (ms * 1e6), n * 4 / 1e9);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  // Every matrix now has unit Frobenius norm.
  std::vector<float> last(static_cast<size_t>(rows * cols));
  ASSERT_EQ(cudaMemcpy(last.data(), m.p() + (B - 1) * rows * cols, last.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  double s = 0;
  for (float x : last) s += static_cast<double>(x) * x;
  EXPECT_NEAR(std::sqrt(s), 1.0, 1e-5);
}

TEST_F(OpsTest, SliceL1) {
  Mat m = Mat::padded(37, 90, 3);
  m.fill([&] { return gauss(); });
  for (Axis ax : {kRows, kCols}) {
    SCOPED_TRACE(ax);
    const int64_t N = ax == kRows ? m.rows : m.cols;
    std::vector<float> h(m.batch * N);
    Dev<float> d(h.size());
    host->slice_l1(m.H(), ax, h.data());
    cuda->slice_l1(m.D(), ax, d.p());
    EXPECT_TRUE(close(h, d.get(), 1e-5));  // host sums in fp32 (see the top)
  }
}

TEST_F(OpsTest, NeuronNormalize) {
  for (Axis ax : {kRows, kCols})
    for (bool sel : {false, true}) {
      SCOPED_TRACE(std::string(ax == kRows ? "rows" : "cols") + (sel ? " selected" : ""));
      const int64_t B = 3;
      Mat u = Mat::padded(24, 40, B);
      u.fill([&] { return gauss(); });
      const int64_t N = ax == kRows ? u.rows : u.cols, per = sel ? 3 * N : N;
      std::vector<float> v(B * per);
      for (auto& x : v) x = uni(0.0f, 2.0f);
      std::vector<int32_t> idx;
      if (sel)
        for (int64_t b = 0; b < B; ++b) {
          std::vector<int32_t> all(per);
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng);
          all.resize(N);
          std::sort(all.begin(), all.end());
          idx.insert(idx.end(), all.begin(), all.end());
        }
      Dev<float> dv(v);
      Dev<int32_t> didx(sel ? idx : std::vector<int32_t>{0});
      cuda->neuron_normalize(u.D(), ax, dv.p(), per, 0.95f, sel ? didx.p() : nullptr);
      host->neuron_normalize(u.H(), ax, v.data(), per, 0.95f, sel ? idx.data() : nullptr);
      EXPECT_TRUE(close(v, dv.get(), kUlps));
      EXPECT_TRUE(close(u.h, u.dev(), kUlps));
    }
}

TEST_F(OpsTest, ApplyUpdateAndDecay) {
  const int64_t n = 50001;
  const GroupScalars gs{0.02, 0.1, 0.9, 0.95, 3, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  for (bool cautious : {false, true}) {
    std::vector<float> x = univ(n), u = univ(n);
    Dev<float> dx(x), du(u);
    cuda->apply_update(dx.p(), du.p(), n, dgs.p(), 1.7f, cautious);
    host->apply_update(x.data(), u.data(), n, &gs, 1.7f, cautious);
    EXPECT_TRUE(close(x, dx.get(), kUlps)) << "cautious " << cautious;
    cuda->decay(dx.p(), n, dgs.p());
    host->decay(x.data(), n, &gs);
    EXPECT_TRUE(close(x, dx.get(), kUlps));
  }
}

// Relative tolerance of a stored value: the larger of the fp32 one and one
// unit in the last place of the storage dtype (a 1-ulp fp32 difference before
// rounding can move a bf16/fp16 result by one of its own ulps).
double dtype_rtol(int dt) { return dt == DION_DTYPE_BF16 ? 1.0 / 128 : dt == DION_DTYPE_FP16 ? 1.0 / 1024 : kUlps; }

// Field f of tensor i, host against device, within its dtype's tolerance
// (atol: fp16 results below its normal range are spaced 2^-24 apart).
void compare_field(const Tensors& ts, size_t i, int f) {
  const int dt = ts.host_list[i].dtype[f];
  EXPECT_TRUE(close(ts.host_vals(i, f), ts.dev_vals(i, f), dtype_rtol(dt), dt == DION_DTYPE_FP16 ? 6e-8 : 0.0))
      << "tensor " << i << " field " << f;
}

void compare_tensors(const Tensors& ts, int fields) {
  for (size_t i = 0; i < ts.t.size(); ++i)
    for (int f = 0; f < fields; ++f)
      if (f != kGrad) compare_field(ts, i, f);
}

// Aligned tensors take the kernels' 16-byte vector path (plus an element
// tail when n is not a multiple of 8), shifted ones the element path: both
// must give the host backend's results.
TEST_F(OpsTest, AdamWAndLion) {
  const std::vector<std::vector<int>> dtypes = {{0, 0, 0, 0}, {1, 1, 0, 0}, {2, 0, 1, 2},
                                                {1, 2, 1, 1}, {1, 1, 1, 1}, {2, 2, 2, 2}};
  const std::vector<int64_t> n = {1000, 3001, 517, 70000, 4099, 8};
  const GroupScalars gs{1e-2, 0.1, 0.9, 0.99, 3, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  Dev<int32_t> skip(std::vector<int32_t>{0});
  for (int64_t shift : {0, 1})
  for (bool cautious : {false, true}) {
    SCOPED_TRACE(std::string(cautious ? "cautious" : "plain") + (shift ? ", misaligned" : ", aligned"));
    Tensors a(rng, dtypes, n, shift);
    cuda->adamw(a.dev_table.p(), a.count(), a.max_n(), dgs.p(), 1e-8f, cautious, skip.p());
    host->adamw(a.host_list.data(), a.count(), a.max_n(), &gs, 1e-8f, cautious, nullptr);
    compare_tensors(a, 4);
    Tensors l(rng, dtypes, n, shift);
    cuda->lion(l.dev_table.p(), l.count(), l.max_n(), dgs.p(), cautious, nullptr);
    host->lion(l.host_list.data(), l.count(), l.max_n(), &gs, cautious, nullptr);
    compare_tensors(l, 3);
  }
  // A skipped step writes nothing.
  Tensors a(rng, dtypes, n);
  skip.put({1});
  cuda->adamw(a.dev_table.p(), a.count(), a.max_n(), dgs.p(), 1e-8f, false, skip.p());
  cuda->lion(a.dev_table.p(), a.count(), a.max_n(), dgs.p(), false, skip.p());
  for (size_t i = 0; i < a.t.size(); ++i)
    for (int f = 0; f < 4; ++f) EXPECT_TRUE(same_bits(a.t[i].h[f], a.dev_raw(i, f))) << i << " " << f;
}

TEST_F(OpsTest, RandnMatchesHost) {
  const int64_t B = 3, rows = 33, cols = 65, row0 = 2, col0 = 3, gcols = 100;
  const PhiloxKey key{0x1234567890abcdefull, kRngSketch | (1u << 8), 99, 7};
  Tensors ts(rng, {{0, -1, -1, -1}, {0, -1, -1, -1}, {0, -1, -1, -1}}, {1, 1, 1});
  const int64_t step = 42;
  Dev<int64_t> dstep(std::vector<int64_t>{step});
  for (int variant = 0; variant < 2; ++variant) {
    const bool keyed = variant == 1;  // tensor ids and step from memory
    std::vector<float> h(B * rows * cols);
    Dev<float> d(h.size());
    host->randn(h.data(), B, rows, cols, row0, col0, gcols, key, keyed ? ts.host_list.data() : nullptr,
                keyed ? &step : nullptr, 0.5f);
    cuda->randn(d.p(), B, rows, cols, row0, col0, gcols, key, keyed ? ts.dev_table.p() : nullptr,
                keyed ? dstep.p() : nullptr, 0.5f);
    const std::vector<float> g = d.get();
    // The device's double log/cos may differ from the host libm's in the
    // last bit; after rounding to fp32 that is at most one ulp, rarely.
    size_t differ = 0;
    for (size_t i = 0; i < h.size(); ++i)
      if (h[i] != g[i]) {
        ++differ;
        EXPECT_LE(std::fabs(h[i] - g[i]), std::fabs(h[i]) * 1.2e-7) << i;
      }
    EXPECT_LE(differ, h.size() / 1000 + 1);
    if (keyed) EXPECT_NE(h[0], h[rows * cols]) << "tensor ids must key the matrices of a batch";
    // randn_bf16: the device's fp32 numbers rounded as store rounds them,
    // bit for bit; the host's, its fp32 numbers rounded.
    Dev<uint16_t> d16(h.size()), d16s(h.size());
    cuda->randn_bf16(d16.p(), B, rows, cols, row0, col0, gcols, key, keyed ? ts.dev_table.p() : nullptr,
                     keyed ? dstep.p() : nullptr, 0.5f);
    cuda->store(d16s.p(), DION_DTYPE_BF16, d.p(), B * rows * cols);
    EXPECT_TRUE(same_bits(d16s.get(), d16.get()));
    std::vector<uint16_t> h16(h.size()), h16s(h.size());
    host->randn_bf16(h16.data(), B, rows, cols, row0, col0, gcols, key, keyed ? ts.host_list.data() : nullptr,
                     keyed ? &step : nullptr, 0.5f);
    host->store(h16s.data(), DION_DTYPE_BF16, h.data(), B * rows * cols);
    EXPECT_TRUE(same_bits(h16s, h16));
  }
}

TEST_F(OpsTest, TopkMatchesHost) {
  struct Case {
    int64_t batch, n, k;
    int levels;  // scores drawn from this many values (ties); 0: continuous
  } cases[] = {{3, 65536, 1, 50},     {3, 65536, 100, 50},  {2, 65536, 32768, 7}, {2, 65536, 65535, 3},
               {2, 65536, 65536, 3},  {4, 10, 3, 2},        {3, 5000, 77, 0},     {2, 4097, 4000, 0},
               {1, 1000, 500, 1},     {3, 300, 150, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "n " << c.n << " k " << c.k << " levels " << c.levels);
    std::vector<float> s(c.batch * c.n);
    std::uniform_int_distribution<int> lv(0, std::max(c.levels - 1, 0));
    for (auto& x : s) x = c.levels ? static_cast<float>(lv(rng)) - c.levels / 2 : gauss();
    // -0 and +0 are equal scores (the host compares with ==).
    for (size_t i = 0; i < s.size(); i += 3)
      if (s[i] == 0.0f) s[i] = -0.0f;
    std::vector<int32_t> h(c.batch * c.k);
    host->topk(s.data(), c.batch, c.n, c.k, h.data());
    Dev<float> ds(s);
    Dev<int32_t> d(h.size());
    cuda->topk(ds.p(), c.batch, c.n, c.k, d.p());
    EXPECT_TRUE(same_bits(h, d.get()));
  }
}

TEST_F(OpsTest, Slices) {
  const int64_t B = 2, k = 5;
  for (Axis ax : {kRows, kCols}) {
    SCOPED_TRACE(ax == kRows ? "rows" : "cols");
    Mat m = Mat::padded(12, 17, B);
    m.fill([&] { return gauss(); });
    const int64_t N = ax == kRows ? m.rows : m.cols;
    std::vector<int32_t> idx;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < k; ++s) idx.push_back(static_cast<int32_t>((s * 2 + b) % N));  // distinct, as topk's
    Dev<int32_t> didx(idx);
    Mat out = ax == kRows ? Mat::padded(k, m.cols, B) : Mat::padded(m.rows, k, B);
    cuda->gather_slices(m.D(), ax, didx.p(), k, out.D());
    host->gather_slices(m.H(), ax, idx.data(), k, out.H());
    EXPECT_TRUE(same_bits(out.h, out.dev()));
    cuda->scale_slices(m.D(), ax, didx.p(), k, -0.5f);
    host->scale_slices(m.H(), ax, idx.data(), k, -0.5f);
    EXPECT_TRUE(same_bits(m.h, m.dev()));
    const GroupScalars gs{0.03, 0.0, 0.9, 0.99, 1, 0};
    Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
    cuda->add_slices(m.D(), ax, didx.p(), k, out.D(), dgs.p(), -2.0f);
    host->add_slices(m.H(), ax, idx.data(), k, out.H(), &gs, -2.0f);
    EXPECT_TRUE(close(m.h, m.dev(), kUlps));
    cuda->add_slices(m.D(), ax, didx.p(), k, out.D(), nullptr, 0.25f);
    host->add_slices(m.H(), ax, idx.data(), k, out.H(), nullptr, 0.25f);
    EXPECT_TRUE(close(m.h, m.dev(), kUlps));
  }
}

// ---- fused passes over typed buffers (Backend::momentum_multi, ...) ----
// Each must give the bits of the op sequence it replaces on the same backend
// (the same fp32 operations, no FMA contraction: exact), and the host's
// fused op within the tolerances above. Tensors of a batch share their
// length n (as load_multi's do) but not their dtypes; n = 776 takes the
// vector path with no tail, 777 a tail and fp32 rows of alternating
// alignment, 5 the element path only, and a shift of one element the
// element path everywhere. A set skip flag must leave every typed buffer
// as it was, bit for bit.

// Two identical sets of tensors: one runs the old sequence, one the fused op.
struct TensorPair {
  Tensors a, b;
  TensorPair(std::mt19937& rng, const std::vector<std::vector<int>>& dtypes, int64_t n, int64_t shift)
      : a(copy_rng(rng), dtypes, std::vector<int64_t>(dtypes.size(), n), shift),
        b(rng, dtypes, std::vector<int64_t>(dtypes.size(), n), shift) {}
  static std::mt19937& copy_rng(std::mt19937& rng) {
    static thread_local std::mt19937 c;
    c = rng;
    return c;
  }
  ::testing::AssertionResult same_field(int f) const {
    for (size_t i = 0; i < a.t.size(); ++i) {
      ::testing::AssertionResult r = same_bits(a.dev_raw(i, f), b.dev_raw(i, f));
      if (!r) return r << " (tensor " << i << ", field " << f << ")";
    }
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult unchanged(int f) const {  // b's device copy still holds the inputs
    for (size_t i = 0; i < b.t.size(); ++i) {
      ::testing::AssertionResult r = same_bits(b.t[i].h[f], b.dev_raw(i, f));
      if (!r) return r << " (tensor " << i << ", field " << f << ")";
    }
    return ::testing::AssertionSuccess();
  }
};

class FusedMultiTest : public OpsTest, public ::testing::WithParamInterface<std::tuple<int64_t, int64_t>> {};

TEST_P(FusedMultiTest, MomentumMulti) {
  const int64_t n = std::get<0>(GetParam()), shift = std::get<1>(GetParam()), T = 5, N = T * n;
  // {param, grad, momentum, -}: the momentum's dtype differs from the grad's in some.
  const std::vector<std::vector<int>> dtypes = {{1, 0, 0, -1}, {1, 1, 1, -1}, {2, 2, 1, -1}, {1, 1, 0, -1},
                                                {0, 0, 2, -1}};
  for (int variant = 0; variant < 4; ++variant)
    for (int32_t skip : {0, 1}) {
      const bool nesterov = variant & 1, store_state = !(variant & 2);
      const float mu = store_state ? 0.95f : 1.0f;  // Muon, or Dion2's M += G
      SCOPED_TRACE(::testing::Message() << "nesterov " << nesterov << ", store " << store_state << ", skip " << skip);
      TensorPair tp(rng, dtypes, n, shift);
      Dev<int32_t> dskip(std::vector<int32_t>{skip});
      Dev<float> M(N), G(N), U(N), U2(N);
      cuda->load_multi(M.p(), tp.a.dev_table.p(), T, kState0, n);
      cuda->load_multi(G.p(), tp.a.dev_table.p(), T, kGrad, n);
      cuda->axpby(mu, G.p(), 1.0f, M.p(), N);
      if (store_state) cuda->store_multi(tp.a.dev_table.p(), T, kState0, M.p(), n, dskip.p());
      if (nesterov)
        cuda->lincomb(mu, M.p(), 1.0f, G.p(), U.p(), N);
      else
        cuda->copy(U.p(), M.p(), sizeof(float) * static_cast<size_t>(N));
      cuda->momentum_multi(tp.b.dev_table.p(), T, n, mu, 1.0f, nesterov, store_state, U2.p(), DION_DTYPE_FP32, dskip.p(),
                           nullptr);
      const std::vector<float> u2 = U2.get();
      EXPECT_TRUE(same_bits(U.get(), u2));
      EXPECT_TRUE(tp.same_field(kState0));
      EXPECT_TRUE(tp.unchanged(kGrad));
      if (skip || !store_state) EXPECT_TRUE(tp.unchanged(kState0));
      std::vector<float> uh(N);
      host->momentum_multi(tp.b.host_list.data(), T, n, mu, 1.0f, nesterov, store_state, uh.data(), DION_DTYPE_FP32, &skip,
                           nullptr);
      EXPECT_TRUE(close(uh, u2, kUlps));
      for (size_t i = 0; i < tp.b.t.size(); ++i) compare_field(tp.b, i, kState0);
    }
}

// momentum_multi with u in bf16: the bits of the fp32 u rounded by store, on
// the device and the host (Dion's M + G at matmul precision BF16).
TEST_P(FusedMultiTest, MomentumMultiBf16U) {
  const int64_t n = std::get<0>(GetParam()), shift = std::get<1>(GetParam()), T = 5, N = T * n;
  const std::vector<std::vector<int>> dtypes = {{1, 1, 1, -1}, {1, 0, 1, -1}, {0, 0, 0, -1}, {1, 2, 1, -1},
                                                {2, 2, 2, -1}};
  TensorPair tp(rng, dtypes, n, shift);
  Dev<float> U(N), Ub(N);  // Ub: room for N bf16 elements
  Dev<uint16_t> R(N);
  cuda->momentum_multi(tp.a.dev_table.p(), T, n, 1.0f, 1.0f, false, false, U.p(), DION_DTYPE_FP32, nullptr, nullptr);
  cuda->store(R.p(), DION_DTYPE_BF16, U.p(), N);
  cuda->momentum_multi(tp.b.dev_table.p(), T, n, 1.0f, 1.0f, false, false, Ub.p(), DION_DTYPE_BF16, nullptr, nullptr);
  const std::vector<uint16_t> want = R.get();
  std::vector<uint16_t> got(static_cast<size_t>(N));
  cuda_ok(cudaMemcpy(got.data(), Ub.p(), sizeof(uint16_t) * static_cast<size_t>(N), cudaMemcpyDeviceToHost), "download");
  EXPECT_TRUE(same_bits(want, got));
  std::vector<uint16_t> hu(static_cast<size_t>(N));
  host->momentum_multi(tp.b.host_list.data(), T, n, 1.0f, 1.0f, false, false, hu.data(), DION_DTYPE_BF16, nullptr,
                       nullptr);
  EXPECT_TRUE(same_bits(want, hu));
}

// momentum_multi_sums (Muon's unnormalised bf16 start): the state and u of
// momentum_multi (fp32 and bf16 u, skipped or not), the host's bits, and
// momentum_parts partial sums per tensor totalling the squares of u as
// written (within sums_bound: double sums in another order), the same on a
// second run. The sizes leave element-wise tails; shift 1 takes the
// element path throughout.
TEST_P(FusedMultiTest, MomentumMultiSums) {
  const int64_t n = std::get<0>(GetParam()), shift = std::get<1>(GetParam()), T = 5, N = T * n;
  const std::vector<std::vector<int>> dtypes = {{1, 1, 1, -1}, {1, 0, 1, -1}, {0, 0, 0, -1}, {1, 2, 1, -1},
                                                {2, 2, 2, -1}};
  const int64_t parts = cuda->momentum_parts(T, n);
  ASSERT_GE(parts, 1);
  ASSERT_LE(parts, Backend::select_parts_max(1, n));
  for (dion_dtype_t ud : {DION_DTYPE_FP32, DION_DTYPE_BF16})
    for (int32_t skip : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "u dtype " << ud << ", skip " << skip);
      TensorPair tp(rng, dtypes, n, shift);
      Dev<int32_t> dskip(std::vector<int32_t>{skip});
      Dev<float> U1(N), U2(N);
      Dev<double> sums(T * parts), sums2(T * parts);
      cuda->momentum_multi(tp.a.dev_table.p(), T, n, 0.95f, 1.0f, true, true, U1.p(), ud, dskip.p(), nullptr);
      cuda->momentum_multi_sums(tp.b.dev_table.p(), T, n, 0.95f, 1.0f, true, U2.p(), ud, dskip.p(), sums.p());
      EXPECT_TRUE(tp.same_field(kState0));
      const size_t bytes = static_cast<size_t>(N) * dtype_size(ud);
      std::vector<uint8_t> u1(bytes), u2(bytes);
      cuda_ok(cudaMemcpy(u1.data(), U1.p(), bytes, cudaMemcpyDeviceToHost), "download");
      cuda_ok(cudaMemcpy(u2.data(), U2.p(), bytes, cudaMemcpyDeviceToHost), "download");
      EXPECT_TRUE(same_bits(u1, u2)) << "u as momentum_multi writes it";
      const std::vector<double> sd = sums.get();
      std::vector<double> hs(static_cast<size_t>(T));
      std::vector<uint8_t> uh(bytes);
      // The host on b's host copy (its inputs), with the state as before the call.
      host->momentum_multi_sums(tp.b.host_list.data(), T, n, 0.95f, 1.0f, true, uh.data(), ud, &skip, hs.data());
      EXPECT_TRUE(same_bits(uh, u2)) << "the host's u";
      for (int64_t t = 0; t < T; ++t) {
        double want = 0, got = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double v = load_elem(u2.data(), ud, t * n + i);
          want += v * v;
        }
        for (int64_t c = 0; c < parts; ++c) got += sd[static_cast<size_t>(t * parts + c)];
        EXPECT_NEAR(got, want, sums_bound(n) * want) << "tensor " << t;
        EXPECT_NEAR(hs[static_cast<size_t>(t)], want, sums_bound(n) * want) << "host, tensor " << t;
      }
      // Again on a and on b, whose states are the same now: the same partial sums.
      cuda->momentum_multi_sums(tp.a.dev_table.p(), T, n, 0.95f, 1.0f, true, U1.p(), ud, dskip.p(), sums2.p());
      cuda->momentum_multi_sums(tp.b.dev_table.p(), T, n, 0.95f, 1.0f, true, U2.p(), ud, dskip.p(), sums.p());
      EXPECT_TRUE(same_bits(sums.get(), sums2.get())) << "the same partial sums on every run";
    }
}

// momentum_multi's nonzero flags: a matrix of u = M + G (mu = 1) all zero, one
// whose only nonzero is its last element (the element-wise tail when n is not
// a multiple of 8), one of -0 only (zero), one with a NaN (nonzero) and a
// random one; against the expected flags, the host backend's and the CUDA
// backend's own nonzero_flags pass over u.
TEST_P(FusedMultiTest, MomentumMultiFlagsNonzeroMatrices) {
  const int64_t n = std::get<0>(GetParam()), T = 5, N = T * n;
  std::vector<float> m(static_cast<size_t>(N), 0.0f), g(static_cast<size_t>(N), 0.0f);
  g[static_cast<size_t>(2 * n - 1)] = 1.0f;
  for (int64_t i = 2 * n; i < 3 * n; ++i) m[static_cast<size_t>(i)] = g[static_cast<size_t>(i)] = -0.0f;
  m[static_cast<size_t>(3 * n + n / 2)] = std::nanf("");
  std::vector<float> r = univ(static_cast<size_t>(n));
  std::copy(r.begin(), r.end(), g.begin() + 4 * n);
  Dev<float> dm(m), dg(g), U(static_cast<size_t>(N));
  std::vector<float> hm = m, hg = g;
  std::vector<TensorEntry> dl(static_cast<size_t>(T)), hl(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    TensorEntry& d = dl[static_cast<size_t>(t)];
    TensorEntry& h = hl[static_cast<size_t>(t)];
    d.n = h.n = n;
    d.dtype[kState0] = d.dtype[kGrad] = h.dtype[kState0] = h.dtype[kGrad] = DION_DTYPE_FP32;
    d.ptr[kState0] = dm.p() + t * n;
    d.ptr[kGrad] = dg.p() + t * n;
    h.ptr[kState0] = hm.data() + t * n;
    h.ptr[kGrad] = hg.data() + t * n;
  }
  Dev<TensorEntry> table(dl);
  Dev<int32_t> flags(std::vector<int32_t>(static_cast<size_t>(T), 0)), ref(static_cast<size_t>(T));
  cuda->momentum_multi(table.p(), T, n, 1.0f, 1.0f, false, false, U.p(), DION_DTYPE_FP32, nullptr, flags.p());
  cuda->nonzero_flags(ConstMatBatch(U.p(), 1, n, n, n, T), ref.p());
  std::vector<float> uh(static_cast<size_t>(N));
  std::vector<int32_t> hflags(static_cast<size_t>(T), 0);
  host->momentum_multi(hl.data(), T, n, 1.0f, 1.0f, false, false, uh.data(), DION_DTYPE_FP32, nullptr, hflags.data());
  const std::vector<int32_t> want = {0, 1, 0, 1, 1};
  EXPECT_EQ(flags.get(), want);
  EXPECT_EQ(ref.get(), want);
  EXPECT_EQ(hflags, want);
}

TEST_P(FusedMultiTest, ApplyUpdateMulti) {
  const int64_t n = std::get<0>(GetParam()), shift = std::get<1>(GetParam()), T = 4, N = T * n;
  const std::vector<std::vector<int>> dtypes = {{0, -1, -1, -1}, {1, -1, -1, -1}, {2, -1, -1, -1}, {1, -1, -1, -1}};
  const GroupScalars gs{0.02, 0.1, 0.9, 0.95, 3, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  // u in fp32, or the bf16 iteration's result (the old sequence widened it with load).
  for (dion_dtype_t du : {DION_DTYPE_FP32, DION_DTYPE_BF16})
  for (bool cautious : {false, true})
    for (int32_t skip : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(du) << " u, cautious " << cautious << ", skip " << skip);
      TensorPair tp(rng, dtypes, n, shift);
      Dev<int32_t> dskip(std::vector<int32_t>{skip});
      std::vector<float> u = univ(static_cast<size_t>(N));
      std::vector<uint16_t> ub(u.size());
      for (size_t i = 0; i < u.size(); ++i) ub[i] = float_to_bf16(u[i]);
      // A bf16 u one element past an aligned address when the tensors are shifted: its element path too.
      Dev<uint16_t> Ub16(static_cast<size_t>(N + shift));
      cuda_ok(cudaMemcpy(Ub16.p() + shift, ub.data(), ub.size() * 2, cudaMemcpyHostToDevice), "upload");
      Dev<float> U(u), X(N);
      if (du == DION_DTYPE_BF16) cuda->load(U.p(), Ub16.p() + shift, DION_DTYPE_BF16, N);
      cuda->load_multi(X.p(), tp.a.dev_table.p(), T, kParam, n);
      cuda->apply_update(X.p(), U.p(), N, dgs.p(), 1.7f, cautious);
      cuda->store_multi(tp.a.dev_table.p(), T, kParam, X.p(), n, dskip.p());
      const void* du_ptr = du == DION_DTYPE_BF16 ? static_cast<const void*>(Ub16.p() + shift) : U.p();
      cuda->apply_update_multi(tp.b.dev_table.p(), T, n, du_ptr, du, dgs.p(), 1.7f, cautious, dskip.p());
      EXPECT_TRUE(tp.same_field(kParam));
      if (skip) EXPECT_TRUE(tp.unchanged(kParam));
      host->apply_update_multi(tp.b.host_list.data(), T, n,
                               du == DION_DTYPE_BF16 ? static_cast<const void*>(ub.data()) : u.data(), du, &gs, 1.7f,
                               cautious, &skip);
      compare_tensors(tp.b, 1);
    }
}

// NorMuon's fused pair: neuron_scales from bf16 matrices, then
// apply_update_neuron_multi, against the host's pair (which the unit suite
// checks bit for bit against load, neuron_normalize and
// apply_update_multi): the variances within fp32 ulps (the device sums the
// squares in another order), the parameters within their dtype's
// tolerance, the scales themselves close. Shapes: 64 columns (16-byte
// chunks of one row each), 37 (the element path); the tensors aligned or
// shifted by one element (the update's element path); both axes; cautious
// or not; a set skip flag writes no parameter.
TEST_F(OpsTest, NeuronScalesAndUpdate) {
  const GroupScalars gs{0.02, 0.1, 0.9, 0.95, 3, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  const std::vector<std::vector<int>> dtypes = {{0, -1, -1, -1}, {1, -1, -1, -1}, {2, -1, -1, -1}};
  const int64_t T = 3;
  for (const int64_t cols : {int64_t{64}, int64_t{37}})
    for (int64_t shift : {0, 1})
      for (Axis ax : {kRows, kCols})
        for (bool cautious : {false, true})
          for (int32_t skip : {0, 1}) {
            const int64_t rows = 24, n = rows * cols, N = ax == kRows ? rows : cols;
            SCOPED_TRACE(::testing::Message() << rows << " x " << cols << (shift ? " shifted" : "")
                                              << (ax == kRows ? " rows" : " cols") << " cautious " << cautious
                                              << " skip " << skip);
            std::vector<uint16_t> in(static_cast<size_t>(T * n));
            for (uint16_t& e : in) e = float_to_bf16(gauss());
            Dev<uint16_t> din(in);
            std::vector<float> v(static_cast<size_t>(T * N));
            for (float& x : v) x = uni(0.0f, 2.0f);
            Dev<float> dv(v);
            Dev<int32_t> dskip(std::vector<int32_t>{skip});
            Tensors ts(rng, dtypes, std::vector<int64_t>(static_cast<size_t>(T), n), shift);
            std::vector<double> sc(static_cast<size_t>(T * N + T));
            Dev<double> dsc(sc.size());
            cuda->neuron_scales(T, rows, cols, ax, din.p(), dv.p(), N, 0.95f, dsc.p());
            cuda->apply_update_neuron_multi(ts.dev_table.p(), T, rows, cols, din.p(), DION_DTYPE_BF16, dsc.p(), ax,
                                            dgs.p(), 1.7f, cautious, dskip.p());
            host->neuron_scales(T, rows, cols, ax, in.data(), v.data(), N, 0.95f, sc.data());
            host->apply_update_neuron_multi(ts.host_list.data(), T, rows, cols, in.data(), DION_DTYPE_BF16, sc.data(),
                                            ax, &gs, 1.7f, cautious, &skip);
            EXPECT_TRUE(close(v, dv.get(), kUlps)) << "variances";
            const std::vector<double> got = dsc.get();
            double worst = 0;
            for (size_t i = 0; i < sc.size(); ++i)
              worst = std::max(worst, std::fabs(got[i] - sc[i]) / std::fabs(sc[i]));
            EXPECT_LE(worst, 1e-6) << "scales";  // through the variances, fp32
            compare_tensors(ts, 1);
            if (skip)
              for (size_t i = 0; i < ts.t.size(); ++i)
                EXPECT_TRUE(same_bits(ts.t[i].h[kParam], ts.dev_raw(i, kParam))) << "a skipped step wrote tensor " << i;
          }
}

// The 3xTF32 tests' helper: whether device 0 is of compute capability 9.0
// (where the kernels run, so their results must differ from SGEMM's).
void compute_capability_90(bool* yes) {
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  *yes = major == 9 && minor == 0;
}

// The float64 product (A_t B_t^T)_ij of the lowrank tests' factors (A_t
// rows x r, B_t cols x r, row-major, one after another), and the sum of its
// terms' magnitudes.
std::pair<double, double> lowrank_ref(const std::vector<float>& fa, const std::vector<float>& fb, int64_t t,
                                      int64_t i, int64_t j, int64_t rows, int64_t cols, int64_t r) {
  double prod = 0, mag = 0;
  for (int64_t k = 0; k < r; ++k) {
    const double x = static_cast<double>(fa[(t * rows + i) * r + k]) * fb[(t * cols + j) * r + k];
    prod += x;
    mag += std::fabs(x);
  }
  return {prod, mag};
}

// The largest error of c3 and of cs (each T results m x n, dense) against
// the float64 product alpha op(X_t) B_t over an inner dimension k, relative
// to the sum of its terms' magnitudes, sum_q |alpha x b|, per element; x(t,
// i, q) and b(t, q, j) give the operands.
template <class XAt, class BAt>
std::pair<double, double> product_errors(int64_t T, int64_t m, int64_t n, int64_t k, double alpha, XAt x, BAt b,
                                         const std::vector<float>& c3, const std::vector<float>& cs) {
  double e3 = 0, es = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0, mag = 0;
        for (int64_t q = 0; q < k; ++q) {
          const double v = alpha * x(t, i, q) * b(t, q, j);
          want += v;
          mag += std::fabs(v);
        }
        const size_t e = static_cast<size_t>((t * m + i) * n + j);
        e3 = std::max(e3, std::fabs(c3[e] - want) / mag);
        es = std::max(es, std::fabs(cs[e] - want) / mag);
      }
  return {e3, es};
}

// The exact-as-SGEMM tests' bound: the 3xTF32 path's error e3 at most twice
// SGEMM's (es), or 2^-22 where SGEMM's is below it (the split's
// representation bound); on compute capability 9.0 (hopper) the two results
// must differ somewhere: the 3xTF32 path ran.
void expect_as_exact_as_sgemm(double e3, double es, bool hopper, bool differ) {
  ASSERT_TRUE(std::isfinite(e3) && std::isfinite(es));
  EXPECT_LE(e3, std::max(2.0 * es, 0x1p-22)) << "SGEMM's error " << es;
  if (hopper) EXPECT_TRUE(differ) << "the 3xTF32 path did not run";
}

// At FP32, Dion's error feedback and update products (accumulate_lowrank,
// update_lowrank: fp32 factors into fp32 C) are as exact as cuBLAS's SGEMM.
// On Hopper they run as three TF32 products of the factors' split parts,
// their sums promoted to fp32 (kernels::lowrank_tf32x3); the error of that
// path must not exceed twice the error of the same backend's SGEMM path
// (DION_LOWRANK_3XTF32=0: cublasGemmBatchedEx at CUBLAS_COMPUTE_32F) on the
// same inputs, both against the float64 product, as max |C - C64| /
// (|alpha| sum_k |a b| + |beta c|) per element (or 2^-22 where SGEMM's is
// below it: the split's own representation bound, hi + lo = x to 2^-22).
// Positive data, where the sums grow with k and an accumulation that does
// not round to nearest shows (the tensor cores' own gave 5 to 10 times
// SGEMM's error at k = 512, bench/micro/lowrank_3xtf32.cu), and signed;
// ranks 20 (one stage), 68 (a partial stage of 32), 192, 512 and 2048,
// tiles cut by the matrices' edges, and batches of more tiles than the
// kernel has CTAs (1100 x 1000 and 900 x 1300: each CTA takes several tiles,
// the next one's stages loaded during the last). On a device of compute
// capability 9.0 the two paths' results must differ somewhere: the 3xTF32
// one ran.
TEST_F(OpsTest, LowrankFp32AsExactAsSgemm) {
  bool hopper = false;
  ASSERT_NO_FATAL_FAILURE(compute_capability_90(&hopper));
  std::unique_ptr<Backend> sgemm;
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_LOWRANK_3XTF32", "0", &sgemm));
  struct Dims {
    int64_t rows, cols, r, T;
  };
  const GroupScalars gs{0.02, 0.1, 0.9, 0.95, 3, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  const float lr_mult = 1.7f;
  const float lr = static_cast<float>(gs.lr), lwd = lr * static_cast<float>(gs.weight_decay);
  const double decay = 1.0f - lwd, lr_adj = lr * lr_mult;
  const float alpha = -0.75f;
  Dev<int32_t> dskip(std::vector<int32_t>{0});
  for (const Dims dims : {Dims{300, 264, 512, 2}, Dims{257, 129, 192, 3}, Dims{130, 300, 2048, 1},
                          Dims{200, 136, 68, 2}, Dims{1100, 1000, 68, 3}, Dims{900, 1300, 20, 2}})
    for (const float lo : {0.0f, -1.0f})
      for (const bool acc : {true, false}) {
        const int64_t rows = dims.rows, cols = dims.cols, r = dims.r, T = dims.T, n = rows * cols;
        SCOPED_TRACE(::testing::Message() << (acc ? "accumulate_lowrank, " : "update_lowrank, ") << rows << " x "
                                          << cols << ", rank " << r << ", data from " << lo);
        const int f = acc ? kState0 : kParam;
        std::vector<int> dts = {-1, -1, -1, -1};
        dts[static_cast<size_t>(f)] = DION_DTYPE_FP32;
        Tensors t3(rng, std::vector<std::vector<int>>(T, dts), std::vector<int64_t>(T, n));
        Tensors ts(rng, std::vector<std::vector<int>>(T, dts), std::vector<int64_t>(T, n));
        std::vector<std::vector<float>> c0(T);
        for (int64_t t = 0; t < T; ++t) {
          c0[t] = univ(static_cast<size_t>(n), lo, 1.0f);
          for (Tensors* x : {&t3, &ts})
            cuda_ok(cudaMemcpy(x->t[t].d[f].p(), c0[t].data(), sizeof(float) * n, cudaMemcpyHostToDevice), "C");
        }
        const std::vector<float> fa = univ(static_cast<size_t>(T * rows * r), lo, 1.0f);
        const std::vector<float> fb = univ(static_cast<size_t>(T * cols * r), lo, 1.0f);
        Dev<float> da(fa), db(fb);
        const ConstMatBatch A(da.p(), rows, r, r, rows * r, T), B(db.p(), cols, r, r, cols * r, T);
        if (acc) {
          cuda->accumulate_lowrank(t3.dev_table.p(), T, A, B, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_MATMUL_FP32,
                                   alpha, dskip.p());
          sgemm->accumulate_lowrank(ts.dev_table.p(), T, A, B, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_MATMUL_FP32,
                                    alpha, dskip.p());
        } else {
          cuda->update_lowrank(t3.dev_table.p(), T, A, B, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_MATMUL_FP32, dgs.p(),
                               lr_mult, dskip.p());
          sgemm->update_lowrank(ts.dev_table.p(), T, A, B, DION_DTYPE_FP32, DION_DTYPE_FP32, DION_MATMUL_FP32,
                                dgs.p(), lr_mult, dskip.p());
        }
        const double keep = acc ? 1.0 : decay, coef = acc ? alpha : -lr_adj;
        double e3 = 0, es = 0;
        bool differ = false;
        for (int64_t t = 0; t < T; ++t) {
          const std::vector<float> g3 = t3.dev_vals(static_cast<size_t>(t), f), gsg = ts.dev_vals(static_cast<size_t>(t), f);
          differ = differ || !same_bits(g3, gsg);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < cols; ++j) {
              const auto [prod, mag] = lowrank_ref(fa, fb, t, i, j, rows, cols, r);
              const size_t e = static_cast<size_t>(i * cols + j);
              const double want = keep * c0[t][e] + coef * prod;
              const double scale = std::fabs(coef) * mag + std::fabs(keep * c0[t][e]);
              e3 = std::max(e3, std::fabs(g3[e] - want) / scale);
              es = std::max(es, std::fabs(gsg[e] - want) / scale);
            }
        }
        ASSERT_NO_FATAL_FAILURE(expect_as_exact_as_sgemm(e3, es, hopper, differ));
        std::printf("%s %ld x %ld, rank %ld, data [%g, 1): max relative error %.3g (SGEMM %.3g)\n",
                    acc ? "accumulate" : "update", static_cast<long>(rows), static_cast<long>(cols),
                    static_cast<long>(r), lo, e3, es);
      }
}

// At FP32, gemm_field's products (Dion's P = M Q and R = M^T P, M each
// tensor's momentum read in place) are as exact as cuBLAS's SGEMM. On
// Hopper they run as kernels::field_tf32x3 (M split into TF32 parts as the
// kernel reads it, B transposed and split into scratch, three TF32 products
// promoted to fp32); its error against the float64 product, max |C - C64| /
// sum_q |x b| per element, must not exceed twice the error of the same
// backend's SGEMM path (DION_FIELD_3XTF32=0: cublasGemmBatchedEx at
// CUBLAS_COMPUTE_32F) on the same inputs, or 2^-22 where SGEMM's is below
// it (the split's representation bound). Both orientations; B dense or from
// each tensor's kState1 field (Q from its state); positive data (the sums
// grow with k) and signed; inner dimensions that are multiples of 4 (the
// kernel's 16-byte copies) and not (4-byte ones), partial stages and tiles,
// tiles of 96 columns (r <= 192 here) and of 128 (r = 200, 256), a long
// inner dimension (2048), and small batches with long inner dimensions,
// which the kernel splits into 2, 4 or 8 partial sums (96 x 2048: one tile,
// 8 splits; 1100 x 520 transposed: 4). On a device of compute capability
// 9.0 the two paths' results must differ somewhere: the 3xTF32 one ran.
TEST_F(OpsTest, FieldProductFp32AsExactAsSgemm) {
  bool hopper = false;
  ASSERT_NO_FATAL_FAILURE(compute_capability_90(&hopper));
  std::unique_ptr<Backend> sgemm;
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_FIELD_3XTF32", "0", &sgemm));
  struct Dims {
    int64_t rows, cols, r, T;
  };
  // r <= min(rows, cols): Q's k x r values fit in a field of rows x cols
  for (const Dims dims : {Dims{300, 264, 64, 2}, Dims{257, 129, 40, 3}, Dims{520, 200, 192, 2},
                          Dims{96, 2048, 72, 1}, Dims{130, 36, 8, 2}, Dims{300, 280, 256, 2},
                          Dims{1100, 520, 200, 1}})
    for (const float lo : {0.0f, -1.0f})
      for (const bool trans : {false, true})
        for (const bool from_field : {false, true}) {
          const int64_t rows = dims.rows, cols = dims.cols, r = dims.r, T = dims.T, n = rows * cols;
          const int64_t k = trans ? rows : cols, m = trans ? cols : rows;
          SCOPED_TRACE(::testing::Message() << rows << " x " << cols << (trans ? " transposed" : "") << ", r " << r
                                            << (from_field ? ", B from the fields" : "") << ", data from " << lo);
          Tensors ts(rng, std::vector<std::vector<int>>(T, {-1, -1, DION_DTYPE_FP32, DION_DTYPE_FP32}),
                     std::vector<int64_t>(T, n));
          std::vector<std::vector<float>> X(T);
          const std::vector<float> B = univ(static_cast<size_t>(T * k * r), lo, 1.0f);
          for (int64_t t = 0; t < T; ++t) {
            X[t] = univ(static_cast<size_t>(n), lo, 1.0f);
            cuda_ok(cudaMemcpy(ts.t[t].d[kState0].p(), X[t].data(), sizeof(float) * n, cudaMemcpyHostToDevice), "M");
            cuda_ok(cudaMemcpy(ts.t[t].d[kState1].p(), B.data() + t * k * r, sizeof(float) * k * r,
                               cudaMemcpyHostToDevice),
                    "Q");
          }
          Dev<float> dB(B), dC3(static_cast<size_t>(T * m * r)), dCs(static_cast<size_t>(T * m * r));
          const ConstMatBatch Bm(from_field ? nullptr : dB.p(), k, r, r, k * r, T);
          const int bf = from_field ? kState1 : -1;
          cuda->gemm_field(ts.dev_table.p(), T, kState0, rows, cols, DION_DTYPE_FP32, trans, Bm,
                           MatBatch{dC3.p(), m, r, r, m * r, T}, DION_MATMUL_FP32, DION_DTYPE_FP32, bf);
          sgemm->gemm_field(ts.dev_table.p(), T, kState0, rows, cols, DION_DTYPE_FP32, trans, Bm,
                            MatBatch{dCs.p(), m, r, r, m * r, T}, DION_MATMUL_FP32, DION_DTYPE_FP32, bf);
          const std::vector<float> c3 = dC3.get(), cs = dCs.get();
          const auto [e3, es] = product_errors(
              T, m, r, k, 1.0,
              [&](int64_t t, int64_t i, int64_t q) -> double {
                return trans ? X[t][static_cast<size_t>(q * cols + i)] : X[t][static_cast<size_t>(i * cols + q)];
              },
              [&](int64_t t, int64_t q, int64_t j) -> double { return B[static_cast<size_t>((t * k + q) * r + j)]; },
              c3, cs);
          ASSERT_NO_FATAL_FAILURE(expect_as_exact_as_sgemm(e3, es, hopper, !same_bits(c3, cs)));
          std::printf("gemm_field %ld x %ld%s, r %ld%s, data [%g, 1): max relative error %.3g (SGEMM %.3g)\n",
                      static_cast<long>(rows), static_cast<long>(cols), trans ? " transposed" : "",
                      static_cast<long>(r), from_field ? ", B from the fields" : "", lo, e3, es);
        }
}

// At FP32 on Hopper, gemm's products C = alpha op(A) B (beta 0, B as
// stored: RCQR's triangular solves' products, the triangular inverses' (alpha
// -1) and the Gram matrices) go through
// the same kernel from strided batches (gemm_x3). A backend created with
// DION_GEMM_3XTF32_MIN_MFLOP=0 takes it for every such shape here; its
// error against the float64 product, max |C - C64| / sum_q |a b|, must not
// exceed twice that of a DION_GEMM_3XTF32=0 backend (cuBLAS's SGEMM), or
// 2^-22. A and B as sub-blocks of wider matrices (ld > cols, as the solves'
// block columns are), A transposed (the Gram form), B shared by the batch
// (stride 0), inner dimensions with and without 16-byte rows, batches small
// enough for the inner dimension to be split; alpha 1, -1 and 0.37 (the
// error relative to |alpha| sum_q |a b|); positive and signed data. On
// compute capability 9.0 the two results must differ: the 3xTF32 path ran.
TEST_F(OpsTest, GemmFp32AsExactAsSgemm) {
  bool hopper = false;
  ASSERT_NO_FATAL_FAILURE(compute_capability_90(&hopper));
  std::unique_ptr<Backend> x3, sgemm;
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_GEMM_3XTF32_MIN_MFLOP", "0", &x3));
  ASSERT_NO_FATAL_FAILURE(cuda_backend_with("DION_GEMM_3XTF32", "0", &sgemm));
  struct Case {
    int64_t m, n, k, T;
    bool ta;
    int64_t pad_a, pad_b;  // extra columns of A's and B's storage (ld = cols + pad)
    bool shared_b;
    float alpha;
  };
  for (const Case cs : {Case{640, 128, 384, 3, false, 128, 0, false, 1.0f},
                        Case{257, 96, 130, 2, false, 6, 32, true, -1.0f},
                        Case{192, 192, 3072, 2, true, 0, 0, false, 0.37f},
                        Case{200, 136, 515, 1, true, 3, 5, false, 1.0f},
                        Case{1030, 256, 1024, 1, false, 0, 256, true, -1.0f}})
    for (const float lo : {0.0f, -1.0f}) {
      const int64_t m = cs.m, n = cs.n, k = cs.k, T = cs.T;
      const int64_t ar = cs.ta ? k : m, ac = cs.ta ? m : k, lda = ac + cs.pad_a, ldb = n + cs.pad_b;
      SCOPED_TRACE(::testing::Message() << "C " << m << " x " << n << " x " << k << (cs.ta ? ", A transposed" : "")
                                        << ", lda " << lda << ", ldb " << ldb << (cs.shared_b ? ", B shared" : "")
                                        << ", batch " << T << ", alpha " << cs.alpha << ", data from " << lo);
      const int64_t sa = ar * lda, sb = cs.shared_b ? 0 : k * ldb;
      const std::vector<float> A = univ(static_cast<size_t>(T * sa), lo, 1.0f);
      const std::vector<float> B = univ(static_cast<size_t>(cs.shared_b ? k * ldb : T * sb), lo, 1.0f);
      Dev<float> dA(A), dB(B), dC3(static_cast<size_t>(T * m * n)), dCs(static_cast<size_t>(T * m * n));
      const ConstMatBatch a(dA.p(), ar, ac, lda, sa, T), b(dB.p(), k, n, ldb, sb, T);
      x3->gemm(cs.ta, false, cs.alpha, a, b, 0.0f, MatBatch{dC3.p(), m, n, n, m * n, T}, DION_MATMUL_FP32);
      sgemm->gemm(cs.ta, false, cs.alpha, a, b, 0.0f, MatBatch{dCs.p(), m, n, n, m * n, T}, DION_MATMUL_FP32);
      const std::vector<float> c3 = dC3.get(), cg = dCs.get();
      const auto [e3, es] = product_errors(
          T, m, n, k, cs.alpha,
          [&](int64_t t, int64_t i, int64_t q) -> double {
            return cs.ta ? A[static_cast<size_t>(t * sa + q * lda + i)] : A[static_cast<size_t>(t * sa + i * lda + q)];
          },
          [&](int64_t t, int64_t q, int64_t j) -> double { return B[static_cast<size_t>(t * sb + q * ldb + j)]; }, c3,
          cg);
      ASSERT_NO_FATAL_FAILURE(expect_as_exact_as_sgemm(e3, es, hopper, !same_bits(c3, cg)));
      std::printf("gemm %ld x %ld x %ld%s, batch %ld, alpha %g, data [%g, 1): max relative error %.3g (SGEMM %.3g)\n",
                  static_cast<long>(m), static_cast<long>(n), static_cast<long>(k), cs.ta ? " tA" : "",
                  static_cast<long>(T), cs.alpha, lo, e3, es);
    }
}

// update_lowrank (Dion's update from its factors P and Q): every parameter
// element against the float64 textbook decay x - lr lr_mult (A B^T)_ij of
// the same inputs (decay and lr lr_mult as apply_update computes them in
// float); accumulate_lowrank (the error feedback into the momentum state):
// every state element against x + alpha (A B^T)_ij. Error allowed: the update's few fp32 roundings and the product's
// fp32 accumulation, 2^-21 of the sum of the terms' magnitudes (|decay x| +
// lr lr_mult sum_k |a_ik b_jk|); with fp32 factors at TF32, each product
// term's operands rounded to 11 bits (2^-10 of its magnitude); for bf16
// parameters the one rounding to bf16 (half an ulp: 2^-8 of the value).
// bf16 factors with fp32 and bf16 parameters, fp32 factors with fp32
// parameters at FP32 and TF32. The host backend's op (the fp32 product,
// then apply_update_multi) within the FP32 bound, and a set skip flag
// leaves every parameter bit for bit. Two shapes: a small one, and one of
// several 128 x 128 output tiles per matrix, where the TF32 products go
// through cuBLASLt's algorithm with such tiles (lt_plan; the test
// runs again with DION_LT_LOWRANK=0, the cuBLAS call, in ctest's
// ops_elementwise_lt_off). On Hopper the FP32 products are the 3xTF32
// kernel's (kernels::lowrank_tf32x3), held to the same bound; ctest's
// ops_elementwise_sgemm runs the test again on cuBLAS's SGEMM.
TEST_F(OpsTest, UpdateAndAccumulateLowrank) {
  struct Dims {
    int64_t rows, cols, r, T;
  };
  for (const Dims dims : {Dims{40, 24, 8, 3}, Dims{300, 264, 68, 2}}) {
    const int64_t rows = dims.rows, cols = dims.cols, r = dims.r, T = dims.T, n = rows * cols;
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", rank " << r);
    const GroupScalars gs{0.02, 0.1, 0.9, 0.95, 3, 0};
    Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
    const float lr_mult = 1.7f;
    const float lr = static_cast<float>(gs.lr), lwd = lr * static_cast<float>(gs.weight_decay);
    const double decay = 1.0f - lwd, lr_adj = lr * lr_mult;
    struct Case {
      dion_dtype_t ab, x;
      dion_matmul_precision_t prec;
    };
    const float alpha = -0.05f;  // the error feedback's -(1 - mu)
    for (const bool acc : {false, true})
    for (const Case c : {Case{DION_DTYPE_BF16, DION_DTYPE_FP32, DION_MATMUL_BF16},
                         Case{DION_DTYPE_BF16, DION_DTYPE_BF16, DION_MATMUL_BF16},
                         Case{DION_DTYPE_FP32, DION_DTYPE_FP32, DION_MATMUL_FP32},
                         Case{DION_DTYPE_FP32, DION_DTYPE_FP32, DION_MATMUL_TF32}})
      for (int32_t skip : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << (acc ? "accumulate_lowrank, " : "update_lowrank, ") << dtype_name(c.ab)
                                          << " factors, " << dtype_name(c.x) << " target, precision "
                                          << static_cast<int>(c.prec) << ", skip " << skip);
        ASSERT_TRUE(Backend::update_lowrank_takes(c.ab, c.x));
        const int f = acc ? kState0 : kParam;
        std::vector<int> dts = {-1, -1, -1, -1};
        dts[static_cast<size_t>(f)] = c.x;
        Tensors ts(rng, std::vector<std::vector<int>>(T, dts), std::vector<int64_t>(T, n));
        // The factors as floats (bf16 values when ab is bf16), and their bits.
        std::vector<float> fa(static_cast<size_t>(T * rows * r)), fb(static_cast<size_t>(T * cols * r));
        for (auto& v : fa) v = c.ab == DION_DTYPE_BF16 ? bf16_to_float(float_to_bf16(gauss())) : gauss();
        for (auto& v : fb) v = c.ab == DION_DTYPE_BF16 ? bf16_to_float(float_to_bf16(gauss())) : gauss();
        std::vector<uint16_t> a16(fa.size()), b16(fb.size());
        for (size_t i = 0; i < fa.size(); ++i) a16[i] = float_to_bf16(fa[i]);
        for (size_t i = 0; i < fb.size(); ++i) b16[i] = float_to_bf16(fb[i]);
        Dev<uint16_t> da16(a16), db16(b16);
        Dev<float> da32(fa), db32(fb);
        const bool lowp = c.ab == DION_DTYPE_BF16;
        const float* pa = lowp ? reinterpret_cast<const float*>(da16.p()) : da32.p();
        const float* pb = lowp ? reinterpret_cast<const float*>(db16.p()) : db32.p();
        const float* ha = lowp ? reinterpret_cast<const float*>(a16.data()) : fa.data();
        const float* hb = lowp ? reinterpret_cast<const float*>(b16.data()) : fb.data();
        Dev<int32_t> dskip(std::vector<int32_t>{skip});
        std::vector<std::vector<float>> before(T);
        for (int64_t t = 0; t < T; ++t) before[t] = ts.host_vals(static_cast<size_t>(t), f);
        const ConstMatBatch A(pa, rows, r, r, rows * r, T), B(pb, cols, r, r, cols * r, T);
        const ConstMatBatch hA(ha, rows, r, r, rows * r, T), hB(hb, cols, r, r, cols * r, T);
        if (acc) {
          cuda->accumulate_lowrank(ts.dev_table.p(), T, A, B, c.ab, c.x, c.prec, alpha, dskip.p());
          host->accumulate_lowrank(ts.host_list.data(), T, hA, hB, c.ab, c.x, c.prec, alpha, &skip);
        } else {
          cuda->update_lowrank(ts.dev_table.p(), T, A, B, c.ab, c.x, c.prec, dgs.p(), lr_mult, dskip.p());
          host->update_lowrank(ts.host_list.data(), T, hA, hB, c.ab, c.x, c.prec, &gs, lr_mult, &skip);
        }
        const double keep = acc ? 1.0 : decay, coef = acc ? alpha : -lr_adj;
        for (int64_t t = 0; t < T; ++t) {
          const std::vector<float> got = ts.dev_vals(static_cast<size_t>(t), f);
          const std::vector<float> hgot = ts.host_vals(static_cast<size_t>(t), f);
          if (skip) {
            EXPECT_TRUE(same_bits(before[t], got)) << "tensor " << t;
            EXPECT_TRUE(same_bits(before[t], hgot)) << "tensor " << t;
            continue;
          }
          EXPECT_FALSE(same_bits(before[t], got)) << "tensor " << t << ": not updated";
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < cols; ++j) {
              const auto [prod, mag] = lowrank_ref(fa, fb, t, i, j, rows, cols, r);
              const size_t e = static_cast<size_t>(i * cols + j);
              const double want = keep * before[t][e] + coef * prod;
              double tol = 0x1p-21 * (std::fabs(keep * before[t][e]) + std::fabs(coef) * mag);
              if (c.x == DION_DTYPE_BF16) tol += 0x1p-8 * std::fabs(want);
              const double dtol = tol + (c.prec == DION_MATMUL_TF32 ? 0x1p-10 * std::fabs(coef) * mag : 0.0);
              ASSERT_LE(std::fabs(got[e] - want), dtol) << "tensor " << t << " (" << i << ", " << j << ")";
              ASSERT_LE(std::fabs(hgot[e] - want), tol) << "host, tensor " << t << " (" << i << ", " << j << ")";
            }
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, FusedMultiTest,
                         ::testing::Combine(::testing::Values(int64_t{776}, int64_t{777}, int64_t{5}),
                                            ::testing::Values(int64_t{0}, int64_t{1})));
// Long tensors: every thread walks several chunks of eight (3.6M elements x
// 4 or 5 tensors: more than 3 chunks per thread on a device of up to 144
// SMs), the vector path only.
INSTANTIATE_TEST_SUITE_P(Long, FusedMultiTest,
                         ::testing::Combine(::testing::Values(int64_t{3600008}), ::testing::Values(int64_t{0})));

// The selection and update passes' large shape: kBigRows x kBigCols
// matrices, so that each thread's ChunkWalk steps over rows and matrices
// several times (2048 x 3000 x 3 tensors: more than 4 chunks per thread on a
// device of up to 144 SMs), run only for the unshifted tensors and one
// choice of the other options (`first`) to keep the host's share of the
// time small.
constexpr int64_t kBigRows = 2048, kBigCols = 3000;
bool small_or_first(int64_t rows, int64_t shift, bool first) { return rows != kBigRows || (shift == 0 && first); }

// Dion2: the selected slices of each matrix, distinct and ascending (as topk's).
std::vector<int32_t> pick_slices(std::mt19937& rng, int64_t batch, int64_t n, int64_t k, bool ascending = true) {
  std::vector<int32_t> idx, all(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b) {
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    if (ascending) std::sort(all.begin(), all.begin() + k);
    idx.insert(idx.end(), all.begin(), all.begin() + k);
  }
  return idx;
}

// The local scope's momentum: stored whole (momentum_multi), its selected
// slices scaled, then only those stored again.
TEST_F(OpsTest, StoreSlicesMulti) {
  const int64_t per = 2, rows = 7, cols = 9, n = per * rows * cols, T = 3, B = T * per, k = 3;
  const std::vector<std::vector<int>> dtypes = {{-1, -1, 0, -1}, {-1, -1, 1, -1}, {-1, -1, 2, -1}};
  for (int64_t shift : {0, 1})
    for (Axis ax : {kRows, kCols})
      for (int32_t skip : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << "shift " << shift << ", axis " << ax << ", skip " << skip);
        TensorPair tp(rng, dtypes, n, shift);
        Dev<int32_t> dskip(std::vector<int32_t>{skip}), none(std::vector<int32_t>{0});
        const std::vector<float> m0 = univ(static_cast<size_t>(B * rows * cols), -4.0f, 4.0f);
        Dev<float> M(m0);
        cuda->store_multi(tp.a.dev_table.p(), T, kState0, M.p(), n, none.p());
        cuda->store_multi(tp.b.dev_table.p(), T, kState0, M.p(), n, none.p());
        const std::vector<uint8_t> before = tp.b.dev_raw(1, kState0);
        const std::vector<int32_t> idx = pick_slices(rng, B, ax == kRows ? rows : cols, k);
        Dev<int32_t> didx(idx);
        const MatBatch m{M.p(), rows, cols, cols, rows * cols, B};
        cuda->scale_slices(m, ax, didx.p(), k, 0.3f);
        cuda->store_multi(tp.a.dev_table.p(), T, kState0, M.p(), n, dskip.p());
        cuda->store_slices_multi(tp.b.dev_table.p(), T, kState0, m, ax, didx.p(), k, dskip.p());
        if (skip)
          EXPECT_TRUE(same_bits(before, tp.b.dev_raw(1, kState0)));
        else
          EXPECT_TRUE(tp.same_field(kState0));
        // The host's: from the same stored state.
        std::vector<float> mh = m0;
        int32_t no = 0;
        host->store_multi(tp.b.host_list.data(), T, kState0, mh.data(), n, &no);
        const MatBatch hm{mh.data(), rows, cols, cols, rows * cols, B};
        host->scale_slices(hm, ax, idx.data(), k, 0.3f);
        host->store_slices_multi(tp.b.host_list.data(), T, kState0, hm, ax, idx.data(), k, &skip);
        for (size_t i = 0; i < tp.b.t.size(); ++i)
          EXPECT_TRUE(same_bits(tp.b.t[i].h[kState0], tp.b.dev_raw(i, kState0))) << "tensor " << i;
      }
}

// Dion with the momentum state as its products' input: momentum_multi with
// u null stores the bits it stores with a u and flags the matrices as the
// host does; gemm_field (C = op(M_i) B from each tensor's state, a
// pointer-array GEMM) against the float64 product of the stored values,
// within 2^-20 of the sum of the terms' magnitudes (fp32 accumulation; bf16
// products are exact), plus 2^-10 of it at TF32; the host's within the fp32
// bound. fp32 and bf16 states, both orientations; a misaligned table (shift)
// for the momentum only (the pointer-array GEMM needs 16-byte alignment).
// With fp32 X, B is also read from each tensor's fp32 field kState1
// (b_field: Q from its state), whose first k r values the dense B holds,
// against the same reference.
TEST_F(OpsTest, MomentumInStateAndGemmField) {
  const int64_t r = 8, T = 3;
  struct Case {
    int dt;
    dion_matmul_precision_t prec;
  };
  // tall and wide: at TF32 op(M) = M takes B as given (k > m) or K-major (k <= m)
  for (const auto& shape : {std::pair<int64_t, int64_t>{40, 24}, std::pair<int64_t, int64_t>{24, 40}}) {
    for (const Case c : {Case{0, DION_MATMUL_FP32}, Case{0, DION_MATMUL_TF32}, Case{1, DION_MATMUL_BF16}})
      for (int64_t shift : {0, 1})
        for (int32_t skip : {0, 1}) {
          const int64_t rows = shape.first, cols = shape.second, n = rows * cols;
          SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", state dtype " << c.dt << ", precision "
                                            << static_cast<int>(c.prec) << ", shift " << shift << ", skip " << skip);
          TensorPair tp(rng, std::vector<std::vector<int>>(T, {-1, 0, c.dt, 0}), n, shift);
          Dev<int32_t> dskip(std::vector<int32_t>{skip}), fa(std::vector<int32_t>(T, 0)),
              fb(std::vector<int32_t>(T, 0));
          Dev<float> U(T * n);
          cuda->momentum_multi(tp.a.dev_table.p(), T, n, 1.0f, 1.0f, false, true, U.p(), DION_DTYPE_FP32, dskip.p(),
                               fa.p());
          cuda->momentum_multi(tp.b.dev_table.p(), T, n, 1.0f, 1.0f, false, true, nullptr, DION_DTYPE_FP32, dskip.p(),
                               fb.p());
          EXPECT_TRUE(tp.same_field(kState0));
          std::vector<int32_t> fh(T, 0);
          host->momentum_multi(tp.b.host_list.data(), T, n, 1.0f, 1.0f, false, true, nullptr, DION_DTYPE_FP32, &skip,
                               fh.data());
          EXPECT_EQ(fh, fb.get());
          // gemm_field needs 16-byte aligned fields (Batch::aligned16): not with a shift.
          if (shift) continue;
          const dion_dtype_t xd = c.dt == 0 ? DION_DTYPE_FP32 : DION_DTYPE_BF16;
          for (bool trans : {false, true}) {
            SCOPED_TRACE(trans ? "op(M) = M^T" : "op(M) = M");
            const int64_t k = trans ? rows : cols, m = trans ? cols : rows;
            std::vector<float> B(static_cast<size_t>(T * k * r));
            for (auto& v : B) v = xd == DION_DTYPE_BF16 ? bf16_to_float(float_to_bf16(gauss())) : gauss();
            const bool from_field = xd == DION_DTYPE_FP32;
            if (from_field)
              for (int64_t t = 0; t < T; ++t) {
                const std::vector<float> q = tp.b.dev_vals(static_cast<size_t>(t), kState1);
                std::copy(q.begin(), q.begin() + k * r, B.begin() + t * k * r);
              }
            std::vector<uint16_t> B16(B.size());
            for (size_t i = 0; i < B.size(); ++i) B16[i] = float_to_bf16(B[i]);
            Dev<float> dB(B), dC(static_cast<size_t>(T * m * r));
            Dev<uint16_t> dB16(B16);
            const float* bp = xd == DION_DTYPE_BF16 ? reinterpret_cast<const float*>(dB16.p()) : dB.p();
            cuda->gemm_field(tp.b.dev_table.p(), T, kState0, rows, cols, xd, trans,
                             ConstMatBatch(bp, k, r, r, k * r, T), MatBatch{dC.p(), m, r, r, m * r, T}, c.prec,
                             DION_DTYPE_FP32, -1);
            Dev<float> dCf(static_cast<size_t>(T * m * r));
            if (from_field)
              cuda->gemm_field(tp.b.dev_table.p(), T, kState0, rows, cols, xd, trans,
                               ConstMatBatch(nullptr, k, r, r, k * r, T), MatBatch{dCf.p(), m, r, r, m * r, T}, c.prec,
                               DION_DTYPE_FP32, kState1);
            // bf16 output (bf16 fields only): C16 holds bf16 elements
            const bool c16 = xd == DION_DTYPE_BF16;
            Dev<uint16_t> dC16(static_cast<size_t>(c16 ? T * m * r : 1));
            if (c16)
              cuda->gemm_field(tp.b.dev_table.p(), T, kState0, rows, cols, xd, trans,
                               ConstMatBatch(bp, k, r, r, k * r, T),
                               MatBatch{reinterpret_cast<float*>(dC16.p()), m, r, r, m * r, T}, c.prec,
                               DION_DTYPE_BF16, -1);
            const float* hbp = xd == DION_DTYPE_BF16 ? reinterpret_cast<const float*>(B16.data()) : B.data();
            std::vector<float> Ch(static_cast<size_t>(T * m * r));
            host->gemm_field(tp.b.host_list.data(), T, kState0, rows, cols, xd, trans,
                             ConstMatBatch(hbp, k, r, r, k * r, T), MatBatch{Ch.data(), m, r, r, m * r, T}, c.prec,
                             DION_DTYPE_FP32, -1);
            const std::vector<float> Cd = dC.get(), Cf = dCf.get();
            const std::vector<uint16_t> Cd16 = dC16.get();
            for (int64_t t = 0; t < T; ++t) {
              const std::vector<float> X = tp.b.dev_vals(static_cast<size_t>(t), kState0);
              for (int64_t i = 0; i < m; ++i)
                for (int64_t j = 0; j < r; ++j) {
                  double want = 0, mag = 0;
                  for (int64_t q = 0; q < k; ++q) {
                    const double x =
                        trans ? X[static_cast<size_t>(q * cols + i)] : X[static_cast<size_t>(i * cols + q)];
                    const double v = x * B[static_cast<size_t>((t * k + q) * r + j)];
                    want += v;
                    mag += std::fabs(v);
                  }
                  const size_t e = static_cast<size_t>((t * m + i) * r + j);
                  const double tol = 0x1p-20 * mag, dtol = tol + (c.prec == DION_MATMUL_TF32 ? 0x1p-10 * mag : 0.0);
                  ASSERT_LE(std::fabs(Cd[e] - want), dtol) << "tensor " << t << " (" << i << ", " << j << ")";
                  if (from_field)
                    ASSERT_LE(std::fabs(Cf[e] - want), dtol)
                        << "B from the fields, tensor " << t << " (" << i << ", " << j << ")";
                  ASSERT_LE(std::fabs(Ch[e] - want), tol) << "host, tensor " << t << " (" << i << ", " << j << ")";
                  // the bf16 output: the fp32 product's rounding, at most half an ulp of bf16 (2^-8 relative) more
                  if (c16)
                    ASSERT_LE(std::fabs(bf16_to_float(Cd16[e]) - want), dtol + 0x1p-8 * std::fabs(want))
                        << "bf16 output, tensor " << t << " (" << i << ", " << j << ")";
                }
            }
          }
        }
  }
}

// Dion's finish of P and R: finish_p, finish_r and col_scale_store give the
// bits of the CUDA sequence they replace (nan_to_num, zero_fixup_flagged,
// stores to bf16, col_normalize, store_multi of Q into every dtype), and the
// host's within the tolerances above (col_normalize's double sums in
// another order: an ulp of the floats; P's and the bf16 copies' elementwise
// ops: bit for bit except where an R value's ulp flips its bf16 rounding,
// hence bf16's rtol). NaN, +-inf, a flagged matrix (R takes Q's), a column
// of 1e30s, and 96 rows (two row chunks of the column sums).
TEST_F(OpsTest, FinishPAndR) {
  const int64_t T = 3;
  const std::vector<std::vector<int>> dtypes = {{-1, -1, -1, 0}, {-1, -1, -1, 1}, {-1, -1, -1, 2}};
  for (const auto& [rows, cols] : std::initializer_list<std::pair<int64_t, int64_t>>{{7, 5}, {96, 40}, {300, 520}})
    for (int32_t skip : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", skip " << skip);
      const int64_t n = rows * cols;
      std::vector<float> R = univ(static_cast<size_t>(T * n), -2.0f, 2.0f), Q = univ(R.size(), -2.0f, 2.0f),
                         P = univ(R.size(), -2.0f, 2.0f);
      R[3] = NAN;
      R[n + 4] = INFINITY;
      R[2 * n + 6] = -INFINITY;
      P[2] = NAN;
      P[n + 5] = -INFINITY;
      for (int64_t i = 0; i < rows; ++i) R[2 * n + i * cols + 1] = 1e30f;
      const std::vector<int32_t> flags = {1, 0, 1};
      TensorPair tp(rng, dtypes, n, 0);
      Dev<int32_t> dflags(flags), dskip(std::vector<int32_t>{skip});
      Dev<float> dR1(R), dR2(R), dP1(P), dP2(P), dQ(Q);
      Dev<double> dss(static_cast<size_t>(T * cols));
      Dev<uint16_t> rb1(R.size()), rb2(R.size()), pb1(R.size()), pb2(R.size());
      const ConstMatBatch q(dQ.p(), rows, cols, cols, n, T);
      const MatBatch r1{dR1.p(), rows, cols, cols, n, T}, r2{dR2.p(), rows, cols, cols, n, T};
      const MatBatch p1{dP1.p(), rows, cols, cols, n, T}, p2{dP2.p(), rows, cols, cols, n, T};
      cuda->nan_to_num(dR1.p(), T * n);
      cuda->nan_to_num(dP1.p(), T * n);
      cuda->zero_fixup_flagged(dflags.p(), p1, r1, q);
      cuda->store(pb1.p(), DION_DTYPE_BF16, dP1.p(), T * n);
      cuda->store(rb1.p(), DION_DTYPE_BF16, dR1.p(), T * n);
      const std::vector<uint16_t> rb_fixed = rb1.get();
      cuda->col_normalize(r1, 0.5f);
      cuda->store(rb1.p(), DION_DTYPE_BF16, dR1.p(), T * n);
      cuda->store_multi(tp.a.dev_table.p(), T, kState1, dR1.p(), n, dskip.p());
      cuda->store(pb2.p(), DION_DTYPE_BF16, dP2.p(), T * n);  // finish_p's precondition: pb = bf16(p)
      cuda->finish_p(p2, dflags.p(), pb2.p(), false);
      cuda->finish_r(r2, dflags.p(), q, nullptr, kState1, rb2.p(), dss.p());
      EXPECT_TRUE(same_bits(rb_fixed, rb2.get())) << "the fixed-up R's bf16 copy";
      const std::vector<float> R2fixed = dR2.get();
      const std::vector<double> ss2 = dss.get();
      cuda->col_scale_store(r2, dss.p(), 0.5f, rb2.p(), tp.b.dev_table.p(), kState1, dskip.p(), true);
      EXPECT_TRUE(same_bits(dP1.get(), dP2.get()));
      EXPECT_TRUE(same_bits(pb1.get(), pb2.get()));
      EXPECT_TRUE(same_bits(dR1.get(), dR2.get()));
      EXPECT_TRUE(same_bits(rb1.get(), rb2.get()));
      EXPECT_TRUE(tp.same_field(kState1));
      if (skip) EXPECT_TRUE(tp.unchanged(kState1));
      // The host's on the same inputs (b's host copy of the state).
      std::vector<float> Rh = R, Ph = P, Qh = Q;
      std::vector<double> ssh(static_cast<size_t>(T * cols));
      std::vector<uint16_t> rbh(R.size()), pbh(R.size());
      const MatBatch rh{Rh.data(), rows, cols, cols, n, T}, ph{Ph.data(), rows, cols, cols, n, T};
      host->store(pbh.data(), DION_DTYPE_BF16, Ph.data(), T * n);
      host->finish_p(ph, flags.data(), pbh.data(), false);
      host->finish_r(rh, flags.data(), ConstMatBatch(Qh.data(), rows, cols, cols, n, T), nullptr, kState1, nullptr,
                     ssh.data());
      EXPECT_TRUE(close(std::vector<float>(ssh.begin(), ssh.end()),
                        [&] {
                          const std::vector<double> d = dss.get();
                          return std::vector<float>(d.begin(), d.end());
                        }(),
                        kUlps));
      host->col_scale_store(rh, ssh.data(), 0.5f, rbh.data(), tp.b.host_list.data(), kState1, &skip, true);
      EXPECT_TRUE(same_bits(Ph, dP2.get()));
      EXPECT_TRUE(same_bits(pbh, pb2.get()));
      EXPECT_TRUE(close(Rh, dR2.get(), kUlps));
      EXPECT_NEAR(Rh[2 * n + 1], 1.0 / std::sqrt(static_cast<double>(rows)), 1e-6) << "the 1e30 column, normalised";
      std::vector<float> wb(rbh.size()), gb(rbh.size());
      const std::vector<uint16_t> rbd = rb2.get();
      for (size_t i = 0; i < rbh.size(); ++i) {
        wb[i] = bf16_to_float(rbh[i]);
        gb[i] = bf16_to_float(rbd[i]);
      }
      EXPECT_TRUE(close(wb, gb, dtype_rtol(DION_DTYPE_BF16)));
      for (size_t i = 0; i < tp.b.t.size(); ++i) compare_field(tp.b, i, kState1);
      // The variants Dion's bf16 path takes, against the calls above, bit for
      // bit: finish_p with pb_all writes every element of a pb holding
      // garbage; load_multi_bf16 is store(BF16) of load_multi; finish_r's
      // fix-up from the typed field (kState1 of b, every dtype) equals it
      // from that field loaded; col_scale_store with write_r false writes
      // the same copies and leaves r.
      Dev<float> dP3(P);
      Dev<uint16_t> pb3(std::vector<uint16_t>(R.size(), 7));
      cuda->finish_p(MatBatch{dP3.p(), rows, cols, cols, n, T}, dflags.p(), pb3.p(), true);
      EXPECT_TRUE(same_bits(dP1.get(), dP3.get()));
      EXPECT_TRUE(same_bits(pb1.get(), pb3.get()));
      Dev<float> dQs(R.size()), dR3(R), dR4(R);
      Dev<uint16_t> qs16(R.size()), want16(R.size()), rb3(R.size()), rb4(std::vector<uint16_t>(R.size(), 7));
      Dev<double> dss3(static_cast<size_t>(T * cols)), dss4(static_cast<size_t>(T * cols));
      cuda->load_multi(dQs.p(), tp.b.dev_table.p(), T, kState1, n);
      cuda->load_multi_bf16(qs16.p(), tp.b.dev_table.p(), T, kState1, n);
      cuda->store(want16.p(), DION_DTYPE_BF16, dQs.p(), T * n);
      EXPECT_TRUE(same_bits(want16.get(), qs16.get()));
      cuda->finish_r(MatBatch{dR3.p(), rows, cols, cols, n, T}, dflags.p(),
                     ConstMatBatch(dQs.p(), rows, cols, cols, n, T), nullptr, kState1, rb3.p(), dss3.p());
      cuda->finish_r(MatBatch{dR4.p(), rows, cols, cols, n, T}, dflags.p(),
                     ConstMatBatch(nullptr, rows, cols, cols, n, T), tp.b.dev_table.p(), kState1, rb4.p(), dss4.p());
      EXPECT_TRUE(same_bits(dR3.get(), dR4.get()));
      EXPECT_TRUE(same_bits(rb3.get(), rb4.get()));
      EXPECT_TRUE(same_bits(dss3.get(), dss4.get()));
      Dev<float> dR5(R2fixed);
      Dev<double> dss5(ss2);
      Dev<uint16_t> rb5(std::vector<uint16_t>(R.size(), 7));
      cuda->col_scale_store(MatBatch{dR5.p(), rows, cols, cols, n, T}, dss5.p(), 0.5f, rb5.p(), nullptr, kState1,
                            nullptr, false);
      EXPECT_TRUE(same_bits(R2fixed, dR5.get()));
      EXPECT_TRUE(same_bits(rb2.get(), rb5.get()));
    }
}

// Dion2's selection on the typed momentum (no fp32 copy of M + G): the
// norms of momentum_l1_multi and the state and slices of
// select_momentum_multi are the bits of the sequence they replace
// (momentum_multi into fp32, slice_l1, gather_slices, scale_slices,
// store_slices_multi); against the host's fused ops, the norms within
// slice_l1's tolerance (the host sums in fp32, slices of at most 520
// elements here: rounding ~sqrt(520) 2^-24 = 1.4e-6 relative, 1e-5 leaves
// a margin of 7) and the rest bit for bit (one addition and one product per
// element).
// 96 rows make two row chunks of the column sums; n = 2 * 7 * 9 leaves a
// tail after the vector path, a shift of one the element path everywhere;
// 40 x 512: whole tiles of the wide column-sum kernel (256 columns); indices
// ascending (topk's) and shuffled (the ops take any distinct indices), and
// k = N / 3 (several selected columns in most chunks of 8).
TEST_F(OpsTest, MomentumL1AndSelectMomentum) {
  const int64_t per = 2, T = 3, B = T * per;
  // grad and momentum dtypes (fp32, bf16, fp16 = 0, 1, 2)
  const std::vector<std::vector<int>> dtypes = {{-1, 0, 1, -1}, {-1, 1, 0, -1}, {-1, 1, 2, -1}};
  for (const auto& [rows, cols] :
       std::initializer_list<std::pair<int64_t, int64_t>>{{7, 9}, {96, 40}, {300, 520}, {40, 512}, {kBigRows, kBigCols}})
    for (int64_t shift : {0, 1})
      for (Axis ax : {kRows, kCols})
        for (int64_t kk : {1, 3, -3})
          for (int32_t skip : {0, 1})
            for (bool ascending : {true, false}) {
              if (!small_or_first(rows, shift, kk == -3 && !skip && ascending)) continue;
              const int64_t n = per * rows * cols, N = ax == kRows ? rows : cols, k = kk > 0 ? kk : N / -kk;
              SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", shift " << shift << ", axis " << ax
                                                << ", k " << k << ", skip " << skip << ", ascending " << ascending);
              TensorPair tp(rng, dtypes, n, shift);
              Dev<int32_t> dskip(std::vector<int32_t>{skip});
              const std::vector<int32_t> idx = pick_slices(rng, B, N, k, ascending);
              Dev<int32_t> didx(idx);
              // The sequence on a.
              Dev<float> M(B * rows * cols), L1(B * N), L2(B * N);
              cuda->momentum_multi(tp.a.dev_table.p(), T, n, 1.0f, 1.0f, false, true, M.p(), DION_DTYPE_FP32, dskip.p(),
                                   nullptr);
              const MatBatch m{M.p(), rows, cols, cols, rows * cols, B};
              cuda->slice_l1(m, ax, L1.p());
              Mat S1 = ax == kRows ? Mat::padded(k, cols, B) : Mat::padded(rows, k, B);
              Mat S2 = ax == kRows ? Mat::padded(k, cols, B) : Mat::padded(rows, k, B);
              Mat S3 = ax == kRows ? Mat::padded(k, cols, B) : Mat::padded(rows, k, B);
              cuda->gather_slices(m, ax, didx.p(), k, S1.D());
              cuda->scale_slices(m, ax, didx.p(), k, 0.9f);
              cuda->store_slices_multi(tp.a.dev_table.p(), T, kState0, m, ax, didx.p(), k, dskip.p());
              // The fused ops on b: the norms write nothing typed.
              cuda->momentum_l1_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, L2.p(), nullptr);
              EXPECT_TRUE(tp.unchanged(kState0));
              EXPECT_TRUE(same_bits(L1.get(), L2.get()));
              cuda->select_momentum_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, didx.p(), k, 0.9f, S2.D(),
                                          DION_DTYPE_FP32, dskip.p(), nullptr);
              EXPECT_TRUE(same_bits(S1.dev(), S2.dev())) << "the slices, and the padding untouched";
              EXPECT_TRUE(tp.same_field(kState0));
              if (skip) EXPECT_TRUE(tp.unchanged(kState0));
              // The host's fused ops on b's host copy (the same inputs).
              std::vector<float> Lh(static_cast<size_t>(B * N));
              host->momentum_l1_multi(tp.b.host_list.data(), T, per, rows, cols, ax, Lh.data(), nullptr);
              EXPECT_TRUE(close(Lh, L2.get(), 1e-5));
              host->select_momentum_multi(tp.b.host_list.data(), T, per, rows, cols, ax, idx.data(), k, 0.9f, S3.H(),
                                          DION_DTYPE_FP32, &skip, nullptr);
              EXPECT_TRUE(same_bits(S3.h, S2.dev()));
              for (size_t i = 0; i < tp.b.t.size(); ++i)
                EXPECT_TRUE(same_bits(tp.b.t[i].h[kState0], tp.b.dev_raw(i, kState0))) << "tensor " << i;
            }
}

// momentum_l1_multi's non-finite flag (Dion2's pre-pass, in place of
// check_nonfinite): left at 0 on finite gradients, with the norms those of
// the call without a flag; set by a NaN, +Inf or -Inf anywhere in one
// gradient (the vector path and, shifted or with columns not a multiple of
// 8, the element path), and never cleared.
TEST_F(OpsTest, MomentumL1FlagsNonfiniteGradients) {
  const int64_t per = 2, T = 3, B = T * per;
  const std::vector<std::vector<int>> dtypes = {{-1, 1, 1, -1}, {-1, 0, 0, -1}, {-1, 2, 1, -1}};
  for (const auto& [rows, cols] : std::initializer_list<std::pair<int64_t, int64_t>>{{7, 9}, {96, 40}, {300, 520}})
    for (int64_t shift : {0, 1})
      for (Axis ax : {kRows, kCols}) {
        SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", shift " << shift << ", axis " << ax);
        const int64_t n = per * rows * cols, N = ax == kRows ? rows : cols;
        TensorPair tp(rng, dtypes, n, shift);
        Dev<float> L1(B * N), L2(B * N);
        Dev<int32_t> flag(std::vector<int32_t>{0});
        cuda->momentum_l1_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, L1.p(), nullptr);
        cuda->momentum_l1_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, L2.p(), flag.p());
        EXPECT_TRUE(same_bits(L1.get(), L2.get()));
        EXPECT_EQ(flag.get()[0], 0);
        int round = 0;
        for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
          // tensor 1 (its grad fp32 or bf16 ...: the dtypes above), a random element
          const int64_t at = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
          const auto dt = static_cast<dion_dtype_t>(tp.b.host_list[1].dtype[kGrad]);
          std::vector<uint8_t> one(dtype_size(dt));
          store_elem(one.data(), dt, 0, bad);
          uint8_t* g = static_cast<uint8_t*>(tp.b.dev_list[1].ptr[kGrad]) + at * dtype_size(dt);
          cuda_ok(cudaMemcpy(g, one.data(), one.size(), cudaMemcpyHostToDevice), "poison");
          Dev<int32_t> f(std::vector<int32_t>{0});
          cuda->momentum_l1_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, L2.p(), f.p());
          EXPECT_EQ(f.get()[0], 1) << "value " << bad << " at " << at;
          cuda->momentum_l1_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, L2.p(), flag.p());
          EXPECT_EQ(flag.get()[0], 1) << "round " << round++;
        }
      }
}

// The selection's sums of squares (one matrix per tensor, as Dion2's batches
// without meshes): with them select_momentum_multi writes the same state and
// slices as without; the parts total each slice matrix's squared Frobenius
// norm (double sums of floats: within sums_bound), are the same bits on a
// second run, and frob_normalize_bf16_parts from them matches
// frob_normalize_bf16 (the norms summed in another order may differ in the
// last float bit: one bf16 unit, at most 2^-7 relative). Shapes: the
// element path (7 x 9, and a shift of one), the chunked one, many blocks.
TEST_F(OpsTest, SelectMomentumSumsOfSquares) {
  const int64_t T = 3;
  const std::vector<std::vector<int>> dtypes = {{-1, 1, 1, -1}, {-1, 0, 0, -1}, {-1, 1, 0, -1}};
  for (const auto& [rows, cols] :
       std::initializer_list<std::pair<int64_t, int64_t>>{{7, 9}, {96, 40}, {300, 520}, {40, 512}})
    for (int64_t shift : {0, 1})
      for (Axis ax : {kRows, kCols}) {
        SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", shift " << shift << ", axis " << ax);
        const int64_t n = rows * cols, N = ax == kRows ? rows : cols, k = std::max<int64_t>(1, N / 4);
        EXPECT_EQ(cuda->select_momentum_parts(T, 2, rows, cols), 0) << "several matrices per tensor: no sums";
        const int64_t parts = cuda->select_momentum_parts(T, 1, rows, cols);
        ASSERT_GE(parts, 1);
        ASSERT_LE(parts, Backend::select_parts_max(rows, cols));
        TensorPair tp(rng, dtypes, n, shift);
        Dev<int32_t> dskip(std::vector<int32_t>{0});
        const std::vector<int32_t> idx = pick_slices(rng, T, N, k);
        Dev<int32_t> didx(idx);
        const int64_t sr = ax == kRows ? k : rows, sc = ax == kRows ? cols : k;
        Dev<float> S1(T * sr * sc), S2(T * sr * sc);
        Dev<double> sums(T * parts), sums2(T * parts);
        const MatBatch s1{S1.p(), sr, sc, sc, sr * sc, T}, s2{S2.p(), sr, sc, sc, sr * sc, T};
        cuda->select_momentum_multi(tp.a.dev_table.p(), T, 1, rows, cols, ax, didx.p(), k, 0.9f, s1, DION_DTYPE_FP32,
                                    dskip.p(), nullptr);
        cuda->select_momentum_multi(tp.b.dev_table.p(), T, 1, rows, cols, ax, didx.p(), k, 0.9f, s2, DION_DTYPE_FP32,
                                    dskip.p(), sums.p());
        EXPECT_TRUE(same_bits(S1.get(), S2.get()));
        EXPECT_TRUE(tp.same_field(kState0));
        const std::vector<float> sv = S2.get();
        const std::vector<double> sd = sums.get();
        for (int64_t b = 0; b < T; ++b) {
          double want = 0, got = 0;
          for (int64_t i = 0; i < sr * sc; ++i) want += static_cast<double>(sv[b * sr * sc + i]) * sv[b * sr * sc + i];
          for (int64_t c = 0; c < parts; ++c) got += sd[b * parts + c];
          EXPECT_NEAR(got, want, sums_bound(sr * sc) * want) << "matrix " << b;
        }
        // A second run on the new state (b's): its sums again, twice.
        cuda->select_momentum_multi(tp.b.dev_table.p(), T, 1, rows, cols, ax, didx.p(), k, 0.9f, s2, DION_DTYPE_FP32,
                                    dskip.p(), sums.p());
        cuda->select_momentum_multi(tp.a.dev_table.p(), T, 1, rows, cols, ax, didx.p(), k, 0.9f, s1, DION_DTYPE_FP32,
                                    dskip.p(), sums2.p());
        EXPECT_TRUE(same_bits(sums.get(), sums2.get())) << "the same partial sums on every run";
        Dev<uint16_t> o1(T * sr * sc), o2(T * sr * sc);
        cuda->frob_normalize_bf16(ConstMatBatch(s2), 1.02f, 1e-7f, o1.p());
        cuda->frob_normalize_bf16_parts(ConstMatBatch(s2), sums.p(), parts, 1.02f, 1e-7f, o2.p());
        const std::vector<uint16_t> b1 = o1.get(), b2 = o2.get();
        std::vector<float> f1(b1.size()), f2(b2.size());
        for (size_t i = 0; i < b1.size(); ++i) {
          f1[i] = bf16_to_float(b1[i]);
          f2[i] = bf16_to_float(b2[i]);
        }
        EXPECT_TRUE(close(f1, f2, 1.0 / 128));
      }
}

// select_momentum_multi into bf16 slices (Dion2's bf16 iteration reads them
// unnormalised): the device's bf16 slices are the host's bits and the
// rounding of the fp32 slices (one rounding per element; a padded out: ld
// and stride count bf16 elements, the padding untouched), the state is the
// fp32 call's, and the partial sums total the squares of the rounded values
// (within sums_bound: double sums in another order). Shapes: the element path,
// the chunked one (16-byte bf16 stores of selected rows where aligned), the
// scattered column stores.
TEST_F(OpsTest, SelectMomentumIntoBf16) {
  const int64_t T = 3, pad = 5;
  const std::vector<std::vector<int>> dtypes = {{-1, 1, 1, -1}, {-1, 0, 0, -1}, {-1, 1, 0, -1}};
  for (const auto& [rows, cols] :
       std::initializer_list<std::pair<int64_t, int64_t>>{{7, 9}, {96, 40}, {300, 520}, {40, 512}, {kBigRows, kBigCols}})
    for (int64_t shift : {0, 1})
      for (Axis ax : {kRows, kCols})
        for (int64_t ldpad : {int64_t{0}, pad}) {
          SCOPED_TRACE(::testing::Message() << rows << " x " << cols << ", shift " << shift << ", axis " << ax
                                            << ", ld pad " << ldpad);
          if (!small_or_first(rows, shift, ldpad == 0)) continue;
          const int64_t n = rows * cols, N = ax == kRows ? rows : cols, k = std::max<int64_t>(1, N / 4);
          const int64_t parts = cuda->select_momentum_parts(T, 1, rows, cols);
          ASSERT_GE(parts, 1);
          TensorPair tp(rng, dtypes, n, shift);
          Dev<int32_t> dskip(std::vector<int32_t>{0});
          const std::vector<int32_t> idx = pick_slices(rng, T, N, k);
          Dev<int32_t> didx(idx);
          const int64_t sr = ax == kRows ? k : rows, sc = ax == kRows ? cols : k, ld = sc + ldpad;
          Dev<float> S(T * sr * sc);
          const std::vector<uint16_t> fill(static_cast<size_t>(T * sr * ld), 0x7777);
          Dev<uint16_t> S16(fill);
          Dev<double> sums(T * parts);
          const MatBatch s32{S.p(), sr, sc, sc, sr * sc, T};
          const MatBatch s16{reinterpret_cast<float*>(S16.p()), sr, sc, ld, sr * ld, T};
          cuda->select_momentum_multi(tp.a.dev_table.p(), T, 1, rows, cols, ax, didx.p(), k, 0.9f, s32, DION_DTYPE_FP32,
                                      dskip.p(), nullptr);
          cuda->select_momentum_multi(tp.b.dev_table.p(), T, 1, rows, cols, ax, didx.p(), k, 0.9f, s16, DION_DTYPE_BF16,
                                      dskip.p(), sums.p());
          EXPECT_TRUE(tp.same_field(kState0));
          const std::vector<float> f32 = S.get();
          const std::vector<uint16_t> got = S16.get();
          const std::vector<double> sd = sums.get();
          // The host on b's host copy (its state before the call: the same inputs).
          std::vector<uint16_t> want(fill);
          std::vector<double> hs(static_cast<size_t>(T));
          const int32_t skip = 0;
          host->select_momentum_multi(tp.b.host_list.data(), T, 1, rows, cols, ax, idx.data(), k, 0.9f,
                                      MatBatch{reinterpret_cast<float*>(want.data()), sr, sc, ld, sr * ld, T},
                                      DION_DTYPE_BF16, &skip, hs.data());
          EXPECT_TRUE(got == want) << "the host's bits";
          int64_t bad = 0;
          for (int64_t b = 0; b < T; ++b) {
            double sq = 0, tot = 0;
            for (int64_t i = 0; i < sr; ++i)
              for (int64_t j = 0; j < ld; ++j) {
                const uint16_t g = got[static_cast<size_t>((b * sr + i) * ld + j)];
                if (j >= sc) {
                  bad += g != 0x7777;
                  continue;
                }
                const uint16_t r = float_to_bf16(f32[static_cast<size_t>((b * sr + i) * sc + j)]);
                bad += g != r;
                const double v = bf16_to_float(r);
                sq += v * v;
              }
            for (int64_t c = 0; c < parts; ++c) tot += sd[static_cast<size_t>(b * parts + c)];
            EXPECT_NEAR(tot, sq, sums_bound(sr * sc) * sq) << "matrix " << b;
            EXPECT_NEAR(hs[static_cast<size_t>(b)], sq, sums_bound(sr * sc) * sq) << "host, matrix " << b;
          }
          EXPECT_EQ(bad, 0) << "elements not bf16(the fp32 slice), or padding written";
        }
}

// frob_scale_bf16 (the bf16 iteration's first step from an unnormalised
// start) against the host: the same fp32 expression per element, with inv
// from the parts summed in another order (a tree on the device), which can
// move inv by a float ulp: at most one bf16 unit per element. On padded,
// non-square and square batches (dense ones with rows of a multiple of 8
// take the 16-byte chunks; 1030 x 2056: more chunks in a row than threads
// in a block, a last group of rows short of four), powers 1 and 2, with and
// without a shift of the diagonal; the padding stays.
TEST_F(OpsTest, FrobScaleBf16) {
  struct Case {
    int64_t rows, cols, ld, batch, nparts;
  } cases[] = {{5, 7, 9, 3, 3},      {64, 64, 64, 4, 88}, {300, 200, 203, 2, 700},
               {72, 48, 48, 2, 5}, {40, 96, 96, 3, 1},  {1030, 2056, 2056, 2, 40}};
  for (const Case& c : cases)
    for (int power : {1, 2})
      for (float diag : {0.0f, 2.3f}) {
        SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.cols << " (ld " << c.ld << ") x " << c.batch
                                          << ", power " << power << ", diag " << diag);
        std::vector<double> parts(static_cast<size_t>(c.batch * c.nparts));
        for (double& p : parts) p = std::uniform_real_distribution<double>(0.0, 3.0)(rng);
        std::vector<uint16_t> m(static_cast<size_t>(c.batch * c.rows * c.ld));
        for (uint16_t& e : m) e = float_to_bf16(gauss());
        Dev<double> dparts(parts);
        Dev<uint16_t> dm(m);
        cuda->frob_scale_bf16(MatBatch{reinterpret_cast<float*>(dm.p()), c.rows, c.cols, c.ld, c.rows * c.ld, c.batch},
                              FrobScale{dparts.p(), c.nparts, 1.02f, 1e-7f, power}, diag);
        std::vector<uint16_t> want = m;
        host->frob_scale_bf16(MatBatch{reinterpret_cast<float*>(want.data()), c.rows, c.cols, c.ld, c.rows * c.ld,
                                       c.batch},
                              FrobScale{parts.data(), c.nparts, 1.02f, 1e-7f, power}, diag);
        const std::vector<uint16_t> got = dm.get();
        int64_t far = 0, changed = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          const int d = std::abs(static_cast<int>(got[i]) - static_cast<int>(want[i]));
          far += d > 1;  // same sign (a positive scale): adjacent bit patterns are one bf16 unit apart
          changed += got[i] != m[i];
        }
        EXPECT_EQ(far, 0);
        EXPECT_GT(changed, 0) << "the matrices were scaled";
      }
}

// ns_shift_bf16 (the bf16 iteration's shift before a whole A A product)
// against the host: without a scale bit for bit (the same fp32 operations);
// with one, inv comes from the parts summed in another order (a tree on the
// device), which can move inv by a float ulp: at most one bf16 unit per
// element of a, a3 and b. Cases: dense n a multiple of 8 (16-byte chunks,
// 768 as gpt-160m's), padded rows (ld > n), n not a multiple of 8 (the
// element path, a short last chunk per row), a batch beyond one; the
// padding of a and b and the rest of a3's buffer stay as they were.
TEST_F(OpsTest, NsShiftBf16) {
  struct Case {
    int64_t n, ld, batch, nparts;
  } cases[] = {{768, 768, 3, 40}, {64, 72, 2, 5}, {37, 37, 3, 1}, {45, 48, 2, 7}};
  const uint16_t kPad = 0x7fc5;
  for (const Case& c : cases)
    for (bool scaled : {false, true}) {
      SCOPED_TRACE(::testing::Message() << c.n << " (ld " << c.ld << ") x " << c.batch << (scaled ? ", scaled" : ""));
      std::vector<double> parts(static_cast<size_t>(c.batch * c.nparts));
      for (double& p : parts) p = std::uniform_real_distribution<double>(0.0, 3.0)(rng);
      std::vector<uint16_t> a(static_cast<size_t>(c.batch * c.n * c.ld), kPad), b(a.size(), kPad),
          a3(static_cast<size_t>(c.batch * c.n * c.n + 5), kPad);
      for (int64_t q = 0; q < c.batch; ++q)
        for (int64_t i = 0; i < c.n; ++i)
          for (int64_t j = 0; j < c.n; ++j) a[static_cast<size_t>((q * c.n + i) * c.ld + j)] = float_to_bf16(gauss());
      Dev<double> dparts(parts);
      Dev<uint16_t> da(a), db(b), da3(a3);
      auto mb = [&](uint16_t* p) { return MatBatch{reinterpret_cast<float*>(p), c.n, c.n, c.ld, c.n * c.ld, c.batch}; };
      const FrobScale dsc{dparts.p(), c.nparts, 1.02f, 1e-7f, 1}, hsc{parts.data(), c.nparts, 1.02f, 1e-7f, 1};
      cuda->ns_shift_bf16(mb(da.p()), mb(db.p()), -4.775f, 3.4445f, scaled ? &dsc : nullptr,
                          scaled ? da3.p() : nullptr);
      std::vector<uint16_t> wa = a, wb = b, wa3 = a3;
      host->ns_shift_bf16(mb(wa.data()), mb(wb.data()), -4.775f, 3.4445f, scaled ? &hsc : nullptr,
                          scaled ? wa3.data() : nullptr);
      const std::vector<uint16_t> ga = da.get(), gb = db.get(), ga3 = da3.get();
      auto far = [&](const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
        int64_t bad = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          // adjacent bit patterns of one sign are one bf16 unit apart; without a scale, exact
          const int d = std::abs(static_cast<int>(got[i]) - static_cast<int>(want[i]));
          bad += scaled ? d > 1 : d != 0;
        }
        return bad;
      };
      EXPECT_EQ(far(ga, wa), 0) << "a";
      EXPECT_EQ(far(gb, wb), 0) << "b";
      EXPECT_EQ(far(ga3, wa3), 0) << "a3";
      EXPECT_NE(gb, b) << "b was written";
      if (scaled) EXPECT_NE(ga3, a3) << "a3 was written";
      if (!scaled) EXPECT_EQ(ga, a) << "a is read only without a scale";
    }
}

// The local scope's parameter update: decay all, add the selected slices.
// Shapes: columns not a multiple of 8 (the element path), and multiples of 8
// (the chunked path when aligned: shift 0), with many chunks per thread;
// indices ascending (topk's) and shuffled (the op takes any distinct ones),
// k = N / 3 (several selected columns in most chunks of 8).
TEST_F(OpsTest, DecayAddSlicesMulti) {
  const int64_t per = 2, T = 3, B = T * per;
  const std::vector<std::vector<int>> dtypes = {{0, -1, -1, -1}, {1, -1, -1, -1}, {2, -1, -1, -1}};
  const GroupScalars gs{0.03, 0.1, 0.9, 0.99, 1, 0};
  Dev<GroupScalars> dgs(std::vector<GroupScalars>{gs});
  for (const auto& [rows, cols] :
       std::initializer_list<std::pair<int64_t, int64_t>>{{7, 9}, {96, 40}, {300, 520}, {40, 512}, {kBigRows, kBigCols}})
    for (int64_t shift : {0, 1})
      for (Axis ax : {kRows, kCols})
        for (int64_t kk : {0, 1, 4, -3})
          for (int32_t skip : {0, 1})
            for (bool ubf16 : {false, true})
              for (bool ascending : {true, false})
                for (bool scaled : {false, true}) {
                if (!small_or_first(rows, shift, kk == -3 && !skip && ascending)) continue;
                if (scaled && (ax != kRows || !ascending)) continue;  // NorDion2's case: rows, topk's indices
                const int64_t n = per * rows * cols, N = ax == kRows ? rows : cols, k = kk >= 0 ? kk : N / -kk;
                SCOPED_TRACE(::testing::Message()
                             << rows << " x " << cols << ", shift " << shift << ", axis " << ax << ", k " << k
                             << ", skip " << skip << ", u bf16 " << ubf16 << ", ascending " << ascending
                             << ", scaled " << scaled);
                TensorPair tp(rng, dtypes, n, shift);
                Dev<int32_t> dskip(std::vector<int32_t>{skip});
                const std::vector<int32_t> idx = pick_slices(rng, B, N, k, ascending);
                Dev<int32_t> didx(idx.empty() ? std::vector<int32_t>{0} : idx);
                // S shaped as gather_slices' out, padded; for a bf16 u, S holds
                // bf16 values and Sb their bf16 bits in the same layout (widening
                // is exact, so the fused op must give the fp32 sequence's bits).
                Mat S = ax == kRows ? Mat::padded(k, cols, B) : Mat::padded(rows, k, B);
                S.fill([&] { return ubf16 ? bf16_to_float(float_to_bf16(gauss())) : gauss(); });
                std::vector<uint16_t> sb(S.h.size());
                for (size_t i = 0; i < sb.size(); ++i) sb[i] = float_to_bf16(S.h[i]);
                Dev<uint16_t> Sb(sb);
                const dion_dtype_t udt = ubf16 ? DION_DTYPE_BF16 : DION_DTYPE_FP32;
                const ConstMatBatch ud =
                    ubf16 ? ConstMatBatch(reinterpret_cast<const float*>(Sb.p()), S.rows, S.cols, S.ld, S.stride, B)
                          : ConstMatBatch(S.D());
                const ConstMatBatch uh =
                    ubf16 ? ConstMatBatch(reinterpret_cast<const float*>(sb.data()), S.rows, S.cols, S.ld, S.stride, B)
                          : ConstMatBatch(S.H());
                // scaled: neuron scales (k per matrix, then B rescales, as
                // neuron_scales lays them out); the reference sequence adds
                // the rows normalised as apply_update_neuron_multi writes
                // them, float(u * scale * rescale).
                std::vector<double> sc(static_cast<size_t>(B * k + B));
                for (auto& v : sc) v = std::uniform_real_distribution<double>(0.25, 4.0)(rng);
                Dev<double> dsc(sc);
                Mat R(S.rows, S.cols, S.ld, S.stride, B);
                R.h = S.h;
                R.sync();
                if (scaled) {
                  for (int64_t b = 0; b < B; ++b)
                    for (int64_t s = 0; s < k; ++s)
                      for (int64_t j = 0; j < cols; ++j)
                        R.at(b, s, j) = static_cast<float>(R.at(b, s, j) * sc[b * k + s] * sc[B * k + b]);
                  R.sync();
                }
                Dev<float> X(B * rows * cols);
                cuda->load_multi(X.p(), tp.a.dev_table.p(), T, kParam, n);
                cuda->decay(X.p(), B * rows * cols, dgs.p());
                if (k > 0)
                  cuda->add_slices(MatBatch{X.p(), rows, cols, cols, rows * cols, B}, ax, didx.p(), k, R.D(), dgs.p(),
                                   -1.3f);
                cuda->store_multi(tp.a.dev_table.p(), T, kParam, X.p(), n, dskip.p());
                cuda->decay_add_slices_multi(tp.b.dev_table.p(), T, per, rows, cols, ax, didx.p(), k, ud, udt,
                                             scaled ? dsc.p() : nullptr, dgs.p(), -1.3f, dskip.p());
                EXPECT_TRUE(tp.same_field(kParam));
                if (skip) EXPECT_TRUE(tp.unchanged(kParam));
                host->decay_add_slices_multi(tp.b.host_list.data(), T, per, rows, cols, ax, idx.data(), k, uh, udt,
                                             scaled ? sc.data() : nullptr, &gs, -1.3f, &skip);
                compare_tensors(tp.b, 1);
              }
}

// orthogonalize_bf16's start: the bits of frob_normalize and a store to
// bf16, from padded, odd and large (many chunks per matrix) batches, into an
// aligned and a misaligned output; the same bits on every run.
TEST_F(OpsTest, FrobNormalizeBf16) {
  struct Case {
    int64_t rows, cols, batch, pad, gap;
  } cases[] = {{9, 13, 3, 3, 5}, {64, 48, 2, 0, 0}, {1024, 1000, 4, 0, 0}, {1, 7, 5, 0, 0}, {33, 100, 2, 4, 0}};
  for (const Case& c : cases)
    for (int64_t out_shift : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.cols << "x" << c.batch << " pad " << c.pad << " shift "
                                        << out_shift);
      Mat m = Mat::padded(c.rows, c.cols, c.batch, c.pad, c.gap);
      m.fill([&] { return 3.0f * gauss(); });
      const std::vector<float> x0 = m.h;
      const int64_t elems = c.rows * c.cols * c.batch;
      Dev<uint16_t> got(static_cast<size_t>(elems + out_shift)), want(static_cast<size_t>(elems));
      for (int run = 0; run < 2; ++run) {
        cuda->frob_normalize_bf16(m.D(), 1.02f, 1e-7f, got.p() + out_shift);
        const std::vector<uint16_t> g = got.get();
        if (run == 0) {
          EXPECT_TRUE(same_bits(x0, m.dev())) << "the input must be left alone";
          // The old sequence: normalise in place, then store row by row (the batch is padded).
          Mat y = Mat::padded(c.rows, c.cols, c.batch, c.pad, c.gap);
          y.h = x0;
          y.sync();
          cuda->frob_normalize(y.D(), 1.02f, 1e-7f);
          for (int64_t b = 0; b < c.batch; ++b)
            for (int64_t i = 0; i < c.rows; ++i)
              cuda->store(want.p() + (b * c.rows + i) * c.cols, DION_DTYPE_BF16, y.d.p() + b * y.stride + i * y.ld,
                          c.cols);
          EXPECT_TRUE(same_bits(want.get(), std::vector<uint16_t>(g.begin() + out_shift, g.end())));
          // The host's: within one bf16 ulp (the sums agree to double rounding).
          std::vector<uint16_t> h(static_cast<size_t>(elems));
          host->frob_normalize_bf16(m.H(), 1.02f, 1e-7f, h.data());
          std::vector<float> hf(h.size()), gf(h.size());
          for (size_t i = 0; i < h.size(); ++i) {
            hf[i] = bf16_to_float(h[i]);
            gf[i] = bf16_to_float(g[i + static_cast<size_t>(out_shift)]);
          }
          EXPECT_TRUE(close(hf, gf, 1.0 / 128));
        } else {
          EXPECT_TRUE(same_bits(want.get(), std::vector<uint16_t>(g.begin() + out_shift, g.end())));
        }
      }
    }
}

}  // namespace
}  // namespace dion_ops_test
