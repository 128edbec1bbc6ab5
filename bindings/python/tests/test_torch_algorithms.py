# SPDX-License-Identifier: MIT
"""libdion.torch's optimizers against float64 references and against the ctypes (numpy) layer.

Tolerances (libdion computes in fp32, unit roundoff u = 6e-8):
* AdamW and Lion are element-wise, a handful of roundings per element and
  step: 1e-5 relative (+1e-6 absolute near zero) over 4 steps.
* Muon, NorMuon, Dion2, NorDion2 and Dion go through matrix products, a
  5-step quintic polynomial or a small QR (dims <= 24): ~n u times the
  iteration's growth, ~1e-6 relative on the update. Each step is checked
  from the library's own state (read through ``state_dict()``) at 1e-4
  relative to the update's largest entry, so that fp32 differences do not
  compound through the polynomial's amplification of small singular
  values; three steps from the start are checked end to end at 1e-3.
* Against the numpy layer the same library runs on the same bits, so the
  results must be identical (bit for bit), in fp32 and bf16.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

import libdion  # noqa: E402
import reference_torch as ref  # noqa: E402
from libdion.torch import Dion, Dion2, DionMixedPrecisionConfig, Muon, NorDion2, NorMuon  # noqa: E402
from torch_util import align_signs, classes, from_numpy, param, randn_like, rel_err, state, to_numpy  # noqa: E402

STEPS = 3


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _decay_update(x0, x1, lr, wd):
    """The orthogonal part of a step: (1 - lr wd) x0 - x1."""
    return (1 - lr * wd) * x0 - x1


# --------------------------------------------------------------------------
# Element-wise algorithms
# --------------------------------------------------------------------------

SCALAR_SHAPES = [(7,), (3, 5), (2, 3, 4), ()]


@pytest.mark.parametrize("owner", ["dion", "muon", "dion2"])
def test_adamw_groups_match_torch_adamw_in_float64(gen, owner):
    """An algorithm="adamw" group against torch.optim.AdamW run on float64 copies (same formula, §1.4)."""
    lr, betas, eps, wd = 0.01, (0.9, 0.95), 1e-8, 0.1
    ps = [param(s, gen) for s in SCALAR_SHAPES]
    ref_ps = [torch.nn.Parameter(p.detach().double().clone()) for p in ps]
    opt = classes()[owner]([dict(params=ps, algorithm="adamw", lr=lr, betas=betas, epsilon=eps, weight_decay=wd)])
    ref_opt = torch.optim.AdamW(ref_ps, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    for _ in range(4):
        for p, rp in zip(ps, ref_ps):
            p.grad = randn_like(p, gen)
            rp.grad = p.grad.double()
        opt.step()
        ref_opt.step()
        for i, (p, rp) in enumerate(zip(ps, ref_ps)):
            torch.testing.assert_close(p.detach().double(), rp.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state(opt, i, "momentum"), ref_opt.state[rp]["exp_avg"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state(opt, i, "variance"), ref_opt.state[rp]["exp_avg_sq"], rtol=1e-5,
                                       atol=1e-9)


@pytest.mark.parametrize("owner", ["dion", "normuon", "nordion2"])
def test_lion_groups_match_the_float64_formula(gen, owner):
    lr, b1, b2, wd = 0.003, 0.9, 0.99, 0.5
    ps = [param(s, gen) for s in SCALAR_SHAPES]
    xs = [p.detach().double().clone() for p in ps]
    ms = [torch.zeros_like(x) for x in xs]
    opt = classes()[owner]([dict(params=ps, algorithm="lion", lr=lr, betas=(b1, b2), weight_decay=wd)])
    for _ in range(4):
        for p in ps:
            p.grad = randn_like(p, gen)
        opt.step()
        for i, p in enumerate(ps):
            xs[i], ms[i] = ref.lion(xs[i], p.grad.double(), ms[i], lr, b1, b2, wd)
            torch.testing.assert_close(p.detach().double(), xs[i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state(opt, i, "momentum"), ms[i], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# Matrix algorithms, one step at a time from the library's state
# --------------------------------------------------------------------------

MUON_CASES = [((16, 8), {}), ((8, 16), {}), ((2, 6, 10), {}), ((12, 20), dict(nesterov=True)),
              ((10, 6), dict(adjust_lr="rms_norm")), ((6, 10), dict(adjust_lr=None))]


@pytest.mark.parametrize("shape,kw", MUON_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else
                         ",".join("%s=%s" % kv for kv in v.items()) or "default")
def test_muon_matches_float64_polar_express_each_step(gen, shape, kw):
    lr, mu, wd = 0.05, 0.9, 0.1
    x = param(shape, gen, 0.1)  # small |x|: its fp32 rounding stays far below the update
    opt = Muon([x], lr=lr, mu=mu, weight_decay=wd, **kw)
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        x0, m0 = x.detach().double().clone(), state(opt, 0, "momentum")
        xr, mr = ref.muon(x0, x.grad.double(), m0, lr, mu, wd, nesterov=kw.get("nesterov", False),
                          adjust=kw.get("adjust_lr", "spectral_norm"))
        opt.step()
        assert rel_err(_decay_update(x0, x.detach().double(), lr, wd), _decay_update(x0, xr, lr, wd)) < 1e-4
        assert rel_err(state(opt, 0, "momentum"), mr) < 1e-6


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (2, 6, 10)], ids=lambda s: "x".join(map(str, s)))
def test_normuon_matches_float64_reference_each_step(gen, shape):
    lr, mu, b2, wd = 0.05, 0.9, 0.8, 0.1
    x = param(shape, gen, 0.1)
    opt = NorMuon([x], lr=lr, mu=mu, muon_beta2=b2, weight_decay=wd)
    assert state(opt, 0, "variance_neuron").shape == shape[:-1] + (1,)
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        x0, m0, v0 = x.detach().double().clone(), state(opt, 0, "momentum"), state(opt, 0, "variance_neuron")
        xr, mr, vr = ref.normuon(x0, x.grad.double(), m0, v0, lr, mu, b2, wd)
        opt.step()
        assert rel_err(_decay_update(x0, x.detach().double(), lr, wd), _decay_update(x0, xr, lr, wd)) < 1e-4
        assert rel_err(state(opt, 0, "momentum"), mr) < 1e-6
        assert rel_err(state(opt, 0, "variance_neuron"), vr) < 1e-4


@pytest.mark.parametrize("shape,fraction", [((8, 16), 0.25), ((16, 8), 0.5), ((12, 12), 1.0)],
                         ids=["wide-rows", "tall-cols", "square-all"])
def test_dion2_matches_float64_reference_each_step(gen, shape, fraction):
    lr, ef, wd = 0.05, 0.9, 0.1
    x = param(shape, gen, 0.1)
    opt = Dion2([x], lr=lr, fraction=fraction, ef_decay=ef, weight_decay=wd)
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        x0, m0 = x.detach().double().clone(), state(opt, 0, "momentum")
        xr, mr = ref.dion2(x0, x.grad.double(), m0, lr, fraction, ef, wd)
        opt.step()
        assert rel_err(_decay_update(x0, x.detach().double(), lr, wd), _decay_update(x0, xr, lr, wd)) < 1e-4
        assert rel_err(state(opt, 0, "momentum"), mr) < 1e-6


@pytest.mark.parametrize("shape,fraction", [((8, 16), 0.25), ((16, 8), 0.5)], ids=["wide", "tall"])
def test_nordion2_matches_float64_reference_each_step(gen, shape, fraction):
    lr, mu, b2, wd = 0.05, 0.9, 0.8, 0.1
    x = param(shape, gen, 0.1)
    opt = NorDion2([x], lr=lr, fraction=fraction, mu=mu, muon_beta2=b2, weight_decay=wd)
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        x0, m0, v0 = x.detach().double().clone(), state(opt, 0, "momentum"), state(opt, 0, "variance_neuron")
        xr, mr, vr = ref.nordion2(x0, x.grad.double(), m0, v0, lr, fraction, mu, b2, wd)
        opt.step()
        assert rel_err(_decay_update(x0, x.detach().double(), lr, wd), _decay_update(x0, xr, lr, wd)) < 1e-4
        assert rel_err(state(opt, 0, "momentum"), mr) < 1e-6
        assert rel_err(state(opt, 0, "variance_neuron"), vr) < 1e-4


DION_CASES = [((16, 8), {}), ((8, 16), {}), ((20, 12), dict(rank_fraction=0.5)),
              ((10, 24), dict(rank_fraction=0.25)), ((16, 8), dict(qr_method="qr"))]


@pytest.mark.parametrize("shape,kw", DION_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else
                         ",".join("%s=%s" % kv for kv in v.items()) or "default")
def test_dion_matches_float64_reference_each_step(gen, shape, kw):
    lr, mu, wd = 0.05, 0.9, 0.1
    x = param(shape, gen, 0.1)
    opt = Dion([x], lr=lr, mu=mu, weight_decay=wd, seed=7, **kw)
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        x0, m0, q0 = x.detach().double().clone(), state(opt, 0, "momentum"), state(opt, 0, "Q")
        xr, mr, qr = ref.dion(x0, x.grad.double(), m0, q0, lr, mu, wd)
        opt.step()
        assert rel_err(_decay_update(x0, x.detach().double(), lr, wd), _decay_update(x0, xr, lr, wd)) < 1e-4
        assert rel_err(state(opt, 0, "momentum"), mr) < 1e-4
        assert rel_err(align_signs(state(opt, 0, "Q"), qr), qr) < 1e-4


def test_muon_three_steps_end_to_end(gen):
    lr, mu, wd = 0.02, 0.95, 0.01
    x = param((12, 20), gen)
    xr, mr = x.detach().double().clone(), torch.zeros(12, 20, dtype=torch.float64)
    start = xr.clone()
    opt = Muon([x], lr=lr, mu=mu, weight_decay=wd)
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        opt.step()
        xr, mr = ref.muon(xr, x.grad.double(), mr, lr, mu, wd)
    assert rel_err(x.detach().double() - start, xr - start) < 1e-3


def test_dion_three_steps_end_to_end_from_the_initial_q(gen):
    lr, mu, wd = 0.02, 0.95, 0.01
    x = param((16, 12), gen)
    opt = Dion([x], lr=lr, mu=mu, weight_decay=wd, rank_fraction=0.5, seed=3)
    q = state(opt, 0, "Q")  # drawn by libdion's seeded generator when the group was added
    assert q.shape == (12, 6) and q.std() > 0.3
    xr, mr = x.detach().double().clone(), torch.zeros(16, 12, dtype=torch.float64)
    start = xr.clone()
    for _ in range(STEPS):
        x.grad = randn_like(x, gen)
        opt.step()
        xr, mr, q = ref.dion(xr, x.grad.double(), mr, q, lr, mu, wd)
    assert rel_err(x.detach().double() - start, xr - start) < 1e-3
    assert rel_err(state(opt, 0, "momentum"), mr) < 1e-3


# --------------------------------------------------------------------------
# Bit-identical to the ctypes layer
# --------------------------------------------------------------------------

NUMPY_CASES = [("dion", dict(rank_fraction=0.5), "lion"), ("dion2", dict(fraction=0.5), "adamw"),
               ("muon", dict(nesterov=True), "lion"), ("normuon", {}, "adamw"), ("nordion2", {}, "lion")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("algo,kw,scalar", NUMPY_CASES, ids=[c[0] for c in NUMPY_CASES])
def test_same_bits_as_the_numpy_layer(gen, algo, kw, scalar, dtype):
    lr, wd = 0.02, 0.1
    shapes = [(12, 20), (20, 12), (20,)]
    ps = [param(s, gen, dtype=dtype) for s in shapes]
    arrays = [to_numpy(p) for p in ps]
    grads = [np.zeros_like(a) for a in arrays]
    opt = classes()[algo]([dict(params=ps[:2]), dict(params=ps[2:], algorithm=scalar, weight_decay=0.0)],
                          lr=lr, weight_decay=wd, seed=11, **kw)
    name = "bf16" if dtype == torch.bfloat16 else None
    spec = [dict(param=a, grad=g, dtype=name) for a, g in zip(arrays, grads)]
    with libdion.Optimizer(seed=11) as lib:
        lib.add_group(algo, spec[:2], lr=lr, weight_decay=wd, **kw)
        lib.add_group(scalar, spec[2:], lr=lr, weight_decay=0.0)
        for _ in range(STEPS):
            for p, g in zip(ps, grads):
                p.grad = randn_like(p, gen)
                g[...] = to_numpy(p.grad)
            opt.step()
            lib.step()
            for p, a in zip(ps, arrays):
                assert torch.equal(p.detach(), from_numpy(a, dtype))
        sd = opt.state_dict()["state"]
        for s in lib.states():
            assert torch.equal(sd[s["tensor"]][s["name"]], from_numpy(lib.read_state(s["index"]),
                                                                      sd[s["tensor"]][s["name"]].dtype))


def test_mixed_precision_config_sets_the_state_dtypes(gen):
    w, b = param((12, 8), gen), param((8,), gen)
    cfg = DionMixedPrecisionConfig(momentum_dtype=torch.bfloat16, Q_dtype=torch.bfloat16,
                                   variance_dtype=torch.float32)
    opt = Dion([dict(params=[w]), dict(params=[b], algorithm="adamw")], mixed_precision_config=cfg, seed=2)
    aw, ab = to_numpy(w), to_numpy(b)
    gw, gb = np.zeros_like(aw), np.zeros_like(ab)
    with libdion.Optimizer(seed=2) as lib:
        lib.add_group("dion", [(aw, gw)], momentum_dtype="bf16", q_dtype="bf16")
        lib.add_group("adamw", [(ab, gb)], momentum_dtype="bf16", variance_dtype="fp32")
        for _ in range(STEPS):
            w.grad, b.grad = randn_like(w, gen), randn_like(b, gen)
            gw[...], gb[...] = w.grad.numpy(), b.grad.numpy()
            opt.step()
            lib.step()
        assert torch.equal(w.detach(), torch.from_numpy(aw)) and torch.equal(b.detach(), torch.from_numpy(ab))
    sd = opt.state_dict()["state"]
    assert {k: v.dtype for k, v in sd[0].items()} == {"momentum": torch.bfloat16, "Q": torch.bfloat16}
    assert {k: v.dtype for k, v in sd[1].items()} == {"momentum": torch.bfloat16, "variance": torch.float32}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_parameters_keep_their_dtype_and_follow_fp32(gen, dtype):
    """bf16/fp16 parameters are updated in place in their dtype and stay near an fp32 run."""
    x32 = param((16, 24), gen, 0.1)
    x16 = torch.nn.Parameter(x32.detach().to(dtype))
    o32, o16 = Muon([x32], lr=0.02), Muon([x16], lr=0.02)
    for _ in range(STEPS):
        g = randn_like(x32, gen)
        x32.grad, x16.grad = g, g.to(dtype)
        o32.step()
        o16.step()
    assert x16.dtype == dtype and state(o16, 0, "momentum").dtype == torch.float64  # state() widens
    assert o16.state_dict()["state"][0]["momentum"].dtype == dtype
    assert rel_err(x16.detach().double(), x32.detach().double()) < 2e-2
