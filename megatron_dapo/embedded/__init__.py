"""The embedded default run's ingredients: task files, tokenizer and a scratch HF checkpoint.

`megatron-dapo train examples/tiny_cpu.yaml` needs no download: the arithmetic task and
its sentencepiece tokenizer are generated (cached), and the policy starts from a
Qwen2-style HF checkpoint initialised from `model.scratch` (cached too), which the
Megatron actor then loads like any other HF checkpoint. The SFT warm start
(embedded/warm_start.py) turns it into a policy with non-trivial accuracy.

Only the controller (global rank 0) writes; the other ranks wait at a barrier and read.
Every cache entry is keyed by a hash of what determines it, the versions of the libraries
whose numerics it depends on included (environment_key), and written atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from megatron_dapo.checkpoint.files import chmod_as_created
from megatron_dapo.config import Config, EmbeddedTaskConfig, ScratchModelConfig
from megatron_dapo.data.arithmetic import (
    ArithmeticMix,
    ArithmeticTask,
    generate_problems,
    prepare_arithmetic_task,
)
from megatron_dapo.data.tokenizer import SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID, SentencePieceSettings
from megatron_dapo.errors import UserError

CACHE_ENV = "MEGATRON_DAPO_CACHE"
DEFAULT_CACHE = ".cache/megatron-dapo"


def cache_root() -> Path:
    """The cache directory ($MEGATRON_DAPO_CACHE, default .cache/megatron-dapo), checked.

    Raises:
        UserError: the path exists and is not a directory, or cannot be created/written.
    """
    root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)
    fix = f"point {CACHE_ENV} at a writable directory (or unset it for {DEFAULT_CACHE})"
    if root.exists() and not root.is_dir():
        raise UserError(f"{CACHE_ENV}={str(root)!r} is a file, not a directory; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{CACHE_ENV}={str(root)!r} cannot be created ({e.strerror or e}); {fix}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"{CACHE_ENV}={str(root)!r} is not writable; {fix}")
    return root


def check_task(embedded: EmbeddedTaskConfig) -> None:
    """Draw the task's problems without writing anything: a mix whose problem space cannot fill the
    splits fails here, in one line, instead of inside the run (tens of milliseconds)."""
    mix = _mix(embedded)
    try:
        val = generate_problems(embedded.num_val, mix, seed=f"{embedded.seed}:val", unique=True)
        held_out = frozenset(p.expression for p in val)
        generate_problems(embedded.num_train, mix, seed=f"{embedded.seed}:train", exclude=held_out)
    except ValueError as e:
        raise UserError(f"data.embedded: {e} (data.embedded.num_val / num_train, max_digits, add/sub/mul/two_step)") from None


def _mix(embedded: EmbeddedTaskConfig) -> ArithmeticMix:
    return ArithmeticMix(add=embedded.add, sub=embedded.sub, mul=embedded.mul, two_step=embedded.two_step,
                         big_mul=embedded.big_mul, max_digits=embedded.max_digits,
                         solution_style=embedded.solution_style)


def task_of(cfg: Config, cache_dir: Path) -> ArithmeticTask:
    """The run's embedded task: data.embedded, its warm start's results padded as the run's tool
    answers are (tools.result_width, when tools are on)."""
    return task_for(cfg.data.embedded, cache_dir, result_width=cfg.tools.result_width if cfg.tools.enable else 0)


def task_for(embedded: EmbeddedTaskConfig, cache_dir: Path, result_width: int = 0) -> ArithmeticTask:
    """Write (or reuse) the arithmetic task's train/val/SFT files and tokenizer (`result_width`: the
    SFT results' padding, tools.result_width; `task_of` takes it from a run's config)."""
    check_task(embedded)
    mix = _mix(embedded)
    mix_parts = asdict(mix)
    if not mix.big_mul:  # the tool task's fields enter the key only when on: older caches stay valid
        del mix_parts["big_mul"]
    parts = {"mix": mix_parts, "n": [embedded.num_train, embedded.num_val, embedded.num_sft],
             "seed": embedded.seed, "vocab": embedded.tokenizer_vocab_size, "sentencepiece": _version("sentencepiece")}
    if embedded.sft_balance_columns >= 2:
        # Only when on, so the cache keys of runs that set it to 0 stay what they were.
        parts["sft_balance_columns"] = {"candidates": embedded.sft_balance_columns, "keys": "fact-in-column"}
    if embedded.train_balance_columns >= 2:
        parts["train_balance_columns"] = {"candidates": embedded.train_balance_columns, "keys": "fact-in-column"}
    if embedded.sft_tool_share > 0:
        parts["sft_tool_share"] = embedded.sft_tool_share
    if embedded.sft_balance_product_digits:
        parts["sft_balance_product_digits"] = True
    if embedded.sft_copy_drills > 0:
        parts["sft_copy_drills"] = embedded.sft_copy_drills
        if embedded.sft_copy_drill_digits != "product":  # only when not the default: older caches stay valid
            parts["sft_copy_drill_digits"] = embedded.sft_copy_drill_digits
    if result_width > 0:  # only when on, as above
        parts["result_width"] = result_width
    return prepare_arithmetic_task(
        cache_dir / f"arithmetic-{digest(parts)}", mix, num_train=embedded.num_train, num_val=embedded.num_val,
        num_sft=embedded.num_sft, seed=embedded.seed, sft_balance_columns=embedded.sft_balance_columns,
        train_balance_columns=embedded.train_balance_columns, sft_tool_share=embedded.sft_tool_share,
        sft_balance_product_digits=embedded.sft_balance_product_digits,
        sft_copy_drills=embedded.sft_copy_drills, sft_copy_drill_digits=embedded.sft_copy_drill_digits,
        result_width=result_width,
        tokenizer_settings=SentencePieceSettings(vocab_size=embedded.tokenizer_vocab_size),
    )


def scratch_checkpoint(scratch: ScratchModelConfig, vocab_size: int, seed: int, cache_dir: Path) -> Path:
    """A randomly initialised Qwen2 (or Qwen3-MoE) HF checkpoint of the `scratch` shape, cached by its settings.

    Args:
        scratch: the architecture.
        vocab_size: the tokenizer's vocabulary (the embedding has exactly these rows).
        seed: initialisation seed.
        cache_dir: parent of the cached checkpoint directories.

    Returns:
        The checkpoint directory (config.json + model.safetensors).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=scratch.hidden_size,
        intermediate_size=scratch.intermediate_size,
        num_hidden_layers=scratch.num_layers,
        num_attention_heads=scratch.num_attention_heads,
        num_key_value_heads=scratch.num_key_value_heads,
        max_position_embeddings=scratch.max_position_embeddings,
        rope_theta=scratch.rope_theta,
        tie_word_embeddings=scratch.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=SPM_BOS_ID,
        eos_token_id=SPM_EOS_ID,
        pad_token_id=SPM_PAD_ID,
        use_sliding_window=False,
    )
    if scratch.family == "qwen3_moe":
        hf_config = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=scratch.moe_intermediate_size
            or max(1, scratch.intermediate_size // scratch.num_experts_per_tok),
            num_experts=scratch.num_experts,
            num_experts_per_tok=scratch.num_experts_per_tok,
            norm_topk_prob=scratch.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=sorted(set(scratch.mlp_only_layers)),
            head_dim=scratch.hidden_size // scratch.num_attention_heads,
        )
        model_class = Qwen3MoeForCausalLM
    else:
        hf_config, model_class = Qwen2Config(**common), Qwen2ForCausalLM
    # The config dict carries transformers' version; torch's draws the initial weights.
    out = cache_dir / f"scratch-{digest({'config': hf_config.to_dict(), 'seed': seed, 'torch': torch.__version__})}"
    if (out / "config.json").is_file():
        return out
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class(hf_config)
    finally:
        torch.random.set_rng_state(generator_state)
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp))
    return out


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to `target` on success.

    A killed writer leaves only a hidden temporary directory, never a half-written
    `target`; when another process won the race, its identical copy is kept.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    chmod_as_created(tmp, directory=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


# Libraries whose version can change the float results of the cached artefacts.
NUMERIC_LIBRARIES = ("torch", "megatron-core", "transformers", "sentencepiece", "numpy", "safetensors")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_key() -> dict[str, object]:
    """What, besides the settings, decides the float results of SFT on this machine.

    The library versions, and the CPU kernel level torch dispatches to (AVX2, AVX512, ...):
    the same computation rounds differently with other kernels, so a cache shared between
    machines must not hand one machine's warm start to another.
    """
    return {"libraries": {name: _version(name) for name in NUMERIC_LIBRARIES},
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cuda": torch.version.cuda if torch.cuda.is_available() else None}


def digest(obj: object) -> str:
    """A short stable hash of a JSON-able object (cache keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]
