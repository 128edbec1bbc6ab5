# SPDX-License-Identifier: MIT
"""Multi-rank support of ``libdion.torch``: meshes, libdion communicators and DTensor descriptors.

Nothing here computes an update. The module turns what a PyTorch program has
into what ``dion.h`` takes:

* an optimizer mesh argument (a ``torch.distributed`` ProcessGroup, a 1-D
  DeviceMesh, or an mpi4py communicator) into a ``MeshSpec``, and a
  ``MeshSpec`` into a ``dion_comm_t``: NCCL for CUDA parameters (rank 0 of the
  group draws the unique id, broadcast over the group with
  ``torch.distributed``), MPI for CPU parameters (the mpi4py communicator
  itself, or one split from ``MPI.COMM_WORLD`` with the group's ranks).
  Communicators are cached per (group, device) and reference counted: every
  optimizer over the same group shares one, destroyed when the last of them
  is closed;
* a DTensor parameter (FSDP2's ``fully_shard``, ``parallelize_module``,
  ``distribute_tensor``) into the shard fields of ``dion_tensor_t``: the
  global shape, and for each ``Shard(d)`` placement on a mesh dim of more
  than one rank, which optimizer mesh that mesh dim is (the one whose process
  group it is), the tensor dim, and this rank's offset and extent (torch's
  chunking: ceil(n / W) per rank, trailing shards short or empty);
* a libdion state of such a parameter into the placements of a DTensor of the
  same mesh (``state_placements``), so that ``state_dict()`` gives DCP
  (torch.distributed.checkpoint) sharded states.

DTensors are recognised by duck typing (``_local_tensor``, ``device_mesh``,
``placements``), placements by their ``is_shard()`` / ``is_replicate()`` /
``is_partial()`` methods, so the code runs on torch versions without DTensor
(the tests drive it with stand-ins there).
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys
import threading
from ctypes import byref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _lib as L
from ._lib import DionInvalidArgument, DionInvalidUsage, DionNotSupported, check, get_lib

ROLES = ("replicate", "outer", "inner")
# What each role is called in dion_options_t.
COMM_FIELDS = {"replicate": "replicate_comm", "outer": "outer_comm", "inner": "inner_comm"}

_MPI_HINT = ("install mpi4py (Debian: apt-get install python3-mpi4py; or pip install mpi4py, built against the MPI "
             "libdion links) and launch the ranks with mpirun")


# --------------------------------------------------------------------------
# torch.distributed and mpi4py, when present
# --------------------------------------------------------------------------

def _dist():
    """torch.distributed when it is built in, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return dist if dist.is_available() else None


def _is_mpi_comm(obj) -> bool:
    return type(obj).__module__.startswith("mpi4py") and hasattr(obj, "py2f") and hasattr(obj, "Get_size")


def _is_device_mesh(obj) -> bool:
    return hasattr(obj, "get_group") and hasattr(obj, "ndim") and hasattr(obj, "size")


def _is_process_group(obj) -> bool:
    dist = _dist()
    if dist is not None and isinstance(obj, getattr(dist, "ProcessGroup", ())):
        return True
    return callable(getattr(obj, "size", None)) and callable(getattr(obj, "rank", None)) and \
        not _is_device_mesh(obj) and not _is_mpi_comm(obj)


def _import_mpi(where: str):
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DionNotSupported(
            "%s: CPU parameters on a multi-rank mesh use libdion's host backend, which communicates over MPI, and "
            "mpi4py is not importable (%s): %s, or use CUDA parameters (NCCL)" % (where, e, _MPI_HINT),
            L.DION_ERROR_NOT_SUPPORTED) from e
    return MPI


def _mpi_world_ranks(comm) -> Optional[Tuple[int, ...]]:
    """The MPI_COMM_WORLD ranks of `comm`'s members in comm-rank order."""
    try:
        from mpi4py import MPI
        world = MPI.COMM_WORLD.Get_group()
        group = comm.Get_group()
        try:
            out = group.Translate_ranks(list(range(comm.Get_size())), world)
        finally:
            group.Free()
            world.Free()
        return tuple(int(r) for r in out)
    except Exception:  # noqa: BLE001 - an inter-communicator or a finalized MPI: unknown
        return None


