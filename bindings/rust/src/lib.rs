// SPDX-License-Identifier: MIT
//! Safe Rust bindings to **libdion**, the Dion family of orthonormal optimizers
//! (Dion, Dion2, Muon, NorMuon, NorDion2) plus AdamW and Lion, behind a C ABI.
//!
//! [`sys`] is the raw, hand-written mirror of `include/dion.h`; this module is
//! the safe layer over it (cudarc's sys / safe split).
//!
//! ```no_run
//! use dion::{Algorithm, Buffers, GroupOptions, Optimizer, OptimizerOptions, Tensor};
//!
//! # fn main() -> dion::Result<()> {
//! let (mut w, mut gw) = (vec![0.1f32; 32 * 16], vec![0f32; 32 * 16]);
//! let (mut b, mut gb) = (vec![0f32; 32], vec![0f32; 32]);
//!
//! let mut opt = Optimizer::new(&OptimizerOptions::new().seed(7))?;
//! opt.add_group(&GroupOptions::new(Algorithm::Muon).lr(0.02).weight_decay(0.0),
//!               [Tensor::new(&mut w, &gw, &[32, 16]).name("w")])?;
//! opt.add_group(&GroupOptions::new(Algorithm::AdamW).lr(1e-3).weight_decay(0.0),
//!               [Tensor::new(&mut b, &gb, &[32]).name("b")])?;
//! for _ in 0..100 {
//!     // ... forward / backward: read w and b, write gw and gb ...
//!     # gw.fill(0.01); gb.fill(0.01);
//!     opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut b, &gb)])?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Buffer model and safety
//!
//! libdion keeps raw pointers to every parameter and gradient and dereferences
//! them in `dion_step`. The safe API never lets it use a pointer that Rust does
//! not currently vouch for:
//!
//! * [`Optimizer::add_group`] takes [`Tensor`] descriptors that borrow the
//!   buffers **for the duration of the call only**;
//! * [`Optimizer::step`] takes one [`Buffers`] per tensor (in the order the
//!   tensors were added), re-binds every tensor to them (`dion_tensor_rebind`)
//!   and then steps. The borrow checker therefore guarantees that the buffers
//!   are alive and unaliased during the step, and between steps they are
//!   entirely the caller's (read the parameters, write the gradients).
//!   Lengths and dtypes are checked against the descriptors given to
//!   `add_group`.
//!
//! Device memory, streams and "bind once, step many times" go through the
//! `unsafe fn`s ([`Tensor::from_raw`], [`Buffers::from_raw`],
//! [`Optimizer::rebind`], [`Optimizer::step_bound`]), each with a
//! `# Safety` section. Host slices are accepted only by an optimizer on the
//! host backend.
//!
//! An [`Optimizer`] is [`Send`] but not [`Sync`]: the C library allows one
//! handle to move between threads but never to be used by two at once.
//!
//! ```compile_fail,E0277
//! fn assert_sync<T: Sync>() {}
//! assert_sync::<dion::Optimizer>(); // Optimizer is not Sync
//! ```
//!
//! ```compile_fail,E0499
//! let (mut w, g) = (vec![0f32; 4], vec![0f32; 4]);
//! let b = dion::Buffers::new(&mut w, &g);
//! w[0] = 1.0; // the parameter is borrowed by `b` until it is consumed
//! drop(b);
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

#[allow(missing_docs)]
pub mod sys;

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;
use std::ptr;

// ===========================================================================
// Status and errors
// ===========================================================================

/// A libdion status code (`dion_status_t`). Any `i32` is representable, so a
/// code appended by a newer libdion is kept rather than lost.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Status(pub i32);

impl Status {
    /// `DION_SUCCESS`
    pub const SUCCESS: Status = Status(0);
    /// `DION_ERROR_INVALID_ARGUMENT`: a NULL, out-of-range or inconsistent argument.
    pub const INVALID_ARGUMENT: Status = Status(1);
    /// `DION_ERROR_INVALID_USAGE`: a valid argument at the wrong time.
    pub const INVALID_USAGE: Status = Status(2);
    /// `DION_ERROR_NOT_SUPPORTED`: a valid request this build/backend cannot serve.
    pub const NOT_SUPPORTED: Status = Status(3);
    /// `DION_ERROR_OUT_OF_MEMORY`
    pub const OUT_OF_MEMORY: Status = Status(4);
    /// `DION_ERROR_CUDA`
    pub const CUDA: Status = Status(5);
    /// `DION_ERROR_CUBLAS`
    pub const CUBLAS: Status = Status(6);
    /// `DION_ERROR_CUSOLVER`
    pub const CUSOLVER: Status = Status(7);
    /// `DION_ERROR_NCCL`
    pub const NCCL: Status = Status(8);
    /// `DION_ERROR_MPI`
    pub const MPI: Status = Status(9);
    /// `DION_ERROR_NUMERICAL`
    pub const NUMERICAL: Status = Status(10);
    /// `DION_ERROR_INTERNAL`: a bug in libdion.
    pub const INTERNAL: Status = Status(11);

    /// The numeric code.
    pub const fn code(self) -> i32 {
        self.0
    }

    /// Whether this is `DION_SUCCESS`.
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }

    /// The C constant's name without its `DION_`/`DION_ERROR_` prefix
    /// (`"INVALID_ARGUMENT"`), or `None` for a code these bindings do not know.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "SUCCESS",
            1 => "INVALID_ARGUMENT",
            2 => "INVALID_USAGE",
            3 => "NOT_SUPPORTED",
            4 => "OUT_OF_MEMORY",
            5 => "CUDA",
            6 => "CUBLAS",
            7 => "CUSOLVER",
            8 => "NCCL",
            9 => "MPI",
            10 => "NUMERICAL",
            11 => "INTERNAL",
            _ => return None,
        })
    }

    /// libdion's static description of the code (`dion_status_string`).
    pub fn description(self) -> &'static str {
        // SAFETY: dion_status_string never returns NULL and returns static text.
        let s = unsafe { CStr::from_ptr(sys::dion_status_string(sys::dion_status_t(self.0))) };
        s.to_str().unwrap_or("unknown status")
    }
}

impl From<sys::dion_status_t> for Status {
    fn from(s: sys::dion_status_t) -> Self {
        Status(s.0)
    }
}

impl From<Status> for sys::dion_status_t {
    fn from(s: Status) -> Self {
        sys::dion_status_t(s.0)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}({})", self.0),
            None => write!(f, "Status({})", self.0),
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// An error from libdion (or from these bindings' own argument checks): the
/// status code and the message naming the function and the offending argument.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    /// The status code (never [`Status::SUCCESS`]).
    pub status: Status,
    /// The message: `dion_last_error()` for libdion's errors.
    pub message: String,
}

impl Error {
    /// Makes an error from a status and a message.
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }

    /// The status code.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    fn invalid(message: impl Into<String>) -> Self {
        Error::new(Status::INVALID_ARGUMENT, message)
    }

    /// The error of a failed libdion call: its status and the message libdion
    /// recorded for `handle` (NULL: for the calling thread).
    fn last(status: sys::dion_status_t, handle: sys::dion_optimizer_t) -> Self {
        let mut message = last_error_message(handle);
        if message.is_empty() {
            message = Status::from(status).description().to_string();
        }
        Error { status: status.into(), message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{:?}]", self.message, self.status)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error").field("status", &self.status).field("message", &self.message).finish()
    }
}

impl std::error::Error for Error {}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn last_error_message(handle: sys::dion_optimizer_t) -> String {
    // SAFETY: `handle` is NULL or a live optimizer; the returned string is
    // valid until the next failing call on it, and is copied at once.
    unsafe {
        let p = sys::dion_last_error(handle);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Status → `Result`, taking the message from `handle` (NULL: the thread's).
fn check(status: sys::dion_status_t, handle: sys::dion_optimizer_t) -> Result<()> {
    if status == sys::dion_status_t::DION_SUCCESS {
        Ok(())
    } else {
        Err(Error::last(status, handle))
    }
}

fn to_i32(v: usize, what: &str, func: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("{func}: {what} = {v} does not fit in int32_t")))
}

fn to_usize(v: i32, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::new(Status::INTERNAL, format!("libdion returned a negative {what} ({v})")))
}

/// Never panics: for `Drop` implementations.
fn log_error(what: &str, e: &Error) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "libdion: {what} failed: {e}");
}

// ===========================================================================
// Versions
// ===========================================================================

/// A libdion version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Incompatible API/ABI changes.
    pub major: i32,
    /// Compatible additions.
    pub minor: i32,
    /// Fixes.
    pub patch: i32,
}

impl Version {
    /// Decodes `MAJOR*10000 + MINOR*100 + PATCH`.
    pub const fn from_code(code: i32) -> Version {
        Version { major: code / 10000, minor: code / 100 % 100, patch: code % 100 }
    }

