# SPDX-License-Identifier: MIT
"""The Pythonic layer: hyperparameters, step counters, rebinding, array lifetime, raw pointers."""
import gc
import weakref

import numpy as np

import libdion
import reference_np as ref
from conftest import f32
from libdion import Optimizer, TensorSpec


def test_set_hparam_lr_takes_effect_at_the_next_step(rng):
    x = f32(rng, 3, 4)
    g = f32(rng, 3, 4)
    x0 = x.copy()
    b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.0
    with Optimizer() as opt:
        grp = opt.add_group("adamw", [(x, g, "p")], lr=0.0, betas=(b1, b2), epsilon=eps, weight_decay=wd)
        opt.step()
        np.testing.assert_array_equal(x, x0)  # lr = 0: nothing moves
        opt.set_hparam(grp, "lr", 0.1)
        assert opt.get_hparam(grp, "lr") == 0.1
        opt.step()
        # Reference: two AdamW steps, the first with lr 0 (moments still advance), the second with lr 0.1.
        xr, m, v = ref.adamw(x0.astype(np.float64), g.astype(np.float64), 0.0, 0.0, 1, 0.0, b1, b2, eps, wd)
        xr, m, v = ref.adamw(xr, g.astype(np.float64), m, v, 2, 0.1, b1, b2, eps, wd)
        np.testing.assert_allclose(x, xr, rtol=1e-5, atol=1e-6)
        assert np.max(np.abs(x - x0)) > 0.05


def test_every_hparam_round_trips_by_name_and_code():
    with Optimizer() as opt:
        grp = opt.add_group("normuon", [], lr=0.5, weight_decay=0.25, mu=0.8, betas=(0.7, 0.6), epsilon=1e-6,
                            ef_decay=0.4, muon_beta2=0.3)
        want = dict(lr=0.5, weight_decay=0.25, mu=0.8, beta1=0.7, beta2=0.6, epsilon=1e-6, ef_decay=0.4,
                    muon_beta2=0.3)
        for name, value in want.items():
            assert opt.get_hparam(grp, name) == value
            opt.set_hparam(grp, name, value / 2)
            assert opt.get_hparam(grp, libdion.core.HPARAMS[name]) == value / 2


def test_step_counters_and_set_step(rng):
    x = f32(rng, 4, 4)
    g = f32(rng, 4, 4)
    with Optimizer() as opt:
        a = opt.add_group("muon", [(x, g, "w")])
        b = opt.add_group("adamw", [])  # a group without tensors advances too
        assert (opt.group_count(), opt.tensor_count()) == (2, 1)
        for _ in range(3):
            opt.step()
        assert opt.step_count(a) == opt.step_count(b) == 3
        opt.set_step(b, 100)
        opt.step()
        assert (opt.step_count(a), opt.step_count(b)) == (4, 101)


def test_nonfinite_gradient_skips_the_step(rng):
    x = f32(rng, 5, 3)
    g = f32(rng, 5, 3)
    with Optimizer() as opt:
        grp = opt.add_group("muon", [(x, g, "w")])
        opt.step()
        before = x.copy()
        m_before = opt.read_state(0)
        g[2, 1] = np.nan
        opt.step()
        np.testing.assert_array_equal(x, before)
        np.testing.assert_array_equal(opt.read_state(0), m_before)
        assert opt.skipped_steps() == 1 and opt.last_step_skipped() and opt.step_count(grp) == 1
        g[2, 1] = 0.5
        opt.step()
        assert opt.skipped_steps() == 1 and not opt.last_step_skipped() and opt.step_count(grp) == 2


def test_nonfinite_gradient_is_applied_when_skipping_is_off(rng):
    x = f32(rng, 4)
    g = f32(rng, 4)
    g[0] = np.inf
    with Optimizer(skip_nonfinite=False) as opt:
        opt.add_group("adamw", [(x, g, "v")])
        opt.step()
        assert opt.skipped_steps() == 0
        assert not np.isfinite(opt.read_state((0, "variance"))[0])


def test_rebind_moves_the_optimizer_to_new_buffers(rng):
    x = f32(rng, 6)
    g1 = f32(rng, 6)
    with Optimizer() as opt:
        opt.add_group("lion", [(x, g1, "v")], lr=0.1, weight_decay=0.0)
        x2 = x.copy()
        g2 = -g1
        opt.rebind(0, x2, g2)
        opt.step()
        np.testing.assert_allclose(x2 - x, -0.1 * np.sign(g2), rtol=1e-5)  # the step went to x2
        opt.rebind(0, x2, None)  # no gradient: the tensor is skipped
        before = x2.copy()
        opt.step()
        np.testing.assert_array_equal(x2, before)


def test_arrays_are_kept_alive_while_bound(rng):
    opt = Optimizer()
    x = f32(rng, 8, 4)
    g = f32(rng, 8, 4)
    wx, wg = weakref.ref(x), weakref.ref(g)
    opt.add_group("muon", [(x, g, "w")])
    del x, g
    gc.collect()
    assert wx() is not None and wg() is not None
    opt.step()  # would read freed memory if the arrays had been collected
    assert np.all(np.isfinite(wx()))
    new_g = np.zeros((8, 4), np.float32)
    opt.rebind(0, wx(), new_g)
    gc.collect()
    assert wg() is None  # the old gradient is released once rebound
    opt.close()
    gc.collect()
    assert wx() is None


