"""scripts/loss_parity.py end to end on CPU: the `tiny` preset on real text, an FP8 recipe and the noise floor paired
with bf16 at two seeds, over two invocations that merge into one results JSON (the second trains only what the first
did not), one run that fails, and the report rebuilt alone."""

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.data.default_corpus import iter_documents, tokenizer_config
from megatron.data.preprocess import preprocess_jsonl
from tests.assets.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "loss_parity.py"
parity = load_script("loss_parity")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 40 documents of the default corpus, tokenized with the default tokenizer: the data flags of a
    --data-path run, without building the whole default corpus."""
    tmp = tmp_path_factory.mktemp("corpus")
    with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
        for doc in itertools.islice(iter_documents(), 40):
            f.write(json.dumps(doc) + "\n")
    preprocess_jsonl(str(tmp / "docs.jsonl"), str(tmp / "docs"), tokenizer_config(), append_eod=True)
    cfg = tokenizer_config()
    flags = ["--data-path", str(tmp / "docs_text_document"), "--split", "80,20,0", "--tokenizer-type"]
    return flags + ["GPT2BPETokenizer", "--vocab-file", cfg.vocab_file, "--merge-file", cfg.merge_file]


@pytest.mark.slow
def test_tiny_parity_pairs_seeds_merges_invocations_and_reports(corpus, tmp_path):
    results, out = tmp_path / "results.json", tmp_path / "docs" / "parity.md"
    common = ["--preset", "tiny", "--train-iters", "6", "--eval-interval", "3", *corpus, "--parallel", "2"]
    common += ["--results", str(results), "--out", str(out), "--seeds", "2", "--noise-floor"]
    # First invocation as a user runs it, a script of its own: seed 1, stopped at iteration 3 and saved.
    first = subprocess.run(
        [sys.executable, str(SCRIPT), *common[:-3], "--noise-floor", "--configs", "local-delayed"]
        + ["--checkpoints", str(tmp_path / "ckpt"), "--extra=--exit-interval 3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert first.returncode == 1, first.stdout[-2000:] + first.stderr[-2000:]  # runs left unfinished
    after_first = json.loads(results.read_text())["runs"]
    assert all(r["partial"] and [it for it, _ in r["train"]] == [1, 2, 3] for r in after_first.values())
    # Second: seed 1 resumed from its checkpoints, seed 2 whole, and a run whose own flags make pretrain_gpt.py
    # refuse it.
    bad = "local-delayed+bad"
    code = parity.main([*common, "--configs", "local-delayed", bad, "--config-flags", f"{bad}=--fp8-margin -1",
                        "--checkpoints", str(tmp_path / "ckpt")])  # fmt: skip
    assert code == 1  # a run failed; the others ran

    runs = json.loads(results.read_text())["runs"]
    good = ["local-bf16", "local-bf16+noise", "local-delayed"]
    good += [parity.run_name(name, 2) for name in good]
    assert sorted(runs) == sorted([*good, bad, parity.run_name(bad, 2)])
    for name in good:
        run = runs[name]
        assert run["returncode"] == 0 and run["error"] is None, run["error"]
        assert [it for it, _ in run["train"]] == [1, 2, 3, 4, 5, 6] and [it for it, _ in run["valid"]] == [3, 6]
        assert all(math.isfinite(loss) for _, loss in run["train"] + run["valid"])
        assert "--full-validation" in run["command"]
    assert runs["local-bf16@seed2"]["seed"] == runs["local-bf16"]["seed"] + 1
    noise = runs["local-bf16+noise"]["command"]
    assert noise[noise.index("--seed") + 2 : noise.index("--seed") + 4] == ["--micro-batch-size", "4"]  # half of 8
    assert runs[bad]["returncode"] == 2 and "--fp8-margin must be >= 0" in runs[bad]["error"]
    for name in good[:3]:  # two parts: iterations 1-3, then 4-6 from the checkpoint
        assert [part["iterations"] for part in runs[name]["parts"]] == [[1, 3], [4, 6]] and not runs[name]["partial"]

    table = out.read_text()
    # the paired table's rows (nine columns; the per-run table below it has six)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| local-")
            and line.count("|") == 10}  # fmt: skip
    for name in ["local-bf16+noise", "local-delayed"]:
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert cells[1:3] == ["local-bf16", "2"] and cells[3].endswith("%") and " .. " in cells[4], cells
    assert "(noise floor: ±" in rows["local-bf16+noise"] and "no finished pair" in rows[bad]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(parity.png)" in table

    # The report alone, from the JSON, elsewhere: the same tables.
    again = tmp_path / "again" / "parity.md"
    parity.main(["--report-only", "--results", str(results), "--out", str(again)])
    assert [line for line in again.read_text().splitlines() if line.startswith("|")] == [
        line for line in table.splitlines() if line.startswith("|")
    ]


@pytest.mark.slow
def test_branches_share_their_trunk_bit_for_bit_and_resume_over_two_commands(corpus, tmp_path, capsys):
    """--branch-at on CPU with --checkpoints: one trunk, then bf16 and FP8 from it, each cut off after a step and
    resumed by the next invocation from its own folder (links to the trunk's files, which stay as they were); the
    bf16 branch logs the losses of the same run trained whole without a trunk, and a third invocation trains
    nothing."""
    results, trunks, ckpt = tmp_path / "results.json", tmp_path / "trunks", tmp_path / "ckpt"
    common = ["--preset", "tiny", "--train-iters", "4", "--eval-interval", "2", *corpus, "--parallel", "2"]
    common += ["--out", str(tmp_path / "parity.md")]
    branch = [*common, "--results", str(results), "--branch-at", "2", "--trunks", str(trunks), "--checkpoints"]
    branch += [str(ckpt), "--configs", "local-delayed"]
    assert parity.main([*branch, "--extra=--exit-interval 3"]) == 1  # the branches stopped at step 3
    trunk = trunks / "local-bf16_trunk"
    assert (trunk / parity.TRACKER).read_text().strip() == "2"
    trunk_files = {p: p.read_bytes() for p in trunk.rglob("*") if p.is_file()}
    runs = json.loads(results.read_text())["runs"]
    assert [it for it, _ in runs["local-bf16+trunk"]["train"]] == [1, 2]
    assert all(
        runs[n]["partial"] and [it for it, _ in runs[n]["train"]] == [3] for n in ("local-bf16", "local-delayed")
    )

    assert parity.main(branch) == 2  # one seed: unresolved
    runs = json.loads(results.read_text())["runs"]
    for name in ("local-bf16", "local-delayed"):
        assert [part["iterations"] for part in runs[name]["parts"]] == [[3, 3], [4, 4]], runs[name]["parts"]
        assert not runs[name]["partial"] and [it for it, _ in runs[name]["valid"]] == [3, 4]  # 3: at the cut
    assert {p: p.read_bytes() for p in trunk.rglob("*") if p.is_file()} == trunk_files

    capsys.readouterr()
    assert parity.main(branch) == 2
    assert "already in" in capsys.readouterr().out
    assert json.loads(results.read_text())["runs"] == runs  # nothing trained again, the trunk included

    scratch = tmp_path / "scratch.json"
    assert parity.main([*common, "--results", str(scratch), "--configs", "local-bf16"]) == 0
    whole = json.loads(scratch.read_text())["runs"]["local-bf16"]
    assert whole["train"][:2] == runs["local-bf16+trunk"]["train"] and whole["train"][2:] == runs["local-bf16"]["train"]
    assert whole["valid"][-1] == runs["local-bf16"]["valid"][-1]
