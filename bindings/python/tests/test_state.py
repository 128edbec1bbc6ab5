# SPDX-License-Identifier: MIT
"""Checkpoints through the binding: state read -> write into a fresh optimizer -> continue == never stopping."""
import numpy as np
import pytest

from conftest import f32
from libdion import Optimizer, bf16_to_float32, float32_to_bf16

ALGOS = {
    "adamw": dict(shapes=[(6, 5), (7,)], names={"momentum", "variance"}),
    "lion": dict(shapes=[(6, 5), (7,)], names={"momentum"}),
    "muon": dict(shapes=[(6, 5), (2, 4, 6)], names={"momentum"}),
    "normuon": dict(shapes=[(6, 5), (8, 4)], names={"momentum", "variance_neuron"}),
    "dion": dict(shapes=[(12, 8), (6, 10)], names={"momentum", "Q"}, kw=dict(rank_fraction=0.5)),
    "dion2": dict(shapes=[(12, 8), (6, 10)], names={"momentum"}, kw=dict(fraction=0.5)),
    "nordion2": dict(shapes=[(12, 8), (6, 10)], names={"momentum", "variance_neuron"}, kw=dict(fraction=0.5)),
}


def _build(algo, params, grads, seed=11):
    spec = ALGOS[algo]
    opt = Optimizer(seed=seed)
    opt.add_group(algo, [(p, g, "t%d" % i) for i, (p, g) in enumerate(zip(params, grads))], lr=0.02,
                  weight_decay=0.05, **spec.get("kw", {}))
    return opt


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_state_round_trip_into_a_fresh_optimizer_continues_identically(rng, algo):
    shapes = ALGOS[algo]["shapes"]
    n_before, n_after = 4, 4
    grads_seq = [[f32(rng, *s) for s in shapes] for _ in range(n_before + n_after)]

    # Run R never stops; its checkpoint is taken after n_before steps.
    pr = [f32(rng, *s) for s in shapes]
    gr = [np.zeros(s, np.float32) for s in shapes]
    with _build(algo, pr, gr) as R:
        assert {s["name"] for s in R.states()} == ALGOS[algo]["names"]
        for k in range(n_before + n_after):
            if k == n_before:
                ckpt_states = [(s, R.read_state(s["index"])) for s in R.states()]
                ckpt_step = R.step_count(0)
                ckpt_params = [p.copy() for p in pr]
            for i in range(len(shapes)):
                gr[i][...] = grads_seq[k][i]
            R.step()
        final_states = [R.read_state(s["index"]) for s in R.states()]
        assert R.step_count(0) == n_before + n_after
    assert ckpt_step == n_before

    # Run C: a fresh optimizer over copies of the checkpointed parameters, loaded from the checkpoint.
    pc = [p.copy() for p in ckpt_params]
    gc = [np.zeros(s, np.float32) for s in shapes]
    with _build(algo, pc, gc) as C:
        infos = C.states()
        assert [(s["tensor"], s["name"], s["local_shape"], s["dtype"]) for s in infos] == \
            [(s["tensor"], s["name"], s["local_shape"], s["dtype"]) for s, _ in ckpt_states]
        for s, arr in ckpt_states:
            C.write_state((s["tensor"], s["name"]), arr)
        C.set_step(0, ckpt_step)
        for s, arr in ckpt_states:
            np.testing.assert_array_equal(C.read_state(s["index"]), arr)
        for k in range(n_before, n_before + n_after):
            for i in range(len(shapes)):
                gc[i][...] = grads_seq[k][i]
            C.step()
        # Bit-identical: the same fp32 operations on the same inputs (Dion's sketches are keyed by
        # seed, tensor and step, all restored).
        for x, y in zip(pc, pr):
            np.testing.assert_array_equal(x, y)
        for s, want in zip(C.states(), final_states):
            np.testing.assert_array_equal(C.read_state(s["index"]), want)
        assert C.step_count(0) == n_before + n_after


def test_state_dict_round_trip(rng):
    p1 = [f32(rng, 8, 6), f32(rng, 5)]
    g1 = [f32(rng, 8, 6), f32(rng, 5)]
    p2 = [p.copy() for p in p1]
    with Optimizer() as a, Optimizer() as b:
        for o, ps in ((a, p1), (b, p2)):
            o.add_group("dion", [(ps[0], g1[0], "w")], rank_fraction=0.5)
            o.add_group("adamw", [(ps[1], g1[1], "b")])
        for _ in range(3):
            a.step()
        sd = a.state_dict()
        assert sd["steps"] == [3, 3]
        b.load_state_dict(sd)
        for i, p in enumerate(p1):
            p2[i][...] = p
        a.step()
        b.step()
        for x, y in zip(p1, p2):
            np.testing.assert_array_equal(x, y)