def test_raw_pointers_and_dicts_equal_arrays(rng):
    x = f32(rng, 6, 4)
    g = f32(rng, 6, 4)
    xs = [x.copy() for _ in range(3)]
    with Optimizer() as a, Optimizer() as b, Optimizer() as c:
        a.add_group("muon", [(xs[0], g, "arr")], lr=0.05)
        b.add_group("muon", [TensorSpec(param=xs[1].ctypes.data, grad=g.ctypes.data, shape=(6, 4), dtype="fp32",
                                        name="raw")], lr=0.05)
        c.add_group("muon", [dict(param=xs[2], grad=g, name="dict", dtype=np.float32)], lr=0.05)
        for o in (a, b, c):
            o.step()
    np.testing.assert_array_equal(xs[0], xs[1])
    np.testing.assert_array_equal(xs[0], xs[2])
    assert not np.array_equal(xs[0], x)


def test_mixed_gradient_dtype(rng):
    """An fp32 parameter with an fp16 gradient (grad_dtype taken from the gradient array)."""
    x = f32(rng, 5)
    g16 = f32(rng, 5).astype(np.float16)
    xr = x.astype(np.float64)
    with Optimizer() as opt:
        opt.add_group("lion", [(x, g16, "v")], lr=0.01, weight_decay=0.0)
        opt.step()
    xr, _ = ref.lion(xr, g16.astype(np.float64), np.zeros(5), 0.01, 0.9, 0.95, 0.0)
    np.testing.assert_allclose(x, xr, rtol=1e-6)


def test_counters_and_memory(rng):
    x = f32(rng, 16, 8)
    g = f32(rng, 16, 8)
    with Optimizer() as opt:
        opt.add_group("dion", [(x, g, "w")])
        mem = opt.memory_usage()
        assert mem["state_bytes"] == (16 * 8 + 8 * 8) * 4 and mem["workspace_bytes"] > 0
        opt.step()
        opt.sync_for_checkpoint()
        assert opt.async_error() == libdion.DION_SUCCESS
        for mesh in ("replicate", "outer", "inner", libdion.DION_MESH_INNER):
            assert opt.comm_bytes(mesh) == (0, 0)  # single-rank: nothing moves
        assert isinstance(opt.handle, int) and opt.handle != 0


def test_context_manager_and_finalizer_destroy_the_handle(rng):
    with Optimizer() as opt:
        assert not opt.closed
    assert opt.closed
    o = Optimizer()
    o.add_group("adamw", [(f32(rng, 3), f32(rng, 3), "v")])
    del o  # __del__ destroys it; must not raise or leak an exception
    gc.collect()


def test_group_options_accept_names_and_codes(rng):
    x = f32(rng, 8, 8)
    with Optimizer() as opt:
        opt.add_group("dion", [(x, None, "w")], qr_method="cqr", adjust_lr=None, matmul_precision="tf32",
                      q_dtype="fp32", momentum_dtype=np.float32, nesterov=True, selection_scope="global",
                      orthogonalizer=libdion.DION_ORTHO_NEWTON_SCHULZ)
        opt.add_group(libdion.DION_ALGO_ADAMW, [])
        assert opt.group_count() == 2


def test_distinct_optimizers_step_concurrently_and_errors_stay_per_thread(rng):
    """Header: distinct handles are independent; the NULL-handle message is per thread."""
    import threading

    shapes = [(24, 16), (16, 24)]
    grads = [[f32(rng, *s) for s in shapes] for _ in range(5)]
    init = [f32(rng, *s) for s in shapes]

    def run(out, idx, barrier=None):
        xs = [x.copy() for x in init]
        gs = [np.zeros_like(x) for x in xs]
        with Optimizer(seed=5) as o:
            o.add_group("dion", [(xs[0], gs[0], "a")], rank_fraction=0.5)
            o.add_group("muon", [(xs[1], gs[1], "b")])
            if barrier:
                barrier.wait()
            for k in range(5):
                for i in range(2):
                    gs[i][...] = grads[k][i]
                o.step()
        out[idx] = xs

    serial = {}
    run(serial, 0)
    results = {}
    barrier = threading.Barrier(4)
    threads = [threading.Thread(target=run, args=(results, i, barrier)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for a, b in zip(results[i], serial[0]):
            np.testing.assert_array_equal(a, b)

    seen = {}

    def fail_in_thread(name, code):
        try:
            Optimizer(backend=code)
        except libdion.DionInvalidArgument as e:
            seen[name] = e.message

    t = threading.Thread(target=fail_in_thread, args=("t", 41))
    t.start()
    t.join()
    fail_in_thread("main", 42)
    assert "backend = 41" in seen["t"] and "backend = 42" in seen["main"]
