"""SGLang engine on CPU: exact HTTP payloads against a fake server, command line, death detection."""

import dataclasses
import importlib.util
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_dapo.config import RolloutConfig
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.engine import EngineError, GenerationResult, SamplingParams, response_seed
from megatron_dapo.rollout.server_process import ServerProcess, node_address
from megatron_dapo.rollout.sglang.engine import SGLangEngine, serializer_for
from megatron_dapo.rollout.sglang.launch import launch_node_engines
from megatron_dapo.rollout.sglang.protocol import cpu_serialize, sglang_serialize
from megatron_dapo.rollout.sglang.server import (
    SGLangServerConfig,
    build_launch_command,
    resolve_server_config,
    server_env,
    sglang_python,
    write_secret_config,
)


class FakeSGLang:
    """An HTTP server on 127.0.0.1 that records requests and replays canned answers per path."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, object]] = []  # method, path, auth, json body
        self.answers: dict[str, list[tuple[int, object]]] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a stuck client cannot hold the server

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((self.command, self.path, self.headers.get("Authorization"), body))
                queue = fake.answers.get(self.path, [(200, {"success": True})])
                status, answer = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(answer).encode() if not isinstance(answer, str) else answer.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self._deadline = threading.Timer(120, self.server.shutdown)  # stops by itself if a test hangs
        self._deadline.start()

    def close(self) -> None:
        self._deadline.cancel()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def _engine(fake: FakeSGLang, **kwargs) -> SGLangEngine:
    return SGLangEngine(fake.url, name="e1", api_key="k3y", control_timeout_s=10, request_timeout_s=10, **kwargs)


def _row(ids: list[int], logprobs: list[float], reason: str) -> dict:
    return {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": reason},
            "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, ids)],
        },
    }


def test_generate_sends_one_row_per_response_and_parses_ids_logprobs_reasons(fake):
    fake.answers["/generate"] = [
        (200, [
            _row([4, 9], [-0.5, -1.25], "stop"),
            _row([4, 4, 4], [-0.5, -0.75, -2.0], "length"),
            _row([8], [-3.0], "abort"),
            _row([], [], "abort"),
        ])
    ]  # fmt: skip
    params = SamplingParams(n=2, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=3, stop_token_ids=(9,), seed=5)
    results = _engine(fake, deterministic=True).generate([[1, 2], [3]], params, index_offset=10)
    method, path, auth, body = fake.requests[0]
    assert (method, path, auth) == ("POST", "/generate", "Bearer k3y")
    assert body["input_ids"] == [[1, 2], [1, 2], [3], [3]]
    assert body["return_logprob"] is True
    assert [re.sub(r"^e1-[0-9a-f]{12}-", "", rid) for rid in body["rid"]] == ["10-0", "10-1", "11-0", "11-1"]
    assert body["sampling_params"][3] == {
        "max_new_tokens": 3, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "n": 1, "no_stop_trim": True,
        "stop_token_ids": [9], "sampling_seed": response_seed(5, 11 * 2 + 1),
    }  # fmt: skip
    assert [(r.prompt_index, r.sample_index, r.output_ids, r.logprobs, r.finish_reason) for r in results] == [
        (10, 0, [4, 9], [-0.5, -1.25], "stop"),
        (10, 1, [4, 4, 4], [-0.5, -0.75, -2.0], "length"),
        (11, 0, [8], [-3.0], "abort"),
        (11, 1, [], [], "abort"),
    ]
    # A server without --enable-deterministic-inference gets no seeds (older 0.5.x reject the key).
    _engine(fake).generate([[1, 2], [3]], params, index_offset=10)
    assert all("sampling_seed" not in row for row in fake.requests[1][3]["sampling_params"])


def test_generate_errors_name_the_engine_and_the_problem(fake):
    fake.answers["/generate"] = [(500, "CUDA out of memory"), (200, [_row([1], [-1.0], "stop")])]
    engine = _engine(fake)
    with pytest.raises(EngineError, match=rf"SGLang engine e1: POST {fake.url}/generate failed with HTTP 500: CUDA out"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(EngineError, match="SGLang engine e1: /generate returned 1 rows, expected 2"):
        engine.generate([[1]], SamplingParams(n=2))
    bad = _row([1, 2], [-1.0, -2.0], "stop")
    bad["output_ids"] = [1]
    fake.answers["/generate"] = [(200, [bad])]
    with pytest.raises(EngineError, match="row 0 output_ids disagree with output_token_logprobs"):
        engine.generate([[1]], SamplingParams())


def test_update_weights_from_tensor_payload_and_flush_after_the_last_bucket(fake):
    seen = []

    def serializer(bucket):
        seen.append([(n, tuple(t.shape)) for n, t in bucket])
        return f"SERIALIZED{len(seen)}"

    fake.answers["/flush_cache"] = [(400, "requests running"), (200, "Cache flushed.")]
    engine = _engine(fake, tp_size=2, serializer=serializer, weight_format="tensors")
    engine.update_weights([("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(6, 4))])
    engine.finish_weight_update()
    # Serialized once per TP rank: torch counts a shared block's consumers per serialization.
    assert seen == [[("model.norm.weight", (4,)), ("lm_head.weight", (6, 4))]] * 2
    assert [r[:2] for r in fake.requests[:2]] == [("POST", "/begin_weight_update"), ("POST", "/update_weights_from_tensor")]
    assert fake.requests[1][3] == {
        "serialized_named_tensors": ["SERIALIZED1", "SERIALIZED2"], "load_format": None, "flush_cache": False,
    }  # fmt: skip
    assert [r[:2] for r in fake.requests[2:]] == [("POST", "/end_weight_update"), ("GET", "/flush_cache"),
                                                  ("GET", "/flush_cache")]
    with pytest.raises(ValueError, match=r"a bucket mixes devices \['cpu', 'meta'\]"):
        _engine(fake).update_weights([("x", torch.ones(1)), ("y", torch.ones(1, device="meta"))])


def test_a_live_update_pauses_in_place_sets_the_version_and_continues_without_a_flush(fake):
    # rollout.placement=disaggregated: a flush fails while paused rows hold the running batch.
    fake.answers["/begin_weight_update"] = [(404, "Not Found")]
    engine = _engine(fake, serializer=lambda bucket: "S", live_updates=True)
    engine.update_weights([("model.norm.weight", torch.ones(4))])
    engine.update_weights([("lm_head.weight", torch.ones(6, 4))])
    engine.finish_weight_update(version=3)
    assert [(r[1], r[3]) for r in fake.requests if r[1] != "/update_weights_from_tensor"] == [
        ("/pause_generation", {"mode": "in_place"}), ("/begin_weight_update", {}),
        ("/update_weight_version", {"new_version": "3", "abort_all_requests": False}),
        ("/continue_generation", {"torch_empty_cache": False}),
    ]  # fmt: skip
    assert sum(r[1] == "/update_weights_from_tensor" for r in fake.requests) == 2


def test_a_row_reports_the_versions_from_its_send_to_its_answer(fake):
    engine = _engine(fake)
    results = [GenerationResult(prompt_index=0, sample_index=i, output_ids=[1], logprobs=[-1.0], finish_reason="length",
                                weight_versions=(v,)) for i, v in enumerate([4, 5, 6])]
    # Sent under 4; versions 5 and 6 were set while the call ran.
    assert [r.weight_versions for r in engine._spans(results, [4, 5, 6])] == [(4,), (4, 5), (4, 5, 6)]
    with pytest.raises(EngineError, match=r"answered with weight version 6 for a request sent under version 4; "
                                          r"the trainer set only \[4, 5\]"):
        engine._spans(results, [4, 5])
    assert engine._spans(results, [None]) == results  # before the first sync nothing is tracked


def test_the_serializer_follows_the_tensors_device() -> None:
    """CUDA: SGLang's serializer (IPC handles); CPU: ours, which needs no sglang (DESIGN.md, SGLang on CPU)."""
    assert serializer_for("cuda") is sglang_serialize
    assert serializer_for("cpu") is cpu_serialize


