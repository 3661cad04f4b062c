"""Host-device synchronizations in a benchmark row's training step, counted by where they happen (FSDP's llama-1b step
on two H100s left the GPU waiting for the host; a synchronization per micro-batch or per unit would drain the GPU's
queue each time). Builds the trainer as `benchmark.py --profile` does, runs warm-up steps, then steps under
`torch.cuda.set_sync_debug_mode("warn")`, which warns at every synchronizing CUDA call (`.item()`, `.tolist()`,
`nonzero`, copies to the host, event and stream synchronizations through torch): rank 0 prints the count per step and
per call site (the Python file and line of each warning), most frequent first.

    python scripts/probes/sync_check.py llama-1b te-delayed dp2_distopt
    python scripts/probes/sync_check.py llama-1b te-delayed fsdp2_optim_grads

Expected of a step: the few the loop makes on purpose once per step (the loss and grad norm read back in
`Steps.train_step`, the loss scaler), none per micro-batch or per unit. NCCL's waits and cudaStreamWaitEvent are no
synchronization of the host and are not counted (nor is TE's C++ code, which torch's mode does not see).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

from megatron.perf.launch import ROOT, relaunch  # no torch at import
from megatron.perf.rows import LAYOUTS, train_flags
from megatron.perf.steps import trainer_step


def count_syncs(argv: list[str], steps: int, warmup: int = 3) -> tuple[int, collections.Counter]:
    """(synchronizations in `steps` training steps, their count per call site)."""
    import torch

    _, step = trainer_step(argv)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every occurrence, not once per call site
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites = collections.Counter(f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in syncs)
    return len(syncs), sites


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset")
    parser.add_argument("config")
    parser.add_argument("layout", choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    # every rank runs the step; rank 0 reports
    if (code := relaunch(__file__, LAYOUTS[args.layout][0], args.layout)) is not None:
        return code
    total, sites = count_syncs(train_flags(args.preset, args.config, 100, 100, args.layout), args.steps)
    if os.environ.get("RANK", "0") == "0":
        print(f"{args.preset} {args.config} {args.layout}: {total / args.steps:.1f} synchronizations per step")
        for site, count in sites.most_common(20):
            print(f"{count / args.steps:8.1f} per step  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
