"""The model-family adapter: HF config -> Megatron GPTModel, and HF weights in and out of any TP/PP layout.

Used by the actor (build + load the initial checkpoint), by weight sync to the rollout
engines (step 7 of the RL loop: ``export_hf`` streams HF-named full tensors) and by the
checkpoint converter. Families (Qwen2, Llama, Qwen3, Qwen3-MoE) differ in how config.json
is read; QK-norm and experts are switched on by the parsed config (moe.py); the tensor
layout logic lives in mapping.py.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_dapo.lora import export_params, is_lora_param
from megatron_dapo.models import mapping
from megatron_dapo.models.config import HFModelConfig
from megatron_dapo.models.export import RECEIVERS, Receivers, export_to_all, export_to_controller
from megatron_dapo.models.hf_checkpoint import HFCheckpoint
from megatron_dapo.models.moe import ensure_router_fallback, mark_expert_parameters, moe_config_kwargs
from megatron_dapo.models.sdpa_attention import SdpaDotProductAttention
from megatron_dapo.models.shared_prompts import enable_token_positions
from megatron_dapo.models.transformer_impl import kernel_fusions, te_available
from megatron_dapo.parallel import ParallelDims
from megatron_dapo.plan import stages

RECOMPUTE_MODES = ("none", "full", "selective")


class ModelAdapter(Protocol):
    """What the actor, weight sync and converter need from a model family."""

    hf: HFModelConfig

    def transformer_config(
        self,
        *,
        dtype: torch.dtype,
        tp: int,
        pp: int,
        recompute: str = "none",
        sequence_parallel: bool = False,
        cp: int = 1,
        cp_comm_type: str = "p2p",
        ep: int = 1,
        etp: int | None = None,
        fusions: dict[str, bool] | None = None,
    ) -> TransformerConfig: ...

    def layer_spec(self, use_te: bool) -> ModuleSpec: ...

    def padded_vocab_size(self, tp: int) -> int: ...

    def build_model(
        self,
        dims: ParallelDims,
        *,
        dtype: torch.dtype,
        recompute: str = "none",
        use_te: bool | None = None,
        init_weights: bool = True,
        sequence_parallel: bool = False,
        cp_comm_type: str = "p2p",
        routing_replay: bool = False,
    ) -> GPTModel: ...

    def load_hf(self, model: Any, checkpoint: HFCheckpoint | str | Path, dims: ParallelDims) -> None: ...

    def export_hf(self, model: Any, dims: ParallelDims, *, receivers: Receivers = "all"
                  ) -> Iterator[tuple[str, torch.Tensor]]: ...


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm for the local (non-TE) spec under sequence parallelism.

    megatron-core 0.16.1's local spec without Apex builds norms with WrappedTorchNorm,
    which refuses sequence_parallel. The norm itself needs nothing: it is per token, so a
    sequence shard normalises the same. Only its weight's gradient is then a partial sum
    over this rank's tokens; marking the weight `sequence_parallel` has megatron's
    finalize_model_grads all-reduce it over the TP group, as it does for TE's and Apex's norms.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm needs normalization=RMSNorm, got {config.normalization}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class HeadRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm over one attention head's channels: Qwen3's q_norm / k_norm on the local spec.

    megatron-core 0.16.1's local spec builds QK norms with WrappedTorchNorm, which refuses
    sequence parallelism although a per-head norm does not care how tokens are split. The
    weight's gradient is a partial sum over this TP rank's heads; finalize_model_grads
    all-reduces it over TP (it does so for every parameter named q_layernorm / k_layernorm
    when config.qk_layernorm is set).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps)


def _local_block_spec(layer_specs: list[ModuleSpec], config: TransformerConfig) -> ModuleSpec:
    """Local layer specs (one per layer of the stage) as a block spec whose norms (input, pre-MLP, final) allow SP."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    copies: dict[int, ModuleSpec] = {}
    for spec in layer_specs:
        if id(spec) in copies:
            continue
        layer = copies[id(spec)] = copy.deepcopy(spec)
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(layer.submodules, name) is not IdentityOp:
                setattr(layer.submodules, name, SequenceParallelRMSNorm)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[copies[id(spec)] for spec in layer_specs], layer_norm=SequenceParallelRMSNorm))


