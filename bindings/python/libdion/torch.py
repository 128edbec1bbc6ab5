# SPDX-License-Identifier: MIT
"""PyTorch optimizers backed by libdion: ``Dion``, ``Dion2``, ``Muon``, ``NorMuon``, ``NorDion2`` (``Dion3``).

Drop-in ``torch.optim.Optimizer`` subclasses with the constructor arguments,
defaults and param-group keys of microsoft/dion. Every update is computed by
the C library; this module only maps parameter groups to libdion groups,
passes the tensors' data pointers and keeps the hyperparameters in step::

    from libdion.torch import Dion
    opt = Dion([dict(params=matrices),
                dict(params=vectors_and_embeddings, algorithm="lion", weight_decay=0)],
               lr=0.02, rank_fraction=0.25)
    loss.backward(); opt.step(); opt.zero_grad()

Parameter groups
    Each group has an ``algorithm`` key: the optimizer's own (``"dion"``,
    ``"muon"``, ...; the default) or ``"adamw"`` / ``"lion"`` for embeddings,
    norms, biases and the LM head. As upstream, nothing is classified
    automatically: a 1-D tensor in a matrix group is an error naming the
    scalar algorithm to use. Each non-empty torch group becomes one libdion
    group. Keys other than upstream's that name a field of
    ``dion_group_options_t`` (``ortho_steps``, ``matmul_precision``,
    ``qr_method``, ...) are passed through too.

When the library optimizer is built
    Eagerly, in ``__init__`` / ``add_param_group``: libdion allocates and
    initialises the state of every parameter at once (zeros; Dion's Q from
    the seeded generator). ``state_dict()`` is therefore complete before the
    first step, a checkpoint can be loaded into a fresh optimizer right away,
    and the state's addresses never change (CUDA graphs). Gradients need not
    exist yet: they are bound at each ``step()``.

Devices
    All parameters of one optimizer must live on one device. CPU tensors use
    libdion's host backend; CUDA tensors its CUDA backend on their device,
    with ``dion_step`` enqueued on ``torch.cuda.current_stream()`` and no
    synchronisation. Parameters and gradients must be float32, bfloat16 or
    float16 and contiguous: libdion updates parameters in place through their
    data pointers, so strided views are rejected rather than copied.

Each ``step()``
    1. runs the closure (under ``torch.enable_grad``) and keeps its loss;
    2. pushes every live hyperparameter (``lr``, ``weight_decay``, ``mu``,
       ``beta1``/``beta2`` (or ``betas``), ``epsilon``, ``ef_decay``,
       ``muon_beta2``) whose group value differs from the one last given to
       the library (``dion_group_set_hparam``), so LR schedulers and manual
       ``param_group`` edits act at that step; structural keys
       (``rank_fraction``, ``fraction``, ``nesterov``, ``algorithm``, ...) are
       fixed once the group exists and changing them raises;
    3. re-binds every parameter whose ``data_ptr`` or gradient changed
       (``dion_tensor_rebind``; a ``None`` gradient binds NULL, so the tensor
       is skipped: ``zero_grad(set_to_none=True)`` works);
    4. calls ``dion_step``.

State and checkpoints
    The live state stays inside libdion. ``state_dict()`` copies it into
    ``optimizer.state[p]`` as tensors named as in the library (``"momentum"``,
    ``"Q"``, ``"variance"``, ``"variance_neuron"``, in the state's dtype, on
    the parameters' device) and stores each group's step counter in
    ``param_groups[i]["step"]``; the result is ``torch.save``-able.
    ``load_state_dict()`` writes them back (``dion_state_write``,
    ``dion_group_set_step``) without casting the states to the parameter
    dtype. With the same ``seed`` the continued run equals the uninterrupted
    one bit for bit.

CUDA graphs
    With the CUDA backend ``optimizer.step()`` can be captured in
    ``torch.cuda.graph`` after one eager warm-up step, as long as the
    parameter and gradient pointers stay those of the last eager step (copy
    new gradients into the existing ``.grad`` buffers; keep them with
    ``zero_grad(set_to_none=False)``). A changed pointer or hyperparameter
    during the capture raises. libdion keeps ``lr``, ``weight_decay`` and the
    betas in device memory, so a scheduler works with replays: change the
    group values and call ``sync_hparams()`` before ``graph.replay()``. The
    other hyperparameters (``mu``, ``epsilon``, ...) are captured by value:
    after changing one, ``sync_hparams()`` and capture again.

Several ranks (DDP, FSDP2, tensor parallel; ``_torch_dist.py`` has the details)
    Meshes are torch ProcessGroups, 1-D DeviceMeshes or mpi4py communicators.
    ``Dion(replicate_mesh=, outer_shard_mesh=, inner_shard_mesh=,
    replicate_mesh_grad_sync=)`` map one to one to libdion's replicate, outer
    shard (FSDP) and inner shard (TP) meshes. The megabatch family's
    ``distributed_mesh`` (microsoft/dion spec §7) is libdion's outer mesh when
    some parameter is sharded over it (FSDP2), else its replicate mesh with
    ``replicate_grad_sync=0`` (DDP averaged the gradients already; the mesh
    splits the orthogonalizations). CUDA parameters get NCCL communicators
    (rank 0 of each group draws the unique id, broadcast with
    ``torch.distributed``), CPU parameters MPI ones (mpi4py: the communicator
    given, or one split from ``MPI.COMM_WORLD`` with the group's ranks);
    communicators are shared per group and destroyed by ``close()`` of the
    last optimizer using them. Creating an optimizer, ``step()`` and
    ``synchronize_for_checkpoint()`` are collective over the meshes.

    DTensor parameters (``fully_shard``, ``parallelize_module``) are passed as
    their local shards with the global shape and, for each ``Shard(d)``
    placement on a mesh dim whose group is one of the optimizer's meshes,
    that mesh's shard dim and this rank's offset/extent (torch's chunking).
    ``Replicate`` needs nothing; ``_StridedShard``, ``Partial``, a shard over a
    mesh the optimizer was not given, and one dim sharded over two meshes are
    refused with a message saying what to change. ``state_dict()`` returns the
    states of DTensor parameters as DTensors over the parameter's mesh
    (momentum placed like the parameter, Dion's Q Shard(0) on the outer mesh
    dim), so torch.distributed.checkpoint saves and reshards them;
    ``load_state_dict()`` takes them back (or local or global plain tensors).

Not supported (clear ``NotImplementedError``): a Python ``newton_schulz_func``
and ``use_gram_newton_schulz``. ``use_triton``, ``triton_post_ortho`` and
``verbose`` are accepted and ignored (libdion has its own kernels).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

try:
    import torch
except ImportError as e:  # libdion itself needs no torch; only this module does
    raise ImportError("libdion.torch needs PyTorch (Debian: apt-get install python3-torch; or pip install torch): %s"
                      % e) from e

from . import _lib as L
from ._lib import DionInvalidArgument, DionInvalidUsage, DionNotSupported
from . import _torch_dist as _D
from .core import _GROUP_FIELDS, HPARAMS, Optimizer as _LibOptimizer, TensorSpec

__all__ = ["Dion", "Dion2", "Muon", "NorMuon", "NorDion2", "Dion3", "DionMixedPrecisionConfig"]

# torch dtype <-> DION_DTYPE_* (libdion's storage dtypes).
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_TORCH_DTYPES = {L.DION_DTYPE_FP32: torch.float32, L.DION_DTYPE_BF16: torch.bfloat16,
                 L.DION_DTYPE_FP16: torch.float16}

# Group keys libdion can change between steps (dion_group_set_hparam).
_LIVE_KEYS = tuple(HPARAMS)  # lr, weight_decay, mu, beta1, beta2, epsilon, ef_decay, muon_beta2
# Every other dion_group_options_t field is fixed when the group is added.
_FROZEN_KEYS = tuple(k for k in _GROUP_FIELDS if k not in HPARAMS)
_SCALAR_ALGORITHMS = ("adamw", "lion")
_ALGORITHM_ALIASES = {"dion3": "nordion2"}
_ADJUST_LR = ("spectral_norm", "rms_norm", None)


@dataclasses.dataclass
class DionMixedPrecisionConfig:
    """State dtypes of a ``Dion`` optimizer (``None``: the parameter's dtype), as microsoft/dion's.

    ``momentum_dtype`` applies to the momentum of every group (Dion, Lion and
    AdamW), ``Q_dtype`` to Dion's Q, ``variance_dtype`` to AdamW's variance.
    Each is ``None``, ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
    """

    momentum_dtype: Optional[torch.dtype] = None
    Q_dtype: Optional[torch.dtype] = None
    variance_dtype: Optional[torch.dtype] = None

    def libdion_options(self) -> Dict[str, Optional[str]]:
        """The matching ``dion_group_options_t`` dtype fields (names libdion's binding accepts)."""
        out = {}
        for field, key in (("momentum_dtype", "momentum_dtype"), ("Q_dtype", "q_dtype"),
                           ("variance_dtype", "variance_dtype")):
            dt = getattr(self, field)
            if dt is not None and dt not in _DTYPE_NAMES:
                raise DionInvalidArgument("DionMixedPrecisionConfig: %s = %s is not supported by libdion "
                                          "(torch.float32, torch.bfloat16 or torch.float16)" % (field, dt))
            out[key] = None if dt is None else _DTYPE_NAMES[dt]
        return out


# --------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------

def _as_float(value, what: str) -> float:
    """A hyperparameter as a Python float (0-d tensors are read; a CUDA tensor synchronises)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise DionInvalidArgument("%s must be a number or a one-element tensor, got a tensor of shape %s" %
                                      (what, tuple(value.shape)))
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DionInvalidArgument("%s must be a number, got %r" % (what, value))
    return float(value)


def _check_hparams(values: Dict[str, Any], where: str) -> None:
    """Range checks with the offending value in the message (ValueError / DionInvalidArgument)."""
    def num(key):
        return _as_float(values[key], "%s: %s" % (where, key))

    for key in ("lr", "weight_decay", "mu", "beta1", "beta2", "epsilon", "ef_decay", "muon_beta2"):
        if key in values:
            v = num(key)
            if not math.isfinite(v) or v < 0.0:
                raise DionInvalidArgument("%s: invalid %s = %r (must be a finite number >= 0)" %
                                          (where, key, values[key]))
    for key in ("rank_fraction", "fraction"):
        if key in values:
            v = num(key)
            if not 0.0 < v <= 1.0:
                raise DionInvalidArgument("%s: invalid %s = %r (must be in (0, 1])" % (where, key, values[key]))
    for key in ("rank_multiple_of", "power_iters", "ortho_steps"):
        if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int) or values[key] < 1):
            raise DionInvalidArgument("%s: invalid %s = %r (must be an int >= 1)" % (where, key, values[key]))
    if "oversample" in values and num("oversample") < 1.0:
        raise DionInvalidArgument("%s: invalid oversample = %r (must be >= 1)" % (where, values["oversample"]))
    if "adjust_lr" in values and values["adjust_lr"] not in _ADJUST_LR:
        raise DionInvalidArgument("%s: invalid adjust_lr = %r (must be 'spectral_norm', 'rms_norm' or None)" %
                                  (where, values["adjust_lr"]))
    if "selection_scope" in values and values["selection_scope"] not in ("local", "global"):
        raise DionInvalidArgument("%s: invalid selection_scope = %r (must be 'local' or 'global')" %
                                  (where, values["selection_scope"]))
    if "qr_method" in values and values["qr_method"] not in ("rcqr", "qr", "cqr"):
        raise DionInvalidArgument("%s: invalid qr_method = %r (must be 'rcqr', 'qr' or 'cqr')" %
                                  (where, values["qr_method"]))


def _check_betas(betas, where: str) -> Tuple[float, float]:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise DionInvalidArgument("%s: invalid betas = %r (must be a pair (beta1, beta2))" % (where, betas)) from None
    _check_hparams({"beta1": b1, "beta2": b2}, where)
    return b1, b2


def _materialize(params) -> List[Any]:
    """``params`` as torch.optim takes it, with every group's ``params`` made a list (generators are read once)."""
    if isinstance(params, torch.Tensor):
        return params  # torch.optim.Optimizer explains that this is an error
    out = list(params)
    for i, g in enumerate(out):
        if isinstance(g, dict) and "params" in g and not isinstance(g["params"], (torch.Tensor, list)):
            out[i] = dict(g, params=list(g["params"]))
    return out


def _all_params(params: List[Any]) -> List[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return []
    out = []
    for g in params:
        if isinstance(g, dict):
            ps = g.get("params", [])
            out.extend([ps] if isinstance(ps, torch.Tensor) else list(ps))
        else:
            out.append(g)
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    return _D.is_dtensor(t)

# --------------------------------------------------------------------------
# Bookkeeping
# --------------------------------------------------------------------------

@dataclasses.dataclass
class _Binding:
    """One torch parameter as a libdion tensor, with the pointers last given to the library."""

    tensor: int
    where: str                     # "libdion.torch.Dion: param_groups[g]['params'][i]"
    label: str                     # where, with the shape and dtype (messages)
    shape: Tuple[int, ...]         # as given to dion_add_group
    dtype: torch.dtype
    param_ptr: int
    grad_ptr: Optional[int]
    shard: Optional[_D.ShardInfo] = None   # a DTensor parameter: its layout over the meshes


@dataclasses.dataclass
class _GroupBinding:
    """One torch param group as a libdion group (None for an empty torch group)."""

    lib_group: Optional[int]
    algorithm: str
    bindings: List[_Binding]
    pushed: Dict[str, float]       # live hyperparameters as last given to libdion
    frozen: Dict[str, Any]         # structural options fixed at dion_add_group


# --------------------------------------------------------------------------
# The shared implementation
# --------------------------------------------------------------------------

class _LibdionOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer over one libdion optimizer (see the module docstring).

    Subclasses set ``_algorithm`` (the matrix algorithm of default groups) and
    ``_matrix_ndim`` (the tensor ranks it accepts), and call ``_setup`` with
    the upstream defaults.
    """

    _algorithm: str = ""
    _matrix_ndim: Tuple[int, int] = (2, L.DION_MAX_DIMS)

    def _setup(self, params, defaults: Dict[str, Any], *, lib_options: Dict[str, Any],
               replicate_grad_sync: bool, seed: int, skip_nonfinite: bool,
               meshes: Optional[Dict[str, Tuple[Any, str]]] = None, distributed_mesh: Any = None) -> None:
        """``meshes``: role -> (mesh, argument name) (Dion); ``distributed_mesh``: the megabatch family's mesh."""
        self._comms: List[int] = []  # libdion communicators acquired for this optimizer (released by close())
        self._core: Optional[_LibOptimizer] = None
        params = _materialize(params)
        where = self._name
        specs: Dict[str, Optional[_D.MeshSpec]] = {}
        if meshes is not None:
            for role, (obj, arg) in meshes.items():
                specs[role] = _D.mesh_spec(obj, role, arg, where, keep_one_rank=True)
        spec = _D.mesh_spec(distributed_mesh, "outer", "distributed_mesh", where)
        if spec is not None:
            # microsoft/dion's distributed_mesh (spec §7.1-7.2) is the mesh the parameters are sharded over
            # (FSDP2: libdion's outer mesh), or, when none is sharded over it (DDP), the group that splits the
            # work while the gradients arrive averaged already (libdion's replicate mesh, no gradient sync).
            if not any(self._sharded_over(p, spec) for p in _all_params(params)):
                spec.role = "replicate"
                replicate_grad_sync = False
            specs[spec.role] = spec
        _D.check_distinct(specs, where)
        self._meshes: Dict[str, Optional[_D.MeshSpec]] = {r: specs.get(r) for r in _D.ROLES}
        self._lib_options = dict(lib_options)  # optimizer-wide libdion fields (groups may override them)
        self._lib_args = dict(seed=seed, skip_nonfinite=bool(skip_nonfinite),
                              replicate_grad_sync=bool(replicate_grad_sync))
        self._device: Optional[torch.device] = None
        self._groups: List[_GroupBinding] = []
        self._tensor_params: List[torch.Tensor] = []  # libdion tensor index -> parameter
        self._tensor_bindings: List[_Binding] = []    # libdion tensor index -> its binding
        self._captured = False  # a step was captured in a CUDA graph
        super().__init__(params, defaults)

    @staticmethod
    def _sharded_over(p, spec: "_D.MeshSpec") -> bool:
        """True if DTensor `p` has a Shard placement over `spec`'s group."""
        if not _is_dtensor(p):
            return False
        mesh = p.device_mesh
        for i, pl in enumerate(p.placements):
            if _D.placement_kind(pl)[0] in ("shard", "strided") and int(mesh.size(i)) > 1 and \
                    _D.same_group(mesh.get_group(i), spec):
                return True
        return False

    @property
    def meshes(self) -> Dict[str, Optional[str]]:
        """Which argument serves each libdion mesh (``replicate``, ``outer``, ``inner``; None: absent).

        A Dion mesh of one rank is listed too (with a one-rank communicator: MPI_COMM_SELF or NCCL): a DTensor
        sharded over it gets its shard dim in the descriptor (full extent), so that Dion's orientation (spec §2.2)
        is that of the run over several ranks. Where no communicator can be made for it (CPU tensors without
        mpi4py, a libdion built without MPI) it is dropped when the first parameters are added."""
        return {r: (None if m is None else m.arg) for r, m in self._meshes.items()}

    @property
    def _name(self) -> str:
        return "libdion.torch.%s" % type(self).__name__

    # ---- properties ----

    @property
    def device(self) -> Optional[torch.device]:
        """The device of the parameters (None before any parameter was added)."""
        return self._device

    @property
    def backend(self) -> Optional[str]:
        """``"host"`` (CPU tensors) or ``"cuda"``; None before any parameter was added."""
        if self._device is None:
            return None
        return "cuda" if self._device.type == "cuda" else "host"

    @property
    def libdion_optimizer(self) -> Optional[_LibOptimizer]:
        """The underlying ``libdion.Optimizer`` (group i of ``lib_group_index(i)``; tensors in parameter order)."""
        return self._core

    def lib_group_index(self, group: int) -> Optional[int]:
        """The libdion group index of torch param group ``group`` (None for an empty group)."""
        return self._groups[group].lib_group

    def close(self) -> None:
        """Frees the library optimizer now (dion_destroy), then its communicators (NCCL/MPI) unless another
        optimizer over the same group still uses them; the object cannot step afterwards."""
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()
        comms, self._comms = getattr(self, "_comms", []), []
        for h in comms:
            _D.COMMS.release(h)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # ---- groups ----

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group (torch semantics) and its libdion group, whose state is allocated at once."""
        where = "%s: param_groups[%d]" % (self._name, len(self.param_groups))
        if "betas" in param_group:
            param_group["beta1"], param_group["beta2"] = _check_betas(param_group.pop("betas"), where)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._groups.append(self._register(group, len(self.param_groups) - 1))
        except BaseException:
            self.param_groups.pop()
            raise

    def _algorithm_of(self, group: Dict[str, Any], where: str) -> str:
        algo = group.get("algorithm", self._algorithm)
        name = algo.lower() if isinstance(algo, str) else algo
        name = _ALGORITHM_ALIASES.get(name, name)
        if name != _ALGORITHM_ALIASES.get(self._algorithm, self._algorithm) and name not in _SCALAR_ALGORITHMS:
            raise DionInvalidArgument("%s: unknown algorithm %r for %s (use %r, 'adamw' or 'lion')" %
                                      (where, algo, type(self).__name__, self._algorithm))
        return name

    def _lib_values(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The dion_group_options_t fields of a group: optimizer-wide options, then the group's keys."""
        values = dict(self._lib_options)
        values.update({k: v for k, v in group.items() if k in _GROUP_FIELDS})
        return values

    def _register(self, group: Dict[str, Any], gi: int) -> _GroupBinding:
        where = "%s: param_groups[%d]" % (self._name, gi)
        algorithm = self._algorithm_of(group, where)
        values = self._lib_values(group)
        _check_hparams(values, where)
        params: List[torch.Tensor] = group["params"]
        wheres = ["%s['params'][%d]" % (where, i) for i in range(len(params))]
        device = self._device if self._device is not None else (_D.local_of(params[0]).device if params else None)
        labels = [self._check_param(p, w, algorithm, device) for p, w in zip(params, wheres)]
        live = {k: _as_float(v, "%s: %s" % (where, k)) for k, v in values.items() if k in _LIVE_KEYS}
        frozen = {k: v for k, v in values.items() if k in _FROZEN_KEYS}
        if not params:
            return _GroupBinding(None, algorithm, [], live, frozen)
        if self._core is None:
            self._create_core(_D.local_of(params[0]).device)  # first: it settles the meshes of one rank
        shards = [_D.describe_dtensor(p, self._meshes, lb) if _is_dtensor(p) else None
                  for p, lb in zip(params, labels)]
        base = len(self._tensor_params)
        specs = []
        for i, p in enumerate(params):
            g = p.grad
            gp = None
            if g is not None:
                gp = self._check_grad(p, g, labels[i]).data_ptr()
            fields = shards[i].fields() if shards[i] is not None else {}
            specs.append(TensorSpec(param=_D.local_of(p).data_ptr(), grad=gp, name=labels[i], shape=tuple(p.shape),
                                    dtype=_DTYPE_NAMES[p.dtype], **fields))
        opts = dict(live)
        opts.update(frozen)
        try:
            lib_group = self._core.add_group(algorithm, specs, **opts)
        except DionNotSupported as e:
            meshes = [m.describe() for m in self._meshes.values() if m is not None and m.size > 1]
            if not meshes:
                raise
            sharded = [lb for lb, sh in zip(labels, shards) if sh is not None and sh.dims]
            raise DionNotSupported(
                "%s: libdion does not support this group on the optimizer's multi-rank meshes (%s)%s: %s" %
                (where, ", ".join(meshes), "" if not sharded else
                 "; sharded parameters: %s" % ", ".join("%s over %s" % (lb, sh.dims) for lb, sh in zip(labels, shards)
                                                        if sh is not None and sh.dims), e.message),
                e.status) from e
        bindings = [_Binding(base + i, wheres[i], labels[i], tuple(p.shape), p.dtype, s.param, s.grad, shards[i])
                    for i, (p, s) in enumerate(zip(params, specs))]
        self._tensor_params.extend(params)
        self._tensor_bindings.extend(bindings)
        for p in params:
            # Every parameter has libdion state from now on: say so to torch.distributed.checkpoint, whose
            # state_dict helpers would otherwise "initialise" an empty optimizer.state with a zero-gradient step.
            self.state[p] = self.state.get(p) or {}
        return _GroupBinding(lib_group, algorithm, bindings, live, frozen)

    def _create_core(self, device: torch.device) -> None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            backend, dev = "cuda", torch.device("cuda", index)
        elif device.type == "cpu":
            index, backend, dev = 0, "host", torch.device("cpu")
        else:
            raise DionNotSupported("%s: parameters on %s are not supported (libdion has a host backend for CPU "
                                   "tensors and a CUDA backend)" % (self._name, device), L.DION_ERROR_NOT_SUPPORTED)
        # One libdion communicator per multi-rank mesh, in a fixed order on every rank (their creation is
        # collective): NCCL for CUDA parameters, MPI for CPU ones.
        comms: Dict[str, int] = {}
        acquired: List[int] = []
        try:
            for role in _D.ROLES:
                spec = self._meshes.get(role)
                if spec is None:
                    continue
                try:
                    h = _D.COMMS.acquire(spec, "cuda" if backend == "cuda" else "host", index, self._name)
                except DionNotSupported:
                    if spec.size > 1:
                        raise
                    # A mesh of one rank only carries Dion's orientation: without a communicator for it (CPU
                    # tensors without mpi4py, a libdion without MPI or NCCL) it is dropped.
                    self._meshes[role] = None
                    continue
                acquired.append(h)
                comms[_D.COMM_FIELDS[role]] = h
            self._core = _LibOptimizer(backend=backend, device=index, **self._lib_args, **comms)
        except BaseException:
            for h in acquired:
                _D.COMMS.release(h)
            raise
        self._comms = acquired
        self._device = dev

    def _check_param(self, p: torch.Tensor, label: str, algorithm: str, device: Optional[torch.device]) -> str:
        """Validates a parameter for libdion (on `device`) and returns its description for messages.

        A DTensor's global shape and dtype are described; its local shard is what must be dense.
        """
        dt = _is_dtensor(p)
        desc = "%s (%sshape %s, %s)" % (label, "DTensor, global " if dt else "", tuple(p.shape),
                                        str(p.dtype).replace("torch.", ""))
        t = _D.local_of(p)
        if t.is_sparse:
            raise DionInvalidArgument("%s is sparse; libdion takes dense tensors" % desc)
        if device is not None and t.device != device:
            raise DionInvalidArgument(
                "%s is on %s but the optimizer's parameters are on %s: all parameters of one libdion optimizer "
                "must be on one device (create one optimizer per device)" % (desc, t.device, device))
        if p.dtype not in _DTYPE_NAMES:
            raise DionInvalidArgument("%s: dtype %s is not supported by libdion (float32, bfloat16 or float16; "
                                      "convert the model, e.g. model.float())" % (desc, p.dtype))
        if p.dim() > L.DION_MAX_DIMS:
            raise DionInvalidArgument("%s has %d dims; libdion takes at most %d" % (desc, p.dim(), L.DION_MAX_DIMS))
        if not t.is_contiguous():
            raise DionInvalidArgument(
                "%s%s is not contiguous (strides %s): libdion updates parameters in place through their data "
                "pointer, so a strided view cannot be optimized; make it contiguous before creating the optimizer "
                "(p.data = p.data.contiguous())" % (desc, ": its local shard" if dt else "", tuple(t.stride())))
        if algorithm not in _SCALAR_ALGORITHMS:
            lo, hi = self._matrix_ndim
            if not lo <= p.dim() <= hi:
                need = "2-D matrices" if lo == hi else "tensors of %d to %d dims (matrices, or batches of them)" % (
                    lo, hi)
                raise DionInvalidArgument(
                    "%s has %d dim%s but algorithm %r takes %s: put it in a group with algorithm='lion' or "
                    "'adamw' (embeddings, norms, biases and the LM head belong there)"
                    % (desc, p.dim(), "" if p.dim() == 1 else "s", algorithm, need))
        return desc

    def _check_grad(self, p: torch.Tensor, g: torch.Tensor, label: str) -> torch.Tensor:
        """Validates a gradient and returns the tensor whose buffer libdion reads (a DTensor's local shard).

        A DTensor gradient placed otherwise than its parameter (a Partial sum, say) is redistributed to the
        parameter's placements first (a collective over its mesh, as every rank holds the same parameters) and
        becomes ``p.grad``.
        """
        if _is_dtensor(g) and _is_dtensor(p):
            kinds = tuple(_D.placement_kind(x) for x in p.placements)
            if not _D.same_placements(g.placements, kinds):
                if not hasattr(g, "redistribute"):
                    raise DionInvalidArgument("%s: the gradient's placements %s differ from the parameter's %s" %
                                              (label, tuple(g.placements), tuple(p.placements)))
                g = g.redistribute(p.device_mesh, p.placements)
                p.grad = g
        pl, gl = _D.local_of(p), _D.local_of(g)
        if gl.is_sparse:
            raise DionInvalidArgument("%s: the gradient is sparse; libdion takes dense gradients" % label)
        if gl.device != pl.device or gl.dtype != pl.dtype or gl.shape != pl.shape:
            raise DionInvalidArgument("%s: the gradient%s (%s, %s, shape %s) does not match the parameter%s" %
                                      (label, "'s local shard" if gl is not g else "", gl.device, gl.dtype,
                                       tuple(gl.shape), "'s (%s)" % (tuple(pl.shape),) if pl is not p else ""))
        if not gl.is_contiguous():
            raise DionInvalidArgument(
                "%s: the gradient is not contiguous (strides %s); libdion reads dense gradients through their data "
                "pointer (assign p.grad = p.grad.contiguous(), or keep the parameter contiguous so that autograd "
                "produces contiguous gradients)" % (label, tuple(gl.stride())))
        return gl

    # ---- per-step synchronisation ----

    def _capturing(self) -> bool:
        return self._device is not None and self._device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _stream(self) -> Optional[int]:
        if self._device is not None and self._device.type == "cuda":
            return torch.cuda.current_stream(self._device).cuda_stream
        return None

    def sync_hparams(self) -> None:
        """Pushes edited hyperparameters to libdion now (``step()`` does it too).

        For CUDA-graph replay: call it between replays after a scheduler
        changed ``lr`` (or ``weight_decay``, ``betas``), which a replayed step
        reads from libdion's device memory. When something changed it first
        waits for the device, so that no replay still in flight sees the new
        values (libdion writes them on the stream of its last call, which is
        not the one replays run on). Raises if a structural key changed.
        """
        self._sync_groups(capturing=False, wait_for_device=True)

    def _sync_groups(self, capturing: bool, wait_for_device: bool = False) -> None:
        if len(self._groups) != len(self.param_groups):
            raise DionInvalidUsage("%s: param_groups has %d groups but %d were added; add groups with "
                                   "add_param_group()" % (self._name, len(self.param_groups), len(self._groups)),
                                   L.DION_ERROR_INVALID_USAGE)
        pending: List[Tuple[_GroupBinding, str, float]] = []  # validated first, then pushed: all or nothing
        for gi, (group, gb) in enumerate(zip(self.param_groups, self._groups)):
            where = "%s: param_groups[%d]" % (self._name, gi)
            if "betas" in group:  # a later group["betas"] = (b1, b2) edit
                group["beta1"], group["beta2"] = _check_betas(group.pop("betas"), where)
            if len(group["params"]) != len(gb.bindings):
                raise DionInvalidUsage("%s: its 'params' list changed from %d to %d tensors; libdion groups are "
                                       "fixed once added: use add_param_group() for new parameters" %
                                       (where, len(gb.bindings), len(group["params"])), L.DION_ERROR_INVALID_USAGE)
            if self._algorithm_of(group, where) != gb.algorithm:
                raise DionInvalidUsage("%s: 'algorithm' changed from %r to %r; it is fixed once the group is "
                                       "created" % (where, gb.algorithm, group.get("algorithm")),
                                       L.DION_ERROR_INVALID_USAGE)
            values = self._lib_values(group)
            for key, old in gb.frozen.items():
                if values.get(key, old) != old:
                    raise DionInvalidUsage(
                        "%s: %r changed from %r to %r, but libdion fixes it when the group is created; only %s can "
                        "change between steps (create a new optimizer to change it)" %
                        (where, key, old, values[key], ", ".join(_LIVE_KEYS)), L.DION_ERROR_INVALID_USAGE)
            for key, old in gb.pushed.items():
                new = _as_float(values.get(key, old), "%s: %s" % (where, key))
                if new == old:
                    continue
                _check_hparams({key: new}, where)
                if capturing:
                    raise DionInvalidUsage(
                        "%s: %s changed from %r to %r during CUDA-graph capture; change hyperparameters outside "
                        "the capture (sync_hparams() between replays)" % (where, key, old, new),
                        L.DION_ERROR_INVALID_USAGE)
                pending.append((gb, key, new))
        if wait_for_device and pending and self.backend == "cuda":
            torch.cuda.synchronize(self._device)
        for gb, key, new in pending:
            if gb.lib_group is not None:
                self._core.set_hparam(gb.lib_group, key, new)
            gb.pushed[key] = new

    def _bind_tensors(self, capturing: bool) -> None:
        for group, gb in zip(self.param_groups, self._groups):
            for p, b in zip(group["params"], gb.bindings):
                pp = _D.local_of(p).data_ptr()
                if pp != b.param_ptr:  # p.data was replaced: check the new storage like a new parameter
                    self._check_param(p, b.where, gb.algorithm, self._device)
                    if tuple(p.shape) != b.shape or p.dtype != b.dtype:
                        raise DionInvalidArgument("%s: the parameter became %s %s; libdion keeps the shape and "
                                                  "dtype given when the group was created" %
                                                  (b.label, tuple(p.shape), p.dtype))
                    if (b.shard is None) != (not _is_dtensor(p)) or (
                            b.shard is not None and
                            _D.describe_dtensor(p, self._meshes, b.label).key() != b.shard.key()):
                        raise DionInvalidArgument("%s: the parameter's sharding changed; libdion keeps the layout "
                                                  "given when the group was created" % b.label)
                g = p.grad
                gp = None
                if g is not None:
                    gp = self._check_grad(p, g, b.label).data_ptr()
                if pp == b.param_ptr and gp == b.grad_ptr:
                    continue
                if capturing:
                    raise DionInvalidUsage(
                        "%s: its %s pointer changed since the last eager step, during CUDA-graph capture; a captured "
                        "step must use the buffers of the warm-up step (keep gradients allocated: "
                        "zero_grad(set_to_none=False))" % (b.label, "gradient" if pp == b.param_ptr else "parameter"),
                        L.DION_ERROR_INVALID_USAGE)
                self._core.rebind(b.tensor, pp, gp)
                b.param_ptr, b.grad_ptr = pp, gp

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimizer step over every group; returns the closure's loss (None without a closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._core is None:  # only empty groups
            return loss
        capturing = self._capturing()
        # Once a step was captured, replays may be in flight on another stream than libdion's last one:
        # hyperparameter writes then wait for the device first (as sync_hparams() always does).
        self._sync_groups(capturing, wait_for_device=self._captured)
        self._bind_tensors(capturing)
        self._core.step(self._stream())
        self._captured = self._captured or capturing
        return loss

    # ---- library queries ----

    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (``skip_nonfinite``); synchronises on CUDA."""
        return 0 if self._core is None else self._core.skipped_steps(self._stream())

    def memory_usage(self) -> Dict[str, int]:
        """Bytes libdion holds for this optimizer: ``{"state_bytes": ..., "workspace_bytes": ...}``."""
        return {"state_bytes": 0, "workspace_bytes": 0} if self._core is None else self._core.memory_usage()

    def synchronize_for_checkpoint(self) -> None:
        """Averages the decoupled states over the replicate mesh (``dion_sync_for_checkpoint``; collective).

        Call it on every rank before ``state_dict()`` when saving a checkpoint of a run with a replicate mesh:
        under compressed Dion each replica's momentum is its own, and a DCP checkpoint keeps one replica's copy.
        A no-op without a replicate mesh or with ``replicate_mesh_grad_sync=False`` (microsoft/dion's rule).
        """
        if self._core is not None:
            self._core.sync_for_checkpoint(self._stream())

    # ---- state ----

    def _read_states(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """Copies of every libdion state, per tensor index (enqueued on the current stream on CUDA)."""
        stream = self._stream()
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for info in self._core.states():
            t = torch.empty(info["local_shape"], dtype=_TORCH_DTYPES[info["dtype_code"]], device=self._device)
            self._core.read_state_into(info["index"], t.data_ptr(), info["local_bytes"], stream)
            out.setdefault(info["tensor"], {})[info["name"]] = self._as_saved(info, t)
        return out

    def _as_saved(self, info: Dict[str, Any], local: torch.Tensor) -> torch.Tensor:
        """A state as state_dict() gives it: the local tensor, or for a DTensor parameter a DTensor over its mesh."""
        sh = self._tensor_bindings[info["tensor"]].shard
        if sh is None:
            return local
        kinds = _D.state_kinds(sh, info["name"], info)
        return _D.to_dtensor(sh, local, kinds, info["global_shape"])

    def _state_local(self, value: torch.Tensor, info: Dict[str, Any], fn: str, label: str) -> torch.Tensor:
        """This rank's part of a checkpointed state, as a dense tensor of the state's local shape and dtype.

        Accepted: a DTensor of the state's global shape (from ``state_dict()`` of a sharded run, or DCP),
        redistributed when it is placed otherwise on the parameter's mesh, gathered (``full_tensor()``) when it
        comes from another mesh; a tensor of the local shape (``torch.save`` per rank); a tensor of the global
        shape (a full state dict, or a run on fewer ranks), of which this rank's window is taken.
        """
        name, lshape, gshape = info["name"], tuple(info["local_shape"]), tuple(info["global_shape"])
        sh = self._tensor_bindings[info["tensor"]].shard
        if _is_dtensor(value):
            if tuple(value.shape) != gshape:
                raise DionInvalidArgument("%s: state %r of %s has global shape %s in the checkpoint, %s here" %
                                          (fn, name, label, tuple(value.shape), gshape))
            if sh is not None and value.device_mesh is sh.mesh:
                kinds = _D.state_kinds(sh, name, info)
                if not _D.same_placements(value.placements, kinds):
                    if not hasattr(value, "redistribute"):
                        raise DionInvalidArgument("%s: state %r of %s has placements %s in the checkpoint, %s here" %
                                                  (fn, name, label, tuple(value.placements),
                                                   _D.placements_of(sh, kinds)))
                    value = value.redistribute(sh.mesh, _D.placements_of(sh, kinds))
            local = _D.local_of(value)
            if tuple(local.shape) not in (lshape, gshape) and hasattr(value, "full_tensor"):
                local = value.full_tensor()  # placed on another mesh: collective over that mesh
            value = local
        if tuple(value.shape) != lshape and tuple(value.shape) == gshape:
            for d, (off, n) in enumerate(zip(info["local_offset"], lshape)):
                value = value.narrow(d, off, n)
        if tuple(value.shape) != lshape:
            raise DionInvalidArgument("%s: state %r of %s has shape %s in the checkpoint, %s here" %
                                      (fn, name, label, tuple(value.shape), lshape))
        return value.detach().to(device=self._device, dtype=_TORCH_DTYPES[info["dtype_code"]],
                                 copy=True).contiguous()

    def state_dict(self) -> Dict[str, Any]:
        """torch's state_dict with ``state[p]`` = copies of libdion's states and ``param_groups[i]["step"]``.

        Rank-symmetric and without communication. States of a DTensor parameter are DTensors over its mesh
        (``_torch_dist.state_kinds`` gives their placements), so that torch.distributed.checkpoint saves each
        shard once and can reshard on load; other states are this rank's tensors.
        """
        if self._core is not None:
            for ti, states in self._read_states().items():
                self.state[self._tensor_params[ti]] = states
            for group, gb in zip(self.param_groups, self._groups):
                if gb.lib_group is not None:
                    group["step"] = self._core.step_count(gb.lib_group)
        return super().state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a ``state_dict()``: hyperparameters, libdion states (exact dtypes) and step counters.

        Everything is checked before anything changes: group count and sizes,
        the structural keys (``rank_fraction``, ``algorithm``, ...), and the
        presence and shape of every state libdion holds.
        """
        fn = "%s.load_state_dict" % self._name
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise DionInvalidArgument("%s: the checkpoint has %d parameter groups, this optimizer %d" %
                                      (fn, len(saved_groups), len(self.param_groups)))
        saved_ids: Dict[int, Any] = {}
        for gi, (group, saved, gb) in enumerate(zip(self.param_groups, saved_groups, self._groups)):
            if len(group["params"]) != len(saved["params"]):
                raise DionInvalidArgument("%s: param_groups[%d] has %d parameters in the checkpoint, %d here" %
                                          (fn, gi, len(saved["params"]), len(group["params"])))
            where = "%s: param_groups[%d]" % (fn, gi)
            saved = dict(saved)
            if "betas" in saved:
                saved["beta1"], saved["beta2"] = _check_betas(saved.pop("betas"), where)
            if self._algorithm_of(saved, where) != gb.algorithm:
                raise DionInvalidArgument("%s: algorithm %r in the checkpoint, %r here" %
                                          (where, saved.get("algorithm"), gb.algorithm))
            values = self._lib_values(saved)
            for key, old in gb.frozen.items():
                if values.get(key, old) != old:
                    raise DionInvalidArgument("%s: %r is %r in the checkpoint but %r here; it is fixed when the "
                                              "group is created" % (where, key, values[key], old))
            _check_hparams({k: v for k, v in values.items() if k in _LIVE_KEYS}, where)
            for i, (p, pid) in enumerate(zip(group["params"], saved["params"])):
                saved_ids[id(p)] = pid

        writes = []
        if self._core is not None:
            states = state_dict.get("state", {})
            for info in self._core.states():
                p = self._tensor_params[info["tensor"]]
                label = self._label_of(info["tensor"])
                value = states.get(saved_ids[id(p)], {}).get(info["name"])
                if not isinstance(value, torch.Tensor):
                    raise DionInvalidArgument("%s: the checkpoint has no %r state tensor for %s" %
                                              (fn, info["name"], label))
                writes.append((info, p, self._state_local(value, info, fn, label)))

        # The states are libdion's: torch's loader gets none of them (it would cast them to the parameter's
        # dtype and device, and keep what libdion does not hold).
        super().load_state_dict(dict(state_dict, state={}))
        if self._core is None:
            return
        stream = self._stream()
        for p in self._tensor_params:
            self.state[p] = {}
        for info, p, v in writes:
            self._core.write_state_from(info["index"], v.data_ptr(), info["local_bytes"], stream)
            self.state[p][info["name"]] = self._as_saved(info, v)
        for group, gb in zip(self.param_groups, self._groups):
            if gb.lib_group is not None and group.get("step") is not None:
                self._core.set_step(gb.lib_group, int(group["step"]))

    def _label_of(self, tensor: int) -> str:
        for gb in self._groups:
            for b in gb.bindings:
                if b.tensor == tensor:
                    return b.label
        return "tensor %d" % tensor

# --------------------------------------------------------------------------
# The optimizers (constructor signatures and group keys of microsoft/dion)
# --------------------------------------------------------------------------

ParamsT = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]

_COMMON_DOC = """
    Keyword-only libdion options: ``seed`` (counter-based generator of Dion's
    initial Q and sketches; the same seed gives the same run),
    ``skip_nonfinite`` (True: a step whose gradients hold NaN/Inf changes
    nothing, see ``skipped_steps()``), ``matmul_precision`` (``"fp32"``,
    ``"tf32"`` or ``"bf16"`` tensor cores on CUDA).
"""


def _orthogonalizer(where: str, use_polar_express: bool, use_gram_newton_schulz: bool,
                    newton_schulz_func: Optional[Callable]) -> str:
    if newton_schulz_func is not None:
        raise DionNotSupported("%s: newton_schulz_func cannot be used: libdion orthogonalizes inside the C library "
                               "(Polar Express, or Newton-Schulz with use_polar_express=False)" % where,
                               L.DION_ERROR_NOT_SUPPORTED)
    if use_gram_newton_schulz:
        raise DionNotSupported("%s: use_gram_newton_schulz is not implemented by libdion (use the default Polar "
                               "Express, or Newton-Schulz with use_polar_express=False)" % where,
                               L.DION_ERROR_NOT_SUPPORTED)
    return "polar_express" if use_polar_express else "newton_schulz"


class Dion(_LibdionOptimizer):
    __doc__ = """Dion (arXiv 2504.05295): low-rank orthonormal updates with error feedback, for 2-D matrices.

    Per matrix X (m x n) with momentum M and Q (b x r, r = rank), B = M or M^T
    so that B is tall::

        M += G;  P = orth(B Q);  R = B^T P;  M -= (1 - mu) P R^T
        Q = colnorm(R);  X = (1 - lr wd) X - lr sqrt(m/n) P Q^T

    ``algorithm="lion"`` / ``"adamw"`` groups use ``betas`` and ``epsilon``.
    Group keys: rank_fraction, rank_multiple_of, lr, mu, beta1, beta2,
    weight_decay, epsilon, oversample, algorithm, step. ``power_iters``,
    ``qr_method`` (``"rcqr"``, ``"qr"`` or ``"cqr"``; upstream's fast Dion
    accepts only rcqr and one power iteration, its reference all three) and
    ``cqr_warmup_steps`` apply to every group. ``mixed_precision_config``
    sets the state dtypes. Meshes (torch ProcessGroup, 1-D DeviceMesh or
    mpi4py communicator): ``replicate_mesh`` (DDP; with
    ``replicate_mesh_grad_sync`` libdion averages the gradients, or P and R
    when compressed), ``outer_shard_mesh`` (FSDP), ``inner_shard_mesh`` (TP);
    the working orientation follows the shard dims (spec §2.2).
    """ + _COMMON_DOC

    _algorithm = "dion"
    _matrix_ndim = (2, 2)

    def __init__(self, params: ParamsT,
                 replicate_mesh: Any = None,
                 outer_shard_mesh: Any = None,
                 inner_shard_mesh: Any = None,
                 replicate_mesh_grad_sync: bool = True,
                 rank_fraction: float = 1.0,
                 rank_multiple_of: int = 1,
                 lr: float = 0.01,
                 mu: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.01,
                 epsilon: float = 1e-8,
                 power_iters: int = 1,
                 qr_method: str = "rcqr",
                 cqr_warmup_steps: int = 150,
                 rcqr_oversample: float = 1.25,
                 mixed_precision_config: Optional[DionMixedPrecisionConfig] = None,
                 *, seed: int = 0, skip_nonfinite: bool = True, matmul_precision: str = "fp32"):
        where = "libdion.torch.Dion"
        beta1, beta2 = _check_betas(betas, where)
        defaults = dict(rank_fraction=rank_fraction, rank_multiple_of=rank_multiple_of, lr=lr, mu=mu, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, epsilon=epsilon, oversample=rcqr_oversample,
                        algorithm="dion", step=0)
        lib = dict(power_iters=power_iters, qr_method=qr_method, cqr_warmup_steps=cqr_warmup_steps,
                   matmul_precision=matmul_precision)
        if mixed_precision_config is not None:
            if not isinstance(mixed_precision_config, DionMixedPrecisionConfig):
                raise TypeError("%s: mixed_precision_config must be a DionMixedPrecisionConfig, got %s" %
                                (where, type(mixed_precision_config).__name__))
            lib.update(mixed_precision_config.libdion_options())
        _check_hparams(dict(defaults, **lib), where)
        self.mixed_precision_config = mixed_precision_config
        self._setup(params, defaults, lib_options=lib, replicate_grad_sync=replicate_mesh_grad_sync, seed=seed,
                    skip_nonfinite=skip_nonfinite,
                    meshes=dict(replicate=(replicate_mesh, "replicate_mesh"),
                                outer=(outer_shard_mesh, "outer_shard_mesh"),
                                inner=(inner_shard_mesh, "inner_shard_mesh")))


class Muon(_LibdionOptimizer):
    __doc__ = """Muon: SGD momentum, then an orthogonalized update (Polar Express by default).

    For each matrix (the last two dims; leading dims are a batch, or with
    ``flatten=True`` a tensor is one (shape[0], rest) matrix)::

        M = mu M + G;  U = orth(nesterov ? mu M + G : M)
        X = (1 - lr wd) X - adjust(lr) U      (cautious_wd: decay only where X U >= 0)

    ``adjust_lr``: ``"spectral_norm"`` (lr sqrt(fan_out/fan_in)), ``"rms_norm"``
    (lr 0.2 sqrt(max(fan_out, fan_in))) or None. Group keys: lr, mu, beta1,
    beta2, weight_decay, cautious_wd, algorithm, step, epsilon, nesterov,
    flatten, adjust_lr. ``distributed_mesh``: the FSDP mesh the parameters
    are sharded over (libdion's outer mesh), or a DDP group (its replicate
    mesh, gradients already averaged); NorMuon, Dion2 and NorDion2 alike.
    """ + _COMMON_DOC

    _algorithm = "muon"

    def __init__(self, params: ParamsT,
                 distributed_mesh: Any = None,
                 lr: float = 0.01,
                 mu: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: Union[float, torch.Tensor] = 0.01,
                 cautious_wd: bool = False,
                 epsilon: float = 1e-8,
                 nesterov: bool = False,
                 adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False,
                 use_gram_newton_schulz: bool = False,
                 use_triton: bool = False,
                 use_polar_express: bool = True,
                 newton_schulz_func: Optional[Callable] = None,
                 *, seed: int = 0, skip_nonfinite: bool = True, matmul_precision: str = "fp32"):
        where = "libdion.torch.%s" % type(self).__name__
        beta1, beta2 = _check_betas(betas, where)
        defaults = dict(lr=lr, mu=mu, beta1=beta1, beta2=beta2, weight_decay=weight_decay, cautious_wd=cautious_wd,
                        algorithm="muon", step=0, epsilon=epsilon, nesterov=nesterov, flatten=flatten,
                        adjust_lr=adjust_lr)
        lib = dict(orthogonalizer=_orthogonalizer(where, use_polar_express, use_gram_newton_schulz,
                                                  newton_schulz_func),
                   matmul_precision=matmul_precision)
        _check_hparams(dict(defaults, **lib), where)
        self._setup(params, defaults, lib_options=lib, replicate_grad_sync=True, seed=seed,
                    skip_nonfinite=skip_nonfinite, distributed_mesh=distributed_mesh)


class NorMuon(_LibdionOptimizer):
    __doc__ = """NorMuon: Muon with neuron-wise (row) normalization of the orthogonalized update.

    After U = orth(...) as in Muon: v = lerp(v, mean_j U_ij^2, 1 - muon_beta2)
    per row ("variance_neuron"), U' = U / (sqrt(v) + 1e-8) rescaled to
    ||U||_F, then the Muon update with U'. Group keys: Muon's plus muon_beta2.
    """ + _COMMON_DOC

    _algorithm = "normuon"

    def __init__(self, params: ParamsT,
                 distributed_mesh: Any = None,
                 lr: float = 0.01,
                 mu: float = 0.95,
                 muon_beta2: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: Union[float, torch.Tensor] = 0.01,
                 cautious_wd: bool = False,
                 epsilon: float = 1e-8,
                 nesterov: bool = False,
                 adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False,
                 use_gram_newton_schulz: bool = False,
                 use_triton: bool = False,
                 use_polar_express: bool = True,
                 newton_schulz_func: Optional[Callable] = None,
                 *, seed: int = 0, skip_nonfinite: bool = True, matmul_precision: str = "fp32"):
        where = "libdion.torch.%s" % type(self).__name__
        beta1, beta2 = _check_betas(betas, where)
        defaults = dict(lr=lr, mu=mu, muon_beta2=muon_beta2, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        cautious_wd=cautious_wd, algorithm="normuon", step=0, epsilon=epsilon, nesterov=nesterov,
                        flatten=flatten, adjust_lr=adjust_lr)
        lib = dict(orthogonalizer=_orthogonalizer(where, use_polar_express, use_gram_newton_schulz,
                                                  newton_schulz_func),
                   matmul_precision=matmul_precision)
        _check_hparams(dict(defaults, **lib), where)
        self._setup(params, defaults, lib_options=lib, replicate_grad_sync=True, seed=seed,
                    skip_nonfinite=skip_nonfinite, distributed_mesh=distributed_mesh)


class Dion2(_LibdionOptimizer):
    __doc__ = """Dion2: orthogonalize only the ``fraction`` of rows (or columns) of the momentum with largest L1 norm.

    Slices are taken along the shorter dim: M += G; I = top-k slices
    (k = ceil(fraction N)); S = M[I]; M[I] = ef_decay S;
    X = (1 - lr wd) X; X[I] -= adjust(lr) orth(S). Group keys: lr, ef_decay,
    fraction, beta1, beta2, weight_decay, epsilon, flatten, adjust_lr,
    algorithm, step, selection_scope.
    """ + _COMMON_DOC

    _algorithm = "dion2"

    def __init__(self, params: ParamsT,
                 distributed_mesh: Any = None,
                 lr: float = 0.01,
                 fraction: float = 0.25,
                 ef_decay: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: Union[float, torch.Tensor] = 0.01,
                 epsilon: float = 1e-8,
                 adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False,
                 use_triton: bool = False,
                 use_polar_express: bool = True,
                 use_gram_newton_schulz: bool = False,
                 newton_schulz_func: Optional[Callable] = None,
                 verbose: bool = False,
                 triton_post_ortho: bool = False,
                 selection_scope: str = "local",
                 *, seed: int = 0, skip_nonfinite: bool = True, matmul_precision: str = "fp32"):
        where = "libdion.torch.%s" % type(self).__name__
        beta1, beta2 = _check_betas(betas, where)
        defaults = dict(lr=lr, ef_decay=ef_decay, fraction=_as_float(fraction, where + ": fraction"), beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, epsilon=epsilon, flatten=flatten, adjust_lr=adjust_lr,
                        algorithm="dion2", step=0, selection_scope=selection_scope)
        lib = dict(orthogonalizer=_orthogonalizer(where, use_polar_express, use_gram_newton_schulz,
                                                  newton_schulz_func),
                   matmul_precision=matmul_precision)
        _check_hparams(dict(defaults, **lib), where)
        self._setup(params, defaults, lib_options=lib, replicate_grad_sync=True, seed=seed,
                    skip_nonfinite=skip_nonfinite, distributed_mesh=distributed_mesh)


class NorDion2(_LibdionOptimizer):
    __doc__ = """NorDion2 (alias ``Dion3``): Dion2 on rows (neurons) with NorMuon's normalization of the selected rows.

    ``mu`` is the error-feedback decay of the selected rows; ``muon_beta2``
    the decay of the per-row "variance_neuron". Group keys: lr, fraction, mu,
    muon_beta2, beta1, beta2, weight_decay, epsilon, flatten, adjust_lr,
    algorithm (``"nordion2"``; ``"dion3"`` is accepted), step, selection_scope.
    """ + _COMMON_DOC

    _algorithm = "nordion2"

    def __init__(self, params: ParamsT,
                 distributed_mesh: Any = None,
                 lr: float = 0.01,
                 fraction: float = 0.25,
                 mu: float = 0.95,
                 muon_beta2: float = 0.95,
                 betas: Tuple[float, float] = (0.9, 0.95),
                 weight_decay: Union[float, torch.Tensor] = 0.01,
                 epsilon: float = 1e-8,
                 adjust_lr: Optional[str] = "spectral_norm",
                 flatten: bool = False,
                 use_triton: bool = False,
                 use_polar_express: bool = True,
                 use_gram_newton_schulz: bool = False,
                 newton_schulz_func: Optional[Callable] = None,
                 triton_post_ortho: bool = False,
                 selection_scope: str = "local",
                 *, seed: int = 0, skip_nonfinite: bool = True, matmul_precision: str = "fp32"):
        where = "libdion.torch.%s" % type(self).__name__
        beta1, beta2 = _check_betas(betas, where)
        defaults = dict(lr=lr, fraction=_as_float(fraction, where + ": fraction"), mu=mu, muon_beta2=muon_beta2,
                        beta1=beta1, beta2=beta2, weight_decay=weight_decay, epsilon=epsilon, flatten=flatten,
                        adjust_lr=adjust_lr, algorithm="nordion2", step=0, selection_scope=selection_scope)
        lib = dict(orthogonalizer=_orthogonalizer(where, use_polar_express, use_gram_newton_schulz,
                                                  newton_schulz_func),
                   matmul_precision=matmul_precision)
        _check_hparams(dict(defaults, **lib), where)
        self._setup(params, defaults, lib_options=lib, replicate_grad_sync=True, seed=seed,
                    skip_nonfinite=skip_nonfinite, distributed_mesh=distributed_mesh)


Dion3 = NorDion2  # microsoft/dion exports Dion3 as the same class object
