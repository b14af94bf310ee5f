"""Training checkpoints: atomic, resumable, reshardable (DESIGN.md, step 8 and the invariants).

A checkpoint is one directory ``<root>/step_<N>``::

    manifest.json       what is inside: step, model architecture and family, layout, format
    dist/               megatron.core.dist_checkpointing (torch_dist): the model chunks'
                        sharded_state_dict, the distributed optimizer's state in a format any
                        TP/PP/DP layout can load, the lr scheduler state
    rng/rank_<r>.pt     each rank's python/numpy/torch/megatron-tracker RNG states
    trainer_state.json  the caller's JSON-able loop state (step, consumed prompts, sampler, carry-over)
    config.yaml         the resolved experiment config
    hf/                 the source HF config.json + tokenizer files, so export needs no other input

Why it survives ``kill -9`` at any moment: every rank writes into ``<root>/.tmp-step_<N>``;
after a barrier rank 0 renames it to ``step_<N>`` (one atomic rename) and then atomically
replaces the ``latest`` pointer file (write tmp, fsync, os.replace). Until the rename the
previous checkpoint is the newest complete one; leftovers of an interrupted save are
deleted by the next save. ``manifest.json`` is written last inside the tmp dir, so a
directory without it was never complete.

Why loading into another layout works: model tensors are ShardedTensors with global
shapes, and the distributed optimizer is saved with ``fully_reshardable`` (canonical,
per-parameter state) by default, so dist_checkpointing reslices both for the loading
layout (``dp_reshardable`` is the faster opt-in that reshards DP only). RNG states are per
rank and only restored when the layout is unchanged (exact resume); otherwise they are
left as seeded, with a warning. Megatron pads the vocab to a multiple of 128 * tp: build
the loading model with convert.adapter_for_checkpoint so its padded vocab matches.

Modules: files (names, durable writes, HF file copy), format (validation, architecture
check, lookup of latest/resume), rng (per-rank RNG states), integrity (checksums),
dist_state (one directory's contents through dist_checkpointing), manager (save/load:
the directories' lifetime).

Nothing untrusted is unpickled: per-rank files load with ``torch.load(weights_only=True)``,
dist_checkpointing's common state also loads weights-only (torch >= 2.6 default), and the
pickled torch.distributed.checkpoint ``.metadata`` is first read by a restricted unpickler
that admits only checkpoint metadata classes (and checks every shard file's length).
"""

from megatron_dapo.checkpoint.dist_state import build_manifest
from megatron_dapo.checkpoint.files import (
    CONFIG_YAML,
    DIST_DIR,
    FORMAT_VERSION,
    HF_DIR,
    LATEST,
    MANIFEST,
    OPTIMIZER_SHARDINGS,
    RNG_DIR,
    TRAINER_STATE,
    CheckpointError,
    atomic_write_text,
    copy_hf_files,
    hf_files_of,
)
from megatron_dapo.checkpoint.format import (
    check_compatible,
    complete_checkpoints,
    current_layout,
    latest_checkpoint,
    model_architecture,
    model_sharded_state_dict,
    read_manifest,
    resolve_resume,
    step_of,
    unwrap,
)
from megatron_dapo.checkpoint.manager import CheckpointManager, save_model_checkpoint
from megatron_dapo.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "CONFIG_YAML",
    "DIST_DIR",
    "FORMAT_VERSION",
    "HF_DIR",
    "LATEST",
    "MANIFEST",
    "OPTIMIZER_SHARDINGS",
    "RNG_DIR",
    "TRAINER_STATE",
    "CheckpointError",
    "CheckpointManager",
    "atomic_write_text",
    "build_manifest",
    "capture_rng_state",
    "check_compatible",
    "complete_checkpoints",
    "copy_hf_files",
    "current_layout",
    "hf_files_of",
    "latest_checkpoint",
    "model_architecture",
    "model_sharded_state_dict",
    "read_manifest",
    "resolve_resume",
    "restore_rng_state",
    "save_model_checkpoint",
    "step_of",
    "unwrap",
]