def test_flattened_buckets_post_one_request_per_dtype_inside_one_session(fake):
    """Two buckets of bf16 + fp32 tensors: four flattened requests between one begin and one end."""
    from megatron_dapo.rollout.flat_bucket import FlatBucket, unflatten

    def serializer(flat):
        assert isinstance(flat, FlatBucket)
        return json.dumps([[n, t.tolist()] for n, t in unflatten(flat)])

    engine = _engine(fake, tp_size=2, serializer=serializer, weight_format="flattened_bucket")
    bf16 = torch.arange(6.0).reshape(2, 3).to(torch.bfloat16)
    engine.update_weights([("a", bf16), ("b", torch.ones(2)), ("c", bf16 * 2)])
    engine.update_weights([("d", torch.zeros(1))])
    engine.finish_weight_update()
    paths = [p for _, p, _, _ in fake.requests]
    assert paths == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + ["/end_weight_update", "/flush_cache"]
    bodies = [b for _, p, _, b in fake.requests if p == "/update_weights_from_tensor"]
    assert all(b["load_format"] == "flattened_bucket" and b["flush_cache"] is False for b in bodies)
    assert [[json.loads(s) for s in b["serialized_named_tensors"]] for b in bodies] == [
        [[["a", [[0, 1, 2], [3, 4, 5]]], ["c", [[0, 2, 4], [6, 8, 10]]]]] * 2,
        [[["b", [1, 1]]]] * 2,
        [[["d", [0]]]] * 2,
    ]


