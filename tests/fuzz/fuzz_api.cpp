// SPDX-License-Identifier: MIT
// libFuzzer harness over the public C API (include/dion.h), host backend.
//
// The input is decoded into a sequence of API calls on up to two optimizer
// handles: dion_create with fuzzed options, dion_add_group with fuzzed group
// options and 0-4 fuzzed tensor descriptors, set/get_hparam, set/get_step,
// tensor_rebind, step, state_info/read/write/find, the query calls, and
// dion_destroy. Every buffer handed to the library is allocated at exactly the
// size the call implies (parameters and gradients: the descriptor's local
// element count times the dtype size; state buffers: the fuzzed `bytes`;
// option structs: their fuzzed struct_size), so AddressSanitizer reports any
// read or write past what the caller provided. Beyond memory safety and UB
// (ASan + UBSan, -fno-sanitize-recover=all), the harness aborts when the
// library breaks a documented contract (see check()):
//   - every failing call returns a known status and leaves a non-empty
//     dion_last_error message;
//   - a failed dion_create leaves *optimizer NULL;
//   - a failed dion_add_group adds no group, tensor or state and changes no
//     parameter; a failed dion_step changes no parameter;
//   - descriptors the header says are invalid (ndim outside [0, 4], a negative
//     dim, a global element count that overflows int64, an unknown dtype,
//     COL_MAJOR with ndim != 2, Dion with ndim != 2, a Muon-family tensor with
//     ndim < 2) and group options outside their documented ranges are refused;
//   - set_hparam refuses non-finite, negative and (betas) > 1 values, and a
//     value it accepts reads back unchanged; set_step likewise for steps;
//   - with skip_nonfinite, a step whose gradients hold NaN/Inf changes no
//     parameter and reports last_skipped = 1; a tensor with a NULL gradient
//     is never written by a step;
//   - state_read after state_write returns the written bytes; a buffer smaller
//     than local_bytes is refused;
//   - the communicator calls refuse NULL / uninitialised input and leave
//     *comm NULL.
//
// Input format (all multi-byte integers little-endian; reading past the end
// yields zeros, so every input is valid). tests/fuzz/make_corpus.py writes
// this format; keep the two in sync.
//   I32 := tag u8: tag < 0xF0 -> tag - 8; F0 -> INT32_MIN (DION_UNSET_INT);
//          F1 -> INT32_MAX; F2 -> INT32_MIN + 1; F3 -> 65536; else u32 raw
//   I64 := tag u8: tag < 0xE0 -> tag - 8; E0 INT64_MAX; E1 INT64_MIN; E2 2^31;
//          E3 2^32; E4 2^62; E5 3037000500 (its square overflows int64);
//          E6 2^40; E7 2^20 + 1; E8 65536; E9 65537; EA INT32_MAX;
//          EB u16 raw; else u64 raw
//   F64 := tag u8: tag < 0xC0 -> kDoubles[tag % size]; else u64 raw bits
//   FILL := mode u8 % 6: 0 zeros | 1 seed u8, scale F64: hashed values in
//           [-scale, scale) | 2 len u8, bytes: raw bytes, repeated |
//           3 value F64: constant | 4 seed u8, index u32, value F64: hashed
//           values with one poisoned element | 5 seed u8: rank-1 outer product
//   STR := len u8 % (max + 1), then len bytes (NUL read as '_')
//   op := opcode u8 % 15, slot u8 (& 1: which of two optimizers), then:
//    0 create      flags u8 (bit 0: NULL options), seed u64, n u8 % 6, n x
//                  (field u8 % 7, value: struct_size I64, the others I32)
//    1 destroy
//    2 add_group   algorithm u8 % 7 (its defaults), n u8 % 8, n x (field
//                  u8 % 29, value; see override_group_field), count u8 % 5,
//                  flags u8 (bit 0 NULL tensors, bit 1 NULL group_index,
//                  bit 2 a stride I64 follows), count x TENSOR
//      TENSOR := sel u8 (ndim (sel & 7) % 5, bit 3 COL_MAJOR), 4 x u8 (dim
//                % 64 + 1), param dtype u8 % 3, grad dtype u8 % 4 - 1, flags
//                u8 (bit 0 a name STR follows, bit 1 NULL grad), n u8 % 5,
//                n x (field u8 % 16, value; see add_group), FILL param, FILL grad
//    3 set_hparam  group I32, hparam I32, value F64
//    4 get_hparam  group I32, hparam I32, u8 (bit 0 NULL output)
//    5 set_step    group I32, step I64
//    6 rebind      tensor I32, flags u8 (bit 0 NULL param, 1 NULL grad,
//                  2 / 3 misaligned param / grad), FILL grad
//    7 step
//    8 state_info  index I32, size u8 % 4 (sizeof | minimal | I64 |
//                  sizeof + u8 % 64), u8 (bit 0 NULL info)
//    9 state_read, 10 state_write: index I32, bytes u8 % 4 (local_bytes |
//                  local_bytes + (int8) u8 % 5 | I64 | 0), u8 (bit 0 NULL
//                  buffer), write: FILL
//   11 state_find  tensor I32, name u8 % 6 (momentum, Q, variance,
//                  variance_neuron, NULL, STR), u8 (bit 0 NULL index)
//   12 queries     NULL-output bits u8, mesh I32, group I32
//   13 fill_grad   tensor u8, FILL
//   14 misc        status I32, algorithm I32, then for the communicator
//                  calls: nranks I32, rank I32, device I32, Fortran comm I32
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dion.h"

