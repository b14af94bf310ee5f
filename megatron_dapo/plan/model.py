"""The memory and step-time model behind `megatron-dapo plan` (report.py prints it).

Per GPU: the Megatron actor's model states under megatron-core's distributed optimizer,
the activations of one micro-batch with and without full recompute, the logits and our
chunked log-prob buffers, and the colocated SGLang engine's weights and KV cache; then
whether each phase of the step fits, and a step time from FLOPs and HBM bandwidth. Every
number keeps the formula that gave it (`Plan`, `Line`), so the report can be checked by
hand; tests/unit/test_plan.py does that for Qwen2.5-32B, tests/unit/test_plan_moe.py for
Qwen3-30B-A3B. First-order only: attention FLOPs, communication (the MoE alltoall too)
and weight-sync time are ignored, MFU and bandwidth efficiency fixed, routing balanced.

Mixture-of-experts models, as megatron-core lays them out: routed experts are split over
EP x ETP ranks of a pipeline stage and their gradients reduced and optimizer states
sharded over the expert data-parallel group, world / (EP x ETP x PP); everything else
(attention, norms, router, embeddings, dense layers) is sharded over TP/PP with its
optimizer states over DP x CP, as for a dense model. A token is dispatched to k experts,
so the expert activations and the alltoall buffers scale with k; FLOPs use the active
parameters (attention, router, top-k experts, embeddings), not the total. The colocated
SGLang engine holds all experts, sharded over its TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_dapo.config import Config, ConfigError, ParallelConfig
from megatron_dapo.plan.dims import ModelDims, teacher_dims
from megatron_dapo.plan.lora import base_bytes_per_param, lora_params_per_gpu, lora_sync_bytes
from megatron_dapo.plan.stages import stage_layers

GIB = 1024**3


# -------------------------------------------------------------------------- hardware


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One GPU kind: memory, dense bf16 peak and HBM bandwidth (vendor datasheet numbers)."""

    name: str
    mem_gib: float
    peak_tflops: float
    hbm_gbps: float
    usable_gib: float | None = None
    """What one process can have of mem_gib (the driver keeps the rest): the total a CUDA process
    sees, which is what SGLang's and the actor's budgets divide. None: mem_gib x USABLE_FRACTION."""

    @property
    def usable(self) -> float:
        """Usable GiB (usable_gib, else mem_gib x USABLE_FRACTION)."""
        return self.usable_gib if self.usable_gib is not None else self.mem_gib * USABLE_FRACTION


USABLE_FRACTION = 79.6 / 80
"""An H100 80GB's usable share (~79.6 GiB of 80, as its driver reports it): the default for a GPU
whose usable memory is not given (A100, H20, --gpu-mem-gib). Not measured here (no GPU lent since
2026-11-22); --gpu-usable-gib sets the real figure."""

