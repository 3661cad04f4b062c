"""Checkpoint save and load times of `pretrain_gpt.py` (model + optimizer), per checkpoint format.

    python scripts/bench_checkpoint.py                                 # llama-1b, te-delayed, one GPU
    python scripts/bench_checkpoint.py --presets llama-1b --configs te-delayed te-delayed-fp8params-o2 --json
    python scripts/bench_checkpoint.py --presets tiny --configs local-bf16 --iters 2   # CPU smoke run

For each preset x config (scripts/benchmark.py's presets and configs, mock data; `tiny` is a CPU-sized model added
here) and each format (`torch`, `torch_dist`, and `torch_dist_async`: torch_dist with --async-save), two fresh
processes: one trains --iters iterations and saves at the last, one loads that checkpoint and trains one iteration
more. The numbers come from the checkpointer's log lines (megatron/checkpoint/checkpointer.py):

    save s       a synchronous save: how long training waited for the checkpoint to be on disk
    blocked s    --async-save: how long training waited for the copy to host memory (the last save's; with
                 --saves 2 or more, the first save's is shown too: it also allocates the pinned host buffers, which
                 later saves reuse; a wait for the previous background write is left out and logged apart);
                 `written s`: the background write from queueing to complete
    load s       reading the checkpoint until the state is in place on the device
    GiB          the checkpoint's files on disk

The checkpoints go under --dir (default: a temporary folder, removed afterwards); each is deleted once loaded, so
the disk holds one at a time (llama-1b with its optimizer: about 15 GiB).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import benchmark  # scripts/benchmark.py, beside this script: presets, configs and process handling

ROOT = Path(__file__).resolve().parent.parent


PRESETS = {
    **benchmark.PRESETS,
    "tiny": "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2"
    " --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --vocab-size 511",
}
FORMATS = {
    "torch": "--ckpt-format torch",
    "torch_dist": "--ckpt-format torch_dist",
    "torch_dist_async": "--ckpt-format torch_dist --async-save",
}
_LINES = {
    "save_s": r"successfully saved checkpoint at iteration\s+\d+ to .* in ([\d.]+) s",
    "written_s": r"checkpoint at iteration\s+\d+ written in the background to .* in ([\d.]+) s",
    "load_s": r"successfully loaded checkpoint from .* in ([\d.]+) s",
}


@dataclass
class Result:
    preset: str
    config: str
    format: str
    save_s: float | None = None
    blocked_s: float | None = None
    written_s: float | None = None
    load_s: float | None = None
    first_blocked_s: float | None = None
    size_gib: float | None = None
    error: str | None = None


_BLOCKED = r"training blocked ([\d.]+) s(?: \(([\d.]+) s of it waiting for the previous background write\))?"


def parse_times(text: str) -> dict[str, float]:
    """The seconds of the last save, background write and load lines of a pretrain_gpt.py log, and of the first
    and last --async-save copies to host memory (a wait for the previous write taken out)."""
    out = {}
    for name, pattern in _LINES.items():
        found = re.findall(pattern, text)
        if found:
            out[name] = float(found[-1])
    copies = [float(total) - float(waited or 0) for total, waited in re.findall(_BLOCKED, text)]
    if copies:
        out["blocked_s"] = copies[-1]
        if len(copies) > 1:
            out["first_blocked_s"] = copies[0]
    return out


def folder_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def commands(preset: str, config: str, fmt: str, iters: int, ckpt: Path, saves: int = 1) -> tuple[list[str], list[str]]:
    """The saving run (saves every `iters` iterations, `saves` times) and the loading run (one iteration more,
    saving nothing)."""
    base = f"{benchmark.COMMON} {PRESETS[preset]} {benchmark.CONFIGS[config]} {FORMATS[fmt]} --log-interval 1"
    launch = [*benchmark.launcher(1), str(ROOT / "pretrain_gpt.py")]
    save = f"{base} --train-iters {iters * saves} --save {ckpt} --save-interval {iters}"
    load = f"{base} --train-iters {iters * saves + 1} --load {ckpt}"
    return launch + save.split(), launch + load.split()


def run(
    preset: str,
    config: str,
    fmt: str,
    iters: int,
    scratch: Path,
    timeout: int,
    log_dir: Path | None,
    saves: int = 1,
) -> Result:
    ckpt = scratch / f"{preset}.{config}.{fmt}"
    shutil.rmtree(ckpt, ignore_errors=True)
    result = Result(preset, config, fmt)
    try:
        for step, cmd in zip(("save", "load"), commands(preset, config, fmt, iters, ckpt, saves)):
            text, code = benchmark.execute(cmd, timeout, benchmark.run_env("1gpu"))
            if log_dir is not None:
                (log_dir / f"{preset}.{config}.{fmt}.{step}.log").write_text(" ".join(cmd) + "\n" + text)
            if code != 0:
                result.error = f"{step}: {benchmark.failure_reason(text, code)}"
                return result
            for name, value in parse_times(text).items():
                setattr(result, name, value)
            if step == "save":
                result.size_gib = folder_gib(ckpt / f"iter_{iters * saves:07d}")
        if result.load_s is None or (result.save_s is None and result.blocked_s is None):
            result.error = "no timing line in the log (run with --log-dir to look)"
        return result
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def table(results: list[Result]) -> str:
    """Markdown table."""
    rows = [
        "| preset | config | format | save s (sync) | training blocked s (async) | written s (async) | load s | GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]

    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    for r in results:
        if r.error:
            rows.append(f"| {r.preset} | {r.config} | {r.format} | failed: {r.error.replace('|', '/')} |" + " |" * 4)
            continue
        blocked = cell(r.blocked_s) + (f" (first {r.first_blocked_s:.2f})" if r.first_blocked_s is not None else "")
        cells = (cell(r.save_s), blocked, cell(r.written_s), cell(r.load_s), cell(r.size_gib))
        rows.append(f"| {r.preset} | {r.config} | {r.format} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["llama-1b"], choices=sorted(PRESETS))
    parser.add_argument("--configs", nargs="+", default=["te-delayed"], choices=sorted(benchmark.CONFIGS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--iters", type=int, default=3, help="iterations before each save (default 3)")
    parser.add_argument("--saves", type=int, default=1, help="saves per run; the numbers are the last one's")
    parser.add_argument("--dir", type=Path, help="scratch folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per pretrain_gpt.py run")
    parser.add_argument("--log-dir", type=Path, help="keep each run's log here")
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines after the table")
    args = parser.parse_args(argv)
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="bench_checkpoint."))
    scratch.mkdir(parents=True, exist_ok=True)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for preset in args.presets:
            for config in args.configs:
                for fmt in args.formats:
                    results.append(
                        run(preset, config, fmt, args.iters, scratch, args.timeout, args.log_dir, args.saves)
                    )
                    print(f"done: {preset} {config} {fmt}", file=sys.stderr, flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(benchmark.environment())
    print(table(results))
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
    return results


if __name__ == "__main__":
    main()