    /// `MAJOR*10000 + MINOR*100 + PATCH` (`DION_VERSION_CODE`'s encoding).
    pub const fn code(self) -> i32 {
        sys::DION_VERSION(self.major, self.minor, self.patch)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The version of `dion.h` these bindings were written against.
pub const HEADER_VERSION: Version = Version::from_code(sys::DION_VERSION_CODE);

/// The version of the libdion actually loaded (`dion_version`).
pub fn version() -> Version {
    // SAFETY: no arguments, no preconditions.
    Version::from_code(unsafe { sys::dion_version() })
}

/// Checks that the loaded libdion has the major version of [`HEADER_VERSION`]
/// (what `dion.h` asks bindings to do at load). [`Optimizer::new`] calls it.
pub fn check_version() -> Result<Version> {
    let v = version();
    if v.major != HEADER_VERSION.major {
        return Err(Error::new(
            Status::NOT_SUPPORTED,
            format!("the loaded libdion is {v} but these bindings were written for libdion {HEADER_VERSION}"),
        ));
    }
    Ok(v)
}

// ===========================================================================
// Enumerations
// ===========================================================================

macro_rules! c_enum {
    ($(#[$m:meta])* pub enum $name:ident : $raw:ty { $($(#[$vm:meta])* $var:ident = $c:path,)* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vm])* $var,)* }

        impl $name {
            /// The C value.
            pub const fn to_raw(self) -> $raw {
                match self { $(Self::$var => $c,)* }
            }
            /// The variant of a C value; `None` for a value these bindings do not know.
            pub const fn from_raw(v: $raw) -> Option<Self> {
                $(if v == $c { return Some(Self::$var); })*
                None
            }
        }
    };
}

c_enum! {
    /// Where the optimizer runs and where its buffers live (`dion_backend_t`).
    pub enum Backend: sys::dion_backend_t {
        /// CPU (BLAS/LAPACK); buffers are host memory.
        Host = sys::DION_BACKEND_HOST,
        /// One CUDA device; buffers are device memory of that device.
        Cuda = sys::DION_BACKEND_CUDA,
    }
}

c_enum! {
    /// The optimizer of a parameter group (`dion_algorithm_t`).
    pub enum Algorithm: sys::dion_algorithm_t {
        /// Low-rank Dion (2-D tensors).
        Dion = sys::DION_ALGO_DION,
        /// Dion2: orthogonalize a selected fraction of rows/columns.
        Dion2 = sys::DION_ALGO_DION2,
        /// Muon: momentum then Polar Express / Newton–Schulz.
        Muon = sys::DION_ALGO_MUON,
        /// Muon with neuron-wise normalization.
        NorMuon = sys::DION_ALGO_NORMUON,
        /// Dion2 with neuron-wise normalization (alias: [`Algorithm::DION3`]).
        NorDion2 = sys::DION_ALGO_NORDION2,
        /// AdamW (element-wise, any shape).
        AdamW = sys::DION_ALGO_ADAMW,
        /// Lion (element-wise, any shape).
        Lion = sys::DION_ALGO_LION,
    }
}

impl Algorithm {
    /// `DION_ALGO_DION3`, another name of [`Algorithm::NorDion2`].
    pub const DION3: Algorithm = Algorithm::NorDion2;
}

c_enum! {
    /// Storage type of parameters, gradients and states (`dion_dtype_t`).
    pub enum DType: sys::dion_dtype_t {
        /// IEEE binary32.
        F32 = sys::DION_DTYPE_FP32,
        /// bfloat16.
        BF16 = sys::DION_DTYPE_BF16,
        /// IEEE binary16.
        F16 = sys::DION_DTYPE_FP16,
    }
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

/// `Option<DType>` → C, `None` being `DION_DTYPE_UNSET`.
fn dtype_opt_raw(d: Option<DType>) -> sys::dion_dtype_t {
    d.map_or(sys::DION_DTYPE_UNSET, DType::to_raw)
}

c_enum! {
    /// Dion's orthonormalization of P (`dion_qr_method_t`).
    pub enum QrMethod: sys::dion_qr_method_t {
        /// Randomized Cholesky QR (default).
        Rcqr = sys::DION_QR_RCQR,
        /// Householder QR.
        Qr = sys::DION_QR_QR,
        /// Cholesky QR, falling back to RCQR when the Cholesky fails.
        Cqr = sys::DION_QR_CQR,
    }
}

c_enum! {
    /// The Muon family's orthogonalizer (`dion_orthogonalizer_t`).
    pub enum Orthogonalizer: sys::dion_orthogonalizer_t {
        /// Polar Express, 5 tuned polynomials (default).
        PolarExpress = sys::DION_ORTHO_POLAR_EXPRESS,
        /// Quintic Newton–Schulz, 5 tuned iterations.
        NewtonSchulz = sys::DION_ORTHO_NEWTON_SCHULZ,
    }
}

c_enum! {
    /// Shape-dependent learning-rate scaling (`dion_adjust_lr_t`).
    pub enum AdjustLr: sys::dion_adjust_lr_t {
        /// `lr * sqrt(fan_out / fan_in)` (default).
        SpectralNorm = sys::DION_ADJUST_LR_SPECTRAL_NORM,
        /// `lr * 0.2 * sqrt(max(fan_out, fan_in))`.
        RmsNorm = sys::DION_ADJUST_LR_RMS_NORM,
        /// No scaling.
        None = sys::DION_ADJUST_LR_NONE,
    }
}

c_enum! {
    /// Where Dion2/NorDion2 select rows/columns (`dion_selection_scope_t`).
    pub enum SelectionScope: sys::dion_selection_scope_t {
        /// Within each rank's shard (default).
        Local = sys::DION_SELECTION_LOCAL,
        /// Over the whole (unsharded) matrix.
        Global = sys::DION_SELECTION_GLOBAL,
    }
}

c_enum! {
    /// Precision of matrix products (`dion_matmul_precision_t`).
    pub enum MatmulPrecision: sys::dion_matmul_precision_t {
        /// Exact fp32 products (default).
        F32 = sys::DION_MATMUL_FP32,
        /// Tensor-core tf32 (CUDA); same as F32 on the host.
        Tf32 = sys::DION_MATMUL_TF32,
        /// bf16 operands, fp32 accumulation (CUDA); same as F32 on the host.
        Bf16 = sys::DION_MATMUL_BF16,
    }
}

c_enum! {
    /// Memory order of a tensor's local buffer (`dion_layout_t`).
    pub enum Layout: sys::dion_layout_t {
        /// C order: the last dim is contiguous (default).
        RowMajor = sys::DION_LAYOUT_ROW_MAJOR,
        /// Fortran order, 2-D tensors only: the first dim is contiguous.
        ColMajor = sys::DION_LAYOUT_COL_MAJOR,
    }
}

c_enum! {
    /// A mesh dimension (`dion_mesh_t`).
    pub enum Mesh: sys::dion_mesh_t {
        /// Data-parallel replicas (DDP / HSDP replicate dim).
        Replicate = sys::DION_MESH_REPLICATE,
        /// Outer shard (FSDP).
        Outer = sys::DION_MESH_OUTER,
        /// Inner shard (tensor parallel).
        Inner = sys::DION_MESH_INNER,
    }
}

c_enum! {
    /// A hyperparameter that can change between steps (`dion_hparam_t`).
    pub enum Hparam: sys::dion_hparam_t {
        /// Learning rate.
        Lr = sys::DION_HPARAM_LR,
        /// Decoupled weight decay.
        WeightDecay = sys::DION_HPARAM_WEIGHT_DECAY,
        /// Dion error-feedback keep factor; Muon/NorMuon momentum; NorDion2 ef decay.
        Mu = sys::DION_HPARAM_MU,
        /// AdamW / Lion beta1.
        Beta1 = sys::DION_HPARAM_BETA1,
        /// AdamW / Lion beta2.
        Beta2 = sys::DION_HPARAM_BETA2,
        /// Epsilon.
        Epsilon = sys::DION_HPARAM_EPSILON,
        /// Dion2 error-feedback decay.
        EfDecay = sys::DION_HPARAM_EF_DECAY,
        /// NorMuon / NorDion2 second-moment decay.
        MuonBeta2 = sys::DION_HPARAM_MUON_BETA2,
    }
}

// ===========================================================================
// Element types
// ===========================================================================

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::Bf16 {}
    impl Sealed for super::F16 {}
}

/// An element type of host buffers, with its [`DType`]. Sealed: implemented
/// for `f32`, [`Bf16`] and [`F16`] only, whose sizes are those of their dtypes.
pub trait Element: sealed::Sealed + Copy + Default + 'static {
    /// The libdion dtype of this type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}

/// A bfloat16 value, stored as its bits.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    const DTYPE: DType = DType::BF16;
}

impl Bf16 {
    /// Rounds to nearest even (libdion's rounding); NaN stays NaN.
    pub fn from_f32(x: f32) -> Bf16 {
        let u = x.to_bits();
        if u & 0x7fff_ffff > 0x7f80_0000 {
            return Bf16(((u >> 16) | 0x40) as u16);
        }
        Bf16((u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16)
    }

    /// Exact widening.
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// An IEEE binary16 value, stored as its bits.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

impl Element for F16 {
    const DTYPE: DType = DType::F16;
}

impl F16 {
    /// Rounds to nearest even, with subnormals and overflow to infinity.
    pub fn from_f32(x: f32) -> F16 {
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32;
        let man = b & 0x7f_ffff;
        if exp == 0xff {
            return F16(sign | 0x7c00 | if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 });
        }
        let e = exp - 127 + 15; // the binary16 biased exponent
        if e >= 0x1f {
            return F16(sign | 0x7c00);
        }
        let round = |v: u32, shift: u32| -> u32 {
            let (q, rem, half) = (v >> shift, v & ((1u32 << shift) - 1), 1u32 << (shift - 1));
            if rem > half || (rem == half && q & 1 == 1) {
                q + 1
            } else {
                q
            }
        };
        if e <= 0 {
            // Subnormal (in units of 2^-24) or zero; a carry into 0x400 is the
            // smallest normal, which is the right encoding.
            if e < -10 {
                return F16(sign);
            }
            return F16(sign | round(man | 0x80_0000, (14 - e) as u32) as u16);
        }
        // Normal; a carry may round up into the exponent, and to infinity.
        F16(sign | round(((e as u32) << 23) | man, 13) as u16)
    }

    /// Exact widening.
    pub fn to_f32(self) -> f32 {
        let h = self.0 as u32;
        let sign = (h & 0x8000) << 16;
        let exp = (h >> 10) & 0x1f;
        let man = h & 0x3ff;
        match exp {
            0 => {
                let v = man as f32 * f32::from_bits(0x3380_0000); // 2^-24
                if sign != 0 {
                    -v
                } else {
                    v
                }
            }
            0x1f => f32::from_bits(sign | 0x7f80_0000 | (man << 13)),
            _ => f32::from_bits(sign | ((exp + 112) << 23) | (man << 13)),
        }
    }
}

// ===========================================================================
// Options
// ===========================================================================

/// Options of [`Optimizer::new`] (`dion_options_t`). Unset fields keep
/// libdion's defaults (those of `dion_options_init`).
///
/// ```
/// let o = dion::OptimizerOptions::new().seed(42).skip_nonfinite(false);
/// assert_eq!(o.to_raw().seed, 42);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerOptions {
    backend: Option<Backend>,
    device: Option<i32>,
    replicate_grad_sync: Option<bool>,
    skip_nonfinite: Option<bool>,
    seed: Option<u64>,
}

impl OptimizerOptions {
    /// All defaults: host backend, device 0, replicate_grad_sync, skip_nonfinite, seed 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Host backend (the default).
    pub fn host() -> Self {
        Self::new().backend(Backend::Host)
    }

    /// CUDA backend on `device`.
    pub fn cuda(device: i32) -> Self {
        Self::new().backend(Backend::Cuda).device(device)
    }

    /// `backend`.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = Some(backend);
        self
    }

    /// `device`: the CUDA device ordinal (CUDA backend).
    pub fn device(mut self, device: i32) -> Self {
        self.device = Some(device);
        self
    }

    /// `replicate_grad_sync`: whether the optimizer averages gradients over the
    /// replicate mesh itself (default true).
    pub fn replicate_grad_sync(mut self, on: bool) -> Self {
        self.replicate_grad_sync = Some(on);
        self
    }

    /// `skip_nonfinite`: whether a step whose gradients hold NaN/Inf changes
    /// nothing (default true).
    pub fn skip_nonfinite(mut self, on: bool) -> Self {
        self.skip_nonfinite = Some(on);
        self
    }

    /// `seed` of the counter-based generator (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The backend these options select.
    pub fn selected_backend(&self) -> Backend {
        self.backend.unwrap_or(Backend::Host)
    }

    /// The C struct (`dion_options_init` then the fields set here; no communicators).
    pub fn to_raw(&self) -> sys::dion_options_t {
        let mut raw = std::mem::MaybeUninit::<sys::dion_options_t>::zeroed();
        // SAFETY: a valid pointer; dion_options_init fills every field and only
        // fails for NULL. All-zero bytes are a valid dion_options_t anyway.
        let mut raw = unsafe {
            sys::dion_options_init(raw.as_mut_ptr());
            raw.assume_init()
        };
        raw.struct_size = size_of::<sys::dion_options_t>();
        raw.abi_version = sys::DION_ABI_VERSION;
        if let Some(b) = self.backend {
            raw.backend = b.to_raw();
        }
        if let Some(d) = self.device {
            raw.device = d;
        }
        if let Some(v) = self.replicate_grad_sync {
            raw.replicate_grad_sync = v as i32;
        }
        if let Some(v) = self.skip_nonfinite {
            raw.skip_nonfinite = v as i32;
        }
        if let Some(s) = self.seed {
            raw.seed = s;
        }
        raw
    }
}

/// Per-group algorithm and hyperparameters (`dion_group_options_t`), filled
/// with microsoft/dion's defaults by `dion_group_options_init`. Fields that do
/// not apply to the algorithm are ignored by libdion. Values are validated by
/// [`Optimizer::add_group`].
///
/// ```
/// use dion::{Algorithm, GroupOptions};
/// let g = GroupOptions::new(Algorithm::Muon).lr(0.02).weight_decay(0.0).nesterov(true);
/// assert_eq!(g.as_raw().lr, 0.02);
/// assert_eq!(g.as_raw().mu, 0.95); // libdion's default
/// ```
#[derive(Clone, Copy, Debug)]
pub struct GroupOptions {
    raw: sys::dion_group_options_t,
    init_status: Status,
}

macro_rules! setters {
    ($($(#[$m:meta])* $name:ident: $ty:ty => |$raw:ident, $v:ident| $body:expr;)*) => {$(
        $(#[$m])*
        pub fn $name(mut self, $v: $ty) -> Self {
            let $raw = &mut self.raw;
            $body;
            self
        }
    )*};
}

impl GroupOptions {
    /// libdion's defaults for `algorithm` (`dion_group_options_init`).
    pub fn new(algorithm: Algorithm) -> Self {
        let mut raw = std::mem::MaybeUninit::<sys::dion_group_options_t>::zeroed();
        // SAFETY: a valid pointer; on success every field is written, and the
        // all-zero bytes are a valid value in any case.
        let (status, mut raw) = unsafe {
            let s = sys::dion_group_options_init(raw.as_mut_ptr(), algorithm.to_raw());
            (Status::from(s), raw.assume_init())
        };
        // Cannot fail for a valid algorithm; if it did, add_group reports it.
        raw.struct_size = size_of::<sys::dion_group_options_t>();
        raw.abi_version = sys::DION_ABI_VERSION;
        raw.algorithm = algorithm.to_raw();
        GroupOptions { raw, init_status: status }
    }

    /// Wraps a C struct as is (its `abi_version` included; `add_group` always
    /// passes `struct_size` = `size_of::<dion_group_options_t>()`).
    pub fn from_raw(raw: sys::dion_group_options_t) -> Self {
        GroupOptions { raw, init_status: Status::SUCCESS }
    }

    /// The C struct.
    pub fn as_raw(&self) -> &sys::dion_group_options_t {
        &self.raw
    }

    /// The algorithm, if a known one.
    pub fn algorithm(&self) -> Option<Algorithm> {
        Algorithm::from_raw(self.raw.algorithm)
    }

    setters! {
        /// `lr` (default 0.01; must be >= 0).
        lr: f64 => |r, v| r.lr = v;
        /// `weight_decay`, decoupled: `X *= 1 - lr*weight_decay` (default 0.01).
        weight_decay: f64 => |r, v| r.weight_decay = v;
        /// `mu`: Dion error feedback, Muon/NorMuon momentum, NorDion2 ef decay (default 0.95).
        mu: f64 => |r, v| r.mu = v;
        /// `beta1` of AdamW and Lion (default 0.9).
        beta1: f64 => |r, v| r.beta1 = v;
        /// `beta2` of AdamW and Lion (default 0.95).
        beta2: f64 => |r, v| r.beta2 = v;
        /// `epsilon` (default 1e-8).
        epsilon: f64 => |r, v| r.epsilon = v;
        /// `betas` = (`beta1`, `beta2`).
        betas: (f64, f64) => |r, v| { r.beta1 = v.0; r.beta2 = v.1 };
        /// Dion `rank_fraction` in (0, 1] (default 1).
        rank_fraction: f64 => |r, v| r.rank_fraction = v;
        /// Dion `rank_multiple_of` >= 1 (default 1).
        rank_multiple_of: i32 => |r, v| r.rank_multiple_of = v;
        /// Dion `power_iters` >= 1 (default 1).
        power_iters: i32 => |r, v| r.power_iters = v;
        /// Dion `qr_method` (default RCQR).
        qr_method: QrMethod => |r, v| r.qr_method = v.to_raw();
        /// Dion `cqr_warmup_steps` (default 150).
        cqr_warmup_steps: i32 => |r, v| r.cqr_warmup_steps = v;
        /// Dion RCQR `oversample` >= 1 (default 1.25).
        oversample: f64 => |r, v| r.oversample = v;
        /// Muon family `orthogonalizer` (default Polar Express).
        orthogonalizer: Orthogonalizer => |r, v| r.orthogonalizer = v.to_raw();
        /// Muon family `ortho_steps` (default 5).
        ortho_steps: i32 => |r, v| r.ortho_steps = v;
        /// Muon family `nesterov` (default false).
        nesterov: bool => |r, v| r.nesterov = v as i32;
        /// Muon family `adjust_lr` (default spectral norm).
        adjust_lr: AdjustLr => |r, v| r.adjust_lr = v.to_raw();
        /// `cautious_wd` of Muon, NorMuon, AdamW and Lion (default false).
        cautious_wd: bool => |r, v| r.cautious_wd = v as i32;
        /// Dion2/NorDion2 `fraction` in (0, 1] (default 0.25).
        fraction: f64 => |r, v| r.fraction = v;
        /// Dion2 `ef_decay` (default 0.95).
        ef_decay: f64 => |r, v| r.ef_decay = v;
        /// Dion2/NorDion2 `selection_scope` (default local).
        selection_scope: SelectionScope => |r, v| r.selection_scope = v.to_raw();
        /// NorMuon/NorDion2 `muon_beta2` (default 0.95).
        muon_beta2: f64 => |r, v| r.muon_beta2 = v;
        /// `flatten`: a tensor of ndim >= 3 is one (shape[0], prod(rest)) matrix (default false).
        flatten: bool => |r, v| r.flatten = v as i32;
        /// `momentum_dtype` (`None`, the default: the parameter's dtype).
        momentum_dtype: Option<DType> => |r, v| r.momentum_dtype = dtype_opt_raw(v);
        /// Dion's `q_dtype` (`None`, the default: the parameter's dtype).
        q_dtype: Option<DType> => |r, v| r.q_dtype = dtype_opt_raw(v);
        /// AdamW's `variance_dtype` (`None`, the default: the parameter's dtype).
        variance_dtype: Option<DType> => |r, v| r.variance_dtype = dtype_opt_raw(v);
        /// `matmul_precision` (default exact fp32).
        matmul_precision: MatmulPrecision => |r, v| r.matmul_precision = v.to_raw();
    }
}

// ===========================================================================
// Tensor descriptors and per-step buffers
// ===========================================================================

/// A shard of a tensor along one mesh: this rank holds indices
/// `[offset, offset + extent)` of dimension `dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The sharded dimension.
    pub dim: usize,
    /// This rank's first index along `dim`.
    pub offset: usize,
    /// This rank's length along `dim` (may be 0).
    pub extent: usize,
}

#[derive(Clone, Copy, Debug)]
struct HostLens {
    param: usize,
    grad: Option<usize>,
}

/// One parameter for [`Optimizer::add_group`] (`dion_tensor_t`): its buffers,
/// its global shape (fan_out × fan_in for matrices, as torch.nn.Linear) and
/// optional name, layout and sharding. The buffers are borrowed for the
/// `add_group` call only; [`Optimizer::step`] is given them again each step.
pub struct Tensor<'a> {
    param: *mut c_void,
    grad: *const c_void,
    param_dtype: DType,
    grad_dtype: DType,
    shape: Vec<usize>,
    name: Option<String>,
    layout: Layout,
    outer: Option<Shard>,
    inner: Option<Shard>,
    host: Option<HostLens>,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Tensor<'a> {
    /// A tensor over host slices: `param` (updated in place) and `grad`, each
    /// of the local number of elements (the product of `shape`, with sharded
    /// dimensions replaced by their extents; checked by `add_group`).
    pub fn new<P: Element, G: Element>(param: &'a mut [P], grad: &'a [G], shape: &[usize]) -> Self {
        let host = HostLens { param: param.len(), grad: Some(grad.len()) };
        Self::build(param.as_mut_ptr().cast(), grad.as_ptr().cast(), P::DTYPE, G::DTYPE, shape, Some(host))
    }

    /// A tensor without a gradient (skipped by steps until a gradient is given).
    pub fn without_grad<P: Element>(param: &'a mut [P], shape: &[usize]) -> Self {
        let host = HostLens { param: param.len(), grad: None };
        Self::build(param.as_mut_ptr().cast(), ptr::null(), P::DTYPE, P::DTYPE, shape, Some(host))
    }

    /// A tensor over raw pointers, e.g. CUDA device memory (`grad` may be NULL).
    ///
    /// # Safety
    ///
    /// `param` must be valid for reads and writes, and `grad` (unless NULL)
    /// for reads, of the local number of elements of `param_dtype` /
    /// `grad_dtype`, in the memory of the optimizer's backend (device memory
    /// of its device for [`Backend::Cuda`]), and must not be accessed by
    /// anything else while libdion uses them. libdion keeps the pointers after
    /// `add_group`: they must stay valid for as long as they may be used, that
    /// is by every [`Optimizer::step_bound`] until the tensor is re-bound, and
    /// until the work enqueued by such a step has completed.
    pub unsafe fn from_raw(
        param: *mut c_void,
        param_dtype: DType,
        grad: *const c_void,
        grad_dtype: DType,
        shape: &[usize],
    ) -> Tensor<'static> {
        Tensor::build(param, grad, param_dtype, grad_dtype, shape, None)
    }

