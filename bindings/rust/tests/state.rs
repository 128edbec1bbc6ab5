// SPDX-License-Identifier: MIT
//! Optimizer state: enumeration, byte and typed round trips, and a checkpoint
//! that resumes bit-exactly in a fresh optimizer.
mod common;

use common::*;
use dion::{Algorithm, Bf16, Buffers, DType, GroupOptions, Layout, Optimizer, OptimizerOptions, StateInfo, Tensor};

/// Model: w (Dion or Muon), b (AdamW). Returns the optimizer with its groups.
fn build(algo: Algorithm, w: &mut [f32], gw: &[f32], b: &mut [f32], gb: &[f32]) -> Optimizer {
    let mut opt = Optimizer::new(&OptimizerOptions::new().seed(5)).unwrap();
    opt.add_group(
        &GroupOptions::new(algo).lr(0.02).weight_decay(0.01).rank_fraction(0.5),
        [Tensor::new(w, gw, &[OUT, IN]).name("w")],
    )
    .unwrap();
    opt.add_group(&GroupOptions::new(Algorithm::AdamW).lr(0.01), [Tensor::new(b, gb, &[OUT]).name("b")]).unwrap();
    opt
}

struct Data {
    teacher: Teacher,
    rng: Rng,
}

impl Data {
    fn new() -> Self {
        let mut rng = Rng(42);
        Data { teacher: Teacher::new(&mut rng), rng }
    }

    fn batches(&mut self, n: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
        (0..n)
            .map(|_| {
                let x = self.rng.normals(BATCH * IN, 1.0);
                let y = self.teacher.targets(&x);
                (x, y)
            })
            .collect()
    }
}

fn train(opt: &mut Optimizer, w: &mut [f32], b: &mut [f32], batches: &[(Vec<f32>, Vec<f32>)]) {
    let (mut gw, mut gb) = (vec![0f32; w.len()], vec![0f32; b.len()]);
    for (x, y) in batches {
        mse(x, y, w, b, Some((&mut gw, &mut gb)));
        opt.step([Buffers::new(&mut *w, &gw), Buffers::new(&mut *b, &gb)]).unwrap();
    }
}

#[test]
fn states_are_enumerated_with_their_shapes() {
    let (mut w, gw, mut b, gb) = (vec![0f32; OUT * IN], vec![0f32; OUT * IN], vec![0f32; OUT], vec![0f32; OUT]);
    let opt = build(Algorithm::Dion, &mut w, &gw, &mut b, &gb);
    let states = opt.states().unwrap();
    let summary: Vec<(usize, usize, &str, Vec<i64>)> =
        states.iter().map(|s| (s.tensor, s.group, s.name.as_str(), s.global_shape.clone())).collect();
    // Dion's Q has r = ceil(0.5 * min(16, 32)) = 8 columns (its rows are the side libdion
    // keeps it on, not fixed by the API).
    assert!(summary.contains(&(0, 0, "momentum", vec![OUT as i64, IN as i64])), "{summary:?}");
    let q = &summary.iter().find(|s| s.2 == "Q").expect("Dion has a Q state").3;
    assert!(q.len() == 2 && q[1] == 8 && (q[0] == OUT as i64 || q[0] == IN as i64), "{summary:?}");
    assert!(summary.contains(&(1, 1, "momentum", vec![OUT as i64])), "{summary:?}");
    assert!(summary.contains(&(1, 1, "variance", vec![OUT as i64])), "{summary:?}");
    assert_eq!(states.len(), 4);
    let mut total = 0;
    for (i, s) in states.iter().enumerate() {
        assert_eq!(s.index, i);
        assert_eq!(s.dtype, DType::F32);
        assert_eq!(s.layout, Layout::RowMajor);
        assert_eq!(s.local_shape, s.global_shape, "single rank: the local shard is everything");
        assert!(s.local_offset.iter().all(|&o| o == 0));
        assert_eq!(s.local_bytes, 4 * s.local_shape.iter().product::<i64>() as u64);
        assert_eq!(opt.find_state(s.tensor, &s.name).unwrap(), i);
        total += s.local_bytes;
    }
    assert_eq!(opt.memory_usage().unwrap().state_bytes, total);
}

#[test]
fn byte_and_typed_round_trips() {
    let (mut w, gw, mut b, gb) = (vec![0f32; OUT * IN], vec![0.01f32; OUT * IN], vec![0f32; OUT], vec![0.1f32; OUT]);
    let mut opt = build(Algorithm::Muon, &mut w, &gw, &mut b, &gb);
    opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut b, &gb)]).unwrap();

    for s in opt.states().unwrap() {
        let bytes = opt.read_state(s.index).unwrap();
        assert_eq!(bytes.len() as u64, s.local_bytes);
        assert!(bytes.iter().any(|&x| x != 0), "state {} ('{}') is still zero after a step", s.index, s.name);
        // Typed view equals the bytes.
        let f = opt.read_state_f32(s.index).unwrap();
        let from_bytes: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
        assert_eq!(f, from_bytes);
        // Write something else, read it back, restore.
        let pattern: Vec<f32> = (0..f.len()).map(|i| i as f32 * 0.5 - 3.0).collect();
        opt.write_state_f32(s.index, &pattern).unwrap();
        assert_eq!(opt.read_state_f32(s.index).unwrap(), pattern);
        opt.write_state(s.index, &bytes).unwrap();
        assert_eq!(opt.read_state(s.index).unwrap(), bytes);
        // A larger buffer is fine for reads (libdion writes local_bytes).
        let mut big = vec![0xAAu8; bytes.len() + 8];
        opt.read_state_into(s.index, &mut big).unwrap();
        assert_eq!(&big[..bytes.len()], &bytes[..]);
        assert!(big[bytes.len()..].iter().all(|&x| x == 0xAA));
    }
}

