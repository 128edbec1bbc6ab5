# SPDX-License-Identifier: MIT
"""float64 numpy references written from the spec's equations
(/work/shared/spec/microsoft-dion-spec.md; section numbers below refer to it).

They are textbook forms, independent of libdion's code: one function per
update, taking and returning float64 arrays.
"""
import numpy as np

# §1.2 Polar Express coefficients (5 iterations, safety factor 1.02 in the normalisation).
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
# §1.2 quintic Newton-Schulz, 5 tuned iterations.
NEWTON_SCHULZ = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def adamw(x, g, m, v, t, lr, beta1, beta2, eps, wd, cautious=False):
    """§1.4 AdamW (fused form: eps added after the bias correction of sqrt(v))."""
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** t
    bc2 = 1 - beta2 ** t
    denom = np.sqrt(v) / np.sqrt(bc2) + eps
    if cautious:
        x = x - lr * wd * x * (m * x >= 0)
    else:
        x = (1 - lr * wd) * x
    x = x - (lr / bc1) * m / denom
    return x, m, v


def lion(x, g, m, lr, beta1, beta2, wd, cautious=False):
    """§1.4 Lion: u = sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g."""
    u = np.sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    if cautious:
        x = x - lr * wd * x * (x * u >= 0)
    else:
        x = (1 - lr * wd) * x
    x = x - lr * u
    return x, m


def orthogonalize(G, eps, kind="polar_express", steps=5):
    """§1.2 on one matrix, in float64 (no bf16 rounding: libdion computes in fp32)."""
    table = POLAR_EXPRESS if kind == "polar_express" else NEWTON_SCHULZ
    safety = 1.02 if kind == "polar_express" else 1.0
    X = G / (safety * np.linalg.norm(G) + eps)
    tall = X.shape[0] > X.shape[1]
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)]
        if tall:
            A = X.T @ X
            B = b * A + c * A @ A
            X = a * X + X @ B
        else:
            A = X @ X.T
            B = b * A + c * A @ A
            X = a * X + B @ X
    return X


def adjust_lr(lr, fan_out, fan_in, mode="spectral_norm"):
    """§1.1."""
    if mode == "spectral_norm":
        return lr * np.sqrt(fan_out / fan_in)
    if mode == "rms_norm":
        return lr * 0.2 * np.sqrt(max(fan_out, fan_in))
    return lr


def muon(x, g, m, lr, mu, wd, eps, nesterov=False, adjust="spectral_norm", kind="polar_express", steps=5):
    """§3.2 Muon; leading dims are a batch of independent matrices. Returns (x, m, update)."""
    m = mu * m + g
    u = mu * m + g if nesterov else m
    rows, cols = x.shape[-2], x.shape[-1]
    ub = u.reshape(-1, rows, cols)
    o = np.stack([orthogonalize(ub[i], eps, kind, steps) for i in range(ub.shape[0])]).reshape(u.shape)
    lr_adj = adjust_lr(lr, rows, cols, adjust)
    upd = lr_adj * o
    x = (1 - lr * wd) * x - upd
    return x, m, upd


def colnorm(R, eps):
    """§13.1: R[:, j] / (||R[:, j]|| + eps)."""
    return R / (np.sqrt((R * R).sum(axis=0, keepdims=True)) + eps)


def dion(x, g, M, Q, lr, mu, wd, eps):
    """§2.3 Dion on one device with Householder QR (the QR methods agree up to column signs, §1.3).

    The working matrix B is M (tall or square) or M^T (wide), §2.2. Returns
    (x, M, Q_new, update) with update = lr sqrt(m/n) * (P Q_new^T in X's orientation).
    """
    m_, n_ = x.shape
    tau = m_ < n_
    M = M + g
    B = M.T if tau else M
    P = B @ Q
    P, _ = np.linalg.qr(P)
    R = B.T @ P
    if tau:
        M = M - (1 - mu) * (R @ P.T)
    else:
        M = M - (1 - mu) * (P @ R.T)
    Qn = colnorm(R, eps)
    D = (Qn @ P.T) if tau else (P @ Qn.T)
    upd = lr * np.sqrt(m_ / n_) * D
    x = (1 - lr * wd) * x - upd
    return x, M, Qn, upd


def align_signs(Q, ref):
    """Q with each column's sign flipped to match ref (QR bases are unique up to column signs)."""
    s = np.sign((Q * ref).sum(axis=0))
    s[s == 0] = 1
    return Q * s
