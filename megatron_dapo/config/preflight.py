"""Everything `train` checks before its first step, without a model: what `config validate` runs.

`check_inputs(cfg)` is the one list. `config validate FILE` calls it alone; `train` calls it
on the controller before it writes anything or starts the warm start (run.build_run), so a
job that validates does not die on any of these minutes (or an SFT warm start) into setup,
and a job that does not validate fails on them in its first seconds. In order:

- the device: `trainer.device=cuda` needs a GPU this process can see, and a fleet's servers
  must fit the device (factory.check_engine_device: a vLLM server on CPU has one worker);
- the engine family is installed (rollout/factory.check_installed: the same check `eval`
  runs for `--engine`), and can serve the checkpoint (factory.check_model: SGLang 0.5.18 and
  a Qwen3-MoE with dense layers, vLLM's CPU MoE kernel and its padded experts);
- the run directory can be created and written (output_dir.check_output_dir), and the
  cache directory ($MEGATRON_DAPO_CACHE) is a writable directory;
- the reward function imports as the reward workers will import it;
- the HF checkpoint (config.json, a supported family, every safetensors shard header) and
  the tokenizer;
- every prompt file (or the embedded task's problem space), and that there are at least
  `data.train_batch_size` prompts (fewer would repeat prompts inside every batch);
- a custom reward function answers one probe call within reward.timeout_s;
- custom tools (tools.enable) import in a worker as the run's tool workers will import them,
  and the call format's end marker is one token of the tokenizer (generation stops on it);
- the tokenizer's ids fit the model's vocabulary (config.json's vocab_size);
- rollout.host names an address of this node (SGLang and vLLM servers bind it), and
  rollout.nodes is used inside a SLURM job (its servers are srun steps of the job);
- the checkpoint the run would resume from (explicit, or `latest` of output_dir with
  resume=auto): its manifest, its architecture against the configured model and the
  parallel layout (Megatron's vocabulary padding depends on TP), and, unless the caller
  verifies them itself in parallel (train), every file's checksum.

Each problem is the same one-line UserError the run would stop with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_dapo.config.experiment import Config
from megatron_dapo.config.fields import ConfigError
from megatron_dapo.errors import UserError


def check_hf_checkpoint(path: str | Path, where: str = "model.hf_checkpoint") -> None:
    """Raise a one-line UserError unless ``path`` is an HF model directory we can load.

    Reads config.json and every safetensors header, no tensor data. `train`, `config validate`,
    the converters and `eval` all run it.

    Args:
        where: how the user named the directory, for the message.
    """
    from megatron_dapo.models import HFCheckpoint, adapter_for

    hf = Path(path)
    if not hf.is_dir():
        raise UserError(f"{where}={str(hf)!r} is not a directory; point it at an HF model "
                        "directory (config.json, *.safetensors, tokenizer files)")
    from megatron_dapo.models.mapping import check_checkpoint

    adapter = adapter_for(hf)  # config.json readable, a supported family
    # Every shard's header readable; tensor names, shapes and dtypes those of config.json's
    # model (a wrong model_type shows as missing or unexpected tensors).
    check_checkpoint(adapter.hf, HFCheckpoint(hf))


def check_device(device: str) -> None:
    """`trainer.device=cuda` on a machine (or in a process) without a visible GPU."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but this process sees no CUDA GPU (torch.cuda.is_available() is "
                        "False); use trainer.device=cpu (or auto), or run where a GPU is visible")


