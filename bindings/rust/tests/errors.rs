// SPDX-License-Identifier: MIT
//! Error paths: libdion's statuses and messages come through as `Error`, the
//! bindings' own checks reject what would let libdion touch memory wrongly,
//! and a failed call changes nothing.
use dion::{
    Algorithm, Backend, Bf16, Buffers, Comm, GroupOptions, Hparam, Mesh, Optimizer, OptimizerOptions, Status, Tensor,
};

fn host() -> Optimizer {
    Optimizer::new(&OptimizerOptions::new()).expect("create a host optimizer")
}

#[test]
fn negative_lr_is_invalid_argument_naming_lr() {
    let mut opt = host();
    let (mut w, g) = (vec![0f32; 12], vec![0f32; 12]);
    let e =
        opt.add_group(&GroupOptions::new(Algorithm::Muon).lr(-1.0), [Tensor::new(&mut w, &g, &[4, 3])]).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT, "{e:?}");
    assert!(e.message.contains("lr"), "{e:?}");
    // Debug shows the code, Display the message and the code.
    assert!(format!("{e:?}").contains("INVALID_ARGUMENT(1)"), "{e:?}");
    assert!(e.to_string().contains(&e.message) && e.to_string().contains("INVALID_ARGUMENT"), "{e}");
    assert_eq!(opt.last_error(), e.message);
    // Nothing was added.
    assert_eq!((opt.group_count().unwrap(), opt.tensor_count().unwrap(), opt.state_count().unwrap()), (0, 0, 0));
    assert!(opt.tensors().is_empty());
}

#[test]
fn set_hparam_validates_and_changes_nothing_on_error() {
    let mut opt = host();
    let (mut w, g) = (vec![0f32; 12], vec![0f32; 12]);
    let gi = opt.add_group(&GroupOptions::new(Algorithm::AdamW).lr(0.5), [Tensor::new(&mut w, &g, &[12])]).unwrap();

    let e = opt.set_lr(gi, -0.1).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("lr"), "{e:?}");
    assert_eq!(opt.lr(gi).unwrap(), 0.5);

    let e = opt.set_hparam(gi, Hparam::Beta2, 1.5).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("beta2"), "{e:?}");
    let e = opt.set_hparam(gi, Hparam::Epsilon, f64::NAN).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);

    opt.set_hparam(gi, Hparam::Beta1, 0.8).unwrap();
    assert_eq!(opt.hparam(gi, Hparam::Beta1).unwrap(), 0.8);
    opt.set_step_count(gi, 41).unwrap();
    assert_eq!(opt.step_count(gi).unwrap(), 41);
    assert_eq!(opt.set_step_count(gi, -1).unwrap_err().status, Status::INVALID_ARGUMENT);
}

#[test]
fn a_bad_group_index_is_invalid_usage() {
    let mut opt = host();
    for e in [
        opt.set_lr(3, 0.1).unwrap_err(),
        opt.lr(3).unwrap_err(),
        opt.step_count(3).unwrap_err(),
        opt.set_step_count(usize::MAX, 1).unwrap_err(), // does not fit int32_t: caught by the bindings
    ] {
        assert!(matches!(e.status, Status::INVALID_USAGE | Status::INVALID_ARGUMENT), "{e:?}");
        assert!(e.message.contains("group"), "{e:?}");
    }
    assert_eq!(opt.lr(3).unwrap_err().status, Status::INVALID_USAGE);
}

#[test]
fn shape_errors_name_the_tensor() {
    let mut opt = host();
    let (mut v, g) = (vec![0f32; 8], vec![0f32; 8]);
    let e =
        opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::new(&mut v, &g, &[8]).name("bias")]).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("bias") && e.message.contains("ndim"), "{e:?}");

    let e = opt
        .add_group(&GroupOptions::new(Algorithm::AdamW), [Tensor::new(&mut v, &g, &[1, 2, 2, 1, 2]).name("t5")])
        .unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("t5") && e.message.contains("DION_MAX_DIMS"), "{e:?}");

    let e =
        opt.add_group(&GroupOptions::new(Algorithm::AdamW), [Tensor::new(&mut v, &g, &[8]).name("a\0b")]).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("NUL"), "{e:?}");

    let e = opt
        .add_group(
            &GroupOptions::new(Algorithm::AdamW),
            [Tensor::new(&mut v, &g, &[2, 4]).layout(dion::Layout::ColMajor).shard_outer(0, 0, 1)],
        )
        .unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT, "{e:?}");
    assert_eq!(opt.tensor_count().unwrap(), 0);
}

