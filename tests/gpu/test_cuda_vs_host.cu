// SPDX-License-Identifier: MIT
// The CUDA backend computes what the host backend computes. Both backends draw
// the same random numbers (same seed: the same initial Dion Q and the same
// RCQR sketches), so from identical parameters, gradients and states they
// must agree up to floating-point rounding. Every algorithm and its main
// options, in fp32, bf16 and fp16, on the unit suites' small shapes (tall,
// wide, square, 3-D batched, column-major, several same-shape tensors in one
// group so that batching is exercised) and on two large fp32 matrices, is
// stepped on both backends with the same fresh random gradients at every step;
// after every step the parameters and every state (dion_state_count / info /
// read) are compared.
//
// What is compared. Errors are relative Frobenius norms. For a parameter it is
// the error of the CHANGE (X_cuda - X_host against X_host - X_base): X itself
// would hide a wrong update behind its own size.
//
// Tolerances (derived, not tuned):
//
//  * fp32, element-wise algorithms (AdamW, Lion): per element a step is ~11
//    fp32 operations (moments, bias corrections, sqrt, eps, division, lr),
//    each rounded to within 2^-24 relative; two correct implementations (FMA
//    contraction on the GPU, none on the host) may round each of them
//    differently: <= 2 x 11 x 2^-24 = 1.3e-6 relative, so tol = 2e-6. The
//    updates do not feed back into the moments, so this does not grow with
//    the number of steps.
//  * fp32, orthogonalizing algorithms (Dion, Muon family): every entry of the
//    update is a dot product of length K = max(rows, cols), evaluated in a
//    different order by cuBLAS than by the host BLAS, then iterated 5 times
//    (Polar Express / Newton-Schulz) or fed through a QR. The reference suites
//    measured naive-fp32 errors of 6e-7..2e-5 on these shapes (K <= 256);
//    the floor is 1e-4 there and grows like the random-walk error of a dot
//    product, sqrt(K / 256), beyond (4096: 4e-4; 8192: 5.7e-4). An
//    algorithmic mistake (a coefficient, a transposition, a wrong sketch)
//    moves the update by >= 1e-2.
//    A QR's orthonormal factor is as sensitive as the condition number of
//    its input, and Dion's P = B Q is ill-conditioned on square random
//    matrices (cond ~ 1e3..1e4): there the intrinsic fp32 sensitivity exceeds
//    any fixed floor. So, as in tests/reference/algorithm_testbed.h, the
//    small fp32 cases also run a third optimizer, on the host, whose
//    gradients are moved by one fp32 ulp in random directions: its distance
//    to the host run (`sens`) is what fp32 rounding alone does to this
//    computation on this input, and the bound is max(floor, 10 x sens) (10:
//    room for a different but equally sound evaluation order, as there).
//  * Parameter storage: X_new is rounded to the parameter dtype; two fp32
//    values that differ by less than an ulp of X can still round one ulp
//    apart. Each comparison adds k x ||ulp(X)|| (the Frobenius norm of the
//    per-element spacing of the dtype at X, over the elements that differ)
//    plus 4 x 2^-24 ||X|| per step for the fp32 operations on X itself
//    (decay, add). k = 2 per step when free-running (one rounding of the
//    stored value, one of the arithmetic on it), 1 for single steps.
//  * bf16 / fp16 parameters (states in the same dtype): 8 / 11 significand
//    bits, one ulp = 2^-7..2^-8 / 2^-10..2^-11 relative. A difference of one
//    ulp in a stored momentum would compound over free-running steps in a
//    way no fixed bound describes, so these cases compare ONE step at a
//    time: before every step the CUDA optimizer gets the host's parameters
//    (cudaMemcpy) and states (dion_state_write), so each step starts from
//    bit-identical inputs. The two fp32 results then differ by the fp32
//    tolerance above, and rounding to the dtype adds at most one ulp per
//    element that differs: bound = tol x ||change|| + 1 x ||ulp_dtype||. Initial
//    parameters are small (|X0| <= 0.05) so that one ulp of X is a small
//    part of a step's update (bf16 ~7%, fp16 ~1% for Muon on 48x32): a wrong
//    update does not hide in the rounding slack. CudaVsHostMutant checks that
//    (a planted lr error of 0.1% in fp32, 25% in bf16/fp16 must fail).
//    For the element-wise algorithms the fp32 values agree to a few 2^-24,
//    so a stored element can differ only if it lies that close to a rounding
//    boundary of the dtype: probability ~ few x 2^-24 / 2^-11 < 1e-3. At
//    most 1% of the elements may differ at all: a truncating (instead of
//    round-to-nearest-even) conversion makes ~50% differ.
//  * Lion's sign(): an element of beta1 M + (1 - beta1) G within a few fp32
//    ulps of 0 may take the other sign on the other backend (probability
//    ~ 4 x 2^-23 per element and step); such an element then differs by
//    2 lr. Elements differing by more than lr are counted as flips, at most
//    1 + 1e-4 x elements x steps per tensor (1e-4: 200x the estimate), and
//    left out of the norm.
//  * Dion's Q is defined up to the signs of its columns; the update does not
//    depend on them. Columns of the CUDA Q are flipped to agree with the
//    host's before comparing.
#include <cstdlib>
#include <memory>

