"""The benchmark's rows: model presets, precision configs and parallel layouts, each config and layout composed from
axes and named by them (scripts/benchmark.py runs them; memory_estimate.py, loss_parity.py and the probes in
scripts/probes/ reuse them).

A config is engine-recipe[-FP8 option...][-loss][-recompute-R]:

    te-bf16                                          Transformer Engine's layers, no FP8
    te-delayed-fp8params-nocalib-fp8attn-chunkce-recompute-block1
        TE, delayed scaling, FP8 weights, no calibration pass, FP8 attention, the chunked loss, 1 layer recomputed

A layout is [tpN_][ppN_][cpN_]engine[_option...] ("1gpu" alone: one GPU, no engine options):

    dp2_distopt_tpamax     two data-parallel ranks, the distributed optimizer, amax reduced over TP only
    tp2_fsdp2              tensor parallelism over two GPUs, each piece sharded by FSDP2 over two data-parallel ranks
    tp2_dp4_fsdp2          ... over four data-parallel ranks (an FSDP engine's dpN: N other than two)

Any composition parses (`config`, `layout`); CONFIGS and LAYOUTS hold the catalogue that runs by default or is
named in the docs. A few older layout names that put the axes in another order stay valid (LAYOUT_ALIASES).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

COMMON = (
    "--mock-data --tokenizer-type NullTokenizer --position-embedding-type rope --normalization RMSNorm --swiglu"
    " --disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention --hidden-dropout 0"
    " --attention-dropout 0 --bf16 --lr 1e-4 --min-lr 1e-5 --eval-iters 0"
)
# --vocab-size 31999 with the NullTokenizer is a vocabulary of 32000 (31999 ids + end-of-document), not padded.
PRESETS = {
    "llama-1b": "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32"
    " --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2"
    " --global-batch-size 16 --vocab-size 31999",
    "llama-8b-4l": "--num-layers 4 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32"
    " --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1"
    " --global-batch-size 8 --vocab-size 31999",
}
# Not run by default: llama-1b at micro-batch 8, four times the activations per micro-batch (recomputation's case);
# the whole Llama-3-8B shape (vocabulary 128256: 128255 ids + end-of-document), two GPUs' worth, and its 32k-token
# sequence for context parallelism.
PRESETS["llama-1b-mbs8"] = PRESETS["llama-1b"].replace("--micro-batch-size 2", "--micro-batch-size 8")
PRESETS["llama3-8b"] = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8"
    " --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 8"
    " --vocab-size 128255"
)
PRESETS["llama3-8b-32k"] = PRESETS["llama3-8b"].replace("8192", "32768")
# The Llama-3-70B shape, one 8-GPU host's worth (docs/benchmarks.md, "Llama-3-70B on one 8-GPU host").
PRESETS["llama3-70b"] = (
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --num-query-groups 8"
    " --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 8"
    " --vocab-size 128255"
)

# ---- configs: engine x recipe x FP8 options x loss x recomputation ----

ENGINES = {"te": "--transformer-impl transformer_engine", "local": "--transformer-impl local"}
RECIPES = {  # name: FP8 flags ("bf16": none)
    "bf16": "",
    "delayed": "--fp8-format hybrid --fp8-recipe delayed",
    "tensorwise": "--fp8-format hybrid --fp8-recipe tensorwise",
    "rowwise": "--fp8-format hybrid --fp8-recipe rowwise",
    "blockwise": "--fp8-format e4m3 --fp8-recipe blockwise",
    "mxfp8": "--fp8-format e4m3 --fp8-recipe mxfp8",
}
PRECISION_AWARE_STATES = (
    "--use-precision-aware-optimizer --main-params-dtype fp16 --exp-avg-dtype fp8 --exp-avg-sq-dtype fp16"
)
CONFIG_OPTIONS = {  # in the order a name lists them
    # every transformer layer in FP8, the first included (Megatron-LM's default; ours keeps the first in bf16)
    "all-fp8": "--no-fp8-first-layer-bf16",
    # FP8 weights (under FSDP: all-gathered as FP8; blockwise: as E4M3 bytes with their 128x128 block scales)
    "fp8params": "--fp8-param-gather",
    # MS-AMP's levels (FP8 gradient communication; O2 also low-precision optimizer states and bf16 gradients)
    "o1": "--fp8-optimizer-level O1",
    "o2": "--fp8-optimizer-level O2",
    # O2's states with fp32 gradient buffers: 2 bytes per parameter more than O2
    "o2-fp32grads": f"--fp8-grad-reduce {PRECISION_AWARE_STATES}",
    # --profile's cost outside its window: Nsight's window over steps 3-4, the numbers average steps after it
    "profile-window": "--profile --profile-step-start 2 --profile-step-end 4 --timing-log-level 0",
    # delayed scaling without its calibration pass (a bf16 forward and backward, which on the 8B under FSDP peaks
    # above the FP8 steps on an 80 GB card)
    "nocalib": "--no-fp8-calibration",
    # FP8 attention: the Llama-3-8B's heads of 128 let cuDNN run it on Hopper
    "fp8attn": "--fp8-dot-product-attention",
    # Smooth-SwiGLU: per-channel power-of-two scales on linear_fc2's input, folded into its weight
    "smooth": "--smooth-swiglu",
}
# the output layer's GEMM and the loss fused a slice of the vocabulary at a time (no logits kept)
LOSSES = {"chunkce": "--cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"}
# activation recomputation (docs/recompute.md): selective (core attention), full (every layer, one at a time),
# blockN (the first N layers whole, the rest keeping their activations)
RECOMPUTE = {
    "selective": "--recompute-activations",
    "full": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
}
_BLOCK = re.compile(r"block(\d+)")


def recompute_flags(name: str) -> str:
    if match := _BLOCK.fullmatch(name):
        return f"--recompute-granularity full --recompute-method block --recompute-num-layers {match.group(1)}"
    if name not in RECOMPUTE:
        raise ValueError(f"unknown recomputation {name!r}: one of {', '.join(RECOMPUTE)} or blockN")
    return RECOMPUTE[name]


@dataclass(frozen=True)
class Config:
    """A precision config by its axes; `name` and `flags` follow from them."""

    engine: str = "te"
    recipe: str = "bf16"
    options: tuple[str, ...] = ()
    loss: str | None = None
    recompute: str | None = None

    @property
    def name(self) -> str:
        parts = [self.engine, self.recipe, *self.options, *([self.loss] if self.loss else [])]
        return "-".join(parts + (["recompute", self.recompute] if self.recompute else []))

    @property
    def flags(self) -> str:
        parts = [ENGINES[self.engine], RECIPES[self.recipe], *(CONFIG_OPTIONS[o] for o in self.options)]
        parts += [LOSSES[self.loss]] if self.loss else []
        parts += [recompute_flags(self.recompute)] if self.recompute else []
        return " ".join(part for part in parts if part)


def config(name: str) -> Config:
    """The config a name spells; ValueError naming the axes' values where it spells none."""
    words = name.split("-")
    if len(words) < 2 or words[0] not in ENGINES or words[1] not in RECIPES:
        raise ValueError(
            f"config {name!r}: engine-recipe first, engine one of {', '.join(ENGINES)}, recipe one of"
            f" {', '.join(RECIPES)}"
        )
    rest, options, loss, recompute = words[2:], [], None, None
    if "recompute" in rest:
        at = rest.index("recompute")
        if at != len(rest) - 2:
            raise ValueError(f"config {name!r}: recompute-R comes last, R one of {', '.join(RECOMPUTE)} or blockN")
        recompute = rest[-1]
        try:
            recompute_flags(recompute)
        except ValueError as error:
            raise ValueError(f"config {name!r}: {error}") from None
        rest = rest[:at]
    if rest and rest[-1] in LOSSES:
        loss, rest = rest[-1], rest[:-1]
    while rest:  # the longest option name first: o2-fp32grads before o2
        option = next((o for n in (2, 1) if (o := "-".join(rest[:n])) in CONFIG_OPTIONS and len(rest) >= n), None)
        if option is None:
            known = ", ".join([*CONFIG_OPTIONS, *LOSSES])
            raise ValueError(f"config {name!r}: unknown option {rest[0]!r}; options are {known}, then recompute-R")
        options.append(option)
        rest = rest[len(option.split("-")) :]
    order = list(CONFIG_OPTIONS)
    composed = Config(words[0], words[1], tuple(sorted(options, key=order.index)), loss, recompute)
    if composed.name != name:
        raise ValueError(f"config {name!r}: write it as {composed.name} (options in the order {', '.join(order)})")
    return composed


