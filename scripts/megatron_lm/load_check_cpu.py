"""Megatron-Core itself loads what `convert.py --saver mcore` writes: a CPU check with Megatron-LM's own sources.

    python scripts/megatron_lm/load_check_cpu.py                  # Megatron-LM's sources in .anchors/megatron
    python scripts/megatron_lm/load_check_cpu.py --megatron PATH  # or elsewhere (the folder holding megatron/core)

This project writes a small Llama (3 layers, GQA, SwiGLU, RMSNorm, RoPE; untied and tied) with --saver mcore:
torch_dist for TP=1 and TP=2, torch for TP=1 and TP=2. Then, in processes that import Megatron-LM's `megatron`
package instead of this one (the two share the name), Megatron-Core builds its GPTModel at TP=1 or 2 (gloo) and
loads each checkpoint the way Megatron-LM's load_checkpoint does: torch_dist through
`dist_checkpointing.load_common_state_dict` and `dist_checkpointing.load` of the model's sharded_state_dict (strict
key and global-shape checks, resharding to the other TP, the padded vocabulary of that TP), torch through
`torch.load` with Megatron-Core's weights-only safe globals. Its logits must equal this project's (fp32, 1e-5).

On a CPU, Megatron-Core runs its `local` layer spec (TE needs a GPU): its norms are `input_layernorm` /
`pre_mlp_layernorm` in a torch file (renamed on loading here) and the TE spec's names in torch_dist (its layers map
them); the TE spec's own keys are checked against Megatron-LM's checkpoints in tests/unit/test_convert_mcore_save.py.
Megatron-Core imports Triton at module level: a stand-in module is installed for that import only after torch
has settled that Triton is absent. Exit status 1 when a load fails or the logits differ.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository
VOCAB, SEQ = 100, 16
CASES = [("td1", 1), ("td2", 2), ("td1", 2), ("td2", 1), ("torch1", 1), ("torch2", 2)]


def write_checkpoints(out: Path, tied: bool) -> None:
    """This project's side: the model, its mcore checkpoints, the reference logits."""
    from megatron.config.pipeline_split import stage_layer_numbers
    from megatron.convert import atomic_output_dir, write_mcore
    from megatron.convert.state import full_model_of, model_config
    from megatron.model.gpt import GPTModel, Stage
    from megatron.parallel.tensor_parallel import TensorParallel

    arch = dict(
        num_layers=3, hidden_size=64, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        swiglu=True, ffn_hidden_size=96, normalization="RMSNorm", position_embedding_type="rope", rotary_base=5000,
        disable_bias_linear=True, untie_embeddings_and_output_weights=not tied, hidden_dropout=0.0,
        attention_dropout=0.0, seq_length=SEQ, max_position_embeddings=SEQ, transformer_impl="local",
    )  # fmt: skip
    cfg = model_config(**arch)
    torch.manual_seed(0)
    stage = Stage(stage_layer_numbers(cfg.num_layers, 1, 0), pre_process=True, post_process=True)
    model = GPTModel(cfg, 128, tp=TensorParallel(None, 1, 0), stage=stage).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not the ones they start as
                param.normal_(1.0, 0.2)
    data = {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1}
    full = full_model_of(cfg, model.state_dict(), VOCAB, "test", iteration=7, consumed_samples=56, data=data)
    for name, fmt, tp in (("td1", "torch_dist", 1), ("td2", "torch_dist", 2), ("torch1", "torch", 1),
                          ("torch2", "torch", 2)):  # fmt: skip
        with atomic_output_dir(out / name) as folder:
            write_mcore(full, folder, tp, 1, fmt)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens)[..., :VOCAB]
    torch.save({"tokens": tokens, "logits": logits, "arch": arch}, out / "ref.pt")


def _without_triton() -> None:
    """Megatron-Core's MoE and fusion modules import Triton at module level; this CPU torch has none. Torch's own
    modules settle that first (they cache "no Triton"), then a stand-in answers Megatron-Core's imports."""
    import importlib

    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()
    torch_triton.has_triton()
    for module in ("torch._dynamo", "functorch.compile", "torch._inductor.runtime.triton_compat",
                   "torch._inductor.utils", "torch.utils.flop_counter"):  # fmt: skip
        importlib.import_module(module)

    class StandIn(types.ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            if name[:1].isupper():
                return type(name, (), {"__init__": lambda self, *a, **k: None})
            return lambda *a, **k: a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda f: f)

    for name in ("triton", "triton.language", "triton.runtime", "triton.runtime.jit"):
        module = StandIn(name)
        module.__path__, module.__version__ = [], "3.4.0"
        sys.modules[name] = module
    sys.modules["triton"].language = sys.modules["triton.language"]  # `import triton.language as tl`


