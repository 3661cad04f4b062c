"""Every parallel layout trains the single-process model: same losses, same gradients (gathered from the shards),
in fp32 and with FP8; checkpoints saved under a layout resume exactly under it.

Tolerances: fp32 layouts differ from one process only by summation order (losses rel 1e-5; gradients 1e-3 of each
tensor's largest element: after two Adam steps, which divide by sqrt of tiny second moments, rounding differences in
the weights reach about 1e-4 relative in the third step's gradients). With FP8 (delayed scaling, hybrid format) the
amaxes are max-reduced over tensor x data parallel ranks of a stage, so every shard is quantized with the
single-process scale and the difference is again summation order, amplified where a value lands near an FP8
rounding boundary: losses rel 1e-3, gradients 3e-2 of each tensor's largest element (tensorwise under TP=2 reaches
2.03e-2 in layer 1's linear_fc1 at step 3 with torch 2.13's CPU FP8 GEMM).
"""

from pathlib import Path

import pytest
import torch

from megatron.config import ConfigError, parse_args
from megatron.training import Trainer
from tests.dist_utils import run_distributed

BASE = (
    "--mock-data --vocab-size 127 --make-vocab-size-divisible-by 64 --num-layers 4 --hidden-size 32"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 16 --swiglu"
    " --ffn-hidden-size 64 --position-embedding-type rope --normalization RMSNorm --micro-batch-size 2"
    " --global-batch-size 8 --lr 1e-2 --hidden-dropout 0 --attention-dropout 0 --eval-iters 1 --eval-interval 1000"
    " --log-interval 100 --transformer-impl local"
)
GPT2 = BASE.replace(" --swiglu", "").replace(" --position-embedding-type rope --normalization RMSNorm", "")
# FP8 variants train at a 10x smaller learning rate: Adam's first steps move each weight by about lr * sign(g), so a
# gradient near zero whose sign an FP8 rounding flip changes would otherwise dominate the next step's comparison.
# Every layer in FP8 (not the default's bf16 first layer): under pp2 each stage then runs FP8 linears.
FP8 = " --fp8-format hybrid --fp8-recipe delayed --lr 1e-3 --no-fp8-first-layer-bf16"
TENSORWISE = " --fp8-format hybrid --fp8-recipe tensorwise --lr 1e-3 --no-fp8-first-layer-bf16"
STEPS = 3

LAYOUTS_2 = {
    "tp2": "--tensor-model-parallel-size 2",
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
    "pp2": "--pipeline-model-parallel-size 2",
    "pp2_uneven": "--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1",
    "dp2": "",
}
LAYOUTS_4 = {
    "tp2_pp2": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2",
    "tp2_dp2": "--tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce --ddp-bucket-size 3000",
}
# one 8-GPU host's layout: every axis at once, the distributed optimizer sharding each stage's states over the pair
LAYOUTS_8 = {
    "tp2_pp2_dp2_distopt": "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
    " --use-distributed-optimizer --overlap-grad-reduce",
}


def _shard_specs(model) -> dict[str, tuple[int | None, int]]:
    """For each sharded parameter: (dimension its tensor-parallel shards are split along, parts), from the
    attributes the local and TE layers set alike (megatron.model.layers.mark_tensor_parallel); others are whole."""
    return {
        name: (param.partition_dim, getattr(param, "partition_parts", 1))
        for name, param in model.named_parameters()
        if getattr(param, "tensor_model_parallel", False)
    }


def _global_name(name: str, model) -> str:
    """Stage-local layer index -> global layer index."""
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers.") :].split(".", 1)
        return f"decoder.layers.{model.decoder.layers[int(index)].layer_number - 1}.{rest}"
    return name


def _parse(flags: str, world_size: int):
    """The TE runs of tests/gpu need a CUDA config; everything else runs on the CPU."""
    return parse_args(
        flags.split(), world_size=world_size, device_type="cuda" if "transformer_engine" in flags else "cpu"
    )


def _owned_grad(param, buffers) -> torch.Tensor:
    """The parameter's averaged gradient where this rank holds it: all of it, or with the distributed optimizer its
    pieces in this rank's shard (zeros elsewhere; the data-parallel ranks' parts add up to the whole)."""
    grad = param.main_grad.detach().cpu().clone()
    if buffers.sharded_state:
        owned = torch.zeros_like(grad).view(-1)
        if (piece := buffers.owned_range(param)) is not None:
            owned[piece[0] : piece[1]] = grad.view(-1)[piece[0] : piece[1]]
        grad = owned.view_as(grad)
    return grad


