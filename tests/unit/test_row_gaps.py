"""scripts/row_gaps.py: benchmark rows paired with the reference layout's row of their config in the same pass; and
scripts/probes/fsdp_rows.sh zero2-1b run dry (python3 and nvidia-smi stubbed) to check that its passes end in that table
and leave at most the 8 files a device call returns."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.assets.scripts import ROOT, load_script

row_gaps = load_script("row_gaps")


def _row(config: str, layout: str, ms: float, peak: float = 20.0) -> str:
    return json.dumps(
        {"preset": "llama-1b", "config": config, "layout": layout, "ms_per_iter": ms, "peak_gib": peak, "error": None}
    )


def test_rows_pair_within_their_pass_by_config():
    text = "\n".join(
        [
            "NVIDIA H100 80GB HBM3, ...",
            _row("fp8", "flat", 440.0, 19.3),
            _row("fp8", "dp2_distopt", 400.0, 21.35),
            _row("bf16", "flat", 500.0),
            "te-delayed:flat: 520 450 449",  # the intervals' line: not a result
            _row("bf16", "dp2_distopt", 520.0),
            _row("fp8", "flat", 396.0, 19.3),  # a second pass starts: (fp8, flat) again
            _row("fp8", "dp2_distopt", 420.0, 21.35),
            json.dumps({"preset": "llama-1b", "config": "bf16", "layout": "flat", "ms_per_iter": None, "error": "OOM"}),
        ]
    )
    found = row_gaps.rows(text)
    assert len(found) == 6
    assert [len(group) for group in row_gaps.passes(found)] == [4, 2]
    gaps = row_gaps.gaps(found, "dp2_distopt")
    assert gaps[("llama-1b", "fp8", "flat")] == pytest.approx([10.0, -5.714285714], abs=1e-6)
    assert gaps[("llama-1b", "bf16", "flat")] == pytest.approx([-3.846153846], abs=1e-6)
    table = row_gaps.table(found, "dp2_distopt")
    assert "| llama-1b, fp8, `flat` | +10.0%, -5.7% | +2.1% | +2.1% | 19.3 (21.35) |" in table
    # three passes: the median and the mean part (one slow pass moves the mean, not the median)
    three = row_gaps.rows(text) + row_gaps.rows(
        "\n".join([_row("fp8", "flat", 500.0), _row("fp8", "dp2_distopt", 400.0)])
    )
    assert "| +10.0%, -5.7%, +25.0% | +10.0% | +9.8% |" in row_gaps.table(three, "dp2_distopt")


def test_no_reference_row_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "summary.txt"
    path.write_text(_row("fp8", "flat", 440.0) + "\n")
    assert row_gaps.main(["--reference", "dp2_distopt", str(path)]) == 1
    assert capsys.readouterr().err.strip() == (
        "row_gaps.py: error: no row has a dp2_distopt row of its config in its pass"
    )


# benchmark.py's stand-in: one result line per row (the flat buckets 10% slower) and its log with two intervals
FAKE_PYTHON = """#!/bin/bash
if [ "$1" = scripts/probes/ab_steps.py ]; then  # its table and summary lines, and the flags it was given
  echo "| block | mfsdp2_optim_grads_bf16comm | dp2_distopt | gap |"
  echo "mfsdp2_optim_grads_bf16comm against dp2_distopt: median +1.0%, mean +2.0% over 12 blocks ($*)"
elif [ "$1" = scripts/benchmark.py ]; then
  while [ $# -gt 0 ]; do
    case $1 in --log-dir) logs=$2;; --configs) config=$2;; --layouts) layout=$2;; --profile-host-stats) stats=$2;; esac
    shift
  done
  if [ -n "${stats:-}" ]; then  # a host profile: each rank's pstats, the flat buckets calling their hook 3 times a step
    mkdir -p "$stats"
    calls=1; [ "$layout" = dp2_distopt ] || calls=3
    for rank in 0 1; do
      "$REAL_PYTHON" -c "import cProfile
def engine_hook(): pass
p = cProfile.Profile(); p.enable()
for _ in range(4 * $calls): engine_hook()
p.disable(); p.dump_stats('$stats/rank$rank.pstats')"
    done
    echo "step 400.0 ms (unprofiled), GPU busy 300.0 ms per step (75.0%), kernels 320.0 ms"
    exit 0
  fi
  ms=400; [ "$layout" = dp2_distopt ] || ms=440
  [ "$layout" = dp2_distopt ] || [ "${NCCL_PROTO:-}" != Simple ] || ms=420
  printf 'per iteration (ms): %s |\\nper iteration (ms): %s |\\n' $ms $ms > "$logs/llama-1b.$config.$layout.log"
  if [ -n "${NCCL_DEBUG:-}" ]; then  # NCCL's set-up lines, as NCCL_DEBUG=INFO prints them
    log="$logs/llama-1b.$config.$layout.log"
    echo "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read" >> "$log"
    echo "h:1:1 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 24, bw 40.000000/40.000000, type NVL/PIX" >> "$log"
  fi
  row='{"preset": "llama-1b", "config": "%s", "layout": "%s", "ms_per_iter": %s, "peak_gib": 19.3, "error": null}'
  printf "$row\\n" "$config" "$layout" $ms