    fn build(
        param: *mut c_void,
        grad: *const c_void,
        param_dtype: DType,
        grad_dtype: DType,
        shape: &[usize],
        host: Option<HostLens>,
    ) -> Tensor<'a> {
        Tensor {
            param,
            grad,
            param_dtype,
            grad_dtype,
            shape: shape.to_vec(),
            name: None,
            layout: Layout::RowMajor,
            outer: None,
            inner: None,
            host,
            _borrow: PhantomData,
        }
    }

    /// A name used in libdion's error messages (copied by libdion).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The memory layout (column-major is for 2-D tensors only).
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// Shards the tensor over the outer (FSDP) mesh.
    pub fn shard_outer(mut self, dim: usize, offset: usize, extent: usize) -> Self {
        self.outer = Some(Shard { dim, offset, extent });
        self
    }

    /// Shards the tensor over the inner (tensor-parallel) mesh.
    pub fn shard_inner(mut self, dim: usize, offset: usize, extent: usize) -> Self {
        self.inner = Some(Shard { dim, offset, extent });
        self
    }

    fn label(&self, i: usize) -> String {
        match &self.name {
            Some(n) => format!("tensors[{i}] ('{n}')"),
            None => format!("tensors[{i}]"),
        }
    }

    /// The local number of elements, as libdion computes it once the shards
    /// are valid (libdion rejects invalid shards before touching memory).
    fn local_numel(&self, func: &str, i: usize) -> Result<usize> {
        let mut local = self.shape.clone();
        for s in [self.outer, self.inner].into_iter().flatten() {
            if s.dim < local.len() {
                local[s.dim] = s.extent;
            }
        }
        local
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::invalid(format!("{func}: {}: the number of elements overflows usize", self.label(i))))
    }

    /// Checks what only the bindings know (slice lengths) and fills the C descriptor.
    fn to_raw(&self, func: &str, i: usize, backend: Backend, name: Option<&CString>) -> Result<sys::dion_tensor_t> {
        let label = self.label(i);
        if self.shape.len() > sys::DION_MAX_DIMS {
            return Err(Error::invalid(format!(
                "{func}: {label}: ndim = {} exceeds DION_MAX_DIMS = {}",
                self.shape.len(),
                sys::DION_MAX_DIMS
            )));
        }
        if let Some(h) = self.host {
            if backend != Backend::Host {
                return Err(Error::invalid(format!(
                    "{func}: {label}: host slices need an optimizer on the host backend (this one is {backend:?}); \
                     use the unsafe Tensor::from_raw for device memory"
                )));
            }
            let n = self.local_numel(func, i)?;
            if h.param != n {
                return Err(Error::invalid(format!(
                    "{func}: {label}: param has {} elements but shape {:?} (local) has {n}",
                    h.param, self.shape
                )));
            }
            if let Some(g) = h.grad {
                if g != n {
                    return Err(Error::invalid(format!(
                        "{func}: {label}: grad has {g} elements but shape {:?} (local) has {n}",
                        self.shape
                    )));
                }
            }
        }
        let i64_of = |v: usize, what: &str| {
            i64::try_from(v)
                .map_err(|_| Error::invalid(format!("{func}: {label}: {what} = {v} does not fit in int64_t")))
        };
        let mut raw = std::mem::MaybeUninit::<sys::dion_tensor_t>::zeroed();
        // SAFETY: a valid pointer; dion_tensor_init writes every field.
        let mut raw = unsafe {
            sys::dion_tensor_init(raw.as_mut_ptr());
            raw.assume_init()
        };
        raw.struct_size = size_of::<sys::dion_tensor_t>();
        raw.name = name.map_or(ptr::null(), |n| n.as_ptr());
        raw.param = self.param;
        raw.grad = self.grad;
        raw.param_dtype = self.param_dtype.to_raw();
        raw.grad_dtype = self.grad_dtype.to_raw();
        raw.layout = self.layout.to_raw();
        raw.ndim = self.shape.len() as i32;
        for (k, &d) in self.shape.iter().enumerate() {
            raw.shape[k] = i64_of(d, "shape")?;
        }
        if let Some(s) = self.outer {
            raw.outer_shard_dim = to_i32(s.dim, "outer shard dim", func)?;
            raw.outer_offset = i64_of(s.offset, "outer offset")?;
            raw.outer_extent = i64_of(s.extent, "outer extent")?;
        }
        if let Some(s) = self.inner {
            raw.inner_shard_dim = to_i32(s.dim, "inner shard dim", func)?;
            raw.inner_offset = i64_of(s.offset, "inner offset")?;
            raw.inner_extent = i64_of(s.extent, "inner extent")?;
        }
        Ok(raw)
    }
}

