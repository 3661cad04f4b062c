"""scripts/loss_parity.py end to end on CPU: the `tiny` preset on real text, bf16 at two seeds and two FP8 recipes,
split over two invocations that merge into one results JSON, one run that fails, and the report rebuilt alone."""

import importlib.util
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.data.default_corpus import iter_documents, tokenizer_config
from megatron.data.preprocess import preprocess_jsonl

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "loss_parity.py"
spec = importlib.util.spec_from_file_location("loss_parity", SCRIPT)
parity = importlib.util.module_from_spec(spec)
sys.modules.setdefault("loss_parity", parity)  # dataclasses look their module up there
spec.loader.exec_module(parity)

GOOD = ["local-bf16", "local-bf16@seed2", "local-delayed", "local-mxfp8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 40 documents of the default corpus, tokenized with the default tokenizer: the data flags of a
    --data-path run (what the parity corpus will use), without building the whole default corpus."""
    tmp = tmp_path_factory.mktemp("corpus")
    with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
        for doc in itertools.islice(iter_documents(), 40):
            f.write(json.dumps(doc) + "\n")
    preprocess_jsonl(str(tmp / "docs.jsonl"), str(tmp / "docs"), tokenizer_config(), append_eod=True)
    cfg = tokenizer_config()
    return [
        "--data-path",
        str(tmp / "docs_text_document"),
        "--split",
        "90,10,0",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        cfg.vocab_file,
        "--merge-file",
        cfg.merge_file,
    ]


@pytest.mark.slow
def test_tiny_parity_run_merges_invocations_reports_failures_and_plots(corpus, tmp_path):
    results, out = tmp_path / "results.json", tmp_path / "docs" / "loss_parity.md"
    common = ["--preset", "tiny", "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1", *corpus]
    common += ["--results", str(results), "--out", str(out)]
    # First invocation as a user runs it: a script of its own.
    first = subprocess.run(
        [sys.executable, str(SCRIPT), *common, "--configs", *GOOD[:2]], capture_output=True, text=True, cwd=ROOT
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    # Second, into the same results: two FP8 recipes and a run whose own flags make pretrain_gpt.py refuse it.
    bad = "local-delayed+bad"
    code = parity.main([*common, "--configs", *GOOD[2:], bad, "--config-flags", f"{bad}=--fp8-margin -1"])
    assert code == 1  # a run failed; the others ran

    runs = json.loads(results.read_text())["runs"]
    assert sorted(runs) == sorted([*GOOD, bad])
    for name in GOOD:
        run = runs[name]
        assert run["returncode"] == 0 and run["error"] is None, run["error"]
        assert [it for it, _ in run["train"]] == [1, 2, 3, 4, 5, 6]
        assert [it for it, _ in run["valid"]] == [3, 6]
        assert all(math.isfinite(loss) for _, loss in run["train"] + run["valid"])
        assert run["command"][1].endswith("pretrain_gpt.py") and "--seed" in run["command"]
    assert runs["local-bf16@seed2"]["seed"] == runs["local-bf16"]["seed"] + 1
    assert runs["local-mxfp8"]["command"][-4:] == ["--fp8-recipe", "mxfp8", "--seed", "1234"]
    assert runs[bad]["returncode"] == 2 and "--fp8-margin must be >= 0" in runs[bad]["error"]

    table = out.read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| local-")}
    assert sorted(rows) == sorted([*GOOD, bad])
    assert "reference" in rows["local-bf16"] and "(noise floor)" in rows["local-bf16@seed2"]
    for name in GOOD[1:]:
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert math.isfinite(float(cells[2])) and cells[4].endswith("%") and cells[6] in ("yes", "**no**"), cells
    assert "failed: --fp8-margin must be >= 0" in rows[bad]
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "(loss_parity.png)" in table

    # The report alone, from the JSON, elsewhere: the same table, a new PNG.
    again = tmp_path / "again" / "parity.md"
    assert parity.main(["--report-only", "--results", str(results), "--out", str(again)]) == 0
    table_lines = [line for line in table.splitlines() if line.startswith("|")]
    assert [line for line in again.read_text().splitlines() if line.startswith("|")] == table_lines
    assert again.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
