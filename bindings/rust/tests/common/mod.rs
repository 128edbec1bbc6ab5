// SPDX-License-Identifier: MIT
//! Helpers shared by the integration tests: a deterministic generator and a
//! small linear teacher-student regression problem.
#![allow(dead_code)]

/// splitmix64 with Box-Muller normals (the same generator as examples/c/demo_mlp.c).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / 9_007_199_254_740_992.0)
    }

    pub fn normal(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }

    pub fn normals(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n).map(|_| (std * self.normal()) as f32).collect()
    }
}

/// y = W x + b with W: OUT x IN (row-major, as torch.nn.Linear), b: OUT.
pub const IN: usize = 32;
pub const OUT: usize = 16;
pub const BATCH: usize = 64;

pub struct Teacher {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
}

impl Teacher {
    pub fn new(rng: &mut Rng) -> Self {
        Teacher { w: rng.normals(OUT * IN, (1.0 / IN as f64).sqrt()), b: rng.normals(OUT, 0.5) }
    }

    pub fn targets(&self, x: &[f32]) -> Vec<f32> {
        let mut y = vec![0f32; x.len() / IN * OUT];
        linear(x, &self.w, &self.b, &mut y);
        y
    }
}

/// y[n, o] = sum_i x[n, i] w[o, i] + b[o].
pub fn linear(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32]) {
    let n = x.len() / IN;
    for r in 0..n {
        for o in 0..OUT {
            let mut s = b[o];
            for i in 0..IN {
                s += x[r * IN + i] * w[o * IN + i];
            }
            y[r * OUT + o] = s;
        }
    }
}

/// Mean squared error of the student on (x, y); with grads, also writes
/// dL/dw and dL/db.
pub fn mse(x: &[f32], y: &[f32], w: &[f32], b: &[f32], grads: Option<(&mut [f32], &mut [f32])>) -> f64 {
    let n = x.len() / IN;
    let mut pred = vec![0f32; n * OUT];
    linear(x, w, b, &mut pred);
    let scale = 1.0 / (n * OUT) as f32;
    let mut loss = 0f64;
    let mut d = vec![0f32; n * OUT];
    for k in 0..n * OUT {
        let e = pred[k] - y[k];
        loss += (e as f64) * (e as f64);
        d[k] = 2.0 * e * scale;
    }
    if let Some((gw, gb)) = grads {
        gw.fill(0.0);
        gb.fill(0.0);
        for r in 0..n {
            for o in 0..OUT {
                let g = d[r * OUT + o];
                gb[o] += g;
                for i in 0..IN {
                    gw[o * IN + i] += g * x[r * IN + i];
                }
            }
        }
    }
    loss / (n * OUT) as f64
}