def group_ranks(group) -> Optional[Tuple[int, ...]]:
    """Global ranks of a ProcessGroup / mpi4py communicator in group-rank order (None if unknown)."""
    if group is None:
        return None
    if _is_mpi_comm(group):
        return _mpi_world_ranks(group)
    dist = _dist()
    if dist is not None and isinstance(group, getattr(dist, "ProcessGroup", ())):
        try:
            return tuple(int(r) for r in dist.get_process_group_ranks(group))
        except Exception:  # noqa: BLE001 - a group this rank is not part of, an old torch
            return None
    ranks = getattr(group, "ranks", None)
    return tuple(int(r) for r in ranks) if ranks is not None else None


# --------------------------------------------------------------------------
# Optimizer meshes
# --------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class MeshSpec:
    """One multi-rank optimizer mesh.

    ``group`` is what libdion's communicator is built from: a torch
    ProcessGroup (``kind == "torch"``) or an mpi4py communicator
    (``kind == "mpi"``). ``ranks`` are its members' global ranks in group-rank
    order, when known (DTensor mesh dims are matched by identity or by them).
    """

    role: str
    arg: str
    obj: Any
    kind: str
    group: Any
    size: int
    rank: int
    ranks: Optional[Tuple[int, ...]]

    def describe(self) -> str:
        ranks = "" if self.ranks is None else ", ranks %s" % (list(self.ranks),)
        return "%s (%d ranks%s)" % (self.arg, self.size, ranks)


def mesh_spec(obj, role: str, arg: str, where: str, keep_one_rank: bool = False) -> Optional[MeshSpec]:
    """The MeshSpec of a mesh argument; None for None or a mesh of one rank.

    Accepted: a torch ProcessGroup, a torch DeviceMesh (1-D; an n-D mesh is
    flattened with ``DeviceMesh._flatten()``), an mpi4py communicator. Any
    object whose ``size()`` is 1 is accepted as "no mesh".

    With ``keep_one_rank`` a group of one rank (of those three kinds) still
    gets a MeshSpec (and no communicator): Dion's orientation follows the
    shard dims (spec §2.2), so a DTensor sharded over a mesh of one rank keeps
    the orientation it has over several ranks.
    """
    if obj is None:
        return None
    if _is_mpi_comm(obj):
        size, rank = int(obj.Get_size()), int(obj.Get_rank())
        if size == 1 and not keep_one_rank:
            return None
        return MeshSpec(role, arg, obj, "mpi", obj, size, rank, _mpi_world_ranks(obj))
    size_fn = getattr(obj, "size", None)
    if not callable(size_fn):
        raise TypeError("%s: %s must be None, a torch DeviceMesh, a ProcessGroup or an mpi4py communicator, got %s" %
                        (where, arg, type(obj).__name__))
    n = int(size_fn())
    if n == 1 and not (keep_one_rank and (_is_device_mesh(obj) or _is_process_group(obj))):
        return None
    if _is_device_mesh(obj):
        mesh = obj
        if int(mesh.ndim) != 1:
            flatten = getattr(mesh, "_flatten", None)
            if flatten is None:
                raise DionInvalidArgument("%s: %s is a %d-D DeviceMesh; pass a 1-D mesh (a sub-mesh such as "
                                          "mesh['dp'], or a ProcessGroup)" % (where, arg, int(mesh.ndim)))
            mesh = flatten()
        group = mesh.get_group(0)
        dist = _dist()
        rank = int(mesh.get_local_rank(0)) if hasattr(mesh, "get_local_rank") else int(dist.get_rank(group))
        return MeshSpec(role, arg, obj, "torch", group, n, rank, group_ranks(group))
    if _is_process_group(obj):
        return MeshSpec(role, arg, obj, "torch", obj, n, int(obj.rank()), group_ranks(obj))
    raise TypeError("%s: %s has %d ranks but is neither a torch DeviceMesh, a ProcessGroup nor an mpi4py "
                    "communicator (got %s)" % (where, arg, n, type(obj).__name__))


