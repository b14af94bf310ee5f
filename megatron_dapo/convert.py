"""HF <-> Megatron checkpoint conversion: the logic behind `megatron-dapo convert` and tools/convert_*.py.

    megatron-dapo convert hf-to-mcore --hf DIR --out DIR [--tp N --pp M --ep E]
    megatron-dapo convert mcore-to-hf --ckpt DIR --out DIR [--hf-config-from DIR] [--max-shard-size 5GB]

One process (the default, whatever --tp/--pp/--ep say) streams: hf-to-mcore builds the model
without touching its memory, reads each parameter from the safetensors shards with plain
file reads only when the torch_dist writer reaches it, and frees it once written
(checkpoint/streaming.py); mcore-to-hf loads one layer at a time and writes each HF tensor
at its planned place in shards whose headers went first (models/hf_writer.py). Peak
resident memory is about the largest layer plus the embedding, not the checkpoint (the
command prints it). The checkpoint reshards at load, so the layout flags only choose the
vocab padding (a multiple of 128 * tp, as that layout would write) and are checked
against the model (heads, layers, experts). Under torchrun with world = tp * pp * ep each
rank builds its shard and reads only its slices (load_hf), the collective path.

The result is a model-only torch_dist checkpoint (checkpoint.save_model_checkpoint) with
the HF config and tokenizer files embedded; the trainer loads it as an initial checkpoint,
any layout. The tool scripts keep their work under ``if __name__ == "__main__":`` because
dist_checkpointing's writer starts a "spawn" Manager that re-imports the launching module.
Conversion is lossless: HF -> Megatron (any TP/PP/EP) -> HF is bit-exact.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

from megatron_dapo.checkpoint import (
    HF_DIR,
    CheckpointError,
    CheckpointManager,
    copy_hf_files,
    hf_files_of,
    latest_checkpoint,
    read_manifest,
    save_model_checkpoint,
)
from megatron_dapo.errors import EXIT_USER_ERROR, UserError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000 bytes."""
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").upper() if match else ""
    if unit and not unit.endswith("B"):
        unit += "B"
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 512MiB or 100000000")
    return int(float(match.group(1)) * _UNITS[unit])


# ----------------------------------------------------------------------------- helpers