GPUS = {
    "h100": Hardware(name="H100 SXM 80GB", mem_gib=80, peak_tflops=989, hbm_gbps=3350, usable_gib=79.6),
    # The lent H200's description: "about 139 GiB of GPU memory".
    "h200": Hardware(name="H200 SXM 141GB", mem_gib=141, peak_tflops=989, hbm_gbps=4800, usable_gib=139.0),
    "h20": Hardware(name="H20 96GB", mem_gib=96, peak_tflops=148, hbm_gbps=4000),
    "a100": Hardware(name="A100 SXM 80GB", mem_gib=80, peak_tflops=312, hbm_gbps=2039),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Assumptions:
    """What the estimate cannot know from the config; all are flags of tools/plan.py."""

    mfu: float = 0.35
    """Achieved fraction of peak FLOP/s in training, log-prob and decode compute."""
    hbm_efficiency: float = 0.7
    """Achieved fraction of HBM bandwidth during decode."""
    avg_prompt_tokens: int | None = None
    """Mean prompt length; None = data.max_prompt_length / 8."""
    avg_response_tokens: int | None = None
    """Mean response length; None = data.max_response_length / 4."""
    gen_rounds: float = 1.0
    """Generation rounds of gen_batch_size prompts per step (dynamic sampling may need more)."""
    overhead_gib: float = 4.0
    """Per-GPU memory outside the tensors counted here: CUDA contexts, NCCL buffers, fragmentation."""


# ------------------------------------------------------------------------------ plan


@dataclass(kw_only=True, slots=True)
class Line:
    """One row of the report: a quantity, its value and the formula that gave it."""

    label: str
    value: float
    unit: str
    formula: str = ""


@dataclass(kw_only=True, slots=True)
class Plan:
    """The numbers behind the report; tests read these, users read `format_plan`."""

    model: ModelDims
    hardware: Hardware
    assumptions: Assumptions
    world_size: int
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    cp: int
    dp: int
    rollout_tp: int
    num_params: int
    """Whole model, unpadded vocabulary."""
    num_active_params: int
    """Parameters one token passes through (num_params for a dense model); FLOPs use these."""
    padded_vocab: int
    """Vocabulary after Megatron's padding to a multiple of make_vocab_size_divisible_by x TP."""
    params_per_gpu: int
    """Non-expert parameters on the fullest pipeline stage's GPU (all of them for a dense model)."""
    bytes_per_param: float
    """Model-state bytes per local parameter (params + grads + optimizer share)."""
    bytes_per_param_formula: str
    model_state_bytes: float
    """Dense and expert model states of one GPU of the fullest stage."""
    microbatch_tokens: int
    """Tokens of the largest micro-batch (token budget, or one longest sequence)."""
    act_bytes_per_token_layer: float
    """Activation bytes per token of one dense layer on one GPU (no recompute)."""
    activation_bytes: float
    """Without recompute."""
    activation_recompute_bytes: float
    """With full uniform recompute."""
    logits_bytes: float
    """fp32 logits plus their gradient, [tokens, V/tp] each."""
    logprob_chunk_bytes: float
    """Chunked log-prob buffers: 3 x chunk x V/tp fp32."""
    recompute: bool
    """Whether the config turns on recompute (model.recompute_activations)."""
    rollout_weight_bytes: float
    kv_bytes_per_token: float
    """KV-cache bytes per token on one GPU of an engine."""
    kv_tokens: int
    """KV-cache capacity per engine in tokens (0 if the weights leave no room)."""
    max_sequence_tokens: int
    train_phase_bytes: float
    rollout_phase_bytes: float
    gpu_bytes: float
    ep: int = 1
    """Expert-parallel size (1 for a dense model)."""
    etp: int = 1
    """Expert tensor-parallel size."""
    edp: int = 1
    """Expert data-parallel size, world / (EP x ETP x PP): the group expert grads and optimizer states use."""
    expert_params_per_gpu: int = 0
    """Routed-expert parameters on one GPU of the fullest stage."""
    expert_bytes_per_param: float = 0.0
    expert_bytes_per_param_formula: str = ""
    moe_act_bytes_per_token_layer: float = 0.0
    """Activation bytes per token of one MoE layer on one GPU (no recompute)."""
    dispatch_bytes: float = 0.0
    """One MoE layer's alltoall send and receive buffers (transient, on top of the activations)."""
    teacher: ModelDims | None = None
    """The distillation teacher's dims (algorithm.distill.teacher), None without one."""
    lora_rank: int = 0
    """model.lora.rank (0 = full-parameter training)."""
    lora_params_per_gpu: int = 0
    """Adapter parameters on one GPU of the fullest stage (plan/lora.py); the base is then frozen."""
    lora_sync_bytes: int = 0
    """The whole model's adapters in bf16: what an adapter-only sync sends each engine."""
    lora_base_bytes_per_param: int = 0
    """A frozen base weight's bytes (its dtype's) with LoRA on."""
    timing: list[Line] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def train_fits(self) -> bool:
        return self.train_phase_bytes <= self.gpu_bytes

    @property
    def rollout_fits(self) -> bool:
        return self.kv_tokens >= self.max_sequence_tokens and self.rollout_phase_bytes <= self.gpu_bytes

    @property
    def fits(self) -> bool:
        return self.train_fits and self.rollout_fits

    @property
    def step_seconds(self) -> float:
        """The step-time estimate (the timing's sum)."""
        return self.timing[-1].value if self.timing else math.inf


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round V up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


@dataclass(frozen=True, slots=True)
class StageParams:
    """Parameters one GPU of a pipeline stage holds, by how their optimizer states are sharded."""

    dense: int
    """Everything but the routed experts (optimizer states over DP x CP)."""
    experts: int
    """Routed experts (optimizer states over the expert data-parallel group)."""


def stage_params(dims: ModelDims, tp: int, pp: int, padded_vocab: int, ep: int = 1,
                 etp: int | None = None) -> list[StageParams]:
    """Parameters held by one GPU of each pipeline stage.

    Layers split over stages as models/stages.py splits them (evenly where PP divides them). A layer's attention and MLP matrices (and QKV biases,
    a shared expert) split over TP; its norms, QK-norms and router are replicated on every
    TP rank; a sparse layer's E routed experts split E/EP per rank, each over ETP. Stage 0
    adds the embedding (V_pad x h / TP), the last stage the output layer (V_pad x h / TP,
    a copy even when tied and PP > 1) and the final norm. With PP = 1 one GPU holds all of that.
    """
    etp = tp if etp is None else etp
    h, layers = dims.hidden_size, stage_layers(dims.num_layers, pp)
    sparse_layers = set(dims.moe_layers) if dims.is_moe else set()
    emb = padded_vocab * h // tp
    out = []
    for stage in range(pp):
        per_stage, first = layers[stage], sum(layers[:stage])
        sparse = sum(1 for i in range(first, first + per_stage) if i in sparse_layers)
        dense = (per_stage - sparse) * ((dims.attention_params() + dims.mlp_params(False)) // tp
                                        + dims.replicated_params(False))
        dense += sparse * ((dims.attention_params() + dims.mlp_params(True)) // tp + dims.replicated_params(True))
        if pp == 1:
            dense += emb * (1 if dims.tie_word_embeddings else 2) + h
        elif stage == 0:
            dense += emb
        elif stage == pp - 1:
            dense += emb + h
        experts = sparse * (dims.num_experts // ep) * (dims.expert_params() // etp)
        out.append(StageParams(dense=dense, experts=experts))
    return out


def params_per_gpu(dims: ModelDims, tp: int, pp: int, padded_vocab: int) -> int:
    """Non-expert parameters held by one GPU of the fullest pipeline stage (see stage_params)."""
    return max(s.dense for s in stage_params(dims, tp, pp, padded_vocab))


def model_state_bytes_per_param(bf16: bool, distributed_optimizer: bool, dp: int,
                                group: str = "DP") -> tuple[float, str]:
    """Bytes per local parameter in megatron-core's mixed-precision layout, and the formula.

    bf16: bf16 params (2) + fp32 main grads in the DDP buffer (4) + fp32 master params,
    Adam m and v (12), the 12 sharded over the data-parallel group by the distributed
    optimizer. fp32: params (4) + grads (4) + Adam m, v (8), the 8 sharded. `group` names
    that group in the formula: DP, or EDP for routed experts (the expert data-parallel group).
    """
    weights_grads, optim = (6, 12) if bf16 else (8, 8)
    if distributed_optimizer:
        return weights_grads + optim / dp, f"{weights_grads} + {optim}/{group} = {weights_grads} + {optim}/{dp}"
    return float(weights_grads + optim), f"{weights_grads} + {optim} (no distributed optimizer)"


def activation_bytes_per_token_layer(dims: ModelDims, tp: int, sequence_parallel: bool, sparse: bool = False,
                                     etp: int | None = None) -> float:
    """Stored activations per token of one layer (bf16, flash attention), Megatron-LM style.

    Korthikanti et al. 2022 (Megatron-LM), per layer and token: 10h replicated on TP ranks
    unless sequence parallel (two norm inputs 4h, the two linear inputs after the norms 4h,
    two dropout masks 2h) plus 24h/t sharded. Flash attention stores no a*s^2 scores. For
    GQA and SwiGLU the sharded part is 4*q_dim (Q, attention output) + 4*kv_dim (K, V)
    + 6F (gate|up output 4F, SwiGLU output 2F), which is 24h for MHA with a 4h GELU MLP;
    QK-norm adds its inputs, 2*(q_dim + kv_dim).

    A sparse layer replaces the 6F by the router's 7E (bf16 logits 2E, fp32 probabilities
    4E, the routing map E) and, per routed copy of the token (k of them, balanced routing),
    the dispatched input 2h (gathered over ETP: x ETP), the expert's 6F_moe/ETP and the
    expert output kept for the probability-weighted combine 2h; the copies of a TP group's
    tokens spread over its ranks: k * (2h * (ETP + 1) + 6F_moe) / TP. A shared expert adds 6F_s.
    """
    etp = tp if etp is None else etp
    replicated = 10 * dims.hidden_size
    sharded = 4 * dims.q_dim + 4 * dims.kv_dim + (2 * (dims.q_dim + dims.kv_dim) if dims.qk_norm else 0)
    if sparse:
        k = dims.num_experts_per_tok
        sharded += (7 * dims.num_experts + 6 * dims.shared_expert_intermediate_size
                    + k * (2 * dims.hidden_size * (etp + 1) + 6 * dims.moe_intermediate_size))
    else:
        sharded += 6 * dims.intermediate_size
    return (replicated / tp if sequence_parallel else replicated) + sharded / tp


def kv_bytes_per_token(dims: ModelDims, rollout_tp: int) -> int:
    """KV bytes per token on one GPU of an engine: 2 (K,V) x L x kv_heads/TP x d x 2 bytes.

    KV heads are replicated when the engine's TP exceeds them (at least one head per GPU).
    """
    heads_per_gpu = max(1, dims.num_key_value_heads // rollout_tp)
    return 2 * dims.num_layers * heads_per_gpu * dims.head_dim * 2


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def check_expert_layout(p: ParallelConfig, dims: ModelDims, world: int, source: str) -> tuple[int, int, int]:
    """Reject an expert layout megatron-core or the actor cannot build, in one line.

    The rules of parallel.validate_layout, megatron-core's initialize_model_parallel and
    the actor (tests/unit/test_plan_moe.py holds them equal to validate_layout's).

    Returns:
        (EP, ETP, expert data-parallel size).

    Raises:
        ConfigError: naming the setting, the model or world size it does not fit, and the fix.
    """
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep = p.expert_model_parallel_size
    etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
    if not dims.is_moe and ep > 1:
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model, but "
                          f"{dims.source} is dense; set it to 1")
    if dims.is_moe and dims.num_experts % ep != 0:
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} does not divide num_experts={dims.num_experts} "
                          f"of {dims.source}; use one of {_divisors(dims.num_experts)}")
    if world % (ep * etp * pp) != 0:
        raise ConfigError(f"parallel: EP x ETP x PP = {ep}x{etp}x{pp} = {ep * etp * pp} does not divide the world "
                          f"size {world} ({source}); expert groups hold EP x ETP ranks of one pipeline stage: "
                          "change expert_model_parallel_size or expert_tensor_parallel_size")
    if not dims.is_moe:
        return 1, etp, world // (etp * pp)
    if dims.moe_intermediate_size % etp != 0:
        raise ConfigError(f"parallel.expert_tensor_parallel_size={etp} does not divide moe_intermediate_size="
                          f"{dims.moe_intermediate_size} of {dims.source}; use one of "
                          f"{_divisors(dims.moe_intermediate_size)[:12]}")
    if tp > 1 and not p.sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel=false: a mixture-of-experts model at "
                          f"tensor_model_parallel_size={tp} trains only with sequence parallelism "
                          "(megatron-core's MoE layer); set parallel.sequence_parallel=true")
    return ep, etp, world // (ep * etp * pp)


