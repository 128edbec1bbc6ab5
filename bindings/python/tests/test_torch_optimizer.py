# SPDX-License-Identifier: MIT
"""torch.optim behaviour of libdion.torch: defaults, closures, schedulers, param_group edits,
zero_grad(set_to_none), re-binding, add_param_group and the state_dict round trip."""
import copy
import io

import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

import libdion  # noqa: E402
import libdion.torch as lt  # noqa: E402
from torch_util import ALGORITHMS, classes, param, randn_like  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(99)


def _model(gen, dtype=torch.float32):
    """Two matrices, a 3-D batch of matrices and two vectors (for every algorithm but Dion's 2-D rule)."""
    return [param((16, 12), gen, dtype=dtype), param((12, 20), gen, dtype=dtype), param((20,), gen, dtype=dtype),
            param((12,), gen, dtype=dtype)]


def _groups(ps, scalar="lion"):
    return [dict(params=ps[:2]), dict(params=ps[2:], algorithm=scalar, lr=0.003, weight_decay=0.0)]


def _lib_hparam(opt, group, name):
    return opt.libdion_optimizer.get_hparam(opt.lib_group_index(group), name)


# --------------------------------------------------------------------------
# Constructors
# --------------------------------------------------------------------------

UPSTREAM_DEFAULTS = {
    "dion": dict(rank_fraction=1.0, rank_multiple_of=1, lr=0.01, mu=0.95, beta1=0.9, beta2=0.95, weight_decay=0.01,
                 epsilon=1e-8, oversample=1.25, algorithm="dion", step=0),
    "muon": dict(lr=0.01, mu=0.95, beta1=0.9, beta2=0.95, weight_decay=0.01, cautious_wd=False, algorithm="muon",
                 step=0, epsilon=1e-8, nesterov=False, flatten=False, adjust_lr="spectral_norm"),
    "normuon": dict(lr=0.01, mu=0.95, muon_beta2=0.95, beta1=0.9, beta2=0.95, weight_decay=0.01, cautious_wd=False,
                    algorithm="normuon", step=0, epsilon=1e-8, nesterov=False, flatten=False,
                    adjust_lr="spectral_norm"),
    "dion2": dict(lr=0.01, ef_decay=0.95, fraction=0.25, beta1=0.9, beta2=0.95, weight_decay=0.01, epsilon=1e-8,
                  flatten=False, adjust_lr="spectral_norm", algorithm="dion2", step=0, selection_scope="local"),
    "nordion2": dict(lr=0.01, fraction=0.25, mu=0.95, muon_beta2=0.95, beta1=0.9, beta2=0.95, weight_decay=0.01,
                     epsilon=1e-8, flatten=False, adjust_lr="spectral_norm", algorithm="nordion2", step=0,
                     selection_scope="local"),
}


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_defaults_and_group_keys_are_microsoft_dions(gen, algo):
    opt = classes()[algo]([param((8, 8), gen)])
    assert opt.defaults == UPSTREAM_DEFAULTS[algo]
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.backend == "host" and opt.device == torch.device("cpu")
    # and the library got them: one libdion group with these values
    for key in ("lr", "weight_decay", "epsilon", "beta1", "beta2"):
        assert _lib_hparam(opt, 0, key) == pytest.approx(UPSTREAM_DEFAULTS[algo][key])


def test_dion3_is_nordion2_and_accepts_its_name(gen):
    assert lt.Dion3 is lt.NorDion2
    p = param((8, 8), gen)
    opt = lt.Dion3([dict(params=[p], algorithm="dion3")])
    assert opt.param_groups[0]["algorithm"] == "dion3" and opt.defaults["algorithm"] == "nordion2"
    p.grad = randn_like(p, gen)
    opt.step()


def test_single_rank_meshes_are_accepted(gen):
    class OneRank:
        def size(self):
            return 1

    lt.Dion([param((8, 8), gen)], replicate_mesh=OneRank(), outer_shard_mesh=OneRank(), inner_shard_mesh=None)
    lt.Muon([param((8, 8), gen)], distributed_mesh=OneRank())


def test_constructor_options_reach_the_library(gen):
    p = param((8, 8), gen)
    opt = lt.Muon([p], lr=0.1, mu=0.8, betas=(0.5, 0.6), weight_decay=0.2, epsilon=1e-6)
    assert [_lib_hparam(opt, 0, k) for k in ("lr", "mu", "beta1", "beta2", "weight_decay", "epsilon")] == \
        pytest.approx([0.1, 0.8, 0.5, 0.6, 0.2, 1e-6])
    q = param((8, 8), gen)
    # a group's own betas=(b1, b2) is honoured (upstream silently ignores it: spec §1.4 quirk)
    opt2 = lt.Dion([dict(params=[q], algorithm="lion", betas=(0.95, 0.98))])
    assert opt2.param_groups[0]["beta1"] == 0.95 and "betas" not in opt2.param_groups[0]
    assert _lib_hparam(opt2, 0, "beta2") == pytest.approx(0.98)


