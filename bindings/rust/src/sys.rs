// SPDX-License-Identifier: MIT
//! Raw declarations of `include/dion.h`, hand-written, in header order.
//!
//! Every item keeps its C name so that the header remains the manual: read the
//! comment above a declaration in `dion.h` for its contract. Nothing here is
//! safe to call without reading that contract; the [`crate`] root wraps it.
//!
//! How this file is kept equal to the header:
//!  * `abi_check.sh` renders the `extern "C"` block with cbindgen and compiles
//!    it together with `dion.h` (C99, LP64 and ILP32): a prototype that differs
//!    fails to compile; it also compares the function names, in order.
//!  * `tests/abi_layout.rs` compiles a C program that prints every struct's
//!    size, alignment and field offsets, every typedef's size and signedness and
//!    every constant, and compares them with this file.
//!  * the unit tests compare `size_of` with `dion_*_sizeof()` of the loaded library.
//!
//! C enumerations are `int32_t` typedefs here, as in the header, because a C
//! value outside a Rust `enum`'s variants would be undefined behaviour; for the
//! same reason the status is a `#[repr(transparent)]` newtype with associated
//! constants rather than an `enum`.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::marker::{PhantomData, PhantomPinned};
use std::os::raw::{c_char, c_void};

// ---------------------------------------------------------------------------
// Versions
// ---------------------------------------------------------------------------

pub const DION_VERSION_MAJOR: i32 = 0;
pub const DION_VERSION_MINOR: i32 = 1;
pub const DION_VERSION_PATCH: i32 = 0;
/// `DION_VERSION(X, Y, Z)`: one encoding, forever.
pub const fn DION_VERSION(x: i32, y: i32, z: i32) -> i32 {
    x * 10000 + y * 100 + z
}
pub const DION_VERSION_CODE: i32 = DION_VERSION(DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH);
/// The `abi_version` field's value (the macro is an `int`; the field a `uint32_t`).
pub const DION_ABI_VERSION: u32 = 1;

// ---------------------------------------------------------------------------
// Status codes
// ---------------------------------------------------------------------------

/// `typedef int32_t dion_status_t`. Any `i32` is a valid value of this type.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct dion_status_t(pub i32);

impl dion_status_t {
    pub const DION_SUCCESS: Self = Self(0);
    pub const DION_ERROR_INVALID_ARGUMENT: Self = Self(1);
    pub const DION_ERROR_INVALID_USAGE: Self = Self(2);
    pub const DION_ERROR_NOT_SUPPORTED: Self = Self(3);
    pub const DION_ERROR_OUT_OF_MEMORY: Self = Self(4);
    pub const DION_ERROR_CUDA: Self = Self(5);
    pub const DION_ERROR_CUBLAS: Self = Self(6);
    pub const DION_ERROR_CUSOLVER: Self = Self(7);
    pub const DION_ERROR_NCCL: Self = Self(8);
    pub const DION_ERROR_MPI: Self = Self(9);
    pub const DION_ERROR_NUMERICAL: Self = Self(10);
    pub const DION_ERROR_INTERNAL: Self = Self(11);
}

// ---------------------------------------------------------------------------
// Enumerations (int32_t typedefs; the constants are their values)
// ---------------------------------------------------------------------------

pub type dion_dtype_t = i32;
pub const DION_DTYPE_UNSET: dion_dtype_t = -1;
pub const DION_DTYPE_FP32: dion_dtype_t = 0;
pub const DION_DTYPE_BF16: dion_dtype_t = 1;
pub const DION_DTYPE_FP16: dion_dtype_t = 2;

pub type dion_backend_t = i32;
pub const DION_BACKEND_HOST: dion_backend_t = 0;
pub const DION_BACKEND_CUDA: dion_backend_t = 1;

pub type dion_algorithm_t = i32;
pub const DION_ALGO_DION: dion_algorithm_t = 0;
pub const DION_ALGO_DION2: dion_algorithm_t = 1;
pub const DION_ALGO_MUON: dion_algorithm_t = 2;
pub const DION_ALGO_NORMUON: dion_algorithm_t = 3;
pub const DION_ALGO_NORDION2: dion_algorithm_t = 4;
pub const DION_ALGO_DION3: dion_algorithm_t = 4;
pub const DION_ALGO_ADAMW: dion_algorithm_t = 5;
pub const DION_ALGO_LION: dion_algorithm_t = 6;