def _adapter(hf_dir: str | os.PathLike[str]) -> Any:
    from megatron_dapo.models import adapter_for

    if not (Path(hf_dir) / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; pass the directory an HF model was saved to")
    try:
        return adapter_for(hf_dir)
    except UserError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _hf_dtype(hf_dir: Path, override: str | None) -> Any:
    """The parameter dtype: --dtype, else config.json's dtype/torch_dtype, else float32."""
    import torch

    name = override
    if name is None:
        try:
            raw = json.loads((hf_dir / "config.json").read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise UserError(f"cannot read {hf_dir / 'config.json'} ({e}); re-download or re-save the checkpoint") from None
        name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise UserError(
            f"dtype {name!r} (from --dtype or {hf_dir / 'config.json'}) is not one of {sorted(set(_DTYPES.values()))}"
        )
    return getattr(torch, _DTYPES[key])


def _check_layout(tp: int, pp: int, ep: int, adapter: Any, world: int) -> None:
    """One line for a layout this model cannot take (heads, KV heads, layers, experts)."""
    import torch

    from megatron_dapo import parallel

    if ep > 1 and not adapter.hf.is_moe:
        raise UserError(
            f"--ep {ep} needs a mixture-of-experts model, but {adapter.hf.architecture} has no experts; drop --ep"
        )
    try:
        parallel.validate_layout(
            world_size=world, tp=tp, pp=pp, cp=1, device=torch.device("cpu"),
            num_attention_heads=adapter.hf.num_attention_heads, num_query_groups=adapter.hf.num_kv_heads,
            num_layers=adapter.hf.num_layers, ep=ep, num_experts=adapter.hf.num_experts if adapter.hf.is_moe else None,
        )
    except ValueError as e:
        raise UserError(f"--tp {tp} --pp {pp} --ep {ep}: {e}") from None


def _processes() -> int:
    from megatron_dapo import launcher

    return launcher.launcher_ranks()[1]


def _init_layout(tp: int, pp: int, ep: int, adapter: Any, device: str) -> Any:
    """Check the layout against the launcher before any process group exists, then build it."""
    from megatron_dapo import parallel

    world = _processes()
    if world != tp * pp * ep:
        raise UserError(
            f"--tp {tp} --pp {pp} --ep {ep} needs {tp * pp * ep} processes but {world} were launched; run "
            f"`torchrun --nproc-per-node {tp * pp * ep} ...`, or one process (no torchrun), which takes any layout"
        )
    _check_layout(tp, pp, ep, adapter, world)
    parallel.init_distributed(device)
    return parallel.initialize_model_parallel(
        tp, pp, num_attention_heads=adapter.hf.num_attention_heads, num_query_groups=adapter.hf.num_kv_heads,
        num_layers=adapter.hf.num_layers, ep=ep, num_experts=adapter.hf.num_experts if adapter.hf.is_moe else None,
    )


def return_large_frees_to_the_os(threshold: int = 1 << 20) -> None:
    """glibc: allocations of at least `threshold` bytes are mmapped, so freeing one returns it to the OS.

    glibc raises its mmap threshold to the size of each mmapped block freed (up to 32 MiB), so
    after the first expert tensor a converter's thousands of 3 MB expert tensors come from the
    heap, whose freed space is kept and fragmented: the Qwen3-30B-A3B shape's peak RSS varied
    by 6% from run to run over the same work (docs/benchmarks.md). A fixed threshold turns the
    dynamic one off. No-op where the C library is not glibc.
    """
    try:
        mallopt = getattr(ctypes.CDLL("libc.so.6"), "mallopt", None)  # musl's libc.so.6 shim has none
    except OSError:
        return
    if mallopt is not None:
        m_mmap_threshold = -3  # <malloc.h>
        mallopt(m_mmap_threshold, threshold)


def peak_rss_bytes() -> int:
    """This process' peak resident set size so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def adapter_for_checkpoint(adapter: Any, manifest: dict[str, Any], tp: int) -> Any:
    """The adapter with vocab padding that reproduces the checkpoint's padded vocab at ``tp``.

    Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * tp, so a model
    saved at TP=2 may have more rows than one built at TP=1; choosing the divisor as
    saved_rows / tp makes every layout whose tp divides the saved rows allocate exactly them.
    """
    saved = int(manifest.get("model", {}).get("vocab_size", 0))
    if saved <= 0 or adapter.padded_vocab_size(tp) == saved:
        return adapter
    if saved % tp != 0 or saved < adapter.hf.vocab_size:
        raise CheckpointError(
            f"checkpoint vocab has {saved} rows, which tp={tp} cannot split evenly (HF vocab {adapter.hf.vocab_size}); "
            "use a tp that divides it"
        )
    return dataclasses.replace(adapter, make_vocab_size_divisible_by=saved // tp)


# ----------------------------------------------------------------------------- HF -> mcore


def check_out_dir(out: str | os.PathLike[str]) -> Path:
    """The converters' --out: a new or empty directory that this user can create, or one line.

    Checked before any work: an existing file, a non-empty directory, a read-only filesystem or a
    directory without write permission ended in a traceback after the model was read.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"--out {path} is a file; pass a path for a new directory")
    if path.is_dir() and any(path.iterdir()):
        raise CheckpointError(f"output directory {path} exists and is not empty; pass a new --out directory")
    # The writer makes <out>/../.tmp-<name> and renames it: the parent must take new entries.
    ancestor = path.parent if path.is_dir() else path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CheckpointError(f"--out {path} cannot be created: {ancestor} is a file; pass another --out")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if _read_only_mount(ancestor) else "no write permission for this user"
        raise CheckpointError(f"--out {path} cannot be created: {ancestor} is not writable ({why}); "
                              "pass an --out on a writable filesystem")
    return path


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def hf_to_mcore(
    hf_dir: str, out: str, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str | None = None, device: str = "cpu"
) -> Path:
    """Convert an HF checkpoint into a model-only torch_dist checkpoint; collective under torchrun.

    Args:
        hf_dir: HF directory (config.json + safetensors + tokenizer files).
        out: new output directory.
        tp: tensor-parallel size of the target layout (the result loads at any layout).
        pp: pipeline-parallel size of the target layout.
        ep: expert-parallel size of the target layout (MoE models).
        dtype: stored parameter dtype; default: the HF config's.
        device: "cpu", "cuda" or "auto" (the torchrun path; one process streams on CPU).

    Returns:
        The output directory.
    """
    hf = Path(hf_dir)
    adapter = _adapter(hf)
    torch_dtype = _hf_dtype(hf, dtype)
    check_out_dir(out)
    if _processes() == 1:
        return _hf_to_mcore_streaming(hf, Path(out), adapter, torch_dtype, tp=tp, pp=pp, ep=ep)
    dims = _init_layout(tp, pp, ep, adapter, device)
    model = adapter.build_model(dims, dtype=torch_dtype, init_weights=False)
    try:
        adapter.load_hf(model, hf, dims)
    except UserError:
        raise
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"HF checkpoint {hf}: {e}") from None
    return save_model_checkpoint(out, [model], hf_dir=hf, model_family=adapter.hf.family)


