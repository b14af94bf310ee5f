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
- the distillation teacher (algorithm.distill.teacher): an HF checkpoint like the model's,
  splittable in the actor's TP/PP layout, with the student's tokenizer;
- every prompt file (or the embedded task's problem space), and that there are at least
  `data.train_batch_size` prompts (fewer would repeat prompts inside every batch);
- a custom reward function answers one probe call within reward.timeout_s;
- the python tool (tools.enable, "python" listed) runs a probe call with its tools.python.isolation
  (tools/sandbox.isolation_problem: the namespaces, the interpreter readable by the jail's user);
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

`static=True` (`config validate --static`, the sbatch scripts' DRY_RUN) is the part that
does not need the target node: no device, Transformer Engine or engine probe, and a path
that does not exist here (a cluster filesystem seen from a login node) is a warning, not an
error; the reward function and custom tools are still imported and probed, and what does
exist here (a checkpoint, a tokenizer, prompt files) is read as train reads it. A
placeholder path (`/path/to/...`, the recipes' own) is named as one either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_dapo.config.experiment import Config
from megatron_dapo.config.fields import ConfigError
from megatron_dapo.config.tools import tool_entry
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


PLACEHOLDER_MARKERS = ("/path/to/", "path/to/")
"""What the example recipes write where a user must put their own path."""


def is_placeholder(path: str | Path) -> bool:
    """Whether `path` is an example's placeholder (`/path/to/...`), not a real path."""
    text = str(path)
    return text.startswith(PLACEHOLDER_MARKERS[1]) or PLACEHOLDER_MARKERS[0] in text


def _missing_path(where: str, path: str | Path, what: str, static: bool, warnings: list[str]) -> bool:
    """True (and a warning under static) when `path` does not exist here; a placeholder is named as one.

    Raises:
        UserError: not static and the path is a placeholder (a missing real path is left to the
            check that reads it, whose message says what it expected).
    """
    if is_placeholder(path):
        line = f"{where}={str(path)!r} is a placeholder: replace it with the path of your {what}"
        if not static:
            raise UserError(line)
        warnings.append(line)
        return True
    if Path(path).exists():
        return False
    if static:
        warnings.append(f"{where}={str(path)!r} does not exist on this machine; not checked (--static): "
                        f"it must exist where the job runs")
    return static


def check_inputs(cfg: Config, *, verify_resume_checksums: bool = True, world_size: int | None = None,
                 world_source: str = "--world-size", static: bool = False) -> list[str]:
    """Check everything train reads before its first step (see the module docstring).

    Args:
        verify_resume_checksums: read every file of the resume checkpoint; train passes False
            and verifies them over all its ranks instead.
        world_size: the job's processes, when known (train; `config validate --world-size`):
            the expert layout is checked against it too.
        world_source: where the world size came from, for the message.
        static: only what does not need the target node (module docstring): no device or
            engine probe, and paths missing here are warnings.

    Returns:
        The warnings (static only: paths not checked because they do not exist here), one line each.

    Raises:
        UserError: the first unusable input, in one line.
    """
    from megatron_dapo.embedded import cache_root, check_task
    from megatron_dapo.output_dir import check_output_dir
    from megatron_dapo.rewards.registry import check_reward_spec, get_reward_fn
    from megatron_dapo.rollout.factory import check_engine_device, check_installed, check_model

    warnings: list[str] = []
    if cfg.trainer.device in ("cpu", "cuda"):  # auto: checked when the engines start, on the device found
        check_engine_device(cfg.rollout, cfg.trainer.device)
    if not static:
        check_device(cfg.trainer.device)
        check_rollout_addresses(cfg)  # this node's addresses: the target node's to check
        if cfg.model.transformer_impl == "transformer_engine":
            from megatron_dapo.models.transformer_impl import choose_transformer_impl

            choose_transformer_impl("transformer_engine")  # where TE cannot run, one line naming why
        check_installed(cfg.rollout.engine, cfg.rollout)
        from megatron_dapo.metrics import check_trackers

        check_trackers(cfg.logging.tensorboard, cfg.logging.mlflow)
    output_dir = Path(cfg.trainer.output_dir)
    if static and not output_dir.exists():
        try:
            check_output_dir(output_dir)
        except UserError as e:  # its parent may be a filesystem mounted only on the cluster
            warnings.append(f"{e} (on this machine; --static: it must be writable where the job runs)")
    else:
        check_output_dir(output_dir)
    check_reward_spec(cfg.reward.reward_fn)
    if cfg.reward.num_workers == 0:
        get_reward_fn(cfg.reward.reward_fn)  # it runs in this process anyway; else the probe imports it
    from megatron_dapo.data.tokenizer import load_tokenizer

    hf = cfg.model.hf_checkpoint
    hf_here = hf is not None and not _missing_path("model.hf_checkpoint", hf, "HF checkpoint directory", static,
                                                   warnings)
    if hf_here:
        check_hf_checkpoint(hf)
        if not static:
            check_model(cfg.rollout.engine, hf, cfg.trainer.device)
    shape_known = True
    if static and hf is not None and not hf_here:
        from megatron_dapo.plan.dims import resolve_model

        try:
            resolve_model(cfg)  # a bundled config of the same name (examples/model_configs) stands in
        except ConfigError as e:
            shape_known = False
            warnings.append(f"{e}; the layout is not checked against the model's shape here (--static)")
    if shape_known:
        check_model_layout(cfg, world_size, world_source)
    source = cfg.model.tokenizer or hf
    if cfg.model.tokenizer is not None:
        tokenizer_here = not _missing_path("model.tokenizer", cfg.model.tokenizer, "tokenizer", static, warnings)
    else:
        tokenizer_here = hf_here or not static
    tokenizer = load_tokenizer(source) if source is not None and tokenizer_here else None
    if source is None and (cfg.data.train_files or cfg.data.val_files):
        # A scratch model reads prompt files with the embedded task's tokenizer, as train does (run.py).
        from megatron_dapo.embedded import task_of

        check_task(cfg.data.embedded)
        tokenizer = load_tokenizer(task_of(cfg, cache_root()).tokenizer_path)
    if tokenizer is not None and hf_here:
        check_tokenizer_fits(tokenizer, hf, "model.tokenizer" if cfg.model.tokenizer else "model.hf_checkpoint")
    if cfg.tools.enable and (tokenizer is not None or hf is None):  # None with hf: not here (--static)
        check_tool_format(cfg, tokenizer)
    if cfg.algorithm.distill.teacher is not None:
        check_teacher(cfg, tokenizer)
    if hf is not None and not cfg.data.train_files:
        raise UserError("data.train_files is empty and model.hf_checkpoint is set; give prompt files "
                        "(DAPO-Math-17K parquet/jsonl) in data.train_files (the embedded task is for "
                        "the scratch model only)")
    files = [(f"data.train_files[{i}]", f, True) for i, f in enumerate(cfg.data.train_files)]
    files += [(f"data.val_files[{i}]", f, False) for i, f in enumerate(cfg.data.val_files)]
    files = [(where, f, train) for where, f, train in files
             if not _missing_path(where, f, "prompt file (parquet or jsonl)", static, warnings)]
    first_answer, first_source = "1", None
    if files and (tokenizer is not None or not static):
        from megatron_dapo.data.datasets import load_prompt_dataset

        num_train, all_train = 0, sum(train for _, _, train in files) == len(cfg.data.train_files)
        for _, f, train in files:
            records = load_prompt_dataset(f, tokenizer, cfg.data.max_prompt_length).records
            if train:
                num_train += len(records)
                first_answer, first_source = records[0].ground_truth, records[0].data_source
        where = f"data.train_files ({len(cfg.data.train_files)} file(s))"
        if cfg.data.train_files and all_train:
            _check_enough_prompts(num_train, cfg.data.train_batch_size, where)
    elif files:
        warnings.append(f"{len(files)} prompt file(s) exist but are not read: the tokenizer "
                        f"({source}) is not on this machine (--static)")
    if not cfg.data.train_files and hf is None:
        cache_root()
        check_task(cfg.data.embedded)
        _check_enough_prompts(cfg.data.embedded.num_train, cfg.data.train_batch_size, "data.embedded.num_train")
    if ":" in cfg.reward.reward_fn and cfg.reward.num_workers > 0:
        from megatron_dapo.rewards.pool import probe_reward_fn

        probe_reward_fn(cfg.reward.reward_fn, cfg.reward.timeout_s, first_answer, data_source=first_source)
    if cfg.tools.enable and "python" in (spec for _, spec in map(tool_entry, cfg.tools.tools)):
        if static:  # the jail's namespaces are the training node's kernel's to allow, not this one's
            warnings.append("tools.python's isolation is probed on the training node, not here (--static)")
        else:
            check_python_tool(cfg.tools.python.isolation)
    if cfg.tools.enable and cfg.tools.custom_tools():
        from megatron_dapo.tools.custom import check_custom_tools

        check_custom_tools(cfg.tools.custom_tools(), cfg.tools.custom_timeout_s)
    if static and cfg.trainer.resume not in ("auto", "disable") and \
            _missing_path("trainer.resume", cfg.trainer.resume, "checkpoint to resume from", static, warnings):
        return warnings
    resume = resume_checkpoint(cfg)
    if resume is not None:
        check_resume(cfg, resume, verify_checksums=verify_resume_checksums)
    return warnings


def check_python_tool(isolation: str) -> None:
    """Raise a one-line UserError unless the python tool's sandbox runs code here as configured (one probe call)."""
    from megatron_dapo.tools.sandbox import isolation_problem

    problem = isolation_problem(isolation)
    if problem is None:
        return
    if isolation == "limits_only":
        raise UserError(f"tools.python.isolation=limits_only: the python tool cannot run code here ({problem})")
    raise UserError(
        f"tools.python.isolation=namespaces: this machine cannot isolate the python tool ({problem}); allow "
        "unprivileged user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 "
        "where it exists, no seccomp or AppArmor rule against them), or accept resource limits alone with "
        "tools.python.isolation=limits_only (the policy's code can then signal your processes and read your files)")


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


# Text the student's and the teacher's tokenizers must encode to the same ids.
_TOKENIZER_PROBE = "Compute 12 + 34 * 5 - 6. Answer: \\boxed{176}\n"


def check_teacher(cfg: Config, student: Any | None) -> None:
    """One line unless algorithm.distill.teacher is an HF checkpoint the actor's layout can hold,
    with the student's tokenizer (same vocabulary size, end token and ids of a probe text) and an
    embedding row for every one of its ids.

    Args:
        student: the student's tokenizer, or None for the embedded task's (only its size is known here).
    """
    from megatron_dapo.data.tokenizer import load_tokenizer

    where = "algorithm.distill.teacher"
    teacher_dir = cfg.algorithm.distill.teacher
    if (Path(teacher_dir) / "manifest.json").is_file():
        raise UserError(f"{where}={teacher_dir!r} is a training checkpoint; export its weights first "
                        f"(megatron-dapo convert mcore-to-hf) and point {where} at the HF directory")
    check_hf_checkpoint(teacher_dir, where)
    hf = json.loads((Path(teacher_dir) / "config.json").read_text())
    heads = int(hf.get("num_attention_heads", 0))
    cfg.check_model_shape(heads, int(hf.get("num_key_value_heads", heads)), int(hf.get("num_hidden_layers", 0)),
                          f"{where}={teacher_dir}")
    teacher = load_tokenizer(teacher_dir)
    size = student.vocab_size if student is not None else cfg.data.embedded.tokenizer_vocab_size
    same = teacher.vocab_size == size
    if same and student is not None:
        same = teacher.eos_id == student.eos_id and teacher.encode(_TOKENIZER_PROBE) == student.encode(_TOKENIZER_PROBE)
    if not same:
        raise UserError(f"{where}={teacher_dir!r}: its tokenizer is not the student's (vocabulary {teacher.vocab_size} "
                        f"vs {size}, or other ids for the same text); the teacher scores the student's tokens, so "
                        "distil from a model with the student's tokenizer")
    rows = int(hf.get("vocab_size", 0))
    if rows < size:
        raise UserError(f"{where}={teacher_dir!r}: its embedding has {rows} rows (config.json vocab_size), fewer "
                        f"than the student's {size} token ids; distil from a model with the student's vocabulary")


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
