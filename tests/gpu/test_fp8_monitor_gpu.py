"""The FP8 monitor, delayed scaling's calibration and the guard on Transformer Engine's layers, against the local
engine on the same weights and data (GPU with TE)."""

import math

import pytest
import torch

from megatron.config import parse_args
from megatron.config.te_rules import te_import_error
from megatron.fp8 import Role, fp8_max
from megatron.training import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(te_import_error() is not None, reason=f"needs Transformer Engine ({te_import_error()})"),
]

LLAMA = (
    "--mock-data --vocab-size 255 --num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention"
    " --num-query-groups 2 --ffn-hidden-size 256 --seq-length 64 --position-embedding-type rope --normalization"
    " RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0"
    " --attention-dropout 0 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --eval-iters 0 --log-interval 1"
    " --no-fp8-first-layer-bf16"  # both layers in FP8: the per-layer comparisons and the guard need two
)


def trainer(impl: str, flags: str) -> Trainer:
    return Trainer(parse_args(f"{LLAMA} --transformer-impl {impl} {flags}".split(), device_type="cuda"))


def te_scales(t: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax history[0], scale) [linears, 3 roles] from TE's modules, in the taps' order (the local engine's)."""
    from megatron.fp8.te_monitor import TE_META_KEY

    history, scale = torch.zeros(len(t.fp8_monitor.taps.modules), 3), torch.zeros(len(t.fp8_monitor.taps.modules), 3)
    for i, module in enumerate(t.fp8_monitor.taps.modules):
        for role in Role:
            key, position = TE_META_KEY[role]
            history[i, role.value] = module.fp8_meta[key].amax_history[0, position]
            scale[i, role.value] = module.fp8_meta[key].scale[position]
    return history, scale


def test_te_calibration_matches_the_local_engine():
    flags = "--fp8-format hybrid --fp8-recipe delayed --train-iters 2"
    te, local = trainer("transformer_engine", flags), trainer("local", flags)
    assert te.fp8_monitor.taps.names == local.fp8_monitor.taps.names
    te_history, te_scale = te_scales(te)
    local_history = local.fp8.amax.history[0].cpu()
    # the same weights and micro-batch in bf16 through two implementations: amaxes agree to bf16 rounding
    assert torch.allclose(te_history, local_history, rtol=3e-2), (te_history, local_history)
    maxima = torch.tensor([fp8_max(local.fp8.recipe.dtype(r)) for r in Role])
    assert torch.allclose(te_scale, maxima / te_history, rtol=1e-6)
    assert math.isfinite(te.train().losses[2])
    uncalibrated = trainer("transformer_engine", flags + " --no-fp8-calibration")
    assert "scaling_fwd" not in uncalibrated.fp8_monitor.taps.modules[0].fp8_meta  # TE starts from scale 1


def test_te_fp8_params_calibrate_and_are_recast_with_the_calibrated_weight_scales():
    flags = "--fp8-format hybrid --fp8-recipe delayed --bf16 --train-iters 3"
    fp8_weights, bf16_weights = (
        trainer("transformer_engine", f"{flags} --fp8-param-gather"),
        trainer("transformer_engine", flags),
    )
    # the same weights and micro-batch: the calibrated amaxes agree to the FP8 weights' rounding
    history, scale = te_scales(fp8_weights)
    reference, _ = te_scales(bf16_weights)
    assert torch.allclose(history, reference, rtol=0.1), (history, reference)
    weights = [m.weight for m in fp8_weights.fp8_monitor.taps.modules]
    weight_scales = scale[:, Role.WEIGHT.value]
    # recast with the calibrated scale, not TE's initial scale 1
    assert all(float(w._scale_inv) == pytest.approx(1 / float(s), rel=1e-6) for w, s in zip(weights, weight_scales))
    assert (weight_scales > 4).all()
    losses = fp8_weights.train().losses, bf16_weights.train().losses
    for step in (1, 2, 3):  # the first steps agree as closely as FP8 rounding of the weights allows
        assert losses[0][step] == pytest.approx(losses[1][step], rel=2e-3), (step, losses)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_te_monitor_reports_what_the_local_engine_reports(recipe, capsys):
    fmt = "e4m3" if recipe == "blockwise" else "hybrid"
    flags = f"--fp8-format {fmt} --fp8-recipe {recipe} --train-iters 2 --fp8-stats-interval 1"
    rows = {}
    for impl in ("transformer_engine", "local"):
        t = trainer(impl, flags)
        reports, report = [], t.fp8_monitor.report

        def keep(*args, report=report, reports=reports):
            reports.append(report(*args))
            return reports[-1]

        t.fp8_monitor.report = keep
        t.train()
        rows[impl] = {(r.linear, r.role): r for r in reports[0]}
    assert rows["transformer_engine"].keys() == rows["local"].keys() and len(rows["local"]) == 2 * 4 * 3
    for key, te_row in rows["transformer_engine"].items():
        local_row = rows["local"][key]
        assert te_row.amax == pytest.approx(local_row.amax, rel=5e-2), key
        assert te_row.scale == pytest.approx(local_row.scale, rel=5e-2), key
        for field in ("saturated", "underflow"):
            assert 0 <= getattr(te_row, field) <= 1
            assert getattr(te_row, field) == pytest.approx(getattr(local_row, field), abs=2e-3), (key, field)
    assert "fp8 stats iteration        1" in capsys.readouterr().out


def test_te_monitor_watches_the_first_step_of_a_run_resumed_from_bf16(tmp_path, capsys):
    """A bf16 checkpoint holds no FP8 state: TE sets it up in each module's first forward, after the monitor's hook
    has read the scale of that cast (1, on the GPU)."""
    trainer("transformer_engine", f"--train-iters 2 --save {tmp_path} --save-interval 2").train()
    flags = f"--fp8-format hybrid --fp8-recipe delayed --train-iters 4 --fp8-stats-interval 3 --load {tmp_path}"
    state = trainer("transformer_engine", flags).train()
    assert math.isfinite(state.losses[3]) and math.isfinite(state.losses[4])
    assert "fp8 stats iteration        3" in capsys.readouterr().out


def test_te_guard_moves_a_saturating_layer_to_bf16():
    t = trainer(
        "transformer_engine",
        "--fp8-format hybrid --fp8-recipe delayed --train-iters 3 --fp8-stats-interval 1 --fp8-guard-intervals 2"
        " --fp8-auto-bf16",
    )
    taps = t.fp8_monitor.taps
    forced = taps.names.index("decoder.layers.1.mlp.linear_fc1")

    def pin_scale(module, args):  # a delayed scale far too large: almost every input element is clipped
        module.fp8_meta["scaling_fwd"].scale[0] = 1e6

    taps.modules[forced].register_forward_pre_hook(pin_scale)
    state = t.train()
    assert t.fp8_monitor.guard.bf16_layers == [2]
    assert t.model.te_fp8.fp8_layers == {1}
    assert math.isfinite(state.losses[3])