impl fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name)
            .field("shape", &self.shape)
            .field("param_dtype", &self.param_dtype)
            .field("grad_dtype", &self.grad_dtype)
            .field("layout", &self.layout)
            .field("outer", &self.outer)
            .field("inner", &self.inner)
            .field("host", &self.host.is_some())
            .finish()
    }
}

#[derive(Clone, Copy, Debug)]
struct HostBufs {
    param_len: usize,
    param_dtype: DType,
    grad: Option<(usize, DType)>,
}

/// The buffers of one tensor for one [`Optimizer::step`]: borrowed for the
/// duration of the step.
pub struct Buffers<'a> {
    param: *mut c_void,
    grad: *const c_void,
    host: Option<HostBufs>,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Buffers<'a> {
    /// Host slices; their lengths and element types must be those the tensor
    /// was added with.
    pub fn new<P: Element, G: Element>(param: &'a mut [P], grad: &'a [G]) -> Self {
        Buffers {
            param: param.as_mut_ptr().cast(),
            grad: grad.as_ptr().cast(),
            host: Some(HostBufs { param_len: param.len(), param_dtype: P::DTYPE, grad: Some((grad.len(), G::DTYPE)) }),
            _borrow: PhantomData,
        }
    }

    /// A parameter without a gradient this step: the tensor is skipped.
    pub fn without_grad<P: Element>(param: &'a mut [P]) -> Self {
        Buffers {
            param: param.as_mut_ptr().cast(),
            grad: ptr::null(),
            host: Some(HostBufs { param_len: param.len(), param_dtype: P::DTYPE, grad: None }),
            _borrow: PhantomData,
        }
    }

    /// Raw pointers (e.g. device memory); `grad` may be NULL (tensor skipped).
    ///
    /// # Safety
    ///
    /// As for [`Tensor::from_raw`]: the pointers must be valid, in the
    /// backend's memory, of the tensor's local size and dtypes, and unaliased
    /// for as long as libdion may use them (through the step's completion on
    /// the CUDA backend, and by later [`Optimizer::step_bound`] calls).
    pub unsafe fn from_raw(param: *mut c_void, grad: *const c_void) -> Buffers<'static> {
        Buffers { param, grad, host: None, _borrow: PhantomData }
    }
}

impl fmt::Debug for Buffers<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffers")
            .field("param", &self.param)
            .field("grad", &self.grad)
            .field("host", &self.host)
            .finish()
    }
}

/// What the bindings remember of each tensor added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's number (its order of addition across groups).
    pub index: usize,
    /// Its group.
    pub group: usize,
    /// Its name (libdion's default, `tensors[i]`, if none was given).
    pub name: String,
    /// Its global shape.
    pub shape: Vec<usize>,
    /// The number of elements of its local buffers.
    pub local_numel: usize,
    /// The parameter's dtype.
    pub param_dtype: DType,
    /// The gradient's dtype.
    pub grad_dtype: DType,
}

// ===========================================================================
// Communicators
// ===========================================================================

/// An NCCL unique id (`dion_nccl_unique_id_t`): send its bytes to every rank.
#[derive(Clone, Copy)]
pub struct NcclUniqueId(pub [u8; sys::DION_NCCL_UNIQUE_ID_BYTES]);