def mpi_importable() -> bool:
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError:
        return False
    return True


def check_distinct(meshes: Dict[str, Optional[MeshSpec]], where: str) -> None:
    """Two optimizer meshes over the same group are an error (libdion needs one communicator per mesh)."""
    specs = [m for m in meshes.values() if m is not None and m.size > 1]
    for i, a in enumerate(specs):
        for b in specs[i + 1:]:
            same = a.group is b.group or (a.ranks is not None and a.ranks == b.ranks)
            if same:
                raise DionInvalidArgument("%s: %s and %s are the same group of ranks; each libdion mesh (replicate, "
                                          "outer shard, inner shard) must be a different one" %
                                          (where, a.arg, b.arg))


def same_group(group, spec: MeshSpec) -> bool:
    if group is spec.group or group is spec.obj:
        return True
    ranks = group_ranks(group)
    return ranks is not None and spec.ranks is not None and tuple(ranks) == tuple(spec.ranks)


# --------------------------------------------------------------------------
# libdion communicators (cached per group and device, reference counted)
# --------------------------------------------------------------------------

class _CommCache:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_key: Dict[Tuple, List[Any]] = {}    # key -> [handle, refcount, group kept alive]
        self._key_of: Dict[int, Tuple] = {}          # handle -> key

    def acquire(self, spec: MeshSpec, backend: str, device: int, where: str) -> int:
        key = (backend, id(spec.group), device if backend == "cuda" else -1)
        with self._lock:
            entry = self._by_key.get(key)
            if entry is not None and entry[2] is spec.group:
                entry[1] += 1
                return entry[0]
        handle = _nccl_comm(spec, device, where) if backend == "cuda" else _mpi_comm(spec, where)
        with self._lock:
            self._by_key[key] = [handle, 1, spec.group]
            self._key_of[handle] = key
        return handle

    def release(self, handle: int) -> None:
        with self._lock:
            key = self._key_of.get(handle)
            if key is None:
                return
            entry = self._by_key[key]
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._by_key[key]
            del self._key_of[handle]
        get_lib().dion_comm_destroy(handle)

    def live(self) -> int:
        """Number of communicators alive (tests)."""
        with self._lock:
            return len(self._by_key)


COMMS = _CommCache()


def _nccl_comm(spec: MeshSpec, device: int, where: str) -> int:
    """A libdion NCCL communicator over `spec`'s group, on CUDA device `device` (collective over the group)."""
    if spec.kind != "torch":
        raise DionInvalidArgument(
            "%s: %s is an mpi4py communicator, but the parameters are CUDA tensors: libdion's CUDA backend "
            "communicates over NCCL; pass a torch ProcessGroup or DeviceMesh (its ranks' NCCL communicator is "
            "created from it)" % (where, spec.arg))
    dist = _dist()
    if spec.size > 1 and (dist is None or not dist.is_initialized()):
        raise DionInvalidUsage("%s: %s has %d ranks but torch.distributed is not initialized" %
                               (where, spec.arg, spec.size), L.DION_ERROR_INVALID_USAGE)
    lib = get_lib()
    uid = L.dion_nccl_unique_id_t()
    payload: List[Any] = [None]
    if spec.rank == 0:
        st = lib.dion_nccl_get_unique_id(byref(uid))
        if st == L.DION_SUCCESS:
            payload = [("ok", ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid)))]
        else:
            raw = lib.dion_last_error(None)
            payload = [("error", st, raw.decode("utf-8", "replace") if raw else "")]
    if spec.size > 1:
        src = spec.ranks[0] if spec.ranks else dist.get_global_rank(spec.group, 0)
        try:
            dist.broadcast_object_list(payload, src=src, group=spec.group, device=torch.device("cuda", device))
        except TypeError:  # torch without the device argument: uses the current device
            dist.broadcast_object_list(payload, src=src, group=spec.group)
    got = payload[0]
    if got[0] != "ok":
        raise L.error_for(int(got[1]), "%s: %s: rank 0 could not create the NCCL unique id: %s" %
                          (where, spec.describe(), got[2]))
    ctypes.memmove(ctypes.addressof(uid), got[1], ctypes.sizeof(uid))
    comm = L.dion_comm_t()
    check(lib.dion_comm_init_nccl(byref(comm), byref(uid), spec.size, spec.rank, int(device)))
    return comm.value


