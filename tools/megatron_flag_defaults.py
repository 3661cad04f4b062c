"""Snapshot the defaults of Megatron-LM's `pretrain_gpt.py` flags, and compare this project's defaults with them.

    python tools/megatron_flag_defaults.py snapshot --megatron-dir /path/to/Megatron-LM --commit SHA
    python tools/megatron_flag_defaults.py compare      # our flags whose default differs from the snapshot

`snapshot` builds Megatron-LM's real argument parser (`add_megatron_arguments`, what `pretrain_gpt.py` parses) in a
separate Python process: this project's package is also called `megatron`, so the child process gets only the
Megatron-LM checkout on its path and a scratch directory as its working directory. Each flag's default is the
parser's (`set_defaults` included, string defaults passed through the flag's `type` as argparse does), then
`pretrain_gpt.py`'s own `args_defaults` (e.g. its GPT2BPETokenizer) fill the flags whose parser default is None,
as Megatron-LM's `validate_args` does. `pretrain_gpt.py` is read from the checkout, or from --pretrain-script.

The snapshot, tests/unit/megatron_defaults.json, maps each flag to {"default": value} plus, for a switch
(store_true/store_false/store_const), "sets": the value the flag stores. tests/unit/test_megatron_defaults.py
compares every flag of ours that Megatron-LM also has.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests/unit/megatron_defaults.json"

# Runs in the child process, with only the Megatron-LM checkout on sys.path. Prints the JSON snapshot's "flags".
_CHILD = r"""
import argparse, enum, json, math, sys, typing, warnings
warnings.simplefilter("ignore")
if not hasattr(typing, "override"):  # Python 3.12's typing.override, used by Megatron-LM as a plain decorator
    typing.override = lambda f: f
from megatron.training.arguments import add_megatron_arguments

def plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return "repr:" + repr(value)

parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
flags = {}
for action in parser._actions:
    if isinstance(action, argparse._HelpAction) or action.default is argparse.SUPPRESS:
        continue
    default = parser.get_default(action.dest)
    if isinstance(default, str) and callable(action.type):
        try:  # argparse converts a string default with the flag's type when the flag is absent
            default = action.type(default)
        except Exception:
            pass
    entry = {"default": plain(default), "dest": action.dest}
    if action.nargs == 0:
        entry["sets"] = plain(action.const)
    for flag in action.option_strings:
        if flag.startswith("--"):
            flags[flag] = entry
json.dump(flags, sys.stdout, sort_keys=True)
"""


def pretrain_args_defaults(script: Path) -> dict[str, Any]:
    """The `args_defaults={...}` literal that Megatron-LM's pretrain_gpt.py passes to `pretrain()`."""
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "args_defaults":
            return ast.literal_eval(node.value)
    return {}


def megatron_defaults(megatron_dir: Path, pretrain_script: Path | None = None) -> dict[str, Any]:
    """{"flags": {flag: {"default", "dest"[, "sets"]}}, "args_defaults": ...} from Megatron-LM's own parser."""
    megatron_dir = megatron_dir.resolve()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(megatron_dir)
    with tempfile.TemporaryDirectory() as scratch:
        # -P: no script or working directory on sys.path, so `import megatron` can only be Megatron-LM's
        result = subprocess.run(
            [sys.executable, "-P", "-c", _CHILD], cwd=scratch, env=env, capture_output=True, text=True, check=False
        )
    if result.returncode:
        sys.exit(f"building Megatron-LM's parser failed:\n{result.stderr[-3000:]}")
    flags = json.loads(result.stdout)
    script = pretrain_script or megatron_dir / "pretrain_gpt.py"
    if not script.exists():
        sys.exit(f"{script} not found: pass --pretrain-script (its args_defaults are part of the defaults)")
    args_defaults = pretrain_args_defaults(script)
    for entry in flags.values():
        if entry["default"] is None and entry["dest"] in args_defaults:
            entry["default"] = args_defaults[entry["dest"]]
    return {"flags": flags, "args_defaults": args_defaults}


def our_defaults() -> dict[str, dict[str, Any]]:
    """This project's flags in the snapshot's form (read from the parser, so new flags are included)."""
    from megatron.config.cli import build_parser

    parser = build_parser()
    out: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        entry = {"default": action.default}
        if action.nargs == 0:
            entry["sets"] = action.const
        for flag in action.option_strings:
            out[flag] = entry
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def describe(entry: dict[str, Any]) -> str:
    """A flag's default as a reader thinks of it: a switch is off or on when absent, a value flag has a value."""
    if "sets" in entry:
        return "on" if _same(entry["default"], entry["sets"]) else "off"
    return repr(entry["default"])


def mismatches(ours: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """{flag: (our default, Megatron-LM's)} for every flag in both whose default differs.

    A switch is compared by whether it is already in effect when absent (so `--no-foo` setting `foo` False matches
    whatever dest it has); a value flag by value (10 equals 10.0, a tuple equals a list). A flag that is a switch on
    one side and takes a value on the other is a mismatch too."""
    out = {}
    for flag in sorted(ours.keys() & theirs.keys()):
        a, b = ours[flag], theirs[flag]
        if ("sets" in a) != ("sets" in b):
            differ = True
        elif "sets" in a:
            differ = _same(a["default"], a["sets"]) != _same(b["default"], b["sets"])
        else:
            differ = not _same(a["default"], b["default"])
        if differ:
            out[flag] = (describe(a), describe(b))
    return out


def load_snapshot(path: Path = SNAPSHOT) -> dict[str, Any]:
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="write the snapshot from a Megatron-LM checkout")
    snap.add_argument("--megatron-dir", type=Path, required=True, help="Megatron-LM checkout (read only)")
    snap.add_argument("--commit", required=True, help="the checkout's commit, recorded in the snapshot")
    snap.add_argument("--pretrain-script", type=Path, help="Megatron-LM's pretrain_gpt.py (default: in the checkout)")
    snap.add_argument("--out", type=Path, default=SNAPSHOT)
    cmp = sub.add_parser("compare", help="list our flags whose default differs from the snapshot's")
    cmp.add_argument("--snapshot", type=Path, default=SNAPSHOT)
    args = parser.parse_args()
    if args.command == "snapshot":
        data = {"megatron_commit": args.commit, **megatron_defaults(args.megatron_dir, args.pretrain_script)}
        args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{len(data['flags'])} flags of Megatron-LM {args.commit} -> {args.out}")
    else:
        theirs = load_snapshot(args.snapshot)["flags"]
        ours = our_defaults()
        diff = mismatches(ours, theirs)
        print(f"{len(ours.keys() & theirs.keys())} of our {len(ours)} flags are Megatron-LM's; defaults differ:")
        for flag, (a, b) in diff.items():
            print(f"  {flag}: ours {a}, Megatron-LM {b}")


if __name__ == "__main__":
    main()