def test_state_info_dicts(rng):
    w = f32(rng, 6, 10)
    v = f32(rng, 3)
    with Optimizer() as opt:
        opt.add_group("dion", [(w, None, "w")], rank_fraction=0.5)
        opt.add_group("adamw", [(v, None, "v")])
        st = opt.states()
        assert [(s["index"], s["tensor"], s["group"], s["name"]) for s in st] == [
            (0, 0, 0, "momentum"), (1, 0, 0, "Q"), (2, 1, 1, "momentum"), (3, 1, 1, "variance")]
        q = st[1]
        assert q["global_shape"] == (6, 3) and q["dtype"] == "fp32" and q["layout"] == "row_major"
        assert q["local_offset"] == (0, 0) and q["local_bytes"] == 6 * 3 * 4
        assert st[0]["global_shape"] == (6, 10) and st[3]["local_shape"] == (3,)
        assert opt.memory_usage()["state_bytes"] == sum(s["local_bytes"] for s in st)
        assert opt.find_state(1, "variance") == 3


def test_bf16_and_fp16_states_read_raw_and_write_back(rng):
    wb = float32_to_bf16(f32(rng, 4, 6))  # bf16 bits in a uint16 array
    gb = float32_to_bf16(f32(rng, 4, 6))
    wh = f32(rng, 5).astype(np.float16)
    gh = f32(rng, 5).astype(np.float16)
    with Optimizer() as opt:
        opt.add_group("muon", [dict(param=wb, grad=gb, dtype="bf16", name="wb")])
        opt.add_group("adamw", [(wh, gh, "wh")], momentum_dtype="fp32")
        opt.step()
        st = opt.states()
        assert [s["dtype"] for s in st] == ["bf16", "fp32", "fp16"]
        m = opt.read_state(0)
        assert m.dtype == np.uint16 and m.shape == (4, 6)
        # Muon's first momentum is the gradient itself (M = mu*0 + G), stored in bf16.
        np.testing.assert_array_equal(m, gb)
        assert np.all(np.isfinite(bf16_to_float32(opt.read_state(0))))
        assert opt.read_state(1).dtype == np.float32 and opt.read_state(2).dtype == np.float16
        opt.write_state(0, np.zeros((4, 6), np.float32))  # float32 into a bf16 state: rounded
        np.testing.assert_array_equal(opt.read_state(0), 0)
        opt.write_state(0, gb)
        np.testing.assert_array_equal(opt.read_state(0), gb)
        # The parameter itself changed and stays finite bf16.
        assert np.all(np.isfinite(bf16_to_float32(wb)))


def test_bf16_helpers_round_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf, 3.0e38], np.float32)
    bits = float32_to_bf16(x)
    back = bf16_to_float32(bits)
    np.testing.assert_array_equal(back[:4], [1.0, 1.0, 1.015625, -2.5])  # ties to even
    assert np.isinf(back[4]) and back[5] > 2.9e38
    assert np.isnan(bf16_to_float32(float32_to_bf16(np.array([np.nan], np.float32))))[0]


def test_raw_address_state_copies(rng):
    """read_state_into / write_state_from: the raw-memory forms frameworks use (libdion.torch)."""
    x = f32(rng, 6, 4)
    g = f32(rng, 6, 4)
    with Optimizer() as opt:
        opt.add_group("adamw", [(x, g, "x")])
        opt.step()
        i = opt.find_state(0, "variance")
        buf = np.empty((6, 4), np.float32)
        opt.read_state_into(i, buf.ctypes.data, buf.nbytes)
        np.testing.assert_array_equal(buf, opt.read_state(i))
        new = f32(rng, 6, 4) ** 2
        opt.write_state_from((0, "variance"), new.ctypes.data, new.nbytes)
        np.testing.assert_array_equal(opt.read_state(i), new)
        with pytest.raises(ValueError):
            opt.read_state_into(i, buf.ctypes.data, 8)  # fewer bytes than the state holds