pub type dion_qr_method_t = i32;
pub const DION_QR_RCQR: dion_qr_method_t = 0;
pub const DION_QR_QR: dion_qr_method_t = 1;
pub const DION_QR_CQR: dion_qr_method_t = 2;

pub type dion_orthogonalizer_t = i32;
pub const DION_ORTHO_POLAR_EXPRESS: dion_orthogonalizer_t = 0;
pub const DION_ORTHO_NEWTON_SCHULZ: dion_orthogonalizer_t = 1;

pub type dion_adjust_lr_t = i32;
pub const DION_ADJUST_LR_SPECTRAL_NORM: dion_adjust_lr_t = 0;
pub const DION_ADJUST_LR_RMS_NORM: dion_adjust_lr_t = 1;
pub const DION_ADJUST_LR_NONE: dion_adjust_lr_t = 2;

pub type dion_selection_scope_t = i32;
pub const DION_SELECTION_LOCAL: dion_selection_scope_t = 0;
pub const DION_SELECTION_GLOBAL: dion_selection_scope_t = 1;

pub type dion_matmul_precision_t = i32;
pub const DION_MATMUL_FP32: dion_matmul_precision_t = 0;
pub const DION_MATMUL_TF32: dion_matmul_precision_t = 1;
pub const DION_MATMUL_BF16: dion_matmul_precision_t = 2;

pub type dion_layout_t = i32;
pub const DION_LAYOUT_ROW_MAJOR: dion_layout_t = 0;
pub const DION_LAYOUT_COL_MAJOR: dion_layout_t = 1;

pub type dion_mesh_t = i32;
pub const DION_MESH_REPLICATE: dion_mesh_t = 0;
pub const DION_MESH_OUTER: dion_mesh_t = 1;
pub const DION_MESH_INNER: dion_mesh_t = 2;

pub type dion_hparam_t = i32;
pub const DION_HPARAM_LR: dion_hparam_t = 0;
pub const DION_HPARAM_WEIGHT_DECAY: dion_hparam_t = 1;
pub const DION_HPARAM_MU: dion_hparam_t = 2;
pub const DION_HPARAM_BETA1: dion_hparam_t = 3;
pub const DION_HPARAM_BETA2: dion_hparam_t = 4;
pub const DION_HPARAM_EPSILON: dion_hparam_t = 5;
pub const DION_HPARAM_EF_DECAY: dion_hparam_t = 6;
pub const DION_HPARAM_MUON_BETA2: dion_hparam_t = 7;

/// Sentinel of integer option fields meaning "use the default".
pub const DION_UNSET_INT: i32 = i32::MIN;

// ---------------------------------------------------------------------------
// Opaque types and handles
// ---------------------------------------------------------------------------

// Opaque structs as the Rustonomicon recommends: zero-sized, not constructible
// outside this module, and neither Send, Sync nor Unpin.
macro_rules! opaque {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}

opaque! {
    /// `struct dion_comm_s` (behind `dion_comm_t`).
    dion_comm_s;
    /// `struct ncclComm` (`ncclComm_t` is `struct ncclComm*`).
    ncclComm;
    /// `struct CUstream_st` (`cudaStream_t` is `struct CUstream_st*`).
    CUstream_st;
    /// `struct dion_optimizer_s` (behind `dion_optimizer_t`).
    dion_optimizer_s;
}

/// A mesh communicator; NULL means "this mesh is absent".
pub type dion_comm_t = *mut dion_comm_s;
/// A CUDA stream (`cudaStream_t`); NULL is the legacy default stream.
pub type dion_stream_t = *mut CUstream_st;
/// An optimizer handle.
pub type dion_optimizer_t = *mut dion_optimizer_s;

// ---------------------------------------------------------------------------
// Communicators
// ---------------------------------------------------------------------------