def megatron_side(root: Path, name: str, tp: int) -> None:
    """Megatron-Core's side, one torchrun process per TP rank."""
    import torch.distributed as dist
    import torch.nn.functional as F

    _without_triton()
    torch.cuda.current_device = lambda: "cpu"  # its RoPE moves the frequencies to "the GPU" on first use
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # no dropout, no CUDA
    ref = torch.load(root / "ref.pt", weights_only=True)
    arch = ref["arch"]
    config = TransformerConfig(
        num_layers=arch["num_layers"], hidden_size=arch["hidden_size"], num_attention_heads=arch["num_attention_heads"],
        num_query_groups=arch["num_query_groups"], ffn_hidden_size=arch["ffn_hidden_size"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        perform_initialization=False, params_dtype=torch.float32, attention_backend=AttnBackend.local,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, gradient_accumulation_fusion=False,
    )  # fmt: skip
    iteration = int((root / name / "latest_checkpointed_iteration.txt").read_text())
    folder = root / name / f"iter_{iteration:07d}"
    dist_format = (folder / "metadata.json").exists()
    if dist_format:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    else:  # Megatron-LM's torch.load: weights only, with the safe globals Megatron-Core registers
        common = torch.load(folder / f"mp_rank_{dist.get_rank():02d}" / "model_optim_rng.pt", map_location="cpu")
    args = common["args"]
    multiple = 128 * tp  # Megatron-LM's padding for this run's TP (NullTokenizer: vocab_size + 1 entries)
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=-(-(args.vocab_size + 1) // multiple)
        * multiple, max_sequence_length=SEQ, parallel_output=False, position_embedding_type="rope",
        share_embeddings_and_output_weights=not arch["untie_embeddings_and_output_weights"],
        rotary_base=arch["rotary_base"],
    ).eval()  # fmt: skip
    if dist_format:
        metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, str(folder))["model"]
    else:
        rename = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
                  "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}  # fmt: skip
        loaded = {}
        for key, value in common["model"].items():
            for te_name, local_name in rename.items():
                key = key.replace(te_name, local_name)
            loaded[key] = value
    result = model.load_state_dict(loaded, strict=False)
    problems = [k for k in result.missing_keys + result.unexpected_keys if not k.endswith("_extra_state")]
    tokens = ref["tokens"]
    positions = torch.arange(SEQ).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        diff = (model(tokens, positions, mask)[..., :VOCAB] - ref["logits"]).abs().max().item()
    if dist.get_rank() == 0:
        ok = not problems and diff < 1e-5
        print(f"{'ok  ' if ok else 'FAIL'} {root.name}/{name} loaded at TP={tp}: iteration {common['iteration']},"
              f" consumed samples {args.consumed_train_samples}, missing/unexpected {problems},"
              f" max |logit difference| {diff:.1e}")  # fmt: skip
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron", default=str(ROOT / ".anchors" / "megatron"), help="Megatron-LM's sources")
    parser.add_argument("--side", nargs=3, help=argparse.SUPPRESS)  # internal: ROOT NAME TP, in torchrun
    args = parser.parse_args()
    if args.side:
        megatron_side(Path(args.side[0]), args.side[1], int(args.side[2]))
        return 0
    if not (Path(args.megatron) / "megatron" / "core").is_dir():
        print(f"no Megatron-LM sources in {args.megatron} (see ../shared/anchors/README.md): pass --megatron")
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for tied in (False, True):
            root = Path(tmp) / ("tied" if tied else "untied")
            write_checkpoints(root, tied)
            env = dict(os.environ, PYTHONPATH=args.megatron)  # Megatron-LM's `megatron`, not this project's
            for name, tp in CASES:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port",
                       "29733", __file__, "--side", str(root), name, str(tp)]  # fmt: skip
                run = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
                lines = [line for line in run.stdout.splitlines() if line.startswith(("ok  ", "FAIL"))]
                errors = [line for line in run.stderr.splitlines() if "Error" in line or "Exception" in line]
                print("\n".join(lines) or f"FAIL {root.name}/{name} at TP={tp}: {' / '.join(errors[:3])[-600:]}")
                failed += run.returncode != 0 or not lines or lines[0].startswith("FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