# --------------------------------------------------------------------------
# step()
# --------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ALGORITHMS)
def test_step_with_a_closure_returns_its_loss_and_trains(gen, algo):
    ps = _model(gen)
    if algo == "dion":
        ps[1] = param((12, 20), gen)
    opt = classes()[algo](_groups(ps), lr=0.02)
    target = torch.randn(16, 20, generator=gen)

    def closure():
        opt.zero_grad()
        out = (ps[0] @ ps[1]) + ps[2] * ps[3].sum()
        loss = ((out - target) ** 2).mean()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert closure().item() < first
    assert opt.step() is None  # no closure: None


def test_zero_grad_set_to_none_skips_the_tensor(gen):
    ps = _model(gen)
    opt = lt.Muon(_groups(ps))
    for p in ps:
        p.grad = randn_like(p, gen)
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in ps)
    ps[0].grad = randn_like(ps[0], gen)  # only the first tensor gets a gradient
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert not torch.equal(ps[0], before[0])
    for p, b in zip(ps[1:], before[1:]):
        assert torch.equal(p.detach(), b)  # skipped: neither the update nor the weight decay touched it


def test_parameters_without_gradients_at_construction_are_bound_later(gen):
    ps = _model(gen)
    opt = lt.Dion2(_groups(ps, "adamw"))  # built eagerly: no gradient exists yet
    opt.step()  # nothing to do, nothing changes
    before = [p.detach().clone() for p in ps]
    loss = (ps[0] @ ps[1]).square().mean() + ps[2].sum() + ps[3].sum()
    loss.backward()
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(ps, before))


def test_zero_grad_keeping_buffers_reuses_the_same_pointers(gen):
    ps = _model(gen)
    opt = lt.Muon(_groups(ps))
    for p in ps:
        p.grad = randn_like(p, gen)
    opt.step()
    ptrs = [p.grad.data_ptr() for p in ps]
    opt.zero_grad(set_to_none=False)
    for p in ps:
        p.grad.add_(randn_like(p, gen))
    opt.step()
    assert [p.grad.data_ptr() for p in ps] == ptrs


def test_a_replaced_parameter_storage_is_rebound(gen):
    p = param((8, 6), gen)
    opt = lt.Muon([p], lr=0.1, weight_decay=0.0)
    p.data = torch.zeros(8, 6)  # new storage (e.g. a checkpoint loaded by assignment)
    p.grad = randn_like(p, gen)
    opt.step()
    assert p.detach().abs().max() > 0  # the update went to the new storage


def test_add_param_group_after_steps(gen):
    ps = _model(gen)
    opt = lt.Muon([dict(params=ps[:2])])
    for p in ps[:2]:
        p.grad = randn_like(p, gen)
    opt.step()
    opt.add_param_group(dict(params=ps[2:], algorithm="adamw", lr=0.001))
    assert opt.lib_group_index(1) == 1 and opt.libdion_optimizer.tensor_count() == 4
    for p in ps:
        p.grad = randn_like(p, gen)
    before = ps[2].detach().clone()
    opt.step()
    assert not torch.equal(ps[2].detach(), before)
    sd = opt.state_dict()
    assert [g["step"] for g in sd["param_groups"]] == [2, 1]


def test_an_empty_group_is_allowed(gen):
    ps = _model(gen)
    opt = lt.Muon([dict(params=ps[:2]), dict(params=[], algorithm="lion")])
    assert opt.lib_group_index(1) is None
    for p in ps[:2]:
        p.grad = randn_like(p, gen)
    opt.step()
    opt.param_groups[1]["lr"] = 0.5  # nothing to push to
    opt.step()


def test_skipped_steps_and_memory_usage(gen):
    p = param((8, 8), gen)
    opt = lt.Muon([p])
    assert opt.memory_usage()["state_bytes"] >= 8 * 8 * 4
    p.grad = torch.full((8, 8), float("nan"))
    before = p.detach().clone()
    opt.step()
    assert opt.skipped_steps() == 1 and torch.equal(p.detach(), before)


# --------------------------------------------------------------------------
# Hyperparameters: schedulers and param_group edits
# --------------------------------------------------------------------------

