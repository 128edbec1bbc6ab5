# SPDX-License-Identifier: MIT
"""libdion's updates against the float64 references of reference_np.py, through the Python binding.

Tolerances. libdion computes in fp32 (unit roundoff u = 6e-8):
* AdamW and Lion are element-wise: a handful of roundings per element, so a
  relative error of a few u per step; 1e-5 relative (+1e-6 absolute for
  values near zero) leaves two orders of margin over 6 steps.
* Muon and Dion go through matrix products, a polynomial iteration or a QR
  of small matrices (n <= 24): error ~ n*u*(growth) ~ 1e-6 relative on the
  update. The check is 1e-4 relative to the update's largest entry, measured
  one step at a time from the library's own state, so that fp32 differences
  do not compound through the polynomial's amplification of small singular
  values. End-to-end multi-step runs are checked at 1e-3.
"""
import numpy as np
import pytest

import reference_np as ref
from conftest import f32
from libdion import Optimizer

STEPS = 6


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    scale = np.max(np.abs(b)) if b.size else 1.0
    return float(np.max(np.abs(a - b)) / scale) if b.size and scale > 0 else float(np.max(np.abs(a - b), initial=0))


# --------------------------------------------------------------------------
# AdamW and Lion (element-wise)
# --------------------------------------------------------------------------

SCALAR_SHAPES = [(), (7,), (3, 5), (2, 3, 4), (1, 1, 2, 3)]