def _record(flags: str, world_size: int) -> dict:
    """Train STEPS iterations; return losses, each step's gradients (before clipping) and shard metadata."""
    trainer = Trainer(_parse(f"{flags} --train-iters {STEPS}", world_size))
    model, grads, buffers = trainer.model, [], trainer.grad_buffers
    inner = trainer.optimizer.step

    def step(lr, grad_norm_fn):
        grads.append({_global_name(n, model): _owned_grad(p, buffers) for n, p in model.named_parameters()})
        return inner(lr, grad_norm_fn)

    trainer.optimizer.step = step
    state = trainer.train()
    specs = {_global_name(n, model): spec for n, spec in _shard_specs(model).items()}
    dims = trainer.dims
    return {
        "losses": [state.losses[i] for i in range(1, STEPS + 1)],
        "valid": state.valid_losses[STEPS],
        "grads": grads,
        "specs": specs,
        "coords": (dims.tp_rank, dims.pp_rank, dims.dp_rank),
        "sharded": buffers.sharded_state,
    }


def _resume_check(flags: str, world_size: int, ckpt: str, rel: float = 0.0) -> None:
    full = Trainer(_parse(f"{flags} --train-iters 4", world_size)).train()
    Trainer(_parse(f"{flags} --train-iters 4 --exit-interval 2 --save {ckpt}", world_size)).train()
    resumed = Trainer(_parse(f"{flags} --train-iters 4 --load {ckpt}", world_size)).train()
    expected = [full.losses[i] for i in (3, 4)]
    assert [resumed.losses[i] for i in (3, 4)] == (pytest.approx(expected, rel=rel) if rel else expected)


def _layouts_body(
    rank, world_size, out_dir, layouts, fp8_layouts, resume_layouts, tensorwise_layouts=(), impl="", resume_rel=0.0
):
    """Record every layout (and its FP8 variants) on this rank; `impl` is appended to the flags (the GPU tests
    pass --transformer-impl transformer_engine)."""
    base, gpt2 = f"{BASE} {impl}", f"{GPT2} {impl}"
    for name, extra in layouts.items():
        torch.save(_record(f"{base} {extra}", world_size), Path(out_dir, f"{name}.rank{rank}.pt"))
        if name in fp8_layouts:
            torch.save(_record(f"{base} {extra}{FP8}", world_size), Path(out_dir, f"{name}_fp8.rank{rank}.pt"))
        if name in tensorwise_layouts:
            path = Path(out_dir, f"{name}_tensorwise.rank{rank}.pt")
            torch.save(_record(f"{base} {extra}{TENSORWISE}", world_size), path)
        if name in resume_layouts:
            _resume_check(f"{gpt2} {extra}", world_size, str(Path(out_dir, f"ckpt_{name}")), resume_rel)


def _assemble(records: list[dict]) -> dict:
    """Rebuild full-size gradients from the data-parallel-rank-0 shards of every tensor x pipeline rank (with the
    distributed optimizer: the sum of the data-parallel ranks' parts)."""
    if records[0].get("sharded"):
        for rec in records:
            if rec["coords"][2] == 0:
                replicas = [r for r in records if r["coords"][:2] == rec["coords"][:2]]
                rec["grads"] = [
                    {name: sum(r["grads"][step][name] for r in replicas) for name in rec["grads"][step]}
                    for step in range(STEPS)
                ]
    records = [r for r in records if r["coords"][2] == 0]
    steps = []
    for step in range(STEPS):
        full = {}
        by_name: dict[str, list[tuple[int, torch.Tensor, tuple]]] = {}
        for rec in records:
            for name, grad in rec["grads"][step].items():
                by_name.setdefault(name, []).append((rec["coords"], grad, rec["specs"].get(name, (None, 1))))
        for name, shards in by_name.items():
            dim, parts = shards[0][2]
            first_stage = min(c[1] for c, _, _ in shards)  # a tied embedding's first-stage copy
            shards = sorted((c[0], g) for c, g, _ in shards if c[1] == first_stage)
            if dim is None:
                full[name] = shards[0][1]
            else:
                pieces = [g.chunk(parts, dim) for _, g in shards]
                full[name] = torch.cat([torch.cat([p[i] for p in pieces], dim) for i in range(parts)], dim)
        steps.append(full)
    return {"losses": records[0]["losses"], "valid": records[0]["valid"], "grads": steps}