_NOCALIB_FP8ATTN = ("fp8params", "nocalib", "fp8attn")
CATALOGUE = (
    Config("te"),
    Config("te", "delayed"),
    Config("te", "delayed", ("all-fp8",)),
    Config("te", "delayed", ("fp8params",)),
    Config("te", "delayed", ("fp8params", "o1")),
    Config("te", "delayed", ("fp8params", "o2")),
    Config("te", "delayed", ("profile-window",)),
    Config("te", "delayed", ("fp8params", "o2-fp32grads")),
    Config("te", "delayed", recompute="selective"),
    Config("te", "delayed", recompute="full"),
    # llama3-8b under fsdp2_o2states: 4 layers recomputed fit H100s (scripts/memory_estimate.py: 61.4 GiB per GPU
    # with 12, 58.0 with 16, 64.9 with 8, 71.9 with none)
    *(Config("te", "delayed", recompute=f"block{n}") for n in (4, 12, 16)),
    # FP8 weights with fewer layers recomputed than O2's states alone allowed
    *(Config("te", "delayed", ("fp8params",), recompute=f"block{n}") for n in (4, 8)),
    # bf16 beside them on the same layout (its activations take more bytes than FP8's)
    *(Config("te", recompute=f"block{n}") for n in (12, 8)),
    # the fewest bytes a Llama-3-8B replica needs per GPU: FP8 weights, every layer recomputed (32k tokens at CP=2)
    Config("te", "delayed", ("fp8params",), recompute="full"),
    Config("te", "delayed", ("fp8attn",)),
    Config("te", "delayed", ("smooth",)),
    Config("te", "delayed", ("fp8params", "nocalib")),
    Config("te", "delayed", _NOCALIB_FP8ATTN),
    # llama3-8b under mfsdp2_o2states on two 80 GB GPUs: out of memory with no layer recomputed, 2 train
    # (docs/fsdp.md)
    *(Config("te", "delayed", _NOCALIB_FP8ATTN, recompute=f"block{n}") for n in (1, 2, 3, 4)),
    Config("te", "delayed", _NOCALIB_FP8ATTN, "chunkce"),
    *(Config("te", "delayed", _NOCALIB_FP8ATTN, "chunkce", f"block{n}") for n in (1, 2)),
    Config("te", "tensorwise"),
    Config("te", "blockwise"),
    Config("te", "blockwise", ("fp8params",)),
    Config("local"),
    Config("local", "delayed"),
    Config("local", "delayed", ("fp8params",)),
    Config("local", "tensorwise"),
    Config("local", "delayed", recompute="full"),
    Config("local", "rowwise"),
    Config("local", "blockwise"),
    Config("local", "mxfp8"),
    # FSDP2 layouts (fsdp2*) only: the row cast gathered for the forward, the column cast for the backward
    # (megatron/parallel/fsdp/fp8_gather_axes.py); the distributed optimizer's local FP8 weights have one scale per
    # tensor
    Config("local", "rowwise", ("fp8params",)),
    Config("local", "mxfp8", ("fp8params",)),
)
CONFIGS = {c.name: c.flags for c in CATALOGUE}
FSDP_ONLY_CONFIGS = ("local-rowwise-fp8params", "local-mxfp8-fp8params")  # run with --layouts fsdp2* (not by default)

