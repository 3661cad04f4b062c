"""--smooth-swiglu: the same function as the plain SwiGLU in full precision, a smaller FP8 error of linear_fc2's
input when the SwiGLU output has outlier channels, scales that follow the amaxes, survive checkpoints and resume,
and exports that need no extra op."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.convert import read_ours, write_hf
from megatron.convert.files import atomic_output_dir
from megatron.convert.mcore import sharded_tensors
from megatron.convert.ours import write_torch
from megatron.convert.state import FullModel, fold_smoothing, model_config
from megatron.fp8 import attach_fp8
from megatron.fp8.formats import Role
from megatron.fp8.linear import Fp8LinearState
from megatron.model import GPTModel
from megatron.model.smooth_swiglu import scale_from_amax, smoothed_linears, update_smoothing

BASE = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16"
    " --swiglu --ffn-hidden-size 64 --normalization RMSNorm --position-embedding-type rope --disable-bias-linear"
    " --hidden-dropout 0 --attention-dropout 0 --transformer-impl local"
)


def build(flags: str = "", seed: int = 0):
    cfg = parse_args(f"{BASE} {flags}".split())
    torch.manual_seed(seed)
    return cfg, GPTModel(cfg.model, 128)


def random_scales(model: GPTModel, seed: int = 5) -> None:
    """Powers of two from 2^-6 to 2^6, as training would leave them."""
    gen = torch.Generator().manual_seed(seed)
    for linear in smoothed_linears(model):
        exponents = torch.randint(-6, 7, linear.smooth_scale.shape, generator=gen)
        linear.smooth_scale.copy_(torch.exp2(exponents.float()))


def tokens(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (2, 16), generator=gen), torch.randint(0, 128, (2, 16), generator=gen)


def test_flag_rules():
    with pytest.raises(ConfigError, match="--smooth-swiglu scales the SwiGLU output: add --swiglu"):
        parse_args("--mock-data --vocab-size 128 --smooth-swiglu".split())
    with pytest.raises(ConfigError, match=r"--smooth-swiglu-migration must be in \[0, 1\], got 1.5"):
        parse_args(f"{BASE} --smooth-swiglu --smooth-swiglu-migration 1.5".split())
    with pytest.raises(ConfigError, match="--smooth-swiglu-migration sets --smooth-swiglu's scales: add"):
        parse_args(f"{BASE} --smooth-swiglu-migration 0.5".split())
    with pytest.raises(ConfigError, match="--smooth-swiglu-migration below 1 reads linear_fc2's whole weight"):
        parse_args(f"{BASE} --smooth-swiglu --smooth-swiglu-migration 0.5 --use-torch-fsdp2".split(), world_size=2)
    with pytest.raises(ConfigError, match="--smooth-swiglu with --fp8-param-gather"):
        parse_args(f"{BASE} --smooth-swiglu --fp8-format hybrid --fp8-param-gather".split())
    # the flag does not choose the engine: on a CPU the default is the local one, for the usual reason
    cfg = parse_args(BASE.replace("--transformer-impl local", "--smooth-swiglu").split())
    assert cfg.model.transformer_impl == "local" and "no CUDA device" in " ".join(cfg.notes)
    assert parse_args(f"{BASE} --smooth-swiglu".split()).model.smooth_swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_function_and_gradients_without_fp8(dtype):
    """Power-of-two scales make x * s and W / s exact: outputs and every gradient agree bit for bit."""
    _, plain = build()
    _, smoothed = build("--smooth-swiglu")
    random_scales(smoothed)
    assert smoothed.state_dict().keys() - plain.state_dict().keys() == {
        f"decoder.layers.{i}.mlp.linear_fc2.smooth_scale" for i in range(2)
    }
    plain.load_state_dict(smoothed.state_dict(), strict=False)
    plain, smoothed = plain.to(dtype), smoothed.to(dtype)
    x, labels = tokens()
    losses = []
    for model in (plain, smoothed):
        loss = model(x, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], atol=0, rtol=0)
    grads = dict(plain.named_parameters())
    for name, param in smoothed.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=0, rtol=1e-6, msg=name)


def test_scales_follow_the_amaxes():
    amax = torch.tensor([1.0, 1.5, 0.3, 0.0, float("inf"), float("nan"), 1e9, 1e-9])
    previous = torch.full((8,), 0.25)
    assert scale_from_amax(amax, previous).tolist() == [1.0, 0.5, 2.0, 0.25, 0.25, 0.25, 2.0**-14, 2.0**14]
    _, model = build("--smooth-swiglu")
    loss = model(*tokens()[:1]).float().square().mean()
    loss.backward()
    fc2 = smoothed_linears(model)
    seen = [linear.smooth_amax.clone() for linear in fc2]
    assert all(bool((s > 0).all()) for s in seen)
    update_smoothing(fc2)
    for linear, amax in zip(fc2, seen):
        assert torch.equal(linear.smooth_scale, scale_from_amax(amax, torch.ones_like(amax)))
        assert not linear.smooth_amax.any()
        smoothed = amax * linear.smooth_scale  # every channel's amax now in (0.5, 1]
        assert bool(((smoothed > 0.5) & (smoothed <= 1)).all())
    model.eval()  # evaluation does not move the statistics
    model(*tokens()[:1])
    assert not any(linear.smooth_amax.any() for linear in fc2)


def test_a_migration_below_1_shares_the_range_with_the_weight():
    amax, wmax = torch.tensor([4096.0, 1.0, 3.0, 5.0, 0.0]), torch.tensor([1.0, 1.0, 0.5, 0.0, 1.0])
    previous = torch.full((5,), 0.25)
    assert scale_from_amax(amax, previous, wmax, 1.0).tolist() == [2.0**-12, 1.0, 0.25, 0.125, 0.25]
    # 4096 and 1: both at 64 (the outlier's range split in half); a zero weight column keeps the old scale
    assert scale_from_amax(amax, previous, wmax, 0.5).tolist() == [2.0**-6, 1.0, 0.25, 0.25, 0.25]
    assert scale_from_amax(amax, previous, wmax, 0.0).tolist() == [1.0, 1.0, 0.5, 0.25, 0.25]  # all in the input
    _, model = build("--smooth-swiglu --smooth-swiglu-migration 0.5")
    model(*tokens()[:1]).float().square().mean().backward()
    fc2 = smoothed_linears(model)
    seen = [linear.smooth_amax.clone() for linear in fc2]
    update_smoothing(fc2, migration=0.5)
    for linear, amax in zip(fc2, seen):
        s, wmax = linear.smooth_scale, linear.weight.detach().abs().amax(dim=0)
        balanced = (amax * wmax).sqrt()  # the input's channel i in (b/2, b], the weight's column i in [b, 2b)
        assert bool(((amax * s > balanced / 2) & (amax * s <= balanced * (1 + 1e-6))).all())
        assert bool(((wmax / s >= balanced * (1 - 1e-6)) & (wmax / s < 2 * balanced)).all())


def fc2_input_error(recipe: str, smooth: bool) -> float:
    """Relative error, in the unscaled units, of linear_fc2's FP8 input in the second layer (FP8) of a model whose
    SwiGLU output has three outlier channels 2^18 times the others, once three steps of statistics (no optimizer
    step: the weights stay) have settled delayed scaling's history and the smoothing scales."""
    cfg, model = build(f"--fp8-format hybrid --fp8-recipe {recipe}" + (" --smooth-swiglu" if smooth else ""))
    fc1 = model.decoder.layers[1].mlp.linear_fc1
    outliers = [3, 17, 40]
    with torch.no_grad():  # the up projection's rows of those channels (the second half of fc1's rows)
        fc1.weight[[64 + i for i in outliers]] *= 2.0**18
    manager = attach_fp8(model, cfg)
    x, labels = tokens()
    for _ in range(3):
        model(x, labels=labels).float().mean().backward()
        manager.step()
        update_smoothing(smoothed_linears(model))
    fc2 = model.decoder.layers[1].mlp.linear_fc2
    seen = []
    original = Fp8LinearState.quantize

    def spy(state, t, role, **kwargs):
        q, q_t = original(state, t, role, **kwargs)
        if state is fc2.fp8 and role is Role.INPUT:
            seen.append((t.detach().clone(), q.dequantize()))
        return q, q_t

    Fp8LinearState.quantize = spy
    try:
        with torch.no_grad():
            model(x, labels=labels)
    finally:
        Fp8LinearState.quantize = original
    (t, deq), s = seen[0], fc2.smooth_scale if smooth else torch.ones(64)
    keep = torch.ones(64, dtype=torch.bool)
    keep[outliers] = False
    error = ((deq - t) / s)[:, keep]
    return float(error.norm() / (t / s)[:, keep].norm())


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_outlier_channels_cost_the_other_channels_their_bits_only_without_smoothing(recipe):
    plain, smoothed = fc2_input_error(recipe, False), fc2_input_error(recipe, True)
    assert smoothed < 0.05, smoothed  # e4m3's rounding: 2^-4 at most per element, ~2% in norm
    assert plain > 10 * smoothed, (plain, smoothed)


