"""The memory and step-time model behind `megatron-dapo plan` (report.py prints it).

Per GPU: the Megatron actor's model states under megatron-core's distributed optimizer,
the activations of one micro-batch with and without full recompute, the logits and our
chunked log-prob buffers, and the colocated SGLang engine's weights and KV cache; then
whether each phase of the step fits, and a step time from FLOPs and HBM bandwidth. Every
number keeps the formula that gave it (`Plan`, `Line`), so the report can be checked by
hand; tests/unit/test_plan.py does that for Qwen2.5-32B. First-order only: attention
FLOPs, communication and weight-sync time are ignored, MFU and bandwidth efficiency fixed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.config import Config, ConfigError

GIB = 1024**3
MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
EMBEDDED_VOCAB_SIZE = 512
"""Vocabulary of the embedded task's tokenizer (its upper bound), used for a scratch model."""


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDims:
    """The shape facts of a decoder-only Qwen2/Llama-style model that memory and FLOPs depend on."""

    name: str
    """Display name."""
    source: str
    """Where the dims came from (a config.json path, or model.scratch)."""
    hidden_size: int
    """h."""
    intermediate_size: int
    """F, the SwiGLU width (gate and up projections are both h x F)."""
    num_layers: int
    """L."""
    num_attention_heads: int
    """a, query heads."""
    num_key_value_heads: int
    """KV heads (GQA groups)."""
    head_dim: int
    """d, per-head width."""
    vocab_size: int
    """V before Megatron's padding."""
    tie_word_embeddings: bool
    """Output layer shares the embedding matrix."""
    qkv_bias: bool
    """Q/K/V projections have biases (Qwen2 does)."""

    @classmethod
    def from_hf(cls, hf: dict, name: str, source: str) -> ModelDims:
        """Read an HF config.json dict (Qwen2/Llama keys)."""
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            return cls(
                name=name,
                source=source,
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads", heads)),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                vocab_size=int(hf["vocab_size"]),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing key {e.args[0]!r}; give a complete HF config.json") from None

    @property
    def q_dim(self) -> int:
        """Width of all query heads (a * d)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads."""
        return self.num_key_value_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer layer: QKV (+bias), output proj, SwiGLU, two RMSNorms."""
        h = self.hidden_size
        qkv = h * (self.q_dim + 2 * self.kv_dim) + (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0)
        return qkv + self.q_dim * h + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self, vocab: int | None = None) -> int:
        """Input embedding plus output layer (one matrix when tied)."""
        v = self.vocab_size if vocab is None else vocab
        return v * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def num_params(self) -> int:
        """All parameters with the unpadded vocabulary (what the HF checkpoint holds)."""
        return self.num_layers * self.layer_params() + self.embedding_params() + self.hidden_size


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the model config: {e}") from None


def known_model_configs(directory: Path = MODEL_CONFIG_DIR) -> dict[str, Path]:
    """Bundled config.json files by model name (file stem), e.g. 'Qwen2.5-32B'."""
    return {p.stem: p for p in sorted(directory.glob("*.json"))}


def resolve_model(cfg: Config, model_config: str | None = None, vocab_size: int = EMBEDDED_VOCAB_SIZE,
                  directory: Path = MODEL_CONFIG_DIR) -> ModelDims:
    """Find the model's dims: --model-config, else the checkpoint's config.json, else a bundled one.

    Args:
        cfg: the experiment.
        model_config: a bundled name (examples/model_configs/<name>.json) or a config.json path.
        vocab_size: vocabulary of a scratch model (model.hf_checkpoint null).
        directory: where bundled configs live.

    Returns:
        The dims, with `source` saying which file was used.

    Raises:
        ConfigError: unknown name, unreadable file, or no way to know the model.
    """
    known = known_model_configs(directory)
    if model_config is not None:
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if path.is_file():
            return ModelDims.from_hf(_read_json(path), path.parent.name or path.stem, str(path))
        match = {k.lower(): v for k, v in known.items()}.get(model_config.lower())
        if match is None:
            raise ConfigError(f"--model-config={model_config!r}: neither a config.json nor a bundled model; "
                              f"use one of {', '.join(known)} or a path to config.json")
        return ModelDims.from_hf(_read_json(match), match.stem, str(match))
    ckpt = cfg.model.hf_checkpoint
    if ckpt is None:
        s = cfg.model.scratch
        return ModelDims(
            name="scratch", source="model.scratch", hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size, num_layers=s.num_layers,
            num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
            head_dim=s.hidden_size // s.num_attention_heads, vocab_size=vocab_size,
            tie_word_embeddings=s.tie_word_embeddings, qkv_bias=True,
        )
    own = Path(ckpt) / "config.json"
    if own.is_file():
        return ModelDims.from_hf(_read_json(own), Path(ckpt).name, str(own))
    base = Path(ckpt.rstrip("/")).name.lower()
    # Longest name first: "qwen2.5-32b-instruct" must pick Qwen2.5-32B, never a shorter prefix.
    for name in sorted(known, key=len, reverse=True):
        if name.lower() in base:
            return ModelDims.from_hf(_read_json(known[name]), name, f"{known[name]} (matched from {ckpt})")
    raise ConfigError(f"model.hf_checkpoint={ckpt!r}: no config.json there and the name matches no bundled "
                      f"model ({', '.join(known)}); pass --model-config NAME or a config.json path")


# -------------------------------------------------------------------------- hardware


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One GPU kind: memory, dense bf16 peak and HBM bandwidth (vendor datasheet numbers)."""

    name: str
    mem_gib: float
    peak_tflops: float
    hbm_gbps: float