GRAPHS = "+graphs"  # suffix of a config run with --cuda-graph-impl transformer_engine

# ---- layouts: model parallelism x data-parallel engine x engine options ----

MODEL_PARALLEL = {  # axis: flags at size N
    "tp": "--tensor-model-parallel-size {} --sequence-parallel",
    "pp": "--pipeline-model-parallel-size {}",
    "cp": "--context-parallel-size {}",
}
# Data-parallel engines. `dpN` is DDP over N ranks and `distopt` the distributed optimizer over the data x context
# group (their gradient reduction overlapped with the backward wherever there is one); the FSDP engines run on two
# data-parallel ranks, or N after a `dpN`.
FSDP_ENGINES = {
    # PyTorch's FSDP2: weights, gradients and states sharded, each layer gathered before use with the next prefetched
    "fsdp2": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fsdp-double-buffer",
    # ... under optim_grads: the gathered weights kept from the first forward to the last backward of a step
    "fsdp2_optim_grads": "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads --fsdp-double-buffer",
    # Megatron-LM's FSDP2 "ZeRO-2": each unit kept gathered from its forward to its backward (one all-gather per unit
    # and micro-batch instead of two; the whole model gathered at the end of each forward)
    "fsdp2_noreshard": "--use-torch-fsdp2 --data-parallel-sharding-strategy optim_grads_params"
    " --torch-fsdp2-no-reshard-after-forward --fsdp-double-buffer",
    # optim_grads on the distributed optimizer's flat buckets (megatron/parallel/fsdp/flat_shards.py): each
    # micro-batch's buckets reduce-scattered into persistent fp32 gradient shards, every bucket allocated only while
    # it is in use
    "mfsdp2_optim_grads": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-grad-reduce"
    " --overlap-param-gather",
}
OVERLAP = "--overlap-grad-reduce"
DISTOPT = "--use-distributed-optimizer"
LAYOUT_OPTIONS = {  # in the order a name lists them
    "tpamax": "--tp-only-amax-red",  # FP8 amaxes reduced over the tensor-parallel group only
    "overlap": "--tp-comm-overlap",  # TE's userbuffers: tensor-parallel communication inside the GEMMs
    "vpp": "--num-layers-per-virtual-pipeline-stage 4",
    # 32 layers (llama3-8b): the last stage one layer short per the output layer's ~2 layers of work (docs/pipeline.md)
    "vpp_balanced": "--pipeline-model-parallel-layout Et*4|t*4|t*5|t*4|t*4|t*4|t*4|t*3L",
    # each micro-batch's reduce-scatter in bf16 (half the bytes; fp32 gradient shards)
    "bf16comm": "--megatron-fsdp-grad-comm-dtype bf16",
    # ... sent as FP8 (e4m3 + a scale per 128 values) and summed in fp32 (O1's gradient communication)
    "fp8comm": "--fp8-grad-reduce",
    # bf16 gradient shards too (2 bytes per parameter less; each shard add in bf16)
    "bf16grads": "--megatron-fsdp-main-grads-dtype bf16",
    # and O2's optimizer states (precision-aware: fp16 main weights + remainder, FP8 / fp16 moments): 10.1 bytes per
    # parameter over the ranks instead of 14
    "o2states": f"--megatron-fsdp-main-grads-dtype bf16 {PRECISION_AWARE_STATES}",
}
# unitsNm: FSDP units of at least N million parameters (fewer, larger collectives, fewer per-unit hooks; under
# optim_grads no more gathered memory, as every unit stays gathered for the step); bNm: buckets of N million
# parameters instead of 40M (fewer reduce-scatters, less host work per micro-batch)
_SIZED = {
    re.compile(r"units(\d+)m"): "--suggested-communication-unit-size {}000000",
    re.compile(r"b(\d+)m"): "--ddp-bucket-size {}000000",
}