def _hf_to_mcore_streaming(hf: Path, out: Path, adapter: Any, dtype: Any, *, tp: int, pp: int, ep: int) -> Path:
    """One process: each parameter read from the shards when the writer reaches it, freed once written."""
    from megatron_dapo import parallel
    from megatron_dapo.checkpoint.streaming import streaming_save_strategy
    from megatron_dapo.models import mapping
    from megatron_dapo.models.adapter import unwrap_model
    from megatron_dapo.models.hf_checkpoint import HFCheckpoint

    _check_layout(tp, pp, ep, adapter, world=tp * pp * ep)
    ckpt = HFCheckpoint(hf, mapped=False)
    mapping.check_checkpoint(adapter.hf, ckpt)
    # The vocab padded as the target layout pads it (128 * tp), so the checkpoint equals what
    # tp * pp * ep processes would write; every layer and expert is whole at TP = EP = 1.
    written = dataclasses.replace(adapter, make_vocab_size_divisible_by=adapter.make_vocab_size_divisible_by * tp)
    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1)
    model = written.build_model(dims, dtype=dtype, init_weights=False)
    maps = {tm.mcore_name: tm for tm in written.tensor_maps(model, dims)}
    padded = written.padded_vocab_size(1)

    def fill(name: str, param: Any) -> Any:
        return mapping.load_shard(maps[name], ckpt, adapter.hf, 1, 0, padded).to(param.dtype)

    strategy = streaming_save_strategy(unwrap_model(model), fill)
    return save_model_checkpoint(out, [model], hf_dir=hf, model_family=adapter.hf.family, sharded_strategy=strategy)


