"""Convert checkpoints between this project, Hugging Face `transformers` and Megatron-LM (command line shaped like
Megatron-LM's tools/checkpoint/convert.py: a loader reads the source, a saver writes the target).

    # Hugging Face Llama / GPT-2 -> this project, for 2-way tensor x 2-way pipeline parallelism
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver native \\
        --load-dir Llama-3.2-1B --save-dir ckpt/llama --target-tensor-parallel-size 2 \\
        --target-pipeline-parallel-size 2
    # this project (any layout) -> Hugging Face (config.json + model.safetensors)
    python tools/checkpoint/convert.py --model-type GPT --loader native --saver hf --load-dir ckpt/run --save-dir hf/run
    # Megatron-LM (torch or torch_dist format, Megatron-Core names) -> this project, resharded
    python tools/checkpoint/convert.py --model-type GPT --loader mcore --saver native --load-dir mlm/ckpt \\
        --save-dir ckpt/from_mlm --target-tensor-parallel-size 1
    # this project -> Megatron-LM (its default torch_dist format; --ckpt-format torch for the legacy one), for a
    # Megatron-LM run at tensor-parallel size 2 (transformer_engine layer spec)
    python tools/checkpoint/convert.py --model-type GPT --loader native --saver mcore --load-dir ckpt/run \\
        --save-dir mlm/from_ours --target-tensor-parallel-size 2

Checkpoints are read as data only (docs/checkpoints.md): a file holding any other class is refused in one line;
--trust-checkpoint (or MEGATRON_TRUST_CHECKPOINT=1) loads a file you trust the old way.

Loaders: native (this project's checkpoints, --ckpt-format torch), hf (LlamaForCausalLM or GPT2LMHeadModel, told
apart by config.json), mcore (Megatron-LM's torch and torch_dist checkpoints). Savers: native, hf (Llama when the
model is RMSNorm + SwiGLU + RoPE, GPT-2 when LayerNorm + GELU + learned positions), mcore (Megatron-LM, Megatron-Core
names of its transformer_engine layer spec). A native or mcore checkpoint written here holds weights and the model
configuration only: train from it with `--load DIR --finetune`, or with `--no-load-optim --no-load-rng` to keep
counting from the source's iteration (in Megatron-LM too). The output appears only when complete (it is written
to a hidden `.NAME.partial` folder beside --save-dir, then renamed).
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron.errors import UserError

LOADERS = ("native", "hf", "mcore")
SAVERS = ("native", "hf", "mcore")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model-type", default="GPT", choices=["GPT"], help="Model family (GPT only, as here).")
    parser.add_argument("--loader", required=True, choices=LOADERS, help="Format of --load-dir.")
    parser.add_argument("--saver", required=True, choices=SAVERS, help="Format to write into --save-dir.")
    parser.add_argument("--load-dir", required=True, help="Checkpoint folder (--save of a run) or Hugging Face folder.")
    parser.add_argument("--save-dir", required=True, help="Output folder; must not exist or be empty.")
    parser.add_argument(
        "--target-tensor-parallel-size", type=int, default=None,
        help="Savers native, mcore: tensor-parallel size of the written checkpoint (default: the source's, else 1).",
    )  # fmt: skip
    parser.add_argument(
        "--target-pipeline-parallel-size", type=int, default=None,
        help="Savers native, mcore: pipeline-parallel size of the written checkpoint (default: the source's, else 1).",
    )  # fmt: skip
    parser.add_argument(
        "--ckpt-format", default=None, choices=["torch", "torch_dist"],
        help="Saver mcore: Megatron-LM's checkpoint format to write (default torch_dist, Megatron-LM's default)."
        " Saver native writes torch.",
    )  # fmt: skip
    parser.add_argument(
        "--true-vocab-size", type=int, default=None,
        help="The tokenizer's vocabulary size, without padding (default: from the source's tokenizer settings).",
    )  # fmt: skip
    parser.add_argument(
        "--make-vocab-size-divisible-by", type=int, default=128,
        help="Savers native, mcore: pad the vocabulary to a multiple of this times the tensor-parallel size"
        " (Megatron-LM's rule; use the value the training run will be given).",
    )  # fmt: skip
    parser.add_argument(
        "--trust-checkpoint", action="store_true",
        help="Load the source the old way, as full pickles that may run code: only for files you trust (otherwise"
        " foreign classes are rebuilt as plain data and any callable is refused; docs/checkpoints.md).",
    )  # fmt: skip
    return parser.parse_args(argv)


def convert(args: argparse.Namespace, log=print) -> None:
    from megatron.checkpoint.safe_load import malformed
    from megatron.convert import atomic_output_dir, read_hf, read_mlm, read_ours, write_hf, write_mcore, write_torch
    from megatron.convert.state import ConvertError

    if args.saver == "hf" and (args.target_tensor_parallel_size or args.target_pipeline_parallel_size):
        raise ConvertError("--target-tensor/pipeline-parallel-size apply to --saver native and mcore only")
    if args.ckpt_format and args.saver != "mcore" and (args.saver, args.ckpt_format) != ("native", "torch"):
        raise ConvertError(f"--ckpt-format {args.ckpt_format} does not apply to --saver {args.saver} (it is for"
                           " --saver mcore; --saver native writes torch)")  # fmt: skip
    start = time.perf_counter()
    try:
        with malformed(f"--load-dir {args.load_dir} ({args.loader})", ConvertError):  # one line, never a traceback
            if args.loader == "native":
                full = read_ours(args.load_dir, args.true_vocab_size)
            elif args.loader == "hf":
                full = read_hf(args.load_dir, args.true_vocab_size, log)
            else:
                full = read_mlm(args.load_dir, args.true_vocab_size, log)
    except UserError as exc:  # every error of reading names the source
        if str(args.load_dir) in str(exc):
            raise
        raise ConvertError(f"{args.load_dir}: {exc}") from None
    count = sum(t.numel() for t in full.state.values())
    log(f"> read {full.source}: {count / 1e6:.1f}M parameters, vocabulary {full.vocab_size}"
        f" ({time.perf_counter() - start:.1f} s)")  # fmt: skip
    start = time.perf_counter()
    with atomic_output_dir(args.save_dir, log) as out:
        if args.saver == "hf":
            what = write_hf(full, out)
        else:
            tp, pp = full.layout or (1, 1)
            tp, pp = args.target_tensor_parallel_size or tp, args.target_pipeline_parallel_size or pp
            if args.saver == "mcore":
                fmt = args.ckpt_format or "torch_dist"
                write_mcore(full, out, tp, pp, fmt, args.make_vocab_size_divisible_by)
                what = f"Megatron-LM {fmt} checkpoint"
            else:
                write_torch(full, out, tp, pp, args.make_vocab_size_divisible_by)
                what = "checkpoint"
            what += f" for tensor x pipeline {tp} x {pp} (iteration {full.iteration})"
    log(f"> wrote {what} to {args.save_dir} ({time.perf_counter() - start:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    from megatron.checkpoint.safe_load import trust_checkpoints

    args = parse(sys.argv[1:] if argv is None else argv)
    trust_checkpoints(args.trust_checkpoint)
    try:
        convert(args)
    except UserError as exc:
        print(f"convert.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