def make_plan(cfg: Config, dims: ModelDims, *, nodes: int, gpus_per_node: int, hardware: Hardware,
              assumptions: Assumptions | None = None) -> Plan:
    """Compute the memory and time plan of `cfg` on nodes x gpus_per_node GPUs.

    Raises:
        ConfigError: a layout that does not divide the world size or the model.
    """
    a = assumptions or Assumptions()
    world = nodes * gpus_per_node
    where = f"--nodes {nodes} x --gpus-per-node {gpus_per_node}"
    dp = cfg.check_world_size(world, where)
    cfg.check_model_shape(dims.num_attention_heads, dims.num_key_value_heads, dims.num_layers, dims.source)
    p, r, d, t = cfg.parallel, cfg.rollout, cfg.data, cfg.trainer
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep, etp, edp = check_expert_layout(p, dims, world, where)
    rtp = r.tensor_model_parallel_size
    if gpus_per_node % rtp != 0 or dims.num_attention_heads % rtp != 0:
        raise ConfigError(f"rollout.tensor_model_parallel_size={rtp} must divide --gpus-per-node={gpus_per_node} "
                          f"and num_attention_heads={dims.num_attention_heads} of {dims.source}")
    warnings: list[str] = []
    if gpus_per_node % tp != 0:
        warnings.append(f"TP={tp} does not divide {gpus_per_node} GPUs per node: TP groups span nodes "
                        "(slow all-reduces over the network)")
    if dims.is_moe and gpus_per_node % (ep * etp) != 0:
        warnings.append(f"EP x ETP = {ep}x{etp} does not divide {gpus_per_node} GPUs per node: the token "
                        "alltoall crosses nodes")
    gpu_bytes = hardware.usable * GIB
    # dtype auto is bf16 on GPU and fp32 on CPU (config/training.py); the planner follows the device.
    bf16 = cfg.model.dtype == "bf16" or (cfg.model.dtype == "auto" and cfg.trainer.device != "cpu")

    # Actor model states, on the stage whose GPU holds the most bytes.
    vpad = padded_vocab_size(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    bpp, bpp_formula = model_state_bytes_per_param(bf16, p.use_distributed_optimizer, dp * cp)
    ebpp, ebpp_formula = model_state_bytes_per_param(bf16, p.use_distributed_optimizer, edp, "EDP")
    fullest = max(stage_params(dims, tp, pp, vpad, ep, etp), key=lambda s: s.dense * bpp + s.experts * ebpp)
    states = fullest.dense * bpp + fullest.experts * ebpp
    lora = cfg.model.lora
    lora_params = lora_sync = 0
    if lora.enabled:  # the base frozen (its value only), the adapters with full model states (plan/lora.py)
        lora_params = lora_params_per_gpu(dims, rank=lora.rank, targets=lora.targets, tp=tp, pp=pp, ep=ep)
        lora_sync = lora_sync_bytes(dims, rank=lora.rank, targets=lora.targets)
        states = (fullest.dense + fullest.experts) * base_bytes_per_param(bf16) + lora_params * bpp

    # Activations of one micro-batch on the first stage (1F1B keeps PP micro-batches of
    # L/PP layers in flight there: L layers' worth in total).
    max_seq = d.max_prompt_length + d.max_response_length
    mb_tokens = max(t.max_tokens_per_microbatch, max_seq)
    if t.max_tokens_per_microbatch < max_seq:
        warnings.append(f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} < the longest sequence "
                        f"({max_seq}); a micro-batch then holds one {max_seq}-token sequence")
    tokens_per_gpu = mb_tokens / cp
    per_tok_layer = activation_bytes_per_token_layer(dims, tp, p.sequence_parallel)
    sparse_layers = dims.num_moe_layers
    moe_per_tok_layer = activation_bytes_per_token_layer(dims, tp, p.sequence_parallel, True, etp) if dims.is_moe \
        else 0.0
    act_full = (per_tok_layer * (dims.num_layers - sparse_layers) + moe_per_tok_layer * sparse_layers) * tokens_per_gpu
    largest_layer = max(per_tok_layer if sparse_layers < dims.num_layers else 0.0, moe_per_tok_layer)
    layer_input = 2 * dims.hidden_size / (tp if p.sequence_parallel else 1)
    act_recompute = layer_input * tokens_per_gpu * dims.num_layers + largest_layer * tokens_per_gpu
    logits = 2 * tokens_per_gpu * vpad / tp * 4
    chunk = 3 * min(t.logprob_chunk_size, tokens_per_gpu) * vpad / tp * 4
    activations = act_recompute if cfg.model.recompute_activations else act_full
    # The alltoall's send buffer (this rank's k copies of its tokens) and receive buffer
    # (gathered over ETP) of the layer in flight.
    dispatch = (dims.num_experts_per_tok * tokens_per_gpu / tp * (1 + etp) * dims.hidden_size * 2
                if dims.is_moe else 0.0)
    overhead = a.overhead_gib * GIB

    # Colocated rollout engine, all experts included. While the actor trains, the engine has
    # released its memory; while it generates, the actor's model states stay resident (no CPU offload).
    engine_weights = dims.num_params() * 2 / rtp
    kv_per_tok = kv_bytes_per_token(dims, rtp)
    engine_static = r.engine_memory_bytes(gpu_bytes, states + overhead)
    kv_tokens = max(0, int((engine_static - engine_weights) // kv_per_tok))
    train_phase = states + activations + logits + chunk + dispatch + overhead
    rollout_phase = states + engine_static + overhead
    refusal = r.engine_refuses_to_start(engine_static, engine_weights)
    if refusal is not None:
        warnings.append(f"{refusal}: "
                        f"{r.gpu_memory_utilization} x the {(gpu_bytes - states - overhead) / GIB:.1f} GiB free next to "
                        f"the actor is below its {engine_weights / GIB:.1f} GiB of weights; raise "
                        "rollout.gpu_memory_utilization or rollout.tensor_model_parallel_size")
    elif kv_tokens < max_seq:
        warnings.append(f"the KV cache holds {kv_tokens} tokens per engine, less than one {max_seq}-token "
                        "sequence: raise rollout.gpu_memory_utilization or rollout.tensor_model_parallel_size")

    teacher = teacher_dims(cfg, warnings)
    plan = Plan(
        teacher=teacher, model=dims, hardware=hardware, assumptions=a, world_size=world, nodes=nodes,
        gpus_per_node=gpus_per_node, tp=tp, pp=pp, cp=cp, dp=dp, rollout_tp=rtp,
        num_params=dims.num_params(), num_active_params=dims.num_active_params(), padded_vocab=vpad,
        params_per_gpu=fullest.dense, bytes_per_param=bpp, bytes_per_param_formula=bpp_formula,
        model_state_bytes=states, microbatch_tokens=mb_tokens, act_bytes_per_token_layer=per_tok_layer,
        activation_bytes=act_full, activation_recompute_bytes=act_recompute, logits_bytes=logits,
        logprob_chunk_bytes=chunk, recompute=cfg.model.recompute_activations, rollout_weight_bytes=engine_weights,
        kv_bytes_per_token=kv_per_tok, kv_tokens=kv_tokens, max_sequence_tokens=max_seq,
        train_phase_bytes=train_phase, rollout_phase_bytes=rollout_phase, gpu_bytes=gpu_bytes,
        ep=ep, etp=etp, edp=edp, expert_params_per_gpu=fullest.experts,
        expert_bytes_per_param=ebpp if dims.is_moe else 0.0,
        expert_bytes_per_param_formula=ebpp_formula if dims.is_moe else "",
        moe_act_bytes_per_token_layer=moe_per_tok_layer, dispatch_bytes=dispatch, warnings=warnings,
        lora_rank=lora.rank, lora_params_per_gpu=lora_params, lora_sync_bytes=lora_sync,
        lora_base_bytes_per_param=base_bytes_per_param(bf16),
    )
    plan.timing = _timing(cfg, plan)
    return plan


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens routed uniformly: E(1 - (1 - k/E)^n)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def mean_lengths(cfg: Config, a: Assumptions) -> tuple[int, int]:
    """Mean prompt and response tokens: the assumptions', else max_prompt_length / 8 and max_response_length / 4."""
    d = cfg.data
    return (a.avg_prompt_tokens or max(1, d.max_prompt_length // 8),
            a.avg_response_tokens or max(1, d.max_response_length // 4))


def in_flight(cfg: Config, a: Assumptions, engines: int, kv_tokens: int) -> tuple[float, int, int]:
    """(responses of a step, responses per engine, sequences an engine decodes at once: as many as its KV holds)."""
    prompt, response = mean_lengths(cfg, a)
    responses = cfg.data.gen_batch_size * cfg.rollout.n * a.gen_rounds
    per_engine = math.ceil(responses / engines)
    return responses, per_engine, max(1, min(per_engine, kv_tokens // (prompt + response)))


def generation_line(cfg: Config, dims: ModelDims, hw: Hardware, a: Assumptions, *, engines: int, rollout_tp: int,
                    kv_tokens: int) -> Line:
    """Generation time of one step on `engines` engines of `rollout_tp` GPUs, `kv_tokens` KV tokens each.

    Every engine decodes its share of the responses with continuous batching, as many at once
    as its KV cache holds; a decode step reads the engine's weights and the batch's KV cache
    from HBM, or is compute bound, whichever is slower. Colocated (make_plan) and on a fleet's
    own GPUs (fleet.py) alike.
    """
    d = cfg.data
    n_params = dims.num_active_params()
    prompt, response = mean_lengths(cfg, a)
    responses, per_engine, concurrent = in_flight(cfg, a, engines, kv_tokens)
    waves = math.ceil(per_engine / concurrent)
    # The longest response bounds the round: at least max_response_length decode steps.
    decode_steps = max(waves * response, d.max_response_length)
    kv_read = concurrent * (prompt + response / 2) * kv_bytes_per_token(dims, rollout_tp)
    weights_read, moe_note = dims.num_params() * 2 / rollout_tp, ""
    if dims.is_moe:
        # A decode step reads only the experts its batch's tokens were routed to.
        touched = experts_touched(dims.num_experts, dims.num_experts_per_tok, concurrent)
        unread = dims.num_moe_layers * (dims.num_experts - touched) * dims.expert_params()
        weights_read = (dims.num_params() - unread) * 2 / rollout_tp
        moe_note = f"; {touched:.1f} of {dims.num_experts} experts read per layer (E(1-(1-k/E)^batch))"
    mem_s = (weights_read + kv_read) / (hw.hbm_gbps * 1e9 * a.hbm_efficiency)
    compute_s = 2 * n_params * concurrent / (rollout_tp * hw.peak_tflops * 1e12 * a.mfu)
    step_s = max(mem_s, compute_s)
    prefill_s = 2 * n_params * responses * prompt / (engines * rollout_tp * hw.peak_tflops * 1e12 * a.mfu)
    gen_s = decode_steps * step_s + prefill_s
    return Line(label="generation", value=gen_s, unit="s",
                formula=f"{engines} engines x {per_engine} responses; {concurrent} concurrent (KV) -> "
                        f"{decode_steps} decode steps x {step_s * 1e3:.1f} ms "
                        f"({'HBM' if mem_s >= compute_s else 'compute'} bound) + prefill {prefill_s:.0f} s" + moe_note)


def _timing(cfg: Config, plan: Plan) -> list[Line]:
    """Step time: generation (decode roofline), old log-probs and training (FLOPs / MFU)."""
    a, hw, d, r, t, m = plan.assumptions, plan.hardware, cfg.data, cfg.rollout, cfg.trainer, plan.model
    n_params = plan.num_active_params
    n = "N_active" if m.is_moe else "N"
    prompt, response = mean_lengths(cfg, a)
    seq = prompt + response
    flops_per_s = plan.world_size * hw.peak_tflops * 1e12 * a.mfu
    gen = generation_line(cfg, m, hw, a, engines=plan.world_size // plan.rollout_tp, rollout_tp=plan.rollout_tp,
                          kv_tokens=plan.kv_tokens)
    gen_s, lines = gen.value, [gen]

    train_tokens = d.train_batch_size * r.n * seq
    # The same decision the trainer takes: the first mini-batch reuses its own forward.
    fwd_passes = cfg.old_log_prob_pass_fraction + (1 if cfg.algorithm.use_kl_loss else 0)
    logprob_s = fwd_passes * 2 * n_params * train_tokens / flops_per_s
    lines.append(Line(label="old/ref log-probs", value=logprob_s, unit="s",
                      formula=f"{fwd_passes:g} x 2 x {n} x {train_tokens:,} tokens / (GPUs x peak x MFU)"))
    if plan.teacher is not None:  # on-policy distillation: one forward of the frozen teacher per token
        t_params = plan.teacher.num_params()
        teacher_s = 2 * t_params * train_tokens / flops_per_s
        per_gpu = 2 * t_params / (plan.tp * plan.pp) / 2**30
        lines.append(Line(label="teacher log-probs", value=teacher_s, unit="s",
                          formula=f"2 x N_teacher {t_params:,} x {train_tokens:,} tokens / (GPUs x peak x MFU); its "
                                  f"bf16 weights {per_gpu:.3g} GiB/GPU in host memory, on the GPU only for this pass"))
        logprob_s += teacher_s

    mb_per_rank = max(1, math.ceil(t.ppo_mini_batch_size * r.n * seq / plan.dp / plan.microbatch_tokens))
    bubble = (plan.pp - 1) / (mb_per_rank + plan.pp - 1)
    factor = 8 if plan.recompute else 6
    train_s = factor * n_params * train_tokens * t.ppo_epochs / flops_per_s / (1 - bubble)
    lines.append(Line(label="training", value=train_s, unit="s",
                      formula=f"{factor} x {n} x {train_tokens:,} tokens x {t.ppo_epochs} epoch(s) / (GPUs x peak x "
                              f"MFU) / (1 - bubble {bubble:.1%}: PP {plan.pp}, {mb_per_rank} micro-batches/update)"))
    lines.append(Line(label="step (sum)", value=gen_s + logprob_s + train_s, unit="s",
                      formula="without weight sync, rewards and communication"))
    return lines
