// SPDX-License-Identifier: MIT
//! Compares src/sys.rs with what the C compiler makes of include/dion.h.
//!
//! tests/abi/layout.c is compiled with the system C compiler ($CC, else `cc`)
//! against the header that build.rs found, and prints "KEY VALUE" lines: struct
//! sizes, alignments, field offsets and sizes, typedef sizes and signedness,
//! constants. The same keys are computed here with size_of / align_of /
//! offset_of! and the Rust constants; the two maps must be equal (a key
//! missing on either side fails too). No C compiler or no header is a failure,
//! not a skip: this is the layout half of the ABI check.
use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

use dion::sys::*;

fn c_facts() -> BTreeMap<String, i64> {
    let include = match option_env!("DION_INCLUDE_DIR") {
        Some(d) => PathBuf::from(d),
        None => panic!(
            "dion.h was not found when the crate was built: {}",
            option_env!("DION_INCLUDE_DIR_MISSING").unwrap_or("set LIBDION_INCLUDE_DIR")
        ),
    };
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/abi/layout.c");
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dion_abi_layout");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args(["-std=c99", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (set CC): {e}"));
    assert!(out.status.success(), "{cc} failed on {}:\n{}", src.display(), String::from_utf8_lossy(&out.stderr));
    let out = Command::new(&exe).output().expect("run the layout helper");
    assert!(out.status.success(), "{} failed", exe.display());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let mut m = BTreeMap::new();
    for line in text.lines() {
        // "KEY VALUE", the key possibly holding spaces ("const DION_VERSION(1, 2, 3)").
        let (key, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        let value = value.parse::<i64>().unwrap_or_else(|e| panic!("bad value in {line:?}: {e}"));
        assert!(m.insert(key.to_string(), value).is_none(), "duplicate key {key}");
    }
    m
}