impl fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclUniqueId(..)")
    }
}

/// A mesh communicator (`dion_comm_t`), destroyed on drop. Give it to an
/// optimizer through [`Comms`]; the optimizer then owns it and destroys it
/// after itself, as libdion requires.
pub struct Comm {
    raw: sys::dion_comm_t,
}

// SAFETY: a communicator has no thread affinity in libdion. It is not Sync:
// libdion's abort flag is a plain field, and NCCL/MPI communicators must not be
// used by two threads at once.
unsafe impl Send for Comm {}

impl Comm {
    /// A fresh NCCL unique id (`dion_nccl_get_unique_id`); NOT_SUPPORTED without NCCL.
    pub fn nccl_unique_id() -> Result<NcclUniqueId> {
        let mut id = sys::dion_nccl_unique_id_t { internal: [0; sys::DION_NCCL_UNIQUE_ID_BYTES] };
        // SAFETY: a valid pointer.
        check(unsafe { sys::dion_nccl_get_unique_id(&mut id) }, ptr::null_mut())?;
        Ok(NcclUniqueId(id.internal.map(|c| c as u8)))
    }

    /// A new NCCL communicator of `nranks` ranks on CUDA `device`
    /// (`dion_comm_init_nccl`; collective over the ranks).
    pub fn init_nccl(id: &NcclUniqueId, nranks: i32, rank: i32, device: i32) -> Result<Comm> {
        let id = sys::dion_nccl_unique_id_t { internal: id.0.map(|b| b as std::os::raw::c_char) };
        let mut raw = ptr::null_mut();
        // SAFETY: valid pointers.
        check(unsafe { sys::dion_comm_init_nccl(&mut raw, &id, nranks, rank, device) }, ptr::null_mut())?;
        Ok(Comm { raw })
    }

    /// Wraps a caller-created `ncclComm_t` (`dion_comm_adopt_nccl`).
    ///
    /// # Safety
    ///
    /// `nccl_comm` must be a valid NCCL communicator that outlives the
    /// returned `Comm` and every optimizer using it, and that nothing else
    /// uses concurrently with them.
    pub unsafe fn adopt_nccl(nccl_comm: *mut sys::ncclComm) -> Result<Comm> {
        let mut raw = ptr::null_mut();
        // SAFETY: the caller vouches for nccl_comm.
        check(unsafe { sys::dion_comm_adopt_nccl(&mut raw, nccl_comm) }, ptr::null_mut())?;
        Ok(Comm { raw })
    }

    /// Wraps (a duplicate of) an MPI communicator given by its Fortran handle
    /// (`dion_comm_from_mpi_fint`); NOT_SUPPORTED without MPI.
    ///
    /// # Safety
    ///
    /// MPI must be initialized and `fortran_comm` must be a valid Fortran
    /// handle (`MPI_Comm_c2f`) of a communicator: MPI's behaviour on an invalid
    /// handle is undefined.
    pub unsafe fn from_mpi_fint(fortran_comm: i32) -> Result<Comm> {
        let mut raw = ptr::null_mut();
        // SAFETY: the caller vouches for the handle.
        check(unsafe { sys::dion_comm_from_mpi_fint(&mut raw, fortran_comm) }, ptr::null_mut())?;
        Ok(Comm { raw })
    }

    /// Number of ranks.
    pub fn size(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: a live communicator and a valid pointer.
        check(unsafe { sys::dion_comm_size(self.raw, &mut v) }, ptr::null_mut())?;
        Ok(v)
    }

    /// This process's rank.
    pub fn rank(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: a live communicator and a valid pointer.
        check(unsafe { sys::dion_comm_rank(self.raw, &mut v) }, ptr::null_mut())?;
        Ok(v)
    }

    /// Aborts the communicator (`dion_comm_abort`): later collectives and steps
    /// through it fail instead of hanging.
    pub fn abort(&mut self) -> Result<()> {
        // SAFETY: a live communicator, not in use elsewhere (&mut).
        check(unsafe { sys::dion_comm_abort(self.raw) }, ptr::null_mut())
    }

    /// The C handle.
    pub fn as_raw(&self) -> sys::dion_comm_t {
        self.raw
    }

    /// Takes ownership of a C handle.
    ///
    /// # Safety
    ///
    /// `raw` must be a live `dion_comm_t` owned by nobody else; it is destroyed
    /// when the returned `Comm` is dropped.
    pub unsafe fn from_raw(raw: sys::dion_comm_t) -> Comm {
        Comm { raw }
    }

    /// Gives up ownership of the C handle (the caller must destroy it).
    pub fn into_raw(self) -> sys::dion_comm_t {
        let raw = self.raw;
        std::mem::forget(self);
        raw
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        if raw.is_null() {
            return;
        }
        // SAFETY: we own the handle and every optimizer using it is gone.
        let s = unsafe { sys::dion_comm_destroy(raw) };
        if s != sys::dion_status_t::DION_SUCCESS {
            log_error("dion_comm_destroy", &Error::last(s, ptr::null_mut()));
        }
    }
}

impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Comm").field("raw", &self.raw).finish()
    }
}

/// The communicators of an optimizer's meshes (absent: size 1).
#[derive(Debug, Default)]
pub struct Comms {
    /// Data-parallel replicas.
    pub replicate: Option<Comm>,
    /// Outer shard (FSDP).
    pub outer: Option<Comm>,
    /// Inner shard (tensor parallel).
    pub inner: Option<Comm>,
}

// ===========================================================================
// The optimizer
// ===========================================================================

/// Steps skipped for non-finite gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SkippedSteps {
    /// Steps skipped since creation.
    pub total: i64,
    /// Whether the last step was skipped.
    pub last: bool,
}

/// Bytes communicated over a mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommBytes {
    /// By the last step.
    pub last_step: u64,
    /// Since creation.
    pub total: u64,
}

/// Memory libdion holds for an optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Optimizer state.
    pub state_bytes: u64,
    /// Workspace.
    pub workspace_bytes: u64,
}

/// One state buffer (`dion_state_info_t`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateInfo {
    /// The state's index (for [`Optimizer::read_state`] and friends).
    pub index: usize,
    /// The tensor it belongs to.
    pub tensor: usize,
    /// That tensor's group.
    pub group: usize,
    /// `"momentum"`, `"Q"`, `"variance"` or `"variance_neuron"`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Layout of the local shard.
    pub layout: Layout,
    /// Global shape.
    pub global_shape: Vec<i64>,
    /// Shape of the local shard.
    pub local_shape: Vec<i64>,
    /// Where the local shard starts in the global state.
    pub local_offset: Vec<i64>,
    /// Bytes of the local shard.
    pub local_bytes: u64,
}

/// A libdion optimizer (`dion_optimizer_t`), destroyed on drop. See the
/// [crate documentation](crate) for how buffers are passed.
pub struct Optimizer {
    handle: sys::dion_optimizer_t,
    backend: Backend,
    groups: usize,
    tensors: Vec<TensorInfo>,
    // Declared after `handle` and dropped after Drop::drop has destroyed it:
    // libdion requires communicators to outlive their optimizers.
    _comms: Comms,
}

// SAFETY: libdion handles have no thread affinity ("distinct handles are fully
// independent"), so an Optimizer may move between threads. It is not Sync
// (the raw handle field already makes it !Sync): one handle must not be used
// by two threads at the same time.
unsafe impl Send for Optimizer {}

impl Optimizer {
    /// Creates an optimizer with no groups (`dion_create`), after checking the
    /// loaded library's major version.
    pub fn new(options: &OptimizerOptions) -> Result<Optimizer> {
        Self::with_comms(options, Comms::default())
    }

    /// Creates an optimizer over the given meshes (collective over them). The
    /// optimizer owns the communicators and destroys them after itself; on
    /// failure they are destroyed at once.
    pub fn with_comms(options: &OptimizerOptions, comms: Comms) -> Result<Optimizer> {
        check_version()?;
        let mut raw = options.to_raw();
        let ptr_of = |c: &Option<Comm>| c.as_ref().map_or(ptr::null_mut(), Comm::as_raw);
        raw.replicate_comm = ptr_of(&comms.replicate);
        raw.outer_comm = ptr_of(&comms.outer);
        raw.inner_comm = ptr_of(&comms.inner);
        let mut handle = ptr::null_mut();
        // SAFETY: valid pointers; the communicators are live and kept alive by
        // the Optimizer.
        check(unsafe { sys::dion_create(&mut handle, &raw) }, ptr::null_mut())?;
        if handle.is_null() {
            return Err(Error::new(Status::INTERNAL, "dion_create succeeded but returned NULL"));
        }
        Ok(Optimizer {
            handle,
            backend: Backend::from_raw(raw.backend).unwrap_or(Backend::Host),
            groups: 0,
            tensors: Vec::new(),
            _comms: comms,
        })
    }

