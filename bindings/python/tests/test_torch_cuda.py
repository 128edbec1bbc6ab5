# SPDX-License-Identifier: MIT
"""libdion.torch on CUDA tensors: the CUDA backend against the host backend, streams, and
capture of optimizer.step() in torch.cuda.graph. Skipped without a GPU or a CUDA build."""
import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

import libdion  # noqa: E402
import libdion.torch as lt  # noqa: E402
from torch_util import ALGORITHMS, classes, cuda_backend_available, param, randn_like, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not cuda_backend_available(),
                                reason="needs a CUDA GPU visible to torch and libdion built with CUDA")

STEPS = 3


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2024)


def _model(gen, device, dtype=torch.float32):
    shapes = [(64, 48), (48, 96), (96,), (48,)]
    return [param(s, gen, 0.1, dtype=dtype, device=device) for s in shapes]


def _groups(ps, scalar):
    return [dict(params=ps[:2]), dict(params=ps[2:], algorithm=scalar, lr=0.003, weight_decay=0.0)]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_cuda_backend_matches_the_host_backend(gen, algo):
    """Same seed, same gradients: fp32 results agree to the accumulated rounding of two BLAS implementations."""
    host = _model(gen, "cpu")
    dev = [torch.nn.Parameter(p.detach().cuda()) for p in host]
    scalar = "adamw" if algo in ("dion2", "normuon") else "lion"
    start = [p.detach().double() for p in host]
    oh = classes()[algo](_groups(host, scalar), lr=0.02, seed=3)
    od = classes()[algo](_groups(dev, scalar), lr=0.02, seed=3)
    assert od.backend == "cuda" and od.device == torch.device("cuda", torch.cuda.current_device())
    for _ in range(STEPS):
        for h, d in zip(host, dev):
            h.grad = randn_like(h, gen)
            d.grad = h.grad.cuda()
        oh.step()
        od.step()
    for h, d, x0 in zip(host, dev, start):  # the accumulated updates agree
        assert rel_err(d.detach().cpu().double() - x0, h.detach().double() - x0) < 1e-4
    sh, sd = oh.state_dict()["state"], od.state_dict()["state"]
    for i in sh:
        for name in sh[i]:
            assert sd[i][name].device.type == "cuda"
            if name != "Q":  # Dion's Q is unique up to column signs
                assert rel_err(sd[i][name].cpu().double(), sh[i][name].double()) < 1e-3


def test_step_runs_on_the_current_stream(gen):
    ps = _model(gen, "cuda")
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    oa, ob = lt.Muon(_groups(ps, "lion")), lt.Muon(_groups(ref, "lion"))
    side = torch.cuda.Stream()
    for _ in range(STEPS):
        grads = [randn_like(p, gen) for p in ps]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            oa.step()  # enqueued on `side`, ordered after the gradient copies
        torch.cuda.current_stream().wait_stream(side)
        for p, g in zip(ref, grads):
            p.grad = g
        ob.step()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ps, ref))


def _capture(opt):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def _eager_run(algo, ps, grads, edits):
    """Eager steps on copies of ps; edits[s] = {key: value} applied to group 0 before step s."""
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    eager = classes()[algo](_groups(ref, "lion"), lr=0.02, seed=1)
    for gs, edit in zip(grads, edits):
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        eager.param_groups[0].update(edit)
        eager.step()
    return ref


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_cuda_graph_replay_equals_eager_steps(gen, algo):
    """One eager warm-up step, capture one step, replay it on new gradients copied into the same buffers."""
    ps = _model(gen, "cuda")
    grads = [[randn_like(p, gen) for p in ps] for _ in range(1 + STEPS)]
    want = _eager_run(algo, ps, grads, [{}] * (1 + STEPS))
    opt = classes()[algo](_groups(ps, "lion"), lr=0.02, seed=1)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()  # warm-up: binds the gradient buffers the graph will read
    graph = _capture(opt)
    for gs in grads[1:]:
        for p, g in zip(ps, gs):
            p.grad.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(ps, want):
        assert torch.equal(a, b)
    assert [g["step"] for g in opt.state_dict()["param_groups"]] == [1 + STEPS] * 2  # device-side counters


