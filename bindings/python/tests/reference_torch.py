# SPDX-License-Identifier: MIT
"""float64 textbook versions of the Dion family written in torch, for the libdion.torch tests.

Each function takes float64 tensors (parameter X, gradient G and the state
going in) and returns the new parameter and state; section numbers refer to
/work/shared/spec/microsoft-dion-spec.md. They are written from the spec's
equations, independently of libdion's code, and orthogonalize in float64
(libdion computes in fp32, so no bf16 rounding is modelled). AdamW is checked
against torch.optim.AdamW itself, so it has no function here.
"""
import math

import torch

from reference_np import NEWTON_SCHULZ, POLAR_EXPRESS


def lion(x, g, m, lr, beta1, beta2, wd):
    """§1.4 Lion: u = sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g; x = (1 - lr wd) x - lr u."""
    u = torch.sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    return (1 - lr * wd) * x - lr * u, m


def orthogonalize(a, eps=1e-8, kind="polar_express", steps=5):
    """§1.2: the polar factor of each matrix of `a` (last two dims) by a tuned quintic iteration."""
    table = POLAR_EXPRESS if kind == "polar_express" else NEWTON_SCHULZ
    safety = 1.02 if kind == "polar_express" else 1.0
    x = a / (safety * torch.linalg.matrix_norm(a, keepdim=True) + eps)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    for i in range(steps):
        ca, cb, cc = table[min(i, len(table) - 1)]
        s = x @ x.mT
        x = ca * x + (cb * s + cc * s @ s) @ x
    return x.mT if tall else x


def adjusted_lr(lr, fan_out, fan_in, mode="spectral_norm"):
    """§1.1."""
    if mode == "spectral_norm":
        return lr * math.sqrt(fan_out / fan_in)
    if mode == "rms_norm":
        return lr * 0.2 * math.sqrt(max(fan_out, fan_in))
    return lr


def muon(x, g, m, lr, mu, wd, eps=1e-8, nesterov=False, adjust="spectral_norm"):
    """§3.2 Muon (leading dims are a batch). Returns (x, m)."""
    m = mu * m + g
    u = orthogonalize(mu * m + g if nesterov else m, eps)
    return (1 - lr * wd) * x - adjusted_lr(lr, x.shape[-2], x.shape[-1], adjust) * u, m


def _neuron_normalize(u, v, beta2):
    """§4.2: v = lerp(v, mean_j u_ij^2, 1 - beta2); u / (sqrt(v) + 1e-8) rescaled to ||u||_F."""
    v = v + (1 - beta2) * ((u * u).mean(dim=-1, keepdim=True) - v)
    un = u / (v.sqrt() + 1e-8)
    f = torch.linalg.matrix_norm(u, keepdim=True)
    return un * f / torch.clamp(torch.linalg.matrix_norm(un, keepdim=True), min=1e-8), v


def normuon(x, g, m, v, lr, mu, beta2, wd, eps=1e-8):
    """§4.2 NorMuon (nesterov off). Returns (x, m, v); v has shape (..., rows, 1)."""
    m = mu * m + g
    u, v = _neuron_normalize(orthogonalize(m, eps), v, beta2)
    return (1 - lr * wd) * x - adjusted_lr(lr, x.shape[-2], x.shape[-1]) * u, m, v


def dion(x, g, m, q, lr, mu, wd, eps=1e-8):
    """§2.3 Dion on one device, Householder QR (equal to RCQR up to column signs). Returns (x, m, q)."""
    rows, cols = x.shape
    wide = rows < cols
    m = m + g
    b = m.mT if wide else m
    p, _ = torch.linalg.qr(b @ q)
    r = b.mT @ p
    m = m - (1 - mu) * (r @ p.mT if wide else p @ r.mT)
    q = r / (r.norm(dim=0, keepdim=True) + eps)
    d = q @ p.mT if wide else p @ q.mT
    return (1 - lr * wd) * x - lr * math.sqrt(rows / cols) * d, m, q


def dion2(x, g, m, lr, fraction, ef_decay, wd, eps=1e-8):
    """§5.3 Dion2, local scope: rows selected if rows <= cols, else columns. Returns (x, m)."""
    rows_sel = x.shape[0] <= x.shape[1]
    m = m + g
    mt = m if rows_sel else m.mT
    k = max(1, math.ceil(fraction * mt.shape[0]))
    idx = torch.topk(mt.abs().sum(dim=1), k).indices
    s = mt[idx].clone()
    mt = mt.clone()
    mt[idx] = ef_decay * s
    o = orthogonalize(s, eps)
    xt = (1 - lr * wd) * (x if rows_sel else x.mT)
    xt = xt.clone()
    xt[idx] -= adjusted_lr(lr, x.shape[0], x.shape[1]) * o
    return (xt if rows_sel else xt.mT), (mt if rows_sel else mt.mT)


def nordion2(x, g, m, v, lr, fraction, mu, beta2, wd, eps=1e-8):
    """§6.2 NorDion2: always rows; the selected rows' update is normalised with their variance_neuron."""
    m = m + g
    k = max(1, math.ceil(fraction * m.shape[0]))
    idx = torch.topk(m.abs().sum(dim=1), k).indices
    s = m[idx].clone()
    m = m.clone()
    m[idx] = mu * s
    u, v_sel = _neuron_normalize(orthogonalize(s, eps), v[idx], beta2)
    v = v.clone()
    v[idx] = v_sel
    x = (1 - lr * wd) * x
    x[idx] -= adjusted_lr(lr, x.shape[0], x.shape[1]) * u
    return x, m, v