GPUS = {
    "h100": Hardware(name="H100 SXM 80GB", mem_gib=80, peak_tflops=989, hbm_gbps=3350),
    "h200": Hardware(name="H200 SXM 141GB", mem_gib=141, peak_tflops=989, hbm_gbps=4800),
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
    padded_vocab: int
    """Vocabulary after Megatron's padding to a multiple of make_vocab_size_divisible_by x TP."""
    params_per_gpu: int
    """Parameters on the fullest pipeline stage's GPU."""
    bytes_per_param: float
    """Model-state bytes per local parameter (params + grads + optimizer share)."""
    bytes_per_param_formula: str
    model_state_bytes: float
    microbatch_tokens: int
    """Tokens of the largest micro-batch (token budget, or one longest sequence)."""
    act_bytes_per_token_layer: float
    """Activation bytes per token per layer on one GPU (no recompute)."""
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


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round V up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def params_per_gpu(dims: ModelDims, tp: int, pp: int, padded_vocab: int) -> int:
    """Parameters held by one GPU of the fullest pipeline stage.

    Layers split evenly over stages and their matrices and QKV biases over TP; the two
    RMSNorm weights of a layer are replicated on every TP rank. Stage 0 adds the embedding
    (V_pad x h / TP), the last stage the output layer (V_pad x h / TP, a copy even when
    tied and PP > 1) and the final norm. With PP = 1 one GPU holds all of that.
    """
    h = dims.hidden_size
    sharded = dims.layer_params() - 2 * h
    layers = dims.num_layers // pp * (sharded // tp + 2 * h)
    emb = padded_vocab * h // tp
    if pp == 1:
        return layers + emb * (1 if dims.tie_word_embeddings else 2) + h
    return layers + emb + h


def model_state_bytes_per_param(bf16: bool, distributed_optimizer: bool, dp: int) -> tuple[float, str]:
    """Bytes per local parameter in megatron-core's mixed-precision layout, and the formula.

    bf16: bf16 params (2) + fp32 main grads in the DDP buffer (4) + fp32 master params,
    Adam m and v (12), the 12 sharded over the data-parallel group by the distributed
    optimizer. fp32: params (4) + grads (4) + Adam m, v (8), the 8 sharded.
    """
    weights_grads, optim = (6, 12) if bf16 else (8, 8)
    if distributed_optimizer:
        return weights_grads + optim / dp, f"{weights_grads} + {optim}/DP = {weights_grads} + {optim}/{dp}"
    return float(weights_grads + optim), f"{weights_grads} + {optim} (no distributed optimizer)"


def activation_bytes_per_token_layer(dims: ModelDims, tp: int, sequence_parallel: bool) -> float:
    """Stored activations per token of one layer (bf16, flash attention), Megatron-LM style.

    Korthikanti et al. 2022 (Megatron-LM), per layer and token: 10h replicated on TP ranks
    unless sequence parallel (two norm inputs 4h, the two linear inputs after the norms 4h,
    two dropout masks 2h) plus 24h/t sharded. Flash attention stores no a*s^2 scores. For
    GQA and SwiGLU the sharded part is 4*q_dim (Q, attention output) + 4*kv_dim (K, V)
    + 6F (gate|up output 4F, SwiGLU output 2F), which is 24h for MHA with a 4h GELU MLP.
    """
    replicated = 10 * dims.hidden_size
    sharded = 4 * dims.q_dim + 4 * dims.kv_dim + 6 * dims.intermediate_size
    return (replicated / tp if sequence_parallel else replicated) + sharded / tp


def kv_bytes_per_token(dims: ModelDims, rollout_tp: int) -> int:
    """KV bytes per token on one GPU of an engine: 2 (K,V) x L x kv_heads/TP x d x 2 bytes.

    KV heads are replicated when the engine's TP exceeds them (at least one head per GPU).
    """
    heads_per_gpu = max(1, dims.num_key_value_heads // rollout_tp)
    return 2 * dims.num_layers * heads_per_gpu * dims.head_dim * 2


def make_plan(cfg: Config, dims: ModelDims, *, nodes: int, gpus_per_node: int, hardware: Hardware,
              assumptions: Assumptions | None = None) -> Plan:
    """Compute the memory and time plan of `cfg` on nodes x gpus_per_node GPUs.

    Raises:
        ConfigError: a layout that does not divide the world size or the model.
    """
    a = assumptions or Assumptions()
    world = nodes * gpus_per_node
    dp = cfg.check_world_size(world, f"--nodes {nodes} x --gpus-per-node {gpus_per_node}")
    cfg.check_model_shape(dims.num_attention_heads, dims.num_key_value_heads, dims.num_layers, dims.source)
    p, r, d, t = cfg.parallel, cfg.rollout, cfg.data, cfg.trainer
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    rtp = r.tensor_model_parallel_size
    if gpus_per_node % rtp != 0 or dims.num_attention_heads % rtp != 0:
        raise ConfigError(f"rollout.tensor_model_parallel_size={rtp} must divide --gpus-per-node={gpus_per_node} "
                          f"and num_attention_heads={dims.num_attention_heads} of {dims.source}")
    warnings: list[str] = []
    if gpus_per_node % tp != 0:
        warnings.append(f"TP={tp} does not divide {gpus_per_node} GPUs per node: TP groups span nodes "
                        "(slow all-reduces over the network)")
    gpu_bytes = hardware.mem_gib * GIB
    # dtype auto is bf16 on GPU and fp32 on CPU (config/training.py); the planner follows the device.
    bf16 = cfg.model.dtype == "bf16" or (cfg.model.dtype == "auto" and cfg.trainer.device != "cpu")

    # Actor model states.
    vpad = padded_vocab_size(dims.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    local_params = params_per_gpu(dims, tp, pp, vpad)
    bpp, bpp_formula = model_state_bytes_per_param(bf16, p.use_distributed_optimizer, dp * cp)
    states = local_params * bpp

    # Activations of one micro-batch on the first stage (1F1B keeps PP micro-batches of
    # L/PP layers in flight there: L layers' worth in total).
    max_seq = d.max_prompt_length + d.max_response_length
    mb_tokens = max(t.max_tokens_per_microbatch, max_seq)
    if t.max_tokens_per_microbatch < max_seq:
        warnings.append(f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} < the longest sequence "
                        f"({max_seq}); a micro-batch then holds one {max_seq}-token sequence")
    tokens_per_gpu = mb_tokens / cp
    per_tok_layer = activation_bytes_per_token_layer(dims, tp, p.sequence_parallel)
    act_full = per_tok_layer * tokens_per_gpu * dims.num_layers
    layer_input = 2 * dims.hidden_size / (tp if p.sequence_parallel else 1)
    act_recompute = layer_input * tokens_per_gpu * dims.num_layers + per_tok_layer * tokens_per_gpu
    logits = 2 * tokens_per_gpu * vpad / tp * 4
    chunk = 3 * min(t.logprob_chunk_size, tokens_per_gpu) * vpad / tp * 4
    activations = act_recompute if cfg.model.recompute_activations else act_full
    overhead = a.overhead_gib * GIB

    # Colocated rollout engine. While the actor trains, the engine has released its memory;
    # while it generates, the actor's model states stay resident (no CPU offload).
    engine_weights = dims.num_params() * 2 / rtp
    kv_per_tok = kv_bytes_per_token(dims, rtp)
    engine_static = r.gpu_memory_utilization * gpu_bytes
    kv_tokens = max(0, int((engine_static - engine_weights) // kv_per_tok))
    train_phase = states + activations + logits + chunk + overhead
    rollout_phase = states + engine_static + overhead
    if kv_tokens < max_seq:
        warnings.append(f"the KV cache holds {kv_tokens} tokens per engine, less than one {max_seq}-token "
                        "sequence: raise rollout.gpu_memory_utilization or rollout.tensor_model_parallel_size")

    plan = Plan(
        model=dims, hardware=hardware, assumptions=a, world_size=world, nodes=nodes,
        gpus_per_node=gpus_per_node, tp=tp, pp=pp, cp=cp, dp=dp, rollout_tp=rtp,
        num_params=dims.num_params(), padded_vocab=vpad, params_per_gpu=local_params,
        bytes_per_param=bpp, bytes_per_param_formula=bpp_formula, model_state_bytes=states,
        microbatch_tokens=mb_tokens, act_bytes_per_token_layer=per_tok_layer, activation_bytes=act_full,
        activation_recompute_bytes=act_recompute, logits_bytes=logits, logprob_chunk_bytes=chunk,
        recompute=cfg.model.recompute_activations, rollout_weight_bytes=engine_weights,
        kv_bytes_per_token=kv_per_tok, kv_tokens=kv_tokens, max_sequence_tokens=max_seq,
        train_phase_bytes=train_phase, rollout_phase_bytes=rollout_phase, gpu_bytes=gpu_bytes,
        warnings=warnings,
    )
    plan.timing = _timing(cfg, plan)
    return plan


def _timing(cfg: Config, plan: Plan) -> list[Line]:
    """Step time: generation (decode roofline), old log-probs and training (FLOPs / MFU)."""
    a, hw, d, r, t = plan.assumptions, plan.hardware, cfg.data, cfg.rollout, cfg.trainer
    n_params = plan.num_params
    prompt = a.avg_prompt_tokens or max(1, d.max_prompt_length // 8)
    response = a.avg_response_tokens or max(1, d.max_response_length // 4)
    flops_per_s = plan.world_size * hw.peak_tflops * 1e12 * a.mfu
    lines: list[Line] = []

    # Generation: every engine decodes its share of the responses with continuous
    # batching, as many at once as the KV cache holds; a decode step reads the engine's
    # weights and the batch's KV cache from HBM, or is compute bound, whichever is slower.
    engines = plan.world_size // plan.rollout_tp
    responses = d.gen_batch_size * r.n * a.gen_rounds
    per_engine = math.ceil(responses / engines)
    seq = prompt + response
    concurrent = max(1, min(per_engine, plan.kv_tokens // seq))
    waves = math.ceil(per_engine / concurrent)
    # The longest response bounds the round: at least max_response_length decode steps.
    decode_steps = max(waves * response, d.max_response_length)
    kv_read = concurrent * (prompt + response / 2) * plan.kv_bytes_per_token
    mem_s = (plan.rollout_weight_bytes + kv_read) / (hw.hbm_gbps * 1e9 * a.hbm_efficiency)
    compute_s = 2 * n_params * concurrent / (plan.rollout_tp * hw.peak_tflops * 1e12 * a.mfu)
    step_s = max(mem_s, compute_s)
    prefill_s = 2 * n_params * responses * prompt / flops_per_s
    gen_s = decode_steps * step_s + prefill_s
    lines.append(Line(label="generation", value=gen_s, unit="s",
                      formula=f"{engines} engines x {per_engine} responses; {concurrent} concurrent (KV) -> "
                              f"{decode_steps} decode steps x {step_s * 1e3:.1f} ms "
                              f"({'HBM' if mem_s >= compute_s else 'compute'} bound) + prefill {prefill_s:.0f} s"))

    train_tokens = d.train_batch_size * r.n * seq
    # The same decision the trainer takes: the first mini-batch reuses its own forward.
    fwd_passes = cfg.old_log_prob_pass_fraction + (1 if cfg.algorithm.use_kl_loss else 0)
    logprob_s = fwd_passes * 2 * n_params * train_tokens / flops_per_s
    lines.append(Line(label="old/ref log-probs", value=logprob_s, unit="s",
                      formula=f"{fwd_passes:g} x 2 x N x {train_tokens:,} tokens / (GPUs x peak x MFU)"))

    mb_per_rank = max(1, math.ceil(t.ppo_mini_batch_size * r.n * seq / plan.dp / plan.microbatch_tokens))
    bubble = (plan.pp - 1) / (mb_per_rank + plan.pp - 1)
    factor = 8 if plan.recompute else 6
    train_s = factor * n_params * train_tokens * t.ppo_epochs / flops_per_s / (1 - bubble)
    lines.append(Line(label="training", value=train_s, unit="s",
                      formula=f"{factor} x N x {train_tokens:,} tokens x {t.ppo_epochs} epoch(s) / (GPUs x peak x MFU)"
                              f" / (1 - bubble {bubble:.1%}: PP {plan.pp}, {mb_per_rank} micro-batches/update)"))
    lines.append(Line(label="step (sum)", value=gen_s + logprob_s + train_s, unit="s",
                      formula="without weight sync, rewards and communication"))
    return lines
