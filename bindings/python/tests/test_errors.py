# SPDX-License-Identifier: MIT
"""Every error path raises the DionError subclass of its status, with a message naming the argument or tensor."""
import ctypes
import os
from ctypes import byref

import numpy as np
import pytest

import libdion
from libdion import _lib as L
from libdion import (DionError, DionInvalidArgument, DionInvalidUsage, DionNotSupported, DionOutOfMemory,
                     Optimizer)


@pytest.fixture
def opt():
    with Optimizer() as o:
        yield o


@pytest.fixture
def adamw_opt():
    W = np.zeros((4, 3), np.float32)
    G = np.zeros((4, 3), np.float32)
    with Optimizer() as o:
        o.add_group("adamw", [(W, G, "w")])
        yield o


@pytest.mark.parametrize("status,cls", sorted(L.ERROR_CLASSES.items()))
def test_check_maps_each_status_to_its_class(status, cls):
    err = L.error_for(status, "dion_step: something named")
    assert type(err) is cls and err.status == status and isinstance(err, DionError)
    assert err.function == "dion_step" and err.message == "dion_step: something named"
    assert L.STATUS_NAMES[status] in str(err)


def test_check_falls_back_to_the_status_string_and_handles_unknown_codes(lib):
    # A code the library never returns: the message is whatever dion_last_error holds or the status string.
    with pytest.raises(DionError) as ei:
        L.check(12345)
    assert type(ei.value) is DionError and ei.value.status == 12345
    L.check(L.DION_SUCCESS)  # no exception
    assert issubclass(DionInvalidArgument, ValueError) and issubclass(DionOutOfMemory, MemoryError)
    assert issubclass(DionNotSupported, NotImplementedError)


# (callable taking the fixture optimizer, expected class, substrings of the message)
W43 = lambda: np.zeros((4, 3), np.float32)  # noqa: E731


CREATE_CASES = [
    (lambda: Optimizer(backend=7), DionInvalidArgument, ["dion_create", "backend = 7"]),
    (lambda: Optimizer(skip_nonfinite=2), DionInvalidArgument, ["dion_create", "skip_nonfinite = 2"]),
    (lambda: Optimizer(replicate_grad_sync=3), DionInvalidArgument, ["replicate_grad_sync = 3"]),
    (lambda: Optimizer(backend="gpu"), DionInvalidArgument, ["backend = 'gpu'"]),
    (lambda: Optimizer(outer_comm=ctypes.addressof(ctypes.create_string_buffer(64))), DionInvalidArgument,
     ["outer_comm is not a valid dion_comm_t"]),
]


@pytest.mark.parametrize("make,cls,words", CREATE_CASES)
def test_create_errors(make, cls, words):
    with pytest.raises(cls) as ei:
        make()
    for w in words:
        assert w in ei.value.message


def test_cuda_backend_unavailable_is_not_supported_or_a_cuda_error():
    try:
        o = Optimizer(backend="cuda")
    except (DionNotSupported, libdion.DionCudaError) as e:
        assert "dion_create" in e.message and ("CUDA" in e.message or "cuda" in e.message)
    else:  # a build and machine with a working CUDA backend
        o.close()


