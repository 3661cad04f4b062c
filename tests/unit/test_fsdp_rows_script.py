"""scripts/probes/fsdp_rows.sh without a GPU: every benchmark config, layout and loss-parity run it names exists.

The script runs only in device calls, where a misspelt name costs a call's device time: loss_parity.py refuses
malformed parity runs (a tag with a second `+`, and flags for runs not asked for).
"""

import importlib.util
import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TEXT = (SCRIPTS / "probes" / "fsdp_rows.sh").read_text()


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return sys.modules[name]


benchmark = _load("benchmark")
loss_parity = _load("loss_parity")


def test_every_config_named_is_a_benchmark_config_or_a_parity_run():
    names = set(re.findall(r"\b(?:te|local)-[a-z0-9][a-z0-9+@-]*", TEXT))
    assert "te-delayed-fp8params+zero2-chunkce" in names  # the pattern reads the script
    for name in sorted(names):
        if "+" in name or "@" in name:
            loss_parity.parse_run_name(name)  # raises with the valid forms
        else:
            assert name in benchmark.CONFIGS, name


def test_every_layout_named_is_a_benchmark_layout():
    names = set(re.findall(r"\b(?:m?fsdp2|dp2)_?[a-z0-9_]*", TEXT))
    assert "mfsdp2_optim_grads_bf16comm" in names
    for name in sorted(names):
        assert name in benchmark.LAYOUTS, name


def test_every_parity_run_has_its_flags_and_the_default_runs_are_among_them():
    part = TEXT[TEXT.index("  parity)") :]
    flags = set(re.findall(r"\[([a-z0-9+@-]+)\]=", part[: part.index(";;")]))
    default = re.search(r"PARITY_CONFIGS:-([^}]+)\}", part).group(1).split()
    assert flags and set(default) <= flags
    for name in flags:
        assert loss_parity.parse_run_name(name).tag, name  # a variant of a config, whose flags these are