pub const DION_NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `dion_nccl_unique_id_t` (`struct dion_nccl_unique_id`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dion_nccl_unique_id {
    pub internal: [c_char; DION_NCCL_UNIQUE_ID_BYTES],
}
pub type dion_nccl_unique_id_t = dion_nccl_unique_id;

// ---------------------------------------------------------------------------
// Optimizer options
// ---------------------------------------------------------------------------

/// `dion_options_t` (`struct dion_options_v1`). Fill with [`dion_options_init`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dion_options_v1 {
    pub struct_size: usize,
    pub abi_version: u32,
    pub backend: dion_backend_t,
    pub device: i32,
    pub replicate_grad_sync: i32,
    pub skip_nonfinite: i32,
    pub reserved0: i32,
    pub seed: u64,
    pub replicate_comm: dion_comm_t,
    pub outer_comm: dion_comm_t,
    pub inner_comm: dion_comm_t,
}
pub type dion_options_t = dion_options_v1;

// ---------------------------------------------------------------------------
// Tensor descriptors and parameter groups
// ---------------------------------------------------------------------------

pub const DION_MAX_DIMS: usize = 4;

/// `dion_tensor_t` (`struct dion_tensor_v1`). Fill with [`dion_tensor_init`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dion_tensor_v1 {
    pub struct_size: usize,
    pub name: *const c_char,
    pub param: *mut c_void,
    pub grad: *const c_void,
    pub param_dtype: dion_dtype_t,
    pub grad_dtype: dion_dtype_t,
    pub layout: dion_layout_t,
    pub ndim: i32,
    pub shape: [i64; DION_MAX_DIMS],
    pub outer_shard_dim: i32,
    pub inner_shard_dim: i32,
    pub outer_offset: i64,
    pub outer_extent: i64,
    pub inner_offset: i64,
    pub inner_extent: i64,
}
pub type dion_tensor_t = dion_tensor_v1;

/// `dion_group_options_t` (`struct dion_group_options_v1`). Fill with
/// [`dion_group_options_init`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dion_group_options_v1 {
    pub struct_size: usize,
    pub abi_version: u32,
    pub algorithm: dion_algorithm_t,
    pub lr: f64,
    pub weight_decay: f64,
    pub mu: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub epsilon: f64,
    // Dion
    pub rank_fraction: f64,
    pub rank_multiple_of: i32,
    pub power_iters: i32,
    pub qr_method: dion_qr_method_t,
    pub cqr_warmup_steps: i32,
    pub oversample: f64,
    // Muon family
    pub orthogonalizer: dion_orthogonalizer_t,
    pub ortho_steps: i32,
    pub nesterov: i32,
    pub adjust_lr: dion_adjust_lr_t,
    pub cautious_wd: i32,
    pub fraction: f64,
    pub ef_decay: f64,
    pub selection_scope: dion_selection_scope_t,
    pub muon_beta2: f64,
    pub flatten: i32,
    // precision
    pub momentum_dtype: dion_dtype_t,
    pub q_dtype: dion_dtype_t,
    pub variance_dtype: dion_dtype_t,
    pub matmul_precision: dion_matmul_precision_t,
}
pub type dion_group_options_t = dion_group_options_v1;

// ---------------------------------------------------------------------------
// Optimizer state (checkpoints)
// ---------------------------------------------------------------------------

/// `dion_state_info_t` (`struct dion_state_info_v1`). Set `struct_size` before
/// calling [`dion_state_info`]; `name` points into the optimizer.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct dion_state_info_v1 {
    pub struct_size: usize,
    pub tensor: i32,
    pub group: i32,
    pub name: *const c_char,
    pub dtype: dion_dtype_t,
    pub layout: dion_layout_t,
    pub ndim: i32,
    pub global_shape: [i64; DION_MAX_DIMS],
    pub local_shape: [i64; DION_MAX_DIMS],
    pub local_offset: [i64; DION_MAX_DIMS],
    pub local_bytes: u64,
}
pub type dion_state_info_t = dion_state_info_v1;

// ---------------------------------------------------------------------------
// Functions, in the order of dion.h (abi_check.sh compares the order)
// ---------------------------------------------------------------------------

