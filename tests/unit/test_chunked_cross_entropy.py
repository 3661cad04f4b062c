"""--cross-entropy-fusion-impl chunked (megatron/model/output_layer.py): the output layer's GEMM and the loss a
slice of the vocabulary at a time give the native fused loss's values and gradients (bit for bit in one slice), into
`main_grad` where the weight has one, over a tensor-parallel group too, and the model trains with it."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.config import ConfigError, parse_args
from megatron.model import output_layer
from megatron.model.cross_entropy import fused_cross_entropy
from megatron.model.output_layer import linear_cross_entropy
from megatron.training.memory import estimate_bytes
from tests.dist_utils import run_distributed
from tests.e2e.test_training import TINY
from tests.unit.test_cross_entropy_fusion import model_loss_and_grads

TOKENS, HIDDEN, VOCAB = 24, 16, 50


def _inputs(dtype):
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype)
    weight = (0.5 * torch.randn(VOCAB, HIDDEN)).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,))
    return x, weight, labels, torch.rand(TOKENS)


def _native(x, weight, labels, grad_out):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_cross_entropy(F.linear(x, weight), labels)
    loss.backward(grad_out)
    return loss, x.grad, weight.grad


def _chunked(x, weight, labels, grad_out, **kwargs):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, weight, labels, **kwargs)
    loss.backward(grad_out)
    return loss, x.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_slice_is_the_native_loss_bit_for_bit(dtype):
    args = _inputs(dtype)
    for ours, theirs in zip(_chunked(*args), _native(*args)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_of_the_vocabulary_give_the_same_loss_and_gradients(dtype, monkeypatch):
    args = _inputs(dtype)
    monkeypatch.setattr(output_layer, "CHUNK_ELEMENTS", TOKENS * 7)  # slices of 7 rows, the last one of 1
    assert len(output_layer._slices(VOCAB, TOKENS)) == 8
    (loss, dx, dw), (ref, ref_dx, ref_dw) = _chunked(*args), _native(*args)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(dx, ref_dx, **tol)
    torch.testing.assert_close(dw, ref_dw, **tol)


@pytest.mark.parametrize("overwrite", [False, True])
def test_the_weight_gradient_goes_into_main_grad(overwrite, monkeypatch):
    x, weight, labels, grad_out = _inputs(torch.bfloat16)
    monkeypatch.setattr(output_layer, "CHUNK_ELEMENTS", TOKENS * 16)
    _, _, ref_dw = _chunked(x, weight, labels, grad_out)
    param = torch.nn.Parameter(weight.clone())
    param.main_grad = torch.full(weight.shape, float("nan") if overwrite else 0.0, dtype=torch.bfloat16)
    param.overwrite_main_grad = overwrite
    linear_cross_entropy(x, param, labels, fuse_wgrad=True).backward(grad_out)
    assert torch.equal(param.main_grad, ref_dw) and param.grad_added_to_main_grad
    assert param.grad.data_ptr() == param.main_grad.data_ptr()  # no gradient tensor beside the buffer


class _Fp32InputSized(TorchDispatchMode):
    """The distinct storages of the fp32 [TOKENS, HIDDEN] tensors the ops inside make."""

    def __init__(self):
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (TOKENS, HIDDEN):
                self.storages.add(t.untyped_storage().data_ptr())
        return out


def test_the_input_gradient_is_summed_in_one_fp32_tensor(monkeypatch):
    """The estimate (training/memory.py) counts one fp32 input gradient beside a slice's work: each slice's part is
    added into it from the GEMM's 16-bit output, with no fp32 copy of that output."""
    x, weight, labels, grad_out = _inputs(torch.bfloat16)
    monkeypatch.setattr(output_layer, "CHUNK_ELEMENTS", TOKENS * 7)
    x.requires_grad_()
    loss = linear_cross_entropy(x, weight, labels)
    with _Fp32InputSized() as mode:
        loss.backward(grad_out)
    assert len(mode.storages) == 1


