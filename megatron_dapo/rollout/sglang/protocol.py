"""The SGLang wire protocol: /generate bodies and answers, weight payloads, the NCCL rendezvous.

Pure functions of what goes over the wire, kept apart from the client (engine.py:
the HTTP calls, retries, health checks and server lifetime) so they can be read against
SGLang's own request structs and tested without a server. Written against SGLang 0.5.x
(request shapes read from sgl-project/sglang v0.5.3-0.5.5: ``entrypoints/http_server.py``,
``managers/io_struct.py``, ``sampling/sampling_params.py``, ``layers/sampler.py``); sglang
itself is imported lazily, and only to serialize CUDA IPC handles: CPU payloads are
serialized without it (:func:`cpu_serialize`), since SGLang's CPU server runs from an
environment of its own.

Endpoints used (SGLang 0.5.x):
- POST /generate: ``{"input_ids": [[...]], "sampling_params": [{...}], "return_logprob": true,
  "rid": [...]}``; answers a list of ``{"output_ids", "meta_info": {"finish_reason": {"type"},
  "output_token_logprobs": [[logprob, token_id, null], ...]}}``. Each of the n responses of
  a prompt is its own row (own rid, own seed); the radix cache shares the prompt's prefill.
- Routed experts (``return_routed_experts: true`` on a server started with
  ``--enable-return-routed-experts``, sglang 0.5.18: state_capturer/routed_experts.py,
  scheduler_components/batch_result_processor.py): a finished row's ``meta_info["routed_experts"]``
  is base64 of int32 [prompt + output - 1, num_hidden_layers, k], the logical expert ids of every
  token it forwarded (the last sampled token has none); an aborted row has none.
- POST /update_weights_from_tensor (colocated): ``serialized_named_tensors`` holds, per TP rank
  of the engine, MultiprocessingSerializer (ForkingPickler + base64) of one flat buffer per
  dtype with ``load_format: "flattened_bucket"`` (flat_bucket.py; sglang >= 0.5.1), else of
  the bucket's ``[(name, cuda_tensor)]``: CUDA IPC handles, the bytes stay on the GPU. Each
  TP rank gets its own serialization: torch counts the consumers of a shared block per
  serialization, and a worker that opens another rank's copy breaks that count.
- POST /begin_weight_update before the first bucket and /end_weight_update after the last
  (``{}``): from sglang 0.5.21 the server refuses weight updates outside such a session;
  older servers answer 404 and are updated without one.
- POST /init_weights_update_group + /update_weights_from_distributed (separate rollout GPUs):
  the trainer broadcasts each tensor over an NCCL group that includes the engine's ranks.
- POST /release_memory_occupation, /resume_memory_occupation (``{"tags": null}`` = all),
  GET /flush_cache (400 while requests run; retried), POST /abort_request ``{"abort_all": true}``,
  GET /health_generate (generates one token).

Log-probs: SGLang's default (SGLANG_RETURN_ORIGINAL_LOGPROB unset) is log(softmax(logits/T))
before top-k/top-p, the quantity engine.py specifies; the launcher pins that variable to
"false" so an inherited environment cannot change it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copyreg
import io
import pickle
import threading
import time
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

from megatron_dapo.rollout.engine import (
    FINISH_REASONS,
    EngineError,
    GenerationResult,
    SamplingParams,
    response_seed,
)
from megatron_dapo.rollout.flat_bucket import FlatBucket, WeightPayload, to_sglang_wire
from megatron_dapo.rollout.routes import RouteShape

__all__ = [
    "SGLANG_VERSION_READ",
    "build_generate_payload",
    "cpu_serialize",
    "create_weight_update_group",
    "parse_generate_response",
    "payload_text",
    "sglang_serialize",
]

SGLANG_VERSION_READ = "0.5.x (0.5.3-0.5.5)"
"""The SGLang versions whose HTTP API this module and engine.py were written against."""


def build_generate_payload(
    prompts: Sequence[Sequence[int]], params: SamplingParams, *, index_offset: int, rid_prefix: str,
    send_seed: bool = False, return_routes: bool = False, lora_path: str | None = None,
) -> dict[str, Any]:
    """The /generate body: one row per response, each with its own rid and sampling params.

    Args:
        prompts: token ids per prompt.
        params: sampling settings.
        index_offset: global index of prompts[0] (seeds use global response indices).
        rid_prefix: unique prefix of this call's request ids.
        send_seed: add a per-response ``sampling_seed`` when params.seed is set. Only servers
            started with --enable-deterministic-inference use it (SGLang >= 0.5.3), so it is
            sent only to those; seeded SGLang rollouts are otherwise not reproducible.
        return_routes: ask for each row's routed experts (a server with --enable-return-routed-experts).
        lora_path: the loaded LoRA adapter every row runs with, by its name (adapters.py); None = the base.

    Returns:
        JSON-serialisable dict for POST /generate.
    """
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "n": 1,
        # The trainer's token ids are final; SGLang must not drop the stop token from output.
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    input_ids, rids, per_row = [], [], []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            input_ids.append(list(prompt))
            rids.append(f"{rid_prefix}-{index_offset + i}-{j}")
            row = dict(sampling)
            if send_seed and params.seed is not None:
                row["sampling_seed"] = response_seed(params.seed, (index_offset + i) * params.n + j)
            per_row.append(row)
    payload = {"input_ids": input_ids, "sampling_params": per_row, "return_logprob": True, "rid": rids}
    if return_routes:
        payload["return_routed_experts"] = True  # one flag for the batch (GenerateReqInput)
    if lora_path is not None:
        payload["lora_path"] = lora_path  # one name for the batch: GenerateReqInput repeats it per row
    return payload


def parse_generate_response(
    response: list[dict[str, Any]], *, num_prompts: int, n: int, index_offset: int, engine: str,
    prompt_lens: Sequence[int] | None = None, routes: RouteShape | None = None,
) -> list[GenerationResult]:
    """Turn /generate's answer into GenerationResults (prompt-major, global indices).

    Token ids and log-probs both come from ``meta_info.output_token_logprobs``, the record
    of what was sampled, so the two lists always have equal length.

    Args:
        response: the decoded JSON list, one entry per row of the request.
        num_prompts: prompts in the request.
        n: responses per prompt.
        index_offset: global index of the first prompt.
        engine: engine name for messages.
        prompt_lens: tokens of each prompt (needed with routes).
        routes: the routes were asked for: every finished row must carry them (as ours,
            GenerationResult.routed_experts); an aborted row has none.

    Returns:
        ``num_prompts * n`` results.
    """
    if not isinstance(response, list) or len(response) != num_prompts * n:
        got = len(response) if isinstance(response, list) else type(response).__name__
        raise EngineError(f"SGLang engine {engine}: /generate returned {got} rows, expected {num_prompts * n}")
    results = []
    for row, item in enumerate(response):
        meta = item["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        if reason not in FINISH_REASONS:
            raise EngineError(f"SGLang engine {engine}: unknown finish reason {reason!r} in row {row}")
        pairs = meta.get("output_token_logprobs") or []
        output_ids = [int(tok) for _, tok, *_ in pairs]
        if "output_ids" in item and list(item["output_ids"]) != output_ids:
            raise EngineError(
                f"SGLang engine {engine}: row {row} output_ids disagree with output_token_logprobs; "
                "the server must run with --skip-tokenizer-init and no_stop_trim"
            )
        routed = None
        if routes is not None and reason != "abort":
            assert prompt_lens is not None, "routes need the prompts' lengths"
            routed = _routed_experts(meta, routes, prompt_lens[row // n] + len(output_ids) - 1, engine, row)
        results.append(
            GenerationResult(
                prompt_index=index_offset + row // n,
                sample_index=row % n,
                output_ids=output_ids,
                logprobs=[float(lp) for lp, *_ in pairs],
                finish_reason=reason,
                weight_versions=_weight_versions(meta, engine, row),
                routed_experts=routed,
            )
        )
    return results


def _routed_experts(meta: dict[str, Any], routes: RouteShape, rows: int, engine: str, row: int) -> np.ndarray:
    """A finished row's ``meta_info["routed_experts"]`` (base64 int32) as ours [rows, L_moe, k]."""
    text = meta.get("routed_experts")
    if not isinstance(text, str):
        raise EngineError(f"SGLang engine {engine}: row {row} has no routed_experts; the server must run with "
                          "--enable-return-routed-experts (SGLangServerConfig.return_routes)")
    try:
        ids = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as err:
        raise EngineError(f"SGLang engine {engine}: row {row} routed_experts is not base64 int32: {err}") from None
    try:
        return routes.ours(ids, rows, f"SGLang engine {engine}: row {row}")
    except ValueError as err:
        raise EngineError(str(err)) from None


