"""Read a Hugging Face checkpoint directory lazily: config.json plus *.safetensors shards.

Loading a 32B model into TP x PP shards must not materialise full tensors on every rank,
so :class:`HFCheckpoint` indexes tensor names/shapes from the safetensors headers and
reads row or column ranges on demand (``safe_open(...).get_slice``). Broken downloads
(missing shard, truncated file, index pointing nowhere) fail here with the file named,
instead of as a shape error deep inside a model load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from megatron_dapo.errors import UserError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """Parse ``DIR/config.json``.

    Args:
        directory: HF checkpoint directory.

    Returns:
        The config as a dict.
    """
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise UserError(
            f"HF checkpoint {directory} has no {CONFIG_FILE}; pass the directory save_pretrained wrote"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}); re-download or re-save the checkpoint") from err
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a {type(config).__name__}, not a JSON object; re-save the checkpoint")
    return config


class HFCheckpoint:
    """Tensor index over the safetensors shards of one HF checkpoint directory.

    Args:
        directory: holds config.json and either model.safetensors.index.json with its
            shards, or one or more *.safetensors files.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise UserError(f"HF checkpoint directory {directory} does not exist; check the path")
        self.config = read_hf_config(self.directory)
        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        self._handles: dict[Path, Any] = {}
        for file in self._weight_files():
            handle = self._open(file)
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                info = handle.get_slice(name)
                self._file_of[name] = file
                self._shapes[name] = tuple(info.get_shape())
                self._dtypes[name] = info.get_dtype()

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise UserError(
                    f"{index} is unreadable or lacks 'weight_map' ({err}); re-download it"
                ) from err
            files = sorted({self.directory / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(
                    f"{index} lists shard files that are missing: {missing}; the download is incomplete"
                )
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in self.directory.iterdir())
            raise UserError(
                f"HF checkpoint {self.directory} has no *.safetensors files (found {found}); "
                "only safetensors is supported: re-save with save_pretrained(safe_serialization=True)"
            )
        return files

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as err:
                raise UserError(
                    f"{file} is truncated or not a safetensors file ({err}); re-download it"
                ) from err
        return self._handles[file]

    @property
    def dtypes(self) -> dict[str, str]:
        """Tensor name -> safetensors dtype name ("F32", "BF16", "I32", ...)."""
        return dict(self._dtypes)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, for every tensor in the checkpoint."""
        return dict(self._shapes)

    def read(
        self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None
    ) -> torch.Tensor:
        """Read one tensor, or only the index range [start, stop) along ``dim``.

        Args:
            name: tensor name as stored (HF naming).
            dim: 0 or 1; the dimension that start/stop select on.
            start: first index; None reads from 0.
            stop: one past the last index; None reads to the end.

        Returns:
            The tensor (or slice) in its stored dtype.
        """
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is not in HF checkpoint {self.directory}")
        tensor_slice = self._open(self._file_of[name]).get_slice(name)
        try:
            if start is None and stop is None:
                return tensor_slice[:]
            if dim == 0:
                return tensor_slice[start:stop]
            assert dim == 1, f"only dims 0 and 1 are sliced, got {dim}"
            return tensor_slice[:, start:stop]
        except Exception as err:
            raise UserError(
                f"reading {name!r} from {self._file_of[name]} failed ({err}); the file is truncated, re-download it"
            ) from err