def test_servers_without_sessions_are_updated_without_and_a_stale_session_is_reopened(fake):
    fake.answers["/begin_weight_update"] = [(404, {"detail": "Not Found"})]
    engine = _engine(fake, serializer=lambda item: "S", weight_format="tensors")
    for _ in range(2):
        engine.update_weights([("w", torch.ones(1))])
        engine.finish_weight_update()
    # sglang < 0.5.21: asked once, then never again; no end either.
    assert [p for _, p, _, _ in fake.requests] == ["/begin_weight_update", "/update_weights_from_tensor",
                                                   "/flush_cache", "/update_weights_from_tensor", "/flush_cache"]
    fake.requests.clear()
    fake.answers["/begin_weight_update"] = [
        (400, {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"}),
        (200, {"success": True}),
    ]
    engine = _engine(fake, serializer=lambda item: "S", weight_format="tensors")
    engine.update_weights([("w", torch.ones(1))])
    assert [p for _, p, _, _ in fake.requests] == ["/begin_weight_update", "/end_weight_update",
                                                   "/begin_weight_update", "/update_weights_from_tensor"]


def test_launch_command_binds_the_node_address_with_a_key_and_memory_saver(tmp_path):
    config = SGLangServerConfig(model_path="/ckpt/qwen", tp_size=4, base_gpu_id=4, mem_fraction_static=0.55,
                                python="/venv/bin/python", log_path=str(tmp_path / "sglang_engine1.log"))
    resolved = resolve_server_config(config, "engine1")
    assert resolved.host == node_address() != "0.0.0.0"
    assert resolved.api_key != resolve_server_config(config, "engine1").api_key
    assert resolved.log_path.endswith("sglang_engine1.log")
    command = build_launch_command(resolved)
    assert command == [
        "/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/ckpt/qwen",
        "--host", resolved.host, "--port", str(resolved.port), "--nccl-port", str(resolved.nccl_port),
        "--tp-size", "4", "--mem-fraction-static", "0.55", "--dtype", "bfloat16",
        "--random-seed", "0", "--config", str(tmp_path / "sglang_engine1.secret.yaml"), "--skip-tokenizer-init",
        "--base-gpu-id", "4", "--enable-memory-saver",
    ]  # fmt: skip
    deterministic = resolve_server_config(SGLangServerConfig(model_path="/m", deterministic=True, python="/p"), "e")
    assert build_launch_command(deterministic)[-1] == "--enable-deterministic-inference"
    # sglang 0.5.18 exits at startup with deterministic inference on its CPU attention (torch_native).
    on_cpu = resolve_server_config(SGLangServerConfig(model_path="/m", deterministic=True, python="/p", device="cpu",
                                                      max_total_tokens=4096), "e")
    with pytest.raises(ValueError, match="cannot run --enable-deterministic-inference"):
        build_launch_command(on_cpu)
    with pytest.raises(ValueError, match=r"mem_fraction_static=1.0 must be in \(0, 1\)"):
        SGLangServerConfig(model_path="/m", mem_fraction_static=1.0)


def test_the_key_reaches_the_server_from_an_owner_only_file_never_the_command_line(tmp_path):
    """Issue 42: `--api-key=<hex>` was in `ps -ef` for every user of the node. The key now goes in
    <log>.secret.yaml (mode 0600), which SGLang's --config merges into its arguments as
    `--api-key <key>` tokens (sglang 0.5.18 server_args_config_parser._add_scalar_arg), so a key that
    starts with "-" (CI, 2026-11-24: argparse read it as an option) is refused, and generated keys
    never do."""
    import argparse
    import stat

    import yaml

    resolved = resolve_server_config(SGLangServerConfig(model_path="/m", python="/p",
                                                        log_path=str(tmp_path / "e.log")), "e")
    path = write_secret_config(resolved)
    assert path == tmp_path / "e.secret.yaml" and stat.S_IMODE(path.stat().st_mode) == 0o600
    command = build_launch_command(resolved)
    assert resolved.api_key not in " ".join(command)
    assert command[command.index("--config") + 1] == str(path)
    # What SGLang's merger makes of the file, parsed as its argparse would.
    tokens = [t for k, v in yaml.safe_load(path.read_text()).items() for t in (f"--{k}", str(v))]
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--api-key", type=str)
    assert parser.parse_known_args(tokens)[0].api_key == resolved.api_key
    # A relaunch's key has a file of its own: the replaced server's cleanup (once it is found
    # dead, while the fresh one still starts) removes only its own (issue 59). A file an earlier
    # run left is not reused either.
    (tmp_path / "e.secret.2.yaml").write_text("left")
    again, third = write_secret_config(resolved), write_secret_config(resolved)
    assert (again, third) == (tmp_path / "e.secret.1.yaml", tmp_path / "e.secret.3.yaml")
    assert stat.S_IMODE(third.stat().st_mode) == 0o600
    assert build_launch_command(resolved, third)[command.index("--config") + 1] == str(third)
    path.unlink()
    assert third.read_text() == f"api-key: {json.dumps(resolved.api_key)}\n"
    with pytest.raises(ValueError, match="not start with '-'"):
        SGLangServerConfig(model_path="/m", python="/p", api_key="-Xk3y")
    generated = {resolve_server_config(SGLangServerConfig(model_path="/m", python="/p"), "e").api_key
                 for _ in range(200)}
    assert len(generated) == 200 and not any(key.startswith("-") for key in generated)


def test_cpu_launch_command_has_the_cpu_flags_and_no_memory_saver():
    """sglang 0.5.18 on CPU: --enable-memory-saver stops the server (torch_memory_saver needs libcuda),
    --device cpu is required ("No accelerator ... is available"), the KV pool is given in tokens."""
    resolved = resolve_server_config(SGLangServerConfig(model_path="/m", device="cpu", max_total_tokens=4096,
                                                        python="/venv/bin/python", dtype="float32"), "e")
    command = build_launch_command(resolved)
    assert "--enable-memory-saver" not in command and "--base-gpu-id" not in command
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--attention-backend") + 1] == "torch_native"
    assert command[command.index("--max-total-tokens") + 1] == "4096"
    assert "--disable-overlap-schedule" in command
    # Every CPU server (colocated, fleet, eval) sleeps when idle instead of spinning a core.
    assert "--sleep-on-idle" in command
    assert server_env(resolved) == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", "SGLANG_USE_CPU_ENGINE": "1"}
    with pytest.raises(ValueError, match="max_total_tokens must be > 0 on a CPU"):
        SGLangServerConfig(model_path="/m", device="cpu")


def test_no_sglang_interpreter_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_DAPO_SGLANG_VENV", str(tmp_path / "none"))
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang imports in this Python: it runs the server")
    assert sglang_python() is None
    assert sglang_python(str(tmp_path / "missing" / "python")) is None
    with pytest.raises(UserError, match=r"SGLang is not installed for this machine; install SGLang: `make install-sglang-cpu`"):
        resolve_server_config(SGLangServerConfig(model_path="/m"), "e")


def test_dead_server_error_names_engine_exit_code_and_log_tail(tmp_path):
    log = tmp_path / "logs" / "dummy.log"
    script = "import sys; print('loading weights'); print('RuntimeError: CUDA error: no device', flush=True); sys.exit(3)"
    process = ServerProcess([sys.executable, "-c", script], name="dummy", log_path=log)
    engine = SGLangEngine("http://127.0.0.1:9", name="dummy", api_key="k", process=process, control_timeout_s=2)
    with pytest.raises(EngineError) as err:
        engine.wait_until_healthy(timeout_s=60, poll_s=0.1)
    message = str(err.value)
    assert f"SGLang engine dummy (pid {process.pid}) exited with code 3; log {log}, last lines:\n" in message
    assert message.endswith("loading weights\nRuntimeError: CUDA error: no device")


def test_launch_reports_a_server_that_cannot_start(tmp_path):
    # Without sglang installed the real launch path must fail fast and carry the log's reason.
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed; the GPU tier covers a real launch")
    config = SGLangServerConfig(model_path=str(tmp_path), host="127.0.0.1", log_path=str(tmp_path / "e0.log"),
                                python=sys.executable)
    with pytest.raises(EngineError, match=r"(?s)SGLang engine e0 \(pid \d+\) exited with code 1.*No module named"):
        SGLangEngine.launch(config, name="e0", startup_timeout_s=60)


def test_launch_node_engines_splits_gpus_and_stops_all_on_failure(tmp_path):
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 does not divide this node's 3 GPUs"):
        launch_node_engines(RolloutConfig(tensor_model_parallel_size=2), tmp_path, num_gpus=3)
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed; the GPU tier covers a real launch")
    config = RolloutConfig(engine="sglang", tensor_model_parallel_size=1, host="127.0.0.1")
    with pytest.raises(EngineError, match=r"SGLang engine sglang0 \(pid \d+\) exited with code 1"):
        launch_node_engines(config, tmp_path, num_gpus=2, log_dir=tmp_path / "logs", startup_timeout_s=60)
    # Both servers were started before the first wait (they load concurrently), each with its own log.
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["sglang0.log", "sglang1.log"]


def test_a_qwen3_moe_with_dense_layers_is_refused_before_sglang_starts(tmp_path):
    """SGLang 0.5.18 serves every Qwen3-MoE layer as sparse (tests/sglang_cpu/test_sglang_moe.py)."""
    from megatron_dapo.rollout.sglang.server import check_servable

    def config(**fields):
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 4,
                                                           "num_experts": 8, **fields}))
        return directory

    check_servable(config(mlp_only_layers=[], decoder_sparse_step=1))  # Qwen3-30B-A3B's shape
    check_servable(tmp_path / "missing")  # the server reports it
    with pytest.raises(UserError, match=r"dense layers \[0, 2\]"):
        check_servable(config(mlp_only_layers=[0, 2]))
    with pytest.raises(UserError, match=r"dense layers \[0, 2\]"):
        check_servable(config(decoder_sparse_step=2))  # layers 1 and 3 sparse
    # transformers 5.19's own config.json names the experts num_local_experts.
    spelled = config(mlp_only_layers=[3])
    saved = json.loads((spelled / "config.json").read_text())
    saved["num_local_experts"] = saved.pop("num_experts")
    (spelled / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"dense layers \[3\]"):
        check_servable(spelled)
    # The same rule is what `config validate` and `train` run first (preflight), per engine family.
    from megatron_dapo.rollout.factory import check_model

    with pytest.raises(UserError, match=r"rollout\.engine=sglang"):
        check_model("sglang", config(mlp_only_layers=[1]), "cpu")
    check_model("local", config(mlp_only_layers=[1]), "cpu")


