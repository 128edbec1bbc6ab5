# SPDX-License-Identifier: MIT
"""Stand-ins for torch.distributed's DTensor, DeviceMesh and placements.

Debian's torch (1.13) has no DTensor, so the CPU tests drive libdion.torch's
DTensor path with these: ``FakeDTensor`` is a wrapper tensor subclass (as
DTensor is) of the GLOBAL shape holding ``_local_tensor``, ``device_mesh`` and
``placements``; its ``from_local`` has DTensor's signature. It supports no
tensor operation: libdion.torch only reads its metadata and local shard.
``FakeMesh`` answers what a DeviceMesh answers (``ndim``, ``size(dim)``,
``get_group(dim)``, ``get_local_rank(dim)``); its groups are whatever the test
gives (an mpi4py communicator, or a ``FakeGroup`` with global ranks).
The real classes are exercised by tests/torchrun on GPUs.
"""
import torch


class Placement:
    def is_shard(self, dim=None):
        return False

    def is_replicate(self):
        return False

    def is_partial(self):
        return False


class Shard(Placement):
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def __eq__(self, other):
        return type(other) is Shard and other.dim == self.dim

    def __hash__(self):
        return hash(("Shard", self.dim))

    def __repr__(self):
        return "Shard(dim=%d)" % self.dim


class _StridedShard(Shard):
    def __init__(self, dim, split_factor):
        super().__init__(dim)
        self.split_factor = split_factor

    def __repr__(self):
        return "_StridedShard(dim=%d, sf=%d)" % (self.dim, self.split_factor)


class Replicate(Placement):
    def is_replicate(self):
        return True

    def __eq__(self, other):
        return type(other) is Replicate

    def __hash__(self):
        return hash("Replicate")

    def __repr__(self):
        return "Replicate()"


class Partial(Placement):
    def is_partial(self):
        return True

    def __repr__(self):
        return "Partial(sum)"


class FakeGroup:
    """A process group known by its global ranks."""

    def __init__(self, ranks):
        self.ranks = tuple(ranks)

    def size(self):
        return len(self.ranks)


class FakeMesh:
    """A DeviceMesh: one (group, size, this rank's coordinate) per mesh dim."""

    device_type = "cpu"

    def __init__(self, dims, names=None):
        self.dims = [tuple(d) for d in dims]
        self.mesh_dim_names = tuple(names) if names else None

    @property
    def ndim(self):
        return len(self.dims)

    def size(self, mesh_dim=None):
        if mesh_dim is None:
            n = 1
            for _, s, _ in self.dims:
                n *= s
            return n
        return self.dims[mesh_dim][1]

    def get_group(self, mesh_dim=0):
        return self.dims[mesh_dim][0]

    def get_local_rank(self, mesh_dim=0):
        return self.dims[mesh_dim][2]

    def get_coordinate(self):
        return [c for _, _, c in self.dims]


def chunk_of(t, mesh, placements):
    """This rank's shard of a global tensor (torch.chunk semantics: ceil(n / W) per rank, trailing ones short)."""
    out = t
    for i, pl in enumerate(placements):
        if isinstance(pl, Shard):
            pieces = torch.chunk(out, mesh.size(i), dim=pl.dim)
            c = mesh.get_local_rank(i)
            if c < len(pieces):
                out = pieces[c]
            else:
                shape = list(out.shape)
                shape[pl.dim] = 0
                out = out.new_empty(shape)
    return out.contiguous()


class FakeDTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, local, mesh, placements, shape, requires_grad=False):
        r = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=local.dtype, device=local.device,
                                                requires_grad=requires_grad)
        r._local_tensor = local
        r.device_mesh = mesh
        r.placements = tuple(placements)
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError("FakeDTensor supports no operation (%s)" % func)

    @staticmethod
    def from_local(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None, stride=None):
        assert not run_check and shape is not None
        return FakeDTensor(local_tensor, device_mesh, placements, shape)


def distribute(global_tensor, mesh, placements, requires_grad=True):
    """A leaf FakeDTensor parameter holding this rank's chunk of `global_tensor`."""
    return FakeDTensor(chunk_of(global_tensor.detach(), mesh, placements).clone(), mesh, placements,
                       global_tensor.shape, requires_grad=requires_grad)


def grad_of(param, global_grad):
    """A FakeDTensor gradient for `param` from the global gradient."""
    return FakeDTensor(chunk_of(global_grad, param.device_mesh, param.placements).clone(), param.device_mesh,
                       param.placements, global_grad.shape)