def check_inputs(cfg: Config, *, verify_resume_checksums: bool = True, world_size: int | None = None,
                 world_source: str = "--world-size") -> None:
    """Check everything train reads before its first step (see the module docstring).

    Args:
        verify_resume_checksums: read every file of the resume checkpoint; train passes False
            and verifies them over all its ranks instead.
        world_size: the job's processes, when known (train; `config validate --world-size`):
            the expert layout is checked against it too.
        world_source: where the world size came from, for the message.

    Raises:
        UserError: the first unusable input, in one line.
    """
    from megatron_dapo.embedded import cache_root, check_task
    from megatron_dapo.output_dir import check_output_dir
    from megatron_dapo.rewards.registry import check_reward_spec, get_reward_fn
    from megatron_dapo.rollout.factory import check_engine_device, check_installed, check_model

    if cfg.trainer.device in ("cpu", "cuda"):  # auto: checked when the engines start, on the device found
        check_engine_device(cfg.rollout, cfg.trainer.device)
    check_device(cfg.trainer.device)
    check_rollout_addresses(cfg)
    if cfg.model.transformer_impl == "transformer_engine":
        from megatron_dapo.models.transformer_impl import choose_transformer_impl

        choose_transformer_impl("transformer_engine")  # where TE cannot run, one line naming why
    check_installed(cfg.rollout.engine, cfg.rollout)
    check_output_dir(Path(cfg.trainer.output_dir))
    check_reward_spec(cfg.reward.reward_fn)
    if cfg.reward.num_workers == 0:
        get_reward_fn(cfg.reward.reward_fn)  # it runs in this process anyway; else the probe imports it
    from megatron_dapo.data.tokenizer import load_tokenizer

    if cfg.model.hf_checkpoint is not None:
        check_hf_checkpoint(cfg.model.hf_checkpoint)
        check_model(cfg.rollout.engine, cfg.model.hf_checkpoint, cfg.trainer.device)
    check_model_layout(cfg, world_size, world_source)
    source = cfg.model.tokenizer or cfg.model.hf_checkpoint
    tokenizer = load_tokenizer(source) if source is not None else None
    if tokenizer is not None and cfg.model.hf_checkpoint is not None:
        check_tokenizer_fits(tokenizer, cfg.model.hf_checkpoint, "model.tokenizer" if cfg.model.tokenizer else
                             "model.hf_checkpoint")
    if cfg.tools.enable:
        check_tool_format(cfg, tokenizer)
    if cfg.model.hf_checkpoint is not None and not cfg.data.train_files:
        raise UserError("data.train_files is empty and model.hf_checkpoint is set; give prompt files "
                        "(DAPO-Math-17K parquet/jsonl) in data.train_files (the embedded task is for "
                        "the scratch model only)")
    files = [*cfg.data.train_files, *cfg.data.val_files]
    first_answer = "1"
    if files:
        from megatron_dapo.data.datasets import load_prompt_dataset

        if tokenizer is None:
            raise UserError("data.train_files is set but neither model.tokenizer nor model.hf_checkpoint is; "
                            "the prompt files need the model's tokenizer: set model.hf_checkpoint")
        num_train = 0
        for f in files:
            records = load_prompt_dataset(f, tokenizer, cfg.data.max_prompt_length).records
            if f in cfg.data.train_files:
                num_train += len(records)
                first_answer = records[0].ground_truth
        where = f"data.train_files ({len(cfg.data.train_files)} file(s))"
        if cfg.data.train_files:
            _check_enough_prompts(num_train, cfg.data.train_batch_size, where)
    if not cfg.data.train_files and cfg.model.hf_checkpoint is None:
        cache_root()
        check_task(cfg.data.embedded)
        _check_enough_prompts(cfg.data.embedded.num_train, cfg.data.train_batch_size, "data.embedded.num_train")
    if ":" in cfg.reward.reward_fn and cfg.reward.num_workers > 0:
        from megatron_dapo.rewards.pool import probe_reward_fn

        probe_reward_fn(cfg.reward.reward_fn, cfg.reward.timeout_s, first_answer)
    if cfg.tools.enable and cfg.tools.custom_tools():
        from megatron_dapo.tools.custom import check_custom_tools

        check_custom_tools(cfg.tools.custom_tools(), cfg.tools.custom_timeout_s)
    resume = resume_checkpoint(cfg)
    if resume is not None:
        check_resume(cfg, resume, verify_checksums=verify_resume_checksums)