#[test]
fn slice_lengths_and_dtypes_are_checked_by_the_bindings() {
    let mut opt = host();
    let (mut w, g) = (vec![0f32; 12], vec![0f32; 12]);
    let (mut w11, g11) = (vec![0f32; 11], vec![0f32; 11]);

    // add_group: param or grad shorter than the shape.
    let e =
        opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::new(&mut w11, &g, &[4, 3]).name("w")]).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("'w'") && e.message.contains("param has 11 elements"), "{e:?}");
    let e = opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::new(&mut w, &g11, &[4, 3])]).unwrap_err();
    assert!(e.message.contains("grad has 11 elements"), "{e:?}");

    opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::new(&mut w, &g, &[4, 3]).name("w")]).unwrap();

    // step: wrong count, wrong lengths, wrong dtype.
    let e = opt.step([]).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("got buffers for 0 tensors"), "{e:?}");
    let e = opt.step([Buffers::new(&mut w11, &g)]).unwrap_err();
    assert!(e.message.contains("param is 11 elements"), "{e:?}");
    let e = opt.step([Buffers::new(&mut w, &g11)]).unwrap_err();
    assert!(e.message.contains("grad is 11 elements"), "{e:?}");
    let mut wb = vec![Bf16::default(); 12];
    let e = opt.step([Buffers::new(&mut wb, &g)]).unwrap_err();
    assert!(e.message.contains("BF16"), "{e:?}");
    assert_eq!(opt.step_count(0).unwrap(), 0, "a rejected step must not count");

    opt.step([Buffers::new(&mut w, &g)]).unwrap();
    assert_eq!(opt.step_count(0).unwrap(), 1);
}

#[test]
fn state_errors() {
    let mut opt = host();
    let (mut w, g) = (vec![0f32; 12], vec![0.1f32; 12]);
    opt.add_group(&GroupOptions::new(Algorithm::AdamW), [Tensor::new(&mut w, &g, &[4, 3]).name("w")]).unwrap();

    let e = opt.find_state(0, "Q").unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("'w'") && e.message.contains("'Q'"), "{e:?}");
    assert_eq!(opt.find_state(5, "momentum").unwrap_err().status, Status::INVALID_ARGUMENT);
    assert_eq!(opt.state_info(99).unwrap_err().status, Status::INVALID_ARGUMENT);

    let m = opt.find_state(0, "momentum").unwrap();
    let mut small = vec![0u8; 47];
    let e = opt.read_state_into(m, &mut small).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("bytes = 47"), "{e:?}");
    assert_eq!(opt.write_state(m, &small).unwrap_err().status, Status::INVALID_ARGUMENT);
    let e = opt.write_state_f32(m, &[1.0; 13]).unwrap_err();
    assert!(e.message.contains("12 elements, got 13"), "{e:?}");
    let e = opt.read_state_as::<Bf16>(m).unwrap_err();
    assert!(e.message.contains("is F32, not BF16"), "{e:?}");
}

#[test]
fn the_cuda_backend_or_its_absence_is_reported_cleanly() {
    match Optimizer::new(&OptimizerOptions::cuda(0)) {
        Err(e) => {
            assert!(matches!(e.status, Status::NOT_SUPPORTED | Status::CUDA), "{e:?}");
            assert!(e.message.contains("dion_create"), "{e:?}");
        }
        Ok(mut opt) => {
            // Host slices must never reach a CUDA optimizer.
            assert_eq!(opt.backend(), Backend::Cuda);
            let (mut w, g) = (vec![0f32; 12], vec![0f32; 12]);
            let e = opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::new(&mut w, &g, &[4, 3])]).unwrap_err();
            assert_eq!(e.status, Status::INVALID_ARGUMENT);
            assert!(e.message.contains("host backend"), "{e:?}");
        }
    }
}