def test_step_lr_changes_the_lr_the_library_sees(gen):
    ps = _model(gen)
    opt = lt.Muon(_groups(ps), lr=0.1, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen = []
    for _ in range(6):
        for p in ps:
            p.grad = randn_like(p, gen)
        before = ps[2].detach().clone()
        opt.step()
        seen.append((_lib_hparam(opt, 0, "lr"), _lib_hparam(opt, 1, "lr")))
        # Lion with weight_decay 0 moves every entry by exactly lr: the library used the new value
        assert (ps[2].detach() - before).abs().max().item() == pytest.approx(seen[-1][1], rel=1e-5)
        sched.step()
    assert [s[0] for s in seen] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert [s[1] for s in seen] == pytest.approx([0.003, 0.003, 0.0015, 0.0015, 0.00075, 0.00075])


def test_lambda_lr_schedule_matches_manual_edits(gen):
    """A scheduler and hand-written lr edits produce the same bits."""
    a, b = _model(gen), None
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa, ob = lt.Dion2(_groups(a)), lt.Dion2(_groups(b))
    sched = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (1 + s))
    base = [g["lr"] for g in ob.param_groups]
    for s in range(4):
        for g, lr in zip(ob.param_groups, base):
            g["lr"] = lr / (1 + s)
        for pa, pb in zip(a, b):
            pa.grad = randn_like(pa, gen)
            pb.grad = pa.grad.clone()
        oa.step()
        ob.step()
        sched.step()
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))


@pytest.mark.parametrize("key,value,hparam", [("lr", 0.5, "lr"), ("weight_decay", 0.25, "weight_decay"),
                                              ("mu", 0.5, "mu"), ("epsilon", 1e-6, "epsilon"),
                                              ("beta1", 0.8, "beta1"), ("betas", (0.7, 0.75), "beta2")])
def test_param_group_edits_are_pushed_at_the_next_step(gen, key, value, hparam):
    p = param((8, 8), gen)
    opt = lt.Muon([p])
    opt.param_groups[0][key] = value
    p.grad = randn_like(p, gen)
    opt.step()
    want = value[1] if key == "betas" else value
    assert _lib_hparam(opt, 0, hparam) == pytest.approx(want)
    if key == "betas":
        assert opt.param_groups[0]["beta1"] == 0.7 and "betas" not in opt.param_groups[0]


def test_ef_decay_and_muon_beta2_edits(gen):
    a, b = param((8, 8), gen), param((8, 8), gen)
    o2, on = lt.Dion2([a]), lt.NorMuon([b])
    o2.param_groups[0]["ef_decay"] = 0.5
    on.param_groups[0]["muon_beta2"] = 0.25
    o2.sync_hparams()
    on.sync_hparams()
    assert _lib_hparam(o2, 0, "ef_decay") == 0.5 and _lib_hparam(on, 0, "muon_beta2") == 0.25


def test_a_tensor_weight_decay_is_read(gen):
    p = param((8, 8), gen)
    opt = lt.Muon([p], weight_decay=torch.tensor(0.3))
    assert _lib_hparam(opt, 0, "weight_decay") == pytest.approx(0.3)
    opt.param_groups[0]["weight_decay"].fill_(0.1)
    opt.sync_hparams()
    assert _lib_hparam(opt, 0, "weight_decay") == pytest.approx(0.1)


# --------------------------------------------------------------------------
# state_dict / load_state_dict
# --------------------------------------------------------------------------

def _run(opt, ps, grads):
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()


ROUND_TRIP = [("dion", "lion", {}), ("dion", "adamw", dict(rank_fraction=0.5)), ("dion2", "adamw", {}),
              ("muon", "lion", dict(nesterov=True)), ("normuon", "adamw", {}), ("nordion2", "lion", {})]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("algo,scalar,kw", ROUND_TRIP, ids=["%s+%s" % (a, s) for a, s, _ in ROUND_TRIP])