#include "gpu_test_util.h"

namespace {

using namespace dion_gpu_test;

// ------------------------------------------------------------------ cases --

struct Config {
  std::string label;
  dion_algorithm_t algo = DION_ALGO_MUON;
  dion_qr_method_t qr = DION_QR_RCQR;
  int32_t cqr_warmup = 150;
  double rank_fraction = 1.0;
  int32_t power_iters = 1;
  dion_orthogonalizer_t ortho = DION_ORTHO_POLAR_EXPRESS;
  int32_t nesterov = 0;
  int32_t cautious_wd = 0;
  double fraction = 0.25;
};

struct ShapeSet {
  std::string label;
  std::vector<std::vector<int64_t>> shapes;  // one tensor per shape, all in one group
  dion_layout_t layout = DION_LAYOUT_ROW_MAJOR;
};

struct Case {
  Config cfg;
  dion_dtype_t dtype = DION_DTYPE_FP32;
  ShapeSet set;
  int steps = 5;
  bool large = false;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.cfg.label << " " << dtype_name(c.dtype) << " " << c.set.label << " (" << c.steps << " steps)";
}

bool is_matrix_algo(dion_algorithm_t a) { return a != DION_ALGO_ADAMW && a != DION_ALGO_LION; }

std::vector<Config> configs() {
  std::vector<Config> v;
  const struct {
    dion_qr_method_t m;
    const char* name;
    int32_t warmup;
  } qrs[] = {{DION_QR_RCQR, "RCQR", 150},
             // cqr_warmup_steps = 1: step 1 runs RCQR, the later steps Cholesky QR.
             {DION_QR_CQR, "CQR", 1},
             {DION_QR_QR, "QR", 150}};
  for (const auto& q : qrs)
    for (double rf : {1.0, 0.25})
      for (int32_t pi : {1, 2}) {
        Config c;
        c.algo = DION_ALGO_DION;
        c.qr = q.m;
        c.cqr_warmup = q.warmup;
        c.rank_fraction = rf;
        c.power_iters = pi;
        c.label = std::string("Dion_") + q.name + (rf == 1.0 ? "_r100" : "_r25") + "_pi" + std::to_string(pi);
        v.push_back(c);
      }
  const struct {
    dion_orthogonalizer_t o;
    const char* name;
  } orthos[] = {{DION_ORTHO_POLAR_EXPRESS, "PE"}, {DION_ORTHO_NEWTON_SCHULZ, "NS"}};
  for (const auto& o : orthos)
    for (int32_t nest : {0, 1})
      for (int32_t cw : {0, 1}) {
        Config c;
        c.algo = DION_ALGO_MUON;
        c.ortho = o.o;
        c.nesterov = nest;
        c.cautious_wd = cw;
        c.label = std::string("Muon_") + o.name + (nest ? "_nesterov" : "") + (cw ? "_cautious" : "");
        v.push_back(c);
      }
  for (const auto& o : orthos)
    for (int32_t cw : {0, 1}) {
      Config c;
      c.algo = DION_ALGO_NORMUON;
      c.ortho = o.o;
      c.cautious_wd = cw;
      c.label = std::string("NorMuon_") + o.name + (cw ? "_cautious" : "");
      v.push_back(c);
    }
  for (dion_algorithm_t a : {DION_ALGO_DION2, DION_ALGO_NORDION2})
    for (const auto& o : orthos)
      for (double f : {0.25, 1.0}) {
        Config c;
        c.algo = a;
        c.ortho = o.o;
        c.fraction = f;
        c.label = std::string(algo_name(a)) + "_" + o.name + (f == 1.0 ? "_f100" : "_f25");
        v.push_back(c);
      }
  for (dion_algorithm_t a : {DION_ALGO_ADAMW, DION_ALGO_LION})
    for (int32_t cw : {0, 1}) {
      Config c;
      c.algo = a;
      c.cautious_wd = cw;
      c.label = std::string(algo_name(a)) + (cw ? "_cautious" : "");
      v.push_back(c);
    }
  return v;
}

std::vector<ShapeSet> shape_sets(dion_algorithm_t a) {
  std::vector<ShapeSet> v = {{"32x48", {{32, 48}}}, {"48x32", {{48, 32}}}, {"64x64", {{64, 64}}}};
  if (a != DION_ALGO_DION) v.push_back({"2x16x24", {{2, 16, 24}}});  // Dion takes 2-D tensors only
  if (!is_matrix_algo(a)) v.push_back({"37", {{37}}});
  v.push_back({"48x32_colmajor", {{48, 32}}, DION_LAYOUT_COL_MAJOR});
  // Several same-shape tensors in one group (batched together) next to others.
  if (a == DION_ALGO_DION)
    v.push_back({"group_3x48x32_32x48", {{48, 32}, {48, 32}, {48, 32}, {32, 48}}});
  else if (is_matrix_algo(a))
    v.push_back({"group_3x48x32_32x48_2x16x24", {{48, 32}, {48, 32}, {48, 32}, {32, 48}, {2, 16, 24}}});
  else
    v.push_back({"group_3x48x32_37_2x16x24", {{48, 32}, {48, 32}, {48, 32}, {37}, {2, 16, 24}}});
  return v;
}

std::vector<Case> small_cases() {
  std::vector<Case> v;
  for (const Config& c : configs())
    for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16})
      for (const ShapeSet& s : shape_sets(c.algo)) {
        Case k;
        k.cfg = c;
        k.dtype = dt;
        k.set = s;
        // fp32 runs free for 5 steps; bf16/fp16 compare 3 single steps from
        // re-synchronised inputs (see the file comment).
        k.steps = dt == DION_DTYPE_FP32 ? 5 : 3;
        v.push_back(k);
      }
  return v;
}