def _weight_versions(meta: dict[str, Any], engine: str, row: int) -> tuple[int, ...]:
    """The versions a row's tokens were sampled under, from ``meta_info`` (() if the server sends none).

    SGLang 0.5.18 answers one ``weight_version`` string per row, the one the client set with
    the update (``/update_weight_version``, or "default" before any); this client only ever
    sets decimal versions, so anything else means another client changed the weights.
    """
    version = meta.get("weight_version")
    if version is None or version == "default":
        return ()
    try:
        return (int(version),)
    except ValueError:
        raise EngineError(f"SGLang engine {engine}: row {row} reports weight_version {version!r}, which this "
                          "trainer never sent; another client updated the server's weights") from None


def payload_text(serialized: str | bytes) -> str:
    """The JSON-safe string SGLang's deserializer takes, from what its serializer returned.

    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` returns base64 text, except
    in sglang 0.5.4, where it returns the base64 as bytes (json.dumps then fails on the
    payload). The server's ``deserialize`` base64-decodes a str and unpickles bytes as they
    are, so bytes are passed on as text: decoded when they are base64 already, encoded when
    they are the raw pickle.
    """
    if isinstance(serialized, str):
        return serialized
    try:
        base64.b64decode(serialized, validate=True)
        return serialized.decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        return base64.b64encode(serialized).decode("ascii")


