"""SdpaDotProductAttention: the local layer spec's fused attention equals megatron's unfused one.

The CPU actor's layer spec swaps megatron-core's DotProductAttention for a subclass that
calls torch's scaled_dot_product_attention on the causal, unmasked case. On random
grouped-query inputs the output and the gradients of q, k, v must equal the unfused
implementation's to fp32 rounding, and every case the fused path does not cover (an
explicit mask, attention dropout while training) must run the unfused code exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank


def _worker(checkpoint: str) -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dapo import parallel
    from megatron_dapo.models import adapter_for
    from megatron_dapo.models.sdpa_attention import SdpaDotProductAttention

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    parallel.initialize_model_parallel(1, 1, seed=0)
    spec = adapter_for(checkpoint).layer_spec(use_te=False)
    out: dict = {"spec": spec.submodules.self_attention.submodules.core_attention is SdpaDotProductAttention}
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               attention_dropout=0.1, attention_softmax_in_fp32=True)
    kwargs = {"config": config, "layer_number": 1, "attn_mask_type": AttnMaskType.causal, "attention_type": "self"}
    fused, unfused = SdpaDotProductAttention(**kwargs), DotProductAttention(**kwargs)
    fused.eval(), unfused.eval()
    gen = torch.Generator().manual_seed(0)
    sq, b = 13, 3
    q = torch.randn(sq, b, 8, 8, generator=gen, requires_grad=True)
    k = torch.randn(sq, b, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(sq, b, 2, 8, generator=gen, requires_grad=True)
    grad_out = torch.randn(sq, b, 64, generator=gen)
    results = []
    for module in (fused, unfused):
        ctx = module(q, k, v, None)
        results.append((ctx.detach(), *torch.autograd.grad(ctx, (q, k, v), grad_out)))
    out["max_diff"] = max(float((a - c).abs().max()) for a, c in zip(*results))
    out["shape"] = tuple(results[0][0].shape)
    # An explicit mask takes the unfused path: results are bit-identical.
    mask = torch.triu(torch.ones(b, 1, sq, sq, dtype=torch.bool), diagonal=1)
    mask[0, 0, :, 0] = True  # hide key 0 from every query of row 0: not expressible as is_causal
    mask[0, 0, 0, 0] = False
    out["masked_equal"] = torch.equal(fused(q, k, v, mask), unfused(q, k, v, mask))
    out["masked_differs_from_causal"] = not torch.allclose(fused(q, k, v, mask), fused(q, k, v, None))
    parallel.destroy()
    return out


def test_sdpa_attention_matches_megatron_unfused_attention(tmp_path) -> None:
    (result,) = run_distributed(_worker, 1, str(make_tiny_checkpoint(tmp_path / "qwen2", num_layers=1)))
    assert result["spec"]
    assert result["shape"] == (13, 3, 64)
    assert result["max_diff"] < 1e-5
    assert result["masked_equal"] and result["masked_differs_from_causal"]