std::vector<Case> large_cases() {
  std::vector<Case> v;
  Config dion;
  dion.algo = DION_ALGO_DION;
  dion.rank_fraction = 0.25;
  dion.label = "Dion_RCQR_r25_pi1";
  Config muon;
  muon.algo = DION_ALGO_MUON;
  muon.label = "Muon_PE";
  for (const Config& c : {dion, muon})
    for (const ShapeSet& s : {ShapeSet{"4096x4096", {{4096, 4096}}}, ShapeSet{"8192x2048", {{8192, 2048}}}}) {
      Case k;
      k.cfg = c;
      k.dtype = DION_DTYPE_FP32;
      k.set = s;
      k.steps = 3;
      k.large = true;
      v.push_back(k);
    }
  return v;
}

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  return sanitize(i.param.cfg.label + "_" + dtype_name(i.param.dtype) + "_" + i.param.set.label);
}

dion_group_options_t make_options(const Config& c) {
  dion_group_options_t g = group_options(c.algo);
  g.lr = 0.01;
  // 0.1 (not the default 0.01) so that weight decay, and the cautious mask,
  // move X by ~1e-3 relative per step: visible above every tolerance here.
  g.weight_decay = 0.1;
  g.qr_method = c.qr;
  g.cqr_warmup_steps = c.cqr_warmup;
  g.rank_fraction = c.rank_fraction;
  g.power_iters = c.power_iters;
  g.orthogonalizer = c.ortho;
  g.nesterov = c.nesterov;
  g.cautious_wd = c.cautious_wd;
  g.fraction = c.fraction;
  return g;
}

