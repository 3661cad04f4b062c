"""Low-precision optimizer states (`--use-precision-aware-optimizer`): their encodings and the eager AdamW step.

Megatron-LM's precision-aware optimizer with FP8-LM's precision decoupling: the update is computed in fp32, and
the master weights and Adam moments are *stored* in fewer bytes (`--main-params-dtype {fp32,fp16}`,
`--exp-avg-dtype` / `--exp-avg-sq-dtype {fp32,fp16,bf16,fp8}`; MS-AMP's O2 is fp16 / fp8 / fp16).

Encodings (`ScaledState`; x a value, amax the largest |x| of its block; bounds for finite x, rounded to nearest):

    fp32  as is                                        4 B/el    exact
    bf16  x rounded, no scale (fp32's range)           2 B/el    |err| <= 2^-8 |x|
    fp16  x * s, s = 2^15 / amax per block (fp32)      2 + 4/B   |err| <= 2^-11 |x| where |x| >= amax 2^-29, else
                                                                 <= amax 2^-40 (0 at or under it)
    fp8   e4m3fn, x * s, s = 448 / amax per block      1 + 4/B   |err| <= 2^-4 |x| where |x| >= amax 2^-14.8, else
                                                                 <= amax 2^-18.8 (0 at or under it)

A block is a contiguous run of BLOCK elements of the flattened tensor (the last one partial). An all-zero block
has s = 1, and s <= 2^126 (a block with amax < ~1e-36 is encoded coarsely rather than with an infinite scale), so
finite values never encode to inf or NaN; 2^15 keeps fp16 data a factor 2 below its overflow. Second moments
(>= 0, 1e-20..1e2 within a tensor) in fp16 flush only under amax 2^-40 of their block. In fp8 they would flush
under amax 2^-18.8 while m is still nonzero there, and m / (0 + eps) blew the update up 1e2-1e5 times (table). So
an fp8 second moment stores sqrt(v) ("root"): 2^-4 on the sqrt(v) the update uses, (2^-3 + 2^-8) |v| on v, and
flushes only under amax 2^-37.6. Stochastic rounding (below) doubles each bound (one ulp, not half) and makes the
error unbiased.

Block size, measured on a 512 x 2048 weight's Adam moments after 100 steps of heavy-tailed gradients (rows and
columns scaled lognormally, 10% of rows rarely hit); relative RMS errors at beta2 = 0.95 (0.999 looks the same):

    block   scales      m in fp8   m flushed   update, O2   update, m and v fp8   update, m and sqrt(v) fp8
    32      0.125 B/el  0.0169     2.9e-5      0.0255       15.9                  0.0365
    128     0.031 B/el  0.0211     5.9e-5      0.0262       435                   0.0372
    512     0.008 B/el  0.0227     9.1e-5      0.0264       773                   0.0374
    tensor  0           0.0267     3.2e-2      0.0471       1.5e5                 5.67

Per tensor flushes 3% of m and breaks fp8 second moments; from 32 to 512 the update's error barely moves while
the scales' bytes fall 16x. BLOCK = 128: 3% on an fp8 byte, and the 1x128 tiles of the blockwise FP8 recipe.
Scales are exact (448 / amax) rather than powers of two, which at 128 gave 0.0263 instead of 0.0211 for m and
flushed 1.4x more.

Stochastic rounding of the moments (on by default). An exponential average rounded to nearest stops moving once
its step (1 - beta) |g - m| falls below half an ulp, so it sticks anywhere within 2^-p / (1 - beta) of the truth
(p significant bits): 62% for fp8 m, 49% for an fp16 and 390% for a bf16 second moment at beta2 = 0.999.
Measured on full-batch softmax regression (the fp32 run's gradients, 300 steps): fp8 m 33% off rounded to nearest,
3.4% rounded stochastically; bf16 v 18% against 3.0%; fp16 v 1.6% against 0.3%. A 32-128-10 MLP (300 steps, lr
3e-3, 4 seeds) ended 17-21% above the fp32-state loss with O2 rounded to nearest, 0.2-1.0% above with stochastic
rounding. `round_stochastically_` adds a uniform random integer below 2^d to the fp32 bit pattern and clears the d
bits the format lacks; the numbers come from the optimizer's torch.Generator, saved with its state, so a resumed
run is bitwise the uninterrupted one.

fp16 master weights. fp16 keeps 11 significant bits: rounded to nearest, an update below half an ulp (2^-12..2^-11
of the weight) is lost with a fixed scale, and only re-rounded by chance when the block's scale moves (200 updates
of 1e-4 relative: all lost in plain fp16, 17% off on average with block scales). So each fp16 master keeps an int8
remainder: the rounding error of its fp16 write in quanta of ulp(fp16 value) / 256, added back when it is decoded
for the next step (error feedback). (fp16 + remainder * quantum) / s is exact up to one fp32 rounding: ~19
significant bits, |err| <= 2^-18 |x| where |x| >= amax 2^-29 (amax 2^-47 under it); an update is lost only below
half a quantum (2^-20..2^-19 of the weight; fp32: 2^-25..2^-24); the 200 updates above end 0.4% off on average.
Cost: 3 + 4/B bytes per element instead of 4. Alone it moved the final loss of a 32-16-1 tanh MLP by <= 0.005%
(4 seeds; fp8 m alone: up to 5%). A 24-bit block fixed point would fit the same 3 bytes with a finer worst case
(2^-23 of the block max) but a coarser quantum for weights under ~1/16 of their block's max; fp16 + remainder
keeps per-element precision.

Bytes per element at B = 128: fp32 4, bf16 2, fp16 2.031, fp8 1.031, fp16 master 3.031; O2 6.09 against 12 for fp32
states. A step's temporaries peak at about 5.5 fp32 copies of the tensor (measured on 16M elements).
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: Elements per scale block: contiguous runs of the flattened tensor, the last block partial.
BLOCK = 128

DTYPES = ("fp32", "bf16", "fp16", "fp8")
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
# Same-width integer views: a skipped step selects old against new encodings bit for bit, whatever the dtype.
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_BITS[torch.float8_e4m3fn] = torch.uint8
# Largest encoded magnitude: e4m3's max; for fp16 2^15, half of fp16's top binade, so that the fp32 rounding of
# value * scale can never reach fp16's overflow (65520) and fp16 data stays usable with a factor 2 to spare.
_TARGET = {"fp16": 32768.0, "fp8": 448.0}
# Scales stay finite: a block whose amax is below T * 2^-126 (~1e-36 for fp8) gets 2^126 and loses precision (its
# values may flush to zero) instead of an infinite scale.
_MAX_SCALE = 2.0**126
# fp32 mantissa bits below each format's: stochastic rounding drops them.
_DROPPED_BITS = {"bf16": 16, "fp16": 13, "fp8": 20}


def _block_views(flat: torch.Tensor, block: int) -> list[torch.Tensor]:
    """flat [n] as 2-D views: [n // block, block] over whole blocks, [1, n % block] over the partial last one."""
    full = flat.numel() // block * block
    views = [flat[:full].view(-1, block)] if full else []
    if full < flat.numel():
        views.append(flat[full:].view(1, -1))
    return views


def _scale_views(scales: torch.Tensor, numel: int, block: int) -> list[torch.Tensor]:
    """The scales of `_block_views`' views, in the same order."""
    full = numel // block
    return [scales[:full], scales[full:]] if 0 < full < scales.numel() else [scales]


def state_bytes(dtype_name: str, master: bool = False, block: int = BLOCK) -> float:
    """Bytes per element of a state held as `dtype_name` (what `ScaledState.nbytes` comes to on a long tensor): the
    data, an fp32 scale per block for fp16 and fp8, and an fp16 main parameter's int8 remainder (`master`)."""
    scales = 4 / block if dtype_name in _TARGET else 0
    return _STORAGE[dtype_name].itemsize + scales + (1 if master and dtype_name == "fp16" else 0)


def block_scales(amax: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """scale = T / amax per block as fp32 (T = 448 for fp8, 2^15 for fp16), 1 for an all-zero block, at most
    2^126 (a tiny amax), so data = value * scale never overflows and scale is never inf."""
    scale = torch.full_like(amax, _TARGET[dtype_name]).div_(amax).clamp_(max=_MAX_SCALE)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def round_stochastically_(x: torch.Tensor, dtype_name: str, generator: torch.Generator) -> torch.Tensor:
    """fp32 `x` in place to the significant bits of `dtype_name`: up with probability (dropped part) / ulp, so
    E[result] = x. Adds uniform random integers below 2^d to the bit pattern and clears its d low bits (d dropped
    bits; sign-magnitude, so the same for negative values; a carry moves to the next binade as it should). The
    cast that follows is then exact, except in the format's subnormal range, which it rounds to nearest."""
    dropped = _DROPPED_BITS[dtype_name]
    noise = torch.randint(0, 1 << dropped, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    x.view(torch.int32).add_(noise).bitwise_and_(-(1 << dropped))
    return x


def _fp16_quantum(hi: torch.Tensor) -> torch.Tensor:
    """ulp(hi) / 256 for each fp16 element, as fp32: 2^(max(e, 1) - 33) for the biased fp16 exponent e (zero and
    subnormals share e = 1's ulp 2^-24), built from the exponent bits, so exactly a power of two."""
    e = ((hi.view(torch.int16) >> 10) & 0x1F).to(torch.int32).clamp_(min=1)
    return e.add_(127 - 33).bitwise_left_shift_(23).view(torch.float32)


def storage_dtype(dtype_name: str) -> torch.dtype:
    """The torch dtype a state held as `dtype_name` stores its data in."""
    return _STORAGE[dtype_name]


def decode_elements(
    data: torch.Tensor, scales: torch.Tensor | None, remainder: torch.Tensor | None = None, root: bool = False
) -> torch.Tensor:
    """fp32 values of encoded elements given each element's own scale (`scales`: data's shape, or None for fp32
    and bf16): `ScaledState.decode`'s arithmetic element for element, so the same bits (a checkpoint decodes the
    blocks of another layout this way)."""
    out = data.float()
    if scales is None:
        return out
    if remainder is not None:
        out.add_(remainder.float().mul_(_fp16_quantum(data)))
    out.div_(scales)
    return out.square_() if root else out


class ScaledState:
    """fp32 values (any shape) held as fp32, bf16, fp16 or fp8 (e4m3fn), see the module docstring.

    `data` has the values' shape in the storage dtype. fp16 and fp8 add `scales`, fp32 [ceil(numel / block)],
    data ~= value * scale. `remainder=True` (fp16 only: the fp16 master weights) adds int8 `remainder`, the
    rounding error of the fp16 write in units of ulp(data) / 256. `root=True` (fp16, fp8: the fp8 second moment)
    encodes sqrt(value) for values >= 0, which doubles the exponent range. fp32 keeps a given contiguous fp32
    tensor itself (no copy) and writes it in place, so a model's fp32 parameter can be its own master.
    """

    def __init__(
        self,
        value: torch.Tensor,
        dtype_name: str = "fp32",
        *,
        block: int = BLOCK,
        remainder: bool = False,
        root: bool = False,
    ) -> None:
        if dtype_name == "fp32" and value.dtype == torch.float32 and value.is_contiguous():
            self._init(dtype_name, block, remainder, root, data=value.detach())
            return
        self._init(dtype_name, block, remainder, root, shape=value.shape, device=value.device)
        self.encode_(value)

    @classmethod
    def zeros(
        cls,
        shape: torch.Size | tuple[int, ...],
        dtype_name: str,
        *,
        block: int = BLOCK,
        root: bool = False,
        device: torch.device | str | None = None,
    ) -> ScaledState:
        """Zeros (scale 1 everywhere) without an fp32 tensor of that size."""
        state = cls.__new__(cls)
        state._init(dtype_name, block, False, root, shape=torch.Size(shape), device=device)
        return state

    def _init(self, dtype_name, block, remainder, root, *, data=None, shape=None, device=None, scales=None, rem=None):
        if dtype_name not in DTYPES:
            raise ValueError(f"unknown state dtype {dtype_name!r}; use one of {', '.join(DTYPES)}")
        if remainder and dtype_name != "fp16":
            raise ValueError(f"a remainder is kept for fp16 values only, not {dtype_name}")
        if root and (dtype_name not in _TARGET or remainder):
            raise ValueError(f"root encoding is for fp16 and fp8 values without a remainder, not {dtype_name}")
        if int(block) < 1:
            raise ValueError(f"block size {block} must be positive")
        self.dtype_name, self.block, self.root = dtype_name, int(block), bool(root)
        self.data = torch.zeros(shape, dtype=_STORAGE[dtype_name], device=device) if data is None else data
        if dtype_name in _TARGET and scales is None:
            scales = torch.ones(-(-self.numel // self.block), dtype=torch.float32, device=self.data.device)
        self.scales = scales
        if remainder and rem is None:
            rem = torch.zeros(self.data.shape, dtype=torch.int8, device=self.data.device)
        self.remainder = rem

    @property
    def numel(self) -> int:
        return self.data.numel()

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes held: data, scales and remainder."""
        tensors = [t for t in (self.data, self.scales, self.remainder) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self, block: bool = False) -> str:
        """The format in words: 'fp8', or with `block` 'fp8 (block 128)' (unscaled formats have no block)."""
        return self.dtype_name + (f" (block {self.block})" if block and self.scales is not None else "")

    def same_format(self, other: ScaledState) -> bool:
        """Whether `other`'s encodings can be copied here bit for bit: same dtype, block, root and remainder."""
        layout = lambda s: (s.describe(block=True), s.root, s.remainder is not None)  # noqa: E731
        return layout(self) == layout(other)

    def _read(self) -> torch.Tensor:
        """The fp32 values; for fp32 the stored tensor itself (callers must not write to it)."""
        if self.dtype_name == "fp32":
            return self.data
        out = self.data.float()
        if self.scales is None:
            return out
        flat = out.view(-1)
        if self.remainder is not None:
            flat.add_(self.remainder.view(-1).float().mul_(_fp16_quantum(self.data.view(-1))))  # exact: 20 bits
        for view, scale in zip(_block_views(flat, self.block), _scale_views(self.scales, self.numel, self.block)):
            view.div_(scale[:, None])
        return out.square_() if self.root else out

    def decode(self) -> torch.Tensor:
        """The fp32 values, in the values' shape, as a new tensor."""
        out = self._read()
        return out.clone() if out is self.data else out

    def encode_(
        self, value: torch.Tensor, skip: torch.Tensor | None = None, generator: torch.Generator | None = None
    ) -> None:
        """Re-encode from `value` (any float dtype, the same numel) in place, with new scales.

        `skip`: a 0-dim bool tensor; where true every encoding stays as it was, bit for bit, selected on the device
        (no host synchronisation). `generator`: round bf16, fp16 and fp8 data stochastically with its random numbers
        (not the remainder's fp16: that is exact to its quantum). Non-finite values give NaN data: the caller skips
        such steps."""
        if value.numel() != self.numel:
            raise ValueError(f"a value of {value.numel()} elements for a state of {self.numel}; pass the same shape")
        value = value.to(self.data.device, torch.float32).reshape(self.data.shape)
        if self.dtype_name == "fp32":
            self._select(self.data, value, skip)
            return
        if self.scales is None:
            if generator is not None:
                value = round_stochastically_(value.clone(), self.dtype_name, generator)
            self._select(self.data, value.to(self.data.dtype), skip)
            return
        flat = value.view(-1).clamp(min=0).sqrt_() if self.root else value.view(-1)
        views = _block_views(flat, self.block)
        amax = [torch.maximum(v.amax(1), v.amin(1).neg_()) for v in views]  # no |x| temporary
        scales = block_scales(torch.cat(amax), self.dtype_name) if amax else self.scales.clone()
        scaled = torch.empty_like(flat)
        for out, v, scale in zip(_block_views(scaled, self.block), views, _scale_views(scales, self.numel, self.block)):
            torch.mul(v, scale[:, None], out=out)
        limit = _TARGET[self.dtype_name]
        scaled.clamp_(-limit, limit)  # one fp32 ulp above T at most: clamped
        if generator is not None and self.remainder is None:
            round_stochastically_(scaled, self.dtype_name, generator)  # T is representable: no overflow
        data = scaled.to(self.data.dtype)
        if self.remainder is not None:
            # The fp16 write's rounding error in quanta of ulp/256: a difference of neighbours and a division by a
            # power of two, both exact. A tie at +-128 quanta is clamped to 127: one quantum of error at most.
            rest = scaled.sub_(data.float()).div_(_fp16_quantum(data))
            self._select(self.remainder, rest.round_().clamp_(-127, 127).to(torch.int8).view(self.shape), skip)
        self._select(self.data, data.view(self.shape), skip)
        self._select(self.scales, scales, skip)

    @staticmethod
    def _select(target: torch.Tensor, new: torch.Tensor, skip: torch.Tensor | None) -> None:
        if skip is None:
            target.copy_(new)
            return
        bits = _BITS.get(target.dtype, target.dtype)
        target.view(bits).copy_(torch.where(skip, target.view(bits), new.view(bits)))

    def copy_(self, other: ScaledState) -> None:
        """Take `other`'s encodings bit for bit (same format and shape; may live on another device)."""
        self.data.copy_(other.data.view(self.shape))
        for mine, theirs in ((self.scales, other.scales), (self.remainder, other.remainder)):
            if mine is not None:
                mine.copy_(theirs.view(mine.shape))

    def state_dict(self) -> dict[str, Any]:
        """Tensors (references, as torch's state_dicts give), strings, ints and a bool: loads with weights_only."""
        state: dict[str, Any] = {"dtype": self.dtype_name, "block": self.block, "root": self.root, "data": self.data}
        if self.scales is not None:
            state["scales"] = self.scales
        if self.remainder is not None:
            state["remainder"] = self.remainder
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ScaledState:
        """The state `state_dict` saved, on its tensors (not copies)."""
        missing = {"dtype", "block", "data"} - set(state)
        if state.get("dtype") in _TARGET:
            missing |= {"scales"} - set(state)
        if missing:
            raise ValueError(f"not a ScaledState state_dict (missing {sorted(missing)}): save it with state_dict()")
        result = cls.__new__(cls)
        result._init(
            state["dtype"],
            state["block"],
            "remainder" in state,
            state.get("root", False),
            data=state["data"],
            scales=state.get("scales"),
            rem=state.get("remainder"),
        )
        expected = -(-result.numel // result.block)
        if result.scales is not None and result.scales.numel() != expected:
            raise ValueError(f"a {result.describe(True)} state of {result.numel} elements needs {expected} scales")
        return result


def _fp32_of(x: ScaledState | torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(fp32 values, whether they are a temporary the caller may overwrite)."""
    if isinstance(x, ScaledState):
        values = x._read()
        return values, values is not x.data
    return x, False


def _store(x: ScaledState | torch.Tensor, value: torch.Tensor, skip: torch.Tensor | None, generator=None) -> None:
    if isinstance(x, ScaledState):
        x.encode_(value, skip, generator)
    else:
        ScaledState._select(x, value, skip)


def adamw_update_(
    master: ScaledState | torch.Tensor,
    grad: torch.Tensor,
    exp_avg: ScaledState | torch.Tensor,
    exp_avg_sq: ScaledState | torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int | torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """One AdamW step on one tensor, in fp32, in place: torch.optim.AdamW's single-tensor arithmetic, operation for
    operation (decoupled decay p *= 1 - lr*wd, m = lerp(m, g, 1 - b1), v = b2*v + (1 - b2)*g*g, p += (-lr / (1 -
    b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)), then each result is re-encoded in its state's format.

    The update uses the new m and v in fp32, before they are encoded. States are ScaledStates or fp32 tensors;
    `grad` fp32 or bf16. `step`: the step number t counting this step, an int or a 0-dim tensor on the device (then
    the bias corrections are computed there, in fp64). `grad_scale`: the gradient is divided by it (clipping).
    `found_inf`: nonzero leaves master, m and v bit for bit unchanged, decided on the device (no host sync).
    `generator`: round the moments stochastically with it (see the module docstring); None rounds to nearest.
    Temporaries: about 5.5 fp32 copies of the tensor at the peak.
    """
    skip = None if found_inf is None else found_inf.ne(0)
    p, p_owned = _fp32_of(master)
    if grad.numel() != p.numel():
        raise ValueError(f"a gradient of {grad.numel()} elements for a parameter of {p.numel()}; pass its own grad")
    g = grad.reshape(p.shape).float()
    if grad_scale is not None:
        g = g / grad_scale
    if weight_decay != 0:
        p, p_owned = (p.mul_(1 - lr * weight_decay) if p_owned else p.mul(1 - lr * weight_decay)), True
    if isinstance(step, torch.Tensor):
        step = step.to(torch.float64)
        neg_step_size = -lr / (1 - torch.pow(beta1, step))
        bias_correction2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
    else:
        neg_step_size = -(lr / (1 - beta1**step))
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    m = torch.lerp(_fp32_of(exp_avg)[0], g, 1 - beta1)
    v = _fp32_of(exp_avg_sq)[0].mul(beta2).addcmul_(g, g, value=1 - beta2)
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
    # (value * m) / denom, then the add: the operation order of torch's CPU addcdiv_, so fp32 states match it bitwise.
    update = m.mul(neg_step_size).div_(denom)
    del denom
    p = p.add_(update) if p_owned else p.add(update)
    del update
    _store(exp_avg, m, skip, generator)
    _store(exp_avg_sq, v, skip, generator)
    del m, v  # before the master's encoding, the one with the most temporaries
    _store(master, p, skip)