def full_of(model: GPTModel) -> FullModel:
    return FullModel(model.cfg, 128, dict(model.state_dict()), "test")


def test_exports_fold_the_scales_and_compute_the_same_function(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, model = build("--smooth-swiglu --untie-embeddings-and-output-weights")
    random_scales(model)
    model.eval()
    full = full_of(model)
    with atomic_output_dir(tmp_path / "hf") as out:
        write_hf(full, out)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x, _ = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)
    plain = fold_smoothing(full)
    assert not plain.model.smooth_swiglu and not any("smooth" in k for k in sharded_tensors(plain, 128))
    # this project's own format keeps them, split over tensor-parallel ranks as linear_fc2's columns
    with atomic_output_dir(tmp_path / "ckpt") as out:
        write_torch(full, out, tp=2, pp=1)
    back = read_ours(tmp_path / "ckpt")
    for name, tensor in full.state.items():
        torch.testing.assert_close(back.state[name][: tensor.shape[0]], tensor, atol=0, rtol=0, msg=name)
    shard = torch.load(tmp_path / "ckpt/iter_0000000/mp_rank_01/model_optim_rng.pt", weights_only=False)["model"]
    name = "decoder.layers.0.mlp.linear_fc2.smooth_scale"
    assert torch.equal(shard[name], full.state[name][32:])
    assert model_config(**dict(vars(full.model))).smooth_swiglu