// The fp32 floor of the algorithm (file comment).
double fp32_floor(const Case& c) {
  if (!is_matrix_algo(c.cfg.algo)) return 2e-6;
  int64_t k = 1;
  for (const auto& s : c.set.shapes) k = std::max({k, s[s.size() - 1], s[s.size() - 2]});
  return 1e-4 * std::max(1.0, std::sqrt(static_cast<double>(k) / 256.0));
}

// ------------------------------------------------------------ comparison --

struct Verdict {
  double err = 0, bound = 0;
  int64_t n = 0, differing = 0, flips = 0;
  bool finite = true;
  std::string worst;
};

struct BoundSpec {
  double tol = 0;             // relative to the change (or to the value)
  double ulps = 0;            // storage-rounding slack, in ulps of the dtype per element
  double slop_ops = 0;        // fp32 operations on the value itself, each <= 2^-24 relative
  double flip_threshold = 0;  // > 0: elements differing by more are flips (Lion), left out
};

// ||got - want|| <= tol ||want - base|| + ulps ||ulp(max(|got|, |want|))|| +
// slop_ops 2^-24 ||want|| (base NULL: tol ||want||). The ulp norm runs over
// the elements that differ only: an element that agrees contributes nothing
// to the left side, so this is as rigorous as summing over all of them, and
// elements an update did not touch (Dion2's unselected rows) add no slack.
Verdict measure(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>* base,
                dion_dtype_t dt, const BoundSpec& b) {
  Verdict v;
  v.n = static_cast<int64_t>(want.size());
  double err2 = 0, scale2 = 0, ulp2 = 0, want2 = 0;
  std::vector<std::pair<double, size_t>> worst;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    const double d = got[i] - want[i];
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) {
      v.finite = false;
      continue;
    }
    if (b.flip_threshold > 0 && std::fabs(d) > b.flip_threshold) {
      ++v.flips;
      continue;
    }
    err2 += d * d;
    const double s = base ? want[i] - (*base)[i] : want[i];
    scale2 += s * s;
    if (d != 0) {
      ++v.differing;
      const double u = ulp(dt, std::max(std::fabs(got[i]), std::fabs(want[i])));
      ulp2 += u * u;
    }
    want2 += want[i] * want[i];
    worst.push_back({std::fabs(d), i});
  }
  v.err = std::sqrt(err2);
  v.bound = b.tol * std::sqrt(scale2) + b.ulps * std::sqrt(ulp2) + b.slop_ops * std::ldexp(std::sqrt(want2), -24);
  const size_t k = std::min<size_t>(3, worst.size());
  std::partial_sort(worst.begin(), worst.begin() + static_cast<std::ptrdiff_t>(k), worst.end(),
                    [](const auto& a, const auto& c) { return a.first > c.first; });
  std::ostringstream o;
  o.precision(9);
  o << "worst elements (index: cuda vs host):";
  for (size_t j = 0; j < k; ++j)
    o << " [" << worst[j].second << "] " << got[worst[j].second] << " vs " << want[worst[j].second] << ";";
  v.worst = o.str();
  return v;
}

// ||a - b|| / ||b - base|| (base NULL: / ||b||).
double rel(const std::vector<double>& a, const std::vector<double>& b, const std::vector<double>* base) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    const double s = base ? b[i] - (*base)[i] : b[i];
    den += s * s;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Dion's Q (rows x cols, row-major): flip columns of `a` to agree in sign with `ref`.
void align_columns(std::vector<double>& a, const std::vector<double>& ref, int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    double dot = 0;
    for (int64_t i = 0; i < rows; ++i)
      dot += a[static_cast<size_t>(i * cols + j)] * ref[static_cast<size_t>(i * cols + j)];
    if (dot < 0)
      for (int64_t i = 0; i < rows; ++i) a[static_cast<size_t>(i * cols + j)] = -a[static_cast<size_t>(i * cols + j)];
  }
}

// ----------------------------------------------------------------- runner --

// One tensor, held three times: for the host optimizer, the perturbed host
// twin and (in device memory) the CUDA optimizer.
struct Twin {
  std::string name;
  std::vector<int64_t> shape;
  int64_t n = 0;
  std::vector<unsigned char> host_param, host_grad, pert_param, pert_grad;
  DeviceBuffer dev_param, dev_grad;
};

