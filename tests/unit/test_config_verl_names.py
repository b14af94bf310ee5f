"""verl's key names, mistyped here, are answered with ours (config/verl_names.py, issue 60)."""

from __future__ import annotations

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.loader import _config_keys
from megatron_dapo.config.verl_names import VERL_KEYS


@pytest.mark.parametrize("override, message", [
    ("trainer.save_freq=5", "trainer.save_freq: unknown key; did you mean 'trainer.save_interval' "
                            "(verl's trainer.save_freq)?"),
    ("trainer.total_epochs=3", "trainer.total_epochs: unknown key; did you mean 'trainer.total_training_steps' "
                               "(verl's trainer.total_epochs)?"),
    ("trainer.clip_ratio_low=0.2", "trainer.clip_ratio_low: unknown key; did you mean 'algorithm.clip_ratio_low' "
                                   "(verl's clip_ratio_low)?"),
    ("algorithm.ppo_mini_batch_size=8", "algorithm.ppo_mini_batch_size: unknown key; did you mean "
                                        "'trainer.ppo_mini_batch_size' (verl's ppo_mini_batch_size)?"),
    ("optim.grad_clip=1.0", "optim.grad_clip: unknown key; did you mean 'optim.clip_grad' (verl's grad_clip)?"),
    ("actor_rollout_ref.rollout.n=16", "actor_rollout_ref: unknown key; this is verl's layout; here: "
                                       "actor_rollout_ref.rollout.n -> rollout.n"),
    ("actor_rollout_ref={actor: {loss_agg_mode: token-mean, clip_ratio_high: 0.28}, rollout: {max_response_length: 8}}",
     "actor_rollout_ref: unknown key; this is verl's layout; here: actor_rollout_ref.actor.loss_agg_mode -> "
     "algorithm.loss_agg_mode, actor_rollout_ref.actor.clip_ratio_high -> algorithm.clip_ratio_high"),
    # Not verl's, but ours in another section; a typo still gets the close spelling.
    ("trainer.max_response_length=8", "trainer.max_response_length: unknown key; did you mean "
                                      "'data.max_response_length'?"),
    ("trainer.sav_interval=3", "trainer.sav_interval: unknown key; did you mean 'trainer.save_interval'?"),
])
def test_a_verl_key_is_answered_with_ours(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == f"command line: {message}"


def test_every_key_the_table_suggests_exists() -> None:
    ours = set(_config_keys())
    assert sorted(v for v in VERL_KEYS.values() if v not in ours) == []
    assert "trainer.save_interval" in ours and "model.scratch.hidden_size" in ours