#[test]
fn nccl_unique_id_without_nccl_fails_cleanly() {
    match Comm::nccl_unique_id() {
        Ok(_) => {}
        Err(e) => assert_eq!(e.status, Status::NOT_SUPPORTED, "{e:?}"),
    }
    // Comm::from_mpi_fint is not exercised here: libdion as first committed called MPI_Comm_f2c
    // before checking MPI_Initialized, and Open MPI aborts the whole test process there. With the
    // check moved first it returns INVALID_USAGE ("MPI is not initialized"); add the test once every
    // CI build has that fix.
}

#[test]
fn queries_of_a_single_rank_host_optimizer() {
    let mut opt = host();
    assert_eq!(opt.memory_usage().unwrap().state_bytes, 0);
    let (mut w, g) = (vec![0f32; 12], vec![0f32; 12]);
    opt.add_group(&GroupOptions::new(Algorithm::AdamW), [Tensor::new(&mut w, &g, &[4, 3])]).unwrap();
    // AdamW: momentum + variance, fp32.
    assert_eq!(opt.memory_usage().unwrap().state_bytes, 2 * 12 * 4);
    for mesh in [Mesh::Replicate, Mesh::Outer, Mesh::Inner] {
        assert_eq!(opt.comm_bytes(mesh).unwrap(), dion::CommBytes { last_step: 0, total: 0 });
    }
    assert!(opt.async_error().unwrap().is_none());
    opt.sync_for_checkpoint().unwrap();
    assert_eq!(opt.backend(), Backend::Host);
    assert_eq!(opt.tensors()[0].name, "tensors[0]");
    assert!(format!("{opt:?}").contains("tensors: 1"));
}

#[test]
fn raw_binding_path() {
    let mut opt = host();
    let mut w = vec![0.5f32; 12];
    let g = [0.1f32; 12];
    // SAFETY: w and g outlive every use below (add_group, step_bound) and are not touched meanwhile.
    unsafe {
        let t = Tensor::from_raw(w.as_mut_ptr().cast(), dion::DType::F32, g.as_ptr().cast(), dion::DType::F32, &[4, 3]);
        opt.add_group(&GroupOptions::new(Algorithm::Muon), [t]).unwrap();
        opt.step_bound(std::ptr::null_mut()).unwrap();
        opt.rebind(0, w.as_mut_ptr().cast(), std::ptr::null()).unwrap();
        opt.step_bound(std::ptr::null_mut()).unwrap(); // no gradient: skipped
    }
    assert_ne!(w, vec![0.5f32; 12]);
    // SAFETY: the error path never dereferences anything.
    let e = unsafe { opt.rebind(0, std::ptr::null_mut(), std::ptr::null()) }.unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("param is NULL"), "{e:?}");
}

#[test]
fn raw_group_options_are_validated_by_libdion() {
    let mut opt = host();
    let (mut w, g) = (vec![0f32; 12], vec![0f32; 12]);
    let mut raw = *GroupOptions::new(Algorithm::AdamW).as_raw();
    raw.abi_version = 99;
    let e = opt.add_group(&GroupOptions::from_raw(raw), [Tensor::new(&mut w, &g, &[12])]).unwrap_err();
    assert_eq!(e.status, Status::INVALID_ARGUMENT);
    assert!(e.message.contains("abi_version"), "{e:?}");
    // A struct_size beyond the Rust struct is never passed on (libdion would read past it).
    raw.abi_version = dion::sys::DION_ABI_VERSION;
    raw.struct_size = 1 << 20;
    raw.algorithm = 42;
    let e = opt.add_group(&GroupOptions::from_raw(raw), [Tensor::new(&mut w, &g, &[12])]).unwrap_err();
    assert!(e.message.contains("algorithm"), "{e:?}");
}