def _mpi_comm(spec: MeshSpec, where: str) -> int:
    """A libdion MPI communicator over `spec` (collective over it; over MPI_COMM_WORLD when split from it)."""
    lib = get_lib()
    created = None
    if spec.kind == "mpi":
        comm = spec.group
    elif spec.size == 1:
        comm = _import_mpi(where).COMM_SELF
    else:
        MPI = _import_mpi(where)
        dist = _dist()
        world = MPI.COMM_WORLD
        if dist is None or not dist.is_initialized() or dist.get_world_size() != world.Get_size() or \
                dist.get_rank() != world.Get_rank():
            raise DionInvalidUsage(
                "%s: %s is a torch process group, and CPU parameters need an MPI communicator over the same ranks; "
                "it is split from MPI.COMM_WORLD, which needs torch.distributed's ranks to be MPI's (torch rank %s "
                "of %s, MPI rank %d of %d): launch with mpirun and initialise torch.distributed with "
                "RANK = OMPI_COMM_WORLD_RANK, or pass mpi4py communicators as the meshes" %
                (where, spec.arg, dist.get_rank() if dist and dist.is_initialized() else "?",
                 dist.get_world_size() if dist and dist.is_initialized() else "?", world.Get_rank(),
                 world.Get_size()), L.DION_ERROR_INVALID_USAGE)
        ranks = list(spec.ranks) if spec.ranks is not None else None
        if ranks is None:
            raise DionInvalidUsage("%s: the ranks of %s are unknown" % (where, spec.arg), L.DION_ERROR_INVALID_USAGE)
        if ranks == list(range(world.Get_size())):
            comm = world
        else:
            # Collective over MPI_COMM_WORLD: every rank constructs the optimizer (true of DeviceMesh dims,
            # whose groups partition the world).
            comm = created = world.Split(min(ranks), ranks.index(world.Get_rank()))
    out = L.dion_comm_t()
    try:
        st = lib.dion_comm_from_mpi_fint(byref(out), int(comm.py2f()))
        check(st)
    finally:
        if created is not None:
            created.Free()  # libdion duplicated it
    return out.value


# --------------------------------------------------------------------------
# DTensor parameters
# --------------------------------------------------------------------------