    /// The C handle, for calls this layer does not wrap. It stays owned by
    /// the `Optimizer`; do not destroy it.
    pub fn as_raw(&self) -> sys::dion_optimizer_t {
        self.handle
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The message of the last failed call on this handle (`dion_last_error`).
    pub fn last_error(&self) -> String {
        last_error_message(self.handle)
    }

    fn check(&self, s: sys::dion_status_t) -> Result<()> {
        check(s, self.handle)
    }

    fn group_i32(&self, group: usize, func: &str) -> Result<i32> {
        to_i32(group, "group", func)
    }

    /// Adds a group of tensors with the given options (`dion_add_group`) and
    /// returns its index. Tensors are numbered across groups in the order they
    /// are added; [`step`](Self::step) takes their buffers in that order. On
    /// error nothing is added.
    pub fn add_group<'b>(
        &mut self,
        options: &GroupOptions,
        tensors: impl IntoIterator<Item = Tensor<'b>>,
    ) -> Result<usize> {
        const F: &str = "dion_add_group";
        if !options.init_status.is_success() {
            return Err(Error::new(
                options.init_status,
                format!("dion_group_options_init failed ({})", options.init_status.description()),
            ));
        }
        let tensors: Vec<Tensor<'b>> = tensors.into_iter().collect();
        let names = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| match &t.name {
                Some(n) => CString::new(n.as_str())
                    .map(Some)
                    .map_err(|_| Error::invalid(format!("{F}: {}: the name contains a NUL byte", t.label(i)))),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let raws = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| t.to_raw(F, i, self.backend, names[i].as_ref()))
            .collect::<Result<Vec<_>>>()?;
        // libdion reads the first struct_size bytes of the options: never let a
        // value from GroupOptions::from_raw make it read past our struct.
        let mut group_options = *options.as_raw();
        group_options.struct_size = size_of::<sys::dion_group_options_t>();
        let mut gi = -1i32;
        // SAFETY: `group_options` and `raws` are valid for the call; each descriptor's
        // buffers are borrowed by `tensors` (alive until this function returns)
        // or vouched for by an unsafe constructor; names outlive the call and
        // are copied by libdion.
        self.check(unsafe { sys::dion_add_group(self.handle, &group_options, raws.as_ptr(), raws.len(), &mut gi) })?;
        let group = to_usize(gi, "group index")?;
        for (i, t) in tensors.iter().enumerate() {
            // Cannot fail now: libdion validated the shape and shards.
            let local_numel = t.local_numel(F, i)?;
            let index = self.tensors.len();
            self.tensors.push(TensorInfo {
                index,
                group,
                name: t.name.clone().unwrap_or_else(|| format!("tensors[{i}]")),
                shape: t.shape.clone(),
                local_numel,
                param_dtype: t.param_dtype,
                grad_dtype: t.grad_dtype,
            });
        }
        self.groups = group + 1;
        Ok(group)
    }

