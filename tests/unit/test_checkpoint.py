"""Checkpoint layout: folder names, metadata, the layout check and corrupt pointers."""

import dataclasses
import enum
import os
import pickle
import sys
import types
from typing import NamedTuple

import pytest
import torch

from megatron.checkpoint import CheckpointError, load_checkpoint, model_parallel_name, save_checkpoint
from megatron.checkpoint.sharding import flat_range_boxes, global_name, placement
from megatron.config import ConfigError, parse_args


def test_shard_folder_names_follow_megatron():
    assert model_parallel_name(0, 0, 1) == "mp_rank_00"
    assert model_parallel_name(1, 2, 4) == "mp_rank_01_002"


def test_other_parallel_layout_is_refused_with_the_flags_to_use(tmp_path):
    save_checkpoint(str(tmp_path), 5, {"x": torch.ones(1)}, writer=True, layout={"tp": 2, "pp": 1, "dp": 1})
    assert (tmp_path / "iter_0000005" / "metadata.json").exists()
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1"):
        load_checkpoint(str(tmp_path), layout={"tp": 1, "pp": 2, "dp": 1})
    # Another data-parallel size loads: replicas are identical.
    state = load_checkpoint(str(tmp_path), layout={"tp": 2, "pp": 1, "dp": 4})
    assert state["iteration"] == 5


def test_corrupt_pointer_and_missing_shard(tmp_path):
    assert load_checkpoint(str(tmp_path)) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(str(tmp_path))


def test_truncated_file_is_reported(tmp_path):
    save_checkpoint(str(tmp_path), 1, {"x": torch.ones(100)}, writer=True)
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt is damaged: 50 bytes, \d+ were written") as err:
        load_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)
    # A checkpoint from before checksums: the file itself cannot be read
    (tmp_path / "iter_0000001" / "metadata.json").write_text('{"layout": {"tp": 1, "pp": 1, "dp": 1}}')
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    "flags,match",
    [
        ("--ckpt-format torch_dcp", "--ckpt-format torch_dcp: Megatron-LM's format for its FSDP"),
        ("--ckpt-format fsdp_dtensor", "--ckpt-format fsdp_dtensor: Megatron-LM's format for its FSDP"),
        ("--async-save --ckpt-format torch", "--async-save writes --ckpt-format torch_dist checkpoints"),
        ("--ckpt-format torch --dist-ckpt-strictness log_all", "--dist-ckpt-strictness applies to loading torch_dist"),
    ],
)
def test_checkpoint_flags_that_cannot_work_are_one_line(flags, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_args(["--mock-data", "--vocab-size", "128", *flags.split()])
    assert "\n" not in str(err.value)
    flags = "--ckpt-format torch_dist --async-save --use-persistent-ckpt-worker"
    cfg = parse_args(["--mock-data", "--vocab-size", "128", *flags.split()])
    assert cfg.checkpoint.async_save and cfg.checkpoint.ckpt_format == "torch_dist"
    # a torch run that may load a torch_dist checkpoint (Megatron-LM's resume tests pass both)
    flags = "--ckpt-format torch --auto-detect-ckpt-format --dist-ckpt-strictness log_all"
    cfg = parse_args(["--mock-data", "--vocab-size", "128", *flags.split()])
    assert cfg.checkpoint.auto_detect_ckpt_format and cfg.checkpoint.dist_ckpt_strictness == "log_all"


def test_flat_ranges_are_tiled_by_boxes_in_order():
    shape = (3, 4, 5)
    full = torch.arange(60).view(shape)
    for start, stop in [(0, 60), (7, 8), (3, 47), (20, 40), (19, 41), (59, 60), (0, 1)]:
        boxes = flat_range_boxes(shape, start, stop)
        pieces = [full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in boxes]
        assert torch.equal(torch.cat(pieces), torch.arange(start, stop)), (start, stop, boxes)


def test_parts_are_split_out_so_each_rank_holds_one_chunk():
    param = torch.nn.Parameter(torch.empty(8, 3))  # rank 1 of 2: [gate_1; up_1], 4 rows each
    param.tensor_model_parallel, param.partition_dim, param.partition_parts = True, 0, 2
    where = placement("decoder.layers.0.mlp.linear_fc1.weight", param, param, tp_size=2, tp_rank=1)
    assert (where.local_shape, where.global_shape, where.offsets) == ((2, 4, 3), (2, 8, 3), (0, 4, 0))
    assert global_name("decoder.layers.1.mlp.linear_fc1.weight", [3, 4]) == "decoder.layers.3.mlp.linear_fc1.weight"


# --- Transformer Engine's pickled FP8 state (megatron/checkpoint/te_state.py), with stand-ins for TE's classes ---
TE_RECIPE = "transformer_engine.common.recipe"


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    HYBRID = _FormatHelper(448.0, 57344.0)


@dataclasses.dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 16
    amax_compute_algo: str = "max"


for _cls in (_FormatHelper, Format, DelayedScaling):
    _cls.__module__ = TE_RECIPE


class _TeLikeModule(torch.nn.Module):
    """Saves its FP8 state as TE does (a pickle in a uint8 tensor) and, like TE 2.20, unpickles it only when
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1."""

    def __init__(self, payload: object = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.payload, self.loaded = payload, None

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(self.payload)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        if os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") != "1":
            raise RuntimeError("Refusing to load ... set NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.")
        self.loaded = pickle.loads(state.numpy().tobytes())


class _RunsCode:
    def __reduce__(self):
        return (os.getcwd, ())


@pytest.fixture
def te_recipe_module(monkeypatch):
    module = types.ModuleType(TE_RECIPE)
    for cls in (_FormatHelper, Format, DelayedScaling):
        setattr(module, cls.__name__, cls)
    for parent in ("transformer_engine", "transformer_engine.common"):  # pickle imports the module by its name
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, TE_RECIPE, module)
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)


def test_te_fp8_state_loads_after_its_pickle_is_checked(te_recipe_module, tmp_path):
    from megatron.checkpoint.checkpointing import load_model_state

    fp8_state = {
        "recipe": DelayedScaling(),
        "scale_fwd": torch.tensor([2.0, 4.0]),
        "amax_history_fwd": torch.rand(16, 2),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True},
    }
    saved = _TeLikeModule(fp8_state).state_dict()
    target = _TeLikeModule()
    load_model_state(target, saved, tmp_path)
    assert target.loaded["recipe"] == DelayedScaling()
    assert torch.equal(target.loaded["amax_history_fwd"], fp8_state["amax_history_fwd"])
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in os.environ  # the opt-in lasted for the load only


@pytest.mark.parametrize("payload", [_RunsCode(), {"recipe": print}], ids=["reduce", "foreign-global"])
def test_a_pickle_holding_anything_else_is_refused_in_one_line(te_recipe_module, tmp_path, payload):
    from megatron.checkpoint.checkpointing import load_model_state

    target = _TeLikeModule()
    refused = "(posix.getcwd|builtins.print), not Transformer Engine's FP8 state"
    with pytest.raises(CheckpointError, match=f"{tmp_path} is not loaded: _extra_state holds {refused}") as info:
        load_model_state(target, _TeLikeModule(payload).state_dict(), tmp_path)
    assert "\n" not in str(info.value) and target.loaded is None


def test_other_load_errors_pass_through(tmp_path):
    from megatron.checkpoint.checkpointing import load_model_state

    with pytest.raises(RuntimeError, match="Missing key") as info:
        load_model_state(torch.nn.Linear(2, 2), {}, tmp_path)
    assert not isinstance(info.value, CheckpointError)
