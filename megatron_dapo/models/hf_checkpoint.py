"""Read a Hugging Face checkpoint directory lazily: config.json plus *.safetensors shards.

Loading a 32B model into TP x PP shards must not materialise full tensors on every rank,
so :class:`HFCheckpoint` indexes tensor names/shapes from the safetensors headers and
reads row or column ranges on demand (``safe_open(...).get_slice``). A streaming converter
opens it with ``mapped=False``: reads then go through plain file reads into fresh buffers,
so the pages of a 4 GB shard never count in the process's resident memory (safetensors
maps the file; every page a slice touches stays resident until the handle closes). Broken downloads
(missing shard, truncated file, index pointing nowhere) fail here with the file named,
instead of as a shape error deep inside a model load.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
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
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deeply
        raise UserError(f"{path} is not valid JSON ({err}); re-download or re-save the checkpoint") from None
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror or err}); check the HF checkpoint's path") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a {type(config).__name__}, not a JSON object; re-save the checkpoint")
    return config


class HFCheckpoint:
    """Tensor index over the safetensors shards of one HF checkpoint directory.

    Args:
        directory: holds config.json and either model.safetensors.index.json with its
            shards, or one or more *.safetensors files.
        mapped: read through safetensors' memory map (default); False reads with plain
            file reads (a streaming converter's bounded resident memory).
    """

    def __init__(self, directory: str | Path, *, mapped: bool = True) -> None:
        self.directory = Path(directory)
        self.mapped = mapped
        self._offsets: dict[Path, dict[str, tuple[int, int]]] = {}
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
        if not mapped:
            self._handles.clear()

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as err:
                raise UserError(
                    f"{index} is unreadable or lacks 'weight_map' ({err}); re-download it"
                ) from None
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
        self,
        name: str,
        dim: int = 0,
        start: int | None = None,
        stop: int | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read one tensor, or only the index range [start, stop) along ``dim``.

        Args:
            name: tensor name as stored (HF naming).
            dim: 0 or 1; the dimension that start/stop select on.
            start: first index; None reads from 0.
            stop: one past the last index; None reads to the end.
            out: a contiguous tensor of the slice's shape to read into (cast to its dtype);
                None allocates one.

        Returns:
            The tensor (or slice): ``out`` if given, else a new tensor in the stored dtype.
        """
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is not in HF checkpoint {self.directory}")
        assert dim in (0, 1), f"only dims 0 and 1 are sliced, got {dim}"
        try:
            if self.mapped:
                tensor_slice = self._open(self._file_of[name]).get_slice(name)
                if start is None and stop is None:
                    value = tensor_slice[:]
                else:
                    value = tensor_slice[start:stop] if dim == 0 else tensor_slice[:, start:stop]
            else:
                value = self._read_unmapped(name, dim, start, stop, out)
        except UserError:
            raise
        except Exception as err:
            raise UserError(
                f"reading {name!r} from {self._file_of[name]} failed ({err}); the file is truncated, re-download it"
            ) from err
        if out is None:
            return value
        if value is not out:
            out.copy_(value)
        return out

    def _read_unmapped(
        self, name: str, dim: int, start: int | None, stop: int | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Rows [start, stop) with one positioned read (columns: the whole tensor, then a copy)."""
        shape = self._shapes[name]
        dtype = _DTYPES[self._dtypes[name]]
        rows = shape[0] if shape else 1
        first, last = (0, rows) if dim == 1 else (start or 0, rows if stop is None else min(stop, rows))
        last = max(first, last)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        piece_shape = (last - first, *shape[1:]) if shape else ()
        direct = dim == 0 and out is not None and out.dtype == dtype and out.is_contiguous()
        buffer = out if direct else torch.empty(piece_shape, dtype=dtype)
        begin, end = self._data_range(name)
        offset = begin + first * row_bytes
        nbytes = (last - first) * row_bytes if shape else end - begin
        if nbytes:
            # A ctypes window on the buffer, not .numpy(): numpy would pin the storage
            # (not resizable), and the streaming writer frees storages by resizing them.
            view = memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")
            with open(self._file_of[name], "rb", buffering=0) as f:
                f.seek(offset)
                done = 0
                while done < nbytes:
                    got = f.readinto(view[done:nbytes])
                    if not got:
                        raise UserError(
                            f"{self._file_of[name]} ends inside tensor {name!r}; the file is truncated, re-download it"
                        )
                    done += got
        if dim == 1:
            return buffer[:, start:stop].contiguous() if (start, stop) != (None, None) else buffer
        return buffer

    def _data_range(self, name: str) -> tuple[int, int]:
        """Absolute byte range [begin, end) of a tensor's data in its file, from the safetensors header."""
        file = self._file_of[name]
        if file not in self._offsets:
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            base = 8 + header_len
            self._offsets[file] = {
                key: (base + info["data_offsets"][0], base + info["data_offsets"][1])
                for key, info in header.items()
                if key != "__metadata__"
            }
        return self._offsets[file][name]

    def close(self) -> None:
        """Drop the open safetensors handles (and the pages they keep mapped)."""
        self._handles.clear()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