    /// The tensors added so far, in order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Number of groups (`dion_group_count`).
    pub fn group_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: a live handle and a valid pointer.
        self.check(unsafe { sys::dion_group_count(self.handle, &mut n) })?;
        to_usize(n, "group count")
    }

    /// Number of tensors (`dion_tensor_count`).
    pub fn tensor_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: a live handle and a valid pointer.
        self.check(unsafe { sys::dion_tensor_count(self.handle, &mut n) })?;
        to_usize(n, "tensor count")
    }

    /// Sets a hyperparameter of a group; it takes effect at the next step
    /// (`dion_group_set_hparam`).
    pub fn set_hparam(&mut self, group: usize, hparam: Hparam, value: f64) -> Result<()> {
        let g = self.group_i32(group, "dion_group_set_hparam")?;
        // SAFETY: a live handle.
        self.check(unsafe { sys::dion_group_set_hparam(self.handle, g, hparam.to_raw(), value) })
    }

    /// Gets a hyperparameter of a group (`dion_group_get_hparam`).
    pub fn hparam(&self, group: usize, hparam: Hparam) -> Result<f64> {
        let g = self.group_i32(group, "dion_group_get_hparam")?;
        let mut v = 0.0;
        // SAFETY: a live handle and a valid pointer.
        self.check(unsafe { sys::dion_group_get_hparam(self.handle, g, hparam.to_raw(), &mut v) })?;
        Ok(v)
    }

    /// Sets a group's learning rate (for schedules).
    pub fn set_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        self.set_hparam(group, Hparam::Lr, lr)
    }

    /// A group's learning rate.
    pub fn lr(&self, group: usize) -> Result<f64> {
        self.hparam(group, Hparam::Lr)
    }

    /// A group's step counter: the number of steps not skipped since creation
    /// or [`set_step_count`](Self::set_step_count) (`dion_group_get_step`).
    pub fn step_count(&self, group: usize) -> Result<i64> {
        let g = self.group_i32(group, "dion_group_get_step")?;
        let mut v = 0;
        // SAFETY: a live handle and a valid pointer.
        self.check(unsafe { sys::dion_group_get_step(self.handle, g, &mut v) })?;
        Ok(v)
    }

    /// Restores a group's step counter from a checkpoint (`dion_group_set_step`).
    pub fn set_step_count(&mut self, group: usize, step: i64) -> Result<()> {
        let g = self.group_i32(group, "dion_group_set_step")?;
        // SAFETY: a live handle.
        self.check(unsafe { sys::dion_group_set_step(self.handle, g, step) })
    }

    /// Points tensor `tensor` at new buffers (`dion_tensor_rebind`), for
    /// [`step_bound`](Self::step_bound). `grad` may be NULL (tensor skipped).
    ///
    /// # Safety
    ///
    /// As for [`Tensor::from_raw`]: the pointers must be valid for the tensor's
    /// local size and dtypes, in the backend's memory, and stay valid and
    /// unaliased for as long as libdion may use them (every later
    /// `step_bound` until the next re-bind, and until work enqueued by those
    /// steps has completed).
    pub unsafe fn rebind(&mut self, tensor: usize, param: *mut c_void, grad: *const c_void) -> Result<()> {
        let t = to_i32(tensor, "tensor", "dion_tensor_rebind")?;
        // SAFETY: the caller vouches for the pointers.
        self.check(unsafe { sys::dion_tensor_rebind(self.handle, t, param, grad) })
    }

    /// One optimizer step over every group (`dion_step`): `buffers` holds the
    /// buffers of every tensor, in the order the tensors were added. The
    /// parameters are updated in place; the step is complete on return (host
    /// backend). A step whose gradients hold NaN/Inf changes nothing when
    /// `skip_nonfinite` is on (see [`skipped_steps`](Self::skipped_steps)).
    pub fn step<'b>(&mut self, buffers: impl IntoIterator<Item = Buffers<'b>>) -> Result<()> {
        let buffers: Vec<Buffers<'b>> = buffers.into_iter().collect();
        self.bind_all("dion::Optimizer::step", &buffers)?;
        // SAFETY: every tensor is bound to buffers borrowed by `buffers` (alive
        // and exclusively ours until we return; on the host backend the step
        // completes before returning) or vouched for by Buffers::from_raw.
        self.check(unsafe { sys::dion_step(self.handle, ptr::null_mut()) })
    }

    fn bind_all(&mut self, func: &str, buffers: &[Buffers<'_>]) -> Result<()> {
        if buffers.len() != self.tensors.len() {
            return Err(Error::invalid(format!(
                "{func}: got buffers for {} tensors but the optimizer has {} (one per tensor, in the order added)",
                buffers.len(),
                self.tensors.len()
            )));
        }
        for (b, t) in buffers.iter().zip(&self.tensors) {
            let Some(h) = b.host else { continue };
            let label = format!("buffers[{}] (tensor '{}')", t.index, t.name);
            if self.backend != Backend::Host {
                return Err(Error::invalid(format!(
                    "{func}: {label}: host slices need an optimizer on the host backend (this one is {:?}); use the \
                     unsafe Buffers::from_raw for device memory",
                    self.backend
                )));
            }
            if h.param_dtype != t.param_dtype || h.param_len != t.local_numel {
                return Err(Error::invalid(format!(
                    "{func}: {label}: param is {} elements of {:?}, the tensor was added with {} of {:?}",
                    h.param_len, h.param_dtype, t.local_numel, t.param_dtype
                )));
            }
            if let Some((len, dt)) = h.grad {
                if dt != t.grad_dtype || len != t.local_numel {
                    return Err(Error::invalid(format!(
                        "{func}: {label}: grad is {len} elements of {dt:?}, the tensor was added with {} of {:?}",
                        t.local_numel, t.grad_dtype
                    )));
                }
            }
        }
        for (i, b) in buffers.iter().enumerate() {
            // SAFETY: checked above (or vouched for by Buffers::from_raw); the
            // pointers are only used by the dion_step that follows.
            unsafe { self.rebind(i, b.param, b.grad)? };
        }
        Ok(())
    }

    /// One step with the buffers last bound (by `add_group`, [`rebind`](Self::rebind)
    /// or a previous step), enqueued on `stream` (NULL: the legacy default
    /// stream; ignored on the host backend).
    ///
    /// # Safety
    ///
    /// Every tensor's last-bound pointers must be valid as described in
    /// [`Tensor::from_raw`] at the time of the call and until the step's work
    /// has completed — in particular, buffers given to [`step`](Self::step) or
    /// to [`add_group`](Self::add_group) as host slices are only borrowed for
    /// that call and must be re-bound. `stream` must be NULL or a valid CUDA
    /// stream of the optimizer's device.
    pub unsafe fn step_bound(&mut self, stream: sys::dion_stream_t) -> Result<()> {
        // SAFETY: the caller vouches for the bound pointers and the stream.
        self.check(unsafe { sys::dion_step(self.handle, stream) })
    }

    /// Averages the decoupled optimizer states over the replicate mesh before
    /// a checkpoint (`dion_sync_for_checkpoint`; collective), on the default stream.
    pub fn sync_for_checkpoint(&mut self) -> Result<()> {
        // SAFETY: a live handle; touches only libdion's own state.
        self.check(unsafe { sys::dion_sync_for_checkpoint(self.handle, ptr::null_mut()) })
    }

    /// Steps skipped for non-finite gradients (`dion_get_skipped_steps`).
    pub fn skipped_steps(&self) -> Result<SkippedSteps> {
        let (mut total, mut last) = (0i64, 0i32);
        // SAFETY: a live handle and valid pointers.
        self.check(unsafe { sys::dion_get_skipped_steps(self.handle, &mut total, &mut last, ptr::null_mut()) })?;
        Ok(SkippedSteps { total, last: last != 0 })
    }

    /// The first error found by work already enqueued, if any (`dion_get_async_error`).
    pub fn async_error(&self) -> Result<Option<Error>> {
        let mut s = sys::dion_status_t::DION_SUCCESS;
        // SAFETY: a live handle and a valid pointer.
        self.check(unsafe { sys::dion_get_async_error(self.handle, &mut s) })?;
        Ok(if s == sys::dion_status_t::DION_SUCCESS {
            None
        } else {
            let status = Status::from(s);
            Some(Error::new(status, format!("asynchronous error: {}", status.description())))
        })
    }

    /// Bytes communicated over `mesh` (`dion_get_comm_bytes`).
    pub fn comm_bytes(&self, mesh: Mesh) -> Result<CommBytes> {
        let (mut last_step, mut total) = (0u64, 0u64);
        // SAFETY: a live handle and valid pointers.
        self.check(unsafe { sys::dion_get_comm_bytes(self.handle, mesh.to_raw(), &mut last_step, &mut total) })?;
        Ok(CommBytes { last_step, total })
    }

    /// Memory libdion holds for this optimizer (`dion_get_memory_usage`).
    pub fn memory_usage(&self) -> Result<MemoryUsage> {
        let (mut state_bytes, mut workspace_bytes) = (0u64, 0u64);
        // SAFETY: a live handle and valid pointers.
        self.check(unsafe { sys::dion_get_memory_usage(self.handle, &mut state_bytes, &mut workspace_bytes) })?;
        Ok(MemoryUsage { state_bytes, workspace_bytes })
    }

    // ---- optimizer state ----

    /// Number of state buffers (`dion_state_count`).
    pub fn state_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: a live handle and a valid pointer.
        self.check(unsafe { sys::dion_state_count(self.handle, &mut n) })?;
        to_usize(n, "state count")
    }

    /// Describes state buffer `index` (`dion_state_info`).
    pub fn state_info(&self, index: usize) -> Result<StateInfo> {
        let i = to_i32(index, "index", "dion_state_info")?;
        let raw = std::mem::MaybeUninit::<sys::dion_state_info_t>::zeroed();
        // SAFETY: all-zero bytes are a valid dion_state_info_t (NULL name).
        let mut raw = unsafe { raw.assume_init() };
        raw.struct_size = size_of::<sys::dion_state_info_t>();
        // SAFETY: a live handle and a valid pointer with struct_size set.
        self.check(unsafe { sys::dion_state_info(self.handle, i, &mut raw) })?;
        let name = if raw.name.is_null() {
            String::new()
        } else {
            // SAFETY: libdion's NUL-terminated string, alive as long as the optimizer.
            unsafe { CStr::from_ptr(raw.name) }.to_string_lossy().into_owned()
        };
        let unknown = |what: &str, v: i32| {
            Error::new(Status::INTERNAL, format!("dion_state_info: state {index} ('{name}') has unknown {what} {v}"))
        };
        let nd = (raw.ndim.max(0) as usize).min(sys::DION_MAX_DIMS);
        Ok(StateInfo {
            index,
            tensor: to_usize(raw.tensor, "tensor index")?,
            group: to_usize(raw.group, "group index")?,
            dtype: DType::from_raw(raw.dtype).ok_or_else(|| unknown("dtype", raw.dtype))?,
            layout: Layout::from_raw(raw.layout).ok_or_else(|| unknown("layout", raw.layout))?,
            global_shape: raw.global_shape[..nd].to_vec(),
            local_shape: raw.local_shape[..nd].to_vec(),
            local_offset: raw.local_offset[..nd].to_vec(),
            local_bytes: raw.local_bytes,
            name,
        })
    }

    /// Every state buffer, in libdion's (rank-symmetric) order.
    pub fn states(&self) -> Result<Vec<StateInfo>> {
        (0..self.state_count()?).map(|i| self.state_info(i)).collect()
    }

    /// The index of the state called `name` of tensor `tensor` (`dion_state_find`).
    pub fn find_state(&self, tensor: usize, name: &str) -> Result<usize> {
        let t = to_i32(tensor, "tensor", "dion_state_find")?;
        let cname = CString::new(name).map_err(|_| Error::invalid("dion_state_find: the name contains a NUL byte"))?;
        let mut idx = -1;
        // SAFETY: a live handle and valid pointers.
        self.check(unsafe { sys::dion_state_find(self.handle, t, cname.as_ptr(), &mut idx) })?;
        to_usize(idx, "state index")
    }

    fn require_host(&self, func: &str) -> Result<()> {
        if self.backend == Backend::Host {
            Ok(())
        } else {
            Err(Error::new(
                Status::NOT_SUPPORTED,
                format!(
                    "{func}: the safe state copies need the host backend (this optimizer is {:?}: copies are \
                     enqueued on a stream); use the unsafe read_state_raw / write_state_raw",
                    self.backend
                ),
            ))
        }
    }

    /// Copies the local shard of state `index` into `dst`, which must hold at
    /// least its `local_bytes` (`dion_state_read`). Host backend.
    pub fn read_state_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        self.require_host("dion::Optimizer::read_state_into")?;
        let i = to_i32(index, "index", "dion_state_read")?;
        // SAFETY: dst is valid for dst.len() bytes, and libdion writes at most
        // local_bytes <= dst.len() (it checks); complete on return (host).
        self.check(unsafe {
            sys::dion_state_read(self.handle, i, dst.as_mut_ptr().cast(), dst.len() as u64, ptr::null_mut())
        })
    }

    /// The local shard of state `index` as bytes. Host backend.
    pub fn read_state(&self, index: usize) -> Result<Vec<u8>> {
        let info = self.state_info(index)?;
        let mut v = vec![0u8; byte_len(info.local_bytes)?];
        self.read_state_into(index, &mut v)?;
        Ok(v)
    }

    /// Overwrites the local shard of state `index` with the first
    /// `local_bytes` of `src` (`dion_state_write`). Host backend.
    pub fn write_state(&mut self, index: usize, src: &[u8]) -> Result<()> {
        self.require_host("dion::Optimizer::write_state")?;
        let i = to_i32(index, "index", "dion_state_write")?;
        // SAFETY: src is valid for src.len() bytes and libdion reads at most
        // local_bytes <= src.len() (it checks); complete on return (host).
        self.check(unsafe {
            sys::dion_state_write(self.handle, i, src.as_ptr().cast(), src.len() as u64, ptr::null_mut())
        })
    }

    fn typed_state_info<T: Element>(&self, index: usize, func: &str) -> Result<StateInfo> {
        let info = self.state_info(index)?;
        if info.dtype != T::DTYPE {
            return Err(Error::invalid(format!(
                "{func}: state {index} ('{}' of tensor {}) is {:?}, not {:?}",
                info.name,
                info.tensor,
                info.dtype,
                T::DTYPE
            )));
        }
        Ok(info)
    }

    /// The local shard of state `index` as elements of its dtype (`T` must
    /// match it). Host backend.
    pub fn read_state_as<T: Element>(&self, index: usize) -> Result<Vec<T>> {
        let info = self.typed_state_info::<T>(index, "dion::Optimizer::read_state_as")?;
        let n = byte_len(info.local_bytes)? / size_of::<T>();
        let mut v = vec![T::default(); n];
        // SAFETY: T is f32/Bf16/F16: plain bytes, any bit pattern valid.
        let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), n * size_of::<T>()) };
        self.read_state_into(index, bytes)?;
        Ok(v)
    }

    /// Overwrites state `index` with `src`, which must have exactly its number
    /// of elements and its dtype. Host backend.
    pub fn write_state_from<T: Element>(&mut self, index: usize, src: &[T]) -> Result<()> {
        const F: &str = "dion::Optimizer::write_state_from";
        let info = self.typed_state_info::<T>(index, F)?;
        if std::mem::size_of_val(src) as u64 != info.local_bytes {
            return Err(Error::invalid(format!(
                "{F}: state {index} ('{}' of tensor {}) has {} elements, got {}",
                info.name,
                info.tensor,
                info.local_bytes / size_of::<T>() as u64,
                src.len()
            )));
        }
        // SAFETY: plain bytes of a live slice.
        let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src)) };
        self.write_state(index, bytes)
    }

    /// [`read_state_as::<f32>`](Self::read_state_as).
    pub fn read_state_f32(&self, index: usize) -> Result<Vec<f32>> {
        self.read_state_as::<f32>(index)
    }

    /// [`write_state_from::<f32>`](Self::write_state_from).
    pub fn write_state_f32(&mut self, index: usize, src: &[f32]) -> Result<()> {
        self.write_state_from::<f32>(index, src)
    }

    /// `dion_state_read` into any memory, enqueued on `stream`.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for writes of `bytes` bytes (host memory, or device
    /// memory of the optimizer's device on the CUDA backend) until the copy
    /// enqueued on `stream` has completed; `stream` must be NULL or valid.
    pub unsafe fn read_state_raw(
        &self,
        index: usize,
        dst: *mut c_void,
        bytes: u64,
        stream: sys::dion_stream_t,
    ) -> Result<()> {
        let i = to_i32(index, "index", "dion_state_read")?;
        // SAFETY: the caller vouches for dst and stream.
        self.check(unsafe { sys::dion_state_read(self.handle, i, dst, bytes, stream) })
    }

    /// `dion_state_write` from any memory, enqueued on `stream`.
    ///
    /// # Safety
    ///
    /// `src` must be valid for reads of `bytes` bytes (host memory, or device
    /// memory of the optimizer's device on the CUDA backend) and not be
    /// modified until the copy enqueued on `stream` has completed; `stream`
    /// must be NULL or valid.
    pub unsafe fn write_state_raw(
        &mut self,
        index: usize,
        src: *const c_void,
        bytes: u64,
        stream: sys::dion_stream_t,
    ) -> Result<()> {
        let i = to_i32(index, "index", "dion_state_write")?;
        // SAFETY: the caller vouches for src and stream.
        self.check(unsafe { sys::dion_state_write(self.handle, i, src, bytes, stream) })
    }
}

fn byte_len(b: u64) -> Result<usize> {
    usize::try_from(b).map_err(|_| Error::new(Status::OUT_OF_MEMORY, format!("{b} bytes do not fit in memory")))
}

impl Drop for Optimizer {
    fn drop(&mut self) {
        // Swap the handle out first so that nothing can see a destroyed one.
        let h = std::mem::replace(&mut self.handle, ptr::null_mut());
        if h.is_null() {
            return;
        }
        // SAFETY: we own the handle and it is live.
        let s = unsafe { sys::dion_destroy(h) };
        if s != sys::dion_status_t::DION_SUCCESS {
            log_error("dion_destroy", &Error::last(s, ptr::null_mut()));
        }
        // `_comms` is dropped after this, destroying the communicators.
    }
}