fn size_of_field<T, F>(_: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

fn rust_facts() -> BTreeMap<String, i64> {
    let mut m = BTreeMap::new();
    macro_rules! put {
        ($k:expr, $v:expr) => {{
            let prev = m.insert($k.to_string(), ($v) as i64);
            assert!(prev.is_none(), "duplicate key {}", $k);
        }};
    }
    macro_rules! consts { ($($c:ident),* $(,)?) => {$( put!(concat!("const ", stringify!($c)), $c); )*}; }
    macro_rules! status { ($($c:ident),* $(,)?) => {$( put!(concat!("const ", stringify!($c)), dion_status_t::$c.0); )*}; }
    macro_rules! int_types { ($($t:ident),* $(,)?) => {$(
        put!(concat!("size ", stringify!($t)), size_of::<$t>());
        put!(concat!("signed ", stringify!($t)), ((<$t>::MIN as i128) < 0) as i64);
    )*}; }
    macro_rules! ptr_types { ($($t:ident),* $(,)?) => {$( put!(concat!("size ", stringify!($t)), size_of::<$t>()); )*}; }
    macro_rules! strukt { ($t:ident { $($f:ident),* $(,)? }) => {
        put!(concat!("size ", stringify!($t)), size_of::<$t>());
        put!(concat!("align ", stringify!($t)), align_of::<$t>());
        $(
            put!(concat!("offset ", stringify!($t), ".", stringify!($f)), offset_of!($t, $f));
            put!(concat!("fsize ", stringify!($t), ".", stringify!($f)), size_of_field(|s: &$t| &s.$f));
        )*
    }; }

    consts!(DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH, DION_VERSION_CODE, DION_ABI_VERSION);
    put!("const DION_VERSION(1, 2, 3)", DION_VERSION(1, 2, 3));

    put!("size dion_status_t", size_of::<dion_status_t>());
    put!("signed dion_status_t", (dion_status_t(-1).0 < 0) as i64);
    status!(
        DION_SUCCESS,
        DION_ERROR_INVALID_ARGUMENT,
        DION_ERROR_INVALID_USAGE,
        DION_ERROR_NOT_SUPPORTED,
        DION_ERROR_OUT_OF_MEMORY,
        DION_ERROR_CUDA,
        DION_ERROR_CUBLAS,
        DION_ERROR_CUSOLVER,
        DION_ERROR_NCCL,
        DION_ERROR_MPI,
        DION_ERROR_NUMERICAL,
        DION_ERROR_INTERNAL,
    );

    int_types!(
        dion_dtype_t,
        dion_backend_t,
        dion_algorithm_t,
        dion_qr_method_t,
        dion_orthogonalizer_t,
        dion_adjust_lr_t,
        dion_selection_scope_t,
        dion_matmul_precision_t,
        dion_layout_t,
        dion_mesh_t,
        dion_hparam_t,
    );
    consts!(
        DION_DTYPE_UNSET,
        DION_DTYPE_FP32,
        DION_DTYPE_BF16,
        DION_DTYPE_FP16,
        DION_BACKEND_HOST,
        DION_BACKEND_CUDA,
        DION_ALGO_DION,
        DION_ALGO_DION2,
        DION_ALGO_MUON,
        DION_ALGO_NORMUON,
        DION_ALGO_NORDION2,
        DION_ALGO_DION3,
        DION_ALGO_ADAMW,
        DION_ALGO_LION,
        DION_QR_RCQR,
        DION_QR_QR,
        DION_QR_CQR,
        DION_ORTHO_POLAR_EXPRESS,
        DION_ORTHO_NEWTON_SCHULZ,
        DION_ADJUST_LR_SPECTRAL_NORM,
        DION_ADJUST_LR_RMS_NORM,
        DION_ADJUST_LR_NONE,
        DION_SELECTION_LOCAL,
        DION_SELECTION_GLOBAL,
        DION_MATMUL_FP32,
        DION_MATMUL_TF32,
        DION_MATMUL_BF16,
        DION_LAYOUT_ROW_MAJOR,
        DION_LAYOUT_COL_MAJOR,
        DION_MESH_REPLICATE,
        DION_MESH_OUTER,
        DION_MESH_INNER,
        DION_HPARAM_LR,
        DION_HPARAM_WEIGHT_DECAY,
        DION_HPARAM_MU,
        DION_HPARAM_BETA1,
        DION_HPARAM_BETA2,
        DION_HPARAM_EPSILON,
        DION_HPARAM_EF_DECAY,
        DION_HPARAM_MUON_BETA2,
        DION_UNSET_INT,
        DION_NCCL_UNIQUE_ID_BYTES,
        DION_MAX_DIMS,
    );

    ptr_types!(dion_comm_t, dion_stream_t, dion_optimizer_t);

    strukt!(dion_nccl_unique_id_t { internal });
    strukt!(dion_options_t {
        struct_size,
        abi_version,
        backend,
        device,
        replicate_grad_sync,
        skip_nonfinite,
        reserved0,
        seed,
        replicate_comm,
        outer_comm,
        inner_comm,
    });
    strukt!(dion_tensor_t {
        struct_size,
        name,
        param,
        grad,
        param_dtype,
        grad_dtype,
        layout,
        ndim,
        shape,
        outer_shard_dim,
        inner_shard_dim,
        outer_offset,
        outer_extent,
        inner_offset,
        inner_extent,
    });
    strukt!(dion_group_options_t {
        struct_size,
        abi_version,
        algorithm,
        lr,
        weight_decay,
        mu,
        beta1,
        beta2,
        epsilon,
        rank_fraction,
        rank_multiple_of,
        power_iters,
        qr_method,
        cqr_warmup_steps,
        oversample,
        orthogonalizer,
        ortho_steps,
        nesterov,
        adjust_lr,
        cautious_wd,
        fraction,
        ef_decay,
        selection_scope,
        muon_beta2,
        flatten,
        momentum_dtype,
        q_dtype,
        variance_dtype,
        matmul_precision,
    });
    strukt!(dion_state_info_t {
        struct_size,
        tensor,
        group,
        name,
        dtype,
        layout,
        ndim,
        global_shape,
        local_shape,
        local_offset,
        local_bytes,
    });
    m
}

#[test]
fn sys_rs_matches_the_c_header() {
    let c = c_facts();
    let r = rust_facts();
    let mut problems = Vec::new();
    for (k, v) in &c {
        match r.get(k) {
            None => problems.push(format!("{k}: C says {v}, src/sys.rs / this test has no such item")),
            Some(rv) if rv != v => problems.push(format!("{k}: C says {v}, Rust says {rv}")),
            _ => {}
        }
    }
    for (k, v) in &r {
        if !c.contains_key(k) {
            problems.push(format!("{k}: Rust says {v}, tests/abi/layout.c does not print it"));
        }
    }
    assert!(problems.is_empty(), "src/sys.rs differs from dion.h:\n  {}", problems.join("\n  "));
    // A sanity floor so that an empty helper output cannot pass.
    assert!(c.len() > 150, "only {} facts from the C helper", c.len());
    eprintln!("abi_layout: {} facts agree", c.len());
}