def check_tokenizer_fits(tokenizer: Any, hf_dir: str | Path, where: str) -> None:
    """The tokenizer's ids must be rows of the model's embedding: a larger tokenizer fails every
    rank's first forward (an index out of range) after the warm start."""
    from megatron_dapo.models import adapter_for

    model_vocab = adapter_for(Path(hf_dir)).hf.vocab_size
    if tokenizer.vocab_size > model_vocab:
        raise UserError(f"{where}: the tokenizer has {tokenizer.vocab_size} ids but the model {hf_dir} has "
                        f"{model_vocab} (config.json vocab_size): its larger ids have no embedding row; use the "
                        "model's own tokenizer (leave model.tokenizer unset) or a model of this tokenizer")


def check_tool_format(cfg: Config, tokenizer: Any) -> None:
    """tools.format's call end must be one token of the run's tokenizer (tools/episode.py refuses it
    otherwise, after the warm start). The embedded task's tokenizer is trained in the run: it has
    the tags markers as pieces exactly when its task calls the calculator (data/arithmetic.py)."""
    from megatron_dapo.tools.episode import check_call_close
    from megatron_dapo.tools.formats import FORMATS

    fmt = FORMATS[cfg.tools.format]
    if tokenizer is not None:
        check_call_close(fmt, tokenizer)
        return
    e = cfg.data.embedded
    if fmt.name == "tags" and (e.big_mul > 0 or e.sft_tool_share > 0):
        return
    why = (f"the embedded task's tokenizer has no {fmt.call_close!r} piece (its pieces are the tags format's)"
           if fmt.name != "tags" else "the embedded task's tokenizer has the tags markers as pieces only when its "
           "task calls the calculator (data.embedded.big_mul > 0 or data.embedded.sft_tool_share > 0)")
    raise UserError(f"tools.format={fmt.name} with the scratch model: {why}, and generation can only stop on one "
                    "token; use tools.format=tags with data.embedded.big_mul > 0, or a model whose tokenizer has "
                    "the format's markers (hermes: Qwen's, model.hf_checkpoint)")


def check_rollout_addresses(cfg: Config) -> None:
    """rollout.host must be an address of this node (the servers bind it; a name that does not
    resolve or an address of another machine failed after the warm start with gaierror or errno
    99), and rollout.nodes needs the SLURM job its servers are steps of."""
    import socket

    r = cfg.rollout
    if r.nodes:
        from megatron_dapo.rollout.fleet.nodes import check_nodes

        check_nodes(r.nodes)
    if r.host is None or r.engine == "local" or r.nodes:
        return
    from megatron_dapo.config.fields import show

    try:
        infos = socket.getaddrinfo(r.host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise UserError(f"rollout.host={show(r.host)} does not resolve ({e}); give this node's address or name "
                        "(e.g. 127.0.0.1), or leave it null for this node's address") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0))
        except OSError as e:
            raise UserError(f"rollout.host={show(r.host)} is {address[0]}, not an address of this node ({e.strerror}), "
                            "so the servers cannot bind it; give this node's address, or leave it null") from None


def check_model_layout(cfg: Config, world_size: int | None = None, world_source: str = "--world-size") -> None:
    """The settings that need the model's own shape: expert parallelism and the MoE loss on a dense
    model, EP not dividing the experts, and (with the world size) the whole expert layout.

    The actor raised these from megatron-core's config on every rank, with a traceback
    (models/moe.moe_config_kwargs); `config validate` passed them.
    """
    from megatron_dapo.plan.dims import resolve_model
    from megatron_dapo.plan.model import check_expert_layout

    dims = resolve_model(cfg)
    ep = cfg.parallel.expert_model_parallel_size
    if not dims.is_moe:
        if ep > 1:
            raise ConfigError(f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model, but "
                              f"{dims.source} is dense; set it to 1")
        if cfg.model.moe_aux_loss_coeff:
            raise ConfigError(f"model.moe_aux_loss_coeff={cfg.model.moe_aux_loss_coeff} applies to mixture-of-experts "
                              f"models only; {dims.source} is dense: set it to 0")
    elif dims.num_experts % ep:
        divisors = [d for d in range(1, dims.num_experts + 1) if dims.num_experts % d == 0]
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} does not divide num_experts={dims.num_experts} "
                          f"of {dims.source}; use one of {divisors}")
    if world_size is not None:
        check_expert_layout(cfg.parallel, dims, world_size, world_source)


