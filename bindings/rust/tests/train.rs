// SPDX-License-Identifier: MIT
//! End to end on the host backend: a linear student learns a linear teacher,
//! Muon for the weight matrix and AdamW for the bias, with a learning-rate
//! schedule through set_lr. The held-out loss must drop by a large factor.
mod common;

use common::*;
use dion::{Algorithm, Buffers, GroupOptions, Hparam, Optimizer, OptimizerOptions, Tensor};

const STEPS: usize = 300;
const LR_MUON: f64 = 0.05;
const LR_ADAMW: f64 = 0.05;

struct Run {
    initial: f64,
    last: f64,
    w: Vec<f32>,
}

fn train(seed: u64, algo: Algorithm) -> dion::Result<Run> {
    let mut rng = Rng(seed);
    let teacher = Teacher::new(&mut rng);
    let x_eval = rng.normals(256 * IN, 1.0);
    let y_eval = teacher.targets(&x_eval);

    let (mut w, mut gw) = (vec![0f32; OUT * IN], vec![0f32; OUT * IN]);
    let (mut b, mut gb) = (vec![0f32; OUT], vec![0f32; OUT]);

    let mut opt = Optimizer::new(&OptimizerOptions::new().seed(seed))?;
    let gm = opt.add_group(
        &GroupOptions::new(algo).lr(LR_MUON).weight_decay(0.0),
        [Tensor::new(&mut w, &gw, &[OUT, IN]).name("w")],
    )?;
    let ga = opt.add_group(
        &GroupOptions::new(Algorithm::AdamW).lr(LR_ADAMW).weight_decay(0.0),
        [Tensor::new(&mut b, &gb, &[OUT]).name("b")],
    )?;
    assert_eq!((gm, ga), (0, 1));
    assert_eq!((opt.group_count()?, opt.tensor_count()?), (2, 2));

    let initial = mse(&x_eval, &y_eval, &w, &b, None);
    for step in 0..STEPS {
        // Constant, then linear decay to 0 over the last 40% of the steps.
        let frac = step as f64 / STEPS as f64;
        let mult = if frac < 0.6 { 1.0 } else { (1.0 - frac) / 0.4 };
        opt.set_lr(gm, LR_MUON * mult)?;
        opt.set_hparam(ga, Hparam::Lr, LR_ADAMW * mult)?;

        let x = rng.normals(BATCH * IN, 1.0);
        let y = teacher.targets(&x);
        mse(&x, &y, &w, &b, Some((&mut gw, &mut gb)));
        opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut b, &gb)])?;
    }
    let last = mse(&x_eval, &y_eval, &w, &b, None);

    assert_eq!(opt.step_count(gm)?, STEPS as i64);
    assert_eq!(opt.step_count(ga)?, STEPS as i64);
    assert_eq!(opt.skipped_steps()?, dion::SkippedSteps { total: 0, last: false });
    assert!(opt.async_error()?.is_none());
    Ok(Run { initial, last, w })
}

#[test]
fn muon_and_adamw_fit_a_linear_teacher() {
    let r = train(1234, Algorithm::Muon).unwrap();
    eprintln!("muon: held-out loss {:.4e} -> {:.4e} ({:.0}x)", r.initial, r.last, r.initial / r.last);
    assert!(r.initial > 0.5, "initial loss {}", r.initial);
    assert!(r.last < r.initial / 100.0, "loss only went from {} to {}", r.initial, r.last);
}

#[test]
fn dion_and_adamw_fit_a_linear_teacher() {
    let r = train(99, Algorithm::Dion).unwrap();
    eprintln!("dion: held-out loss {:.4e} -> {:.4e} ({:.0}x)", r.initial, r.last, r.initial / r.last);
    assert!(r.last < r.initial / 100.0, "loss only went from {} to {}", r.initial, r.last);
}

#[test]
fn training_is_deterministic() {
    let a = train(7, Algorithm::Muon).unwrap();
    let b = train(7, Algorithm::Muon).unwrap();
    assert_eq!(a.w, b.w);
}

#[test]
fn a_nonfinite_gradient_skips_the_whole_step() {
    let mut w = vec![0.5f32; 4 * 3];
    let mut gw = vec![0.1f32; 4 * 3];
    let mut b = vec![0.5f32; 4];
    let gb = vec![0.1f32; 4];
    let mut opt = Optimizer::new(&OptimizerOptions::new()).unwrap();
    opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::new(&mut w, &gw, &[4, 3])]).unwrap();
    opt.add_group(&GroupOptions::new(Algorithm::AdamW), [Tensor::new(&mut b, &gb, &[4])]).unwrap();
    opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut b, &gb)]).unwrap();
    let (w1, b1) = (w.clone(), b.clone());
    let momentum = opt.read_state_f32(opt.find_state(0, "momentum").unwrap()).unwrap();

    gw[5] = f32::NAN;
    opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut b, &gb)]).unwrap();
    assert_eq!((w.clone(), b.clone()), (w1, b1), "a skipped step changed a parameter");
    assert_eq!(opt.read_state_f32(opt.find_state(0, "momentum").unwrap()).unwrap(), momentum);
    assert_eq!(opt.skipped_steps().unwrap(), dion::SkippedSteps { total: 1, last: true });
    assert_eq!(opt.step_count(0).unwrap(), 1);

    gw[5] = 0.1;
    opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut b, &gb)]).unwrap();
    assert_eq!(opt.skipped_steps().unwrap(), dion::SkippedSteps { total: 1, last: false });
    assert_eq!(opt.step_count(1).unwrap(), 2);
}

#[test]
fn a_tensor_without_gradient_is_skipped() {
    let mut w = vec![0.5f32; 4 * 3];
    let gw = vec![0.1f32; 4 * 3];
    let mut opt = Optimizer::new(&OptimizerOptions::new()).unwrap();
    opt.add_group(&GroupOptions::new(Algorithm::Muon), [Tensor::without_grad(&mut w, &[4, 3])]).unwrap();
    opt.step([Buffers::without_grad(&mut w)]).unwrap();
    assert_eq!(w, vec![0.5f32; 12]);
    opt.step([Buffers::new(&mut w, &gw)]).unwrap();
    assert_ne!(w, vec![0.5f32; 12]);
}

#[test]
fn the_optimizer_can_move_to_another_thread() {
    let mut w = vec![0.5f32; 8 * 8];
    let gw = vec![0.1f32; 8 * 8];
    let mut opt = Optimizer::new(&OptimizerOptions::new()).unwrap();
    opt.add_group(&GroupOptions::new(Algorithm::NorMuon), [Tensor::new(&mut w, &gw, &[8, 8])]).unwrap();
    let (opt, w) = std::thread::spawn(move || {
        let mut opt = opt;
        let mut w = w;
        opt.step([Buffers::new(&mut w, &gw)]).unwrap();
        (opt, w)
    })
    .join()
    .unwrap();
    assert_eq!(opt.step_count(0).unwrap(), 1);
    assert_ne!(w, vec![0.5f32; 64]);
}

#[test]
fn every_algorithm_steps_bf16_and_f16_parameters() {
    use dion::{Bf16, F16};
    for algo in [
        Algorithm::Dion,
        Algorithm::Dion2,
        Algorithm::Muon,
        Algorithm::NorMuon,
        Algorithm::NorDion2,
        Algorithm::AdamW,
        Algorithm::Lion,
    ] {
        let mut w: Vec<Bf16> = (0..48).map(|i| Bf16::from_f32(0.01 * i as f32)).collect();
        let gw: Vec<f32> = (0..48).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.01).collect();
        let mut v: Vec<F16> = (0..48).map(|i| F16::from_f32(-0.01 * i as f32)).collect();
        let gv: Vec<F16> = gw.iter().map(|&g| F16::from_f32(g)).collect();
        let mut opt = Optimizer::new(&OptimizerOptions::new()).unwrap();
        opt.add_group(
            &GroupOptions::new(algo).lr(0.01),
            [Tensor::new(&mut w, &gw, &[6, 8]).name("w"), Tensor::new(&mut v, &gv, &[8, 6]).name("v")],
        )
        .unwrap_or_else(|e| panic!("{algo:?}: {e}"));
        let (w0, v0) = (w.clone(), v.clone());
        for _ in 0..3 {
            opt.step([Buffers::new(&mut w, &gw), Buffers::new(&mut v, &gv)])
                .unwrap_or_else(|e| panic!("{algo:?}: {e}"));
        }
        assert_ne!(w, w0, "{algo:?} did not update the bf16 parameter");
        assert_ne!(v, v0, "{algo:?} did not update the f16 parameter");
        assert!(w.iter().all(|x| x.to_f32().is_finite()) && v.iter().all(|x| x.to_f32().is_finite()));
    }
}