// One fp32 ulp in a random direction on every element (the perturbed twin's
// gradients): the size of one fp32 rounding.
std::vector<unsigned char> perturb_fp32(const std::vector<unsigned char>& g, uint64_t seed) {
  std::vector<unsigned char> out = g;
  for (size_t i = 0; i < g.size() / 4; ++i) {
    float f;
    std::memcpy(&f, g.data() + 4 * i, 4);
    const float to =
        hash_uniform(seed, i) < 0 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
    f = std::nextafter(f, to);
    std::memcpy(out.data() + 4 * i, &f, 4);
  }
  return out;
}

class CudaVsHost : public ::testing::TestWithParam<Case> {
 protected:
  // lr_factor != 1: the CUDA optimizer's lr is multiplied by it (a planted
  // bug); the bounds are then only measured, into max_param_ratio_.
  void run(const Case& c, double lr_factor = 1.0);
  void record(double err, double bound, double* worst) {
    *worst = std::max(*worst, bound > 0 ? err / bound : (err > 0 ? HUGE_VAL : 0.0));
  }
  double max_param_ratio_ = 0, max_state_ratio_ = 0;  // max of error / bound
};

// DION_GPU_TEST_VERBOSE=1 prints every case's largest error / bound ratios.
bool verbose() {
  const char* v = std::getenv("DION_GPU_TEST_VERBOSE");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

void CudaVsHost::run(const Case& c, double lr_factor) {
  DION_REQUIRE_GPU();
  CUDA_ASSERT(cudaSetDevice(0));
  const dion_dtype_t dt = c.dtype;
  const bool lowp = dt != DION_DTYPE_FP32;
  const bool elementwise = !is_matrix_algo(c.cfg.algo);
  // The sensitivity twin (file comment) for the small fp32 matrix cases.
  const bool use_twin = !lowp && !elementwise && !c.large;
  const bool lion = c.cfg.algo == DION_ALGO_LION;
  const uint64_t lib_seed = 20240917, data_seed = 0xD1017u;
  const double floor = fp32_floor(c);
  const std::string what = c.cfg.label + " " + dtype_name(dt) + " " + c.set.label;
  const bool mutant = lr_factor != 1.0;

  Stream stream;  // declared first: it outlives the optimizer that used it
  ASSERT_NE(stream.get(), nullptr);
  Optimizer host, cuda, pert;
  ASSERT_EQ(host.create(options(DION_BACKEND_HOST, lib_seed)), DION_SUCCESS);
  ASSERT_EQ(cuda.create(options(DION_BACKEND_CUDA, lib_seed, 0)), DION_SUCCESS);
  if (use_twin) ASSERT_EQ(pert.create(options(DION_BACKEND_HOST, lib_seed)), DION_SUCCESS);

  std::vector<std::unique_ptr<Twin>> ts;
  std::vector<dion_tensor_t> dh, dc, dp;
  for (size_t i = 0; i < c.set.shapes.size(); ++i) {
    auto t = std::make_unique<Twin>();
    t->name = "vs.t" + std::to_string(i);
    t->shape = c.set.shapes[i];
    t->n = numel(t->shape);
    // |X0| <= 0.05 (see the file comment); the layout only permutes storage,
    // so the same bytes serve every backend.
    t->host_param = random_bytes(t->n, dt, data_seed + 17 * i, 0.05);
    t->pert_param = t->host_param;
    t->host_grad.assign(t->host_param.size(), 0);
    t->pert_grad = t->host_grad;
    CUDA_ASSERT(t->dev_param.allocate(t->host_param.size()));
    CUDA_ASSERT(t->dev_grad.allocate(t->host_grad.size()));
    CUDA_ASSERT(t->dev_param.upload(t->host_param));
    CUDA_ASSERT(t->dev_grad.upload(t->host_grad));
    dh.push_back(descriptor(t->name.c_str(), t->host_param.data(), t->host_grad.data(), dt, t->shape, c.set.layout));
    dc.push_back(descriptor(t->name.c_str(), t->dev_param.get(), t->dev_grad.get(), dt, t->shape, c.set.layout));
    dp.push_back(descriptor(t->name.c_str(), t->pert_param.data(), t->pert_grad.data(), dt, t->shape, c.set.layout));
    ts.push_back(std::move(t));
  }
  const dion_group_options_t g = make_options(c.cfg);
  int32_t gh = -1, gc = -1;
  DION_ASSERT_OK(host.get(), dion_add_group(host, &g, dh.data(), dh.size(), &gh));
  DION_ASSERT_OK(cuda.get(), dion_add_group(cuda, &g, dc.data(), dc.size(), &gc));
  if (use_twin) DION_ASSERT_OK(pert.get(), dion_add_group(pert, &g, dp.data(), dp.size(), nullptr));
  ASSERT_EQ(gh, 0);
  ASSERT_EQ(gc, 0);
  if (mutant) DION_ASSERT_OK(cuda.get(), dion_group_set_hparam(cuda, 0, DION_HPARAM_LR, g.lr * lr_factor));

  // Both backends enumerate the same states with the same descriptions.
  std::vector<StateData> sh = read_states(host), sc = read_states(cuda, stream.get());
  ASSERT_EQ(sh.size(), sc.size()) << what << ": state counts differ";
  ASSERT_GT(sh.size(), 0u);
  for (size_t i = 0; i < sh.size(); ++i) {
    const dion_state_info_t &a = sc[i].info, &b = sh[i].info;
    EXPECT_EQ(sc[i].name, sh[i].name) << what << ": state " << i;
    EXPECT_EQ(a.tensor, b.tensor) << what << ": state " << i;
    EXPECT_EQ(a.dtype, b.dtype) << what << ": state " << i << " " << sh[i].name;
    EXPECT_EQ(a.layout, b.layout) << what << ": state " << i << " " << sh[i].name;
    ASSERT_EQ(a.ndim, b.ndim) << what << ": state " << i << " " << sh[i].name;
    for (int d = 0; d < a.ndim; ++d) {
      EXPECT_EQ(a.global_shape[d], b.global_shape[d]) << what << ": state " << i << " dim " << d;
      EXPECT_EQ(a.local_shape[d], b.local_shape[d]) << what << ": state " << i << " dim " << d;
    }
    ASSERT_EQ(a.local_bytes, b.local_bytes) << what << ": state " << i << " " << sh[i].name;
  }
  // The initial states agree (zeros; Dion's Q: the same generator draws on
  // both backends, to within one fp32 ulp on a few elements, then rounded
  // to the dtype: 1 ulp of slack).
  for (size_t i = 0; i < sh.size(); ++i) {
    std::vector<double> want = to_values(sh[i].raw, sh[i].info.dtype), got = to_values(sc[i].raw, sc[i].info.dtype);
    const Verdict v = measure(got, want, nullptr, sh[i].info.dtype, {floor, 1, 0, 0});
    EXPECT_TRUE(v.finite && v.err <= v.bound)
        << what << ": initial state " << sh[i].name << " of tensor " << sh[i].info.tensor << ": " << v.err << " > "
        << v.bound << "; " << v.worst;
  }

  std::vector<std::vector<double>> x0;
  for (auto& t : ts) x0.push_back(to_values(t->host_param, dt));
  int64_t flips_so_far = 0;

  for (int step = 1; step <= c.steps; ++step) {
    // Fresh random gradients, the same on every backend.
    for (size_t i = 0; i < ts.size(); ++i) {
      Twin& t = *ts[i];
      // Copied into the existing buffers: the optimizers hold their addresses.
      const std::vector<unsigned char> gb = random_bytes(t.n, dt, data_seed * 1000003ull + 1009ull * step + i, 1.0);
      std::memcpy(t.host_grad.data(), gb.data(), gb.size());
      CUDA_ASSERT(t.dev_grad.upload(t.host_grad));
      if (use_twin) {
        const std::vector<unsigned char> p = perturb_fp32(t.host_grad, 77 * step + i);
        std::memcpy(t.pert_grad.data(), p.data(), p.size());
      }
    }
    // bf16 / fp16: start every step from the host's parameters and states.
    if (lowp) {
      for (auto& t : ts) CUDA_ASSERT(t->dev_param.upload(t->host_param));
      for (size_t i = 0; i < sh.size(); ++i)
        DION_ASSERT_OK(cuda.get(), dion_state_write(cuda, static_cast<int32_t>(i), sh[i].raw.data(), sh[i].raw.size(),
                                                    stream.dion()));
      CUDA_ASSERT(stream.sync());
    }
    std::vector<std::vector<double>> x_before;
    for (auto& t : ts) x_before.push_back(to_values(t->host_param, dt));
    std::vector<std::vector<double>> s_before;
    for (auto& s : sh) s_before.push_back(to_values(s.raw, s.info.dtype));

    DION_ASSERT_OK(host.get(), dion_step(host, nullptr));
    DION_ASSERT_OK(cuda.get(), dion_step(cuda, stream.dion()));
    if (use_twin) DION_ASSERT_OK(pert.get(), dion_step(pert, nullptr));
    CUDA_ASSERT(stream.sync());
    EXPECT_EQ(group_step(host, 0), step) << what;
    EXPECT_EQ(group_step(cuda, 0), step) << what << ": the CUDA group's step counter";

    // Free-running fp32: k = 2 ulps per step (one for rounding the stored X
    // differently, one for the fp32 arithmetic on X itself); single steps
    // (bf16/fp16): 1 ulp of the dtype plus 4 fp32 roundings of X.
    const double ulps = lowp ? 1.0 : 2.0 * step;
    const double slop = lowp ? 4.0 : 4.0 * step;

    // Parameters: the error of the change.
    for (size_t i = 0; i < ts.size(); ++i) {
      Twin& t = *ts[i];
      const std::vector<double> want = to_values(t.host_param, dt);
      const std::vector<double> got = to_values(t.dev_param.download(), dt);
      const std::vector<double>& base = lowp ? x_before[i] : x0[i];
      double tol = floor;
      double sens = 0;
      if (use_twin) {
        sens = rel(to_values(t.pert_param, dt), want, &base);
        tol = std::max(floor, 10.0 * sens);
      }
      if (tol > floor && step == c.steps)
        std::printf("  %s tensor %zu: fp32 sensitivity %.3g raises the tolerance to %.3g\n", what.c_str(), i, sens,
                    tol);
      BoundSpec b{tol, ulps, slop, lion ? g.lr : 0.0};
      const Verdict v = measure(got, want, &base, dt, b);
      EXPECT_TRUE(v.finite) << what << ": non-finite parameter of tensor " << i << " after step " << step;
      record(v.err, v.bound, &max_param_ratio_);
      if (!mutant)
        EXPECT_LE(v.err, v.bound) << what << ": parameter of tensor " << i << " (" << shape_str(t.shape)
                                  << ") after step " << step << ": ||X_cuda - X_host|| = " << v.err << " > bound "
                                  << v.bound << " (tol " << tol << ", sens " << sens << ", floor " << floor << ")\n  "
                                  << v.worst;
      if (mutant) continue;
      if (lion) {
        // Flips accumulate in free-running runs; single steps count anew.
        const int64_t allowed = 1 + static_cast<int64_t>(1e-4 * static_cast<double>(t.n) * (lowp ? 1 : step));
        EXPECT_LE(v.flips, allowed) << what << ": " << v.flips << " Lion sign flips in tensor " << i << " after step "
                                    << step;
        flips_so_far = std::max(flips_so_far, v.flips);
      } else {
        EXPECT_EQ(v.flips, 0);
      }
      if (lowp && elementwise)
        EXPECT_LE(v.differing, 1 + t.n / 100)
            << what << ": " << v.differing << " of " << t.n << " parameter elements of tensor " << i
            << " differ after step " << step << " (round-to-nearest-even on both sides differs on < 1e-3)";
    }

    // States: relative to the state itself.
    std::vector<StateData> nh = read_states(host), nc = read_states(cuda, stream.get());
    std::vector<StateData> np;
    if (use_twin) np = read_states(pert);
    ASSERT_EQ(nh.size(), nc.size());
    for (size_t i = 0; i < nh.size(); ++i) {
      const dion_state_info_t& info = nh[i].info;
      const std::vector<double> want = to_values(nh[i].raw, info.dtype);
      std::vector<double> got = to_values(nc[i].raw, info.dtype);
      std::vector<double> pv;
      if (use_twin) pv = to_values(np[i].raw, info.dtype);
      if (nh[i].name == "Q" && info.ndim == 2) {
        align_columns(got, want, info.local_shape[0], info.local_shape[1]);
        if (use_twin) align_columns(pv, want, info.local_shape[0], info.local_shape[1]);
      }
      double tol = floor, sens = 0;
      if (use_twin) {
        sens = rel(pv, want, nullptr);
        tol = std::max(floor, 10.0 * sens);
        if (tol > floor && step == c.steps)
          std::printf("  %s state %s of tensor %d: fp32 sensitivity %.3g raises the tolerance to %.3g\n", what.c_str(),
                      nh[i].name.c_str(), info.tensor, sens, tol);
      }
      // A state is a fresh fp32 result rounded once per step (single steps:
      // once): `ulps` as for X, no extra arithmetic on a large base value.
      const Verdict v = measure(got, want, nullptr, info.dtype, {tol, lowp ? 1.0 : 1.0 * step, 0, 0});
      EXPECT_TRUE(v.finite) << what << ": non-finite state " << nh[i].name << " of tensor " << info.tensor;
      record(v.err, v.bound, &max_state_ratio_);
      if (mutant) continue;
      EXPECT_LE(v.err, v.bound) << what << ": state " << nh[i].name << " of tensor " << info.tensor << " after step "
                                << step << ": ||S_cuda - S_host|| = " << v.err << " > bound " << v.bound << " (tol "
                                << tol << ", sens " << sens << ")\n  " << v.worst;
      if (lowp && elementwise)
        EXPECT_LE(v.differing, 1 + v.n / 100)
            << what << ": " << v.differing << " of " << v.n << " elements of state " << nh[i].name << " of tensor "
            << info.tensor << " differ after step " << step;
    }
    sh = std::move(nh);
    if (::testing::Test::HasFailure()) return;  // one failing step is enough to read
  }
  if (lion && flips_so_far > 0) std::printf("  %s: %lld Lion sign flip(s)\n", what.c_str(), (long long)flips_so_far);
  if (verbose())
    std::printf("  %s%s: max error/bound: parameters %.3g, states %.3g\n", what.c_str(), mutant ? " (mutant)" : "",
                max_param_ratio_, max_state_ratio_);
}

TEST_P(CudaVsHost, SameResultsAsHostBackend) { run(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Small, CudaVsHost, ::testing::ValuesIn(small_cases()), case_name);

// The large fp32 matrices (slow on the host side: 10-35 s per case for the
// host BLAS, measured on 16 cores).
class CudaVsHostLarge : public CudaVsHost {};
TEST_P(CudaVsHostLarge, SameResultsAsHostBackend) { run(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Large, CudaVsHostLarge, ::testing::ValuesIn(large_cases()), case_name);

// The bounds above are not vacuous: the same comparison, with the CUDA
// optimizer's learning rate off by 0.1% (fp32) or 25% (bf16 / fp16), must
// exceed them. (bf16 is the weak case: with |X| ~ 0.025 one bf16 ulp is ~7%
// of a Muon-size update, so the bound, which allows one ulp on every element
// that differs, only resolves lr errors of ~10% and more.)
class CudaVsHostMutant : public CudaVsHost {};
TEST_P(CudaVsHostMutant, ComparisonDetectsAWrongLearningRate) {
  const Case c = GetParam();
  const double factor = c.dtype == DION_DTYPE_FP32 ? 1.001 : 1.25;
  run(c, factor);
  if (IsSkipped() || HasFatalFailure()) return;
  EXPECT_GT(max_param_ratio_, 1.0) << "a CUDA run with lr x " << factor
                                   << " stays within the bounds: they cannot see such a bug";
}

std::vector<Case> mutant_cases() {
  std::vector<Case> v;
  std::vector<std::string> seen;
  for (const Config& c : configs()) {
    // The first (default-most) configuration of each algorithm.
    if (std::find(seen.begin(), seen.end(), algo_name(c.algo)) != seen.end()) continue;
    seen.push_back(algo_name(c.algo));
    for (dion_dtype_t dt : {DION_DTYPE_FP32, DION_DTYPE_BF16, DION_DTYPE_FP16}) {
      Case k;
      k.cfg = c;
      k.dtype = dt;
      k.set = {"48x32", {{48, 32}}};
      k.steps = dt == DION_DTYPE_FP32 ? 5 : 3;
      v.push_back(k);
    }
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(PlantedBug, CudaVsHostMutant, ::testing::ValuesIn(mutant_cases()), case_name);

}  // namespace