def test_cpu_serializer_outlasts_a_slow_shared_memory_manager(monkeypatch) -> None:
    """torch's libshm gives torch_shm_manager 1 s to acknowledge each shared file (socket.h);
    on a busy host it misses that and the weight update failed (CI, 2026-11-26). The serializer
    tries again; any other error, or the fifth timeout, is raised."""
    import base64
    import pickle

    from megatron_dapo.rollout.sglang import protocol

    monkeypatch.setattr(protocol.time, "sleep", lambda s: None)
    calls = {"n": 0}
    failures = {"n": 2, "message": protocol.SHM_MANAGER_TIMEOUT}

    class Flaky(protocol._WirePickler):
        def dump(self, obj):
            calls["n"] += 1
            if calls["n"] <= failures["n"]:
                raise RuntimeError(failures["message"] + "\nException raised from recv at socket.h:67")
            return super().dump(obj)

    monkeypatch.setattr(protocol, "_WirePickler", Flaky)
    weight = torch.arange(6, dtype=torch.float32).view(2, 3)
    wire = protocol.cpu_serialize([("w", weight)])
    assert calls["n"] == 3
    with protocol._file_system_sharing():
        ((name, tensor),) = pickle.loads(base64.b64decode(wire))
    assert name == "w" and torch.equal(tensor, weight)

    calls["n"], failures["n"] = 0, 10
    with pytest.raises(RuntimeError, match="Shared memory manager connection has timed out"):
        protocol.cpu_serialize([("w", weight)])
    assert calls["n"] == protocol.SHM_MANAGER_ATTEMPTS
    calls["n"], failures["n"], failures["message"] = 0, 1, "something else"
    with pytest.raises(RuntimeError, match="something else"):
        protocol.cpu_serialize([("w", weight)])
    assert calls["n"] == 1