extern "C" {
    // Versions
    pub fn dion_version() -> i32;

    // Status codes
    pub fn dion_status_string(status: dion_status_t) -> *const c_char;

    // Communicators
    pub fn dion_nccl_get_unique_id(id: *mut dion_nccl_unique_id_t) -> dion_status_t;
    pub fn dion_comm_init_nccl(
        comm: *mut dion_comm_t,
        id: *const dion_nccl_unique_id_t,
        nranks: i32,
        rank: i32,
        device: i32,
    ) -> dion_status_t;
    pub fn dion_comm_adopt_nccl(comm: *mut dion_comm_t, nccl_comm: *mut ncclComm) -> dion_status_t;
    pub fn dion_comm_from_mpi_fint(comm: *mut dion_comm_t, fortran_comm: i32) -> dion_status_t;
    pub fn dion_comm_size(comm: dion_comm_t, size: *mut i32) -> dion_status_t;
    pub fn dion_comm_rank(comm: dion_comm_t, rank: *mut i32) -> dion_status_t;
    pub fn dion_comm_abort(comm: dion_comm_t) -> dion_status_t;
    pub fn dion_comm_destroy(comm: dion_comm_t) -> dion_status_t;

    // Optimizer options
    pub fn dion_options_init(options: *mut dion_options_t) -> dion_status_t;
    pub fn dion_options_sizeof() -> usize;

    // Optimizer lifetime
    pub fn dion_create(optimizer: *mut dion_optimizer_t, options: *const dion_options_t) -> dion_status_t;
    pub fn dion_destroy(optimizer: dion_optimizer_t) -> dion_status_t;
    pub fn dion_last_error(optimizer: dion_optimizer_t) -> *const c_char;

    // Tensor descriptors and parameter groups
    pub fn dion_tensor_init(tensor: *mut dion_tensor_t) -> dion_status_t;
    pub fn dion_tensor_sizeof() -> usize;
    pub fn dion_group_options_init(options: *mut dion_group_options_t, algorithm: dion_algorithm_t) -> dion_status_t;
    pub fn dion_group_options_sizeof() -> usize;
    pub fn dion_add_group(
        optimizer: dion_optimizer_t,
        options: *const dion_group_options_t,
        tensors: *const dion_tensor_t,
        count: usize,
        group_index: *mut i32,
    ) -> dion_status_t;
    pub fn dion_group_count(optimizer: dion_optimizer_t, count: *mut i32) -> dion_status_t;
    pub fn dion_tensor_count(optimizer: dion_optimizer_t, count: *mut i32) -> dion_status_t;
    pub fn dion_group_set_hparam(
        optimizer: dion_optimizer_t,
        group: i32,
        hparam: dion_hparam_t,
        value: f64,
    ) -> dion_status_t;
    pub fn dion_group_get_hparam(
        optimizer: dion_optimizer_t,
        group: i32,
        hparam: dion_hparam_t,
        value: *mut f64,
    ) -> dion_status_t;
    pub fn dion_group_get_step(optimizer: dion_optimizer_t, group: i32, step: *mut i64) -> dion_status_t;
    pub fn dion_group_set_step(optimizer: dion_optimizer_t, group: i32, step: i64) -> dion_status_t;
    pub fn dion_tensor_rebind(
        optimizer: dion_optimizer_t,
        tensor: i32,
        param: *mut c_void,
        grad: *const c_void,
    ) -> dion_status_t;

    // Stepping
    pub fn dion_step(optimizer: dion_optimizer_t, stream: dion_stream_t) -> dion_status_t;
    pub fn dion_sync_for_checkpoint(optimizer: dion_optimizer_t, stream: dion_stream_t) -> dion_status_t;
    pub fn dion_get_skipped_steps(
        optimizer: dion_optimizer_t,
        skipped: *mut i64,
        last_skipped: *mut i32,
        stream: dion_stream_t,
    ) -> dion_status_t;
    pub fn dion_get_async_error(optimizer: dion_optimizer_t, status: *mut dion_status_t) -> dion_status_t;
    pub fn dion_get_comm_bytes(
        optimizer: dion_optimizer_t,
        mesh: dion_mesh_t,
        last_step: *mut u64,
        total: *mut u64,
    ) -> dion_status_t;
    pub fn dion_get_memory_usage(
        optimizer: dion_optimizer_t,
        state_bytes: *mut u64,
        workspace_bytes: *mut u64,
    ) -> dion_status_t;

    // Optimizer state (checkpoints)
    pub fn dion_state_count(optimizer: dion_optimizer_t, count: *mut i32) -> dion_status_t;
    pub fn dion_state_info(optimizer: dion_optimizer_t, index: i32, info: *mut dion_state_info_t) -> dion_status_t;
    pub fn dion_state_find(
        optimizer: dion_optimizer_t,
        tensor: i32,
        name: *const c_char,
        index: *mut i32,
    ) -> dion_status_t;
    pub fn dion_state_read(
        optimizer: dion_optimizer_t,
        index: i32,
        dst: *mut c_void,
        bytes: u64,
        stream: dion_stream_t,
    ) -> dion_status_t;
    pub fn dion_state_write(
        optimizer: dion_optimizer_t,
        index: i32,
        src: *const c_void,
        bytes: u64,
        stream: dion_stream_t,
    ) -> dion_status_t;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    // The authoritative layout check is tests/abi_layout.rs (against the C
    // compiler); these compare with the library actually loaded.
    #[test]
    fn struct_sizes_match_the_loaded_library() {
        unsafe {
            assert_eq!(size_of::<dion_options_t>(), dion_options_sizeof(), "dion_options_t");
            assert_eq!(size_of::<dion_tensor_t>(), dion_tensor_sizeof(), "dion_tensor_t");
            assert_eq!(size_of::<dion_group_options_t>(), dion_group_options_sizeof(), "dion_group_options_t");
        }
    }

    #[test]
    fn status_is_a_transparent_i32() {
        assert_eq!(size_of::<dion_status_t>(), size_of::<i32>());
        assert_eq!(align_of::<dion_status_t>(), align_of::<i32>());
    }

    #[test]
    fn loaded_library_has_our_major_version() {
        let v = unsafe { dion_version() };
        assert_eq!(v / 10000, DION_VERSION_MAJOR, "libdion {v} vs bindings {DION_VERSION_CODE}");
    }

    #[test]
    fn init_functions_fill_header_and_defaults() {
        unsafe {
            let mut o = std::mem::MaybeUninit::<dion_options_t>::uninit();
            assert_eq!(dion_options_init(o.as_mut_ptr()), dion_status_t::DION_SUCCESS);
            let o = o.assume_init();
            assert_eq!(o.struct_size, size_of::<dion_options_t>());
            assert_eq!(o.abi_version, DION_ABI_VERSION);
            assert_eq!((o.backend, o.replicate_grad_sync, o.skip_nonfinite, o.seed), (DION_BACKEND_HOST, 1, 1, 0));
            assert!(o.replicate_comm.is_null() && o.outer_comm.is_null() && o.inner_comm.is_null());

            let mut t = std::mem::MaybeUninit::<dion_tensor_t>::uninit();
            assert_eq!(dion_tensor_init(t.as_mut_ptr()), dion_status_t::DION_SUCCESS);
            let t = t.assume_init();
            assert_eq!(t.struct_size, size_of::<dion_tensor_t>());
            assert_eq!(
                (t.param_dtype, t.grad_dtype, t.layout),
                (DION_DTYPE_FP32, DION_DTYPE_UNSET, DION_LAYOUT_ROW_MAJOR)
            );
            assert_eq!((t.outer_shard_dim, t.inner_shard_dim), (-1, -1));

            let mut g = std::mem::MaybeUninit::<dion_group_options_t>::uninit();
            assert_eq!(dion_group_options_init(g.as_mut_ptr(), DION_ALGO_LION), dion_status_t::DION_SUCCESS);
            let g = g.assume_init();
            assert_eq!(g.struct_size, size_of::<dion_group_options_t>());
            assert_eq!(g.algorithm, DION_ALGO_LION);
            assert_eq!((g.lr, g.weight_decay, g.mu, g.beta1, g.beta2), (0.01, 0.01, 0.95, 0.9, 0.95));
            assert_eq!((g.oversample, g.fraction, g.ortho_steps), (1.25, 0.25, 5));
            assert_eq!(
                (g.momentum_dtype, g.q_dtype, g.variance_dtype),
                (DION_DTYPE_UNSET, DION_DTYPE_UNSET, DION_DTYPE_UNSET)
            );
        }
    }

    #[test]
    fn every_status_has_a_string() {
        for code in 0..=11 {
            let s = unsafe { std::ffi::CStr::from_ptr(dion_status_string(dion_status_t(code))) };
            assert!(!s.to_bytes().is_empty());
            assert_ne!(s.to_str().unwrap(), "unknown status", "code {code}");
        }
        let s = unsafe { std::ffi::CStr::from_ptr(dion_status_string(dion_status_t(12345))) };
        assert_eq!(s.to_str().unwrap(), "unknown status");
    }
}
