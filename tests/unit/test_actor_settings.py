"""The actor's small pure pieces: lr schedule, loss settings, optimizer config."""

import math

import pytest
import torch

from megatron_dapo.actor.actor import LRSchedule, make_optimizer_config
from megatron_dapo.algo import LossSettings
from megatron_dapo.config import AlgorithmConfig, OptimConfig


def test_warmup_is_linear_from_the_first_step_then_constant() -> None:
    sched = LRSchedule(lr=1e-6, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(sched.current())
        sched.num_steps += 1
    assert lrs == pytest.approx([0.25e-6, 0.5e-6, 0.75e-6, 1e-6, 1e-6, 1e-6], rel=1e-12)
    assert LRSchedule(lr=3e-4).current() == 3e-4


def test_decay_reaches_its_floor_at_decay_steps_then_stays() -> None:
    def lrs(style: str) -> list[float]:
        sched = LRSchedule(lr=1.0, warmup_steps=2, decay_style=style, decay_steps=6, min_lr_ratio=0.1)
        out = []
        for _ in range(8):
            out.append(sched.current())
            sched.num_steps += 1
        return out

    assert lrs("linear") == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])
    half = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    assert lrs("cosine") == pytest.approx([0.5, 1.0, 1.0, half, 0.55, 1.1 - half, 0.1, 0.1])
    assert lrs("constant") == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="decay_style='step'"):
        LRSchedule(lr=1.0, decay_style="step")


def test_the_decay_spans_the_whole_run_by_default() -> None:
    from megatron_dapo.config import Config

    cfg = Config()
    cfg.trainer.total_training_steps, cfg.data.train_batch_size, cfg.trainer.ppo_mini_batch_size = 10, 16, 8
    cfg.trainer.ppo_epochs = 2
    assert cfg.optimizer_steps == 10 * 2 * 2


def test_loss_settings_from_config_copy_every_field() -> None:
    algo = AlgorithmConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=5.0,
                           loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True,
                           kl_loss_coef=0.02, kl_loss_type="k3")
    s = LossSettings.from_config(algo, temperature=0.7, max_response_length=512)
    assert (s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c, s.loss_agg_mode, s.entropy_coeff,
            s.use_kl_loss, s.kl_loss_coef, s.kl_loss_type, s.temperature, s.loss_scale_factor) == (
        0.1, 0.3, 5.0, "seq-mean-token-mean", 0.01, True, 0.02, "k3", 0.7, 512.0)


def test_sum_norm_divides_by_a_constant_from_the_config() -> None:
    # Dr.GRPO's MAX_TOKENS: the configured factor, else max_response_length; never a batch length.
    norm = {"loss_agg_mode": "seq-mean-token-sum-norm"}
    assert LossSettings.from_config(AlgorithmConfig(**norm), 1.0, 4096).loss_scale_factor == 4096.0
    assert LossSettings.from_config(AlgorithmConfig(**norm, loss_scale_factor=300.0), 1.0, 4096).loss_scale_factor == 300.0
    with pytest.raises(ValueError, match=r"loss_scale_factor=None \(algorithm.loss_scale_factor\): seq-mean-token-sum-norm"):
        LossSettings(**norm)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_agg_mode": "token-sum"}, "loss_agg_mode='token-sum' .algorithm.loss_agg_mode. is not one of"),
    ({"temperature": 0.0}, r"temperature=0.0 \(rollout.temperature\) must be > 0"),
])
def test_loss_settings_reject_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossSettings(**kwargs)


def test_optimizer_config_is_adamw_with_master_weights_for_bf16() -> None:
    optim = OptimConfig(lr=2e-6, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0)
    cfg = make_optimizer_config(optim, dtype=torch.bfloat16, use_distributed_optimizer=True)
    assert (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.adam_beta2, cfg.clip_grad) == ("adam", 2e-6, 0.1, 0.95, 1.0)
    assert cfg.bf16 and not cfg.fp16 and cfg.params_dtype == torch.bfloat16 and cfg.use_distributed_optimizer
    assert cfg.decoupled_weight_decay  # AdamW, not Adam with L2
    fp32 = make_optimizer_config(OptimConfig(clip_grad=0.0), dtype=torch.float32, use_distributed_optimizer=False)
    assert not fp32.bf16 and fp32.clip_grad == math.inf  # clip off, but the norm is still reported