impl fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Optimizer")
            .field("handle", &self.handle)
            .field("backend", &self.backend)
            .field("groups", &self.groups)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send<T: Send>() {}

    #[test]
    fn optimizer_and_comm_are_send() {
        assert_send::<Optimizer>();
        assert_send::<Comm>();
        assert_send::<GroupOptions>();
        assert_send::<OptimizerOptions>();
    }

    #[test]
    fn status_debug_display_and_names() {
        assert_eq!(format!("{:?}", Status::INVALID_ARGUMENT), "INVALID_ARGUMENT(1)");
        assert_eq!(format!("{:?}", Status(99)), "Status(99)");
        assert!(Status::INVALID_ARGUMENT.description().starts_with("invalid argument"));
        assert_eq!(Status(99).description(), "unknown status");
        assert!(Status::SUCCESS.is_success() && !Status::INTERNAL.is_success());
        // Every named status is the C constant of that name.
        let pairs = [
            (Status::SUCCESS, sys::dion_status_t::DION_SUCCESS),
            (Status::INVALID_ARGUMENT, sys::dion_status_t::DION_ERROR_INVALID_ARGUMENT),
            (Status::INVALID_USAGE, sys::dion_status_t::DION_ERROR_INVALID_USAGE),
            (Status::NOT_SUPPORTED, sys::dion_status_t::DION_ERROR_NOT_SUPPORTED),
            (Status::OUT_OF_MEMORY, sys::dion_status_t::DION_ERROR_OUT_OF_MEMORY),
            (Status::CUDA, sys::dion_status_t::DION_ERROR_CUDA),
            (Status::CUBLAS, sys::dion_status_t::DION_ERROR_CUBLAS),
            (Status::CUSOLVER, sys::dion_status_t::DION_ERROR_CUSOLVER),
            (Status::NCCL, sys::dion_status_t::DION_ERROR_NCCL),
            (Status::MPI, sys::dion_status_t::DION_ERROR_MPI),
            (Status::NUMERICAL, sys::dion_status_t::DION_ERROR_NUMERICAL),
            (Status::INTERNAL, sys::dion_status_t::DION_ERROR_INTERNAL),
        ];
        for (s, c) in pairs {
            assert_eq!(sys::dion_status_t::from(s), c);
            assert!(s.name().is_some());
        }
    }

    #[test]
    fn error_formats_show_code_and_message() {
        let e = Error::new(Status::INVALID_ARGUMENT, "dion_add_group: lr = -1 is out of range");
        assert_eq!(
            format!("{e:?}"),
            "Error { status: INVALID_ARGUMENT(1), message: \"dion_add_group: lr = -1 is out of range\" }"
        );
        assert_eq!(format!("{e}"), "dion_add_group: lr = -1 is out of range [INVALID_ARGUMENT(1)]");
        let boxed: Box<dyn std::error::Error> = Box::new(e.clone());
        assert_eq!(boxed.to_string(), e.to_string());
    }

    #[test]
    fn versions() {
        assert_eq!(Version::from_code(10203), Version { major: 1, minor: 2, patch: 3 });
        assert_eq!(Version::from_code(10203).code(), 10203);
        assert_eq!(HEADER_VERSION.code(), sys::DION_VERSION_CODE);
        assert_eq!(check_version().unwrap(), version());
        assert_eq!(version().to_string(), format!("{}.{}.{}", version().major, version().minor, version().patch));
    }

    #[test]
    fn enums_round_trip_and_reject_unknown_values() {
        for a in [
            Algorithm::Dion,
            Algorithm::Dion2,
            Algorithm::Muon,
            Algorithm::NorMuon,
            Algorithm::NorDion2,
            Algorithm::AdamW,
            Algorithm::Lion,
        ] {
            assert_eq!(Algorithm::from_raw(a.to_raw()), Some(a));
        }
        assert_eq!(Algorithm::DION3.to_raw(), sys::DION_ALGO_DION3);
        assert_eq!(Algorithm::from_raw(7), None);
        assert_eq!(DType::from_raw(sys::DION_DTYPE_UNSET), None);
        assert_eq!(DType::from_raw(2), Some(DType::F16));
        assert_eq!(Hparam::from_raw(7), Some(Hparam::MuonBeta2));
        assert_eq!(Hparam::from_raw(8), None);
        assert_eq!(Mesh::Inner.to_raw(), sys::DION_MESH_INNER);
        assert_eq!(AdjustLr::None.to_raw(), sys::DION_ADJUST_LR_NONE);
    }

    #[test]
    fn optimizer_options_apply_over_the_c_defaults() {
        let d = OptimizerOptions::new().to_raw();
        assert_eq!(d.struct_size, unsafe { sys::dion_options_sizeof() });
        assert_eq!((d.backend, d.device, d.replicate_grad_sync, d.skip_nonfinite, d.seed), (0, 0, 1, 1, 0));
        let o = OptimizerOptions::cuda(3).seed(9).skip_nonfinite(false).replicate_grad_sync(false).to_raw();
        assert_eq!((o.backend, o.device, o.replicate_grad_sync, o.skip_nonfinite, o.seed), (1, 3, 0, 0, 9));
        assert_eq!(o.abi_version, sys::DION_ABI_VERSION);
        assert_eq!(OptimizerOptions::cuda(0).selected_backend(), Backend::Cuda);
    }

    #[test]
    fn group_options_setters_cover_every_field() {
        let g = GroupOptions::new(Algorithm::Dion)
            .lr(0.5)
            .weight_decay(0.25)
            .mu(0.75)
            .beta1(0.125)
            .beta2(0.375)
            .epsilon(1e-6)
            .rank_fraction(0.5)
            .rank_multiple_of(8)
            .power_iters(2)
            .qr_method(QrMethod::Cqr)
            .cqr_warmup_steps(10)
            .oversample(1.5)
            .orthogonalizer(Orthogonalizer::NewtonSchulz)
            .ortho_steps(7)
            .nesterov(true)
            .adjust_lr(AdjustLr::RmsNorm)
            .cautious_wd(true)
            .fraction(0.5)
            .ef_decay(0.5)
            .selection_scope(SelectionScope::Global)
            .muon_beta2(0.9)
            .flatten(true)
            .momentum_dtype(Some(DType::BF16))
            .q_dtype(Some(DType::F16))
            .variance_dtype(None)
            .matmul_precision(MatmulPrecision::Tf32);
        let r = g.as_raw();
        assert_eq!(r.struct_size, unsafe { sys::dion_group_options_sizeof() });
        assert_eq!(r.abi_version, sys::DION_ABI_VERSION);
        assert_eq!(r.algorithm, sys::DION_ALGO_DION);
        assert_eq!((r.lr, r.weight_decay, r.mu, r.beta1, r.beta2, r.epsilon), (0.5, 0.25, 0.75, 0.125, 0.375, 1e-6));
        assert_eq!((r.rank_fraction, r.rank_multiple_of, r.power_iters), (0.5, 8, 2));
        assert_eq!((r.qr_method, r.cqr_warmup_steps, r.oversample), (sys::DION_QR_CQR, 10, 1.5));
        assert_eq!((r.orthogonalizer, r.ortho_steps, r.nesterov), (sys::DION_ORTHO_NEWTON_SCHULZ, 7, 1));
        assert_eq!((r.adjust_lr, r.cautious_wd), (sys::DION_ADJUST_LR_RMS_NORM, 1));
        assert_eq!((r.fraction, r.ef_decay, r.selection_scope), (0.5, 0.5, sys::DION_SELECTION_GLOBAL));
        assert_eq!((r.muon_beta2, r.flatten), (0.9, 1));
        assert_eq!((r.momentum_dtype, r.q_dtype, r.variance_dtype), (sys::DION_DTYPE_BF16, sys::DION_DTYPE_FP16, -1));
        assert_eq!(r.matmul_precision, sys::DION_MATMUL_TF32);
        let b = GroupOptions::new(Algorithm::Lion).betas((0.8, 0.99));
        assert_eq!((b.as_raw().beta1, b.as_raw().beta2), (0.8, 0.99));
        assert_eq!(b.algorithm(), Some(Algorithm::Lion));
        assert_eq!(GroupOptions::from_raw(*b.as_raw()).as_raw().beta2, 0.99);
    }

    #[test]
    fn bf16_conversions() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 3.140625, 65504.0, 1e-40, f32::INFINITY, f32::NEG_INFINITY] {
            let b = Bf16::from_f32(x);
            assert_eq!(Bf16::from_f32(b.to_f32()), b, "{x}");
        }
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).0, 0x3f80); // tie to even
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).0, 0x3f82); // tie to even (up)
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn f16_conversions() {
        let cases: [(f32, u16); 12] = [
            (0.0, 0x0000),
            (-0.0, 0x8000),
            (1.0, 0x3c00),
            (-2.0, 0xc000),
            (65504.0, 0x7bff),
            (65520.0, 0x7c00), // rounds to infinity
            (f32::INFINITY, 0x7c00),
            (6.103_515_6e-5, 0x0400),     // smallest normal
            (5.960_464_5e-8, 0x0001),     // smallest subnormal 2^-24
            (2.980_232_2e-8, 0x0000),     // 2^-25: tie, rounds to even 0
            (4.470_348_4e-8, 0x0001),     // 1.5 * 2^-25 rounds up
            (1.0 + 1.0 / 2048.0, 0x3c00), // tie to even
        ];
        for (x, bits) in cases {
            assert_eq!(F16::from_f32(x).0, bits, "{x}");
        }
        for bits in (0u16..=0xffff).step_by(7) {
            let h = F16(bits);
            let x = h.to_f32();
            if x.is_nan() {
                assert!(F16::from_f32(x).to_f32().is_nan());
            } else {
                assert_eq!(F16::from_f32(x), h, "{bits:#06x}");
            }
        }
    }
}