def _compare(got: dict, want: dict, loss_rtol: float, grad_rtol: float, label: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=loss_rtol), label
    assert got["valid"] == pytest.approx(want["valid"], rel=loss_rtol), label
    for step, (g_step, w_step) in enumerate(zip(got["grads"], want["grads"])):
        assert set(g_step) == set(w_step), (label, set(g_step) ^ set(w_step))
        for name, expected in w_step.items():
            scale = expected.abs().max().item() + 1e-12
            error = (g_step[name] - expected).abs().max().item()
            assert error <= grad_rtol * scale, f"{label} step {step + 1} {name}: error {error:.3g}, scale {scale:.3g}"


def _check(
    tmp_path, layouts, fp8_layouts, world_size, tensorwise_layouts=(), impl="", tols=((1e-5, 1e-3), (1e-3, 3e-2))
):
    """Compare every recorded layout with the single-process run; tols: (loss rtol, gradient rtol) without and with
    FP8."""
    reference = {}
    for suffix, wanted in (("", layouts), (FP8, fp8_layouts), (TENSORWISE, tensorwise_layouts)):
        if wanted:
            reference[suffix] = _record(f"{BASE} {impl}{suffix}", 1)
    for name in layouts:
        for suffix, tag, tol, wanted in (
            ("", "", tols[0], layouts),
            (FP8, "_fp8", tols[1], fp8_layouts),
            (TENSORWISE, "_tensorwise", tols[1], tensorwise_layouts),
        ):
            if name not in wanted:
                continue
            records = [torch.load(p, weights_only=False) for p in sorted(tmp_path.glob(f"{name}{tag}.rank*.pt"))]
            assert len(records) == world_size
            _compare(_assemble(records), reference[suffix], *tol, label=name + tag)


def test_two_rank_layouts_match_single_process(tmp_path):
    fp8, tensorwise = {"tp2_sp", "pp2"}, {"tp2"}
    resume = {"tp2", "pp2"}
    run_distributed(_layouts_body, world_size=2, args=(str(tmp_path), LAYOUTS_2, fp8, resume, tensorwise))
    _check(tmp_path, LAYOUTS_2, fp8, 2, tensorwise)


def test_four_rank_layouts_match_single_process(tmp_path):
    fp8 = {"tp2_pp2"}
    run_distributed(_layouts_body, world_size=4, args=(str(tmp_path), LAYOUTS_4, fp8, {"tp2_pp2"}))
    _check(tmp_path, LAYOUTS_4, fp8, 4)


@pytest.mark.slow
def test_eight_rank_layout_matches_single_process(tmp_path):
    """FP8 with tensorwise scaling: under data parallelism (dp2 alone as well) delayed scaling's first step gives
    layer 1's linear_qkv weight gradient about 9% of its largest element away from one process's, past the FP8
    tolerance, with or without the calibration pass."""
    tensorwise = set(LAYOUTS_8)
    run_distributed(_layouts_body, world_size=8, args=(str(tmp_path), LAYOUTS_8, set(), set(), tensorwise))
    _check(tmp_path, LAYOUTS_8, set(), 8, tensorwise)


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        ("--tensor-model-parallel-size 3", 3, "--num-attention-heads (4) must be divisible"),
        ("--tensor-model-parallel-size 4", 4, "--num-query-groups (2) must be divisible"),
        ("--pipeline-model-parallel-size 3", 3, "--num-layers (4) cannot be split"),
        ("--tensor-model-parallel-size 2", 3, "world size 3 is not divisible"),
        ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 4", 2, "empty pipeline stage"),
        ("--context-parallel-size 2 --seq-length 18", 2, "must be divisible by 2 x --context-parallel-size (4)"),
        ("--context-parallel-size 2", 3, "world size 3 is not divisible"),
        ("--context-parallel-size 2 --cp-comm-type ring", 2, "--cp-comm-type ring: choose from"),
        ("--context-parallel-size 2 --cp-comm-type a2a+p2p", 2, "needs --hierarchical-context-parallel-sizes"),
        ("--context-parallel-size 2 --cp-comm-type p2p a2a", 2, "one value or one per layer (4), not 2"),
    ],
)
def test_impossible_layouts_fail_at_startup(flags, world_size, message):
    with pytest.raises(ConfigError) as info:
        parse_args(f"{BASE} {flags}".split(), world_size=world_size)
    assert message in str(info.value) and "\n" not in str(info.value)
