"""The life of an SGLang server an engine launches: its start, the wait until it serves, its
restart and its stop (``ServerLife``, which SGLangEngine inherits; the HTTP client and the
generate calls are engine.py, weight updates weights.py).

A start resolves what the user left unset (host, ports, key, log: server.py), spawns the server
(its key in a file of its own) and waits on /health_generate; a server that died because another
process took a port the engine picked is launched again on new ports (DESIGN.md "Ports a server
binds"). A restart relaunches from the resolved config (same port, key and log, appended).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Self

from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.routes import RouteShape
from megatron_dapo.rollout.server_process import (
    PORT_ATTEMPTS,
    ServerProcess,
    poll_until_healthy,
    server_environment,
)
from megatron_dapo.rollout.sglang.server import (
    SGLangServerConfig,
    build_launch_command,
    check_servable,
    copies_lm_head,
    resolve_server_config,
    server_env,
    write_secret_config,
)

logger = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
"""How long a stopped server gets after SIGTERM before SIGKILL. SGLang 0.5.18 answers the group's
SIGTERM with its crash path (the scheduler's exit makes the launcher send SIGQUIT and sleep 5 s for
diagnostics: 6.2-6.5 s per stop measured on 2 cores) and nothing it does on the way out is ours to
keep: ServerProcess removes its shared memory either way."""



class ServerLife:
    """Start, wait, restart and stop of the server an SGLangEngine owns (mixed into it)."""

    @classmethod
    def start(
        cls,
        config: SGLangServerConfig,
        *,
        name: str,
        vocab_size: int | None = None,
        request_timeout_s: float = 3600.0,
        live_updates: bool = False,
    ) -> Self:
        """Start a server process without waiting for it (see :meth:`wait_until_healthy`).

        Args:
            config: launch settings (unset host/ports/key/log are filled in).
            name: engine name (also names the default log file).
            vocab_size: checks prompt ids when given.
            request_timeout_s: timeout of one /generate call.
            live_updates: weights arrive while it generates (see __init__); adds
                --disable-radix-cache to the launch.

        Returns:
            An engine that owns its (still loading) server process.
        """
        check_servable(config.model_path)  # what the server would serve wrong (a UserError, exit 2)
        if live_updates and "--disable-radix-cache" not in config.extra_args:
            config = dataclasses.replace(config, extra_args=(*config.extra_args, "--disable-radix-cache"))
        resolved = resolve_server_config(config, name)
        process = _spawn(resolved, name)
        engine = cls(
            f"http://{resolved.host}:{resolved.port}",
            name=name,
            api_key=resolved.api_key,
            tp_size=resolved.tp_size,
            vocab_size=vocab_size,
            process=process,
            request_timeout_s=request_timeout_s,
            deterministic=resolved.deterministic,
            expected_shapes=served_shapes(resolved.model_path),
            live_updates=live_updates,
            routes=RouteShape.of_checkpoint(resolved.model_path) if resolved.return_routes else None,
        )
        engine.lm_head_copy = copies_lm_head(resolved.model_path)
        # What restart() launches again: the resolved config, so the same port, key and log (appended).
        engine._relaunch = dict(config=resolved, name=name, vocab_size=vocab_size, request_timeout_s=request_timeout_s,
                                live_updates=live_updates)
        engine._picked_ports = (not config.port, not config.nccl_port)
        return engine

    @classmethod
    def launch(
        cls,
        config: SGLangServerConfig,
        *,
        name: str,
        startup_timeout_s: float = 900.0,
        vocab_size: int | None = None,
        request_timeout_s: float = 3600.0,
        live_updates: bool = False,
        stop: threading.Event | None = None,
    ) -> Self:
        """Start a server and wait until /health_generate answers.

        Args:
            config: launch settings (unset host/ports/key/log are filled in).
            name: engine name (also names the default log file).
            startup_timeout_s: how long the server may take to load.
            vocab_size: checks prompt ids when given.
            request_timeout_s: timeout of one /generate call.
            live_updates: weights arrive while it generates (see __init__).
            stop: once set, the wait for the server ends and the server is stopped (relaunch:
                the engine's shutdown meanwhile).

        Returns:
            A healthy engine that owns its server process.
        """
        engine = cls.start(config, name=name, vocab_size=vocab_size, request_timeout_s=request_timeout_s,
                           live_updates=live_updates)
        try:
            engine.wait_until_healthy(timeout_s=startup_timeout_s, stop=stop)
        except BaseException:
            engine.shutdown()
            raise
        return engine


    @property
    def server_config(self) -> SGLangServerConfig:
        """The resolved launch settings of the server this engine owns (its host, ports, key, log)."""
        if getattr(self, "_relaunch", None) is None:
            raise EngineError(f"SGLang engine {self.name} at {self.base_url} does not own its server")
        return self._relaunch["config"]

    @property
    def log_path(self) -> str | None:
        """The server's log file when this engine owns the server (RestartableEngine)."""
        return str(self.process.log_path) if self.process is not None else None

    @property
    def restartable(self) -> bool:
        """Whether restart() can replace the server: its owner serves restarts (a colocated job),
        or this engine launched it and the controller feeds it."""
        if self.restart_channel is not None:
            return True
        return getattr(self, "_relaunch", None) is not None and self.process is not None and not self.fed_by_ranks

    def restart(self, *, startup_timeout_s: float = 900.0) -> None:
        """Replace a dead or hung server by a fresh one (RestartableEngine).

        In a colocated job the server's owner (a leader rank, maybe this one) does it and
        loads the weights of the last sync with their version (restarts.py); this returns
        once it serves again. Otherwise this engine relaunches the server it launched
        (:meth:`relaunch`) and the controller loads the weights of its last sync. A client
        of a server another rank owns without a restart channel, or a server fed by the
        ranks' sync, raises EngineError, and the controller reports the engine's own failure.
        """
        if self.restart_channel is not None:
            # A shutdown() meanwhile (the run ends) stops waiting for the owner's answer.
            stop = self._stopping = threading.Event()
            self.restart_channel.request(self.name, log_location=self._log_location or self.log_path or "", stop=stop)
            return
        if not self.restartable:
            owner = "another rank owns its server" if self.process is None else \
                "its weights come from the ranks' colocated sync, which the controller cannot rerun alone"
            raise EngineError(f"SGLang engine {self.name} cannot be restarted by the controller: {owner}"
                              f"{self._log_hint()}")
        self.relaunch(startup_timeout_s=startup_timeout_s)

    def relaunch(self, *, startup_timeout_s: float = 900.0) -> None:
        """Kill the server this engine launched (dead or hung) and launch it again from its resolved
        config: same port, API key and log file (appended); weights of its HF checkpoint, no version."""
        if getattr(self, "_relaunch", None) is None or self.process is None:
            raise EngineError(f"SGLang engine {self.name} did not launch its server; only its owner can relaunch it"
                              f"{self._log_hint()}")
        # From here a shutdown() (the run ends meanwhile) ends the relaunch at its next health check
        # and stops the fresh server: the exit does not wait up to startup_timeout_s for a server it
        # drops. The event is the relaunch's own, installed before the old server is stopped.
        stop = self._stopping = threading.Event()
        self.process.stop(timeout_s=STOP_GRACE_S)
        fresh = type(self).launch(**self._relaunch, startup_timeout_s=startup_timeout_s, stop=stop)
        self.__dict__.update(fresh.__dict__)
        if stop.is_set():  # shut down after the fresh server answered, before it was this engine's
            self.shutdown()
            raise EngineError(f"SGLang engine {self.name} was shut down while it restarted{self._log_hint()}")

    @property
    def exited(self) -> bool:
        """Whether the server process this engine launched has exited (False for a client)."""
        return self.process is not None and self.process.returncode is not None


    def _probe_health(self, timeout_s: float, *, starting: bool = False) -> bool:
        try:
            self._request("GET", "/health_generate", timeout_s=timeout_s, exit_grace_s=0.0 if starting else 10.0)
        except EngineError:
            if self.process is not None:
                self.process.check_alive()
            return False
        return True

    def wait_until_healthy(self, *, timeout_s: float, poll_s: float = 0.5, stop: threading.Event | None = None) -> None:
        """Poll /health_generate until it answers, the process dies, or timeout_s passes.

        A refused connection is the server still loading: the probe does not wait for an
        exit then (it waited 10 s per probe, measured 5-10 s of every start on 2 cores). A
        server that died because a port it was given was taken is launched again on new ports
        (:meth:`_respawn_on_fresh_ports`), up to PORT_ATTEMPTS launches, each waited for up to
        timeout_s (SGLang binds its HTTP port after the model loads).

        Raises:
            EngineError: the server died (log tail included) or did not come up in time.
        """

        def probe(t: float) -> bool:
            with self._state_lock:
                self._refuse_if_released("/health_generate")
            return self._probe_health(t, starting=True)

        for attempt in range(PORT_ATTEMPTS):
            try:
                poll_until_healthy(probe, timeout_s=timeout_s, poll_s=poll_s,
                                   what=f"SGLang engine {self.name} at {self.base_url}", process=self.process, stop=stop)
                return
            except EngineError:
                if attempt + 1 == PORT_ATTEMPTS or not self._respawn_on_fresh_ports():
                    raise

    def _respawn_on_fresh_ports(self) -> bool:
        """Launch again on ports picked anew when the server died because another process took a
        port this engine had picked (free when free_port chose it, bound by someone else before
        the server bound it: seen in CI beside another worker's servers). A server whose HTTP
        port the user set keeps its ports: a taken one is theirs to change. False when that is
        not what happened."""
        picked = getattr(self, "_picked_ports", (False, False))
        if self.process is None or not picked[0] or not self.process.lost_port_race():
            return False
        config = self._relaunch["config"]
        config = resolve_server_config(dataclasses.replace(
            config, port=0, nccl_port=0 if picked[1] else config.nccl_port), self.name)
        logger.warning("SGLang engine %s: port %s was taken before the server bound it; launching again on %s",
                       self.name, self.base_url.rsplit(":", 1)[-1], config.port)
        # The dead server's reaper, shared memory and key file go now: the probe that found it dead
        # did so, unless the wait timed out first (it died in the last poll).
        self.process.stop(timeout_s=STOP_GRACE_S)
        self.process = _spawn(config, self.name)
        self.base_url = f"http://{config.host}:{config.port}"
        self._relaunch["config"] = config
        return True

    def shutdown(self) -> None:
        """Stop the owned server process (no-op for an attached server); a relaunch in progress
        gives up its fresh server."""
        self._stopping.set()
        if self.process is not None:
            self.process.stop(timeout_s=STOP_GRACE_S)


def _spawn(config: SGLangServerConfig, name: str) -> ServerProcess:
    """The server process of a resolved config, its key in a file of its own."""
    # The launcher's variables are scrubbed: under torchrun the server would otherwise join
    # the trainer's agent store and hang in its own init_process_group (server_process.py).
    env = server_environment(server_env(config))
    secret = write_secret_config(config)
    return ServerProcess([*config.launcher, *build_launch_command(config, secret)], name=name, log_path=config.log_path,
                         env=env, shm_prefixes=("sglang_", "sem.mp-"), private_files=(secret,))


def served_shapes(model_path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """HF name -> shape of what a server loads from `model_path` (None when it cannot be read).

    Tied models (tie_word_embeddings) have no lm_head.weight in the file, but the trainer's
    export sends one (the embedding's copy), which SGLang's loader skips: it is allowed.
    """
    from megatron_dapo.errors import UserError
    from megatron_dapo.models.hf_checkpoint import HFCheckpoint, read_hf_config

    try:
        shapes = HFCheckpoint(model_path).shapes
        tied = bool(read_hf_config(model_path).get("tie_word_embeddings"))
    except (OSError, ValueError, UserError):  # not a readable HF directory: the server reports it at start
        return None
    if tied and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes
