// SPDX-License-Identifier: MIT
//! A two-layer tanh MLP "student" (32 -> 64 -> 16) learns a fixed random
//! "teacher" MLP from fresh Gaussian inputs every step, on the host backend.
//! The weight matrices go to an orthonormal optimizer (Muon by default), the
//! biases to AdamW: the usual split. The learning rate is constant, then
//! decays linearly to 0 over the last 30% of the steps (through set_lr).
//!
//!     cargo run --example train [-- --algo muon|dion|normuon|dion2|nordion2|adamw|lion] [--steps N]
//!
//! Prints the held-out loss every 50 steps and exits non-zero if it did not
//! drop by at least 10x (so CI notices a broken build).
use dion::{Algorithm, Buffers, GroupOptions, Optimizer, OptimizerOptions, Tensor};

const N_IN: usize = 32;
const N_HID: usize = 64;
const N_OUT: usize = 16;
const T_HID: usize = 48; // teacher hidden units
const BATCH: usize = 64;
const EVAL: usize = 512;

/// splitmix64 + Box-Muller.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / 9_007_199_254_740_992.0
    }
    fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                (std * (-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()) as f32
            })
            .collect()
    }
}

/// y[b, o] = act(sum_i x[b, i] w[o, i] + bias[o]); w is fan_out x fan_in (torch.nn.Linear).
fn linear(x: &[f32], w: &[f32], bias: &[f32], n_in: usize, n_out: usize, tanh: bool) -> Vec<f32> {
    let rows = x.len() / n_in;
    let mut y = vec![0f32; rows * n_out];
    for r in 0..rows {
        let xr = &x[r * n_in..(r + 1) * n_in];
        for o in 0..n_out {
            let s = bias[o] + xr.iter().zip(&w[o * n_in..(o + 1) * n_in]).map(|(a, b)| a * b).sum::<f32>();
            y[r * n_out + o] = if tanh { s.tanh() } else { s };
        }
    }
    y
}

struct Mlp {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

struct Grads {
    w1: Vec<f32>,
    b1: Vec<f32>,
    w2: Vec<f32>,
    b2: Vec<f32>,
}

impl Mlp {
    fn forward(&self, x: &[f32], hid: usize) -> (Vec<f32>, Vec<f32>) {
        let h = linear(x, &self.w1, &self.b1, N_IN, hid, true);
        let y = linear(&h, &self.w2, &self.b2, hid, N_OUT, false);
        (h, y)
    }

    /// Mean squared error; with `g`, also its gradients.
    fn loss(&self, x: &[f32], target: &[f32], g: Option<&mut Grads>) -> f64 {
        let rows = x.len() / N_IN;
        let (h, y) = self.forward(x, N_HID);
        let n = (rows * N_OUT) as f64;
        let loss = y.iter().zip(target).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / n;
        let Some(g) = g else { return loss };
        let dy: Vec<f32> = y.iter().zip(target).map(|(a, b)| (2.0 * (a - b) as f64 / n) as f32).collect();
        for v in [&mut g.w1, &mut g.b1, &mut g.w2, &mut g.b2] {
            v.fill(0.0);
        }
        let mut dh = vec![0f32; rows * N_HID];
        for r in 0..rows {
            for o in 0..N_OUT {
                let d = dy[r * N_OUT + o];
                g.b2[o] += d;
                for j in 0..N_HID {
                    g.w2[o * N_HID + j] += d * h[r * N_HID + j];
                    dh[r * N_HID + j] += d * self.w2[o * N_HID + j];
                }
            }
        }
        for r in 0..rows {
            for j in 0..N_HID {
                let hv = h[r * N_HID + j];
                let d = dh[r * N_HID + j] * (1.0 - hv * hv);
                g.b1[j] += d;
                for i in 0..N_IN {
                    g.w1[j * N_IN + i] += d * x[r * N_IN + i];
                }
            }
        }
        loss
    }
}

fn parse_args() -> Result<(Algorithm, usize), String> {
    let mut algo = Algorithm::Muon;
    let mut steps = 600;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--algo" => {
                algo = match args.next().as_deref() {
                    Some("muon") => Algorithm::Muon,
                    Some("dion") => Algorithm::Dion,
                    Some("dion2") => Algorithm::Dion2,
                    Some("normuon") => Algorithm::NorMuon,
                    Some("nordion2") | Some("dion3") => Algorithm::NorDion2,
                    Some("adamw") => Algorithm::AdamW,
                    Some("lion") => Algorithm::Lion,
                    other => return Err(format!("unknown --algo {other:?}")),
                }
            }
            "--steps" => {
                steps = args.next().and_then(|s| s.parse().ok()).ok_or("--steps needs a positive integer")?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok((algo, steps))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (algo, steps) = parse_args()?;
    let v = dion::check_version()?;
    println!(
        "libdion {v} (bindings for {}), {algo:?} for W1/W2 + AdamW for biases, {steps} steps",
        dion::HEADER_VERSION
    );

    let mut rng = Rng(2024);
    // Teacher: clearly nonlinear first layer, outputs normalized to ~unit variance below.
    let teacher = Mlp {
        w1: rng.normals(T_HID * N_IN, 2.0 / (N_IN as f64).sqrt()),
        b1: rng.normals(T_HID, 0.5),
        w2: rng.normals(N_OUT * T_HID, 1.0 / (T_HID as f64).sqrt()),
        b2: rng.normals(N_OUT, 0.5),
    };
    let teach = |x: &[f32]| teacher.forward(x, T_HID).1;
    let x_eval = rng.normals(EVAL * N_IN, 1.0);
    let y_eval = teach(&x_eval);
    let scale = (y_eval.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / y_eval.len() as f64).sqrt() as f32;
    let y_eval: Vec<f32> = y_eval.iter().map(|v| v / scale).collect();

    // Student (PyTorch-like init) and its gradients.
    let mut s = Mlp {
        w1: rng.normals(N_HID * N_IN, 1.0 / (N_IN as f64).sqrt()),
        b1: vec![0.0; N_HID],
        w2: rng.normals(N_OUT * N_HID, 1.0 / (N_HID as f64).sqrt()),
        b2: vec![0.0; N_OUT],
    };
    let mut g =
        Grads { w1: vec![0.0; N_HID * N_IN], b1: vec![0.0; N_HID], w2: vec![0.0; N_OUT * N_HID], b2: vec![0.0; N_OUT] };

    let (lr_mat, lr_vec) = match algo {
        Algorithm::AdamW => (1e-2, 1e-2),
        Algorithm::Lion => (1e-3, 1e-3),
        _ => (0.03, 3e-3),
    };
    let mut opt = Optimizer::new(&OptimizerOptions::new().seed(1))?;
    let mats = opt.add_group(
        &GroupOptions::new(algo).lr(lr_mat).weight_decay(0.0).rank_fraction(0.5),
        [
            Tensor::new(&mut s.w1, &g.w1, &[N_HID, N_IN]).name("W1"),
            Tensor::new(&mut s.w2, &g.w2, &[N_OUT, N_HID]).name("W2"),
        ],
    )?;
    let vecs = opt.add_group(
        &GroupOptions::new(Algorithm::AdamW).lr(lr_vec).weight_decay(0.0),
        [Tensor::new(&mut s.b1, &g.b1, &[N_HID]).name("b1"), Tensor::new(&mut s.b2, &g.b2, &[N_OUT]).name("b2")],
    )?;
    let mem = opt.memory_usage()?;
    println!("optimizer state: {} bytes in {} buffers", mem.state_bytes, opt.state_count()?);

    let initial = s.loss(&x_eval, &y_eval, None);
    println!("{:>6}  {:>12}", "step", "eval loss");
    println!("{:>6}  {:>12.5}", 0, initial);
    for step in 1..=steps {
        let frac = (step - 1) as f64 / steps as f64;
        let mult = if frac < 0.7 { 1.0 } else { (1.0 - frac) / 0.3 };
        opt.set_lr(mats, lr_mat * mult)?;
        opt.set_lr(vecs, lr_vec * mult)?;

        let x = rng.normals(BATCH * N_IN, 1.0);
        let y: Vec<f32> = teach(&x).iter().map(|v| v / scale).collect();
        s.loss(&x, &y, Some(&mut g));
        opt.step([
            Buffers::new(&mut s.w1, &g.w1),
            Buffers::new(&mut s.w2, &g.w2),
            Buffers::new(&mut s.b1, &g.b1),
            Buffers::new(&mut s.b2, &g.b2),
        ])?;
        if step % 50 == 0 || step == steps {
            println!("{:>6}  {:>12.5}", step, s.loss(&x_eval, &y_eval, None));
        }
    }
    let last = s.loss(&x_eval, &y_eval, None);
    let skipped = opt.skipped_steps()?;
    println!(
        "held-out loss {initial:.4} -> {last:.4} ({:.1}x lower); group steps {}/{}; skipped {}",
        initial / last,
        opt.step_count(mats)?,
        opt.step_count(vecs)?,
        skipped.total
    );
    if last.is_nan() || last >= initial / 10.0 {
        return Err(format!("the loss did not drop by 10x ({initial} -> {last})").into());
    }
    Ok(())
}
