"""scripts/memory_estimate.py on the Llama-3-70B shape over one 8-GPU host: the candidate layouts print their
estimates, sharding divides what each rank holds, and the verdict against an H200 follows from the estimate itself."""

import importlib.util

import pytest

from megatron.training.memory import UNCOUNTED_GIB
from tests.assets.scripts import ROOT

H200_GIB = 139.8  # torch.cuda.get_device_properties(0).total_memory of an H200 ("141 GB"), in GiB
CONFIG = "te-delayed-fp8params-recompute-full"
LAYOUTS = ("dp8_fsdp2_o2states", "tp2_dp4_fsdp2_o2states", "tp4_fsdp2_o2states", "tp8")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("memory_estimate", ROOT / "scripts" / "memory_estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_70b_rows_print_and_the_smallest_one_is_judged_by_its_own_total(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["memory_estimate.py", "llama3-70b", CONFIG, *LAYOUTS, "--capacity-gib", "139.8"])
    script.main()
    out = capsys.readouterr().out
    totals = {}
    for layout in LAYOUTS:
        cfg, est, (line,) = script.estimate("llama3-70b", CONFIG, layout)
        assert cfg.model.num_layers == 80 and cfg.data_parallel_size * cfg.parallel.tensor_model_parallel_size == 8
        totals[layout] = est["total"] / 2**30
        assert f"llama3-70b {CONFIG} {layout}: {totals[layout]:.2f} GiB" in out
        assert line in out
    # FSDP over 8 keeps an eighth of the Adam states of the whole model; TP8 (no data parallelism) all of a TP piece's
    _, fsdp8, _ = script.estimate("llama3-70b", CONFIG, "dp8_fsdp2_o2states")
    _, tp8, _ = script.estimate("llama3-70b", CONFIG, "tp8")
    assert fsdp8["adam"] < tp8["adam"]
    smallest = min(totals, key=totals.get)
    verdict = script.capacity_verdict(totals[smallest], H200_GIB)
    assert verdict in out
    assert verdict.startswith("fits: leaves") == (totals[smallest] + UNCOUNTED_GIB <= H200_GIB), verdict
    assert script.capacity_verdict(H200_GIB + 1, H200_GIB).startswith("does not fit: 1.0 GiB over")


def test_a_layout_of_no_axes_is_a_one_line_usage_error(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["memory_estimate.py", "llama3-70b", "te-delayed", "dp2_fsdp2"])
    with pytest.raises(SystemExit):
        script.main()
    assert "layout 'dp2_fsdp2': write it as fsdp2" in capsys.readouterr().err
