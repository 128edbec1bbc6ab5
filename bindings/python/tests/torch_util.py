# SPDX-License-Identifier: MIT
"""Helpers of the libdion.torch tests (import after ``pytest.importorskip("torch")``)."""
import numpy as np
import torch

import libdion

ALGORITHMS = ("dion", "dion2", "muon", "normuon", "nordion2")


def classes():
    """Algorithm name -> libdion.torch class."""
    import libdion.torch as lt
    return {"dion": lt.Dion, "dion2": lt.Dion2, "muon": lt.Muon, "normuon": lt.NorMuon, "nordion2": lt.NorDion2}


def param(shape, gen, scale=1.0, dtype=torch.float32, device="cpu"):
    """A leaf tensor requiring grad, N(0, scale^2), drawn from `gen` (a CPU generator)."""
    t = scale * torch.randn(shape, generator=gen, dtype=torch.float64)
    return torch.nn.Parameter(t.to(dtype=dtype, device=device))


def randn_like(p, gen, scale=1.0):
    return (scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(dtype=p.dtype, device=p.device)


def state(opt, index, name):
    """State `name` of the index-th parameter (in group order), as float64, through state_dict()."""
    return opt.state_dict()["state"][index][name].double().cpu()


def rel_err(a, b):
    """max |a - b| / max |b| (absolute when b is zero)."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / scale if scale > 0 else err


def align_signs(q, ref):
    """q with each column's sign flipped to match ref (QR bases are unique up to column signs)."""
    s = torch.sign((q * ref).sum(dim=0))
    s[s == 0] = 1
    return q * s


def to_numpy(t):
    """A CPU tensor as the numpy array the ctypes layer takes (bf16 as uint16 bits)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    return t.numpy().copy()


def from_numpy(a, dtype):
    """Inverse of to_numpy."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def cuda_backend_available():
    """True when torch sees a GPU and the loaded libdion has its CUDA backend."""
    if not torch.cuda.is_available():
        return False
    try:
        libdion.Optimizer(backend="cuda").close()
    except libdion.DionError:
        return False
    return True