# ----------------------------------------------------------------------------- mcore -> HF


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory, or the one ``latest`` names when given a checkpoints root."""
    p = Path(path)
    if p.is_dir() and not (p / "manifest.json").is_file():
        found = latest_checkpoint(p)
        if found is not None:
            return found
    read_manifest(p)
    return p


def mcore_to_hf(
    ckpt: str,
    out: str,
    *,
    hf_config_from: str | None = None,
    max_shard_size: str = "5GB",
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    device: str = "cpu",
    peft: bool = False,
    base: str | None = None,
) -> Path:
    """Export a torch_dist checkpoint (training or converted) as an HF directory; collective under torchrun.

    Args:
        ckpt: a checkpoint directory, or a checkpoints root (its ``latest`` is used).
        out: output directory (created; must be empty).
        hf_config_from: HF directory with config.json + tokenizer files; default the
            checkpoint's embedded ``hf/``.
        max_shard_size: largest safetensors shard, e.g. "5GB".
        tp: tensor-parallel size to load with under torchrun (memory per rank ~ model / (tp*pp)).
        pp: pipeline-parallel size to load with under torchrun.
        ep: expert-parallel size to load with under torchrun (MoE models).
        device: "cpu", "cuda" or "auto".
        peft: a LoRA checkpoint as PEFT's adapter directory instead of merged weights.
        base: a LoRA checkpoint's base directory; default the one its manifest names.

    Returns:
        The output directory.
    """
    max_bytes = parse_size(max_shard_size)
    path = resolve_checkpoint(ckpt)
    manifest = read_manifest(path)
    hf_src = Path(hf_config_from) if hf_config_from else hf_files_of(path)
    if hf_src is None:
        raise CheckpointError(
            f"checkpoint {path} has no embedded {HF_DIR}/config.json (saved without an HF source); "
            "pass --hf-config-from DIR with the model's config.json and tokenizer files"
        )
    adapter = _adapter(hf_src)
    saved_family = manifest.get("model_family")
    if saved_family and saved_family != adapter.hf.family:
        raise CheckpointError(
            f"checkpoint {path} holds a {saved_family!r} model but {hf_src / 'config.json'} describes a "
            f"{adapter.hf.family!r} model; pass --hf-config-from of the same family"
        )
    if peft and not manifest.get("lora"):
        raise CheckpointError(f"checkpoint {path} is a full model, not a LoRA run's adapters: drop --peft")
    out_dir = check_out_dir(out)
    dtype = _hf_dtype(hf_src, manifest.get("params_dtype"))
    if manifest.get("lora"):  # adapters only, on their base (lora/export.py)
        from megatron_dapo.lora.export import export_lora_checkpoint

        if _processes() > 1:
            raise CheckpointError(f"checkpoint {path} holds LoRA adapters, which export in one process: run "
                                  "`megatron-dapo convert mcore-to-hf` without torchrun")
        adapter, model, dims = export_lora_checkpoint(path, manifest, out_dir, dtype, peft=peft, base=base)
        return out_dir if peft else _write_export(adapter, model, dims, out_dir, hf_src, dtype, max_bytes)
    if _processes() == 1:
        _check_layout(tp, pp, ep, adapter, world=tp * pp * ep)
        return _mcore_to_hf_streaming(path, manifest, out_dir, hf_src, adapter, dtype, max_bytes)
    adapter = adapter_for_checkpoint(adapter, manifest, tp)
    dims = _init_layout(tp, pp, ep, adapter, device)
    model = adapter.build_model(dims, dtype=dtype, init_weights=False)
    CheckpointManager(path.parent).load(path, [model], model_family=adapter.hf.family, load_rng=False)
    return _write_export(adapter, model, dims, out_dir, hf_src, dtype, max_bytes)


def _write_export(adapter: Any, model: Any, dims: Any, out_dir: Path, hf_src: Path, dtype: Any, max_bytes: int
                  ) -> Path:
    """The loaded model's HF tensors into out_dir (rank 0 writes), with hf_src's config and tokenizer."""
    import torch.distributed as dist

    from megatron_dapo.models.hf_writer import StreamingShardWriter, hf_specs

    writer = None
    if dims.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer = StreamingShardWriter(out_dir, hf_specs(adapter.hf, dtype), max_bytes)
    for name, tensor in adapter.export_hf(model, dims, receivers="controller"):
        if writer is not None:
            writer.write(name, tensor)
    if writer is not None:
        writer.finish()
        copy_hf_files(hf_src, out_dir)
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def _mcore_to_hf_streaming(
    path: Path, manifest: dict[str, Any], out_dir: Path, hf_src: Path, adapter: Any, dtype: Any, max_bytes: int
) -> Path:
    """One process: the checkpoint loaded a layer at a time, each HF tensor written where its shard planned it."""
    from megatron_dapo import parallel
    from megatron_dapo.checkpoint import check_compatible
    from megatron_dapo.checkpoint.integrity import verify_checksums
    from megatron_dapo.checkpoint.streaming import load_groups
    from megatron_dapo.models import mapping
    from megatron_dapo.models.adapter import unwrap_model
    from megatron_dapo.models.hf_writer import StreamingShardWriter, hf_specs

    adapter = adapter_for_checkpoint(adapter, manifest, 1)
    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1)
    model = adapter.build_model(dims, dtype=dtype, init_weights=False)
    check_compatible(manifest, [model], str(path), adapter.hf.family)
    verify_checksums(path, manifest)
    # One group per layer, but one per expert for a layer's routed experts: a Qwen3-235B-class
    # layer holds 4.8 GB of experts, more than its embedding.
    groups: list[list[Any]] = []
    for tm in adapter.tensor_maps(model, dims):
        if tm.mirror:
            continue
        key = tm.sort_key[:3] if tm.expert is not None else tm.sort_key[:1]
        if not groups or groups[-1][0] != key:
            groups.append([key])
        groups[-1].append(tm)
    groups = [group[1:] for group in groups]
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = StreamingShardWriter(out_dir, hf_specs(adapter.hf, dtype), max_bytes)
    try:
        names = [[tm.mcore_name for tm in group] for group in groups]
        stream = load_groups(path, unwrap_model(model), names)
        for group in groups:
            # next(), not zip() or enumerate(): those keep their last result tuple, and with it
            # the previous layer, alive until the next layer has been read.
            loaded = next(stream)
            for tm in group:
                for name, tensor in zip(tm.hf_names, mapping.hf_from_shards(tm, [loaded[tm.mcore_name]], adapter.hf),
                                        strict=True):
                    writer.write(name, tensor)
            del loaded, tensor  # else they stay alive while the next group loads (two layers, not one)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    copy_hf_files(hf_src, out_dir)
    return out_dir


# ----------------------------------------------------------------------------- command line


def _add_hf_to_mcore_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf", required=True, help="HF checkpoint directory (config.json + safetensors + tokenizer)"
    )
    parser.add_argument("--out", required=True, help="new directory for the torch_dist checkpoint")
    parser.add_argument(
        "--tp", type=int, default=1,
        help="tensor-parallel size of the target layout (one process takes any; torchrun needs tp*pp*ep)",
    )
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the target layout")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of the target layout (MoE)")
    parser.add_argument(
        "--dtype", default=None, help="stored dtype (float32|bfloat16|float16); default: the HF config's"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu", help="where to run")


def _add_mcore_to_hf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt", required=True, help="checkpoint directory (step_<N> or converted), or a checkpoints root"
    )
    parser.add_argument("--out", required=True, help="new directory for the HF model")
    parser.add_argument(
        "--hf-config-from", default=None, help="HF dir with config.json + tokenizer (default: embedded)"
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 512MiB"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load with (torchrun)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load with (torchrun)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size to load with (torchrun, MoE)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu", help="where to run")
    parser.add_argument("--peft", action="store_true",
                        help="a LoRA run's checkpoint as a PEFT adapter directory (default: merged HF weights)")
    parser.add_argument("--base", default=None,
                        help="a LoRA run's base HF directory (default: the one its manifest names)")


def _run_hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_dapo import parallel

    return_large_frees_to_the_os()
    try:
        out = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                          device=args.device)
    finally:
        parallel.destroy()
    if _is_rank0():
        print(f"wrote {out} (tp={args.tp} pp={args.pp} ep={args.ep}; loads at any layout)")
        _print_memory(_weights_bytes(Path(args.hf)))
    return 0


def _weights_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _print_memory(checkpoint_bytes: int) -> None:
    """The process' peak RSS against the checkpoint's size (rank 0's, under torchrun)."""
    peak = peak_rss_bytes()
    ratio = f" = {peak / checkpoint_bytes:.2f}x" if checkpoint_bytes else ""
    print(f"peak RSS {_gib(peak)} for a {_gib(checkpoint_bytes)} checkpoint{ratio}")


def _run_mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_dapo import parallel

    return_large_frees_to_the_os()
    try:
        out = mcore_to_hf(
            args.ckpt,
            args.out,
            hf_config_from=args.hf_config_from,
            max_shard_size=args.max_shard_size,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            device=args.device,
            peft=args.peft,
            base=args.base,
        )
    finally:
        parallel.destroy()
    if _is_rank0():
        print(f"wrote {out}")
        _print_memory(_weights_bytes(Path(out)))
    return 0


def add_convert_subparser(subparsers: Any) -> None:
    """Add `convert hf-to-mcore|mcore-to-hf` to the `megatron-dapo` command's subparsers.

    Each leaf sets ``func`` (argparse.Namespace -> exit code); UserErrors propagate to the
    CLI, which prints one line and exits 2. func tears down the process groups it made.
    """
    convert = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron torch_dist")
    sub = convert.add_subparsers(dest="direction", required=True, parser_class=type(convert))
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> torch_dist model checkpoint")
    _add_hf_to_mcore_args(to_mcore)
    to_mcore.set_defaults(func=_run_hf_to_mcore)
    to_hf = sub.add_parser("mcore-to-hf", help="torch_dist checkpoint -> HF safetensors directory")
    _add_mcore_to_hf_args(to_hf)
    to_hf.set_defaults(func=_run_mcore_to_hf)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def tool_main(direction: str, argv: list[str] | None = None) -> int:
    """Entry point of tools/convert_{hf_to_mcore,mcore_to_hf}.py: exit code, one line on user errors."""
    prog = {"hf-to-mcore": "convert_hf_to_mcore", "mcore-to-hf": "convert_mcore_to_hf"}[direction]
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    if direction == "hf-to-mcore":
        _add_hf_to_mcore_args(parser)
        run = _run_hf_to_mcore
    else:
        _add_mcore_to_hf_args(parser)
        run = _run_mcore_to_hf
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as e:
        if _is_rank0():
            print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
