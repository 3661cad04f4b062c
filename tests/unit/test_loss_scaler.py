"""The fp16 loss scaler (megatron/optim/loss_scaler.py): Megatron-LM's dynamic scaling rules and a static scale."""

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.optim.loss_scaler import DynamicLossScaler, LossScaler, build_loss_scaler


def dynamic(**kwargs) -> DynamicLossScaler:
    args = {"initial_scale": 2.0**16, "min_scale": 1.0, "growth_interval": 3, "hysteresis": 2} | kwargs
    return DynamicLossScaler(**args)


def test_grows_after_a_window_of_finite_steps():
    scaler = dynamic()
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0**16
    scaler.update(found_inf=False)
    assert scaler.scale == 2.0**17 and scaler.growth_tracker == 0


def test_hysteresis_then_backoff_on_every_further_overflow():
    scaler = dynamic()
    scaler.update(found_inf=True)  # first overflow: tolerated (hysteresis 2)
    assert scaler.scale == 2.0**16
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0**15
    scaler.update(found_inf=True)  # the hysteresis is spent until the scale grows again
    assert scaler.scale == 2.0**14


def test_overflow_resets_the_growth_window_and_growth_refills_hysteresis():
    scaler = dynamic()
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)
    assert scaler.growth_tracker == 0 and scaler.hysteresis_tracker == 1
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 2.0**17 and scaler.hysteresis_tracker == 2
    scaler.update(found_inf=True)  # tolerated again
    assert scaler.scale == 2.0**17


def test_never_below_the_minimum():
    scaler = dynamic(initial_scale=8.0, min_scale=2.0, hysteresis=1)
    for _ in range(5):
        scaler.update(found_inf=True)
    assert scaler.scale == 2.0


def test_static_scale_ignores_overflows_and_unscales():
    scaler = LossScaler(1024.0)
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0
    loss = torch.tensor(3.0)
    assert float(scaler.scale_loss(loss)) == 3072.0
    grads = [torch.full((4,), 2048.0), torch.empty(0)]
    scaler.unscale_(grads, factor=torch.tensor(0.5))
    assert torch.equal(grads[0], torch.ones(4))


def test_state_dict_round_trip():
    scaler = dynamic()
    for found_inf in (False, True, True, False):
        scaler.update(found_inf)
    other = dynamic(initial_scale=2.0**30)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict() == {"scale": 2.0**15, "growth_tracker": 1, "hysteresis_tracker": 0}
    other.load_state_dict(LossScaler(1.0).state_dict())  # a bf16 checkpoint: nothing to resume
    assert other.scale == 2.0**15


def test_built_from_megatron_flags_with_megatron_defaults():
    assert build_loss_scaler(parse_args(["--mock-data", "--vocab-size", "64"]).precision).scale == 1.0
    scaler = build_loss_scaler(parse_args(["--mock-data", "--vocab-size", "64", "--fp16"]).precision)
    assert isinstance(scaler, DynamicLossScaler)
    assert (scaler.scale, scaler.min_scale, scaler.growth_interval, scaler.hysteresis) == (2.0**32, 1.0, 1000, 2)
    static = build_loss_scaler(
        parse_args(["--mock-data", "--vocab-size", "64", "--fp16", "--loss-scale", "128"]).precision
    )
    assert type(static) is LossScaler and static.scale == 128.0


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--fp16 --bf16", "--fp16 and --bf16"),
        ("--fp16 --min-loss-scale 0", "--min-loss-scale"),
        ("--fp16 --hysteresis 0", "--hysteresis"),
        ("--fp16 --loss-scale -1", "--loss-scale"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_args(["--mock-data", "--vocab-size", "64", *flags.split()])
    assert "\n" not in str(info.value)