def unwrap_model(model: Any) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers or a one-chunk list.

    Args:
        model: GPTModel, a wrapper with ``.module``, or ``[chunk]``.

    Returns:
        The GPTModel.
    """
    if isinstance(model, list | tuple):
        if len(model) != 1:
            raise ValueError(
                f"got {len(model)} model chunks; virtual pipeline stages are not supported by the adapter, use one chunk"
            )
        model = model[0]
    while not isinstance(model, GPTModel):
        if not hasattr(model, "module"):
            raise TypeError(f"expected a GPTModel or a wrapper of one, got {type(model).__name__}")
        model = model.module
    return model


def _mark_tensor_parallel_weights(gpt: GPTModel) -> None:
    """Give every TP-sharded weight megatron's tensor-parallel attributes, initialised or not.

    megatron-core 0.16 sets ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` on the weights of its local-spec parallel layers only inside the
    weight initialisers, which ``perform_initialization=False`` skips (biases are marked
    either way). Unmarked, a shard counts as a TP duplicate, so the optimizer's grad norm
    (and hence the clip) sees it on TP rank 0 only. Weights that already carry the marks
    (initialised ones, Transformer Engine layers, which mark their own) are left alone.

    Args:
        gpt: a freshly built GPTModel of this pipeline stage.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.mlp import MLP

    # megatron builds a gated MLP's linear_fc1 with stride 2 ([gate; up] per TP shard)
    # but keeps the stride only on the weight it marks; mirror MLP.__init__'s rule.
    strides = {
        id(module.linear_fc1): 2
        for module in gpt.modules()
        if isinstance(module, MLP) and module.config.gated_linear_unit and not module.config.use_kitchen
    }
    for module in gpt.modules():
        if isinstance(module, VocabParallelEmbedding | ColumnParallelLinear):
            partition_dim = 0
        elif isinstance(module, RowParallelLinear):
            partition_dim = 1
        else:
            continue
        weight = module.weight  # None for an output layer that reuses the embedding
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, True, partition_dim, strides.get(id(module), 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderAdapter:
    """Adapter for Llama-style decoders (RMSNorm, SwiGLU, rope, GQA); subclassed per family."""

    hf: HFModelConfig
    """Parsed config.json."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocab to a multiple of this times tp."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of megatron's switch load-balancing loss on every MoE layer (0 = off); MoE models only."""

    architectures: ClassVar[tuple[str, ...]] = ()

    def transformer_config(
        self,
        *,
        dtype: torch.dtype,
        tp: int,
        pp: int,
        recompute: str = "none",
        sequence_parallel: bool = False,
        cp: int = 1,
        cp_comm_type: str = "p2p",
        ep: int = 1,
        etp: int | None = None,
        fusions: dict[str, bool] | None = None,
    ) -> TransformerConfig:
        """Megatron TransformerConfig that reproduces the HF model.

        Args:
            dtype: parameter dtype (float32, bfloat16 or float16).
            tp: tensor-parallel size.
            pp: pipeline-parallel size.
            recompute: "none" | "full" (every layer, uniform) | "selective" (core attention).
            sequence_parallel: shard activations along the sequence in TP regions (tp > 1).
            cp: context-parallel size (TE attention only).
            cp_comm_type: how CP attention exchanges K/V: "p2p" (ring), "all_gather", "a2a"
                or "a2a+p2p" (TE's names).
            ep: expert-parallel size (MoE models).
            etp: expert tensor-parallel size; None = tp (megatron's default).
            fusions: kernel fusion flags (kernel_fusions); None = none, megatron's defaults.

        Returns:
            The TransformerConfig.
        """
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE_MODES}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16"
            )
        hf = self.hf
        recompute_kwargs: dict[str, Any] = {}
        if recompute == "full":
            recompute_kwargs = {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
        elif recompute == "selective":
            recompute_kwargs = {"recompute_granularity": "selective"}
        family_kwargs = moe_config_kwargs(hf, ep=ep, etp=etp, aux_loss_coeff=self.moe_aux_loss_coeff)
        if hf.qk_norm:
            family_kwargs["qk_layernorm"] = True
        return TransformerConfig(
            **(fusions or {}),  # in the constructor, so that __post_init__ checks them
            num_layers=hf.num_layers,
            **stages.megatron_split(hf.num_layers, pp),  # uneven stages where pp does not divide the layers
            hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_kv_heads,
            kv_channels=hf.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=hf.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            sequence_parallel=sequence_parallel and tp > 1,
            context_parallel_size=cp,
            cp_comm_type=cp_comm_type if cp > 1 else None,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            attention_softmax_in_fp32=True,
            **recompute_kwargs,
            **family_kwargs,
        )

    def layer_spec(self, use_te: bool, *, moe: bool = False) -> ModuleSpec:
        """Transformer Engine layer spec (fused norms, GPU) or the local megatron-core spec (CPU-capable).

        Args:
            use_te: pick the TE spec; needs transformer_engine and CUDA.
            moe: the layer's MLP is a mixture of experts (TE: grouped GEMM experts;
                local: megatron's SequentialMLP).

        Returns:
            The layer ModuleSpec.
        """
        from megatron.core.models.gpt import gpt_layer_specs

        num_experts = self.hf.num_experts if moe else None
        if use_te:
            if not te_available():
                raise ValueError(
                    "use_te=True but transformer_engine is not importable or CUDA is absent; use use_te=False"
                )
            if not (self.hf.qk_norm or moe):
                return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=moe, qk_layernorm=self.hf.qk_norm)
        if not (self.hf.qk_norm or moe):
            spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        else:
            spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=self.hf.qk_norm,
                                                            normalization="RMSNorm")
        if self.hf.qk_norm:
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
        # Fused SDPA instead of megatron's unfused local attention (models/sdpa_attention.py).
        spec.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
        return spec

    def stage_spec(self, config: TransformerConfig, use_te: bool, dims: ParallelDims) -> ModuleSpec:
        """The spec GPTModel builds this pipeline stage from: one layer spec, or a block of per-layer specs.

        A dense model is one layer spec repeated (a block spec with SP-capable norms under
        sequence parallelism on the local spec). An MoE model lists its stage's layers,
        each sparse or dense as config.json says.

        Args:
            config: the stage's TransformerConfig.
            use_te: the TE spec (else the local one).
            dims: the layout (pipeline stage and size).

        Returns:
            A layer ModuleSpec or a TransformerBlock ModuleSpec.
        """
        per_stage = stages.stage_layers(self.hf.num_layers, dims.pp)[dims.pp_rank]
        if not self.hf.is_moe:
            spec = self.layer_spec(use_te)
            if config.sequence_parallel and not use_te:
                spec = _local_block_spec([spec] * per_stage, config)
            return spec
        from megatron.core.transformer.transformer_block import (
            LayerNormImpl,
            TransformerBlock,
            TransformerBlockSubmodules,
        )

        dense, sparse = self.layer_spec(use_te), self.layer_spec(use_te, moe=True)
        first = stages.first_layer(self.hf.num_layers, dims.pp, dims.pp_rank)
        layers = [sparse if i in self.hf.moe_layers else dense for i in range(first, first + per_stage)]
        if config.sequence_parallel and not use_te:
            return _local_block_spec(layers, config)
        final_norm: Any = LayerNormImpl
        if use_te:
            from megatron.core.extensions.transformer_engine import TENorm

            final_norm = TENorm
        return ModuleSpec(module=TransformerBlock,
                          submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm))

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rows Megatron allocates: V padded to a multiple of make_vocab_size_divisible_by * tp."""
        return mapping.padded_vocab_size(self.hf.vocab_size, tp, self.make_vocab_size_divisible_by)

    def build_model(
        self,
        dims: ParallelDims,
        *,
        dtype: torch.dtype,
        recompute: str = "none",
        use_te: bool | None = None,
        init_weights: bool = True,
        sequence_parallel: bool = False,
        cp_comm_type: str = "p2p",
        routing_replay: bool = False,
    ) -> GPTModel:
        """Build this pipeline stage's GPTModel on dims.device.

        Args:
            dims: the layout from parallel.initialize_model_parallel (its cp is the model's).
            dtype: parameter dtype.
            recompute: see transformer_config.
            use_te: TE layer spec; None picks it when te_available().
            init_weights: random-initialise parameters; False skips it (weights come from load_hf).
                Either way TP-sharded weights carry megatron's tensor_model_parallel /
                partition_dim / partition_stride attributes.
            sequence_parallel: Megatron sequence parallelism (dims.tp > 1); every input's
                sequence length must then be a multiple of dims.tp.
            cp_comm_type: see transformer_config.
            routing_replay: routes are replayed (no fused router: kernel_fusions).

        Returns:
            The GPTModel of stage dims.pp_rank (embedding on the first stage, output layer on the last).
        """
        stages.stage_layers(self.hf.num_layers, dims.pp)  # a stage of no layer is refused here
        for name, value in (
            ("num_attention_heads", self.hf.num_attention_heads),
            ("num_key_value_heads", self.hf.num_kv_heads),
        ):
            if value % dims.tp != 0:
                raise ValueError(
                    f"{name}={value} is not divisible by tp={dims.tp}; pick tp among its divisors"
                )
        use_te = te_available() if use_te is None else use_te
        fusions = kernel_fusions(use_te=use_te,
                                 apex_wgrad=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
                                 triton=importlib.util.find_spec("triton") is not None,
                                 moe=self.hf.is_moe, routing_replay=routing_replay)
        config = self.transformer_config(dtype=dtype, tp=dims.tp, pp=dims.pp, recompute=recompute,
                                         sequence_parallel=sequence_parallel, cp=dims.cp, cp_comm_type=cp_comm_type,
                                         ep=dims.ep, etp=dims.etp, fusions=fusions)
        config.perform_initialization = init_weights
        if self.hf.is_moe:
            config.moe_grouped_gemm = use_te  # TEGroupedMLP on the TE spec, SequentialMLP on the local one
            ensure_router_fallback()
        spec = self.stage_spec(config, use_te, dims)
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=self.padded_vocab_size(dims.tp),
            max_sequence_length=self.hf.max_position_embeddings,
            pre_process=dims.is_first_stage,
            post_process=dims.is_last_stage,
            share_embeddings_and_output_weights=self.hf.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=self.hf.rope_theta,
        )
        _mark_tensor_parallel_weights(model)
        if self.hf.is_moe:
            mark_expert_parameters(model)
        if not use_te:  # the local spec's attention runs shared-prompt micro-batches
            enable_token_positions(model)
        # Every parameter in the model dtype, as Megatron-LM's Float16Module makes it: torch's
        # RMSNorm (the fallback without apex/TE) creates fp32 weights in a bf16 model, and the
        # distributed optimizer orders a param group's fp32 and bf16 shards differently from
        # its index map, so its state_dict paired the wrong tensors and checkpoints failed
        # (seen on the first save of a bf16 run on an H100, 2026-11-22).
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        return model.to(dims.device)

    def tensor_maps(self, model: Any, dims: ParallelDims) -> list[mapping.TensorMap]:
        """How each of this rank's parameters is made of HF tensors (export order; the converter's plan)."""
        return self._maps(unwrap_model(model), dims)

    def _maps(self, gpt: GPTModel, dims: ParallelDims | None = None) -> list[mapping.TensorMap]:
        layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(gpt.decoder.layers)}
        expert_offset = dims.ep_rank * (self.hf.num_experts // dims.ep) if dims is not None and self.hf.is_moe else 0
        # A LoRA model's adapters are no HF tensors of the base (lora/state.py exports them merged).
        named = [(n, p) for n, p in gpt.named_parameters() if not is_lora_param(n)]
        return mapping.tensor_maps(named, layer_numbers, self.hf.tie_word_embeddings,
                                   expert_offset=expert_offset)

    def load_hf(self, model: Any, checkpoint: HFCheckpoint | str | Path, dims: ParallelDims) -> None:
        """Copy HF weights into this rank's shard of the model, reading only the slices it holds.

        Call it before the optimizer is built (the distributed optimizer keeps its own
        fp32 copies of the parameters). No collectives: every rank reads on its own (an
        expert-parallel rank only its own experts).

        Args:
            model: this stage's GPTModel (or a DDP wrapper / one-chunk list).
            checkpoint: an HFCheckpoint or its directory; its tensors are checked against config.json first.
            dims: the layout the model was built for.
        """
        ckpt = checkpoint if isinstance(checkpoint, HFCheckpoint) else HFCheckpoint(checkpoint)
        mapping.check_checkpoint(self.hf, ckpt)
        gpt = unwrap_model(model)
        params = dict(gpt.named_parameters())
        padded = self.padded_vocab_size(dims.tp)
        mismatched = []
        with torch.no_grad():
            for tm in self._maps(gpt, dims):
                if tm.expert is None:
                    shard = mapping.load_shard(tm, ckpt, self.hf, dims.tp, dims.tp_rank, padded)
                else:
                    shard = mapping.load_shard(tm, ckpt, self.hf, dims.etp, dims.etp_rank, padded)
                param = params[tm.mcore_name]
                if shard.shape != param.shape:
                    mismatched.append(
                        f"{tm.mcore_name} model {tuple(param.shape)} vs checkpoint {tuple(shard.shape)}"
                    )
                    continue
                param.copy_(shard)
        if mismatched:
            raise ValueError(
                f"the model does not match HF checkpoint {ckpt.directory}: {'; '.join(mismatched[:8])}; "
                "build it with this adapter's build_model for the same config.json"
            )

    def export_hf(self, model: Any, dims: ParallelDims, *, receivers: Receivers = "all"
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the full model as HF (name, tensor) pairs, one tensor materialised at a time.

        Collective: every rank must iterate to the end. ``receivers="all"``: every rank of a
        TP x PP (x EP) replica receives every tensor (colocated engines, one per GPU), each
        data-parallel replica exporting on its own. ``receivers="controller"``: only global
        rank 0 receives, the other ranks send it their shards and yield nothing (consumers
        on the controller; models/export.py); ``receivers="stages"``: each pipeline stage's
        first rank receives its own stage's tensors (a fleet's per-stage broadcast). Order: embeddings, layers 0..L-1, final
        norm, lm_head (absent when tied). Tensors are in the parameter dtype, on
        dims.device, with padding vocab rows removed. A tensor that needed no
        communication is a view of the parameter: treat it as read-only and consume it
        before the next optimizer step.

        Mixture-of-experts layers: after the layer's other tensors, expert by expert in
        global order, each expert's gate/up/down; at most one expert's tensors exist at a
        time beyond the model (never a whole layer's experts).

        Args:
            model: this stage's GPTModel (or wrapper / one-chunk list).
            dims: the layout the model was built for.
            receivers: "all", "controller" or "stages".

        Yields:
            (HF name, full tensor), e.g. ("model.layers.0.self_attn.q_proj.weight", [nq*d, H]).
        """
        if receivers not in RECEIVERS:
            raise ValueError(f"receivers={receivers!r}; choose one of {RECEIVERS}")
        gpt = unwrap_model(model)
        params = export_params(gpt)  # a LoRA model's adapted weights merged, shard by shard
        local = [tm for tm in self._maps(gpt, dims) if not tm.mirror]
        if receivers == "all":
            return export_to_all(self.hf, local, params, dims)
        return export_to_controller(self.hf, local, params, dims, per_stage=receivers == "stages")
