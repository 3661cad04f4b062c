"""Checkpoint layout: folder names, metadata, the layout check and corrupt pointers."""

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


class _RefusesItsPickledState(torch.nn.Module):
    """Stands in for a Transformer Engine module whose pickled delayed-scaling state TE refuses to unpickle."""

    def __init__(self, message: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.message = message

    def get_extra_state(self) -> torch.Tensor:
        return torch.ones(3, dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        raise RuntimeError(self.message)


def test_te_refusing_its_pickled_fp8_state_is_one_line_naming_the_variable(tmp_path):
    from megatron.checkpoint.checkpointing import load_model_state

    te_message = (
        "Refusing to load pickled Transformer Engine extra state for LayerNormLinear. ... To load it anyway, set"
        " NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1."
    )
    module = _RefusesItsPickledState(te_message)
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1") as info:
        load_model_state(module, module.state_dict(), tmp_path)
    assert "\n" not in str(info.value)
    other = _RefusesItsPickledState("something else broke")
    with pytest.raises(RuntimeError, match="something else broke") as info:  # other errors pass through as they are
        load_model_state(other, other.state_dict(), tmp_path)
    assert not isinstance(info.value, CheckpointError)
