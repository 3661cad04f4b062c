"""CPU training runs with the FP8 monitor, delayed scaling's calibration and the guard (local engine, emulated
FP8): the monitor's TensorBoard scalars, the calibrated first scales, a layer moved to bf16 and kept so on resume."""

import math

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.config import parse_args
from megatron.fp8 import Role, fp8_max
from megatron.model.layers import LayerNormLinear, Linear, normalize
from megatron.training import Trainer
from megatron.training.data_loading import to_device

TINY = (
    "--mock-data --vocab-size 128 --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32"
    " --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --log-interval 1 --eval-iters 0 --hidden-dropout 0"
    " --attention-dropout 0 --fp8-format hybrid --fp8-recipe delayed"
)


def trainer(flags: str) -> Trainer:
    return Trainer(parse_args(f"{TINY} {flags}".split()))


def test_monitor_writes_finite_tensorboard_scalars_and_a_summary_line(tmp_path, capsys):
    trainer(f"--train-iters 4 --fp8-stats-interval 2 --tensorboard-dir {tmp_path}").train()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t.startswith("fp8/")]
    assert len(tags) == 72, tags  # layer 2's 4 linears x 3 tensors x 6 stats: layer 1 stays in bf16
    assert "fp8/layers.1.mlp.linear_fc2/grad/underflow" in tags
    for tag in tags:
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == [2, 4], (tag, steps)
        assert all(math.isfinite(e.value) for e in events.Scalars(tag)), tag
    summary = [line for line in capsys.readouterr().out.splitlines() if "fp8 stats iteration" in line]
    assert len(summary) == 2 and "saturated:" in summary[0] and "underflow:" in summary[0]


def _first_micro_batch_amaxes(t: Trainer) -> torch.Tensor:
    """amax [linears, 3] of x, W and dY over one high-precision pass of the first micro-batch, measured with plain
    module hooks (independently of the engine's calibration path)."""
    states = list(t.fp8.states.values())
    amax = torch.zeros(len(states), 3)
    modules = {name: m for name, m in t.model.named_modules() if isinstance(m, Linear)}

    def hooks(i, module):
        def pre(mod, args):
            x = args[0].detach()
            if isinstance(mod, LayerNormLinear):  # the norm is fused into the module; its GEMM sees the output
                x = normalize(x, mod.layer_norm_weight, mod.layer_norm_bias, mod.norm_kind, mod.eps)
            amax[i, Role.INPUT.value] = x.abs().max()
            amax[i, Role.WEIGHT.value] = mod.weight.detach().abs().max()

        def post(mod, args, out):
            out.register_hook(lambda g: amax[i].__setitem__(Role.GRAD.value, g.abs().max()))

        return module.register_forward_pre_hook(pre), module.register_forward_hook(post)

    handles = [h for i, s in enumerate(states) for h in hooks(i, modules[s.name])]
    for s in states:
        s.enabled = False  # plain high-precision linears
    batch = next(iter(t.loader(t.datasets.train, t.state.consumed_samples)))  # the next step's first
    t.steps.loss(to_device(batch, t.device)).backward()
    for h in handles:
        h.remove()
    for s in states:
        s.enabled = True
    return amax


def test_calibration_sets_the_scales_the_amax_rule_gives():
    t = trainer("--train-iters 2")
    expected = _first_micro_batch_amaxes(t)
    maxima = torch.tensor([fp8_max(t.fp8.recipe.dtype(r)) for r in Role])
    assert torch.allclose(t.fp8.amax.history[0], expected, rtol=1e-6)
    assert torch.allclose(t.fp8.amax.scale, maxima / expected, rtol=1e-6)
    assert all(p.grad is None for p in t.model.parameters())  # the pass's gradients were thrown away

    margin = trainer("--train-iters 2 --fp8-margin 2")
    assert torch.allclose(margin.fp8.amax.scale, maxima / expected / 4, rtol=1e-6)
    uncalibrated = trainer("--train-iters 2 --no-fp8-calibration")
    assert torch.equal(uncalibrated.fp8.amax.scale, torch.ones_like(expected))


def test_a_checkpoint_without_delayed_scales_is_calibrated_and_one_with_them_keeps_its_own(tmp_path, capsys):
    bf16 = tmp_path / "bf16"
    Trainer(
        parse_args(
            f"{TINY.replace('--fp8-format hybrid --fp8-recipe delayed', '')} --train-iters 2 --save {bf16}".split()
        )
    ).train()
    branched = trainer(f"--train-iters 4 --load {bf16}")  # FP8 from a bf16 run's weights, as the parity branches
    assert "holds no delayed-scaling scales: calibrating" in capsys.readouterr().out
    expected = _first_micro_batch_amaxes(branched)
    assert branched.fp8.amax.generation == 1 and torch.allclose(branched.fp8.amax.history[0], expected, rtol=1e-6)

    fp8 = tmp_path / "fp8"
    saved = trainer(f"--train-iters 2 --save {fp8}")
    saved.train()
    resumed = trainer(f"--train-iters 4 --load {fp8}")
    assert "holds no delayed-scaling scales" not in capsys.readouterr().out
    assert torch.equal(resumed.fp8.amax.history, saved.fp8.amax.history)
    assert torch.equal(resumed.fp8.amax.scale, saved.fp8.amax.scale)


def test_calibration_leaves_the_random_streams_alone():
    # the pass runs dropout; the first step must still draw what it draws without calibration
    calibrated = trainer("--train-iters 1 --hidden-dropout 0.1")
    after_calibrated = torch.random.get_rng_state()
    uncalibrated = trainer("--train-iters 1 --hidden-dropout 0.1 --no-fp8-calibration")
    assert torch.equal(after_calibrated, torch.random.get_rng_state())
    assert (calibrated.fp8.amax.generation, uncalibrated.fp8.amax.generation) == (1, 0)


def test_guard_moves_a_saturating_layer_to_bf16_and_resume_keeps_it(tmp_path, capsys):
    flags = "--fp8-stats-interval 1 --fp8-guard-intervals 2 --fp8-auto-bf16"
    t = trainer(f"--train-iters 3 {flags} --save {tmp_path}")
    states = list(t.fp8.states.values())
    forced = next(i for i, s in enumerate(states) if s.name.endswith("layers.1.mlp.linear_fc1"))
    module = dict(t.model.named_modules())[states[forced].name]

    def pin_scale(mod, args):  # a delayed scale 1e6 too large: almost every input element is clipped
        t.fp8.amax.scale[forced, Role.INPUT.value] = 1e6

    module.register_forward_pre_hook(pin_scale)
    t.train()
    out = capsys.readouterr().out
    assert "FP8 guard: transformer layer 2, layers.1.mlp.linear_fc1 input: saturated" in out
    assert "moved the layer to bf16 for the rest of the run (--fp8-auto-bf16)" in out
    assert [s.enabled for s in states] == [s.layer_number != 2 for s in states]
    assert t.fp8_monitor.guard.bf16_layers == [2]

    resumed = trainer(f"--train-iters 4 {flags} --load {tmp_path}")
    assert [s.enabled for s in resumed.fp8.states.values()] == [s.layer_number != 2 for s in states]
    state = resumed.train()
    assert math.isfinite(state.losses[4])