@pytest.mark.parametrize("shape", SCALAR_SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("cautious", [False, True], ids=["wd", "cautious_wd"])
def test_adamw_matches_float64_reference(rng, shape, cautious):
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1
    x = f32(rng, *shape)
    g = np.zeros(shape, np.float32)
    xr = x.astype(np.float64)
    mr = np.zeros(shape)
    vr = np.zeros(shape)
    with Optimizer() as opt:
        grp = opt.add_group("adamw", [(x, g, "p")], lr=lr, betas=(b1, b2), epsilon=eps, weight_decay=wd,
                            cautious_wd=cautious)
        for t in range(1, STEPS + 1):
            g[...] = f32(rng, *shape)
            opt.step()
            xr, mr, vr = ref.adamw(xr, g.astype(np.float64), mr, vr, t, lr, b1, b2, eps, wd, cautious)
            np.testing.assert_allclose(x, xr, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(opt.read_state((0, "momentum")), mr, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(opt.read_state((0, "variance")), vr, rtol=1e-5, atol=1e-9)
            assert opt.step_count(grp) == t


@pytest.mark.parametrize("shape", SCALAR_SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("cautious", [False, True], ids=["wd", "cautious_wd"])
def test_lion_matches_float64_reference(rng, shape, cautious):
    lr, b1, b2, wd = 0.003, 0.9, 0.99, 0.5
    x = f32(rng, *shape)
    g = np.zeros(shape, np.float32)
    xr = x.astype(np.float64)
    mr = np.zeros(shape)
    with Optimizer() as opt:
        opt.add_group("lion", [(x, g, "p")], lr=lr, beta1=b1, beta2=b2, weight_decay=wd, cautious_wd=cautious)
        for _ in range(STEPS):
            g[...] = f32(rng, *shape)
            opt.step()
            xr, mr = ref.lion(xr, g.astype(np.float64), mr, lr, b1, b2, wd, cautious)
            np.testing.assert_allclose(x, xr, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(opt.read_state(0), mr, rtol=1e-5, atol=1e-7)


def test_adamw_fp16_parameters_track_the_reference_at_fp16_precision(rng):
    """fp16 storage: the library rounds x, m, v to fp16 after each step; the reference does the same."""
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1
    x = f32(rng, 5, 6).astype(np.float16)
    g = np.zeros((5, 6), np.float16)
    xr = x.astype(np.float64)
    mr = np.zeros((5, 6))
    vr = np.zeros((5, 6))
    with Optimizer() as opt:
        opt.add_group("adamw", [(x, g, "h")], lr=lr, betas=(b1, b2), epsilon=eps, weight_decay=wd)
        st = {s["name"]: s for s in opt.states()}
        assert st["momentum"]["dtype"] == "fp16" and opt.read_state(0).dtype == np.float16
        for t in range(1, 4):
            g[...] = f32(rng, 5, 6)
            opt.step()
            xr, mr, vr = ref.adamw(xr, g.astype(np.float64), mr, vr, t, lr, b1, b2, eps, wd)
            xr, mr, vr = (a.astype(np.float16).astype(np.float64) for a in (xr, mr, vr))
            np.testing.assert_allclose(x, xr, rtol=2e-3, atol=2e-3)


# --------------------------------------------------------------------------
# Muon (Polar Express / Newton-Schulz)
# --------------------------------------------------------------------------

MUON_CASES = [
    dict(shape=(16, 8)),
    dict(shape=(8, 16)),
    dict(shape=(12, 12)),
    dict(shape=(1, 9)),
    dict(shape=(2, 6, 10)),
    dict(shape=(16, 8), nesterov=True),
    dict(shape=(8, 16), adjust_lr="rms_norm"),
    dict(shape=(8, 16), adjust_lr=None),
    dict(shape=(10, 6), orthogonalizer="newton_schulz"),
    dict(shape=(6, 10), ortho_steps=7),
]


def _muon_id(c):
    extra = [("%s=%s" % (k, v)) for k, v in c.items() if k != "shape"]
    return "x".join(map(str, c["shape"])) + ("-" + "-".join(extra) if extra else "")


@pytest.mark.parametrize("case", MUON_CASES, ids=_muon_id)
def test_muon_matches_float64_polar_express_each_step(rng, case):
    case = dict(case)
    shape = case.pop("shape")
    lr, mu, wd, eps = 0.05, 0.9, 0.1, 1e-8
    nesterov = case.get("nesterov", False)
    adjust = case.get("adjust_lr", "spectral_norm")
    kind = case.get("orthogonalizer", "polar_express")
    steps = case.get("ortho_steps", 5)
    x = f32(rng, *shape, scale=0.1)  # small |x|: its fp32 rounding stays far below the update
    g = np.zeros(shape, np.float32)
    with Optimizer() as opt:
        opt.add_group("muon", [(x, g, "w")], lr=lr, mu=mu, weight_decay=wd, epsilon=eps, **case)
        for _ in range(STEPS):
            g[...] = f32(rng, *shape)
            x0 = x.astype(np.float64)
            m0 = opt.read_state((0, "momentum")).astype(np.float64)
            xr, mr, upd = ref.muon(x0, g.astype(np.float64), m0, lr, mu, wd, eps, nesterov, adjust, kind, steps)
            opt.step()
            upd_lib = (1 - lr * wd) * x0 - x.astype(np.float64)
            assert rel_err(upd_lib, upd) < 1e-4
            assert rel_err(opt.read_state(0), mr) < 1e-6


def test_muon_multi_step_end_to_end(rng):
    shape = (12, 20)
    lr, mu, wd, eps = 0.02, 0.95, 0.01, 1e-8
    x = f32(rng, *shape)
    x_start = x.astype(np.float64)
    g = np.zeros(shape, np.float32)
    xr = x_start.copy()
    mr = np.zeros(shape)
    with Optimizer() as opt:
        opt.add_group("muon", [(x, g, "w")], lr=lr, mu=mu, weight_decay=wd, epsilon=eps)
        for _ in range(10):
            g[...] = f32(rng, *shape)
            opt.step()
            xr, mr, _ = ref.muon(xr, g.astype(np.float64), mr, lr, mu, wd, eps)
        assert rel_err(x - x_start, xr - x_start) < 1e-3
        assert rel_err(opt.read_state(0), mr) < 1e-5


def test_muon_column_major_parameter_equals_row_major(rng):
    """An F-ordered 2-D array is DION_LAYOUT_COL_MAJOR: same logical matrix, same update."""
    xc = f32(rng, 9, 5)
    xf = np.asfortranarray(xc.copy())
    gc = np.zeros((9, 5), np.float32)
    gf = np.zeros((9, 5), np.float32, order="F")
    with Optimizer() as a, Optimizer() as b:
        a.add_group("muon", [(xc, gc, "c")], lr=0.05)
        b.add_group("muon", [(xf, gf, "f")], lr=0.05)
        assert b.states()[0]["layout"] == "col_major"
        for _ in range(3):
            gc[...] = f32(rng, 9, 5)
            gf[...] = gc
            a.step()
            b.step()
        np.testing.assert_allclose(xf, xc, rtol=0, atol=1e-6)
        mf = b.read_state(0)
        assert mf.flags.f_contiguous and mf.shape == (9, 5)
        np.testing.assert_allclose(mf, a.read_state(0), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------
# Dion
# --------------------------------------------------------------------------

DION_CASES = [
    dict(shape=(16, 8)),                         # tall, r = 8 < a: randomized Cholesky QR
    dict(shape=(8, 16)),                         # wide: B = M^T, Q is (m, r)
    dict(shape=(12, 12)),                        # square, r = a: Householder QR
    dict(shape=(20, 12), rank_fraction=0.5),     # low rank r = 6
    dict(shape=(10, 24), rank_fraction=0.25),    # wide low rank r = 3
    dict(shape=(16, 8), qr_method="qr"),
    dict(shape=(16, 8), qr_method="cqr", cqr_warmup_steps=0),
    dict(shape=(18, 10), rank_fraction=0.5, power_iters=1, rank_multiple_of=4),  # r = 8
]


def _dion_rank(shape, rank_fraction=1.0, rank_multiple_of=1, **_):
    mn = min(shape)
    q = rank_multiple_of
    return int(min(mn, q * np.ceil(rank_fraction * mn / q)))


@pytest.mark.parametrize("case", DION_CASES, ids=_muon_id)
def test_dion_matches_float64_reference_each_step(rng, case):
    case = dict(case)
    shape = case.pop("shape")
    lr, mu, wd, eps = 0.05, 0.9, 0.1, 1e-8
    r = _dion_rank(shape, **case)
    x = f32(rng, *shape, scale=0.1)
    g = np.zeros(shape, np.float32)
    with Optimizer(seed=7) as opt:
        opt.add_group("dion", [(x, g, "w")], lr=lr, mu=mu, weight_decay=wd, epsilon=eps, **case)
        qi = opt.find_state(0, "Q")
        info = opt.state_info(qi)
        b = shape[0] if shape[0] < shape[1] else shape[1]
        assert info["global_shape"] == (b, r) and info["local_shape"] == (b, r)
        q0 = opt.read_state(qi)
        assert np.all(np.isfinite(q0)) and np.std(q0) > 0.3  # N(0, 1) from the library's generator
        for _ in range(STEPS):
            g[...] = f32(rng, *shape)
            x0 = x.astype(np.float64)
            m0 = opt.read_state((0, "momentum")).astype(np.float64)
            Q0 = opt.read_state(qi).astype(np.float64)
            xr, mr, qr, upd = ref.dion(x0, g.astype(np.float64), m0, Q0, lr, mu, wd, eps)
            opt.step()
            upd_lib = (1 - lr * wd) * x0 - x.astype(np.float64)
            assert rel_err(upd_lib, upd) < 1e-4
            assert rel_err(opt.read_state(0), mr) < 1e-4
            q_lib = opt.read_state(qi).astype(np.float64)
            assert rel_err(ref.align_signs(q_lib, qr), qr) < 1e-4
            np.testing.assert_allclose(np.linalg.norm(q_lib, axis=0), 1.0, rtol=1e-5)


def test_dion_multi_step_end_to_end_from_the_initial_q(rng):
    shape = (16, 12)
    lr, mu, wd, eps = 0.02, 0.95, 0.01, 1e-8
    x = f32(rng, *shape)
    g = np.zeros(shape, np.float32)
    with Optimizer(seed=3) as opt:
        opt.add_group("dion", [(x, g, "w")], lr=lr, mu=mu, weight_decay=wd, epsilon=eps, rank_fraction=0.5)
        Q = opt.read_state((0, "Q")).astype(np.float64)  # the library draws Q0 from its own generator
        x_start = x.astype(np.float64)
        xr = x_start.copy()
        M = np.zeros(shape)
        for _ in range(8):
            g[...] = f32(rng, *shape)
            opt.step()
            xr, M, Q, _ = ref.dion(xr, g.astype(np.float64), M, Q, lr, mu, wd, eps)
        assert rel_err(x - x_start, xr - x_start) < 1e-3
        assert rel_err(opt.read_state(0), M) < 1e-3


def test_dion_zero_gradient_only_decays(rng):
    """Spec §13.5: with a zero gradient X = (1 - lr wd) X exactly and Q's columns get norm 1."""
    x = f32(rng, 10, 6)
    x0 = x.copy()
    g = np.zeros((10, 6), np.float32)
    with Optimizer() as opt:
        opt.add_group("dion", [(x, g, "w")], lr=0.1, weight_decay=0.5)
        opt.step()
        np.testing.assert_allclose(x, x0 * np.float32(1 - 0.1 * 0.5), rtol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(opt.read_state((0, "Q")), axis=0), 1.0, rtol=1e-5)