def is_dtensor(t) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if type(t).__name__ == "DTensor":
        return True
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh") and hasattr(t, "placements")


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise); no autograd edge, no communication."""
    if not is_dtensor(t):
        return t
    loc = getattr(t, "_local_tensor", None)
    if loc is None:
        with torch.no_grad():
            loc = t.to_local()
    return loc


def placement_kind(pl) -> Tuple[str, Optional[int]]:
    """("shard", dim), ("replicate", None), ("partial", None), ("strided", dim) or ("unknown", None)."""
    name = type(pl).__name__
    if name == "_StridedShard" or hasattr(pl, "split_factor"):
        return "strided", getattr(pl, "dim", None)
    try:
        if pl.is_partial():
            return "partial", None
    except Exception:  # noqa: BLE001
        pass
    try:
        if pl.is_replicate():
            return "replicate", None
    except Exception:  # noqa: BLE001
        pass
    try:
        if pl.is_shard():
            dim = getattr(pl, "dim", None)
            if isinstance(dim, int):
                return "shard", dim
    except Exception:  # noqa: BLE001
        pass
    return "unknown", None


def _coordinate(mesh, i: int) -> int:
    get_local_rank = getattr(mesh, "get_local_rank", None)
    if callable(get_local_rank):
        return int(get_local_rank(i))
    return int(mesh.get_coordinate()[i])


def chunk(n: int, world: int, index: int) -> Tuple[int, int]:
    """(offset, extent) of chunk `index` of a dim of `n` over `world` ranks (torch.chunk: ceil(n / world) each)."""
    size = -(-n // world) if world > 0 else n
    off = min(index * size, n)
    return off, max(0, min(n, off + size) - off)


def chunked_layout(global_shape: Sequence[int], mesh, kinds: Sequence[Tuple[str, Optional[int]]]):
    """(local shape, global offset) of this rank for placements given as kinds (shard/replicate only)."""
    shape = [int(x) for x in global_shape]
    offset = [0] * len(shape)
    for i, (kind, dim) in enumerate(kinds):
        if kind != "shard":
            continue
        off, ext = chunk(shape[dim], int(mesh.size(i)), _coordinate(mesh, i))
        offset[dim] += off
        shape[dim] = ext
    return tuple(shape), tuple(offset)


def _torch_layout(global_shape, mesh, placements):
    """torch's own (local shape, global offset), or None where it is not available (older torch, stand-ins)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        try:
            from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
        except ImportError:
            return None
    try:
        shape, offset = compute_local_shape_and_global_offset(torch.Size(global_shape), mesh, placements)
    except Exception:  # noqa: BLE001 - not a real DeviceMesh (stand-ins)
        return None
    return tuple(int(x) for x in shape), tuple(int(x) for x in offset)


@dataclasses.dataclass
class ShardInfo:
    """How a DTensor parameter is laid out over the optimizer's meshes."""

    mesh: Any
    placements: Tuple[Any, ...]
    kinds: Tuple[Tuple[str, Optional[int]], ...]
    global_shape: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    roles: Dict[int, str]            # mesh dim -> "outer" / "inner" (Shard placements over > 1 rank)
    dims: Dict[str, int]             # "outer" / "inner" -> tensor dim
    cls: Any                         # the DTensor class (from_local)

    def fields(self) -> Dict[str, int]:
        """The shard fields of dion_tensor_t (TensorSpec keywords)."""
        out: Dict[str, int] = {}
        for role in ("outer", "inner"):
            d = self.dims.get(role, -1)
            out["%s_shard_dim" % role] = d
            out["%s_offset" % role] = self.offset[d] if d >= 0 else 0
            out["%s_extent" % role] = self.local_shape[d] if d >= 0 else 0
        return out

    def key(self) -> Tuple:
        return (self.kinds, self.global_shape, self.local_shape, self.offset, tuple(sorted(self.dims.items())))