def _option_flags(option: str) -> str | None:
    if option in LAYOUT_OPTIONS:
        return LAYOUT_OPTIONS[option]
    return next((flags.format(m.group(1)) for p, flags in _SIZED.items() if (m := p.fullmatch(option))), None)


@dataclass(frozen=True)
class Layout:
    """A parallel layout by its axes; `name`, `gpus` and `flags` follow from them."""

    model_parallel: tuple[tuple[str, int], ...] = ()  # ("tp", 2), ("pp", 2), ("cp", 2): in MODEL_PARALLEL's order
    data_parallel: int = 1
    engine: str = "ddp"  # ddp, distopt or one of FSDP_ENGINES (two data-parallel ranks unless named)
    options: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.data_parallel * math.prod(size for _, size in self.model_parallel)

    @property
    def name(self) -> str:
        parts = [f"{axis}{size}" for axis, size in self.model_parallel]
        if self.engine in FSDP_ENGINES:
            parts += [f"dp{self.data_parallel}"] if self.data_parallel != 2 else []
            parts.append(self.engine)
        else:
            parts += [f"dp{self.data_parallel}"] if self.data_parallel > 1 else []
            parts += ["distopt"] if self.engine == "distopt" else []
            parts = parts if self.model_parallel or self.data_parallel > 1 else ["1gpu", *parts]
        return "_".join(parts + list(self.options))

    @property
    def flags(self) -> str:
        parts = [MODEL_PARALLEL[axis].format(size) for axis, size in self.model_parallel]
        if self.engine in FSDP_ENGINES:
            parts.append(FSDP_ENGINES[self.engine])
        elif self.engine == "distopt":  # one GPU has no reduction to overlap
            parts.append(f"{OVERLAP} {DISTOPT} --overlap-param-gather" if self.gpus > 1 else DISTOPT)
        elif self.data_parallel > 1:
            parts.append(OVERLAP)
        parts += [_option_flags(option) for option in self.options]
        return " ".join(part for part in parts if part)


