"""What a run prints before its first step (rank 0, Megatron-LM's arguments block first): the flags, the notes, the
device and layout, the padded vocabulary, the parameter count, the memory estimate and the FP8 and model summaries;
the configuration written as config.json beside the run's outputs (and into TensorBoard); and the line at the end
that says where those outputs are."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron.checkpoint.save_folder import write_atomically
from megatron.config import Config
from megatron.config.batch_schedule import BatchSchedule
from megatron.config.pipeline_split import layout_line
from megatron.model import GPTModel, Stage, count_parameters
from megatron.model.layers import is_fp8_param
from megatron.parallel import ParallelDims
from megatron.parallel.pipeline import schedule_line

from .logger import TensorBoardWriter, print_rank_0
from .memory import print_memory_estimate


def print_arguments(cfg: Config) -> None:
    print_rank_0("------------------------ arguments ------------------------")
    for values in cfg.to_dict().values():
        if isinstance(values, dict):
            for key, value in sorted(values.items()):
                print_rank_0(f"  {key} {'.' * max(1, 40 - len(key))} {value}")
    print_rank_0("-------------------- end of arguments ---------------------")
    for note in cfg.notes:
        print_rank_0(f"note: {note}")


def print_layout(
    cfg: Config, dims: ParallelDims, device: torch.device, stage: Stage, schedule: BatchSchedule, train_iters: int
) -> None:
    """The device, the parallel sizes, the micro-batches of a step and the pipeline's schedule and layout."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_rank_0(
        f"> device: {device} ({name}), world size {dims.world_size}, data-parallel size {dims.dp},"
        + (f" context-parallel size {dims.cp}," if dims.cp > 1 else "")
        + f" {cfg.num_micro_batches} micro-batches of {cfg.training.micro_batch_size} per step"
    )
    if dims.pp > 1:
        print_rank_0(f"> {schedule_line(dims.pp, stage.num_chunks, cfg.num_micro_batches)}")
    if cfg.pipeline_layout is not None:
        print_rank_0(f"> {layout_line(cfg.pipeline_layout, dims.pp, cfg.model.num_layers)}")
    if not schedule.is_constant:
        phases = ", ".join(f"{batch} from sample {start}" for start, batch in schedule.phases)
        print_rank_0(f"> global batch size schedule: {phases}; {train_iters} iterations")


def print_model(
    cfg: Config, dims: ParallelDims, true_vocab_size: int, vocab_size: int, model: GPTModel, fp8_lines: list[str]
) -> float:
    """The vocabulary padded from `true_vocab_size` (the tokenizer's) to `vocab_size`, the parameters, the memory
    estimate (returned, GiB: printed again beside the measured peak at the end), the FP8 engine's summary
    (`fp8_lines`) and the model's."""
    print_rank_0(
        f"> padded vocab (size: {true_vocab_size}) with"
        f" {vocab_size - true_vocab_size} dummy tokens (new size: {vocab_size})"
    )
    params = count_parameters(model)
    if dims.tp * dims.pp > 1:
        print_rank_0(f"> number of parameters on (tensor, pipeline) model parallel rank (0, 0): {params:,}")
    else:
        print_rank_0(f"> number of parameters: {params:,}")
    fp8_params = sum(p.numel() for p in model.parameters() if is_fp8_param(p))
    device = next(model.parameters()).device
    estimate_gib = print_memory_estimate(cfg, dims, params, vocab_size, fp8_params, device)
    for line in fp8_lines:
        print_rank_0(f"> fp8: {line}")
    for line in model.describe():
        print_rank_0(f"> {line}")
    return estimate_gib


def config_dir(cfg: Config) -> str | None:
    """Where config.json goes: the first of --log-dir, --save, --tensorboard-dir given."""
    return cfg.logging.log_dir or cfg.checkpoint.save or cfg.logging.tensorboard_dir


def write_config(cfg: Config, dims: ParallelDims, tensorboard: TensorBoardWriter) -> None:
    """config.json into `config_dir` (first rank), and into TensorBoard."""
    out_dir = config_dir(cfg)
    if out_dir and dims.is_first_rank:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_atomically(Path(out_dir) / "config.json", cfg.to_json() + "\n")  # a planted link is replaced
    tensorboard.text("config", "```\n" + cfg.to_json() + "\n```")


def outputs_line(cfg: Config) -> str:
    """Where the run's files are (checkpoints, TensorBoard events, config.json), and the flag for each kind it did
    not write: the log's last word on what a run left on disk."""
    save, tensorboard, out_dir = cfg.checkpoint.save, cfg.logging.tensorboard_dir, config_dir(cfg)
    parts = [f"checkpoints in {save}" if save else "no checkpoint (--save DIR keeps one)"]
    if tensorboard:
        parts.append(f"TensorBoard events in {tensorboard} (tensorboard --logdir {tensorboard})")
    else:
        parts.append("no TensorBoard events (--tensorboard-dir DIR)")
    if out_dir:
        parts.append(f"config.json in {out_dir}")
    return "> outputs: " + "; ".join(parts)