SCHEDULE = [{}, {}, dict(lr=0.01, weight_decay=0.05), dict(lr=0.005), dict(betas=(0.8, 0.9))]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_replays_read_lr_weight_decay_and_betas_pushed_by_sync_hparams(gen, algo):
    """A scheduler between replays: the graph reads libdion's device copies of lr, weight_decay, betas."""
    ps = _model(gen, "cuda")
    grads = [[randn_like(p, gen) for p in ps] for _ in SCHEDULE]
    want = _eager_run(algo, ps, grads, SCHEDULE)
    opt = classes()[algo](_groups(ps, "lion"), lr=0.02, seed=1)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()
    graph = _capture(opt)
    for gs, edit in zip(grads[1:], SCHEDULE[1:]):
        for p, g in zip(ps, gs):
            p.grad.copy_(g)
        opt.param_groups[0].update(edit)
        opt.sync_hparams()
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(ps, want):
        assert torch.equal(a, b)


def test_eager_steps_after_replays_see_new_hyperparameters(gen):
    ps = _model(gen, "cuda")
    grads = [[randn_like(p, gen) for p in ps] for _ in range(4)]
    edits = [{}, {}, {}, dict(lr=0.003)]
    want = _eager_run("muon", ps, grads, edits)
    opt = lt.Muon(_groups(ps, "lion"), lr=0.02, seed=1)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()
    graph = _capture(opt)
    for gs in grads[1:3]:
        for p, g in zip(ps, gs):
            p.grad.copy_(g)
        graph.replay()
    for p, g in zip(ps, grads[3]):
        p.grad.copy_(g)
    opt.param_groups[0]["lr"] = 0.003
    opt.step()  # eager, right after the replays were enqueued
    torch.cuda.synchronize()
    for a, b in zip(ps, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algo,key,value", [("dion", "mu", 0.5), ("muon", "mu", 0.5), ("dion2", "ef_decay", 0.5),
                                            ("normuon", "muon_beta2", 0.5), ("muon", "epsilon", 1e-3)])
def test_recapture_after_a_by_value_hyperparameter_changes(gen, algo, key, value):
    ps = _model(gen, "cuda")
    grads = [[randn_like(p, gen) for p in ps] for _ in range(4)]
    edits = [{}, {}, {key: value}, {}]
    want = _eager_run(algo, ps, grads, edits)
    opt = classes()[algo](_groups(ps, "lion"), lr=0.02, seed=1)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()
    graph = _capture(opt)
    for gs, edit in zip(grads[1:], edits[1:]):
        for p, g in zip(ps, gs):
            p.grad.copy_(g)
        if edit:
            opt.param_groups[0].update(edit)
            opt.sync_hparams()
            graph = _capture(opt)  # the new value is baked into the new graph
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(ps, want):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the refused capture recorded nothing
def test_capture_with_new_gradient_buffers_is_refused(gen):
    ps = _model(gen, "cuda")
    opt = lt.Muon(_groups(ps, "lion"))
    for p in ps:
        p.grad = randn_like(p, gen)
    opt.step()
    old = [p.grad for p in ps]  # kept alive, so that the new gradients get new addresses
    opt.zero_grad(set_to_none=True)
    for p in ps:
        p.grad = randn_like(p, gen)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(libdion.DionInvalidUsage, match="pointer changed since the last eager step, during "
                                                       "CUDA-graph capture"):
        with torch.cuda.graph(graph):
            opt.step()
    opt.step()  # eager again: binds the new buffers
    torch.cuda.synchronize()
    del old


def test_cpu_and_cuda_parameters_cannot_mix(gen):
    with pytest.raises(ValueError, match="is on cuda:0 but the optimizer's parameters are on cpu"):
        lt.Dion([param((8, 8), gen), param((8, 8), gen, device="cuda")])


def test_bf16_parameters_on_cuda(gen):
    ps = _model(gen, "cuda", torch.bfloat16)
    opt = lt.Dion2(_groups(ps, "lion"))
    for p in ps:
        p.grad = randn_like(p, gen)
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert all(p.dtype == torch.bfloat16 and not torch.equal(p, b) for p, b in zip(ps, before))