ADD_GROUP_CASES = [
    (lambda o: o.add_group("muon", [(np.zeros(3, np.float32), None, "bias")]), DionInvalidArgument,
     ["dion_add_group", "tensor 'bias'", "ndim", "adamw"]),
    (lambda o: o.add_group("dion", [(np.zeros((2, 2, 2), np.float32), None, "w3")]), DionInvalidArgument,
     ["tensor 'w3'", "Dion needs a 2-D tensor"]),
    (lambda o: o.add_group("dion2", [(np.zeros(()), None, "s")]), DionInvalidArgument, ["tensor 's'", "float64"]),
    (lambda o: o.add_group("muon", [(W43(), None, "w")], lr=-1.0), DionInvalidArgument, ["options->lr = -1"]),
    (lambda o: o.add_group("muon", [(W43(), None, "w")], weight_decay=float("nan")), DionInvalidArgument,
     ["weight_decay"]),
    (lambda o: o.add_group("dion", [(W43(), None, "w")], rank_fraction=0.0), DionInvalidArgument,
     ["rank_fraction = 0"]),
    (lambda o: o.add_group("dion", [(W43(), None, "w")], power_iters=0), DionInvalidArgument, ["power_iters = 0"]),
    (lambda o: o.add_group("dion2", [(W43(), None, "w")], fraction=1.5), DionInvalidArgument, ["fraction = 1.5"]),
    (lambda o: o.add_group("muon", [(W43(), None, "w")], ortho_steps=0), DionInvalidArgument, ["ortho_steps = 0"]),
    (lambda o: o.add_group("muon", [(W43(), None, "w")], momentum_dtype=9), DionInvalidArgument,
     ["momentum_dtype = 9"]),
    (lambda o: o.add_group("muon", [(W43(), None, "w")], qr_method="householder"), DionInvalidArgument,
     ["qr_method = 'householder'"]),
    (lambda o: o.add_group("muon", [(W43(), None, "w")], orthogonalizer=5), DionInvalidArgument,
     ["orthogonalizer = 5"]),
    (lambda o: o.add_group("bogus", []), DionInvalidArgument, ["algorithm = 'bogus'"]),
    (lambda o: o.add_group(42, []), DionInvalidArgument, ["algorithm = 42"]),
    (lambda o: o.add_group("muon", [(W43().astype(np.float64), None, "w")]), DionInvalidArgument,
     ["tensor 'w'", "float64"]),
    (lambda o: o.add_group("muon", [(W43()[:, :2], None, "w")]), DionInvalidArgument, ["tensor 'w'", "contiguous"]),
    (lambda o: o.add_group("muon", [(W43(), np.zeros((2, 3), np.float32), "w")]), DionInvalidArgument,
     ["tensor 'w'", "grad shape (2, 3)"]),
    (lambda o: o.add_group("muon", [(W43(), np.zeros((4, 3), np.float32, order="F"), "w")]), DionInvalidArgument,
     ["tensor 'w'", "layout"]),
    (lambda o: o.add_group("muon", [(np.zeros((4, 3), np.uint16), None, "w")]), DionInvalidArgument,
     ["tensor 'w'", "uint16", "bf16"]),
    (lambda o: o.add_group("adamw", [(np.zeros((1, 1, 1, 1, 2), np.float32), None, "w5")]), DionInvalidArgument,
     ["tensor 'w5'", "5 dims"]),
    (lambda o: o.add_group("muon", [dict(param=0, shape=(4, 3), dtype="fp32", name="nullp")]), DionInvalidArgument,
     ["dion_add_group", "tensor 'nullp'", "param is NULL"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 0), dtype="fp32", name="empty")]), DionInvalidArgument,
     ["tensor 'empty'", "shape[1] = 0"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 3), dtype="fp64")]), DionInvalidArgument,
     ["tensors[0]", "fp64"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 3), dtype=7, name="d7")]), DionInvalidArgument,
     ["tensor 'd7'", "param_dtype = 7"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(2, 4, 3), dtype="fp32", layout="col", name="c3")]),
     DionInvalidArgument, ["tensor 'c3'", "COL_MAJOR"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 3), dtype="fp32", outer_shard_dim=0, outer_extent=2,
                                         name="sh")]), DionInvalidArgument, ["tensor 'sh'", "no outer communicator"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 3), dtype="fp32", inner_shard_dim=5, name="sh")]),
     DionInvalidArgument, ["tensor 'sh'", "inner_shard_dim = 5"]),
    (lambda o: o.add_group("muon", [dict(shape=(4, 3))]), DionInvalidArgument, ["tensors[0]", "param"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 3))]), DionInvalidArgument, ["shape and dtype"]),
    (lambda o: o.add_group("muon", [dict(param=64, shape=(4, 3), dtype="fp32", colour=1)]), DionInvalidArgument,
     ["unknown keys", "colour"]),
    (lambda o: o.add_group("muon", ["w"]), DionInvalidArgument, ["tensors[0]", "str"]),
]


