# SPDX-License-Identifier: MIT
"""Every error path of libdion.torch: a DionError (ValueError / RuntimeError / NotImplementedError
subclass) whose message names the parameter or option and says what to do."""
import pytest

torch = pytest.importorskip("torch", reason="libdion.torch tests need PyTorch (apt-get install python3-torch)")

import libdion  # noqa: E402
import libdion.torch as lt  # noqa: E402
from torch_util import ALGORITHMS, classes, param, randn_like  # noqa: E402


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(5)


class FakeMesh:
    """Anything with size() and nothing else: neither a DeviceMesh, a ProcessGroup nor an mpi4py communicator."""

    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ALGORITHMS)
def test_float64_parameters_are_rejected(gen, algo):
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    with pytest.raises(libdion.DionInvalidArgument,
                       match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(8, 8\), float64\): dtype torch.float64 "
                             r"is not supported by libdion \(float32, bfloat16 or float16"):
        classes()[algo]([p])


def test_the_error_is_a_value_error_too(gen):
    with pytest.raises(ValueError):
        lt.Muon([torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))])


def test_non_contiguous_parameter(gen):
    p = torch.nn.Parameter(torch.randn(8, 6).t())
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] \(shape \(6, 8\), float32\) is not contiguous "
                                         r"\(strides \(1, 6\)\).*make it contiguous"):
        lt.Muon([p])


def test_non_contiguous_gradient(gen):
    p = param((6, 6), gen)
    opt = lt.Muon([p])
    p.grad = torch.randn(6, 6).t()
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] .*: the gradient is not contiguous \(strides \(1, 6\)\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_sparse_gradient(gen):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = lt.Muon([dict(params=emb.parameters(), algorithm="lion")])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="the gradient is sparse; libdion takes dense gradients"):
        opt.step()


def test_mixed_devices(gen):
    with pytest.raises(ValueError, match=r"params'\]\[1\] \(shape \(4, 4\), float32\) is on meta but the optimizer's "
                                         r"parameters are on cpu: all parameters of one libdion optimizer must be on "
                                         r"one device"):
        lt.Muon([param((4, 4), gen), torch.nn.Parameter(torch.empty(4, 4, device="meta"))])
    opt = lt.Muon([param((4, 4), gen)])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] .* is on meta"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.empty(3, device="meta"))], algorithm="lion"))
    assert len(opt.param_groups) == 1  # the failed group was not kept


def test_unsupported_device():
    with pytest.raises(NotImplementedError, match="parameters on meta are not supported"):
        lt.Muon([torch.nn.Parameter(torch.empty(4, 4, device="meta"))])


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_a_vector_in_a_matrix_group_names_the_scalar_algorithms(gen, algo):
    with pytest.raises(libdion.DionInvalidArgument,
                       match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(8,\), float32\) has 1 dim but algorithm "
                             r"'%s' takes .*: put it in a group with algorithm='lion' or 'adamw'" % algo):
        classes()[algo]([param((8, 8), gen), param((8,), gen)])


def test_dion_takes_only_2d_matrices(gen):
    with pytest.raises(ValueError, match=r"shape \(2, 4, 4\), float32\) has 3 dims but algorithm 'dion' takes 2-D "
                                         r"matrices"):
        lt.Dion([param((2, 4, 4), gen)])
    lt.Muon([param((2, 4, 4), gen)])  # a batch of matrices is fine for the Muon family


def test_five_dims_are_too_many(gen):
    with pytest.raises(ValueError, match="has 5 dims; libdion takes at most 4"):
        lt.Muon([dict(params=[param((1, 1, 2, 2, 2), gen)], algorithm="lion")])


def test_unknown_algorithm(gen):
    with pytest.raises(ValueError, match=r"param_groups\[0\]: unknown algorithm 'muon' for Dion \(use 'dion', "
                                         r"'adamw' or 'lion'\)"):
        lt.Dion([dict(params=[param((4, 4), gen)], algorithm="muon")])
    with pytest.raises(ValueError, match="unknown algorithm 'sgd' for Muon"):
        lt.Muon([dict(params=[param((4, 4), gen)], algorithm="sgd")])


# --------------------------------------------------------------------------
# Hyperparameters
# --------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kw,msg", [
    (lt.Dion, dict(lr=-1.0), r"libdion.torch.Dion: invalid lr = -1.0 \(must be a finite number >= 0\)"),
    (lt.Dion, dict(mu=-0.5), "invalid mu = -0.5"),
    (lt.Dion, dict(weight_decay=-0.1), "invalid weight_decay = -0.1"),
    (lt.Dion, dict(betas=(0.9,)), r"invalid betas = \(0.9,\) \(must be a pair"),
    (lt.Dion, dict(betas=(0.9, -0.1)), "invalid beta2 = -0.1"),
    (lt.Dion, dict(rank_fraction=0.0), r"invalid rank_fraction = 0.0 \(must be in \(0, 1\]\)"),
    (lt.Dion, dict(rank_fraction=1.5), "invalid rank_fraction = 1.5"),
    (lt.Dion, dict(rank_multiple_of=0), "invalid rank_multiple_of = 0"),
    (lt.Dion, dict(power_iters=0), "invalid power_iters = 0"),
    (lt.Dion, dict(qr_method="svd"), "invalid qr_method = 'svd'"),
    (lt.Dion, dict(rcqr_oversample=0.5), "invalid oversample = 0.5"),
    (lt.Muon, dict(adjust_lr="max"), "invalid adjust_lr = 'max'"),
    (lt.Muon, dict(lr=float("nan")), "invalid lr = nan"),
    (lt.NorMuon, dict(muon_beta2=-1.0), "invalid muon_beta2 = -1.0"),
    (lt.Dion2, dict(fraction=0.0), r"invalid fraction = 0.0 \(must be in \(0, 1\]\)"),
    (lt.Dion2, dict(ef_decay=-1.0), "invalid ef_decay = -1.0"),
    (lt.Dion2, dict(selection_scope="world"), "invalid selection_scope = 'world'"),
    (lt.NorDion2, dict(fraction=2.0), "invalid fraction = 2.0"),
])
def test_constructor_validation(gen, cls, kw, msg):
    with pytest.raises(ValueError, match=msg):
        cls([param((4, 4), gen)], **kw)


