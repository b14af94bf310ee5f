"""SGLang rollout engines: one HTTP server per rollout tensor-parallel group, driven over HTTP.

Written against SGLang 0.5.x (request shapes read from sgl-project/sglang v0.5.3-0.5.5:
``entrypoints/http_server.py``, ``managers/io_struct.py``, ``sampling/sampling_params.py``,
``layers/sampler.py``). The controller (global rank 0) launches one server per engine
(server.py: flags, address, API key, log file) and talks to it over HTTP with the
standard library only; sglang itself is imported lazily, and only to serialize CUDA IPC
handles. Every failure message names the engine and its log, with the log's last lines
when the server process died.

What goes over the wire (the endpoints, request bodies, answers, log-prob semantics and
the weight-update group's rendezvous) is protocol.py; this module re-exports its
public names. Weight updates, versions and the memory hand-over are weights.py
(``WeightUpdates``, which SGLangEngine inherits); the server's start, wait, restart and stop are
life.py (``ServerLife``, inherited too); restarts of a server another rank owns are restarts.py.

The client guards the calls a real server dies of (read in sglang 0.5.18 and run against
its CPU server, DESIGN.md "SGLang's own server, and what it dies of"): nothing but
resume_memory is sent while the engine is released, release is refused while this client
has requests in flight, and resume without release is refused, each with an EngineError
before anything is sent. SGLang's abort stops only what is queued or running at that
moment, so abort() here is sticky: requests this client would send after it return at
once with reason "abort", requests in flight that the server registered after the abort
are aborted by their own ids, and clear_abort() (the controller, when a generation
session starts) lets requests through again.

Weights that arrive while the engine generates (the asynchronous loop, ``live_updates``, or
any update while this client has requests in flight) pause generation in place for the
update: rows keep their KV cache, go on under the new weights, and report every version
their call saw from send to answer (DESIGN.md "The asynchronous loop").
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from megatron_dapo.rollout.engine import EngineError, GenerationResult, SamplingParams, check_prompts
from megatron_dapo.rollout.flat_bucket import (
    WeightFormat,
    WeightPayload,
)
from megatron_dapo.rollout.routes import RouteShape
from megatron_dapo.rollout.server_process import (
    ServerProcess,
    call_while_healthy,
)
from megatron_dapo.rollout.sglang.life import ServerLife
from megatron_dapo.rollout.sglang.protocol import (
    SGLANG_VERSION_READ,
    build_generate_payload,
    create_weight_update_group,
    parse_generate_response,
)
from megatron_dapo.rollout.sglang.weights import WeightUpdates, serializer_for

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.restarts import RestartChannel

__all__ = [
    "SGLANG_VERSION_READ",
    "SGLangEngine",
    "build_generate_payload",
    "create_weight_update_group",
    "parse_generate_response",
    "serializer_for",
]



class SGLangEngine(ServerLife, WeightUpdates):
    """Client of one SGLang server (optionally owning its process); implements RolloutEngine.

    Weight updates and the memory hand-over are the WeightUpdates half (weights.py).
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str,
        api_key: str,
        tp_size: int = 1,
        vocab_size: int | None = None,
        process: ServerProcess | None = None,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 300.0,
        num_retries: int = 3,
        serializer: Callable[[WeightPayload], str] | None = None,
        deterministic: bool = False,
        log_location: str = "",
        weight_format: WeightFormat | None = None,
        health_check_interval_s: float = 30.0,
        health_check_failures: int = 5,
        expected_shapes: dict[str, tuple[int, ...]] | None = None,
        live_updates: bool = False,
        routes: RouteShape | None = None,
    ) -> None:
        """Attach to a server (launched by :meth:`start`/:meth:`launch`, or already running).

        Args:
            base_url: ``http://host:port`` of the server.
            name: engine name for messages and metrics.
            api_key: the server's bearer token.
            tp_size: the server's TP size (one serialized bucket per TP rank).
            vocab_size: checks prompt ids when given.
            process: the server process when this engine launched it (death detection, shutdown).
            request_timeout_s: timeout of one /generate call.
            control_timeout_s: timeout of other calls (weights, memory, cache).
            num_retries: attempts of idempotent calls on connection errors.
            serializer: payload -> string for /update_weights_from_tensor; default by the
                tensors' device (serializer_for).
            deterministic: the server runs --enable-deterministic-inference; seeds are sent.
            log_location: where the server's log is when another process owns the server
                (named in errors; colocated engines on other nodes).
            weight_format: how :meth:`update_weights` sends a bucket; None = by device: CUDA
                flattened where the installed sglang has it (flat_bucket.default_weight_format),
                CPU always flattened (our serializer writes it; per-tensor payloads would move the
                caller's own tensors into shared memory in place).
            health_check_interval_s: while a /generate runs, /health_generate is asked this
                often (and may take this long to answer).
            health_check_failures: that many failed checks in a row abandon the /generate
                with an EngineError (5 x 30 s: no sooner than SGLang's own --watchdog-timeout,
                300 s, would kill a server stuck in one forward pass).
            expected_shapes: HF name -> shape of every tensor the server's model loads (its
                checkpoint's); a weight update naming another tensor or shape is refused before
                it is sent (SGLang's load_weights raises in the scheduler, which kills the server).
            live_updates: weights arrive while the engine generates (the asynchronous loop): every
                update pauses generation in place (/pause_generation mode "in_place") from its
                first bucket to finish_weight_update, so no forward pass sees half-loaded weights
                and rows in flight keep their KV cache; the server must run without the radix
                cache (a prompt cached under old weights would be reused under new ones).
            routes: ask for every row's routed experts, of this shape (a server launched with
                return_routes); finished results then carry them (routing replay).
        """
        if health_check_interval_s <= 0 or health_check_failures < 1:
            raise ValueError(f"SGLang engine {name}: health_check_interval_s={health_check_interval_s} must be > 0 "
                             f"and health_check_failures={health_check_failures} >= 1")
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._tp_size = tp_size
        self._vocab_size = vocab_size
        self.process = process
        self._request_timeout_s = request_timeout_s
        self._control_timeout_s = control_timeout_s
        self._num_retries = num_retries
        self._serializer = serializer
        self._deterministic = deterministic
        self._log_location = log_location
        self.weight_format: WeightFormat | None = weight_format
        self._sessions: bool | None = None  # whether the server has weight-update sessions (None: not asked yet)
        self._session_open = False
        self._health_check_interval_s = health_check_interval_s
        self._health_check_failures = health_check_failures
        self._state_lock = threading.Lock()
        self._released = False
        self._inflight: dict[int, list[str]] = {}  # generate call -> its request ids
        self._stopped = threading.Event()  # abort() came; cleared by clear_abort()
        self._stopping = threading.Event()  # shutdown() came: a relaunch in progress stops waiting
        self._abort_epoch = 0
        self._version: int | None = None  # the weight version last set on the server; None = not tracked
        self._call_versions: dict[int, list[int | None]] = {}  # generate call -> version at send, then each set
        self._live_updates = live_updates
        self._paused = False  # generation is paused in place for a weight update
        self._adapter: str | None = None  # the LoRA adapter requests name (adapters.py); None = the base
        self._expected_shapes = expected_shapes
        self.routes = routes
        self.lm_head_copy = False
        """Every update also sends the embedding as lm_head.weight (server.copies_lm_head)."""

    fed_by_ranks = False
    """Its weights come from the ranks' colocated sync (colocated.py sets it), not the controller."""

    restart_channel: RestartChannel | None = None
    """Set on the controller's engines of a colocated job: a restart is asked of the server's
    owner, which keeps the weights (restarts.py)."""

    @property
    def tp_size(self) -> int:
        """The server's TP workers (its ranks in a weight broadcast group)."""
        return self._tp_size

    # ------------------------------------------------------------------ HTTP

    def _request(
        self, method: str, path: str, payload: dict[str, Any] | None = None, *, timeout_s: float, retries: int = 1,
        exit_grace_s: float = 10.0,
    ) -> Any:
        """One HTTP call; retries connection errors (not HTTP errors) up to ``retries`` times.

        After a connection error the owned server gets ``exit_grace_s`` to exit, so a dying
        server is named as dead; 0 while it starts (a refused connection is then expected).
        """
        url = f"{self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Authorization": f"Bearer {self._api_key}", "Content-Type": "application/json"}
        last_error: Exception | None = None
        for attempt in range(retries):
            if self.process is not None:
                self.process.check_alive()
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    body = response.read()
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:2000]
                raise EngineError(
                    f"SGLang engine {self.name}: {method} {url} failed with HTTP {err.code}: {detail}{self._log_hint()}"
                ) from err
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as err:
                last_error = err
                if self.process is not None:
                    # A scheduler that died takes the server down only after SGLang's own 5 s
                    # grace: wait for the exit, so the error names the exit code and the log.
                    self.process.wait_for_exit(timeout_s=0.0 if isinstance(err, TimeoutError) else exit_grace_s)
                    self.process.check_alive()
                if attempt + 1 < retries:
                    time.sleep(min(2.0**attempt, 10.0))
                continue
            return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode(errors="replace")
        raise EngineError(
            f"SGLang engine {self.name}: {method} {url} failed after {retries} attempts "
            f"(timeout {timeout_s:.0f}s): {last_error}{self._log_hint()}"
        )

    def _log_hint(self) -> str:
        if self.process is not None:
            return f"; server log: {self.process.log_path}"
        return f"; server log: {self._log_location}" if self._log_location else ""

    # ------------------------------------------------------------------ RolloutEngine

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, index_offset: int = 0
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses per prompt in one batched /generate call.

        Args:
            prompts: token ids per prompt.
            params: sampling settings.
            index_offset: global index of prompts[0].

        Returns:
            ``len(prompts) * n`` results, prompt-major. After abort() (until clear_abort())
            every result is an empty "abort" without a request.

        Raises:
            EngineError: the engine is released, the server failed, or it answered with
                weights other than the version last synced.
        """
        check_prompts(prompts, vocab_size=self._vocab_size, engine=self.name)
        payload = build_generate_payload(
            prompts, params, index_offset=index_offset, rid_prefix=f"{self.name}-{uuid.uuid4().hex[:12]}",
            send_seed=self._deterministic, return_routes=self.routes is not None, lora_path=self._adapter)
        with self._state_lock:
            self._refuse_if_released("/generate")
            if self._stopped.is_set():
                return [GenerationResult(prompt_index=index_offset + row // params.n, sample_index=row % params.n,
                                         output_ids=[], logprobs=[], finish_reason="abort")
                        for row in range(len(payload["rid"]))]
            call = id(payload)
            self._inflight[call] = list(payload["rid"])
            self._call_versions[call] = [self._version]
            epoch = self._abort_epoch
        try:
            # Not retried: a resent batch would generate twice; a dead server is reported instead.
            # A server that stops answering must not hold the request (and every rank) for an hour.
            response = call_while_healthy(
                lambda: self._request("POST", "/generate", payload, timeout_s=self._request_timeout_s),
                health=lambda timeout_s: self._probe_health(timeout_s), interval_s=self._health_check_interval_s,
                max_failures=self._health_check_failures,
                what=f"SGLang engine {self.name}: /generate", probe=f"{self.base_url}/health_generate",
                log_hint=self._log_hint(), on_wait=self._late_abort(payload["rid"], epoch))
        finally:
            with self._state_lock:
                self._inflight.pop(call, None)
                versions = self._call_versions.pop(call)
        results = parse_generate_response(
            response, num_prompts=len(prompts), n=params.n, index_offset=index_offset, engine=self.name,
            prompt_lens=[len(p) for p in prompts], routes=self.routes,
        )
        return self._spans(results, versions)

    def _late_abort(self, rids: list[str], epoch: int) -> Callable[[], None]:
        """While a call's rows run: once an abort came after the call started, abort its rows by id.

        abort_all reaches only the rows the server had registered when it arrived; rows
        registered after it would run to their full length while the batch waits. An id the
        server does not know yet is ignored there, so the ids are sent again every second
        until the call returns.
        """
        last = [0.0]

        def on_wait() -> None:
            if self._abort_epoch == epoch or time.monotonic() - last[0] < 1.0:
                return
            last[0] = time.monotonic()
            for rid in rids:
                self._request("POST", "/abort_request", {"rid": rid}, timeout_s=self._control_timeout_s)

        return on_wait

    def _spans(self, results: list[GenerationResult], versions: list[int | None]) -> list[GenerationResult]:
        """Each row's versions, oldest first, from the one it reports and those set while its call ran.

        SGLang 0.5.18 reports one version per row, the server's when the row's answer was
        built. ``versions`` is the version at send, then every version set while the call
        was in flight: a row answering the k-th spans versions[:k+1] (rows paused in place
        keep their KV cache and go on under the new weights). A version outside that list
        came from another client.
        """
        if versions[0] is None:
            return results
        spanned: list[GenerationResult] = []
        for r in results:
            if not r.weight_versions:
                spanned.append(r)
                continue
            answered = r.weight_versions[-1]
            if answered not in versions:
                raise EngineError(f"SGLang engine {self.name}: answered with weight version {answered} for a request "
                                  f"sent under version {versions[0]}; the trainer set only {versions}{self._log_hint()}")
            spanned.append(dataclasses.replace(r, weight_versions=tuple(versions[: versions.index(answered) + 1])))
        return spanned

    @property
    def num_in_flight(self) -> int:
        """generate() calls of this client running now."""
        return len(self._inflight)

    def abort(self) -> None:
        """Abort every in-flight request (they finish with reason "abort") and every request sent
        until clear_abort() (they return at once, never sent)."""
        with self._state_lock:
            self._stopped.set()
            self._abort_epoch += 1
            if self._released:
                return  # nothing runs on a released server, and it must not be called
        self._request(
            "POST", "/abort_request", {"abort_all": True}, timeout_s=self._control_timeout_s, retries=self._num_retries
        )

    def clear_abort(self) -> None:
        """Let requests through again after abort() (a new generation session starts)."""
        self._stopped.clear()

    def health(self, *, timeout_s: float = 30.0) -> bool:
        """Whether /health_generate answers 200 within timeout_s (False on any failure but death).

        Raises:
            EngineError: the owned server process died (with its log tail), or the engine is
                released (/health_generate generates a token, which a released server dies of).
        """
        with self._state_lock:
            self._refuse_if_released("/health_generate")
        return self._probe_health(timeout_s)