@pytest.mark.parametrize("call,cls,words", ADD_GROUP_CASES)
def test_add_group_errors_name_the_argument_and_add_nothing(opt, call, cls, words):
    with pytest.raises(cls) as ei:
        call(opt)
    for w in words:
        assert w in ei.value.message, ei.value.message
    assert (opt.group_count(), opt.tensor_count(), opt.state_count()) == (0, 0, 0)


def test_add_group_unknown_keyword_is_a_type_error(opt):
    with pytest.raises(TypeError, match="'learning_rate'"):
        opt.add_group("muon", [], learning_rate=0.1)


def test_second_tensor_is_named_and_the_first_is_not_added(opt):
    good = (np.zeros((4, 3), np.float32), None, "good")
    bad = (np.zeros(3, np.float32), None, "bad")
    with pytest.raises(DionInvalidArgument, match=r"tensor 'bad' \(tensors\[1\]\)"):
        opt.add_group("muon", [good, bad])
    assert opt.tensor_count() == 0


OPT_CASES = [
    (lambda o: o.set_hparam(3, "lr", 0.1), DionInvalidUsage, ["dion_group_set_hparam", "group = 3"]),
    (lambda o: o.set_hparam(0, "lr", -0.1), DionInvalidArgument, ["dion_group_set_hparam", "lr = -0.1"]),
    (lambda o: o.set_hparam(0, "beta1", 1.5), DionInvalidArgument, ["beta1 = 1.5"]),
    (lambda o: o.set_hparam(0, "epsilon", float("inf")), DionInvalidArgument, ["epsilon = inf"]),
    (lambda o: o.set_hparam(0, "learning_rate", 0.1), DionInvalidArgument, ["hparam = 'learning_rate'"]),
    (lambda o: o.set_hparam(0, 99, 0.1), DionInvalidArgument, ["hparam = 99"]),
    (lambda o: o.get_hparam(0, 99), DionInvalidArgument, ["dion_group_get_hparam", "hparam = 99"]),
    (lambda o: o.get_hparam(-1, "lr"), DionInvalidUsage, ["group = -1"]),
    (lambda o: o.step_count(5), DionInvalidUsage, ["dion_group_get_step", "group = 5"]),
    (lambda o: o.set_step(5, 1), DionInvalidUsage, ["dion_group_set_step", "group = 5"]),
    (lambda o: o.set_step(0, -1), DionInvalidArgument, ["step = -1"]),
    (lambda o: o.rebind(9, np.zeros((4, 3), np.float32)), DionInvalidArgument, ["dion_tensor_rebind", "tensor = 9"]),
    (lambda o: o.rebind(0, 0), DionInvalidArgument, ["dion_tensor_rebind", "tensor 'w'", "param is NULL"]),
    (lambda o: o.rebind(0, np.zeros((3, 4), np.float32)), DionInvalidArgument, ["tensor 'w'", "param shape (3, 4)"]),
    (lambda o: o.rebind(0, np.zeros((4, 3), np.float16)), DionInvalidArgument, ["tensor 'w'", "float16"]),
    (lambda o: o.rebind(0, np.zeros((4, 3), np.float32), np.zeros((4, 4), np.float32)), DionInvalidArgument,
     ["tensor 'w'", "grad shape (4, 4)"]),
    (lambda o: o.rebind(0, np.zeros((4, 3), np.float32), np.zeros((4, 3), np.float32, order="F")),
     DionInvalidArgument, ["tensor 'w'", "layout"]),
    (lambda o: o.rebind(0, np.zeros((4, 3), np.float32)[::-1]), DionInvalidArgument, ["tensor 'w'", "contiguous"]),
    (lambda o: o.read_state(99), DionInvalidArgument, ["dion_state_info", "index = 99"]),
    (lambda o: o.read_state((0, "Q")), DionInvalidArgument, ["dion_state_find", "tensor 'w'", "'Q'"]),
    (lambda o: o.find_state(7, "momentum"), DionInvalidArgument, ["dion_state_find", "tensor = 7"]),
    (lambda o: o.write_state(0, np.zeros((4, 3), np.float16)), DionInvalidArgument,
     ["state 0 ('momentum' of tensor 0)", "float16"]),
    (lambda o: o.write_state(1, np.zeros((3, 4), np.float32)), DionInvalidArgument,
     ["'variance' of tensor 0", "(3, 4)"]),
    (lambda o: o.comm_bytes(7), DionInvalidArgument, ["dion_get_comm_bytes", "mesh = 7"]),
    (lambda o: o.comm_bytes("sideways"), DionInvalidArgument, ["mesh = 'sideways'"]),
]


