"""Typed experiment configuration: one dataclass per component, YAML in, YAML out.

YAML is only a way to write these dataclasses. Loading is strict: an unknown key, a
wrong type or an inconsistent value fails at load time with one line that names the
key, where it came from (the file or the command line) and the fix, so a typo never
silently becomes a default in a 128-GPU job. Key names follow verl's where one exists
(clip_ratio_low, loss_agg_mode, filter_groups.*, gen_batch_size, ppo_mini_batch_size,
overlong_buffer.*, max_response_length, ...) so a verl DAPO recipe maps over by eye.

One module per group of sections (model.py: model + parallel; rollout.py; algorithm.py;
data.py; policy_loss.py: algorithm.policy_loss and its modes; reward.py; training.py: optim + trainer + logging), experiment.py for `Config`
and the rules that span sections, fields.py for the validation primitives, loader.py for
YAML and overrides, verl_names.py for verl's keys (the unknown-key hint), preflight.py for
the inputs train reads first (`config validate`, --static on a login node). Import every
name from megatron_dapo.config.
"""

from megatron_dapo.config.algorithm import (
    LOSS_AGG_MODES,
    AlgorithmConfig,
    FilterGroupsConfig,
    LossAggMode,
    RolloutCorrectionConfig,
)
from megatron_dapo.config.data import DataConfig, EmbeddedTaskConfig
from megatron_dapo.config.experiment import Config
from megatron_dapo.config.fields import ConfigError, _FieldError
from megatron_dapo.config.loader import from_dict, load_config, parse_override, to_dict, to_yaml
from megatron_dapo.config.model import (
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    ScratchModelConfig,
    SFTWarmStartConfig,
)
from megatron_dapo.config.policy_loss import (
    LOSS_MODE_SPECS,
    LOSS_MODES,
    LossMode,
    LossModeSpec,
    PolicyLossConfig,
)
from megatron_dapo.config.reward import OverlongBufferConfig, RewardConfig
from megatron_dapo.config.rollout import (
    ENGINE_NAMES,
    EngineName,
    RolloutConfig,
    SGLangConfig,
    ValKwargsConfig,
)
from megatron_dapo.config.tools import PythonToolConfig, ToolsConfig
from megatron_dapo.config.training import LoggingConfig, OptimConfig, TrainerConfig

__all__ = [
    "ENGINE_NAMES",
    "LOSS_AGG_MODES",
    "LOSS_MODES",
    "LOSS_MODE_SPECS",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EmbeddedTaskConfig",
    "EngineName",
    "FilterGroupsConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossAggMode",
    "LossMode",
    "LossModeSpec",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "ParallelConfig",
    "PolicyLossConfig",
    "PythonToolConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SFTWarmStartConfig",
    "SGLangConfig",
    "ScratchModelConfig",
    "ToolsConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "_FieldError",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
    "to_yaml",
]
