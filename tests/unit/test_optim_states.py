"""Low-precision optimizer states (megatron.optim.states): encodings' error bounds, scales, overflow and underflow,
the AdamW update against torch's, skipped steps, fp16 masters keeping small updates, O2 training against fp32
states, bitwise resume and conversion between formats."""

import io
import math

import pytest
import torch

from megatron.optim.precision_aware import PrecisionAwareAdamW
from megatron.optim.states import BLOCK, ScaledState, adamw_update_, state_bytes

O2 = dict(main_params_dtype="fp16", exp_avg_dtype="fp8", exp_avg_sq_dtype="fp16")
TO_O2 = "optimizer states converted: main params fp32 -> fp16, exp_avg fp32 -> fp8, exp_avg_sq fp32 -> fp16"


@pytest.fixture(autouse=True)
def seeded():
    """Every test draws the same numbers whatever ran before it."""
    torch.manual_seed(0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def encodings(opt: PrecisionAwareAdamW) -> list[torch.Tensor]:
    """Every encoded tensor of an optimizer (data, scales, remainders), cloned."""
    states = opt.masters + opt.exp_avg + opt.exp_avg_sq
    return [t.clone() for s in states for t in (s.data, s.scales, s.remainder) if t is not None]


def per_element_amax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Each element's block amax, as a tensor like x (flattened)."""
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat.abs(), (0, -flat.numel() % block)).view(-1, block)
    return padded.amax(1).repeat_interleave(block)[: flat.numel()]