#[test]
fn bf16_states_follow_the_parameter_dtype() {
    let mut w = vec![Bf16::from_f32(0.25); 6 * 4];
    let g = vec![Bf16::from_f32(0.125); 6 * 4];
    let mut opt = Optimizer::new(&OptimizerOptions::new()).unwrap();
    opt.add_group(
        &GroupOptions::new(Algorithm::AdamW).variance_dtype(Some(DType::F32)),
        [Tensor::new(&mut w, &g, &[6, 4])],
    )
    .unwrap();
    opt.step([Buffers::new(&mut w, &g)]).unwrap();
    let m = opt.state_info(opt.find_state(0, "momentum").unwrap()).unwrap();
    let v = opt.state_info(opt.find_state(0, "variance").unwrap()).unwrap();
    assert_eq!((m.dtype, m.local_bytes), (DType::BF16, 48));
    assert_eq!((v.dtype, v.local_bytes), (DType::F32, 96));
    let mb = opt.read_state_as::<Bf16>(m.index).unwrap();
    assert_eq!(mb.len(), 24);
    assert!(mb.iter().all(|x| x.to_f32() > 0.0), "{mb:?}");
    opt.write_state_from::<Bf16>(m.index, &[Bf16::from_f32(1.0); 24]).unwrap();
    assert_eq!(opt.read_state_as::<Bf16>(m.index).unwrap(), vec![Bf16::from_f32(1.0); 24]);
    assert!(opt.read_state_f32(v.index).unwrap().iter().all(|&x| x > 0.0));
}

/// Train A for 10 steps, checkpoint (params, states, step counters, hparams),
/// train A for 10 more; restore the checkpoint into a fresh B and train the same
/// 10 batches: B must end bit-identical to A. Then do the same through a file-like
/// byte blob to show states survive serialization.
fn checkpoint_resumes_exactly(algo: Algorithm) {
    let mut data = Data::new();
    let first = data.batches(10);
    let second = data.batches(10);

    let (mut wa, mut ba) = (vec![0f32; OUT * IN], vec![0f32; OUT]);
    let (gw0, gb0) = (vec![0f32; OUT * IN], vec![0f32; OUT]);
    let mut a = build(algo, &mut wa, &gw0, &mut ba, &gb0);
    train(&mut a, &mut wa, &mut ba, &first);
    a.set_lr(0, 0.015).unwrap(); // a scheduled lr is part of the checkpoint too

    // Checkpoint.
    let infos: Vec<StateInfo> = a.states().unwrap();
    let blob: Vec<(String, usize, Vec<u8>)> =
        infos.iter().map(|s| (s.name.clone(), s.tensor, a.read_state(s.index).unwrap())).collect();
    let steps: Vec<i64> = (0..2).map(|g| a.step_count(g).unwrap()).collect();
    let lrs: Vec<f64> = (0..2).map(|g| a.lr(g).unwrap()).collect();
    let (wc, bc) = (wa.clone(), ba.clone());
    assert_eq!(steps, vec![10, 10]);

    train(&mut a, &mut wa, &mut ba, &second);

    // Resume in a fresh optimizer with the same options and seed (Dion's RCQR sketches are
    // keyed by seed and step; its Q comes from the checkpoint).
    let (mut wb, mut bb) = (wc, bc);
    let mut b = build(algo, &mut wb, &gw0, &mut bb, &gb0);
    for (name, tensor, bytes) in &blob {
        let i = b.find_state(*tensor, name).unwrap();
        b.write_state(i, bytes).unwrap();
    }
    for g in 0..2 {
        b.set_step_count(g, steps[g]).unwrap();
        b.set_lr(g, lrs[g]).unwrap();
    }
    train(&mut b, &mut wb, &mut bb, &second);

    assert_eq!(wa, wb, "{algo:?}: the weight differs after resuming");
    assert_eq!(ba, bb, "{algo:?}: the bias differs after resuming");
    for s in a.states().unwrap() {
        assert_eq!(a.read_state(s.index).unwrap(), b.read_state(s.index).unwrap(), "{algo:?}: state {}", s.name);
    }
    assert_eq!(b.step_count(0).unwrap(), 20);
}

#[test]
fn checkpoint_resumes_exactly_muon() {
    checkpoint_resumes_exactly(Algorithm::Muon);
}

#[test]
fn checkpoint_resumes_exactly_dion() {
    checkpoint_resumes_exactly(Algorithm::Dion);
}

#[test]
fn checkpoint_resumes_exactly_normuon() {
    checkpoint_resumes_exactly(Algorithm::NorMuon);
}
