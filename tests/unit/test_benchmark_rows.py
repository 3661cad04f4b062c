"""megatron/perf/rows.py: the benchmark's configs and layouts composed from their axes. Every name the catalogue held
as a hand-written flag string (tests/assets/benchmark_rows.json) still gives exactly those flags."""

import json

import pytest

from megatron.perf import rows
from tests.assets.scripts import ROOT

EXPECTED = json.loads((ROOT / "tests/assets/benchmark_rows.json").read_text())


def test_every_catalogue_config_gives_its_flag_string_in_the_same_order():
    assert list(rows.CONFIGS.items()) == list(EXPECTED["configs"].items())
    assert list(rows.FSDP_ONLY_CONFIGS) == EXPECTED["fsdp_only"]


def test_every_catalogue_layout_gives_its_gpus_and_flag_string_in_the_same_order():
    assert [(name, list(row)) for name, row in rows.LAYOUTS.items()] == list(EXPECTED["layouts"].items())


def test_names_round_trip_through_their_axes():
    for name in rows.CONFIGS:
        assert rows.config(name).name == name
    for name in rows.LAYOUTS:
        assert rows.layout(name).name == rows.LAYOUT_ALIASES.get(name, name)
    assert rows.layout("fsdp2_tp2") == rows.layout("tp2_fsdp2")


def test_compositions_outside_the_catalogue_resolve_from_their_axes():
    composed = rows.config("local-tensorwise-fp8params-chunkce-recompute-block3")
    assert composed.flags == (
        "--transformer-impl local --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather"
        " --cross-entropy-loss-fusion --cross-entropy-fusion-impl chunked"
        " --recompute-granularity full --recompute-method block --recompute-num-layers 3"
    )
    assert rows.layout_of("tp2_pp2_dp2_distopt") == (
        8,
        "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
        " --overlap-grad-reduce --use-distributed-optimizer --overlap-param-gather",
    )
    assert rows.layout_of("fsdp2_bf16comm_units100m")[1].endswith(
        "--megatron-fsdp-grad-comm-dtype bf16 --suggested-communication-unit-size 100000000"
    )


@pytest.mark.parametrize(
    "name, message",
    [
        ("te-fp16", "recipe one of bf16, delayed"),
        ("te-delayed-o2-fp8params", "write it as te-delayed-fp8params-o2"),
        ("te-delayed-fp9", "unknown option 'fp9'"),
        ("te-delayed-recompute-half", "unknown recomputation 'half'"),
    ],
)
def test_a_config_name_of_no_axes_is_a_one_line_error(name, message):
    with pytest.raises(ValueError, match=message):
        rows.config(name)


@pytest.mark.parametrize(
    "name, message",
    [("dp2_tp2", "unknown part 'tp2'"), ("pp2_tp2", "write it as tp2_pp2"), ("fsdp2_zero9", "unknown part 'zero9'")],
)
def test_a_layout_name_of_no_axes_is_a_one_line_error(name, message):
    with pytest.raises(ValueError, match=message):
        rows.layout(name)


def test_an_fsdp_engine_over_other_than_two_data_parallel_ranks_names_them():
    row = rows.layout("tp2_dp4_fsdp2_o2states")
    assert (row.gpus, row.data_parallel, row.engine, row.name) == (8, 4, "fsdp2", "tp2_dp4_fsdp2_o2states")
    assert rows.layout_of("dp8_fsdp2") == (8, rows.FSDP_ENGINES["fsdp2"])
    assert rows.layout("fsdp2").data_parallel == 2
    with pytest.raises(ValueError, match="write it as tp2_fsdp2"):
        rows.layout("tp2_dp2_fsdp2")