def _check_enough_prompts(num_prompts: int, train_batch_size: int, where: str) -> None:
    if num_prompts < train_batch_size:
        raise UserError(f"{where} holds {num_prompts} usable prompt(s), fewer than data.train_batch_size="
                        f"{train_batch_size}: every batch would repeat prompts; add prompts or lower "
                        "data.train_batch_size")


def resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint train would resume from (trainer.resume: explicit, or auto's latest)."""
    from megatron_dapo.checkpoint import resolve_resume

    return resolve_resume(cfg.trainer.resume, Path(cfg.trainer.output_dir) / "checkpoints")


def check_resume(cfg: Config, path: Path, *, verify_checksums: bool = True) -> dict[str, Any]:
    """The resume checkpoint against the configured model and layout; returns its manifest.

    Raises:
        CheckpointError: unreadable, of another model, saved in a layout that cannot load at
            this one, or (verify_checksums) a file that does not match its checksum.
    """
    from megatron_dapo.checkpoint import CheckpointError, read_manifest
    from megatron_dapo.checkpoint.integrity import verify_checksums as verify
    from megatron_dapo.models.mapping import padded_vocab_size

    manifest = read_manifest(path)
    expected = expected_architecture(cfg)
    saved = manifest.get("model", {})
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    layout = manifest.get("layout", {})
    if expected is not None:
        vocab = expected.pop("vocab_size")
        diffs = [f"{k}={saved[k]!r} (config: {v!r})" for k, v in expected.items() if k in saved and saved[k] != v]
        if diffs:
            raise CheckpointError(f"checkpoint {path} does not match the configured model: {', '.join(diffs)}; "
                                  "resume with the model it was trained with, or set trainer.resume=disable")
        padded = padded_vocab_size(vocab, tp)
        if "vocab_size" in saved and saved["vocab_size"] != padded:
            fits = [t for t in (1, 2, 4, 8, 16) if padded_vocab_size(vocab, t) == saved["vocab_size"]]
            hint = f"resume at parallel.tensor_model_parallel_size={' or '.join(map(str, fits))}" if fits else \
                "resume with the layout it was saved at"
            raise CheckpointError(
                f"checkpoint {path} was saved at tensor_model_parallel_size={layout.get('tp', '?')}, where Megatron "
                f"pads the vocabulary of {vocab} to {saved['vocab_size']} rows; at parallel.tensor_model_parallel_size"
                f"={tp} it pads to {padded}, which the saved embedding cannot load into; {hint}")
    if manifest.get("has_optimizer") and manifest.get("optimizer_sharding") == "dp_reshardable" and \
            (layout.get("tp"), layout.get("pp")) != (tp, pp):
        raise CheckpointError(
            f"checkpoint {path} holds dp_reshardable optimizer state saved at tp={layout.get('tp')} "
            f"pp={layout.get('pp')}, which loads only at that TP/PP (config: tp={tp} pp={pp}); resume with the "
            "saved parallel sizes")
    if verify_checksums:
        verify(path, manifest)
    return manifest


def expected_architecture(cfg: Config) -> dict[str, int] | None:
    """The checkpoint architecture fields the config determines (unpadded vocab_size); None = unknown."""
    if cfg.model.hf_checkpoint is None:
        s = cfg.model.scratch
        return {"num_layers": s.num_layers, "hidden_size": s.hidden_size, "ffn_hidden_size": s.intermediate_size,
                "num_attention_heads": s.num_attention_heads, "num_query_groups": s.num_key_value_heads,
                "vocab_size": cfg.data.embedded.tokenizer_vocab_size}
    config_path = Path(cfg.model.hf_checkpoint) / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, ValueError, RecursionError):
        return None  # check_hf_checkpoint reports it
    heads = int(hf.get("num_attention_heads", 0))
    return {"num_layers": int(hf.get("num_hidden_layers", 0)), "hidden_size": int(hf.get("hidden_size", 0)),
            "ffn_hidden_size": int(hf.get("intermediate_size", 0)), "num_attention_heads": heads,
            "num_query_groups": int(hf.get("num_key_value_heads", heads)), "vocab_size": int(hf.get("vocab_size", 0))}
