"""Mixture-of-experts settings: an HF MoE config as megatron-core 0.16.1 TransformerConfig fields.

Read in megatron-core 0.16.1 (transformer/moe/router.py, moe_utils.py, token_dispatcher.py,
moe_layer.py) against transformers 5.19's Qwen3MoeTopKRouter:

- Routing. HF: p = softmax(logits) in fp32, top-k of p, divided by their sum when
  ``norm_topk_prob``. megatron's ``topk_routing_with_score_function``: with
  ``moe_router_pre_softmax`` the fp32 softmax comes first and the top-k values are used
  as they are (HF with norm_topk_prob=False); without it, top-k of the logits and a softmax
  over those k (exactly the renormalised top-k probabilities: norm_topk_prob=True). The
  router's logits are taken in the model dtype (``moe_router_dtype`` None), as HF and the
  engines do: the actor routes like the engines that sampled the tokens.
- Token dispatcher: ``alltoall`` on every device. It runs on gloo (torch 2.13's gloo has
  all_to_all_single, all_gather_into_tensor and reduce_scatter_tensor, pinned in
  tests/multirank/test_moe_expert_parallel.py), accepts variable sequence lengths (which
  the actor's pipeline needs; ``allgather`` refuses them in TransformerConfig) and is
  megatron's dispatcher for expert parallelism on GPUs; ``flex`` needs DeepEP/HybridEP.
- Tensor parallelism: MoELayer.forward raises in training when TP > 1 without sequence
  parallelism, so the actor requires parallel.sequence_parallel with MoE and TP > 1
  (forward-only passes, e.g. tools/check_parity.py, run without it).
- Without Transformer Engine, megatron-core 0.16.1's router cannot run: moe_utils imports
  ``te_general_gemm`` only inside its TE try-block, and RouterGatingLinearFunction tests
  ``te_general_gemm is not None`` (NameError) before its torch.mm fallback.
  :func:`ensure_router_fallback` defines the name as None when TE is absent, which selects
  megatron's own fallback; it changes nothing where TE imports (tests/unit/test_models_moe.py).
- One optimizer layout at every EP size. megatron marks an expert weight ``allreduce=False``
  only when expert_model_parallel_size > 1 (tensor_parallel/layers.py), and
  get_megatron_optimizer puts exactly those in a second optimizer of its ChainedOptimizer;
  the chain's non-tensor state (param groups, step) is saved per optimizer, so a checkpoint
  saved at EP 2 (two optimizers) did not load at EP 1 (one). :func:`mark_expert_parameters`
  marks every expert weight at every EP size; at EP 1 the expert data-parallel group is the
  data-parallel group, so gradients and updates are the same
  (tests/multirank/test_actor_moe.py saves at EP 2 and resumes at EP 1).
- Load-balancing loss: megatron's switch loss (``moe_router_load_balancing_type="aux_loss"``)
  with ``moe_aux_loss_coeff`` is attached to the router's output by MoEAuxLossAutoScaler,
  whose gradient scale the pipeline schedule sets to 1 / num_microbatches, and DDP averages
  it over data-parallel ranks: the mean over micro-batches and ranks of each layer's loss,
  independent of the DAPO loss's own token normalisation.
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.models.config import HFModelConfig


def ensure_router_fallback() -> bool:
    """Give megatron's moe_utils the ``te_general_gemm = None`` its no-TE path expects.

    Returns:
        True when the name had to be defined (Transformer Engine is not importable).
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def mark_expert_parameters(model: Any) -> int:
    """Mark every routed expert's weights ``allreduce=False`` (expert-parallel), whatever the EP size.

    Args:
        model: a freshly built GPTModel (before DDP and the optimizer).

    Returns:
        The number of parameters marked.
    """
    marked = 0
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
            marked += 1
    return marked


TOKEN_DISPATCHER = "alltoall"
"""megatron-core's token dispatcher for every MoE model, CPU (gloo) and GPU (NCCL) alike."""


def moe_config_kwargs(hf: HFModelConfig, *, ep: int, etp: int | None, aux_loss_coeff: float) -> dict[str, Any]:
    """TransformerConfig fields of the model's experts (empty for a dense model).

    Args:
        hf: parsed HF config.
        ep: expert-parallel size.
        etp: expert tensor-parallel size; None = the TP size.
        aux_loss_coeff: load-balancing loss weight (0 = off).

    Returns:
        Keyword arguments for TransformerConfig.
    """
    if not hf.is_moe:
        if ep > 1:
            raise ValueError(f"expert parallelism (ep={ep}) needs a mixture-of-experts model, but "
                             f"{hf.architecture} is dense; set parallel.expert_model_parallel_size=1")
        if aux_loss_coeff:
            raise ValueError(f"model.moe_aux_loss_coeff={aux_loss_coeff} applies to mixture-of-experts models only; "
                             f"{hf.architecture} is dense: set it to 0")
        return {}
    if aux_loss_coeff < 0:
        raise ValueError(f"model.moe_aux_loss_coeff={aux_loss_coeff} must be >= 0")
    if hf.num_experts % ep != 0:
        raise ValueError(f"num_experts={hf.num_experts} is not divisible by expert_model_parallel_size={ep}; "
                         f"pick ep among its divisors")
    return {
        "num_moe_experts": hf.num_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_layer_freq": [int(i in hf.moe_layers) for i in range(hf.num_layers)],
        "moe_router_pre_softmax": not hf.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": aux_loss_coeff,
        "moe_token_dispatcher_type": TOKEN_DISPATCHER,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
    }