def describe_dtensor(p: torch.Tensor, meshes: Dict[str, Optional[MeshSpec]], label: str) -> ShardInfo:
    """The ShardInfo of a DTensor parameter; errors name the parameter and what to do."""
    mesh = p.device_mesh
    placements = tuple(p.placements)
    gshape = tuple(int(x) for x in p.shape)
    nd = len(gshape)
    local = local_of(p)
    if len(placements) != int(mesh.ndim):
        raise DionInvalidArgument("%s: a DTensor with %d placements on a %d-D mesh" %
                                  (label, len(placements), int(mesh.ndim)))
    kinds: List[Tuple[str, Optional[int]]] = []
    roles: Dict[int, str] = {}
    dims: Dict[str, int] = {}
    available = ", ".join(m.describe() for m in meshes.values() if m is not None) or "none: all are None or 1 rank"
    for i, pl in enumerate(placements):
        kind, dim = placement_kind(pl)
        if kind == "strided" and int(mesh.size(i)) == 1:
            kinds.append((kind, dim))  # one rank: the dim is whole (FSDP2 x TP with a data-parallel degree of 1)
            continue
        if kind == "strided":
            raise DionNotSupported(
                "%s: placement %r on mesh dim %d is a _StridedShard (FSDP2 sharding the dim tensor parallelism "
                "already shards): libdion shards each dim over at most one mesh and needs contiguous chunks. Shard "
                "another dim with FSDP2 (fully_shard(..., shard_placement_fn=lambda p: Shard(1)) for column-wise "
                "parallel weights)" % (label, pl, i), L.DION_ERROR_NOT_SUPPORTED)
        if kind == "partial":
            raise DionInvalidArgument("%s: placement %r on mesh dim %d is Partial (pending reduction); optimizer "
                                      "parameters must be Shard or Replicate" % (label, pl, i))
        if kind == "unknown":
            raise DionNotSupported("%s: placement %r on mesh dim %d is not supported by libdion (Shard(d) with "
                                   "torch's even chunking, or Replicate)" % (label, pl, i), L.DION_ERROR_NOT_SUPPORTED)
        if kind == "shard":
            if not -nd <= dim < nd:
                raise DionInvalidArgument("%s: placement %r on mesh dim %d: dim out of range for %d dims" %
                                          (label, pl, i, nd))
            dim %= nd
        kinds.append((kind, dim))
        if kind != "shard":
            continue
        group = mesh.get_group(i)
        one = int(mesh.size(i)) == 1
        cands = [r for r, m in meshes.items() if m is not None and (m.size == 1) == one and same_group(group, m)]
        role = next((r for r in cands if meshes[r].group is group or meshes[r].obj is group), cands[0] if cands else None)
        if one and role in (None, "replicate"):
            continue  # a whole dim: nothing to tell libdion
        if role is None:
            raise DionInvalidArgument(
                "%s is sharded (%r) over mesh dim %d (%d ranks%s), which is none of the optimizer's meshes (%s): "
                "pass that mesh (e.g. mesh[%r]) as the optimizer's outer_shard_mesh / inner_shard_mesh "
                "(distributed_mesh for Muon, NorMuon, Dion2, NorDion2)" %
                (label, pl, i, int(mesh.size(i)), "" if group_ranks(group) is None else
                 ", ranks %s" % (list(group_ranks(group)),), available,
                 (mesh.mesh_dim_names[i] if getattr(mesh, "mesh_dim_names", None) else i)))
        if role == "replicate":
            raise DionInvalidArgument(
                "%s is sharded (%r) over mesh dim %d, which is the optimizer's replicate mesh (%s): a replicate mesh "
                "holds whole copies; give that mesh as a shard mesh instead" %
                (label, pl, i, meshes["replicate"].describe()))
        if role in dims:
            raise DionInvalidArgument("%s: two mesh dims of its DTensor are the optimizer's %s mesh" % (label, role))
        if dim in dims.values():
            raise DionNotSupported("%s: tensor dim %d is sharded over two mesh dims (%s); libdion shards a dim over "
                                   "at most one mesh" % (label, dim, placements), L.DION_ERROR_NOT_SUPPORTED)
        roles[i] = role
        dims[role] = dim
    mine = chunked_layout(gshape, mesh, kinds)
    theirs = _torch_layout(gshape, mesh, placements) if type(p).__name__ == "DTensor" else None
    lshape, offset = theirs if theirs is not None else mine
    if tuple(local.shape) != lshape or (theirs is not None and theirs != mine):
        raise DionNotSupported(
            "%s: its local shard has shape %s but torch's chunking of the global shape %s over %s gives %s at "
            "offset %s: libdion takes Shard placements with torch's chunking only (ceil(n / W) per rank, trailing "
            "shards short or empty)" % (label, tuple(local.shape), gshape, placements, mine[0], mine[1]),
            L.DION_ERROR_NOT_SUPPORTED)
    return ShardInfo(mesh, placements, tuple(kinds), gshape, lshape, offset, roles, dims, type(p))


# --------------------------------------------------------------------------
# States of DTensor parameters as DTensors
# --------------------------------------------------------------------------

