#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Writes the seed corpus of tests/fuzz/fuzz_api.cpp into tests/fuzz/corpus/.

Each seed is a small, well-formed call sequence in the harness's input format
(documented at the top of fuzz_api.cpp; keep the two in sync). Together they
reach every call kind and the interesting corners: every algorithm stepping,
each QR method, bf16/fp16/col-major tensors, NaN gradients under the guard,
shapes whose element count overflows int64, bad struct sizes, out-of-range
hyperparameters, rebinding, state round trips. libFuzzer mutates from there.

    python3 tests/fuzz/make_corpus.py [OUT_DIR]

Standard library only. Output is deterministic (the same bytes every run).
"""
import math
import os
import struct
import sys

# ---------------------------------------------------------------- encoding --

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UNSET = INT32_MIN  # DION_UNSET_INT

OPS = dict(CREATE=0, DESTROY=1, ADD_GROUP=2, SET_HPARAM=3, GET_HPARAM=4, SET_STEP=5, REBIND=6, STEP=7,
           STATE_INFO=8, STATE_READ=9, STATE_WRITE=10, STATE_FIND=11, QUERIES=12, FILL_GRAD=13, MISC=14)

# The harness's F64 table, in order (Reader::f64).
NAN = float("nan")
F64_TABLE = [0.0, -0.0, 1.0, -1.0, 0.5, 0.01, 0.95, 0.9, 1e-8, 1e-30, 1e30, 1e300, NAN, math.inf, -math.inf,
             2.2250738585072014e-308, 5e-324, 1.7976931348623157e308, 1.25, 64.0, math.nextafter(64.0, 100.0),
             1e-3, 2.0, 0.25, math.nextafter(1.0, 0.0), math.nextafter(1.0, 2.0), -1e-300, 100.0, 1e10,
             -NAN, 0.999, 1e-38, 65504.0, 3.4e38, 1e39]

I64_SPECIAL = {INT64_MAX: 0xE0, INT64_MIN: 0xE1, 2**31: 0xE2, 2**32: 0xE3, 2**62: 0xE4, 3037000500: 0xE5,
               2**40: 0xE6, 2**20 + 1: 0xE7, 65536: 0xE8, 65537: 0xE9, INT32_MAX: 0xEA}


def u8(v):
    return bytes([v & 0xFF])


def u32(v):
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64(v):
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def i32(v):
    if -8 <= v < 0xF0 - 8:
        return u8(v + 8)
    special = {INT32_MIN: 0xF0, INT32_MAX: 0xF1, INT32_MIN + 1: 0xF2, 65536: 0xF3}
    if v in special:
        return u8(special[v])
    return u8(0xF4) + u32(v)


def i64(v):
    if -8 <= v < 0xE0 - 8:
        return u8(v + 8)
    if v in I64_SPECIAL:
        return u8(I64_SPECIAL[v])
    return u8(0xEC) + u64(v)


def f64(v):
    bits = struct.unpack("<Q", struct.pack("<d", v))[0]
    for k, t in enumerate(F64_TABLE):
        if struct.unpack("<Q", struct.pack("<d", t))[0] == bits:
            return u8(k)
    return u8(0xC0) + u64(bits)


def string(s, max_len):
    b = s.encode()
    assert len(b) <= max_len and b"\0" not in b
    return u8(len(b)) + b


# FILL specs
def fill_zero():
    return u8(0)


def fill_hash(seed=1, scale=1.0):
    return u8(1) + u8(seed) + f64(scale)


def fill_raw(pattern):
    assert 1 <= len(pattern) <= 64
    return u8(2) + u8(len(pattern) - 1) + bytes(pattern)


def fill_const(v):
    return u8(3) + f64(v)


def fill_poison(seed, index, v):
    return u8(4) + u8(seed) + u32(index) + f64(v)


def fill_rank1(seed=3):
    return u8(5) + u8(seed)


# ---------------------------------------------------------------- calls --

ALGO = dict(DION=0, DION2=1, MUON=2, NORMUON=3, NORDION2=4, ADAMW=5, LION=6)
FP32, BF16, FP16, UNSET_DT = 0, 1, 2, -1

# Group option fields (override_group_field) and the encoder of each value.
GROUP_FIELDS = ["struct_size", "abi_version", "algorithm", "lr", "weight_decay", "mu", "beta1", "beta2", "epsilon",
                "rank_fraction", "rank_multiple_of", "power_iters", "qr_method", "cqr_warmup_steps", "oversample",
                "orthogonalizer", "ortho_steps", "nesterov", "adjust_lr", "cautious_wd", "fraction", "ef_decay",
                "selection_scope", "muon_beta2", "flatten", "momentum_dtype", "q_dtype", "variance_dtype",
                "matmul_precision"]
GROUP_F64 = {"lr", "weight_decay", "mu", "beta1", "beta2", "epsilon", "rank_fraction", "oversample", "fraction",
             "ef_decay", "muon_beta2"}

TENSOR_FIELDS = ["ndim", "shape0", "shape1", "shape2", "shape3", "param_dtype", "grad_dtype", "layout",
                 "outer_shard_dim", "inner_shard_dim", "outer_offset", "outer_extent", "inner_offset",
                 "inner_extent", "struct_size", "null_param"]
TENSOR_I64 = {"shape0", "shape1", "shape2", "shape3", "outer_offset", "outer_extent", "inner_offset",
              "inner_extent", "struct_size"}

OPTION_FIELDS = ["struct_size", "abi_version", "backend", "device", "replicate_grad_sync", "reserved0",
                 "skip_nonfinite"]


def op(name, slot=0):
    return u8(OPS[name]) + u8(slot)


def create(slot=0, seed=0, null_options=False, **over):
    out = op("CREATE", slot) + u8(1 if null_options else 0) + u64(seed) + u8(len(over))
    assert len(over) < 6
    for k, v in over.items():
        out += u8(OPTION_FIELDS.index(k)) + (i64(v) if k == "struct_size" else i32(v))
    return out


def tensor(shape, dtype=FP32, grad_dtype=UNSET_DT, col_major=False, name=None, null_grad=False,
           param=None, grad=None, **over):
    """shape: up to 4 dims in 1..64 (others via overrides such as shape0=2**62)."""
    ndim = len(shape)
    dims = list(shape) + [1] * (4 - ndim)
    assert all(1 <= d <= 64 for d in dims)
    out = u8(ndim | (8 if col_major else 0)) + b"".join(u8(d - 1) for d in dims)
    out += u8(dtype) + u8(grad_dtype + 1)
    out += u8((1 if name is not None else 0) | (2 if null_grad else 0))
    if name is not None:
        out += string(name, 24)
    assert len(over) < 5
    out += u8(len(over))
    for k, v in over.items():
        out += u8(TENSOR_FIELDS.index(k))
        if k == "null_param":
            continue
        out += i64(v) if k in TENSOR_I64 else i32(v)
    out += param if param is not None else fill_hash(7, 0.5)
    out += grad if grad is not None else fill_hash(11, 1.0)
    return out


def add_group(algo, tensors, slot=0, null_tensors=False, null_index=False, stride=None, **over):
    out = op("ADD_GROUP", slot) + u8(ALGO[algo] if isinstance(algo, str) else algo)
    assert len(over) < 8
    out += u8(len(over))
    for k, v in over.items():
        out += u8(GROUP_FIELDS.index(k))
        out += f64(v) if k in GROUP_F64 else (i64(v) if k == "struct_size" else i32(v))
    assert len(tensors) <= 4
    flags = (1 if null_tensors else 0) | (2 if null_index else 0) | (4 if stride is not None else 0)
    out += u8(len(tensors)) + u8(flags)
    if stride is not None:
        out += i64(stride)
    return out + b"".join(tensors)


HP = dict(LR=0, WEIGHT_DECAY=1, MU=2, BETA1=3, BETA2=4, EPSILON=5, EF_DECAY=6, MUON_BETA2=7)


def set_hparam(group, hp, value, slot=0):
    return op("SET_HPARAM", slot) + i32(group) + i32(HP.get(hp, hp) if isinstance(hp, str) else hp) + f64(value)


def get_hparam(group, hp, slot=0, null_out=False):
    return op("GET_HPARAM", slot) + i32(group) + i32(hp) + u8(1 if null_out else 0)


def set_step(group, step, slot=0):
    return op("SET_STEP", slot) + i32(group) + i64(step)


def rebind(t, slot=0, null_param=False, null_grad=False, misalign_param=False, misalign_grad=False, grad=None):
    flags = (1 if null_param else 0) | (2 if null_grad else 0) | (4 if misalign_param else 0) | (
        8 if misalign_grad else 0)
    return op("REBIND", slot) + i32(t) + u8(flags) + (grad if grad is not None else fill_hash(5, 1.0))


def step(slot=0):
    return op("STEP", slot)


def destroy(slot=0):
    return op("DESTROY", slot)


def state_info(index, slot=0, size="exact", null=False):
    out = op("STATE_INFO", slot) + i32(index)
    if size == "exact":
        out += u8(0)
    elif size == "minimal":
        out += u8(1)
    elif isinstance(size, tuple):  # ("raw", value)
        out += u8(2) + i64(size[1])
    else:  # ("larger", extra)
        out += u8(3) + u8(size)
    return out + u8(1 if null else 0)


def state_rw(write, index, slot=0, bytes_sel=("exact",), null=False, src=None):
    out = op("STATE_WRITE" if write else "STATE_READ", slot) + i32(index)
    kind = bytes_sel[0]
    if kind == "exact":
        out += u8(0)
    elif kind == "delta":
        out += u8(1) + u8(bytes_sel[1] & 0xFF)
    elif kind == "raw":
        out += u8(2) + i64(bytes_sel[1])
    else:
        out += u8(3)
    out += u8(1 if null else 0)
    if write:
        out += src if src is not None else fill_hash(9, 1.0)
    return out


def state_find(t, name, slot=0, null_index=False):
    names = ["momentum", "Q", "variance", "variance_neuron"]
    out = op("STATE_FIND", slot) + i32(t)
    if name is None:
        out += u8(4)
    elif name in names:
        out += u8(names.index(name))
    else:
        out += u8(5) + string(name, 20)
    return out + u8(1 if null_index else 0)


def queries(slot=0, nulls=0, mesh=0, group=0):
    return op("QUERIES", slot) + u8(nulls) + i32(mesh) + i32(group)


def fill_grad(t, spec, slot=0):
    return op("FILL_GRAD", slot) + u8(t) + spec


def misc(status=0, algo=0, slot=0, nranks=2, rank=0, device=0, fortran_comm=0):
    return op("MISC", slot) + i32(status) + i32(algo) + i32(nranks) + i32(rank) + i32(device) + i32(fortran_comm)


# ---------------------------------------------------------------- seeds --


def seeds():
    s = {}
    M = lambda *shape, **kw: tensor(list(shape), **kw)  # noqa: E731

    # One algorithm each, a few steps, a state round trip.
    for algo in ALGO:
        shape = [12, 8] if algo != "ADAMW" else [3, 4, 5]
        s[f"algo_{algo.lower()}"] = (create(seed=5) + add_group(algo, [M(*shape)]) + step() + step() +
                                     state_info(0) + state_rw(False, 0) + state_rw(True, 0) + step() + destroy())
    for name, qr in (("rcqr", 0), ("qr", 1), ("cqr", 2)):
        s[f"dion_{name}"] = (create(seed=1) + add_group("DION", [M(16, 10), M(10, 16)], qr_method=qr,
                                                         cqr_warmup_steps=0, rank_fraction=0.5) +
                             step() + step() + step() + destroy())
    s["dion_cqr_rank1"] = (create() + add_group("DION", [M(24, 16, grad=fill_rank1(3))], qr_method=2,
                                                cqr_warmup_steps=0) + step() + step() + destroy())
    s["dion_power_iters"] = create() + add_group("DION", [M(9, 7)], power_iters=3, oversample=2.0) + step()
    s["muon_ns_nesterov"] = (create() + add_group("MUON", [M(2, 5, 6), M(8, 8)], orthogonalizer=1, nesterov=1,
                                                  ortho_steps=7, adjust_lr=1, cautious_wd=1) + step() + step())
    s["muon_flatten"] = create() + add_group("MUON", [M(4, 3, 2, 2)], flatten=1) + step()
    s["dion2_global"] = create() + add_group("DION2", [M(16, 12)], selection_scope=1, fraction=1.0) + step()
    s["nordion2_fraction"] = create() + add_group("NORDION2", [M(5, 9)], fraction=0.01) + step() + step()
    s["normuon_bf16"] = create() + add_group("NORMUON", [M(6, 10, dtype=BF16)], momentum_dtype=FP32) + step()
    s["adamw_mixed_dtypes"] = (create() + add_group("ADAMW", [M(7, dtype=FP16, grad_dtype=FP32), M(), M(3, 3,
                               dtype=BF16)], variance_dtype=FP32) + step() + step())
    s["lion_scalar"] = create() + add_group("LION", [M(), M(1)], cautious_wd=1) + step()
    s["col_major"] = (create() + add_group("DION", [M(8, 6, col_major=True)]) +
                      add_group("MUON", [M(6, 8, col_major=True)]) + step() + state_info(0) + state_rw(False, 0))
    s["named_tensors"] = create() + add_group("MUON", [M(4, 4, name="layer.0.w"), M(4, 4, name="")]) + step()
    # The non-finite guard: NaN / Inf gradients, then a clean step.
    s["nan_grad_skipped"] = (create() + add_group("DION", [M(8, 8)]) + add_group("ADAMW", [M(5)]) + step() +
                             fill_grad(1, fill_poison(2, 3, NAN)) + step() + queries() +
                             fill_grad(1, fill_hash(4)) + step())
    s["inf_grad_bf16"] = (create() + add_group("LION", [M(4, 4, dtype=BF16)]) +
                          fill_grad(0, fill_poison(1, 0, math.inf)) + step() + queries())
    s["nan_guard_off"] = (create(skip_nonfinite=0) + add_group("MUON", [M(6, 6)]) +
                          fill_grad(0, fill_const(NAN)) + step() + step())
    s["huge_grads"] = (create() + add_group("DION", [M(8, 8, grad=fill_const(1e30))]) +
                       add_group("ADAMW", [M(8, grad=fill_const(1e-30))]) + step() + step())
    s["zero_grads"] = (create() + add_group("DION", [M(8, 6, grad=fill_zero())]) +
                       add_group("NORMUON", [M(6, 8, grad=fill_zero())]) + step() + step())
    # Sizes: overflowing products, negative and zero dims, too many dims.
    s["shape_overflow_2d"] = create() + add_group("MUON", [M(2, 2, shape0=3037000500, shape1=3037000500)])
    s["shape_overflow_4d"] = create() + add_group("ADAMW", [M(2, 2, 2, 2, shape0=2**32, shape1=2**32,
                                                                shape2=2**32)])
    s["shape_int64_max"] = create() + add_group("ADAMW", [M(2, 2, shape0=INT64_MAX, shape1=2)])
    s["shape_beyond_2e40"] = create() + add_group("ADAMW", [M(2, 2, shape0=2**31, shape1=2**31)])
    s["shape_negative"] = create() + add_group("ADAMW", [M(2, 3, shape0=-2, shape1=-3)])
    s["shape_zero"] = create() + add_group("LION", [M(2, 3, shape1=0)])
    s["ndim_bad"] = create() + add_group("ADAMW", [M(2, ndim=5), M(2, ndim=-1)])
    s["dion_needs_2d"] = create() + add_group("DION", [M(2, 3, 4)]) + add_group("MUON", [M(5)])
    s["col_major_3d"] = create() + add_group("ADAMW", [M(2, 3, 4, col_major=True)])
    s["bad_dtypes"] = create() + add_group("ADAMW", [M(3, param_dtype=3), M(3, grad_dtype=7)])
    s["shard_without_comm"] = (create() + add_group("DION", [M(8, 8, outer_shard_dim=0, outer_offset=0,
                                                                outer_extent=8)]))
    s["shard_extent_overflow"] = (create() + add_group("ADAMW", [M(4, 4, inner_shard_dim=1, inner_offset=2**62,
                                                                    inner_extent=INT64_MAX)]))
    s["tensor_stride"] = (create() + add_group("ADAMW", [M(3), M(4)], stride=200) +
                          add_group("ADAMW", [M(3)], stride=16) + add_group("ADAMW", [M(3), M(3, struct_size=99)]))
    s["null_tensors"] = create() + add_group("ADAMW", [M(3)], null_tensors=True) + add_group("LION", [],
                                                                                            null_index=True)
    s["null_param"] = create() + add_group("ADAMW", [M(3, null_param=0)])
    # Options out of range.
    s["group_options_bad"] = (create() + add_group("DION", [M(4, 4)], lr=-1.0) +
                              add_group("DION", [M(4, 4)], rank_fraction=NAN) +
                              add_group("DION", [M(4, 4)], rank_fraction=1e300, mu=math.inf) +
                              add_group("DION2", [M(4, 4)], fraction=0.0) +
                              add_group("MUON", [M(4, 4)], ortho_steps=INT32_MAX, power_iters=INT32_MIN + 1) +
                              add_group("DION", [M(4, 4)], oversample=math.nextafter(64.0, 100.0)) +
                              add_group("ADAMW", [M(4)], beta1=1e30, epsilon=-0.0) +
                              add_group("ADAMW", [M(4)], algorithm=9))
    s["group_options_struct"] = (create() + add_group("ADAMW", [M(3)], struct_size=12) +
                                 add_group("ADAMW", [M(3)], struct_size=4) +
                                 add_group("ADAMW", [M(3)], struct_size=100000) +
                                 add_group("ADAMW", [M(3)], abi_version=2) +
                                 add_group("DION", [M(4, 4)], rank_multiple_of=UNSET, qr_method=UNSET,
                                           momentum_dtype=UNSET) + step())
    s["dion_rank_multiple"] = (create() + add_group("DION", [M(40, 30)], rank_fraction=0.07, rank_multiple_of=8,
                                                    q_dtype=BF16) + step())
    s["create_options"] = (create(struct_size=12) + create(struct_size=0) + create(struct_size=2**62) +
                           create(abi_version=0) + create(backend=7) + create(backend=UNSET, device=-1) +
                           add_group("LION", [M(2)]) + step())
    s["create_null_options"] = create(null_options=True, seed=2**63) + add_group("ADAMW", [M(2)]) + step()
    s["create_reserved"] = create(reserved0=1, slot=1) + create(skip_nonfinite=2) + create(replicate_grad_sync=-1)
    # Hyperparameters and steps.
    s["hparams"] = (create() + add_group("ADAMW", [M(4)]) + set_hparam(0, "LR", 1e-3) +
                    set_hparam(0, "BETA1", 1.0) + set_hparam(0, "BETA2", math.nextafter(1.0, 2.0)) +
                    set_hparam(0, "WEIGHT_DECAY", NAN) + set_hparam(0, "EPSILON", -1e-300) +
                    set_hparam(0, 99, 0.5) + set_hparam(1, "LR", 0.5) + set_hparam(-1, "MU", 0.5) +
                    get_hparam(0, 0) + get_hparam(0, 8) + get_hparam(0, 0, null_out=True) + step())
    s["hparam_lr_huge"] = (create() + add_group("MUON", [M(6, 6)]) + set_hparam(0, "LR", 1e300) + step() +
                           step() + add_group("LION", [M(3)]) + set_hparam(1, "LR", 1e30) + step())
    s["set_step"] = (create() + add_group("ADAMW", [M(4)]) + set_step(0, 0) + step() + set_step(0, INT64_MAX) +
                     step() + set_step(0, -1) + set_step(3, 1) + add_group("DION", [M(5, 5)], qr_method=2) +
                     set_step(1, 1000) + step())
    # Rebinding.
    s["rebind"] = (create() + add_group("MUON", [M(4, 6)]) + add_group("ADAMW", [M(5)]) + step() + rebind(0) +
                   step() + rebind(1, null_grad=True) + step() + rebind(0, null_param=True) + rebind(7) +
                   rebind(-1) + rebind(1, misalign_param=True) + rebind(1, misalign_grad=True) + step())
    s["null_grad_tensor"] = (create() + add_group("DION", [M(6, 6, null_grad=True), M(6, 6)]) + step() +
                             rebind(0) + step())
    # State buffers.
    s["state_buffers"] = (create() + add_group("DION", [M(8, 5)]) + add_group("ADAMW", [M(3, dtype=BF16)]) +
                          step() + state_info(0, size="minimal") + state_info(1, size=5) +
                          state_info(1, size=("raw", 4)) + state_info(2, size=("raw", 2**40)) +
                          state_info(9) + state_info(-1) + state_info(0, null=True) +
                          state_rw(False, 0, bytes_sel=("delta", -1)) + state_rw(False, 1, bytes_sel=("delta", 3)) +
                          state_rw(False, 1, bytes_sel=("raw", INT64_MAX)) + state_rw(False, 2, bytes_sel=("zero",)) +
                          state_rw(True, 3, bytes_sel=("delta", -4)) + state_rw(True, 1, null=True) +
                          state_rw(True, 0, src=fill_const(NAN)) + state_rw(True, 2, src=fill_raw([0xFF, 0x7F])) +
                          step() + state_rw(False, 40))
    s["state_find"] = (create() + add_group("NORMUON", [M(4, 4)]) + add_group("ADAMW", [M(2)]) +
                       state_find(0, "momentum") + state_find(0, "variance_neuron") + state_find(1, "variance") +
                       state_find(1, "Q") + state_find(0, None) + state_find(5, "momentum") +
                       state_find(0, "momentum\x01", null_index=True) + state_find(0, "momentum", null_index=True))
    s["queries"] = (create() + add_group("ADAMW", [M(2)]) + queries(nulls=0) + queries(nulls=0xFF, mesh=3) +
                    queries(nulls=0x18, mesh=-1, group=7) + misc(status=12, algo=7) + misc(status=-1, algo=-1, nranks=0, rank=-1) +
                    misc(nranks=INT32_MAX, rank=INT32_MAX - 1, device=-1, fortran_comm=INT32_MIN))
    # Two optimizers interleaved, and calls on a NULL handle.
    s["two_slots"] = (create(slot=0, seed=1) + create(slot=1, seed=1) + add_group("DION", [M(6, 4)], slot=0) +
                      add_group("DION", [M(6, 4)], slot=1) + step(0) + step(1) + destroy(1) + step(0) +
                      state_rw(False, 1, slot=0) + destroy(0))
    s["null_handle"] = (add_group("ADAMW", [M(2)]) + step() + set_hparam(0, "LR", 0.1) + set_step(0, 1) +
                        rebind(0) + state_info(0) + state_rw(False, 0) + state_rw(True, 0) + state_find(0, "Q") +
                        queries() + misc() + get_hparam(0, 0))
    s["many_groups"] = (create() + b"".join(add_group(a, [M(3, 3), M(3, 3)]) for a in ALGO) + step() + step() +
                        step())
    return s


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        if old.startswith("seed_"):
            os.remove(os.path.join(out, old))
    corpus = seeds()
    for name, data in sorted(corpus.items()):
        assert len(data) <= 4096, (name, len(data))  # tools/sanitize.sh runs with -max_len=4096
        with open(os.path.join(out, f"seed_{name}"), "wb") as f:
            f.write(data)
    print(f"wrote {len(corpus)} seeds to {out}")


if __name__ == "__main__":
    main()
