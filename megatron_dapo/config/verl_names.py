"""verl's config keys and ours: what the loader suggests when a verl key is written here.

Where verl and we share a name in the same place (data.train_batch_size, trainer.test_freq,
algorithm.filter_groups.*, ...) nothing is needed. The table holds the keys of verl's DAPO
recipe (recipe/dapo, verl's ppo_trainer.yaml) that are spelled or placed differently here;
the loader (loader.py) matches an unknown key by its full verl path first, then by its last
part, and a whole verl section (actor_rollout_ref: {...}) by the keys inside it.
"""

from __future__ import annotations

from typing import Any

VERL_KEYS: dict[str, str] = {
    "trainer.save_freq": "trainer.save_interval",
    "trainer.total_epochs": "trainer.total_training_steps",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.resume_mode": "trainer.resume",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints_to_keep",
    "actor_rollout_ref.model.path": "model.hf_checkpoint",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "trainer.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs": "trainer.ppo_epochs",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "trainer.max_tokens_per_microbatch",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "trainer.max_tokens_per_microbatch",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg_mode",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_loss_type",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coeff",
    "actor_rollout_ref.actor.grad_clip": "optim.clip_grad",
    "actor_rollout_ref.actor.optim.lr": "optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "optim.lr_warmup_steps",
    "actor_rollout_ref.actor.optim.weight_decay": "optim.weight_decay",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size": "parallel.context_parallel_size",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.val_kwargs.n",
    "reward_model.overlong_buffer.enable": "reward.overlong_buffer.enable",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_buffer.penalty_factor",
    "custom_reward_function.path": "reward.reward_fn",
    "custom_reward_function.name": "reward.reward_fn",
}
"""verl's dotted key -> ours."""

# The last part of each verl key that is not also a key of ours in another place, for a verl
# key written under one of our sections (trainer.clip_ratio_low, optim.grad_clip).
_LEAVES: dict[str, str] = {}
for _verl, _ours in VERL_KEYS.items():
    _LEAVES.setdefault(_verl.rpartition(".")[2], _ours)


def verl_hint(key: str, value: Any = None) -> str | None:
    """Our key for an unknown key written as verl names it, or None.

    Args:
        key: the unknown key, dotted (e.g. "trainer.save_freq", "actor_rollout_ref").
        value: its value; a mapping is searched for verl keys inside it.

    Returns:
        "did you mean 'trainer.save_interval' (verl's trainer.save_freq)?" or the like.
    """
    if key in VERL_KEYS:
        return f"did you mean '{VERL_KEYS[key]}' (verl's {key})?"
    leaf = key.rpartition(".")[2]
    if "." in key and leaf in _LEAVES and _LEAVES[leaf] != key:
        return f"did you mean '{_LEAVES[leaf]}' (verl's {leaf})?"
    if isinstance(value, dict):
        found = [(f"{key}.{path}", VERL_KEYS[f"{key}.{path}"]) for path in _paths(value) if f"{key}.{path}" in VERL_KEYS]
        if found:
            shown = ", ".join(f"{verl} -> {ours}" for verl, ours in found[:4])
            more = f" and {len(found) - 4} more" if len(found) > 4 else ""
            return f"this is verl's layout; here: {shown}{more}"
    return None


def _paths(tree: dict[Any, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of a nested mapping, in order."""
    out: list[str] = []
    for k, v in tree.items():
        path = f"{prefix}{k}"
        out.extend(_paths(v, path + ".") if isinstance(v, dict) else [path])
    return out