def sample(n: int, low: float, high: float, signed: bool = True, seed: int = 0) -> torch.Tensor:
    """Log-uniform magnitudes in [low, high], shuffled, so every block spans the whole range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.empty(n).uniform_(math.log(low), math.log(high), generator=g))
    return x * (torch.randint(0, 2, (n,), generator=g) * 2 - 1) if signed else x


# Bounds (round to nearest): bf16 keeps 8 significant bits, fp16 11, e4m3 4: half an ulp is 2^-8, 2^-11, 2^-4 of
# |x| in the normal range; below it (relative to the block max, see the module docstring) the error is absolute:
# amax 2^-40 for fp16, amax 2^-10 / 448 for fp8. fp16 with remainder: one quantum, ulp/256 <= 2^-18 |x|.
BOUNDS = {
    "fp32": lambda x, amax: torch.zeros_like(x),
    "bf16": lambda x, amax: 2**-8 * x.abs(),
    "fp16": lambda x, amax: 2**-11 * x.abs() + amax * 2**-40,
    "fp8": lambda x, amax: 2**-4 * x.abs() + amax * 2**-10 / 448,
}


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16", "fp8"])
def test_round_trip_error_bounds(dtype_name):
    x = torch.randn(1000, 7) * sample(7000, 1e-3, 1e3).view(1000, 7)  # numel not a multiple of BLOCK
    state = ScaledState(x.clone(), dtype_name)
    err = (state.decode() - x).abs().reshape(-1)
    assert state.decode().shape == x.shape and state.numel == x.numel()
    assert torch.all(err <= BOUNDS[dtype_name](x.reshape(-1), per_element_amax(x)) * (1 + 2**-20))
    assert state.nbytes == {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[dtype_name] * 7000 + (
        4 * math.ceil(7000 / BLOCK) if dtype_name in ("fp16", "fp8") else 0
    )


def test_fp16_with_remainder_keeps_19_bits():
    """|err| <= one quantum ulp16/256 <= 2^-18 |x| (plus one fp32 rounding in each of * s and / s); under fp16's
    normal range (amax 2^-29) the quantum is 2^-32 / s = amax 2^-47."""
    x = torch.randn(5000) * sample(5000, 1e-4, 1e2)
    state = ScaledState(x, "fp16", remainder=True)
    err = (state.decode() - x).abs()
    assert torch.all(err <= (2**-18 + 2**-22) * x.abs() + per_element_amax(x) * 2**-47)
    assert state.nbytes == 3 * 5000 + 4 * math.ceil(5000 / BLOCK)


def test_root_encoding_of_second_moments():
    """sqrt(v) in e4m3: fp8's bound on sqrt(v) (2^-4 relative, sqrt(amax) 2^-18.8 absolute below the normal
    range), so (1 + 2^-4)^2 - 1 relative on v; flushed only under amax 2^-37.6 of the block, not 2^-18.8."""
    v = sample(4096, 1e-20, 1e2, signed=False)
    decoded = ScaledState(v, "fp8", root=True).decode()
    amax = per_element_amax(v)
    assert torch.isfinite(decoded).all() and (decoded >= 0).all()
    assert torch.all((decoded.sqrt() - v.sqrt()).abs() <= BOUNDS["fp8"](v.sqrt(), amax.sqrt()) * (1 + 2**-20))
    assert torch.all(decoded[v > amax * 2**-37.6] != 0)
    normal = v > amax * 2**-29.6
    assert torch.all((decoded - v).abs()[normal] <= ((1 + 2**-4) ** 2 - 1) * v[normal])


def test_empty_tensors_step():
    """A data-parallel rank whose shard holds only padding has empty pieces."""
    opt = PrecisionAwareAdamW([torch.zeros(0), torch.randn(3)], [0.1, 0.0], lr=1e-2, **O2)
    opt.step([torch.zeros(0), torch.randn(3)])
    assert opt.master(0).shape == (0,) and opt.exp_avg[0].scales.numel() == 0


def test_zero_tensors_and_zero_blocks():
    for name in ("bf16", "fp16", "fp8"):
        state = ScaledState(torch.zeros(300), name)
        assert torch.equal(state.decode(), torch.zeros(300))
        if state.scales is not None:
            assert torch.equal(state.scales, torch.ones(3))  # an all-zero block gets scale 1
    x = torch.cat([torch.zeros(BLOCK), torch.randn(BLOCK)])
    state = ScaledState(x, "fp8")
    assert state.scales[0] == 1 and torch.equal(state.decode()[:BLOCK], torch.zeros(BLOCK))


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("low, high, signed", [(1e-8, 1e4, True), (1e-20, 1e2, False)])
def test_wide_ranges_stay_finite_and_flush_only_tiny_values(dtype_name, low, high, signed):
    x = sample(10_000, low, high, signed)
    decoded = ScaledState(x, dtype_name).decode()
    assert torch.isfinite(decoded).all()
    amax = per_element_amax(x)
    # Flushing to zero is bounded: above these fractions of the block max a value always survives.
    survives = {"bf16": 0.0, "fp16": 2**-40, "fp8": 2**-10 / 448}[dtype_name]
    assert torch.all(decoded[x.abs() > amax * survives] != 0)


def test_extreme_amax_gives_finite_scales():
    tiny = torch.full((BLOCK,), 1e-40)  # an fp32 subnormal: 448 / amax would overflow
    huge = torch.full((BLOCK,), 3e38)
    for name in ("fp16", "fp8"):
        for x in (tiny, huge, torch.cat([tiny, huge])):
            state = ScaledState(x, name)
            assert torch.isfinite(state.scales).all() and torch.isfinite(state.decode()).all()
        assert torch.allclose(ScaledState(huge, name).decode(), huge, rtol=2**-4)


def test_scales_follow_new_values_and_skip_keeps_the_old_bits():
    x = torch.randn(1000)
    state = ScaledState(x, "fp8")
    old_data, old_scales = state.data.clone(), state.scales.clone()
    state.encode_(1000 * x, skip=torch.tensor(True))
    assert same_bits(state.data, old_data) and same_bits(state.scales, old_scales)
    state.encode_(1000 * x, skip=torch.tensor(False))
    torch.testing.assert_close(state.scales, old_scales / 1000, rtol=1e-6, atol=0)
    err = (state.decode() - 1000 * x).abs()
    assert torch.all(err <= BOUNDS["fp8"](1000 * x, per_element_amax(1000 * x)) * (1 + 2**-20))
    block_amax = (1000 * x).view(-1)[: 7 * BLOCK].view(7, BLOCK).abs().amax(1)
    torch.testing.assert_close(state.scales[:7], 448 / block_amax)
    assert state.scales[7] == torch.tensor(448.0) / (1000 * x[7 * BLOCK :]).abs().max()  # the partial block's own


def test_scaled_state_dict_round_trip_through_torch_save():
    x = torch.randn(40, 9)
    for kwargs in (dict(dtype_name="fp8"), dict(dtype_name="fp16", remainder=True), dict(dtype_name="bf16")):
        state = ScaledState(x, **kwargs)
        buffer = io.BytesIO()
        torch.save(state.state_dict(), buffer)
        buffer.seek(0)
        loaded = ScaledState.from_state_dict(torch.load(buffer, weights_only=True))
        assert loaded.same_format(state) and torch.equal(loaded.decode(), state.decode())
    with pytest.raises(ValueError, match="scales"):
        ScaledState.from_state_dict({"dtype": "fp8", "block": 128, "data": torch.zeros(300, dtype=torch.uint8)})


def torch_adamw_pair(steps: int = 20):
    torch.manual_seed(0)
    values = [torch.randn(300, 7), torch.randn(129)]
    ref = [v.clone().requires_grad_() for v in values]
    groups = [{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    torch_opt = torch.optim.AdamW(groups, foreach=False, fused=False, **kwargs)
    ours = PrecisionAwareAdamW([v.clone() for v in values], [0.1, 0.0], **kwargs)
    for _ in range(steps):
        grads = [torch.randn_like(v) for v in values]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        torch_opt.step()
        ours.step(grads, 1e-2)
    return torch_opt, ref, ours


def test_all_fp32_matches_torch_adamw_bitwise():
    torch_opt, ref, ours = torch_adamw_pair()
    for i, p in enumerate(ref):
        state = torch_opt.state[p]
        assert torch.equal(ours.master(i), p.detach())
        assert torch.equal(ours.exp_avg[i].decode(), state["exp_avg"])
        assert torch.equal(ours.exp_avg_sq[i].decode(), state["exp_avg_sq"])
    assert ours.step_count == 20


def test_fp32_masters_are_updated_in_place():
    """An fp32 master is the caller's tensor itself: a model's fp32 parameter can be its own master."""
    param = torch.randn(10)
    opt = PrecisionAwareAdamW([param], [0.0], lr=0.1)
    before = param.clone()
    opt.step([torch.ones(10)])
    assert torch.equal(param, opt.master(0)) and not torch.equal(param, before)


@pytest.mark.parametrize(
    "dtypes", [{}, O2, dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8")], ids=["fp32", "O2", "mix"]
)
def test_found_inf_skips_the_step_bitwise(dtypes):
    opt = PrecisionAwareAdamW([torch.randn(300), torch.randn(4, 5)], [0.1, 0.0], lr=1e-2, **dtypes)
    initial = encodings(opt)
    opt.step([torch.randn(300), torch.randn(4, 5)], found_inf=torch.tensor(1.0))  # a first step divides by 1 - b^0
    assert all(same_bits(a, b) for a, b in zip(initial, encodings(opt))) and opt.step_count == 0
    opt.step([torch.randn(300), torch.randn(4, 5)])
    before = encodings(opt)
    poisoned = [torch.full((300,), float("inf")), torch.full((4, 5), float("nan"))]
    opt.step(poisoned, grad_scale=torch.tensor(2.0), found_inf=torch.tensor(1.0))
    assert all(same_bits(a, b) for a, b in zip(before, encodings(opt)))
    assert opt.step_count == 1  # the skipped step does not count (bias correction)
    opt.step([torch.randn(300), torch.randn(4, 5)], found_inf=torch.tensor(0.0))
    assert opt.step_count == 2 and all(torch.isfinite(opt.master(i)).all() for i in range(2))


def test_grad_scale_divides_the_gradient():
    grads = [torch.randn(300), torch.randn(20)]
    plain, scaled = (PrecisionAwareAdamW([torch.ones(300), torch.ones(20)], [0.1, 0.0], lr=1e-2) for _ in range(2))
    for _ in range(3):
        plain.step(grads)
        scaled.step([4 * g for g in grads], grad_scale=torch.tensor(4.0))
    assert all(torch.equal(plain.master(i), scaled.master(i)) for i in range(2))


def test_bf16_gradients_are_accepted():
    opt = PrecisionAwareAdamW([torch.randn(300)], [0.0], lr=1e-2, **O2)
    opt.step([torch.randn(300, dtype=torch.bfloat16)])
    assert torch.isfinite(opt.master(0)).all()


def test_fp16_masters_keep_small_updates():
    """200 updates of 1e-6 on weights ~1e-2 (1e-4 relative, below fp16's half ulp 2.4e-4..4.9e-4). A plain fp16
    tensor loses all of them; with the remainder each write errs by at most half a quantum (ulp/512 <= 2^-19 |w|)
    plus two fp32 roundings (2^-23 |w|), so the total is within 200 * (2^-19 + 2^-23) max |w| of fp32's (2.5% of the
    2e-4 moved). Block-scaled fp16 without a remainder re-rounds at every new scale: off by ~17% on average."""
    w = 1e-2 * (0.8 + 0.4 * torch.rand(4096, generator=torch.Generator().manual_seed(0)))
    fp32, fp16 = w.clone(), w.half()
    scaled, kept = ScaledState(w, "fp16"), ScaledState(w, "fp16", remainder=True)
    start_scaled, start_kept = scaled.decode(), kept.decode()
    for _ in range(200):
        fp32 += 1e-6
        fp16 = (fp16.float() + 1e-6).half()
        scaled.encode_(scaled.decode() + 1e-6)
        kept.encode_(kept.decode() + 1e-6)
    moved = fp32 - w
    assert torch.equal(fp16, w.half())  # every update lost
    err = (kept.decode() - start_kept - moved).abs()
    assert torch.all(err <= 200 * (2**-19 + 2**-23) * w.abs().max())
    assert err.mean() < 0.01 * moved.mean()
    assert (scaled.decode() - start_scaled - moved).abs().mean() > 0.1 * moved.mean()


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16", "fp8"])
def test_stochastic_rounding_is_unbiased_within_one_ulp(dtype_name):
    """One ulp (twice the nearest bounds) at most, and unbiased: the mean of 64 encodings is >4x closer than one."""
    x = torch.randn(4096)
    generator = torch.Generator().manual_seed(0)
    state = ScaledState.zeros(x.shape, dtype_name)
    decoded = []
    for _ in range(64):
        state.encode_(x, generator=generator)
        decoded.append(state.decode())
    decoded = torch.stack(decoded)
    assert torch.all((decoded - x).abs() <= 2 * BOUNDS[dtype_name](x, per_element_amax(x)) * (1 + 2**-20))
    assert (decoded.mean(0) - x).abs().mean() < 0.25 * (decoded[0] - x).abs().mean()


def test_stochastic_rounding_tracks_a_slowly_moving_average():
    """Rounded to nearest, m <- 0.9 m + 0.1 g sticks once 0.1 |g - m| is below half an ulp: anywhere within
    2^-4 / 0.1 = 62% of the truth in fp8. Stochastic rounding is unbiased and follows it. The gradients of 150
    full-batch Adam steps on a softmax regression; the fp32 m is the truth (measured: 47% against 3.9%)."""
    g = torch.Generator().manual_seed(0)
    x, teacher = torch.randn(1024, 32, generator=g), torch.randn(32, 10, generator=g)
    labels = torch.multinomial(torch.softmax(x @ teacher, 1), 1, generator=g).squeeze(1)
    w, m, v = torch.zeros(32, 10), torch.zeros(32, 10), torch.zeros(32, 10)
    nearest, stochastic = ScaledState.zeros((32, 10), "fp8"), ScaledState.zeros((32, 10), "fp8")
    generator = torch.Generator().manual_seed(1)
    for t in range(150):
        wg = w.clone().requires_grad_()
        torch.nn.functional.cross_entropy(x @ wg, labels).backward()
        nearest.encode_(0.9 * nearest.decode() + 0.1 * wg.grad)
        stochastic.encode_(0.9 * stochastic.decode() + 0.1 * wg.grad, generator=generator)
        adamw_update_(w, wg.grad, m, v, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=t + 1)
    error = lambda state: ((state.decode() - m).norm() / m.norm()).item()
    assert error(nearest) > 0.25 and error(stochastic) < 0.08


def train_mlp(dtypes: dict, seed: int, steps: int = 200, lr: float = 3e-3) -> float:
    """A 32-128-10 ReLU classifier on 2048 fixed random samples, full batch, warm-up and cosine decay."""
    g = torch.Generator().manual_seed(seed)
    x, teacher = torch.randn(2048, 32, generator=g), torch.randn(32, 10, generator=g)
    labels = torch.multinomial(torch.softmax(x @ teacher, 1), 1, generator=g).squeeze(1)
    weights = [torch.randn(32, 128, generator=g) / 32**0.5, torch.zeros(128)]
    weights += [torch.randn(128, 10, generator=g) / 128**0.5, torch.zeros(10)]
    opt = PrecisionAwareAdamW(weights, [0.01, 0.0, 0.01, 0.0], lr=lr, betas=(0.9, 0.95), **dtypes)
    for t in range(steps):
        w1, b1, w2, b2 = (opt.master(i).requires_grad_() for i in range(4))
        loss = torch.nn.functional.cross_entropy(torch.relu(x @ w1 + b1) @ w2 + b2, labels)
        loss.backward()
        opt.step(
            [w1.grad, b1.grad, w2.grad, b2.grad], lr * min(1, (t + 1) / 20) * 0.5 * (1 + math.cos(math.pi * t / steps))
        )
    return loss.item()


def test_o2_training_ends_within_1_percent_of_fp32_states():
    """fp16 masters + fp8 exp_avg + fp16 exp_avg_sq (MS-AMP O2). Over 6 seeds this ended -0.16..+0.30% from the
    fp32-state loss (0.26); rounding the moments to nearest instead ended 17-21% above it (300 steps)."""
    reference = train_mlp({}, seed=0)
    o2 = train_mlp(O2, seed=0)
    assert abs(o2 - reference) / reference < 0.01, (o2, reference)


def test_resume_is_bitwise_exact():
    def run(opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.step([torch.randn(300, generator=g), torch.randn(5, 7, generator=g)], 1e-2)

    make = lambda: PrecisionAwareAdamW([torch.randn(300), torch.randn(5, 7)], [0.1, 0.0], lr=1e-2, **O2)
    torch.manual_seed(0)
    first = make()
    run(first, 10, seed=1)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    run(first, 10, seed=2)
    torch.manual_seed(1)
    resumed = make()  # other initial values: everything comes from the checkpoint
    buffer.seek(0)
    assert resumed.load_state_dict(torch.load(buffer, weights_only=True)) is None
    run(resumed, 10, seed=2)
    assert resumed.step_count == first.step_count == 20
    assert all(same_bits(a, b) for a, b in zip(encodings(first), encodings(resumed)))
    assert all(torch.equal(first.master(i), resumed.master(i)) for i in range(2))


def test_conversion_between_formats_gives_a_note():
    values = [torch.randn(300), torch.randn(5, 7)]
    fp32 = PrecisionAwareAdamW([v.clone() for v in values], [0.1, 0.0], lr=1e-2)
    fp32.step([torch.randn(300), torch.randn(5, 7)])
    o2 = PrecisionAwareAdamW([v.clone() for v in values], [0.1, 0.0], lr=1e-2, **O2)
    assert o2.load_state_dict(fp32.state_dict()) == TO_O2
    for i in range(2):
        torch.testing.assert_close(o2.master(i), fp32.master(i), rtol=2**-17, atol=0)
        assert torch.isfinite(o2.exp_avg[i].decode()).all() and torch.isfinite(o2.exp_avg_sq[i].decode()).all()
    assert o2.step_count == 1
    # Back to fp32, and to another block size.
    back = PrecisionAwareAdamW([torch.zeros(300), torch.zeros(5, 7)], [0.1, 0.0], lr=1e-2)
    assert back.load_state_dict(o2.state_dict()) == (
        "optimizer states converted: main params fp16 -> fp32, exp_avg fp8 -> fp32, exp_avg_sq fp16 -> fp32"
    )
    assert all(torch.equal(back.master(i), o2.master(i)) for i in range(2))  # fp16 + remainder decodes exactly
    other = PrecisionAwareAdamW([torch.zeros(300), torch.zeros(5, 7)], [0.1, 0.0], lr=1e-2, block_size=32, **O2)
    assert other.load_state_dict(o2.state_dict()) == (
        "optimizer states converted: main params fp16 (block 128) -> fp16 (block 32),"
        " exp_avg fp8 (block 128) -> fp8 (block 32), exp_avg_sq fp16 (block 128) -> fp16 (block 32)"
    )
    assert all(torch.isfinite(other.exp_avg_sq[i].decode()).all() for i in range(2))


def test_fp32_state_dict_round_trips_with_torch_adamw():
    """The plain form carries torch.optim.AdamW's state both ways; continuing from it matches torch's run."""
    torch_opt, ref, ours = torch_adamw_pair(steps=5)
    plain = ours.fp32_state_dict()
    assert plain["step"] == 5 and all(isinstance(t, torch.Tensor) for t in plain["masters"])
    restored = PrecisionAwareAdamW([torch.zeros(300, 7), torch.zeros(129)], [0.1, 0.0], lr=1e-2, betas=(0.9, 0.95))
    from_torch = {"step": int(torch_opt.state[ref[0]]["step"]), "masters": [p.detach().clone() for p in ref]}
    from_torch.update({k: [torch_opt.state[p][k].clone() for p in ref] for k in ("exp_avg", "exp_avg_sq")})
    assert restored.load_state_dict(from_torch) is None  # all fp32: nothing converted
    grads = [torch.randn(300, 7), torch.randn(129)]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    torch_opt.step()
    restored.step(grads, 1e-2)
    assert all(torch.equal(restored.master(i), ref[i].detach()) for i in range(2))
    o2 = PrecisionAwareAdamW([torch.zeros(300, 7), torch.zeros(129)], [0.1, 0.0], lr=1e-2, **O2)
    assert o2.load_fp32_state_dict(plain) == TO_O2


def test_mismatches_fail_with_one_line():
    opt = PrecisionAwareAdamW([torch.zeros(300), torch.zeros(5, 7)], [0.1, 0.0], lr=1e-2)
    fewer = PrecisionAwareAdamW([torch.zeros(300)], [0.1], lr=1e-2)
    reshaped = PrecisionAwareAdamW([torch.zeros(300), torch.zeros(7, 5)], [0.1, 0.0], lr=1e-2)
    with pytest.raises(ValueError, match="holds 1 masters tensors, this optimizer 2"):
        opt.load_state_dict(fewer.state_dict())
    with pytest.raises(ValueError, match=r"masters\[1\] has shape \(7, 5\)"):
        opt.load_state_dict(reshaped.state_dict())
    with pytest.raises(ValueError, match="shape"):
        opt.load_fp32_state_dict(reshaped.fp32_state_dict())
    with pytest.raises(ValueError, match="1 gradients for 2 tensors"):
        opt.step([torch.zeros(300)])
    with pytest.raises(ValueError, match="--main-params-dtype bf16"):
        PrecisionAwareAdamW([torch.zeros(3)], [0.0], lr=1.0, main_params_dtype="bf16")
    with pytest.raises(ValueError, match="--exp-avg-sq-dtype fp4"):
        PrecisionAwareAdamW([torch.zeros(3)], [0.0], lr=1.0, exp_avg_sq_dtype="fp4")
    for line in ("holds", "shape", "gradients"):
        assert "\n" not in line


def test_bytes_per_element_for_the_startup_log():
    sizes = [torch.zeros(BLOCK * 10), torch.zeros(BLOCK * 6)]
    o2 = PrecisionAwareAdamW(sizes, [0.0, 0.0], lr=1.0, **O2).bytes_per_element()
    assert o2 == {"master": 3 + 4 / BLOCK, "exp_avg": 1 + 4 / BLOCK, "exp_avg_sq": 2 + 4 / BLOCK}
    fp32 = PrecisionAwareAdamW([torch.zeros(BLOCK)], [0.0], lr=1.0).bytes_per_element()
    assert fp32 == {"master": 4.0, "exp_avg": 4.0, "exp_avg_sq": 4.0}


def test_adamw_update_on_plain_tensors_with_a_device_step():
    """The function itself: plain fp32 states and an int or 0-dim tensor step give the same bits."""
    p1, m1, v1 = torch.randn(50), torch.zeros(50), torch.zeros(50)
    p2, m2, v2 = p1.clone(), m1.clone(), v1.clone()
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    for t in range(1, 6):
        grad = torch.randn(50)
        adamw_update_(p1, grad, m1, v1, step=t, **kwargs)
        adamw_update_(p2, grad, m2, v2, step=torch.tensor(float(t), dtype=torch.float64), **kwargs)
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8"])
def test_state_bytes_is_what_a_state_holds(name):
    """The memory estimate's bytes per element (`state_bytes`) against a state's actual bytes, whole blocks."""
    value = torch.randn(100 * BLOCK)
    assert ScaledState(value, name).nbytes == state_bytes(name) * value.numel()
    if name == "fp16":
        assert ScaledState(value, name, remainder=True).nbytes == state_bytes(name, master=True) * value.numel()