@pytest.mark.parametrize("call,cls,words", OPT_CASES)
def test_optimizer_call_errors(adamw_opt, call, cls, words):
    with pytest.raises(cls) as ei:
        call(adamw_opt)
    for w in words:
        assert w in ei.value.message, ei.value.message


def _raw(call):
    """Runs a raw ctypes call and returns the error check() raises (or None)."""
    try:
        L.check(call())
    except DionError as e:
        return e
    return None


def test_raw_c_entry_points_with_bad_arguments(lib, adamw_opt):
    h = adamw_opt._handle
    c = L.dion_comm_t()
    uid = L.dion_nccl_unique_id_t()
    cases = [
        (lambda: lib.dion_create(None, None), DionInvalidArgument, "dion_create: optimizer is NULL"),
        (lambda: lib.dion_step(None, None), DionInvalidArgument, "dion_step: optimizer is NULL"),
        (lambda: lib.dion_options_init(None), DionInvalidArgument, "dion_options_init: options is NULL"),
        (lambda: lib.dion_tensor_init(None), DionInvalidArgument, "dion_tensor_init: tensor is NULL"),
        (lambda: lib.dion_group_options_init(None, 0), DionInvalidArgument, "dion_group_options_init: options"),
        (lambda: lib.dion_add_group(h, None, None, 0, None), DionInvalidArgument, "dion_add_group: options is NULL"),
        (lambda: lib.dion_group_count(h, None), DionInvalidArgument, "dion_group_count: count is NULL"),
        (lambda: lib.dion_tensor_count(h, None), DionInvalidArgument, "dion_tensor_count: count is NULL"),
        (lambda: lib.dion_state_count(h, None), DionInvalidArgument, "dion_state_count: count is NULL"),
        (lambda: lib.dion_state_info(h, 0, byref(L.dion_state_info_t())), DionInvalidArgument,
         "info->struct_size = 0"),
        (lambda: lib.dion_state_find(h, 0, None, None), DionInvalidArgument, "dion_state_find: name is NULL"),
        (lambda: lib.dion_state_read(h, 0, None, 48, None), DionInvalidArgument, "dion_state_read: dst is NULL"),
        (lambda: lib.dion_state_write(h, 0, None, 48, None), DionInvalidArgument, "dion_state_write: src is NULL"),
        (lambda: lib.dion_state_read(h, 0, ctypes.create_string_buffer(8), 8, None), DionInvalidArgument,
         "bytes = 8 is smaller than state 'momentum'"),
        (lambda: lib.dion_get_memory_usage(h, None, None), DionInvalidArgument, "both NULL"),
        (lambda: lib.dion_get_skipped_steps(h, None, None, None), DionInvalidArgument, "both NULL"),
        (lambda: lib.dion_get_async_error(h, None), DionInvalidArgument, "dion_get_async_error: status is NULL"),
        (lambda: lib.dion_nccl_get_unique_id(None), DionInvalidArgument, "dion_nccl_get_unique_id: id is NULL"),
        (lambda: lib.dion_comm_init_nccl(byref(c), byref(uid), 2, 5, 0), DionInvalidArgument,
         "rank 5 is not in [0, nranks = 2)"),
        (lambda: lib.dion_comm_init_nccl(byref(c), None, 1, 0, 0), DionInvalidArgument, "id is NULL"),
        (lambda: lib.dion_comm_adopt_nccl(byref(c), None), DionInvalidArgument, "nccl_comm is NULL"),
        (lambda: lib.dion_comm_from_mpi_fint(None, 0), DionInvalidArgument, "dion_comm_from_mpi_fint: comm is NULL"),
        (lambda: lib.dion_comm_size(None, None), DionInvalidArgument, "dion_comm_size: comm is NULL"),
        (lambda: lib.dion_comm_rank(None, None), DionInvalidArgument, "dion_comm_rank: comm is NULL"),
        (lambda: lib.dion_comm_abort(None), DionInvalidArgument, "dion_comm_abort: comm is NULL"),
    ]
    for call, cls, words in cases:
        err = _raw(call)
        assert type(err) is cls, (words, err)
        assert words in err.message, err.message
    # NULL is accepted and ignored by the destroy functions.
    assert lib.dion_destroy(None) == 0 and lib.dion_comm_destroy(None) == 0
    # The handle's own message stays that of ITS last failure; the thread's holds the latest of all.
    L.check(lib.dion_get_memory_usage(h, byref(ctypes.c_uint64()), None), h)
    assert lib.dion_last_error(h).startswith(b"dion_get_async_error")
    assert lib.dion_last_error(None).startswith(b"dion_comm_abort")


