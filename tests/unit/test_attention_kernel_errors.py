"""The one line for an attention call Transformer Engine has no kernel for names what was asked and the change that
gives it a kernel, never the flag the run already has."""

import torch

from megatron.model.te_attention import attention_kernel_missing


def test_each_cause_gets_its_own_fix():
    forced = attention_kernel_missing("flash", 64, torch.bfloat16, False)
    assert "(head dim 64, bfloat16, no FP8 attention)" in forced and "--attention-backend flash" in forced
    assert forced.endswith("use auto")
    fp8 = attention_kernel_missing("auto", 64, torch.bfloat16, True)
    assert "FP8 attention" in fp8 and "drop the flag or change --kv-channels" in fp8 and "use auto" not in fp8
    neither = attention_kernel_missing("auto", 256, torch.float16, False)
    assert "NVTE_DEBUG=1" in neither and "--attention-backend" not in neither
    deterministic = attention_kernel_missing("auto", 128, torch.bfloat16, True, deterministic=True)
    assert "no deterministic FP8 attention kernel" in deterministic
    assert deterministic.endswith("drop --fp8-dot-product-attention or --deterministic-mode")
