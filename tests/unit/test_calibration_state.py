"""Whether a run's FP8 linears already hold delayed-scaling state after a load (`holds_delayed_scales`), which decides
whether the trainer calibrates a loaded run: Transformer Engine's fp8_meta as TE leaves it, modelled on the CPU."""

from types import SimpleNamespace

import torch

from megatron.fp8.calibration import holds_delayed_scales

CPU = torch.device("cpu")


def te_module(scale: float | None, history: list[float] | None = None) -> SimpleNamespace:
    """A TE linear's fp8_meta: none before its first FP8 forward or load (scale None), else scaling_fwd (input,
    weight, output) and scaling_bwd (gradient) at `scale`, with amax history rows `history` (newest row first)."""
    if scale is None:
        return SimpleNamespace(fp8_meta={})
    rows = torch.tensor(history or [0.0])[:, None]

    def meta(n: int) -> SimpleNamespace:
        return SimpleNamespace(scale=torch.full((n,), scale), amax_history=rows.expand(-1, n).clone())

    return SimpleNamespace(fp8_meta={"scaling_fwd": meta(3), "scaling_bwd": meta(2)})


def te_holds(*modules: SimpleNamespace) -> bool:
    return holds_delayed_scales(None, SimpleNamespace(modules=list(modules)), CPU)


def test_transformer_engine_state_from_a_checkpoint_is_held_even_with_its_history_zeroed():
    # TE zeroes the newest history row after each update: with --fp8-amax-history-len 1 (the default) all of it
    assert te_holds(te_module(scale=112.0, history=[0.0]))
    assert te_holds(te_module(scale=112.0, history=[0.0, 3.5]))


def test_transformer_engine_layers_without_state_are_calibrated():
    assert not te_holds(te_module(scale=None))  # a bf16 checkpoint: TE made no fp8_meta
    assert not te_holds(te_module(scale=1.0))  # made but never updated: scales 1, amaxes 0
    assert not te_holds(te_module(scale=112.0), te_module(scale=None))  # every FP8 linear must hold its own
    assert te_holds()  # a pipeline stage without FP8 linears needs nothing


def test_local_engine_state_is_its_amax_history():
    def manager(history: torch.Tensor | None) -> SimpleNamespace:
        return SimpleNamespace(amax=SimpleNamespace(history=history))

    assert not holds_delayed_scales(manager(torch.zeros(1, 4, 3)), None, CPU)
    assert holds_delayed_scales(manager(torch.tensor([[[0.0, 0.5, 0.0]]])), None, CPU)
    assert holds_delayed_scales(manager(None), None, CPU)  # no delayed scaling: nothing to calibrate