def test_checkpoint_round_trip_and_resume(tmp_path):
    """Scales are saved and loaded (torch_dist and torch), and a resumed run ends where the uninterrupted one does."""
    import pretrain_gpt

    flags = (
        f"{BASE} --smooth-swiglu --micro-batch-size 2 --global-batch-size 4 --train-iters 4 --eval-iters 0"
        " --lr 1e-3 --save-interval 2"
    )
    for fmt in ("torch", "torch_dist"):
        whole, part = tmp_path / f"{fmt}_whole", tmp_path / f"{fmt}_part"
        assert pretrain_gpt.main(f"{flags} --ckpt-format {fmt} --save {whole}".split()) == 0
        assert pretrain_gpt.main(f"{flags} --ckpt-format {fmt} --save {part} --exit-interval 2".split()) == 0
        assert pretrain_gpt.main(f"{flags} --ckpt-format {fmt} --save {part} --load {part}".split()) == 0
        a, b = read_ours(whole).state, read_ours(part).state
        scale = a["decoder.layers.1.mlp.linear_fc2.smooth_scale"]
        assert not torch.all(scale == 1)  # the scales moved and were saved
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=f"{fmt}: {name}")


def test_a_run_turns_smoothing_on_when_it_resumes(tmp_path, capsys):
    """A checkpoint saved without --smooth-swiglu loads into a run with it (a resume or a parity branch): its scales
    start at 1, as at a first step, and the log says so; the run trains on and saves them."""
    import pretrain_gpt

    flags = f"{BASE} --micro-batch-size 2 --global-batch-size 4 --eval-iters 0 --lr 1e-3"
    for fmt in ("torch", "torch_dist"):
        plain, smoothed = tmp_path / f"{fmt}_plain", tmp_path / f"{fmt}_smoothed"
        assert pretrain_gpt.main(f"{flags} --train-iters 2 --ckpt-format {fmt} --save {plain}".split()) == 0
        capsys.readouterr()
        resumed = f"{flags} --train-iters 4 --smooth-swiglu --ckpt-format {fmt} --load {plain} --save {smoothed}"
        assert pretrain_gpt.main(resumed.split()) == 0
        assert (
            "holds no Smooth-SwiGLU scales (saved without --smooth-swiglu): they start at 1" in capsys.readouterr().out
        )
        state = read_ours(smoothed).state
        assert not torch.all(state["decoder.layers.1.mlp.linear_fc2.smooth_scale"] == 1), fmt  # updated since
