# SPDX-License-Identifier: MIT
"""A thin Pythonic layer over the C API: one ``Optimizer`` owning one handle.

No algorithm logic lives here: every update is computed by libdion. This
layer translates names to enum values, numpy arrays to tensor descriptors,
keeps the arrays alive while the library holds their pointers, and turns
statuses into ``DionError`` subclasses.

Memory: on the host backend parameters and gradients are host buffers (numpy
arrays, or raw addresses given with a shape and a dtype). A numpy array passed
to ``add_group`` or ``rebind`` is referenced by the optimizer until it is
rebound or the optimizer is closed, so it cannot be freed under the library.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
from ctypes import byref, c_double, c_int32, c_int64, c_uint64
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _lib as L
from ._lib import DionInvalidArgument, DionInvalidUsage, check, get_lib

try:  # numpy is optional: raw pointers work without it
    import numpy as np
except ImportError:  # pragma: no cover - exercised only without numpy
    np = None

# --------------------------------------------------------------------------
# Name tables
# --------------------------------------------------------------------------

ALGORITHMS = {
    "dion": L.DION_ALGO_DION,
    "dion2": L.DION_ALGO_DION2,
    "muon": L.DION_ALGO_MUON,
    "normuon": L.DION_ALGO_NORMUON,
    "nordion2": L.DION_ALGO_NORDION2,
    "dion3": L.DION_ALGO_DION3,
    "adamw": L.DION_ALGO_ADAMW,
    "lion": L.DION_ALGO_LION,
}
BACKENDS = {"host": L.DION_BACKEND_HOST, "cpu": L.DION_BACKEND_HOST, "cuda": L.DION_BACKEND_CUDA}
DTYPES = {"fp32": L.DION_DTYPE_FP32, "float32": L.DION_DTYPE_FP32, "bf16": L.DION_DTYPE_BF16,
          "bfloat16": L.DION_DTYPE_BF16, "fp16": L.DION_DTYPE_FP16, "float16": L.DION_DTYPE_FP16}
DTYPE_NAMES = {L.DION_DTYPE_FP32: "fp32", L.DION_DTYPE_BF16: "bf16", L.DION_DTYPE_FP16: "fp16"}
DTYPE_SIZES = {L.DION_DTYPE_FP32: 4, L.DION_DTYPE_BF16: 2, L.DION_DTYPE_FP16: 2}
LAYOUTS = {"row": L.DION_LAYOUT_ROW_MAJOR, "row_major": L.DION_LAYOUT_ROW_MAJOR, "C": L.DION_LAYOUT_ROW_MAJOR,
           "col": L.DION_LAYOUT_COL_MAJOR, "col_major": L.DION_LAYOUT_COL_MAJOR, "F": L.DION_LAYOUT_COL_MAJOR}
LAYOUT_NAMES = {L.DION_LAYOUT_ROW_MAJOR: "row_major", L.DION_LAYOUT_COL_MAJOR: "col_major"}
HPARAMS = {
    "lr": L.DION_HPARAM_LR,
    "weight_decay": L.DION_HPARAM_WEIGHT_DECAY,
    "mu": L.DION_HPARAM_MU,
    "beta1": L.DION_HPARAM_BETA1,
    "beta2": L.DION_HPARAM_BETA2,
    "epsilon": L.DION_HPARAM_EPSILON,
    "ef_decay": L.DION_HPARAM_EF_DECAY,
    "muon_beta2": L.DION_HPARAM_MUON_BETA2,
}
MESHES = {"replicate": L.DION_MESH_REPLICATE, "outer": L.DION_MESH_OUTER, "inner": L.DION_MESH_INNER}
# Enum-valued group options and the names they accept (None means the C default "none").
_ENUM_OPTIONS = {
    "qr_method": {"rcqr": L.DION_QR_RCQR, "qr": L.DION_QR_QR, "cqr": L.DION_QR_CQR},
    "orthogonalizer": {"polar_express": L.DION_ORTHO_POLAR_EXPRESS, "newton_schulz": L.DION_ORTHO_NEWTON_SCHULZ},
    "adjust_lr": {"spectral_norm": L.DION_ADJUST_LR_SPECTRAL_NORM, "rms_norm": L.DION_ADJUST_LR_RMS_NORM,
                  "none": L.DION_ADJUST_LR_NONE, None: L.DION_ADJUST_LR_NONE},
    "selection_scope": {"local": L.DION_SELECTION_LOCAL, "global": L.DION_SELECTION_GLOBAL},
    "matmul_precision": {"fp32": L.DION_MATMUL_FP32, "tf32": L.DION_MATMUL_TF32, "bf16": L.DION_MATMUL_BF16},
}
_DTYPE_OPTIONS = ("momentum_dtype", "q_dtype", "variance_dtype")
_GROUP_FIELDS = tuple(f for f, _ in L.dion_group_options_t._fields_ if f not in ("struct_size", "abi_version",
                                                                                  "algorithm"))


def _lookup(table: Dict, value, what: str, fn: str) -> int:
    if isinstance(value, bool):
        raise DionInvalidArgument("%s: %s = %r is not a valid value" % (fn, what, value))
    if isinstance(value, int):
        return int(value)
    key = value.lower() if isinstance(value, str) and value not in ("C", "F") else value
    try:
        return table[key]
    except (KeyError, TypeError):
        names = ", ".join(repr(k) for k in table if k is not None)
        raise DionInvalidArgument("%s: %s = %r is not one of %s" % (fn, what, value, names)) from None


def dtype_code(dtype, what: str = "dtype", fn: str = "libdion") -> int:
    """DION_DTYPE_* for a name ("fp32", "bf16", "fp16"), a numpy dtype or an int code."""
    if dtype is None:
        return L.DION_DTYPE_UNSET
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return int(dtype)
    if isinstance(dtype, str):
        return _lookup(DTYPES, dtype, what, fn)
    if np is not None:
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is not None:
            if dt == np.float32:
                return L.DION_DTYPE_FP32
            if dt == np.float16:
                return L.DION_DTYPE_FP16
            if dt.name == "bfloat16":  # ml_dtypes.bfloat16 and friends
                return L.DION_DTYPE_BF16
            raise DionInvalidArgument(
                "%s: %s = %s is not supported by libdion (float32, float16, bfloat16; for bf16 data in a uint16 "
                "array pass dtype='bf16')" % (fn, what, dt))
    raise DionInvalidArgument("%s: %s = %r is not a dtype" % (fn, what, dtype))


def numpy_dtype_for(code: int):
    """The numpy dtype that holds one element of DION_DTYPE_* `code`.

    fp32 -> float32, fp16 -> float16, bf16 -> uint16 (the raw bits; numpy
    has no bfloat16: ``bf16_to_float32`` widens them).
    """
    if code == L.DION_DTYPE_FP32:
        return np.dtype(np.float32)
    if code == L.DION_DTYPE_FP16:
        return np.dtype(np.float16)
    if code == L.DION_DTYPE_BF16:
        return np.dtype(np.uint16)
    raise DionInvalidArgument("libdion: dtype code %d is not a storage dtype" % code)


def bf16_to_float32(bits):
    """Widens raw bf16 bits (uint16 array) to float32 exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x):
    """Rounds float32 values to bf16 (nearest, ties to even) and returns the raw bits as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


# --------------------------------------------------------------------------
# Tensor specifications
# --------------------------------------------------------------------------

@dataclasses.dataclass
class TensorSpec:
    """One parameter for ``Optimizer.add_group``.

    ``param``/``grad`` are numpy arrays or raw addresses (int). With a numpy
    ``param`` the shape, dtype and layout are taken from it (a 2-D
    F-contiguous array maps to DION_LAYOUT_COL_MAJOR); with an address
    ``shape`` and ``dtype`` are required. ``grad`` None means "no gradient
    yet" (the tensor is skipped until rebound). ``grad_dtype`` None: same as
    the parameter (or taken from a numpy ``grad``). The shard fields mirror
    dion_tensor_t and matter only with multi-rank meshes.
    """

    param: Any
    grad: Any = None
    name: Optional[str] = None
    shape: Optional[Sequence[int]] = None
    dtype: Any = None
    grad_dtype: Any = None
    layout: Any = None
    outer_shard_dim: int = -1
    inner_shard_dim: int = -1
    outer_offset: int = 0
    outer_extent: int = 0
    inner_offset: int = 0
    inner_extent: int = 0


def _is_array(x) -> bool:
    return np is not None and isinstance(x, np.ndarray)


def _address(x, what: str, fn: str, arrays: bool = True) -> Optional[int]:
    """A raw address from an int, a ctypes.c_void_p or None (arrays are handled by the callers)."""
    if x is None:
        return None
    if isinstance(x, ctypes.c_void_p):
        return x.value
    if isinstance(x, int) and not isinstance(x, bool):
        return int(x)
    raise DionInvalidArgument("%s: %s must be %san address (int) or None, got %s" %
                              (fn, what, "a numpy array, " if arrays else "", type(x).__name__))


def _array_layout(a, label: str, what: str, fn: str) -> int:
    if a.flags.c_contiguous:
        return L.DION_LAYOUT_ROW_MAJOR
    if a.ndim == 2 and a.flags.f_contiguous:
        return L.DION_LAYOUT_COL_MAJOR
    raise DionInvalidArgument(
        "%s: %s: %s must be C-contiguous, or F-contiguous if 2-D (libdion reads dense buffers and updates the "
        "parameter in place, so a strided view cannot be passed)" % (fn, label, what))


def _to_spec(entry, i: int, fn: str) -> TensorSpec:
    if isinstance(entry, TensorSpec):
        return entry
    if isinstance(entry, dict):
        unknown = set(entry) - {f.name for f in dataclasses.fields(TensorSpec)}
        if unknown:
            raise DionInvalidArgument("%s: tensors[%d] has unknown keys %s" % (fn, i, sorted(unknown)))
        if "param" not in entry:
            raise DionInvalidArgument("%s: tensors[%d] has no 'param'" % (fn, i))
        return TensorSpec(**entry)
    if isinstance(entry, (tuple, list)):
        if not 1 <= len(entry) <= 3:
            raise DionInvalidArgument("%s: tensors[%d] must be (param, grad[, name]), got %d items" %
                                      (fn, i, len(entry)))
        return TensorSpec(*entry)
    if _is_array(entry):
        return TensorSpec(entry)
    raise DionInvalidArgument("%s: tensors[%d] must be a (param, grad[, name]) tuple, a dict or a TensorSpec, got %s" %
                              (fn, i, type(entry).__name__))


@dataclasses.dataclass
class _TensorMeta:
    name: str
    shape: Tuple[int, ...]
    param_dtype: int
    grad_dtype: int
    layout: int


def _array_dtype(a, declared, label: str, what: str, fn: str) -> int:
    """Dtype code of a numpy buffer; uint16 buffers need a declared bf16/fp16."""
    if a.dtype == np.uint16:
        code = dtype_code(declared, what + "_dtype", fn) if declared is not None else L.DION_DTYPE_UNSET
        if code not in (L.DION_DTYPE_BF16, L.DION_DTYPE_FP16):
            raise DionInvalidArgument("%s: %s: %s is a uint16 array; say whether it holds bf16 or fp16 bits "
                                      "(dtype='bf16')" % (fn, label, what))
        return code
    code = dtype_code(a.dtype, what + " dtype", "%s: %s" % (fn, label))
    if declared is not None and dtype_code(declared, what, fn) != code:
        raise DionInvalidArgument("%s: %s: %s is a %s array but its dtype is given as %r" %
                                  (fn, label, what, a.dtype, declared))
    return code


# --------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------

class Optimizer:
    """One libdion optimizer (dion_create ... dion_destroy).

    Use it as a context manager or call ``close()``; ``__del__`` is only a
    safety net. Calls on one object are serialized with a lock (the C API
    forbids concurrent use of one handle); distinct optimizers may step
    concurrently from several threads (ctypes releases the GIL). Example::

        with Optimizer(seed=0) as opt:
            g = opt.add_group("muon", [(W, dW, "w")], lr=0.02)
            opt.step()
    """

    def __init__(self, backend="host", seed: int = 0, skip_nonfinite=True, replicate_grad_sync=True,
                 device: int = 0, replicate_comm=None, outer_comm=None, inner_comm=None):
        self._lib = get_lib()
        self._handle = None
        self._lock = threading.RLock()
        self._keep: Dict[int, Tuple[Any, Any]] = {}   # tensor index -> (param, grad) objects kept alive
        self._meta: List[_TensorMeta] = []
        opts = L.dion_options_t()
        check(self._lib.dion_options_init(byref(opts)))
        fn = "Optimizer"
        opts.backend = _lookup(BACKENDS, backend, "backend", fn)
        opts.device = int(device)
        opts.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        opts.skip_nonfinite = int(skip_nonfinite)
        opts.replicate_grad_sync = int(replicate_grad_sync)
        opts.replicate_comm = _address(replicate_comm, "replicate_comm", fn, arrays=False)
        opts.outer_comm = _address(outer_comm, "outer_comm", fn, arrays=False)
        opts.inner_comm = _address(inner_comm, "inner_comm", fn, arrays=False)
        h = L.dion_optimizer_t()
        check(self._lib.dion_create(byref(h), byref(opts)))  # errors land on the thread (handle is NULL)
        self._handle = h
        self.options = opts

    # ---- lifetime ----

    def close(self) -> None:
        """Destroys the optimizer (idempotent) and releases the kept arrays."""
        h, self._handle = getattr(self, "_handle", None), None
        if h is not None and h.value:
            st = self._lib.dion_destroy(h)
            self._keep = {}
            if st != L.DION_SUCCESS:
                check(st)
        self._keep = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def __repr__(self):
        if self._handle is None:
            return "<libdion.Optimizer (closed)>"
        return "<libdion.Optimizer backend=%d groups=%d tensors=%d states=%d>" % (
            self.options.backend, self.group_count(), self.tensor_count(), self.state_count())

    @property
    def closed(self) -> bool:
        return self._handle is None

    @property
    def handle(self) -> int:
        """The raw dion_optimizer_t (for direct calls into ``libdion.lib``)."""
        return self._h("handle").value

    def _h(self, fn: str):
        if self._handle is None:
            raise DionInvalidUsage("Optimizer.%s: the optimizer is closed" % fn, L.DION_ERROR_INVALID_USAGE)
        return self._handle

    def _call(self, fn: str, cfunc, *args) -> None:
        with self._lock:
            h = self._h(fn)
            check(cfunc(h, *args), h)

    # ---- groups and tensors ----

    def add_group(self, algorithm="muon", tensors: Sequence = (), **hyperparams) -> int:
        """Adds a group and returns its index.

        ``tensors``: (param, grad[, name]) tuples of numpy arrays, dicts or
        ``TensorSpec`` (raw addresses with shape and dtype). Tensors are
        numbered across groups in the order they are added.
        ``hyperparams``: any field of dion_group_options_t (lr, weight_decay,
        mu, beta1, beta2 or betas=(b1, b2), epsilon, rank_fraction, ...);
        enum fields take names ("qr", "newton_schulz", "rms_norm", None, ...),
        dtype fields names or numpy dtypes, flags booleans. Unset fields keep
        microsoft/dion's defaults (dion_group_options_init).
        """
        fn = "add_group"
        algo = _lookup(ALGORITHMS, algorithm, "algorithm", fn)
        go = L.dion_group_options_t()
        st = self._lib.dion_group_options_init(byref(go), algo)
        if st != L.DION_SUCCESS:
            check(st)
        if "betas" in hyperparams:
            betas = hyperparams.pop("betas")
            hyperparams.setdefault("beta1", betas[0])
            hyperparams.setdefault("beta2", betas[1])
        for key, value in hyperparams.items():
            if key not in _GROUP_FIELDS:
                raise TypeError("add_group() got an unexpected keyword argument %r (dion_group_options_t fields: %s)"
                                % (key, ", ".join(_GROUP_FIELDS)))
            if key in _ENUM_OPTIONS:
                value = _lookup(_ENUM_OPTIONS[key], value, key, fn)
            elif key in _DTYPE_OPTIONS:
                value = dtype_code(value, key, fn)
            elif isinstance(value, bool):
                value = int(value)
            try:
                setattr(go, key, value)
            except TypeError:
                raise DionInvalidArgument("%s: %s = %r has the wrong type" % (fn, key, value)) from None

        specs = [_to_spec(t, i, fn) for i, t in enumerate(tensors)]
        n = len(specs)
        arr = (L.dion_tensor_t * max(n, 1))()
        keep, metas, names = [], [], []
        base = len(self._meta)
        for i, s in enumerate(specs):
            d = arr[i]
            check(self._lib.dion_tensor_init(byref(d)))
            label = "tensors[%d]" % i if s.name is None else "tensor '%s' (tensors[%d])" % (s.name, i)
            meta, pp, gp = self._describe(s, label, fn)
            name_b = s.name.encode() if s.name is not None else None
            names.append(name_b)
            d.name = name_b
            d.param = pp
            d.grad = gp
            d.param_dtype = meta.param_dtype
            d.grad_dtype = meta.grad_dtype
            d.layout = meta.layout
            d.ndim = len(meta.shape)
            for k, v in enumerate(meta.shape[:L.DION_MAX_DIMS]):
                d.shape[k] = v
            d.outer_shard_dim = s.outer_shard_dim
            d.inner_shard_dim = s.inner_shard_dim
            d.outer_offset, d.outer_extent = s.outer_offset, s.outer_extent
            d.inner_offset, d.inner_extent = s.inner_offset, s.inner_extent
            keep.append((s.param, s.grad))
            metas.append(meta)
        gi = c_int32(-1)
        with self._lock:
            h = self._h(fn)
            check(self._lib.dion_add_group(h, byref(go), arr if n else None, n, byref(gi)), h)
            for i in range(n):
                self._keep[base + i] = keep[i]
            self._meta.extend(metas)
        return gi.value

    def _describe(self, s: TensorSpec, label: str, fn: str):
        """(meta, param address, grad address) of a spec, validating what only Python can see."""
        if _is_array(s.param):
            p = s.param
            if p.ndim > L.DION_MAX_DIMS:
                raise DionInvalidArgument("%s: %s: param has %d dims; libdion takes at most %d" %
                                          (fn, label, p.ndim, L.DION_MAX_DIMS))
            if not p.flags.writeable:
                raise DionInvalidArgument("%s: %s: param is read-only; the library updates it in place" % (fn, label))
            layout = _array_layout(p, label, "param", fn)
            if s.layout is not None and _lookup(LAYOUTS, s.layout, "layout", fn) != layout:
                if p.flags.c_contiguous and p.flags.f_contiguous:  # both orders describe this memory
                    layout = _lookup(LAYOUTS, s.layout, "layout", fn)
                else:
                        raise DionInvalidArgument("%s: %s: layout %r does not match the param array's memory order" %
                                              (fn, label, s.layout))
            if s.shape is not None and tuple(s.shape) != tuple(p.shape):
                raise DionInvalidArgument("%s: %s: shape %s differs from the param array's %s" %
                                          (fn, label, tuple(s.shape), p.shape))
            pdt = _array_dtype(p, s.dtype, label, "param", fn)
            shape = tuple(int(x) for x in p.shape)
            paddr = p.ctypes.data
        else:
            paddr = _address(s.param, "%s: param" % label, fn)
            if s.shape is None or s.dtype is None:
                raise DionInvalidArgument("%s: %s: a raw param address needs shape and dtype" % (fn, label))
            shape = tuple(int(x) for x in s.shape)
            pdt = dtype_code(s.dtype, "dtype", "%s: %s" % (fn, label))
            layout = L.DION_LAYOUT_ROW_MAJOR if s.layout is None else _lookup(LAYOUTS, s.layout, "layout", fn)
            if len(shape) > L.DION_MAX_DIMS:
                raise DionInvalidArgument("%s: %s: shape has %d dims; libdion takes at most %d" %
                                          (fn, label, len(shape), L.DION_MAX_DIMS))
        meta = _TensorMeta(s.name or "", shape, pdt, L.DION_DTYPE_UNSET, layout)
        if _is_array(s.grad):
            _check_grad_array_shape_layout(s.grad, meta, label, fn)
            declared = s.grad_dtype if s.grad_dtype is not None else (s.dtype if s.grad.dtype == np.uint16 else None)
            gdt = _array_dtype(s.grad, declared, label, "grad", fn)
            gaddr = s.grad.ctypes.data
        else:
            gaddr = _address(s.grad, "%s: grad" % label, fn)
            gdt = L.DION_DTYPE_UNSET if s.grad_dtype is None else dtype_code(s.grad_dtype, "grad_dtype", fn)
        meta.grad_dtype = pdt if gdt == L.DION_DTYPE_UNSET else gdt
        return meta, paddr, gaddr

    def rebind(self, tensor: int, param, grad=None) -> None:
        """Points tensor `tensor` at new buffers (dion_tensor_rebind); grad None skips it.

        Arrays must keep the shape, dtypes and layout given to add_group.
        """
        fn = "rebind"
        if not 0 <= tensor < len(self._meta):
            # The library owns the message for a bad index.
            paddr = param.ctypes.data if _is_array(param) else _address(param, "param", fn)
            self._call(fn, self._lib.dion_tensor_rebind, int(tensor), paddr, None)
            return
        meta = self._meta[tensor]
        label = "tensor %d" % tensor if not meta.name else "tensor '%s' (%d)" % (meta.name, tensor)
        if _is_array(param):
            if tuple(param.shape) != meta.shape:
                raise DionInvalidArgument("%s: %s: param shape %s differs from %s given to add_group" %
                                          (fn, label, tuple(param.shape), meta.shape))
            if not param.flags.writeable:
                raise DionInvalidArgument("%s: %s: param is read-only" % (fn, label))
            if _array_layout(param, label, "param", fn) != meta.layout and \
                    not (param.flags.c_contiguous and param.flags.f_contiguous):
                raise DionInvalidArgument("%s: %s: param layout differs from the one given to add_group" % (fn, label))
            declared = DTYPE_NAMES.get(meta.param_dtype)
            if _array_dtype(param, declared if param.dtype == np.uint16 else None, label, "param", fn) != \
                    meta.param_dtype:
                raise DionInvalidArgument("%s: %s: param dtype %s differs from %s given to add_group" %
                                          (fn, label, param.dtype, DTYPE_NAMES.get(meta.param_dtype)))
            paddr = param.ctypes.data
        else:
            paddr = _address(param, "%s: param" % label, fn)
        if _is_array(grad):
            _check_grad_array_shape_layout(grad, meta, label, fn)
            declared = DTYPE_NAMES.get(meta.grad_dtype)
            if _array_dtype(grad, declared if grad.dtype == np.uint16 else None, label, "grad", fn) != \
                    meta.grad_dtype:
                raise DionInvalidArgument("%s: %s: grad dtype %s differs from %s given to add_group" %
                                          (fn, label, grad.dtype, DTYPE_NAMES.get(meta.grad_dtype)))
            gaddr = grad.ctypes.data
        else:
            gaddr = _address(grad, "%s: grad" % label, fn)
        with self._lock:
            h = self._h(fn)
            check(self._lib.dion_tensor_rebind(h, int(tensor), paddr, gaddr), h)
            self._keep[tensor] = (param, grad)

    def group_count(self) -> int:
        v = c_int32()
        self._call("group_count", self._lib.dion_group_count, byref(v))
        return v.value

    def tensor_count(self) -> int:
        v = c_int32()
        self._call("tensor_count", self._lib.dion_tensor_count, byref(v))
        return v.value

    # ---- hyperparameters and steps ----

    def set_hparam(self, group: int, hparam, value: float) -> None:
        """Sets one hyperparameter ("lr", "weight_decay", "mu", "beta1", ...) of a group for the next step."""
        self._call("set_hparam", self._lib.dion_group_set_hparam, int(group),
                   _lookup(HPARAMS, hparam, "hparam", "set_hparam"), float(value))

    def get_hparam(self, group: int, hparam) -> float:
        v = c_double()
        self._call("get_hparam", self._lib.dion_group_get_hparam, int(group),
                   _lookup(HPARAMS, hparam, "hparam", "get_hparam"), byref(v))
        return v.value

    def step_count(self, group: int) -> int:
        """The group's step counter (dion_group_get_step)."""
        v = c_int64()
        self._call("step_count", self._lib.dion_group_get_step, int(group), byref(v))
        return v.value

    def set_step(self, group: int, step: int) -> None:
        self._call("set_step", self._lib.dion_group_set_step, int(group), int(step))

    def step(self, stream=None) -> None:
        """One optimizer step over every group (complete on return on the host backend)."""
        self._call("step", self._lib.dion_step, _address(stream, "stream", "step", arrays=False))

    def sync_for_checkpoint(self, stream=None) -> None:
        self._call("sync_for_checkpoint", self._lib.dion_sync_for_checkpoint,
                   _address(stream, "stream", "sync_for_checkpoint", arrays=False))

    def skipped_steps(self, stream=None) -> int:
        """Steps skipped for non-finite gradients since creation."""
        v = c_int64()
        self._call("skipped_steps", self._lib.dion_get_skipped_steps, byref(v), None,
                   _address(stream, "stream", "skipped_steps", arrays=False))
        return v.value

    def last_step_skipped(self, stream=None) -> bool:
        v = c_int32()
        self._call("last_step_skipped", self._lib.dion_get_skipped_steps, None, byref(v),
                   _address(stream, "stream", "last_step_skipped", arrays=False))
        return bool(v.value)

    def async_error(self) -> int:
        """DION_SUCCESS or the first error found by enqueued work (a status code)."""
        v = c_int32()
        self._call("async_error", self._lib.dion_get_async_error, byref(v))
        return v.value

    def comm_bytes(self, mesh="replicate") -> Tuple[int, int]:
        """(bytes of the last step, bytes since creation) over a mesh."""
        a, b = c_uint64(), c_uint64()
        self._call("comm_bytes", self._lib.dion_get_comm_bytes, _lookup(MESHES, mesh, "mesh", "comm_bytes"),
                   byref(a), byref(b))
        return a.value, b.value

    def memory_usage(self) -> Dict[str, int]:
        """{"state_bytes": ..., "workspace_bytes": ...} held by libdion for this optimizer."""
        a, b = c_uint64(), c_uint64()
        self._call("memory_usage", self._lib.dion_get_memory_usage, byref(a), byref(b))
        return {"state_bytes": a.value, "workspace_bytes": b.value}

    # ---- state ----

    def state_count(self) -> int:
        v = c_int32()
        self._call("state_count", self._lib.dion_state_count, byref(v))
        return v.value

    def state_info(self, index: int) -> Dict[str, Any]:
        info = L.dion_state_info_t()
        info.struct_size = ctypes.sizeof(info)
        self._call("state_info", self._lib.dion_state_info, int(index), byref(info))
        nd = info.ndim
        return {
            "index": int(index),
            "tensor": info.tensor,
            "group": info.group,
            "name": info.name.decode() if info.name else "",
            "dtype": DTYPE_NAMES.get(info.dtype, info.dtype),
            "dtype_code": info.dtype,
            "layout": LAYOUT_NAMES.get(info.layout, info.layout),
            "ndim": nd,
            "global_shape": tuple(info.global_shape[:nd]),
            "local_shape": tuple(info.local_shape[:nd]),
            "local_offset": tuple(info.local_offset[:nd]),
            "local_bytes": info.local_bytes,
        }

    def states(self) -> List[Dict[str, Any]]:
        """Every state buffer described as a dict (index, tensor, group, name, dtype, shapes, local_bytes)."""
        return [self.state_info(i) for i in range(self.state_count())]

    def find_state(self, tensor: int, name: str) -> int:
        """Index of state `name` ("momentum", "Q", "variance", "variance_neuron") of a tensor."""
        v = c_int32()
        self._call("find_state", self._lib.dion_state_find, int(tensor), name.encode(), byref(v))
        return v.value

    def _state_index(self, index) -> int:
        if isinstance(index, tuple):
            return self.find_state(*index)
        return int(index)

    def read_state_into(self, index, address: int, nbytes: int, stream=None) -> None:
        """Copies state `index` (or a (tensor, name) pair) to raw memory of `nbytes` >= its local_bytes.

        On the CUDA backend `address` may be host or device memory and the
        copy is enqueued on `stream`; frameworks pass their own tensors here.
        """
        self._call("read_state_into", self._lib.dion_state_read, self._state_index(index),
                   _address(address, "address", "read_state_into", arrays=False) or None, int(nbytes),
                   _address(stream, "stream", "read_state_into", arrays=False))

    def write_state_from(self, index, address: int, nbytes: int, stream=None) -> None:
        """Copies raw memory of `nbytes` bytes into state `index` (or a (tensor, name) pair); see read_state_into."""
        self._call("write_state_from", self._lib.dion_state_write, self._state_index(index),
                   _address(address, "address", "write_state_from", arrays=False) or None, int(nbytes),
                   _address(stream, "stream", "write_state_from", arrays=False))

    def read_state(self, index, stream=None):
        """Copies state `index` (or a (tensor, name) pair) into a new numpy array of its local shape.

        fp32 -> float32, fp16 -> float16, bf16 -> uint16 holding the raw bits
        (see ``bf16_to_float32``). Column-major states come back as
        F-ordered arrays of the logical shape.
        """
        i = self._state_index(index)
        info = self.state_info(i)
        dt = numpy_dtype_for(info["dtype_code"])
        order = "F" if info["layout"] == "col_major" else "C"
        out = np.empty(info["local_shape"], dtype=dt, order=order)
        self._call("read_state", self._lib.dion_state_read, i, out.ctypes.data if out.nbytes else None,
                   out.nbytes, _address(stream, "stream", "read_state", arrays=False))
        return out

    def write_state(self, index, array, stream=None) -> None:
        """Copies `array` into state `index` (or a (tensor, name) pair).

        The array must have the state's local shape and storage dtype (as
        ``read_state`` returns it: float32, float16, or uint16 bits for bf16;
        a float32 array for a bf16 state is rounded with ``float32_to_bf16``).
        """
        fn = "write_state"
        i = self._state_index(index)
        info = self.state_info(i)
        label = "state %d ('%s' of tensor %d)" % (i, info["name"], info["tensor"])
        a = np.asarray(array)
        if tuple(a.shape) != info["local_shape"]:
            raise DionInvalidArgument("%s: %s: array shape %s differs from the local shape %s" %
                                      (fn, label, tuple(a.shape), info["local_shape"]))
        want = numpy_dtype_for(info["dtype_code"])
        if info["dtype_code"] == L.DION_DTYPE_BF16 and a.dtype == np.float32:
            a = float32_to_bf16(a).reshape(a.shape)
        elif info["dtype_code"] == L.DION_DTYPE_BF16 and a.dtype.name == "bfloat16":
            a = a.view(np.uint16)
        if a.dtype != want:
            raise DionInvalidArgument("%s: %s: array dtype %s; the state is %s (numpy %s)" %
                                      (fn, label, a.dtype, info["dtype"], want))
        a = np.asfortranarray(a) if info["layout"] == "col_major" else np.ascontiguousarray(a)
        self._call(fn, self._lib.dion_state_write, i, a.ctypes.data if a.nbytes else None, a.nbytes,
                   _address(stream, "stream", fn, arrays=False))

    def state_dict(self) -> Dict[str, Any]:
        """Plain snapshot: every state array plus each group's step counter."""
        return {
            "states": [(s["tensor"], s["name"], self.read_state(s["index"])) for s in self.states()],
            "steps": [self.step_count(g) for g in range(self.group_count())],
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restores a ``state_dict()`` taken from an optimizer with the same groups and tensors."""
        steps = sd["steps"]
        if len(steps) != self.group_count():
            raise DionInvalidArgument("load_state_dict: %d group step counters for %d groups" %
                                      (len(steps), self.group_count()))
        for tensor, name, arr in sd["states"]:
            self.write_state((tensor, name), arr)
        for g, s in enumerate(steps):
            self.set_step(g, s)


def _check_grad_array_shape_layout(g, meta: _TensorMeta, label: str, fn: str) -> None:
    if tuple(g.shape) != meta.shape:
        raise DionInvalidArgument("%s: %s: grad shape %s differs from the parameter shape %s" %
                                  (fn, label, tuple(g.shape), meta.shape))
    ok = g.flags.f_contiguous if meta.layout == L.DION_LAYOUT_COL_MAJOR else g.flags.c_contiguous
    if not ok:
        raise DionInvalidArgument("%s: %s: grad must have the parameter's layout (%s) and be contiguous" %
                                  (fn, label, LAYOUT_NAMES[meta.layout]))
