"""Which RoPE the attention layers run (megatron/model/rope_kernel.py), the fused kernel's launch sizes and its cos/sin
table: the CPU side, without Triton. The kernel's numbers are tests/gpu/test_rope_kernel.py's."""

from __future__ import annotations

import pytest
import torch

from megatron.config import parse_args
from megatron.model import GPTModel, rope_kernel, transformer
from megatron.model.layers import RotaryEmbedding

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
SHARED = torch.zeros(16, 1, 1, 8)  # [s, 1, 1, d]: positions shared by the batch
PER_SAMPLE = torch.zeros(16, 2, 1, 8)  # [s, b, 1, d]: per-sample position ids


@pytest.mark.parametrize("triton", [True, False])
def test_rope_path(monkeypatch, triton):
    monkeypatch.setattr(rope_kernel, "available", lambda: triton)
    for te_kernel in (True, False):
        # the CPU, --no-rope-fusion (or --qk-layernorm), per-sample positions: the unfused ops
        assert rope_kernel.rope_path(True, SHARED, CPU, te_kernel) == "unfused"
        assert rope_kernel.rope_path(False, SHARED, CUDA, te_kernel) == "unfused"
        assert rope_kernel.rope_path(True, PER_SAMPLE, CUDA, te_kernel) == "unfused"
    # CUDA with shared positions: this kernel; without Triton, TE's in the TE layer, the unfused ops in the local one
    assert rope_kernel.rope_path(True, SHARED, CUDA, te_kernel=True) == ("triton" if triton else "te")
    assert rope_kernel.rope_path(True, SHARED, CUDA, te_kernel=False) == ("triton" if triton else "unfused")


def test_the_plain_gpt_on_the_cpu_never_calls_the_kernel(monkeypatch):
    """The oracle stays op for op what it was, whether Triton is importable or not."""
    monkeypatch.setattr(rope_kernel, "available", lambda: True)

    def refuse(*args):
        raise AssertionError("the fused RoPE kernel ran on the CPU")

    monkeypatch.setattr(transformer, "fused_qkv_rope", refuse)
    flags = (
        "--mock-data --vocab-size 64 --num-layers 1 --hidden-size 32 --num-attention-heads 4 --group-query-attention"
        " --num-query-groups 2 --seq-length 8 --micro-batch-size 1 --position-embedding-type rope"
    )
    cfg = parse_args(flags.split(), device_type="cpu")
    model = GPTModel(cfg.model, 64, precision=cfg.precision)
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)


def test_config_llama_shapes():
    """llama-1b: one warp holds a key block (8 heads x 32 channels) in 16-byte vectors and all 32 query heads;
    Llama-3-8B (head size 128): two warps; short rows (8 tensor-parallel ranks) go two to a program."""
    one_b = rope_kernel.config(32, 8, 64, 64, 8192)
    assert (one_b["num_warps"], one_b["Q_HEADS_B"], one_b["KV_HEADS_B"], one_b["ROWS"]) == (1, 32, 8, 1)
    assert (one_b["PER"], one_b["HALF"], one_b["HALF_B"], one_b["REST"]) == (4, 32, 32, 0)
    eight_b = rope_kernel.config(32, 8, 128, 128, 8192)
    assert (eight_b["num_warps"], eight_b["Q_HEADS_B"], eight_b["ROWS"]) == (2, 32, 1)
    tp8 = rope_kernel.config(4, 1, 128, 128, 8192)
    assert (tp8["num_warps"], tp8["Q_HEADS_B"], tp8["KV_HEADS_B"], tp8["ROWS"]) == (1, 4, 1, 2)


def test_config_blocks_of_heads_odd_sizes_and_overrides():
    many = rope_kernel.config(128, 8, 128, 128, 512)
    assert many["Q_HEADS_B"] == 32 and many["num_warps"] == 2  # four blocks of 32 query heads
    odd = rope_kernel.config(12, 4, 96, 24, 6)  # 3 heads per group, a quarter rotated, head size 96
    sizes = ("PER", "HN_B", "HALF", "HALF_B", "REST", "REST_B")
    assert tuple(odd[name] for name in sizes) == (3, 128, 12, 16, 72, 128)
    assert rope_kernel.config(2, 1, 32, 32, 6)["ROWS"] == 2  # 128-element rows: two divide 6 rows, four would not
    forced = rope_kernel.config(32, 8, 64, 64, 8192, rows_per_program=4, num_warps=8)
    assert (forced["ROWS"], forced["num_warps"], forced["Q_HEADS_B"]) == (4, 8, 32)


@pytest.mark.parametrize(
    "args, message",
    [
        ((30, 8, 64, 64, 16), "30 query heads do not split into 8 groups"),
        ((32, 8, 64, 33, 16), "rotary dimension 33: must be even"),
        ((32, 8, 64, 128, 16), "rotary dimension 128: must be even and in 2..64"),
    ],
)
def test_config_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        rope_kernel.config(*args)
    with pytest.raises(ValueError, match="3 rows per program do not divide 16 rows"):
        rope_kernel.config(32, 8, 64, 64, 16, rows_per_program=3)


def test_trig_table_is_the_angles_cos_and_sin():
    angles = RotaryEmbedding(16, 10000)(12)  # [12, 1, 1, 16]
    table = rope_kernel.trig_table(angles, 10)  # the first 10 positions
    assert table.shape == (2, 10, 16) and table.dtype == torch.float32 and table.is_contiguous()
    assert torch.equal(table[0], angles[:10, 0, 0].cos()) and torch.equal(table[1], angles[:10, 0, 0].sin())
    for bad in (angles[:9], angles.expand(12, 2, 1, 16), angles[:, 0]):
        with pytest.raises(ValueError, match=r"the kernel takes \[s2 >= 10, 1, 1, d\]"):
            rope_kernel.trig_table(bad, 10)


def test_trig_table_is_made_once_per_angles_and_length_while_they_are_unchanged():
    rotary = RotaryEmbedding(16, 10000)
    angles = rotary(12)
    table = rope_kernel.trig_table(angles, 10)
    assert rope_kernel.trig_table(angles, 10) is table  # every layer of a forward and its backward
    other_length = rope_kernel.trig_table(angles, 12)
    assert other_length.shape == (2, 12, 16) and torch.equal(other_length[0], angles[:, 0, 0].cos())
    # new angles (the next micro-batch's, or per-sample positions) and angles changed in place get a new table
    fresh = rotary(12)
    assert rope_kernel.trig_table(fresh, 12) is not other_length
    angles.mul_(2)
    again = rope_kernel.trig_table(angles, 12)
    assert again is not other_length and torch.equal(again[1], angles[:, 0, 0].sin())
    with torch.inference_mode():  # tensors without a version counter: a table each call
        frozen = rotary(12)
        assert rope_kernel.trig_table(frozen, 12) is not rope_kernel.trig_table(frozen, 12)


def test_launch_without_triton_names_the_fix(monkeypatch):
    monkeypatch.setattr(rope_kernel, "build", lambda: None)
    packed = torch.zeros(4, 1, 2, 6 * 8)
    with pytest.raises(RuntimeError, match=r"needs Triton \(pip install triton\); --no-rope-fusion does not"):
        rope_kernel.qkv_rope_forward(packed, RotaryEmbedding(8, 10000)(4), 4)
    with pytest.raises(ValueError, match="a packed row of 48 channels does not hold 5 \\+ 2 heads per group"):
        rope_kernel.qkv_rope_forward(packed, RotaryEmbedding(8, 10000)(4), 5)