def test_messages_survive_a_successful_call(adamw_opt, lib):
    with pytest.raises(DionInvalidUsage):
        adamw_opt.step_count(3)
    adamw_opt.step_count(0)  # success does not clear the message (header: dion_last_error)
    assert b"group = 3" in lib.dion_last_error(adamw_opt._handle)


def test_closed_optimizer_raises_invalid_usage():
    o = Optimizer()
    o.close()
    o.close()  # idempotent
    assert o.closed
    for call in (o.step, lambda: o.add_group("adamw", []), lambda: o.set_hparam(0, "lr", 1.0), o.states):
        with pytest.raises(DionInvalidUsage, match="closed"):
            call()


def _overcommit_refuses(nbytes):
    with open("/proc/self/maps") as f:
        asan = "libasan" in f.read()
    if asan and "allocator_may_return_null=1" not in os.environ.get("ASAN_OPTIONS", ""):
        return False  # AddressSanitizer would abort the process instead of returning NULL
    try:
        mode = int(open("/proc/sys/vm/overcommit_memory").read())
        mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo")}
    except (OSError, ValueError):
        return False
    return mode in (0, 2) and mem.get("MemTotal", 0) + mem.get("SwapTotal", 0) < nbytes // 4


def test_out_of_memory_maps_to_dion_out_of_memory_and_adds_nothing(opt):
    shape = (1 << 19, 1 << 20)  # 2 TiB of fp32 state; the param address is never touched
    if not _overcommit_refuses(4 * shape[0] * shape[1]):
        pytest.skip("the kernel may overcommit 2 TiB here: the allocation would not fail cleanly")
    with pytest.raises(DionOutOfMemory) as ei:
        opt.add_group("adamw", [dict(param=4096, shape=shape, dtype="fp32", name="huge")])
    assert "2199023255552 bytes" in ei.value.message
    assert (opt.tensor_count(), opt.state_count(), opt.memory_usage()["state_bytes"]) == (0, 0, 0)
