"""--smooth-swiglu on Transformer Engine's layers (megatron/model/te_mlp.py, te_linear.smoothed_te_linear): the same
function and gradients as the plain layers in bf16, bit for bit; the scales move between the engines in a state
dict; linear_fc2's gradient reaches main_grad through the kernel as through autograd, bit for bit; FP8 training
with it learns like bf16; and with outlier channels in the SwiGLU output it keeps linear_fc2's other channels,
which plain delayed scaling flushes. The local engine's twin: tests/unit/test_smooth_swiglu.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron.config.te_rules import te_import_error
from megatron.model.smooth_swiglu import smoothed_linears, update_smoothing
from megatron.optim import MixedPrecisionAdamW
from megatron.parallel import GradientBuffers
from tests.gpu.test_te_model import LLAMA, batches, build, config, grad_norm, progress, rel_err
from tests.gpu.test_te_model import train as train_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

TE = "transformer_engine"
DELAYED = "--fp8-format hybrid --fp8-recipe delayed --bf16"


def random_scales(model, seed: int = 5) -> None:
    """Powers of two from 2^-6 to 2^6, as training would leave them."""
    gen = torch.Generator().manual_seed(seed)
    for linear in smoothed_linears(model):
        exponents = torch.randint(-6, 7, linear.smooth_scale.shape, generator=gen)
        linear.smooth_scale.copy_(torch.exp2(exponents.float()))


def test_same_function_and_gradients_in_bf16_bit_for_bit():
    plain, smoothed = build(LLAMA, TE), build(LLAMA, TE, "--smooth-swiglu")
    assert len(smoothed_linears(smoothed)) == 3 and not smoothed_linears(plain)
    random_scales(smoothed)
    batch = batches()[0]
    losses = [model(batch["tokens"], labels=batch["labels"]).float().mean() for model in (plain, smoothed)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = dict(smoothed.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(grads[name].grad, param.grad), name
    assert all(linear.smooth_amax.gt(0).all() for linear in smoothed_linears(smoothed))  # observed in training


def test_scales_move_between_the_engines():
    te = build(LLAMA, TE, "--smooth-swiglu")
    random_scales(te)
    local = build(LLAMA, "local", "--smooth-swiglu", seed=2)
    local.load_state_dict(te.state_dict())  # TE's _extra_state entries are dropped
    for a, b in zip(smoothed_linears(te), smoothed_linears(local)):
        assert torch.equal(a.smooth_scale.cpu(), b.smooth_scale.cpu())
    tokens = batches()[0]["tokens"]
    with torch.no_grad():
        assert rel_err(local.eval()(tokens), te.eval()(tokens)) < 2e-2


def train(flags: str, steps: int = 60) -> tuple[list[float], object]:
    """test_te_model.train with the optimizer step's smoothing update, as training/steps.py runs it."""
    return train_model(flags, steps, after_step=lambda model: partial(update_smoothing, smoothed_linears(model)))


def test_fc2_gradient_into_main_grad_and_the_cached_quotient_follow_each_step():
    """linear_fc2's gradient g / s added into main_grad by the kernel is autograd's division plus the buffers' add,
    bit for bit, over two micro-batches, at each of two optimizer steps; and the W / s kept between micro-batches
    follows each step and each load (a fresh model with the same state computes the same loss)."""
    fused = build(LLAMA, TE, "--smooth-swiglu")
    plain = build(LLAMA, TE, "--smooth-swiglu --no-gradient-accumulation-fusion")
    random_scales(fused)
    engines = [GradientBuffers(model, None) for model in (fused, plain)]
    optimizer = MixedPrecisionAdamW(fused, config(LLAMA, TE, "--lr 1e-3 --smooth-swiglu").optimizer)
    data = batches()
    for step in range(2):
        plain.load_state_dict(fused.state_dict())  # the same weights and scales at each step
        for model in (fused, plain):
            for batch in data[2 * step : 2 * step + 2]:  # two micro-batches per step
                model(batch["tokens"], labels=batch["labels"]).mean().backward()
        assert all(layer.mlp.linear_fc2.smooth_wgrad_fusion for layer in fused.decoder.layers)
        assert not any(layer.mlp.linear_fc2.smooth_wgrad_fusion for layer in plain.decoder.layers)
        for (name, param), other in zip(fused.named_parameters(), plain.parameters()):
            if name.endswith("linear_fc2.weight"):
                assert torch.equal(param.main_grad, other.main_grad), (step, name)
            else:  # TE's fused wgrad GEMMs accumulate in fp32, the others' gradients are rounded to bf16 first
                assert rel_err(param.main_grad, other.main_grad) < 1e-2, (step, name)
        optimizer.step(1e-3, lambda: grad_norm(optimizer))
        update_smoothing(smoothed_linears(fused))
        for engine in engines:
            engine.zero()
    fresh = build(LLAMA, TE, "--smooth-swiglu")
    fresh.load_state_dict(fused.state_dict())
    batch = data[0]
    losses = [model(batch["tokens"], labels=batch["labels"]).float().mean() for model in (fused, fresh)]
    assert torch.equal(losses[0], losses[1])