def test_group_values_are_validated_too(gen):
    with pytest.raises(ValueError, match=r"param_groups\[1\]: invalid lr = -0.1"):
        lt.Muon([dict(params=[param((4, 4), gen)]), dict(params=[param((4,), gen)], algorithm="lion", lr=-0.1)])


def test_mixed_precision_config_errors(gen):
    cfg = lt.DionMixedPrecisionConfig(momentum_dtype=torch.float64)
    with pytest.raises(ValueError, match="momentum_dtype = torch.float64 is not supported by libdion"):
        lt.Dion([param((4, 4), gen)], mixed_precision_config=cfg)
    with pytest.raises(TypeError, match="mixed_precision_config must be a DionMixedPrecisionConfig"):
        lt.Dion([param((4, 4), gen)], mixed_precision_config=dict(momentum_dtype=torch.bfloat16))


def test_bad_edits_are_rejected_at_the_next_step_before_anything_changes(gen):
    p = param((8, 8), gen)
    opt = lt.Muon([p])
    p.grad = randn_like(p, gen)
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]: invalid lr = -1.0"):
        opt.step()
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["lr"] = 0.01
    opt.param_groups[0]["nesterov"] = True
    with pytest.raises(libdion.DionInvalidUsage, match=r"param_groups\[0\]: 'nesterov' changed from False to True, "
                                                       r"but libdion fixes it when the group is created"):
        opt.step()
    opt.param_groups[0]["nesterov"] = False
    opt.param_groups[0]["algorithm"] = "lion"
    with pytest.raises(RuntimeError, match="'algorithm' changed from 'muon' to 'lion'"):
        opt.step()
    opt.param_groups[0]["algorithm"] = "muon"
    opt.param_groups[0]["params"].append(param((4,), gen))
    with pytest.raises(RuntimeError, match="its 'params' list changed from 1 to 2 tensors.*add_param_group"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    opt.step()
    assert not torch.equal(p.detach(), before)


def test_rank_fraction_cannot_change(gen):
    opt = lt.Dion([param((8, 8), gen)])
    opt.param_groups[0]["rank_fraction"] = 0.5
    with pytest.raises(RuntimeError, match="'rank_fraction' changed from 1.0 to 0.5"):
        opt.step()


def test_a_replaced_parameter_is_checked_like_a_new_one(gen):
    p = param((8, 8), gen)
    opt = lt.Muon([p])
    p.data = torch.randn(8, 8, dtype=torch.float64)
    p.grad = None
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        opt.step()


# --------------------------------------------------------------------------
# Meshes (more in test_torch_dist.py)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kw,name", [
    (lt.Dion, dict(replicate_mesh=FakeMesh(2)), "replicate_mesh has 2 ranks"),
    (lt.Dion, dict(outer_shard_mesh=FakeMesh(4)), "outer_shard_mesh has 4 ranks"),
    (lt.Dion, dict(inner_shard_mesh=FakeMesh(8)), "inner_shard_mesh has 8 ranks"),
    (lt.Muon, dict(distributed_mesh=FakeMesh(2)), "distributed_mesh has 2 ranks"),
    (lt.NorMuon, dict(distributed_mesh=FakeMesh(2)), "distributed_mesh has 2 ranks"),
    (lt.Dion2, dict(distributed_mesh=FakeMesh(2)), "distributed_mesh has 2 ranks"),
    (lt.NorDion2, dict(distributed_mesh=FakeMesh(2)), "distributed_mesh has 2 ranks"),
])
def test_a_multi_rank_mesh_must_be_a_group(gen, cls, kw, name):
    with pytest.raises(TypeError, match=name + " but is neither a torch DeviceMesh, a ProcessGroup nor an mpi4py "
                                               "communicator"):
        cls([param((4, 4), gen)], **kw)


def test_a_mesh_must_have_a_size(gen):
    with pytest.raises(TypeError, match="replicate_mesh must be None, a torch DeviceMesh, a ProcessGroup or an mpi4py "
                                        "communicator"):
        lt.Dion([param((4, 4), gen)], replicate_mesh="dp")


def test_python_orthogonalizers_are_not_supported(gen):
    with pytest.raises(NotImplementedError, match="newton_schulz_func cannot be used"):
        lt.Muon([param((4, 4), gen)], newton_schulz_func=lambda x, eps: x)
    with pytest.raises(NotImplementedError, match="use_gram_newton_schulz is not implemented by libdion"):
        lt.NorMuon([param((4, 4), gen)], use_gram_newton_schulz=True)
    lt.Dion2([param((4, 4), gen)], use_triton=True, triton_post_ortho=True, verbose=True)  # accepted, ignored


def test_capture_errors_are_explained_without_cuda(gen):
    """The capture checks run only under torch.cuda.graph; here: sync_hparams raises on a frozen edit."""
    opt = lt.Muon([param((4, 4), gen)])
    opt.param_groups[0]["flatten"] = True
    with pytest.raises(RuntimeError, match="'flatten' changed"):
        opt.sync_hparams()