def state_kinds(info: ShardInfo, name: str, state: Dict[str, Any]) -> Tuple[Tuple[str, Optional[int]], ...]:
    """Placements (as kinds) of libdion state `name` of a DTensor parameter over the parameter's mesh.

    * a state of the parameter's shape (momentum, variance): the parameter's placements;
    * Dion's ``Q`` (b x r): its rows follow B's columns, the dim the outer mesh shards (spec §2.2), so
      ``Shard(0)`` on the outer mesh dim and ``Replicate`` elsewhere (libdion keeps r whole on the inner mesh,
      unlike upstream's Shard(1));
    * a state with the parameter's dims, some collapsed to 1 (NorMuon's per-row ``variance_neuron``):
      the parameter's Shard placements on the dims it keeps, Replicate on the collapsed ones;
    * ``variance_neuron`` of a flattened (``flatten=True``) tensor of ndim >= 3, (shape[0], 1): Shard(0) where
      the parameter is sharded on dim 0.

    The result is checked against libdion's own local offset and shape of the state on this rank; a state
    that does not fit raises (rather than being saved as something DCP would misread).
    """
    gshape = tuple(state["global_shape"])
    nd_p = len(info.global_shape)
    out: List[Tuple[str, Optional[int]]] = []
    for i, (kind, dim) in enumerate(info.kinds):
        sharded = i in info.roles
        if name == "Q" and len(gshape) == 2 and nd_p == 2:
            out.append(("shard", 0) if info.roles.get(i) == "outer" else ("replicate", None))
        elif gshape == info.global_shape:
            out.append((kind, dim))
        elif len(gshape) == nd_p:
            if not sharded or gshape[dim] == 1:
                out.append(("replicate", None))
            elif gshape[dim] == info.global_shape[dim]:
                out.append(("shard", dim))
            else:
                out.append(("unknown", dim))
        elif len(gshape) == 2 and nd_p >= 3 and gshape == (info.global_shape[0], 1):
            out.append(("shard", 0) if sharded and dim == 0 else ("replicate", None))
        else:
            out.append(("unknown", dim))
    kinds = tuple(out)
    if any(k == "unknown" for k, _ in kinds) or \
            chunked_layout(gshape, info.mesh, kinds) != (tuple(state["local_shape"]), tuple(state["local_offset"])):
        raise DionInvalidUsage(
            "state %r (global %s, local %s at %s) of a DTensor parameter %s with placements %s cannot be described "
            "as a DTensor of the parameter's mesh" % (name, gshape, tuple(state["local_shape"]),
                                                     tuple(state["local_offset"]), info.global_shape, info.placements),
            L.DION_ERROR_INVALID_USAGE)
    return kinds


def _placement_types(info: ShardInfo):
    """(Shard, Replicate) classes of the parameter's placements' module (torch's, or a stand-in's)."""
    for pl in info.placements:
        mod = sys.modules.get(type(pl).__module__)
        shard, rep = getattr(mod, "Shard", None), getattr(mod, "Replicate", None)
        if shard is not None and rep is not None:
            return shard, rep
    try:
        from torch.distributed.tensor import Replicate, Shard
    except ImportError:  # torch < 2.4
        from torch.distributed._tensor import Replicate, Shard
    return Shard, Replicate


def placements_of(info: ShardInfo, kinds) -> Tuple[Any, ...]:
    if kinds == info.kinds:
        return info.placements
    shard, rep = _placement_types(info)
    return tuple(shard(d) if k == "shard" else rep() for k, d in kinds)


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def to_dtensor(info: ShardInfo, local: torch.Tensor, kinds, global_shape) -> torch.Tensor:
    """A DTensor over the parameter's mesh from this rank's shard (no communication)."""
    with torch.no_grad():
        return info.cls.from_local(local, info.mesh, placements_of(info, kinds), run_check=False,
                                   shape=torch.Size(global_shape), stride=contiguous_stride(global_shape))


def same_placements(a, kinds) -> bool:
    return tuple(placement_kind(p) for p in a) == tuple(kinds)
