"""Which transformer implementation the model is built from, and which kernel fusions it then gets.

The actor's GPTModel is built once, before the RL loop's first step (run.py), from one of two
layer specs: Transformer Engine's (GPU only) or megatron-core's local one (CPU and CUDA alike).
``model.transformer_impl`` picks between them (choose_transformer_impl); `config validate` asks
first where TE is required, so that a node where TE cannot run stops with one line rather than
crashing at build. The TransformerConfig fusions follow from that choice and from what
else imports here (apex, triton), not from how a family reads config.json or names its
weights: that is adapter.py's job, which only consumes the answers (build_model, layer_spec).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from megatron_dapo.errors import UserError

logger = logging.getLogger(__name__)


@functools.cache
def te_status() -> tuple[bool, str]:
    """Whether the Transformer Engine layer spec can be used here, and if not why.

    "Installed" is not enough: a node whose TE wheel was built for another torch or CUDA has the
    package but its torch extension fails to import, and the TE spec then crashed at build. So TE
    counts only once `transformer_engine.pytorch` has imported, next to a visible GPU.
    """
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "transformer_engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # an ABI mismatch is an ImportError, OSError or RuntimeError
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return False, f"transformer_engine is installed but transformer_engine.pytorch failed to import ({type(err).__name__}: {first})"
    return True, ""


def te_available() -> bool:
    """Whether the Transformer Engine layer spec can be used (te_status)."""
    return te_status()[0]


def choose_transformer_impl(setting: str) -> bool:
    """model.transformer_impl -> whether to build the TE layer spec (else megatron's local spec).

    Args:
        setting: "auto" (TE where it imports next to a GPU; the reason logged where it does not, on
            a GPU), "local" (megatron's own layers, on CPU and CUDA alike) or "transformer_engine".

    Raises:
        UserError: "transformer_engine" where it cannot be used, naming why.
    """
    usable, why = te_status()
    if setting == "local":
        return False
    if setting == "transformer_engine":
        if not usable:
            raise UserError(f"model.transformer_impl=transformer_engine: {why}; install Transformer Engine for this "
                            "torch and CUDA, or set model.transformer_impl=local (megatron's own layers)")
        return True
    if setting != "auto":
        raise ValueError(f"model.transformer_impl={setting!r}")
    if not usable and torch.cuda.is_available():
        logger.warning("model.transformer_impl=auto: megatron's local layer spec, since %s", why)
    return usable


FUSION_FLAGS = ("apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                "moe_permute_fusion", "moe_router_fusion")
"""The TransformerConfig kernel fusions :func:`kernel_fusions` decides."""


def kernel_fusions(*, use_te: bool, apex_wgrad: bool, triton: bool, moe: bool = False,
                   routing_replay: bool = False) -> dict[str, bool]:
    """TransformerConfig fusion flags for the layer spec in use (read in megatron-core 0.16.1).

    Only the TE spec (so a GPU) gets any; the CPU and the local GPU spec keep megatron's
    unfused defaults, the paths the CPU tests and the H100 run checked. They are passed to
    TransformerConfig's constructor (transformer_config), so its __post_init__ checks them: set
    afterwards, as before issue 39, a flag its machine could not run skipped those checks.

    - apply_rope_fusion: TE's fused RoPE kernel (one kernel for the rotation of q and k instead
      of several elementwise ops); TransformerConfig refuses it when rope_utils could not
      import it from TE.
    - gradient_accumulation_fusion: the weight-gradient GEMM accumulates straight into the
      fp32 main_grad (no bf16 gradient tensor, no separate add). megatron passes the flag to
      TE's linears too (`fuse_wgrad_accumulation=config.gradient_accumulation_fusion`,
      extensions/transformer_engine.py), so without apex's fused_weight_gradient_mlp_cuda, which
      megatron's own ColumnParallelLinear (the output layer) needs for it, no linear fuses it.
    - bias_activation_fusion (SwiGLU: bias_swiglu_impl, bias or not) and bias_dropout_fusion
      (bias_dropout_add_fused_train): megatron's jit_fuser, torch.compile, whose CUDA kernels
      need triton; fewer memory round trips per layer.
    - moe_permute_fusion (MoE): TE's fused token permute/unpermute around the experts (TE >= 2.1,
      our floor is 2.8); TransformerConfig refuses it when TE's kernels are missing.
    - moe_router_fusion (MoE): TE's fused top-k + softmax + aux-loss scores (TE >= 2.7), only
      without routing replay, which replaces the router's top-k with the recorded routes.

    Args:
        use_te: the model uses the Transformer Engine layer spec (CUDA present).
        apex_wgrad: apex's fused_weight_gradient_mlp_cuda extension imports.
        triton: triton imports.
        moe: the model has MoE layers.
        routing_replay: algorithm.routing_replay is on.

    Returns:
        Every name of FUSION_FLAGS with its value.
    """
    return {"apply_rope_fusion": use_te, "gradient_accumulation_fusion": use_te and apex_wgrad,
            "bias_activation_fusion": use_te and triton, "bias_dropout_fusion": use_te and triton,
            "moe_permute_fusion": use_te and moe, "moe_router_fusion": use_te and moe and not routing_replay}