def test_a_cpu_fleet_gives_each_server_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SGLang fleet server gets its slice of the cores and one OpenMP thread per core of it:
    sglang 0.5.18 binds its threads only on AMX or arm64 CPUs and otherwise leaves torch's pool at
    every core, so two servers and the trainer ran six threads on two cores (DESIGN.md, "A CPU
    fleet's servers get cores of their own")."""
    from megatron_dapo.rollout.sglang.server import cpu_fleet_binding

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {4, 5, 6, 7, 8})
    assert [cpu_fleet_binding(i, 2) for i in range(2)] == [
        {"SGLANG_CPU_OMP_THREADS_BIND": "4,5", "OMP_NUM_THREADS": "2"},
        {"SGLANG_CPU_OMP_THREADS_BIND": "6,7", "OMP_NUM_THREADS": "2"}]
    # More servers than cores: one core each, shared round the cores (the 2-core CI: 2 servers).
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert [cpu_fleet_binding(i, 3)["SGLANG_CPU_OMP_THREADS_BIND"] for i in range(3)] == ["0", "1", "0"]
    assert {cpu_fleet_binding(i, 2)["OMP_NUM_THREADS"] for i in range(2)} == {"1"}
    assert cpu_fleet_binding(0, 1) == {"SGLANG_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a sweep running trainers side by side asks for fewer
    assert cpu_fleet_binding(0, 1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-1")  # the user's binding wins; the count stays
    assert cpu_fleet_binding(1, 2) == {"OMP_NUM_THREADS": "1"}


def test_an_overlapped_loop_leaves_the_trainer_cores_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_staleness > 0: the actor updates while the servers generate, so beside them the trainer
    keeps an equal slice (the first cores and the remainder) and sizes its ranks' pools to it; one
    server on two cores took both, and the update ran on the same two (rollout/fleet/cores.py)."""
    from megatron_dapo.rollout.fleet.cores import split_beside_trainer, trainer_threads
    from megatron_dapo.rollout.sglang.server import cpu_fleet_binding

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpu_fleet_binding(0, 1, overlapped=True) == {"SGLANG_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    assert trainer_threads(1, True, local_ranks=1) == 1
    # Synchronous: generation and update take turns, each on every core; the trainer is left alone.
    assert cpu_fleet_binding(0, 1) == {"SGLANG_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}
    assert trainer_threads(1, False, local_ranks=1) is None
    # Two servers on two cores: a core each, the trainer shares (too few cores to keep one).
    assert [cpu_fleet_binding(i, 2, overlapped=True)["SGLANG_CPU_OMP_THREADS_BIND"] for i in range(2)] == ["0", "1"]
    assert trainer_threads(2, True, local_ranks=1) is None
    # Eleven cores, two servers, two ranks: 3 + 3 for the servers, 5 for the trainer, 2 threads a rank.
    assert split_beside_trainer(2, True, range(11)) == ([5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4])
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(11)))
    assert [cpu_fleet_binding(i, 2, overlapped=True)["SGLANG_CPU_OMP_THREADS_BIND"] for i in range(2)] == \
        ["5,6,7", "8,9,10"]
    assert trainer_threads(2, True, local_ranks=2) == 2
    # A node of the fleet's own is the servers' alone, whatever the loop.
    assert cpu_fleet_binding(0, 1, (0, 1, 2, 3), overlapped=True)["SGLANG_CPU_OMP_THREADS_BIND"] == "0,1,2,3"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_trainer_keeps_its_threads_when_the_user_binds_the_servers(monkeypatch: pytest.MonkeyPatch,
                                                                      engine: str) -> None:
    """A user's own *_CPU_OMP_THREADS_BIND places the servers (it wins over our slice); the
    trainer then keeps its threads too, not a share of a split that was not made."""
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.rollout.factory import fleet_trainer_threads

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    cfg = load_config("examples/tiny_cpu.yaml", [f"rollout.engine={engine}", "rollout.placement=disaggregated",
                                                 "trainer.max_staleness=1", "algorithm.rollout_correction.rollout_is=token",
                                                 "rollout.num_engines=1"])
    assert fleet_trainer_threads(cfg, 1) == 2
    assert fleet_trainer_threads(cfg, 1, "cuda") is None  # a GPU fleet's servers take no trainer cores
    monkeypatch.setenv(f"{engine.upper()}_CPU_OMP_THREADS_BIND", "0,1")
    assert fleet_trainer_threads(cfg, 1) is None
    other = "VLLM" if engine == "sglang" else "SGLANG"
    monkeypatch.delenv(f"{engine.upper()}_CPU_OMP_THREADS_BIND")
    monkeypatch.setenv(f"{other}_CPU_OMP_THREADS_BIND", "0,1")  # the other engine's: not this fleet's
    assert fleet_trainer_threads(cfg, 1) == 2


def test_the_fleet_binding_reaches_the_server_over_the_trainers_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's environment is this process's with the engine's settings on top: a trainer's
    OMP_NUM_THREADS=2 does not undo a fleet server's one thread."""
    from megatron_dapo.rollout.server_process import server_environment
    from megatron_dapo.rollout.sglang.server import SGLangServerConfig, cpu_fleet_binding, server_env

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    config = SGLangServerConfig(model_path="m", device="cpu", max_total_tokens=1024, env=cpu_fleet_binding(1, 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = server_environment(server_env(config))
    assert (env["OMP_NUM_THREADS"], env["SGLANG_CPU_OMP_THREADS_BIND"]) == ("1", "1")


def test_a_gpu_fleet_gives_each_server_its_own_gpus_in_the_actors_dtype(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path) -> None:
    """An SGLang fleet on GPUs beside four trainer ranks of an 8-GPU node: each TP-2 server on two
    GPUs after the trainer's (--base-gpu-id 4, 6), bf16 as the actor, its memory share of whole
    GPUs, no memory saver (a fleet never hands its memory to training), no CPU binding; the
    weights then travel by NCCL from the controller's GPU (not run here: DESIGN.md, "GPU fleets")."""
    import torch

    from megatron_dapo.config import Config
    from megatron_dapo.rollout import factory
    from megatron_dapo.rollout.sglang.engine import SGLangEngine

    cfg = Config()
    cfg.rollout.engine, cfg.rollout.placement, cfg.rollout.num_engines = "sglang", "disaggregated", 2
    cfg.rollout.tensor_model_parallel_size, cfg.rollout.gpu_memory_utilization = 2, 0.85
    launched = []
    monkeypatch.setattr(SGLangEngine, "launch", classmethod(lambda cls, config, **kw: launched.append(config) or config))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    factory._sglang_training(cfg, tmp_path, None, torch.device("cuda", 0), tmp_path)
    assert sorted((c.base_gpu_id, c.tp_size, c.device, c.dtype, c.mem_fraction_static, c.releases_memory, c.env)
                  for c in launched) == [(4, 2, "cuda", "bfloat16", 0.85, False, {}), (6, 2, "cuda", "bfloat16", 0.85, False, {})]
    command = build_launch_command(resolve_server_config(launched[0], "sglang0"))
    assert "--enable-memory-saver" not in command and "--device" not in command
    assert "--disable-overlap-schedule" in command  # a live update never meets a decode step in flight
    assert command[command.index("--tp-size") + 1] == "2"
    cfg.model.dtype = "fp32"
    launched.clear()
    factory._sglang_training(cfg, tmp_path, None, torch.device("cuda", 0), tmp_path)
    assert {c.dtype for c in launched} == {"float32"}


def test_evals_gpu_server_starts_without_the_memory_saver(monkeypatch, tmp_path) -> None:
    """`megatron-dapo eval --engine sglang` on a GPU: nothing is released between rollouts, and in
    sglang 0.5.23 --enable-memory-saver turns off the post-capture KV sizing
    (arg_groups/overrides.py), so eval's server must not ask for it (issue 57, item 6)."""
    import torch

    from megatron_dapo.rollout import factory
    from megatron_dapo.rollout.sglang import engine as sglang_engine
    from megatron_dapo.rollout.sglang.server import build_launch_command

    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sglang_engine.SGLangEngine, "launch",
                        classmethod(lambda cls, config, **kwargs: seen.setdefault("config", config)))
    args = factory.EvalEngineArgs(hf_dir=tmp_path, vocab_size=100, max_batch_size=4, log_dir=tmp_path)
    factory._sglang_eval(args)
    config = seen["config"]
    assert config.device == "cuda" and config.releases_memory is False
    resolved = dataclasses.replace(config, host="127.0.0.1", port=1, nccl_port=2, api_key="k", python="python")
    assert "--enable-memory-saver" not in build_launch_command(resolved)


def test_the_replaced_server_found_dead_leaves_its_relaunchs_key_in_place(tmp_path):
    """Two fleet servers killed at once (issue 59): while the fresh server of a relaunch still
    starts, the engine's requests (or a shutdown) still meet the replaced process, which then
    removes its key's file; the fresh server died with "Config file not found: sglang1.secret.yaml".
    Here the fresh "server" reads its --config a moment after the old process was found dead."""
    resolved = resolve_server_config(SGLangServerConfig(model_path="/m", python="/p",
                                                        log_path=str(tmp_path / "sglang1.log")), "sglang1")
    first = write_secret_config(resolved)
    old = ServerProcess([sys.executable, "-c", "pass"], name="sglang1", log_path=resolved.log_path,
                        private_files=(first,))
    assert old.wait_for_exit(30) == 0  # SIGKILLed, as far as the engine can tell
    fresh_key = write_secret_config(resolved)
    reads_late = ("import os, sys, time; time.sleep(1.0); "
                  "sys.exit(0 if open(sys.argv[1]).read().startswith('api-key:') else 3)")
    fresh = ServerProcess([sys.executable, "-c", reads_late, str(fresh_key)], name="sglang1",
                          log_path=resolved.log_path, private_files=(fresh_key,))
    with pytest.raises(EngineError, match="sglang1"):
        old.check_alive()  # a request thread of the engine, during the relaunch
    assert not first.exists()
    assert fresh.wait_for_exit(30) == 0, fresh.log_tail()
    fresh.stop()
    assert not fresh_key.exists()