LAYOUT_ALIASES = {  # older names: the engine before the model parallelism, or the flat buckets without optim_grads
    "fsdp2_tp2": "tp2_fsdp2",
    "fsdp2_cp2": "cp2_fsdp2",
    "mfsdp2_bf16grads": "mfsdp2_optim_grads_bf16grads",
    "mfsdp2_fp8comm": "mfsdp2_optim_grads_fp8comm",
    "mfsdp2_o2states": "mfsdp2_optim_grads_o2states",
}
_MODEL_PARALLEL_WORD = re.compile(r"(tp|pp|cp)(\d+)")


def layout(name: str) -> Layout:
    """The layout a name spells (or an alias of one); ValueError naming the axes' values where it spells none."""
    words = LAYOUT_ALIASES.get(name, name).split("_")
    model_parallel, data_parallel, engine, options = [], 1, "ddp", []
    while words and (match := _MODEL_PARALLEL_WORD.fullmatch(words[0])):
        model_parallel.append((match.group(1), int(match.group(2))))
        words = words[1:]
    named_dp = re.fullmatch(r"dp(\d+)", words[0]) if words else None
    joined = "_".join(words[1:] if named_dp else words)
    fsdp = max((e for e in FSDP_ENGINES if joined == e or joined.startswith(e + "_")), key=len, default=None)
    if fsdp:
        data_parallel = int(named_dp.group(1)) if named_dp else 2
        engine, words = fsdp, words[len(fsdp.split("_")) + bool(named_dp) :]
    else:
        if words[:1] == ["1gpu"]:
            words = words[1:]
        elif words and (match := re.fullmatch(r"dp(\d+)", words[0])):
            data_parallel, words = int(match.group(1)), words[1:]
        if words[:1] == ["distopt"]:
            engine, words = "distopt", words[1:]
    while words:  # the longest option name first: vpp_balanced before vpp
        option = next((o for n in (2, 1) if len(words) >= n and _option_flags(o := "_".join(words[:n]))), None)
        if option is None:
            known = ", ".join([*FSDP_ENGINES, *LAYOUT_OPTIONS, "unitsNm", "bNm"])
            raise ValueError(
                f"layout {name!r}: unknown part {words[0]!r}; [tpN_][ppN_][cpN_](1gpu|dpN)[_distopt] or [dpN_]an"
                f" FSDP engine, then options: {known}"
            )
        options.append(option)
        words = words[len(option.split("_")) :]
    order = list(MODEL_PARALLEL)
    composed = Layout(
        tuple(sorted(model_parallel, key=lambda p: order.index(p[0]))), data_parallel, engine, tuple(options)
    )
    if composed.name != LAYOUT_ALIASES.get(name, name):
        raise ValueError(f"layout {name!r}: write it as {composed.name}")
    return composed