def test_state_dict_round_trip_equals_not_stopping(gen, algo, scalar, kw, dtype):
    """Save after 3 steps (torch.save), load into a fresh optimizer and model, 3 more steps: same bits."""
    ps = _model(gen, dtype)
    ps[1] = param((12, 20), gen, dtype=dtype)
    start = [p.detach().clone() for p in ps]
    grads = [[randn_like(p, gen) for p in ps] for _ in range(6)]
    cls = classes()[algo]

    # uninterrupted
    opt = cls(_groups(ps, scalar), lr=0.02, seed=4, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for gs in grads:
        _run(opt, ps, [gs])
        sched.step()
    want = [p.detach().clone() for p in ps]

    # interrupted: 3 steps, checkpoint, a fresh model and optimizer, 3 steps
    ps1 = [torch.nn.Parameter(s.clone()) for s in start]
    opt1 = cls(_groups(ps1, scalar), lr=0.02, seed=4, **kw)
    sched1 = torch.optim.lr_scheduler.StepLR(opt1, step_size=1, gamma=0.9)
    for gs in grads[:3]:
        _run(opt1, ps1, [gs])
        sched1.step()
    buf = io.BytesIO()
    torch.save(dict(model=[p.detach() for p in ps1], opt=opt1.state_dict(), sched=sched1.state_dict()), buf)
    names = {n for st in opt1.state_dict()["state"].values() for n in st}
    assert names == {"dion": {"momentum", "Q"}, "normuon": {"momentum", "variance_neuron"},
                     "nordion2": {"momentum", "variance_neuron"}}.get(algo, {"momentum"}) | (
        {"variance"} if scalar == "adamw" else set())
    del opt1, sched1, ps1

    buf.seek(0)
    ck = torch.load(buf)
    ps2 = [torch.nn.Parameter(t.clone()) for t in ck["model"]]
    opt2 = cls(_groups(ps2, scalar), lr=0.02, seed=4, **kw)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.9)
    opt2.load_state_dict(ck["opt"])
    sched2.load_state_dict(ck["sched"])
    assert [g["step"] for g in opt2.state_dict()["param_groups"]] == [3, 3]
    for gs in grads[3:]:
        _run(opt2, ps2, [gs])
        sched2.step()
    for p, w in zip(ps2, want):
        assert torch.equal(p.detach(), w)


def test_state_dict_before_the_first_step_is_complete(gen):
    ps = _model(gen)
    opt = lt.NorMuon(_groups(ps, "adamw"))
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert set(sd["state"][0]) == {"momentum", "variance_neuron"} and set(sd["state"][2]) == {"momentum", "variance"}
    assert all(g["step"] == 0 for g in sd["param_groups"])


def test_states_keep_their_dtype_through_load_state_dict(gen):
    """fp32 momentum of bf16 parameters is not cast to bf16 on load (torch's default would)."""
    w = param((12, 8), gen, dtype=torch.bfloat16)
    cfg = lt.DionMixedPrecisionConfig(momentum_dtype=torch.float32)
    opt = lt.Dion([w], mixed_precision_config=cfg)
    w.grad = randn_like(w, gen)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["momentum"].dtype == torch.float32 and sd["state"][0]["Q"].dtype == torch.bfloat16
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = lt.Dion([w2], mixed_precision_config=cfg)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state[w2]["momentum"], sd["state"][0]["momentum"])
    assert opt2.state[w2]["momentum"].dtype == torch.float32
    assert torch.equal(opt2.state_dict()["state"][0]["momentum"], sd["state"][0]["momentum"])


def test_load_state_dict_restores_the_hyperparameters(gen):
    p = param((8, 8), gen)
    opt = lt.Muon([p])
    opt.param_groups[0]["lr"] = 0.123
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = lt.Muon([q])
    opt2.load_state_dict(sd)
    q.grad = randn_like(q, gen)
    opt2.step()
    assert _lib_hparam(opt2, 0, "lr") == pytest.approx(0.123)


def test_load_state_dict_rejects_a_different_structure_before_changing_anything(gen):
    p = param((12, 8), gen)
    sd = lt.Dion([p], rank_fraction=0.5).state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt = lt.Dion([q], rank_fraction=1.0)
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"param_groups\[0\]: 'rank_fraction' is 0.5 in the checkpoint but 1.0"):
        opt.load_state_dict(sd)
    with pytest.raises(libdion.DionError, match="2 parameter groups"):
        opt.load_state_dict(lt.Dion([dict(params=[p]), dict(params=[], algorithm="lion")]).state_dict())
    bad = lt.Dion([q]).state_dict()
    del bad["state"][0]["Q"]
    with pytest.raises(ValueError, match=r"no 'Q' state tensor for .*param_groups\[0\]\['params'\]\[0\]"):
        opt.load_state_dict(bad)
    bad = lt.Dion([q]).state_dict()
    bad["state"][0]["momentum"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"state 'momentum' .* has shape \(3, 3\) in the checkpoint, \(12, 8\)"):
        opt.load_state_dict(bad)
    bad = lt.Dion([q]).state_dict()
    bad["param_groups"][0]["algorithm"] = "lion"
    with pytest.raises(ValueError, match="algorithm 'lion' in the checkpoint, 'dion' here"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert all(torch.equal(before["state"][0][k], after["state"][0][k]) for k in ("momentum", "Q"))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_each_class_documents_its_update_and_options(algo):
    doc = classes()[algo].__doc__
    assert doc and "Group keys" in doc and "seed" in doc and "skip_nonfinite" in doc