def sglang_serialize(payload: WeightPayload) -> str:
    """SGLang's MultiprocessingSerializer of one request's payload (CUDA IPC handles for CUDA tensors).

    The handles name the GPU by UUID (SGLang's torch reduction patch, also applied by its
    servers), so they open correctly even if the server saw a different CUDA_VISIBLE_DEVICES.
    """
    try:  # GPU-only dependency; the module moved in SGLang 0.5
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.utils import MultiprocessingSerializer

    monkey_patch_torch_reductions()
    return payload_text(MultiprocessingSerializer.serialize(to_sglang_wire(payload), output_str=True))


class _SGLangFlattenedTensorMetadata:
    """Stands for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata in a pickle.

    The server unpickles it as that class (a dataclass whose fields are, in order, name,
    shape, dtype, start_idx, end_idx, numel; sglang 0.5.1-0.5.23), the only metadata class
    its SafeUnpickler allows; the trainer need not import sglang to write it.
    """


SGLANG_METADATA_GLOBAL = b"sglang.srt.weight_sync.tensor_bucket\nFlattenedTensorMetadata\n"


class _Metadata:
    __slots__ = ("args",)

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _SGLangFlattenedTensorMetadata, self.args


class _WirePickler(pickle._Pickler):  # type: ignore[misc,name-defined]
    """ForkingPickler's reductions (torch tensors as shared memory) in the pure-Python pickler,
    whose save_global can name a class this process does not import."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is _SGLangFlattenedTensorMetadata:
            self.write(pickle.GLOBAL + SGLANG_METADATA_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


_SHARING_LOCK = threading.Lock()
# torch libshm's error when torch_shm_manager has not answered within its fixed 1 s.
SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
SHM_MANAGER_ATTEMPTS = 5


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU tensors travel as named shared-memory files while this is active.

    torch's default CPU strategy (file_descriptor) passes descriptors through a socket
    whose authentication key is this process's: SGLang's scheduler, another process
    tree, fails the handshake ("AuthenticationError: digest sent was rejected") and the
    whole server dies (sglang 0.5.18 on CPU). Named files need no handshake. The files
    live as long as a process holds the storage, as with descriptors.
    """
    with _SHARING_LOCK:
        before = torch.multiprocessing.get_sharing_strategy()
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            torch.multiprocessing.set_sharing_strategy(before)


def cpu_serialize(payload: WeightPayload) -> str:
    """What SGLang's MultiprocessingSerializer writes for a payload of CPU tensors, without sglang.

    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` is ForkingPickler + base64
    (sglang srt/utils/common.py); the tensors go as shared-memory files the server maps
    (`_file_system_sharing`), the flat buffer's metadata as sglang's own class.

    Args:
        payload: a flat buffer of a bucket, or its (hf_name, full tensor) pairs, on the CPU.

    Returns:
        The base64 string one TP worker deserializes.
    """
    if isinstance(payload, FlatBucket):
        wire: Any = {"flattened_tensor": payload.tensor,
                     "metadata": [_Metadata((e.name, e.shape, e.dtype, e.start_idx, e.end_idx, e.numel))
                                  for e in payload.entries]}
    else:
        wire = list(payload)
    for attempt in range(SHM_MANAGER_ATTEMPTS):
        buffer = io.BytesIO()
        try:
            with _file_system_sharing():
                _WirePickler(buffer).dump(wire)
            break
        except RuntimeError as err:
            # torch's libshm waits 1 s (poll in socket.h) for torch_shm_manager's "OK" to each
            # shared file; a busy host misses that (CI, 2026-11-26, two test workers on 2 cores).
            # The manager is up and the late "OK" harmless: storages already shared stay shared.
            if SHM_MANAGER_TIMEOUT not in str(err) or attempt == SHM_MANAGER_ATTEMPTS - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def create_weight_update_group(
    *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "nccl",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """The trainer's side (rank 0) of the broadcast group SGLang servers join (``/init_weights_update_group``);
    the recipe both sides share is rollout/fleet/group.py. Use ``group.broadcast``."""
    from megatron_dapo.rollout.fleet.group import join_weight_group

    return join_weight_group(master_address=master_address, master_port=master_port, world_size=world_size, rank=0,
                             group_name=group_name, backend=backend, timeout_s=timeout_s)