namespace {

// ------------------------------------------------------------------ input --

class Reader {
 public:
  Reader(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool done() const { return i_ >= n_; }
  uint8_t u8() { return i_ < n_ ? d_[i_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() {
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= static_cast<uint32_t>(u8()) << (8 * k);
    return v;
  }
  uint64_t u64() {
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= static_cast<uint64_t>(u8()) << (8 * k);
    return v;
  }
  int32_t i32() {
    const uint8_t t = u8();
    if (t < 0xF0) return static_cast<int32_t>(t) - 8;
    switch (t) {
      case 0xF0: return std::numeric_limits<int32_t>::min();
      case 0xF1: return std::numeric_limits<int32_t>::max();
      case 0xF2: return std::numeric_limits<int32_t>::min() + 1;
      case 0xF3: return 65536;
      default: return static_cast<int32_t>(u32());
    }
  }
  int64_t i64() {
    const uint8_t t = u8();
    if (t < 0xE0) return static_cast<int64_t>(t) - 8;
    switch (t) {
      case 0xE0: return std::numeric_limits<int64_t>::max();
      case 0xE1: return std::numeric_limits<int64_t>::min();
      case 0xE2: return int64_t(1) << 31;
      case 0xE3: return int64_t(1) << 32;
      case 0xE4: return int64_t(1) << 62;
      case 0xE5: return 3037000500LL;
      case 0xE6: return int64_t(1) << 40;
      case 0xE7: return (int64_t(1) << 20) + 1;
      case 0xE8: return 65536;
      case 0xE9: return 65537;
      case 0xEA: return 2147483647;
      case 0xEB: return u16();
      default: return static_cast<int64_t>(u64());
    }
  }
  double f64() {
    static const double kDoubles[] = {0.0,
                                      -0.0,
                                      1.0,
                                      -1.0,
                                      0.5,
                                      0.01,
                                      0.95,
                                      0.9,
                                      1e-8,
                                      1e-30,
                                      1e30,
                                      1e300,
                                      std::numeric_limits<double>::quiet_NaN(),
                                      HUGE_VAL,
                                      -HUGE_VAL,
                                      DBL_MIN,
                                      std::numeric_limits<double>::denorm_min(),
                                      DBL_MAX,
                                      1.25,
                                      64.0,
                                      std::nextafter(64.0, 100.0),
                                      1e-3,
                                      2.0,
                                      0.25,
                                      std::nextafter(1.0, 0.0),
                                      std::nextafter(1.0, 2.0),
                                      -1e-300,
                                      100.0,
                                      1e10,
                                      -std::numeric_limits<double>::quiet_NaN(),
                                      0.999,
                                      1e-38,
                                      65504.0,
                                      3.4e38,
                                      1e39};
    const uint8_t t = u8();
    if (t < 0xC0) return kDoubles[t % (sizeof(kDoubles) / sizeof(kDoubles[0]))];
    const uint64_t bits = u64();
    double v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  std::string str(size_t max_len) {
    const size_t n = u8() % (max_len + 1);
    std::string s;
    for (size_t k = 0; k < n; ++k) {
      char c = static_cast<char>(u8());
      s.push_back(c ? c : '_');  // the API takes NUL-terminated names
    }
    return s;
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t i_ = 0;
};

// ---------------------------------------------------------------- oracles --

// A contract violation: print it and abort so libFuzzer saves the input.
#define check(cond, ...)                                                      \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "fuzz_api: contract violated at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                      \
      std::fprintf(stderr, "\n");                                             \
      std::abort();                                                           \
    }                                                                         \
  } while (0)

// DION_FUZZ_TRACE=1: print every call's status and error (to see what a
// corpus file exercises: fuzz_api FILE).
bool g_trace = false;

// Every failure is a known status with a message, on the handle and on the thread.
void check_failure(dion_status_t s, dion_optimizer_t h, const char* call) {
  if (g_trace) std::fprintf(stderr, "  %-26s %2d %s\n", call, s, s ? dion_last_error(nullptr) : "");
  if (s == DION_SUCCESS) return;
  check(s >= DION_ERROR_INVALID_ARGUMENT && s <= DION_ERROR_INTERNAL, "%s returned unknown status %d", call, s);
  check(s != DION_ERROR_INTERNAL, "%s: internal error: %s", call, dion_last_error(nullptr));
  const char* t = dion_last_error(nullptr);
  check(t && *t, "%s failed with %d but dion_last_error(NULL) is empty", call, s);
  if (h) {
    const char* m = dion_last_error(h);
    check(m && *m, "%s failed with %d but dion_last_error(handle) is empty", call, s);
  }
  const char* ss = dion_status_string(s);
  check(ss && *ss, "dion_status_string(%d) is empty", s);
}

// ---------------------------------------------------------------- dtypes --

bool dtype_ok(int32_t dt) { return dt == DION_DTYPE_FP32 || dt == DION_DTYPE_BF16 || dt == DION_DTYPE_FP16; }
size_t esize(int32_t dt) { return dt == DION_DTYPE_FP32 ? 4 : 2; }

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;                     // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;                    // overflow -> Inf
  if (a < 0x33000001u) return sign;                              // underflow -> 0
  const int e = static_cast<int>(a >> 23) - 127 + 15;
  uint32_t m = (a & 0x7fffffu) | 0x800000u;
  if (e <= 0) {                                                  // subnormal
    const int sh = 14 - e;
    uint32_t r = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (static_cast<uint32_t>(e) << 10) | ((m >> 13) & 0x3ffu);
  const uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) ++r;
  return static_cast<uint16_t>(sign | r);
}

void put(void* buf, int32_t dt, size_t i, float v) {
  if (dt == DION_DTYPE_FP32) {
    std::memcpy(static_cast<char*>(buf) + 4 * i, &v, 4);
  } else {
    const uint16_t h = dt == DION_DTYPE_BF16 ? to_bf16(v) : to_fp16(v);
    std::memcpy(static_cast<char*>(buf) + 2 * i, &h, 2);
  }
}

bool any_nonfinite(const void* buf, int32_t dt, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (dt == DION_DTYPE_FP32) {
      uint32_t u;
      std::memcpy(&u, static_cast<const char*>(buf) + 4 * i, 4);
      if ((u & 0x7f800000u) == 0x7f800000u) return true;
    } else {
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(buf) + 2 * i, 2);
      if (dt == DION_DTYPE_BF16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u) return true;
    }
  }
  return false;
}

float hashf(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
}

// A fill spec is always read whole, whether or not there is a buffer to
// fill, so the input's layout does not depend on what the library accepted.
struct FillSpec {
  uint8_t mode = 0, seed = 0;
  float value = 0;
  uint32_t at = 0;
  size_t len = 1;
  uint8_t pat[64] = {0};
};

FillSpec read_fill(Reader& in) {
  FillSpec f;
  f.mode = in.u8() % 6;
  switch (f.mode) {
    case 1:
      f.seed = in.u8();
      f.value = static_cast<float>(in.f64());  // the scale
      break;
    case 2:
      f.len = in.u8() % 64 + 1;
      for (size_t k = 0; k < f.len; ++k) f.pat[k] = in.u8();
      break;
    case 3: f.value = static_cast<float>(in.f64()); break;
    case 4:
      f.seed = in.u8();
      f.at = in.u32();
      f.value = static_cast<float>(in.f64());
      break;
    case 5: f.seed = in.u8(); break;
    default: break;
  }
  return f;
}

// Fills n elements of dtype dt (an invalid dtype gets zeros).
void fill(Reader& in, void* buf, int32_t dt, size_t n) {
  const FillSpec f = read_fill(in);
  if (!buf || n == 0) return;
  const size_t bytes = n * (dtype_ok(dt) ? esize(dt) : 4);
  if (!dtype_ok(dt) || f.mode == 0) {
    std::memset(buf, 0, bytes);
    return;
  }
  switch (f.mode) {
    case 1:
      for (size_t i = 0; i < n; ++i) put(buf, dt, i, f.value * hashf(f.seed, i));
      break;
    case 2:
      for (size_t b = 0; b < bytes; ++b) static_cast<uint8_t*>(buf)[b] = f.pat[b % f.len];
      break;
    case 3:
      for (size_t i = 0; i < n; ++i) put(buf, dt, i, f.value);
      break;
    case 4:
      for (size_t i = 0; i < n; ++i) put(buf, dt, i, hashf(f.seed, i));
      put(buf, dt, f.at % n, f.value);
      break;
    default:  // a rank-1 pattern over an 8-column view
      for (size_t i = 0; i < n; ++i) put(buf, dt, i, hashf(f.seed, i / 8) * hashf(f.seed + 1u, i % 8));
      break;
  }
}

uint64_t fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// ------------------------------------------------------------ known bugs --

// Inputs that reach a bug already reported are steered around here, so that
// a bounded fuzzing run in CI reports new problems only; drop an entry once
// its bug is fixed.

// (None at the moment: the two bugs this harness found, an overflowing
// set_step and a misaligned tensor stride, are fixed and have regression
// tests in tests/unit/test_reliability_api.cpp.)

// ------------------------------------------------------------ the harness --

constexpr size_t kMaxElems = 65536;       // per tensor: larger descriptors are not passed
constexpr size_t kMaxTotalElems = 262144; // per input, to keep an execution fast
constexpr int kMaxSteps = 12;             // per input
constexpr int32_t kMaxPowerIters = 16;    // larger values are legal but take a step proportionally long

// A caller buffer: `bytes` usable bytes starting `off` bytes into a malloc'd block.
struct Buf {
  char* base = nullptr;
  size_t bytes = 0, off = 0;
  void* ptr() const { return base ? base + off : nullptr; }
  void alloc(size_t b, size_t o) {
    bytes = b;
    off = o;
    base = static_cast<char*>(std::malloc(b + o ? b + o : 1));
  }
  void release() {
    std::free(base);
    base = nullptr;
  }
};

struct HTensor {
  size_t numel = 0;
  int32_t pdt = DION_DTYPE_FP32, gdt = DION_DTYPE_FP32;
  Buf param, grad;  // grad.base == nullptr: no gradient
  bool has_grad() const { return grad.base != nullptr; }
};

struct Slot {
  dion_optimizer_t h = nullptr;
  int32_t skip_nonfinite = 1;
  std::vector<HTensor> tensors;
  int32_t groups = 0;
  int32_t states = 0;
};

class Harness {
 public:
  explicit Harness(Reader& in) : in_(in) {}
  ~Harness() {
    for (Slot& s : slots_) destroy(s);
  }
  void run();