_CATALOGUE_LAYOUTS = (
    "1gpu",
    "1gpu_distopt",  # one GPU's optimizer memory and step time, not sharded
    "dp2",
    "dp2_distopt",
    "dp2_distopt_tpamax",
    "fsdp2",
    "fsdp2_optim_grads",
    "fsdp2_noreshard",
    "mfsdp2_optim_grads",
    "mfsdp2_optim_grads_bf16comm",
    "mfsdp2_optim_grads_bf16comm_b100m",  # llama-1b: 10 buckets instead of 19
    "mfsdp2_optim_grads_bf16comm_b200m",
    "mfsdp2_bf16grads",
    "mfsdp2_fp8comm",
    "mfsdp2_o2states",  # the 8B's weights stay whole (FP8), gradients and states sharded
    "fsdp2_units200m",  # llama-1b: four layers a unit
    "fsdp2_optim_grads_units100m",  # llama-1b: two and four layers a unit; losses bitwise those of one-layer units
    "fsdp2_optim_grads_units200m",
    "fsdp2_bf16comm",
    "fsdp2_fp8comm",  # megatron/parallel/fsdp/fp8_reduce_scatter.py
    "fsdp2_optim_grads_bf16comm",
    "fsdp2_bf16grads",  # the Llama-3-8B shape's fit on 80 GB
    "fsdp2_o2states",  # room for the 8B's activations, so that fewer layers are recomputed
    "fsdp2_o2states_units400m",  # two of the 8B's layers (218M parameters) a unit: half the per-unit host work
    "fsdp2_tp2",  # each tensor-parallel piece sharded over the two data-parallel ranks
    "fsdp2_cp2",  # the four data x context parallel ranks shard everything
    "tp2",
    "tp2_overlap",
    "pp2",
    "pp2_vpp",
    "pp2_vpp_balanced",
    "cp2",
    "cp2_distopt",  # the optimizer's states sharded over the context-parallel pair (the data x context group)
    "tp2_pp2",
    "tp2_dp2",
    "dp4",
)
LAYOUTS = {name: ((row := layout(name)).gpus, row.flags) for name in _CATALOGUE_LAYOUTS}  # name: (GPUs, flags)


def layout_of(name: str) -> tuple[int, str]:
    """(GPUs, flags) of a catalogue layout or any other the axes compose."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    row = layout(name)
    return row.gpus, row.flags


def config_flags(name: str) -> str:
    """The flags of a catalogue config or any other the axes compose (without the +graphs suffix)."""
    return CONFIGS[name] if name in CONFIGS else config(name).flags


def _flag(flags: str, name: str, default: int = 1) -> int:
    match = re.search(rf"{name} (\d+)", flags)
    return int(match.group(1)) if match else default


def train_flags(
    preset: str,
    config: str,
    iters: int,
    log_interval: int,
    layout: str = "1gpu",
    weak: bool = False,
    extra: str = "",
) -> list[str]:
    """pretrain_gpt.py's flags; `weak`: multiply the preset's global batch by the data-parallel size (each GPU then
    runs as many micro-batches per step as one GPU does: weak scaling). A config named `<config>+graphs` adds
    --cuda-graph-impl transformer_engine. `extra`: flags appended to every run (--extra-flags)."""
    gpus, layout_flags = layout_of(layout)
    graphs = " --cuda-graph-impl transformer_engine" if config.endswith(GRAPHS) else ""
    config = config.removesuffix(GRAPHS)
    flags = f"{COMMON} {PRESETS[preset]} {config_flags(config)}{graphs} {layout_flags} --train-iters {iters}"
    flags += f" --log-interval {log_interval} {extra}"
    if weak:
        model_parallel = _flag(layout_flags, "--tensor-model-parallel-size") * _flag(
            layout_flags, "--pipeline-model-parallel-size"
        )
        flags += f" --global-batch-size {_flag(PRESETS[preset], '--global-batch-size') * gpus // model_parallel}"
    return flags.split()