def _tensor_parallel_body(rank, world):
    x, weight, labels, grad_out = _inputs(torch.float32)
    output_layer.CHUNK_ELEMENTS = TOKENS * 10  # three slices of this rank's 25 rows
    ref, ref_dx, ref_dw = _native(x, weight, labels, grad_out)
    rows = VOCAB // world
    shard = weight[rank * rows : (rank + 1) * rows]
    loss, dx, dw = _chunked(x, shard, labels, grad_out, group=dist.group.WORLD)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    dist.all_reduce(dx)  # each rank's input gradient covers its vocabulary rows: the model all-reduces them
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref_dw[rank * rows : (rank + 1) * rows], rtol=1e-5, atol=1e-6)


def test_over_a_tensor_parallel_group():
    run_distributed(_tensor_parallel_body, world_size=2)


def _layouts_body(rank, world):
    from megatron.parallel.fsdp.flat_shards import FlatGradShards
    from tests.distributed.test_fsdp import _close, _run
    from tests.distributed.test_parallel_layouts import BASE

    output_layer.CHUNK_ELEMENTS = 32 * 5  # slices of 5 rows of a rank's 64 (the vocabulary of 127 padded to 128)
    FlatGradShards.fill_new_buckets = float("nan")  # every row of the output layer's gradient must be written
    flags = f"{BASE} --train-iters 2 --eval-iters 0 --untie-embeddings-and-output-weights --cross-entropy-loss-fusion"
    layouts = {
        "tp2 sp": "--tensor-model-parallel-size 2 --sequence-parallel",
        "optim_grads": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",  # overwrite_main_grad
    }
    for label, layout in layouts.items():
        want, _ = _run(f"{flags} {layout} --cross-entropy-fusion-impl native", world)
        got, _ = _run(f"{flags} {layout} --cross-entropy-fusion-impl chunked", world)
        _close(got, want, 1e-6, label, steps=2)


def test_training_under_tensor_parallelism_and_sharded_gradients():
    """Two steps of training on two ranks: the chunked loss, its weight gradient in the buffers (unzeroed ones
    too), trains as the native fused loss does."""
    run_distributed(_layouts_body, world_size=2)


def _nearest_nodes(node, depth: int = 3) -> str:
    """The names of the autograd nodes up to `depth` steps before `node`."""
    names, frontier = [], [node]
    for _ in range(depth):
        names += [n.name() for n in frontier]
        frontier = [m for n in frontier for m, _ in n.next_functions if m is not None]
    return " ".join(names)


@pytest.mark.parametrize("tied", ["", "--untie-embeddings-and-output-weights"])
def test_the_model_computes_its_loss_with_it(tied):
    tokens = torch.randint(0, 128, (2, 32))
    flags = f"{tied} --cross-entropy-loss-fusion --cross-entropy-fusion-impl"
    (native, native_grads), (chunked, chunked_grads) = (
        model_loss_and_grads(f"{flags} {impl}", tokens) for impl in ("native", "chunked")
    )
    assert "LinearCrossEntropy" in _nearest_nodes(chunked.grad_fn)
    assert "LinearCrossEntropy" not in _nearest_nodes(native.grad_fn)
    assert torch.equal(native, chunked)  # one slice of TINY's vocabulary
    for ours, theirs in zip(chunked_grads, native_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_the_memory_estimate_counts_no_logits():
    flags = "--bf16 --untie-embeddings-and-output-weights --cross-entropy-loss-fusion --cross-entropy-fusion-impl"
    native, chunked = (parse_args(f"{TINY} {flags} {impl}".split()) for impl in ("native", "chunked"))
    a, b = (estimate_bytes(cfg, 10**6, 128, torch.bfloat16) for cfg in (native, chunked))
    tokens = 32 * 2
    # native: fp32 logits and their gradient kept, 8 bytes per logit; chunked: none kept, but a slice's work in the
    # backward (6 bytes per logit; here the whole vocabulary is one slice) and the fp32 input gradient
    assert a["activations"] - b["activations"] == 8 * tokens * 128
    assert b["buffers"] - a["buffers"] == 6 * tokens * 128 + 4 * tokens * 32


def test_chunked_without_the_fusion_is_a_one_line_error():
    """Without --cross-entropy-loss-fusion the choice would be ignored and the whole logits kept."""
    with pytest.raises(ConfigError, match="chunked takes effect only with --cross-entropy-loss-fusion") as error:
        parse_args(f"{TINY} --cross-entropy-fusion-impl chunked".split())
    assert "\n" not in str(error.value)
    parse_args(f"{TINY} --cross-entropy-fusion-impl native".split())  # Megatron-LM's default, accepted alone