 private:
  enum Op {
    kCreate, kDestroy, kAddGroup, kSetHparam, kGetHparam, kSetStep, kRebind, kStep, kStateInfo, kStateRead,
    kStateWrite, kStateFind, kQueries, kFillGrad, kMisc, kNumOps
  };

  Slot& slot() { return slots_[in_.u8() & 1]; }
  void destroy(Slot& s);
  void create(Slot& s);
  void add_group(Slot& s);
  void set_hparam(Slot& s);
  void get_hparam(Slot& s);
  void set_step(Slot& s);
  void rebind(Slot& s);
  void step(Slot& s);
  void state_info(Slot& s);
  void state_rw(Slot& s, bool write);
  void state_find(Slot& s);
  void queries(Slot& s);
  void fill_grad(Slot& s);
  void misc(Slot& s);
  uint64_t param_hash(const Slot& s) const {
    uint64_t h = 1469598103934665603ull;
    for (const HTensor& t : s.tensors) h = fnv(t.param.ptr(), t.param.bytes, h);
    return h;
  }
  bool take_elems(size_t n) {
    if (n > kMaxTotalElems - total_elems_) return false;
    total_elems_ += n;
    return true;
  }

  Reader& in_;
  Slot slots_[2];
  size_t total_elems_ = 0;
  int steps_ = 0, creates_ = 0, add_groups_ = 0;
};

void Harness::destroy(Slot& s) {
  if (s.h) {
    const dion_status_t st = dion_destroy(s.h);
    check(st == DION_SUCCESS, "dion_destroy failed: %d", st);
  }
  s.h = nullptr;
  for (HTensor& t : s.tensors) {
    t.param.release();
    t.grad.release();
  }
  s.tensors.clear();
  s.groups = s.states = 0;
}

void Harness::create(Slot& s) {
  destroy(s);
  if (++creates_ > 6) return;
  const uint8_t flags = in_.u8();
  dion_options_t o;
  check(dion_options_init(&o) == DION_SUCCESS, "dion_options_init");
  o.seed = in_.u64();
  const uint8_t n_over = in_.u8() % 6;
  for (uint8_t k = 0; k < n_over; ++k) {
    switch (in_.u8() % 7) {
      case 0: o.struct_size = static_cast<size_t>(in_.i64()); break;
      case 1: o.abi_version = static_cast<uint32_t>(in_.i32()); break;
      case 2: o.backend = in_.i32(); break;
      case 3: o.device = in_.i32(); break;
      case 4: o.replicate_grad_sync = in_.i32(); break;
      case 5: o.reserved0 = in_.i32(); break;
      default: o.skip_nonfinite = in_.i32(); break;
    }
  }
  // Host only: the CUDA backend is not what this harness is about, and a
  // build with CUDA must not touch a device here.
  if (o.backend == DION_BACKEND_CUDA) o.backend = DION_BACKEND_HOST;
  // The options as the library must see them: defaults past struct_size.
  dion_options_t eff;
  dion_options_init(&eff);
  const size_t ss = o.struct_size;
  const bool size_ok = ss >= sizeof(size_t) + sizeof(uint32_t) && ss <= sizeof(dion_options_t);
  if (size_ok) std::memcpy(&eff, &o, ss);
  // The caller's struct occupies exactly struct_size bytes (at least the
  // struct_size field itself; sizes beyond 64 KiB get the whole struct).
  const size_t alloc = ss < sizeof(size_t) ? sizeof(size_t) : ss > 65536 ? sizeof(dion_options_t) : ss;
  std::vector<char> raw(alloc, 0);
  std::memcpy(raw.data(), &o, alloc < sizeof(o) ? alloc : sizeof(o));
  Buf b;
  b.alloc(alloc, 0);
  std::memcpy(b.ptr(), raw.data(), alloc);
  dion_optimizer_t h = reinterpret_cast<dion_optimizer_t>(uintptr_t(0x1));  // must be overwritten
  const bool null_opts = flags & 1;
  const dion_status_t st = dion_create(&h, null_opts ? nullptr : static_cast<const dion_options_t*>(b.ptr()));
  b.release();
  check_failure(st, nullptr, "dion_create");
  if (st != DION_SUCCESS) {
    check(h == nullptr, "failed dion_create left *optimizer = %p", static_cast<void*>(h));
  } else {
    check(h != nullptr, "dion_create succeeded with a NULL handle");
  }
  if (!null_opts) {
    auto unset_or = [](int32_t v, int32_t d) { return v == DION_UNSET_INT ? d : v; };
    const int32_t skip = unset_or(eff.skip_nonfinite, 1);
    const int32_t sync = unset_or(eff.replicate_grad_sync, 1);
    const int32_t backend = unset_or(eff.backend, DION_BACKEND_HOST);
    const bool must_fail = !size_ok || eff.abi_version != DION_ABI_VERSION || eff.reserved0 != 0 ||
                           (skip != 0 && skip != 1) || (sync != 0 && sync != 1) ||
                           (backend != DION_BACKEND_HOST && backend != DION_BACKEND_CUDA);
    if (must_fail) check(st != DION_SUCCESS, "dion_create accepted invalid options (struct_size %zu)", ss);
    s.skip_nonfinite = skip;
  } else {
    s.skip_nonfinite = 1;
  }
  if (st == DION_SUCCESS) s.h = h;
}

// Group option fields a fuzzed override can set, in dion_group_options_t order.
void override_group_field(Reader& in, dion_group_options_t& o) {
  switch (in.u8() % 29) {
    case 0: o.struct_size = static_cast<size_t>(in.i64()); break;
    case 1: o.abi_version = static_cast<uint32_t>(in.i32()); break;
    case 2: o.algorithm = in.i32(); break;
    case 3: o.lr = in.f64(); break;
    case 4: o.weight_decay = in.f64(); break;
    case 5: o.mu = in.f64(); break;
    case 6: o.beta1 = in.f64(); break;
    case 7: o.beta2 = in.f64(); break;
    case 8: o.epsilon = in.f64(); break;
    case 9: o.rank_fraction = in.f64(); break;
    case 10: o.rank_multiple_of = in.i32(); break;
    case 11: o.power_iters = in.i32(); break;
    case 12: o.qr_method = in.i32(); break;
    case 13: o.cqr_warmup_steps = in.i32(); break;
    case 14: o.oversample = in.f64(); break;
    case 15: o.orthogonalizer = in.i32(); break;
    case 16: o.ortho_steps = in.i32(); break;
    case 17: o.nesterov = in.i32(); break;
    case 18: o.adjust_lr = in.i32(); break;
    case 19: o.cautious_wd = in.i32(); break;
    case 20: o.fraction = in.f64(); break;
    case 21: o.ef_decay = in.f64(); break;
    case 22: o.selection_scope = in.i32(); break;
    case 23: o.muon_beta2 = in.f64(); break;
    case 24: o.flatten = in.i32(); break;
    case 25: o.momentum_dtype = in.i32(); break;
    case 26: o.q_dtype = in.i32(); break;
    case 27: o.variance_dtype = in.i32(); break;
    default: o.matmul_precision = in.i32(); break;
  }
}

// Options the header documents as invalid: an unknown algorithm, negative lr /
// weight_decay / mu, rank_fraction or fraction outside (0, 1] (NaN included),
// a bad struct_size / abi_version.
bool group_options_invalid(const dion_group_options_t& o, bool size_ok) {
  if (!size_ok || o.abi_version != DION_ABI_VERSION) return true;
  if (o.algorithm < DION_ALGO_DION || o.algorithm > DION_ALGO_LION) return true;
  auto neg_or_nan = [](double v) { return !(v >= 0); };
  auto not_unit = [](double v) { return !(v > 0 && v <= 1); };
  return neg_or_nan(o.lr) || neg_or_nan(o.weight_decay) || neg_or_nan(o.mu) || not_unit(o.rank_fraction) ||
         not_unit(o.fraction);
}

// How the harness can hand a descriptor to the library.
enum class Size { kSmall, kMustFail, kTooBig };

void Harness::add_group(Slot& s) {
  if (++add_groups_ > 10) return;
  // Group options: an algorithm's defaults plus fuzzed overrides.
  const uint8_t a = in_.u8();
  dion_group_options_t o;
  check(dion_group_options_init(&o, static_cast<dion_algorithm_t>(a % 7)) == DION_SUCCESS, "group_options_init");
  const uint8_t n_over = in_.u8() % 8;
  for (uint8_t k = 0; k < n_over; ++k) override_group_field(in_, o);
  dion_group_options_t eff;
  dion_group_options_init(&eff, DION_ALGO_DION);
  const size_t oss = o.struct_size;
  const bool osize_ok = oss >= sizeof(size_t) + sizeof(uint32_t) && oss <= sizeof(dion_group_options_t);
  if (osize_ok) std::memcpy(&eff, &o, oss);
  const bool opts_invalid = group_options_invalid(eff, osize_ok);
  // DION_UNSET_INT means the default (1) for power_iters.
  const int32_t power_iters = eff.power_iters == DION_UNSET_INT ? 1 : eff.power_iters;

  const uint8_t count = in_.u8() % 5;
  const uint8_t flags = in_.u8();
  size_t stride = sizeof(dion_tensor_t);
  if (flags & 4) stride = static_cast<size_t>(in_.i64());

  std::vector<dion_tensor_t> descs(count);
  std::vector<HTensor> built(count);
  std::vector<std::string> names(count);
  // Why the call must fail (nullptr: it may succeed).
  const char* must_fail = opts_invalid ? "group options out of their documented range"
                          : ((flags & 1) && count > 0) ? "tensors is NULL with count > 0"
                                                       : nullptr;
  bool skip = false;
  // The library reads the array's stride from tensors[0].struct_size.
  const size_t min_stride = offsetof(dion_tensor_t, inner_extent) + sizeof(int64_t);
  bool stride_ok = stride >= min_stride && stride <= 4096;
  for (size_t i = 0; i < count; ++i) {
    dion_tensor_t& d = descs[i];
    dion_tensor_init(&d);
    d.struct_size = stride;
    const uint8_t shape_sel = in_.u8();
    d.ndim = (shape_sel & 7) % 5;
    for (int k = 0; k < DION_MAX_DIMS; ++k) d.shape[k] = in_.u8() % 64 + 1;
    d.param_dtype = in_.u8() % 3;
    d.grad_dtype = static_cast<int32_t>(in_.u8() % 4) - 1;
    d.layout = (shape_sel >> 3) & 1;
    const uint8_t tflags = in_.u8();
    if (tflags & 1) {
      names[i] = in_.str(24);
      d.name = names[i].c_str();
    }
    const uint8_t t_over = in_.u8() % 5;
    bool null_param = false, null_grad = (tflags & 2) != 0;
    for (uint8_t k = 0; k < t_over; ++k) {
      switch (in_.u8() % 16) {
        case 0: d.ndim = in_.i32(); break;
        case 1: d.shape[0] = in_.i64(); break;
        case 2: d.shape[1] = in_.i64(); break;
        case 3: d.shape[2] = in_.i64(); break;
        case 4: d.shape[3] = in_.i64(); break;
        case 5: d.param_dtype = in_.i32(); break;
        case 6: d.grad_dtype = in_.i32(); break;
        case 7: d.layout = in_.i32(); break;
        case 8: d.outer_shard_dim = in_.i32(); break;
        case 9: d.inner_shard_dim = in_.i32(); break;
        case 10: d.outer_offset = in_.i64(); break;
        case 11: d.outer_extent = in_.i64(); break;
        case 12: d.inner_offset = in_.i64(); break;
        case 13: d.inner_extent = in_.i64(); break;
        case 14: d.struct_size = static_cast<size_t>(in_.i64()); break;
        default: null_param = true; break;
      }
    }
    if (i == 0) {
      stride = d.struct_size;
      stride_ok = stride >= min_stride && stride <= 4096;
      if (!stride_ok) must_fail = "tensors[0].struct_size is not a dion_tensor_t size";
    } else if (d.struct_size != stride) {
      must_fail = "a struct_size differs from tensors[0]'s";
    }
    // The descriptor as the library must read it: defaults past the stride.
    dion_tensor_t e;
    dion_tensor_init(&e);
    if (stride_ok) std::memcpy(&e, &d, stride < sizeof(e) ? stride : sizeof(e));
    // Documented refusals.
    const bool ndim_ok = e.ndim >= 0 && e.ndim <= DION_MAX_DIMS;
    const int32_t gdt = e.grad_dtype == DION_DTYPE_UNSET ? e.param_dtype : e.grad_dtype;
    if (!ndim_ok) must_fail = "ndim outside [0, 4]";
    if (!dtype_ok(e.param_dtype) || !dtype_ok(gdt)) must_fail = "an unknown dtype";
    if (e.layout != DION_LAYOUT_ROW_MAJOR && e.layout != DION_LAYOUT_COL_MAJOR) must_fail = "an unknown layout";
    if (e.layout == DION_LAYOUT_COL_MAJOR && e.ndim != 2) must_fail = "COL_MAJOR with ndim != 2";
    if (eff.algorithm == DION_ALGO_DION && e.ndim != 2) must_fail = "Dion with ndim != 2";
    const bool matrix = eff.algorithm >= DION_ALGO_DION && eff.algorithm <= DION_ALGO_NORDION2;
    if (matrix && e.ndim < 2) must_fail = "a Muon-family tensor with ndim < 2";
    // The sizes the descriptor implies.
    Size kind = Size::kSmall;
    int64_t global = 1, local = 1;
    if (!ndim_ok) {
      kind = Size::kMustFail;
    } else {
      int64_t ls[DION_MAX_DIMS];
      for (int k = 0; k < e.ndim; ++k) ls[k] = e.shape[k];
      if (e.outer_shard_dim >= 0 && e.outer_shard_dim < e.ndim) ls[e.outer_shard_dim] = e.outer_extent;
      if (e.inner_shard_dim >= 0 && e.inner_shard_dim < e.ndim) ls[e.inner_shard_dim] = e.inner_extent;
      bool overflow = false, negative = false;
      for (int k = 0; k < e.ndim; ++k) {
        negative |= e.shape[k] < 0 || ls[k] < 0;
        if (!overflow) overflow = __builtin_mul_overflow(global, e.shape[k], &global);
        // Extents within their dims cannot overflow where the global count
        // does not: a local overflow means an extent outside the global shape.
        if (!overflow) overflow = __builtin_mul_overflow(local, ls[k], &local);
      }
      if (negative || overflow) {
        // A negative dimension or extent, an extent past its dim, or an
        // element count past int64 is never a valid tensor: the library must
        // refuse it (build_tensor's checked products).
        must_fail = negative ? "a negative dim or extent" : "an element count past int64 or an extent past its dim";
        kind = Size::kMustFail;
      } else if (global > (int64_t(1) << 40)) {
        // Beyond what libdion supports: it must refuse it rather than try to
        // allocate its state (an attempt shows as a malloc-limit crash).
        kind = Size::kMustFail;
      } else if (static_cast<uint64_t>(local) > kMaxElems) {
        kind = Size::kTooBig;
      }
    }
    if (kind == Size::kTooBig) skip = true;
    HTensor& t = built[i];
    t.pdt = e.param_dtype;
    t.gdt = gdt;
    if (kind == Size::kSmall) {
      t.numel = static_cast<size_t>(local);
      if (!take_elems(2 * t.numel)) skip = true;
    } else {
      t.numel = 0;
    }
    // Exactly the implied bytes (a 16-byte block for descriptors that must be
    // refused, so a library that accepted one and wrote to it is still caught).
    const size_t pb = kind == Size::kSmall ? t.numel * (dtype_ok(t.pdt) ? esize(t.pdt) : 4) : 16;
    const size_t gb = kind == Size::kSmall ? t.numel * (dtype_ok(t.gdt) ? esize(t.gdt) : 4) : 16;
    if (!skip) {
      t.param.alloc(pb, 0);
      if (!null_grad) t.grad.alloc(gb, 0);
    }
    fill(in_, t.param.ptr(), t.pdt, kind == Size::kSmall ? t.numel : 0);
    fill(in_, t.grad.ptr(), t.gdt, kind == Size::kSmall ? t.numel : 0);
    d.param = null_param ? nullptr : t.param.ptr();
    d.grad = t.grad.ptr();
  }
  // Dion's power iterations are unbounded by the API; a large count is legal
  // but makes one step run that many iterations.
  if (!opts_invalid && power_iters > kMaxPowerIters && eff.algorithm == DION_ALGO_DION) skip = true;
  if (skip) {
    for (HTensor& t : built) {
      t.param.release();
      t.grad.release();
    }
    return;
  }
  // Lay the descriptors out at the caller's stride in a block of exactly
  // count * stride bytes (element 0 only when the stride is invalid).
  size_t alloc = stride_ok ? count * stride : sizeof(dion_tensor_t);
  if (alloc < sizeof(size_t)) alloc = sizeof(size_t);
  Buf arr;
  arr.alloc(alloc, 0);
  std::memset(arr.ptr(), 0, alloc);
  for (size_t i = 0; i < count; ++i) {
    const size_t at = stride_ok ? i * stride : 0;
    if (!stride_ok && i > 0) break;
    size_t n = stride_ok ? (stride < sizeof(dion_tensor_t) ? stride : sizeof(dion_tensor_t))
                         : (alloc < sizeof(dion_tensor_t) ? alloc : sizeof(dion_tensor_t));
    std::memcpy(arr.base + at, &descs[i], n);
  }
  if (count == 0) std::memcpy(arr.base, &stride, sizeof(size_t));
  // The group options block: exactly struct_size bytes too.
  const size_t oalloc = oss < sizeof(size_t) ? sizeof(size_t) : oss > 65536 ? sizeof(o) : oss;
  Buf ob;
  ob.alloc(oalloc, 0);
  std::memset(ob.ptr(), 0, oalloc);
  std::memcpy(ob.ptr(), &o, oalloc < sizeof(o) ? oalloc : sizeof(o));

  int32_t groups0 = -1, tensors0 = -1, states0 = -1;
  if (s.h) {
    dion_group_count(s.h, &groups0);
    dion_tensor_count(s.h, &tensors0);
    dion_state_count(s.h, &states0);
  }
  const uint64_t h0 = param_hash(s);
  int32_t gi = -7;
  const dion_status_t st =
      dion_add_group(s.h, static_cast<const dion_group_options_t*>(ob.ptr()),
                     (flags & 1) ? nullptr : static_cast<const dion_tensor_t*>(arr.ptr()), count,
                     (flags & 2) ? nullptr : &gi);
  arr.release();
  ob.release();
  check_failure(st, s.h, "dion_add_group");
  if (!s.h) {
    check(st == DION_ERROR_INVALID_ARGUMENT, "dion_add_group(NULL) returned %d", st);
  } else if (st != DION_SUCCESS) {
    int32_t g1 = -1, t1 = -1, s1 = -1;
    dion_group_count(s.h, &g1);
    dion_tensor_count(s.h, &t1);
    dion_state_count(s.h, &s1);
    check(g1 == groups0 && t1 == tensors0 && s1 == states0,
          "failed dion_add_group changed the counts (groups %d->%d, tensors %d->%d, states %d->%d)", groups0, g1,
          tensors0, t1, states0, s1);
    check(param_hash(s) == h0, "failed dion_add_group changed a parameter");
  } else {
    check(!must_fail, "dion_add_group accepted an invalid group (%s; algorithm %d, %u tensors)", must_fail,
          eff.algorithm, count);
    if (!(flags & 2)) check(gi == groups0, "group_index %d, expected %d", gi, groups0);
    for (HTensor& t : built) s.tensors.push_back(t);
    built.clear();
    int32_t t1 = -1;
    dion_tensor_count(s.h, &t1);
    check(t1 == static_cast<int32_t>(s.tensors.size()), "tensor_count %d, harness has %zu", t1, s.tensors.size());
    s.groups = groups0 + 1;
    dion_state_count(s.h, &s.states);
  }
  for (HTensor& t : built) {
    t.param.release();
    t.grad.release();
  }
}

void Harness::set_hparam(Slot& s) {
  const int32_t g = in_.i32(), hp = in_.i32();
  const double v = in_.f64();
  const dion_status_t st = dion_group_set_hparam(s.h, g, hp, v);
  check_failure(st, s.h, "dion_group_set_hparam");
  const bool unit = hp == DION_HPARAM_BETA1 || hp == DION_HPARAM_BETA2 || hp == DION_HPARAM_MUON_BETA2;
  const bool bad = !std::isfinite(v) || v < 0 || (unit && v > 1) || hp < DION_HPARAM_LR ||
                   hp > DION_HPARAM_MUON_BETA2 || g < 0 || g >= s.groups || !s.h;
  if (bad) check(st != DION_SUCCESS, "set_hparam(group %d, hparam %d, %g) was accepted", g, hp, v);
  if (st == DION_SUCCESS) {
    double r = -1;
    check(dion_group_get_hparam(s.h, g, hp, &r) == DION_SUCCESS, "get_hparam after set_hparam");
    check(std::memcmp(&r, &v, sizeof v) == 0 || r == v, "hparam %d reads back %g, set %g", hp, r, v);
  }
}

void Harness::get_hparam(Slot& s) {
  const int32_t g = in_.i32(), hp = in_.i32();
  const bool null_out = in_.u8() & 1;
  double v = 0;
  const dion_status_t st = dion_group_get_hparam(s.h, g, hp, null_out ? nullptr : &v);
  check_failure(st, s.h, "dion_group_get_hparam");
  if (null_out) check(st != DION_SUCCESS, "get_hparam accepted a NULL output");
}

void Harness::set_step(Slot& s) {
  const int32_t g = in_.i32();
  const int64_t v = in_.i64();
  const dion_status_t st = dion_group_set_step(s.h, g, v);
  check_failure(st, s.h, "dion_group_set_step");
  if (v < 0 || !s.h || g < 0 || g >= s.groups) check(st != DION_SUCCESS, "set_step(%d, %lld) accepted", g, (long long)v);
  if (st == DION_SUCCESS) {
    int64_t r = -1;
    check(dion_group_get_step(s.h, g, &r) == DION_SUCCESS, "get_step after set_step");
    check(r == v, "step reads back %lld, set %lld", (long long)r, (long long)v);
  }
}

void Harness::rebind(Slot& s) {
  const int32_t ti = in_.i32();
  const uint8_t flags = in_.u8();
  const bool valid = s.h && ti >= 0 && static_cast<size_t>(ti) < s.tensors.size();
  HTensor cur;
  if (valid) cur = s.tensors[static_cast<size_t>(ti)];
  const size_t n = cur.numel;
  // New buffers of the tensor's exact size; a misaligned pointer lives one
  // byte into a block one byte larger, so its n elements are still in bounds.
  Buf p, g;
  const size_t pe = dtype_ok(cur.pdt) ? esize(cur.pdt) : 4, ge = dtype_ok(cur.gdt) ? esize(cur.gdt) : 4;
  if (!(flags & 1)) p.alloc(n * pe, (flags & 4) ? 1 : 0);
  if (!(flags & 2)) g.alloc(n * ge, (flags & 8) ? 1 : 0);
  if (p.base) {
    if (valid && cur.param.base && n) std::memcpy(p.ptr(), cur.param.ptr(), n * pe);
  }
  fill(in_, g.ptr(), cur.gdt, n);
  const uint64_t h0 = param_hash(s);
  const dion_status_t st = dion_tensor_rebind(s.h, ti, p.ptr(), g.ptr());
  check_failure(st, s.h, "dion_tensor_rebind");
  if (!valid) check(st != DION_SUCCESS, "rebind of tensor %d accepted", ti);
  if ((flags & 1) && n > 0) check(st != DION_SUCCESS, "rebind with a NULL param accepted");
  if (st != DION_SUCCESS) {
    check(param_hash(s) == h0, "failed rebind changed a parameter");
    p.release();
    g.release();
    return;
  }
  // The old buffers are freed at once: a library that kept using them after
  // the rebind is caught as a use-after-free.
  HTensor& t = s.tensors[static_cast<size_t>(ti)];
  t.param.release();
  t.grad.release();
  t.param = p;
  t.grad = g;
}

void Harness::step(Slot& s) {
  if (++steps_ > kMaxSteps) return;
  bool nonfinite = false;
  for (const HTensor& t : s.tensors)
    if (t.has_grad() && t.numel && any_nonfinite(t.grad.ptr(), t.gdt, t.numel)) nonfinite = true;
  // Tensors without a gradient are skipped by the step: snapshot them.
  std::vector<uint64_t> idle(s.tensors.size(), 0);
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (!s.tensors[i].has_grad()) idle[i] = fnv(s.tensors[i].param.ptr(), s.tensors[i].param.bytes);
  int64_t skipped0 = 0;
  if (s.h) dion_get_skipped_steps(s.h, &skipped0, nullptr, nullptr);
  const uint64_t h0 = param_hash(s);
  const dion_status_t st = dion_step(s.h, nullptr);
  check_failure(st, s.h, "dion_step");
  if (!s.h) {
    check(st == DION_ERROR_INVALID_ARGUMENT, "dion_step(NULL) returned %d", st);
    return;
  }
  if (st != DION_SUCCESS) {
    check(param_hash(s) == h0, "failed dion_step changed a parameter");
    return;
  }
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (!s.tensors[i].has_grad())
      check(fnv(s.tensors[i].param.ptr(), s.tensors[i].param.bytes) == idle[i],
            "dion_step wrote tensor %zu, which has no gradient", i);
  int64_t skipped = 0;
  int32_t last = -1;
  check(dion_get_skipped_steps(s.h, &skipped, &last, nullptr) == DION_SUCCESS, "get_skipped_steps");
  if (nonfinite && s.skip_nonfinite) {
    check(last == 1 && skipped == skipped0 + 1, "a step with a non-finite gradient was not skipped");
    check(param_hash(s) == h0, "a skipped step changed a parameter");
  } else {
    check(last == 0 && skipped == skipped0, "a step with finite gradients was skipped (last %d)", last);
  }
}

// A state_info block of the caller's struct_size bytes (at least the field itself).
void Harness::state_info(Slot& s) {
  const int32_t idx = in_.i32();
  size_t ss = sizeof(dion_state_info_t);
  switch (in_.u8() % 4) {
    case 0: break;
    case 1: ss = offsetof(dion_state_info_t, local_bytes) + sizeof(uint64_t); break;
    case 2: ss = static_cast<size_t>(in_.i64()); break;
    default: ss = sizeof(dion_state_info_t) + in_.u8() % 64; break;
  }
  const bool null_info = (in_.u8() & 1) != 0;
  const size_t alloc = ss < sizeof(size_t) ? sizeof(size_t) : ss > 65536 ? sizeof(dion_state_info_t) : ss;
  Buf b;
  b.alloc(alloc, 0);
  std::memset(b.ptr(), 0xAB, alloc);
  std::memcpy(b.ptr(), &ss, sizeof ss);
  const dion_status_t st = dion_state_info(s.h, idx, null_info ? nullptr : static_cast<dion_state_info_t*>(b.ptr()));
  check_failure(st, s.h, "dion_state_info");
  const size_t min_ss = offsetof(dion_state_info_t, local_bytes) + sizeof(uint64_t);
  if (null_info || idx < 0 || idx >= s.states || !s.h || ss < min_ss) check(st != DION_SUCCESS, "state_info accepted");
  if (st == DION_SUCCESS) {
    dion_state_info_t r;
    std::memcpy(&r, b.ptr(), sizeof r < alloc ? sizeof r : alloc);
    check(r.ndim >= 0 && r.ndim <= DION_MAX_DIMS, "state ndim %d", r.ndim);
    check(r.tensor >= 0 && static_cast<size_t>(r.tensor) < s.tensors.size(), "state tensor %d", r.tensor);
    check(r.name != nullptr && r.name[0] != '\0', "state without a name");
    uint64_t numel = 1;
    for (int d = 0; d < r.ndim; ++d) {
      check(r.local_shape[d] >= 0 && r.local_offset[d] >= 0 && r.local_offset[d] + r.local_shape[d] <= r.global_shape[d],
            "state shard outside its global shape");
      numel *= static_cast<uint64_t>(r.local_shape[d]);
    }
    check(dtype_ok(r.dtype) && r.local_bytes == numel * esize(r.dtype), "local_bytes %llu for %llu elements",
          (unsigned long long)r.local_bytes, (unsigned long long)numel);
  }
  b.release();
}

// state_read / state_write with a fuzzed capacity; the buffer is exactly
// `bytes` long whenever that is allocatable.
void Harness::state_rw(Slot& s, bool write) {
  const int32_t idx = in_.i32();
  uint64_t need = 0;
  bool known = false;
  if (s.h && idx >= 0 && idx < s.states) {
    dion_state_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    known = dion_state_info(s.h, idx, &info) == DION_SUCCESS;
    check(known, "state_info(%d) failed for a valid index", idx);
    need = info.local_bytes;
  }
  uint64_t bytes = need;
  switch (in_.u8() % 4) {
    case 0: break;
    case 1: bytes = need + static_cast<uint64_t>(static_cast<int8_t>(in_.u8()) % 5); break;
    case 2: bytes = static_cast<uint64_t>(in_.i64()); break;
    default: bytes = 0; break;
  }
  const bool null_buf = (in_.u8() & 1) != 0;
  const size_t alloc = bytes <= (uint64_t(4) << 20) ? static_cast<size_t>(bytes) : static_cast<size_t>(need);
  Buf b;
  if (!null_buf) b.alloc(alloc, 0);
  if (b.base) std::memset(b.ptr(), write ? 0 : 0xCD, alloc);
  if (write) fill(in_, b.ptr(), DION_DTYPE_FP32, alloc / 4);
  const uint64_t h0 = param_hash(s);
  const dion_status_t st = write ? dion_state_write(s.h, idx, b.ptr(), bytes, nullptr)
                                 : dion_state_read(s.h, idx, b.ptr(), bytes, nullptr);
  check_failure(st, s.h, write ? "dion_state_write" : "dion_state_read");
  check(param_hash(s) == h0, "state_read/write changed a parameter");
  if (!known || bytes < need || (null_buf && need > 0)) check(st != DION_SUCCESS, "state read/write accepted");
  if (st == DION_SUCCESS && write && need > 0) {
    // What was written reads back bit for bit.
    Buf back;
    back.alloc(static_cast<size_t>(need), 0);
    check(dion_state_read(s.h, idx, back.ptr(), need, nullptr) == DION_SUCCESS, "read after write");
    check(std::memcmp(back.ptr(), b.ptr(), static_cast<size_t>(need)) == 0, "state %d does not read back", idx);
    back.release();
  }
  b.release();
}

void Harness::state_find(Slot& s) {
  const int32_t ti = in_.i32();
  static const char* kNames[] = {"momentum", "Q", "variance", "variance_neuron"};
  const uint8_t sel = in_.u8() % 6;
  std::string fuzzed;
  const char* name = nullptr;
  if (sel < 4) {
    name = kNames[sel];
  } else if (sel == 5) {
    fuzzed = in_.str(20);
    name = fuzzed.c_str();
  }
  const bool null_idx = (in_.u8() & 1) != 0;
  int32_t idx = -1;
  const dion_status_t st = dion_state_find(s.h, ti, name, null_idx ? nullptr : &idx);
  check_failure(st, s.h, "dion_state_find");
  if (st == DION_SUCCESS) {
    check(idx >= 0 && idx < s.states, "state_find returned %d of %d", idx, s.states);
    dion_state_info_t info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    check(dion_state_info(s.h, idx, &info) == DION_SUCCESS, "info of a found state");
    check(info.tensor == ti && std::strcmp(info.name, name) == 0, "state_find found the wrong state");
  }
}

void Harness::queries(Slot& s) {
  const uint8_t nulls = in_.u8();
  int32_t c = 0;
  check_failure(dion_group_count(s.h, (nulls & 1) ? nullptr : &c), s.h, "dion_group_count");
  check_failure(dion_tensor_count(s.h, (nulls & 2) ? nullptr : &c), s.h, "dion_tensor_count");
  check_failure(dion_state_count(s.h, (nulls & 4) ? nullptr : &c), s.h, "dion_state_count");
  uint64_t a = 0, b = 0;
  check_failure(dion_get_memory_usage(s.h, (nulls & 8) ? nullptr : &a, (nulls & 16) ? nullptr : &b), s.h,
                "dion_get_memory_usage");
  int64_t sk = 0;
  int32_t last = 0;
  check_failure(dion_get_skipped_steps(s.h, (nulls & 8) ? nullptr : &sk, (nulls & 16) ? nullptr : &last, nullptr),
                s.h, "dion_get_skipped_steps");
  const int32_t mesh = in_.i32();
  check_failure(dion_get_comm_bytes(s.h, mesh, (nulls & 32) ? nullptr : &a, (nulls & 64) ? nullptr : &b), s.h,
                "dion_get_comm_bytes");
  dion_status_t as = 0;
  check_failure(dion_get_async_error(s.h, (nulls & 128) ? nullptr : &as), s.h, "dion_get_async_error");
  const uint64_t h0 = param_hash(s);
  check_failure(dion_sync_for_checkpoint(s.h, nullptr), s.h, "dion_sync_for_checkpoint");
  check(param_hash(s) == h0, "sync_for_checkpoint changed a parameter");
  int64_t stp = 0;
  check_failure(dion_group_get_step(s.h, in_.i32(), (nulls & 1) ? nullptr : &stp), s.h, "dion_group_get_step");
}

void Harness::fill_grad(Slot& s) {
  const uint8_t sel = in_.u8();
  HTensor* t = s.tensors.empty() ? nullptr : &s.tensors[sel % s.tensors.size()];
  fill(in_, t ? t->grad.ptr() : nullptr, t ? t->gdt : DION_DTYPE_FP32, t ? t->numel : 0);
}

void Harness::misc(Slot& s) {
  const char* m = dion_last_error(s.h);
  check(m != nullptr, "dion_last_error returned NULL");
  (void)std::strlen(m);
  const char* ss = dion_status_string(in_.i32());
  check(ss != nullptr && *ss, "dion_status_string returned an empty string");
  check(dion_version() / 10000 == DION_VERSION_MAJOR, "dion_version() %d", dion_version());
  check(dion_options_sizeof() == sizeof(dion_options_t) && dion_tensor_sizeof() == sizeof(dion_tensor_t) &&
            dion_group_options_sizeof() == sizeof(dion_group_options_t),
        "sizeof functions disagree with the header");
  dion_group_options_t o;
  const int32_t algo = in_.i32();
  const dion_status_t st = dion_group_options_init(&o, algo);
  check_failure(st, nullptr, "dion_group_options_init");
  if (algo < DION_ALGO_DION || algo > DION_ALGO_LION) check(st != DION_SUCCESS, "options_init(%d) accepted", algo);
  // Communicators: this harness creates none (the fuzz build has no MPI or
  // NCCL), so these are the refusal paths, which must leave *comm NULL.
  const int32_t nranks = in_.i32(), rank = in_.i32(), device = in_.i32(), fint = in_.i32();
  int32_t v = 0;
  check(dion_comm_size(nullptr, &v) == DION_ERROR_INVALID_ARGUMENT, "comm_size(NULL)");
  check(dion_comm_rank(nullptr, &v) == DION_ERROR_INVALID_ARGUMENT, "comm_rank(NULL)");
  check(dion_comm_abort(nullptr) == DION_ERROR_INVALID_ARGUMENT, "comm_abort(NULL)");
  check(dion_comm_destroy(nullptr) == DION_SUCCESS, "comm_destroy(NULL) must be a no-op");
  dion_nccl_unique_id_t id;
  std::memset(&id, 0, sizeof id);
  check_failure(dion_nccl_get_unique_id(nullptr), nullptr, "dion_nccl_get_unique_id");
  check(dion_nccl_get_unique_id(nullptr) != DION_SUCCESS, "nccl_get_unique_id(NULL) accepted");
  dion_comm_t c = reinterpret_cast<dion_comm_t>(uintptr_t(0x1));
  dion_status_t cs = dion_comm_adopt_nccl(&c, nullptr);
  check_failure(cs, nullptr, "dion_comm_adopt_nccl");
  check(cs != DION_SUCCESS && c == nullptr, "comm_adopt_nccl(NULL) accepted or left *comm set");
  c = reinterpret_cast<dion_comm_t>(uintptr_t(0x1));
  cs = dion_comm_from_mpi_fint(&c, fint);  // MPI is never initialised here
  check_failure(cs, nullptr, "dion_comm_from_mpi_fint");
  check(cs != DION_SUCCESS && c == nullptr, "comm_from_mpi_fint without MPI_Init accepted or left *comm set");
  c = reinterpret_cast<dion_comm_t>(uintptr_t(0x1));
  cs = dion_comm_init_nccl(&c, &id, nranks, rank, device);
  check_failure(cs, nullptr, "dion_comm_init_nccl");
  if (cs == DION_SUCCESS) {
    dion_comm_destroy(c);
  } else {
    check(c == nullptr, "failed comm_init_nccl left *comm set");
  }
}

void Harness::run() {
  int ops = 0;
  while (!in_.done() && ++ops <= 256) {
    switch (in_.u8() % kNumOps) {
      case kCreate: create(slot()); break;
      case kDestroy: destroy(slot()); break;
      case kAddGroup: add_group(slot()); break;
      case kSetHparam: set_hparam(slot()); break;
      case kGetHparam: get_hparam(slot()); break;
      case kSetStep: set_step(slot()); break;
      case kRebind: rebind(slot()); break;
      case kStep: step(slot()); break;
      case kStateInfo: state_info(slot()); break;
      case kStateRead: state_rw(slot(), false); break;
      case kStateWrite: state_rw(slot(), true); break;
      case kStateFind: state_find(slot()); break;
      case kQueries: queries(slot()); break;
      case kFillGrad: fill_grad(slot()); break;
      default: misc(slot()); break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* t = std::getenv("DION_FUZZ_TRACE");
  g_trace = t && *t && std::strcmp(t, "0") != 0;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in(data, size);
  Harness h(in);
  h.run();
  return 0;
}