else
  exec "$REAL_PYTHON" "$@"
fi
"""


def _dry_run(tmp_path: Path, part: str, **env: str) -> Path:
    """scripts/probes/fsdp_rows.sh PART run with benchmark.py and nvidia-smi stubbed; returns its OUTDIR."""
    repo = tmp_path / "repo"
    (repo / ".devkit").mkdir(parents=True)
    (repo / ".devkit" / "setup-te.sh").write_text("true\n")
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python3").write_text(FAKE_PYTHON)
    (stubs / "nvidia-smi").write_text("#!/bin/bash\necho 'NVIDIA H100 80GB HBM3, 81559 MiB'\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "out"
    full_env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "REAL_PYTHON": sys.executable,
        "TMPDIR": str(tmp_path / "scratch"),
        **env,
    }
    subprocess.run(
        ["bash", "scripts/probes/fsdp_rows.sh", part, str(out)], cwd=repo, env=full_env, check=True, capture_output=True
    )
    return out


def test_zero2_1b_passes_end_in_the_gap_table_and_keep_only_the_first_pass_logs(tmp_path):
    out = _dry_run(
        tmp_path,
        "zero2-1b",
        PASSES="4",  # the old layout kept 8 logs + the summary: one more than comes back
        ROWS="te-delayed-fp8params:mfsdp2_optim_grads_bf16comm te-delayed-fp8params:dp2_distopt",
    )
    summary = (out / "summary.txt").read_text()
    assert (
        "| llama-1b, te-delayed-fp8params, `mfsdp2_optim_grads_bf16comm` | +10.0%, +10.0%, +10.0%, +10.0% | +10.0%"
        " | +10.0% |" in summary
    )
    assert "te-delayed-fp8params:dp2_distopt: 400 400" in summary
    # every second pass runs the rows in reverse: a drift over the call favours neither
    order = [line.split(":")[1] for line in summary.splitlines() if line.startswith("te-delayed-fp8params:")]
    assert order == ["mfsdp2_optim_grads_bf16comm", "dp2_distopt", "dp2_distopt", "mfsdp2_optim_grads_bf16comm"] * 2
    returned = [path for path in out.rglob("*") if path.is_file()]
    assert len(returned) <= 8, returned
    assert sorted(path.name for path in (out / "pass1").iterdir()) == [
        "llama-1b.te-delayed-fp8params.dp2_distopt.log",
        "llama-1b.te-delayed-fp8params.mfsdp2_optim_grads_bf16comm.log",
    ]


def test_zero2_nccl_runs_the_rows_with_nccls_protocol_then_simple_and_prints_its_links(tmp_path):
    out = _dry_run(tmp_path, "zero2-nccl")
    summary = (out / "summary.txt").read_text()
    # the stub's flat row is 10% slower under NCCL's own protocol and 5% under NCCL_PROTO=Simple: the variable
    # reached the second pass's runs and not the first's
    assert "| llama-1b, te-delayed-fp8params, `mfsdp2_optim_grads_bf16comm` | +10.0%, +5.0% |" in summary
    links = [line for line in summary.splitlines() if line.startswith("te-delayed-fp8params:")]
    assert len(links) == 4
    assert all("nccl: P2P/CUMEM/read x1; bw 40.000000/40.000000, NVL/PIX x1;" in line for line in links), links
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.log")) == [
        "pass1/llama-1b.te-delayed-fp8params.dp2_distopt.log",
        "pass1/llama-1b.te-delayed-fp8params.mfsdp2_optim_grads_bf16comm.log",
        "simple1/llama-1b.te-delayed-fp8params.dp2_distopt.log",
        "simple1/llama-1b.te-delayed-fp8params.mfsdp2_optim_grads_bf16comm.log",
    ]


def test_host_1b_profiles_each_layout_on_every_rank_and_diffs_the_first_against_the_second(tmp_path):
    out = _dry_run(tmp_path, "host-1b")
    summary = (out / "summary.txt").read_text()
    assert summary.count("step 400.0 ms (unprofiled)") == 2
    for rank in (0, 1):
        section = summary[summary.index(f"rank {rank}: mfsdp2_optim_grads_bf16comm against dp2_distopt") :]
        assert re.search(r"\| <string>:2 engine_hook \| [+-][\d.]+ \| 3, 1 \|", section), section  # per step
    returned = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(returned) <= 8 and "dp2_distopt/rank1.pstats" in returned, returned


def test_ab_1b_runs_the_two_engines_in_one_process_and_keeps_the_summary(tmp_path):
    out = _dry_run(tmp_path, "ab-1b", AB_FLAGS="--blocks 4")
    summary = (out / "summary.txt").read_text()
    assert "ab_steps.py: rc=0" in summary
    line = next(line for line in summary.splitlines() if line.startswith("mfsdp2_optim_grads_bf16comm against"))
    assert "--layouts mfsdp2_optim_grads_bf16comm dp2_distopt --blocks 4)" in line
