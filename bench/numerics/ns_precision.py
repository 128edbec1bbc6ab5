#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""How accurate is the Muon iteration in half precision, and does the Gram form hold up?

A host-only study (numpy, no GPU): it emulates the products the CUDA backend
runs -- operands rounded to bf16 or fp16, fp32 accumulation, the result
rounded again -- and compares each variant of the quintic Newton-Schulz
iteration (src/algo/orthogonalize.cpp's coefficients, 5 steps) with the same
iteration in float64.

Variants (each with the library's Newton-Schulz or Polar Express coefficients):
  classic      X <- (a I + b A + c A A) X with A = X X^T, every product rounded
               (what newton_schulz_bf16 does today, in bf16)
  gram         the same polynomial kept in the s x s space: Q_k = a I + b R + c R R,
               R <- Q_k R Q_k, P <- Q_k P, and X = P X_0 once at the end
               (equal to classic in exact arithmetic; 2 s^2 l products in all
               instead of 2 per step)
  gram+rK      gram, restarted after step K (2 or 3): X_K = P X_0 formed,
               R = X_K X_K^T formed again from it, P reset (the same FLOPs
               either way)
  gram+r13     restarted after steps 1 and 3 (the first step is then the
               classic one), src/algo/ns_bf16.hpp's default (kNsGramRestarts)

Printed per matrix: the relative Frobenius distance to the float64 iteration
and the range of the result's singular values (float64's own range beside it).
Then the model's FLOP count of each variant on the bench's GPT shapes.

  /usr/bin/python3 bench/numerics/ns_precision.py [--m 768 --n 3072] [--seed 0]
                                                 [--coeffs newton-schulz|polar-express]
"""
import argparse

import numpy as np

# kNewtonSchulz in src/algo/orthogonalize.cpp
NEWTON_SCHULZ = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
# kPolarExpress, whose start is normalised by 1.02 ||X||_F (kPolarExpressSafety)
POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]
NS = list(NEWTON_SCHULZ)  # the table in use (--coeffs)
FACTOR = 1.0
EPS = 1e-7


def normalise(G):
    return G / (FACTOR * np.linalg.norm(G) + EPS)


def bf16(x):
    """Round to nearest even bf16, returned as float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).reshape(x.shape)


def fp16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


ROUND = {"bf16": bf16, "fp16": fp16}


def mm(a, b, rnd):
    """A tensor-core product: rounded operands, fp32 accumulation, rounded result."""
    return rnd(np.matmul(a.astype(np.float32), b.astype(np.float32)))


def shift(R, coef, rnd):
    a, b, c = coef
    return rnd(c * np.matmul(R, R) + b * R + a * np.eye(R.shape[0], dtype=np.float32))


def classic64(G):
    X = normalise(G.astype(np.float64))
    eye = np.eye(X.shape[0])
    for a, b, c in NS:
        A = X @ X.T
        X = (a * eye + b * A + c * A @ A) @ X
    return X


def classic(G, rnd):
    X = rnd(normalise(G))
    for coef in NS:
        X = mm(shift(mm(X, X.T, rnd), coef, rnd), X, rnd)
    return X


def gram(G, rnd, restarts=()):
    """restarts: the steps after which X and R are formed again."""
    X = rnd(normalise(G))
    R, P = mm(X, X.T, rnd), None
    for it, coef in enumerate(NS):
        if it in restarts:
            X, P = mm(P, X, rnd), None
            R = mm(X, X.T, rnd)
        Q = shift(R, coef, rnd)
        P = Q if P is None else mm(Q, P, rnd)
        if it + 1 < len(NS) and it + 1 not in restarts:
            R = mm(mm(Q, R, rnd), Q, rnd)  # not symmetrised, as the library forms it
    return mm(P, X, rnd)


def make(kind, m, n, rng):
    if kind == "gaussian":
        return rng.standard_normal((m, n)).astype(np.float32)
    U, _ = np.linalg.qr(rng.standard_normal((m, m)))
    V, _ = np.linalg.qr(rng.standard_normal((n, m)))
    if kind == "decaying":  # singular values from 1 down to 1e-3, geometrically
        return ((U * np.geomspace(1, 1e-3, m)) @ V.T).astype(np.float32)
    # "low rank": a rank-16 signal plus 1 % noise, like a gradient late in training
    return (rng.standard_normal((m, 16)) @ rng.standard_normal((16, n))
            + 0.01 * rng.standard_normal((m, n))).astype(np.float32)


def sv_range(X):
    s = np.linalg.svd(X.astype(np.float64), compute_uv=False)
    return s.min(), s.max()


def flops(s, l, variant, steps=len(NS), restarts=(1, 3)):
    """Model FLOPs of one s x l matrix (s <= l). s^3 products: Q's R R, R's two, P's one."""
    if variant == "classic":
        return steps * (4 * s * s * l + 2 * s ** 3)
    bounds = [0] + sorted(restarts) + [steps]
    phases = [b - a for a, b in zip(bounds, bounds[1:])]
    # per phase: the Gram formation and the P X product, 2 s^2 l each; k Q's,
    # (k - 1) P products and (k - 1) R updates of 2 products
    return sum(4 * s * s * l + 2 * s ** 3 * (k + (k - 1) + 2 * (k - 1)) for k in phases)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=768)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--coeffs", choices=("newton-schulz", "polar-express"), default="newton-schulz")
    args = ap.parse_args()
    global FACTOR
    if args.coeffs == "polar-express":
        NS[:] = POLAR_EXPRESS
        FACTOR = 1.02
    rng = np.random.default_rng(args.seed)
    for kind in ("gaussian", "decaying", "low rank"):
        G = make(kind, args.m, args.n, rng)
        ref = classic64(G)
        lo, hi = sv_range(ref)
        print(f"{kind} {args.m} x {args.n}: float64 singular values {lo:.3f} .. {hi:.3f}")
        for prec in ("bf16", "fp16"):
            rnd = ROUND[prec]
            for name, Y in (("classic", classic(G, rnd)), ("gram", gram(G, rnd)), ("gram+r2", gram(G, rnd, (2,))),
                            ("gram+r3", gram(G, rnd, (3,))), ("gram+r13", gram(G, rnd, (1, 3)))):
                lo, hi = sv_range(Y)
                d = np.linalg.norm(Y - ref) / np.linalg.norm(ref)
                print(f"  {prec} {name:8s} distance {d:.4f}   singular values {lo:.3f} .. {hi:.3f}")
    print("model FLOPs per step, GPT block matrices (s = d; square ones keep the classic form):")
    for d, layers, name in ((768, 12, "gpt-160m"), (2048, 24, "gpt-1.3b")):
        tot = {}
        for label, rs in (("classic", None), ("gram+r2", (2,)), ("gram+r13", (1, 3))):
            for l in (3 * d, d, 4 * d, 4 * d):
                c = flops(d, l, "classic")
                g = c if rs is None else min(c, flops(d, l, "gram", restarts=rs))
                tot[label] = tot.get(label, 0) + layers * g
        c = tot["classic"]
        print(f"  {name}: classic {c / 1e12:.3f} TFLOP, gram+r2 {tot['gram+r2'] / 1e12:.3f} ({tot['gram+r2'] / c:.2f}),"
              f" gram+r13 {tot['gram+r13'] / 1e12:.3f} ({tot['gram+r13'] / c:.2f})")


if __name__ == "__main__":
    main()
