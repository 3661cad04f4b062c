"""The start-of-run memory estimate of benchmark rows, without a GPU: the flags `scripts/benchmark.py` runs, parsed as
`pretrain_gpt.py` parses them, the parameters counted from the shapes (`megatron.perf.work.param_count`), and the
line `megatron/training/memory.py` prints at startup (rank 0's).

    python scripts/memory_estimate.py llama-1b te-delayed fsdp2 dp2_distopt
    python scripts/memory_estimate.py llama3-8b te-delayed-recompute-block12 fsdp2_o2states
    python scripts/memory_estimate.py llama3-8b te-delayed-fp8params fsdp2_o2states \
        --extra "--recompute-granularity full --recompute-method block --recompute-num-layers 12"
    python scripts/memory_estimate.py llama3-70b te-delayed-fp8params-recompute-full dp8_fsdp2_o2states tp8

Any config and layout the axes of megatron/perf/rows.py compose is accepted, not only the catalogue's.

Transformer Engine's configs are parsed with the local layers (parsing TE's needs TE and a GPU) and then marked as
TE's: the estimate reads --transformer-impl, the shapes and the precision and parallel flags only.
"""

from __future__ import annotations

import argparse

from benchmark import axes_type

from megatron.config import Config, parse_args
from megatron.data.tokenizers import build_tokenizer, padded_vocab_size
from megatron.perf.rows import PRESETS, config_flags, layout_of, train_flags
from megatron.perf.work import param_count

TE_FLAG = "--transformer-impl transformer_engine"
TE_ONLY = "--fp8-dot-product-attention"  # refused with the local layers: dropped for parsing, set again after


def estimate(preset: str, config: str, layout: str, extra: str = "") -> tuple[Config, dict[str, float], list[str]]:
    """(the parsed configuration, `estimate_bytes`'s numbers, the startup line) of one benchmark row, with the flags
    `extra` appended; under pipeline parallelism those of the pipeline rank with the largest total."""
    from megatron.training.memory import estimate_bytes, memory_estimate_lines

    te = TE_FLAG in config_flags(config.removesuffix("+graphs"))
    flags = " ".join(train_flags(preset, config, 10, 1, layout)) + f" {extra}"
    local = flags.replace(TE_FLAG, "--transformer-impl local").replace(TE_ONLY, "")
    cfg = parse_args(local.split(), world_size=layout_of(layout)[0])
    if te:
        cfg.model.transformer_impl = "transformer_engine"
        cfg.precision.fp8_dot_product_attention = TE_ONLY in flags
    vocab = padded_vocab_size(
        build_tokenizer(cfg.data).vocab_size,
        cfg.data.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size,
    )
    params, fp8_weights = param_count(cfg, vocab)
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    matrix = vocab * m.hidden_size // cfg.parallel.tensor_model_parallel_size
    untied = m.untie_embeddings_and_output_weights
    layer = (params - matrix * (2 if untied else 1) - m.hidden_size) / m.num_layers  # the final norm aside
    fp8_layer = fp8_weights / max(len(cfg.precision.fp8_layer_numbers(m.num_layers)), 1)
    fp8_numbers = set(cfg.precision.fp8_layer_numbers(m.num_layers))
    dtype = cfg.precision.params_dtype
    worst: tuple[dict[str, float], list[str]] | None = None
    for rank in range(pp):  # each pipeline rank's estimate; the busiest one's is the run's
        layers = [n for chunk in cfg.stage_chunks(rank) for n in chunk]
        first, last = rank == 0, rank == pp - 1
        stage = len(layers) * layer + matrix * (int(first) + int(last and (untied or pp > 1))) + m.hidden_size * last
        stage_fp8 = round(fp8_layer * len(fp8_numbers.intersection(layers)))
        # FP8 parameters (TE's or local ones) only without FSDP, which gathers FP8 weights from high-precision shards
        fp8_params = stage_fp8 if cfg.precision.fp8_param_gather and not cfg.sharding.fsdp2 else 0
        est = estimate_bytes(cfg, round(stage), vocab, dtype, pp_rank=rank, fp8_params=fp8_params)
        if worst is None or est["total"] > worst[0]["total"]:
            worst = est, memory_estimate_lines(cfg, est, round(stage), dtype, fp8_params=fp8_params)
    assert worst is not None
    return cfg, *worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("config", type=axes_type(lambda name: config_flags(name.removesuffix("+graphs"))))
    parser.add_argument("layouts", nargs="+", type=axes_type(layout_of))
    parser.add_argument("--extra", default="", help="flags appended to the row's (a recomputation, ...)")
    parser.add_argument(
        "--capacity-gib", type=float, help="a GPU's memory (H200: 139.8): each row says whether it leaves enough"
    )
    args = parser.parse_args()
    for layout in args.layouts:
        _, est, lines = estimate(args.preset, args.config, layout, args.extra)
        total = est["total"] / 2**30
        print(f"{args.preset} {args.config}{' ' + args.extra if args.extra else ''} {layout}: {total:.2f} GiB")
        if args.capacity_gib:
            print(f"  {capacity_verdict(total, args.capacity_gib)}")
        for line in lines:
            print(f"  {line}")


def capacity_verdict(total_gib: float, capacity_gib: float) -> str:
    """Whether an estimate fits a GPU of `capacity_gib` with room for what it does not count (`UNCOUNTED_GIB`)."""
    from megatron.training.memory import UNCOUNTED_GIB, headroom_note

    if total_gib > capacity_gib:
        return f"does not fit: {total_gib - capacity_gib:.1f} GiB over {capacity_gib:g} GiB"
    return headroom_note(total_gib, capacity_gib) or (
        f"fits: leaves {capacity_gib - total_gib:.1f} GiB of {capacity_gib:g} GiB (about {UNCOUNTED_GIB:g} needed"
        " beyond the estimate)"
    )


if __name__ == "__main__":
    main()