def test_the_quotient_is_kept_only_where_the_layer_keeps_its_weight_casts():
    """A training forward keeps W / s for the step's later micro-batches; a layer that keeps no weight casts (FSDP's
    resharded weights) or an evaluation forward keeps none, so no unsharded quotient outlives its use."""
    model = build(LLAMA, TE, "--smooth-swiglu")
    batch = batches()[0]
    fc2s = [layer.mlp.linear_fc2 for layer in model.decoder.layers]
    model(batch["tokens"], labels=batch["labels"]).mean().backward()
    assert all(fc2._quotient is not None for fc2 in fc2s)
    with torch.no_grad():
        model.eval()(batch["tokens"])
    assert all(fc2._quotient is None for fc2 in fc2s)
    model.train()
    for layer in model.decoder.layers:
        layer.cache_weight_casts = False
    model(batch["tokens"], labels=batch["labels"]).mean().backward()
    assert all(fc2._quotient is None for fc2 in fc2s)


def test_fp8_training_learns_like_bf16_with_the_fc2_wgrad_fused_outside_te():
    bf16 = progress(train("--bf16")[0])
    losses, model = train(f"{DELAYED} --smooth-swiglu")
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert progress(losses) > 0.7 * bf16 > 0, (progress(losses), bf16)
    for layer in model.decoder.layers:
        fc2 = layer.mlp.linear_fc2
        assert not fc2.fuse_wgrad_accumulation and layer.mlp.linear_fc1.fuse_wgrad_accumulation
        assert fc2.smooth_wgrad_fusion and fc2.weight.fused_wgrad_accumulation
        scale = fc2.smooth_scale
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round())) and not torch.all(scale == 1)


def fc2_output_error(smooth: bool) -> float:
    """Relative error of the second layer's (FP8) linear_fc2 output under delayed scaling, against the same model
    in bf16, when three SwiGLU output channels are 2^18 times the others (linear_fc1's output scaled there, after
    its FP8 GEMM) and linear_fc2 ignores them (zero weight columns): so the output is the other channels' alone,
    which one per-tensor scale set by the outliers flushes. The first layer is in bf16 in both models, so the
    second layer's input is the same."""
    extra = " --smooth-swiglu" if smooth else ""
    models = [build(LLAMA, TE, f"{DELAYED}{extra}"), build(LLAMA, TE, f"--bf16{extra}")]
    outliers, ffn = [3, 17, 40], 256
    grow = torch.ones(2 * ffn, device="cuda", dtype=torch.bfloat16)
    grow[[ffn + i for i in outliers]] = 2.0**18  # the up projection's half of linear_fc1's output
    outputs = []
    for model in models:
        mlp = model.decoder.layers[1].mlp
        mlp.linear_fc1.register_forward_hook(lambda module, args, out: out * grow)
        with torch.no_grad():
            mlp.linear_fc2.weight[:, outliers] = 0
        batch = batches()[0]
        for _ in range(3):  # delayed scaling's history (one step deep) and the smoothing scales settle
            model(batch["tokens"], labels=batch["labels"]).mean().backward()
            update_smoothing(smoothed_linears(model))
        handle = mlp.linear_fc2.register_forward_hook(lambda module, args, out: outputs.append(out.detach().float()))
        with torch.no_grad():
            model(batch["tokens"], labels=batch["labels"])
        handle.remove()
    return rel_err(outputs[0], outputs[1])


def test_outlier_channels_flush_the_others_only_without_smoothing():
    plain, smoothed = fc2_output_error(False), fc2_output_error(True)
    assert smoothed < 0.1, smoothed
    assert plain > 5 * smoothed, (plain, smoothed)
