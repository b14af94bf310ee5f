"""The SGLang engine against SGLang's own server on CPU (sglang 0.5.18 + its CPU kernels).

Run by `.ci/run` after `make install-sglang-cpu`; skipped where no SGLang interpreter is
installed. One float32 server serves the module (start-up is ~25 s on 2 cores); two servers at
once and a kill of one are the fleet's tests (test_sglang_fleet.py). What each test holds is a rule of DESIGN.md's "SGLang's
own server, and what it dies of": each failed against the real server before the engine
was fixed (the abort test: requests sent after an abort ran to full length). Multi-turn episodes
(issue 40) run on the same server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from model_utils import TINY_SHAPE, sampled_gaps
from safetensors.torch import load_file
from sglang_venv import venv_kernel
from tiers import requires, sglang_missing

from megatron_dapo.launcher import free_port
from megatron_dapo.rollout.engine import EngineError, GenerationResult, SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.protocol import create_weight_update_group
from megatron_dapo.rollout.sglang.server import SGLangServerConfig
from megatron_dapo.rollout.streaming import CarriedPrompt, PromptFeed, stream_per_prompt

pytestmark = [
    pytest.mark.sglang_cpu,
    *requires(sglang_missing()),
]

# A context long enough that an unaborted request runs for many seconds on 2 cores.
SHAPE = {**TINY_SHAPE, "hidden_size": 128, "max_position_embeddings": 4096}
PROMPTS = [[5, 17, 42, 8], [3, 9], [60, 61, 62, 63, 64, 65]]


def make_checkpoint(directory: Path, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                         eos_token_id=None, bos_token_id=None))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return directory


def launch(checkpoint: Path, log: Path, name: str, env: dict[str, str] | None = None) -> SGLangEngine:
    config = SGLangServerConfig(model_path=str(checkpoint), device="cpu", dtype="float32", max_total_tokens=32768,
                                host="127.0.0.1", log_path=str(log), env=env or {})
    return SGLangEngine.launch(config, name=name, vocab_size=SHAPE["vocab_size"], startup_timeout_s=600)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_ckpt")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def kernel_trace(tmp_path_factory) -> Path:
    """Where the module's server writes each call of megatron-dapo's sgl_kernel stand-in, if it has it."""
    return tmp_path_factory.mktemp("sgl_kernel_trace") / "calls.txt"


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory, kernel_trace):
    engine = launch(checkpoints[0], tmp_path_factory.mktemp("sglang_log") / "sglang0.log", "sglang0",
                    env={"MEGATRON_DAPO_SGL_KERNEL_TRACE": str(kernel_trace)})
    yield engine
    engine.shutdown()


@pytest.fixture
def weights_a(engine, checkpoints):
    """The module's server holds checkpoint a (version 0) after the test."""
    yield
    engine.clear_abort()
    if engine.released:
        engine.resume_memory()
    engine.update_weights(sorted(load_file(str(checkpoints[0] / "model.safetensors")).items()))
    engine.finish_weight_update(version=0)


def gaps(checkpoint: Path, results: list[GenerationResult], temperature: float) -> torch.Tensor:
    return sampled_gaps(checkpoint, PROMPTS, results, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_are_our_contract_at_float32_level(engine, checkpoints, temperature):
    """log_softmax(logits / T) of the sampled tokens, equal to transformers' float32 values.

    Measured 2026-11-24: mean 4.8e-7 / max 1.9e-6 at T = 1, 8.9e-7 / 3.8e-6 at T = 0.7 (a
    bf16 server: 8e-3 / 3e-2, 1.4e-2 / 4.9e-2).
    """
    results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=1))
    assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(3) for j in range(2)]
    assert all(len(r.output_ids) == 12 and r.finish_reason == "length" for r in results)
    diff = gaps(checkpoints[0], results, temperature)
    assert float(diff.mean()) < 5e-6 and float(diff.max()) < 5e-5, (float(diff.mean()), float(diff.max()))


def test_sglang_runs_its_torch_paths_with_the_kernel_standin(engine, kernel_trace):
    """With megatron-dapo's sgl_kernel stand-in (the default install, docs/DESIGN.md "SGLang's CPU
    kernels") prefill and decode call no function of the kernel package: every AMX/AVX-512 op is
    gated off (AMX CPUs included) and the names imported under is_cpu() serve speculative decoding
    only. With a real kernel build installed this pins nothing (the trace is the stand-in's)."""
    if not venv_kernel()["standin"]:
        pytest.skip("this SGLang venv has a real sgl_kernel build (SGLANG_CPU_KERNEL_WHEEL)")
    kernel_trace.unlink(missing_ok=True)
    results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    assert all(len(r.output_ids) == 6 for r in results)
    assert not kernel_trace.exists(), kernel_trace.read_text()


def test_no_route_that_changes_weights_or_state_answers_without_the_key(engine):
    """Issue 42: every weight- or state-changing route refuses a request without the key, and the key
    is on no command line (it reaches SGLang through a 0600 file and --config, removed at exit)."""
    from server_exposure import command_lines_holding, owner_only, status_without_key

    for path in ("/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                 "/update_weights_from_distributed", "/destroy_weights_update_group", "/flush_cache",
                 "/pause_generation", "/continue_generation", "/abort_request", "/release_memory_occupation",
                 "/resume_memory_occupation", "/generate"):
        assert status_without_key(engine.base_url, path) == 401, path
    assert command_lines_holding(engine._api_key) == []
    assert owner_only(engine.process.log_path)
    secret = engine.process.log_path.with_name(f"{engine.process.log_path.stem}.secret.yaml")
    assert secret.exists() and owner_only(secret)


def _shm_torch_files() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("torch_")}


def test_flattened_buckets_load_the_new_weights_with_their_version(engine, checkpoints, weights_a):
    """update_weights_from_tensor with our CPU serializer (no sglang in this Python): every answer
    then carries the synced version, greedy log-probs are the new weights', and the shared-memory
    files of the payloads do not accumulate over syncs."""
    new = sorted(load_file(str(checkpoints[1] / "model.safetensors")).items())
    before = _shm_torch_files()
    for version in (1, 2, 3):
        half = len(new) // 2
        engine.update_weights(new[:half])  # two buckets, as weight_sync cuts them
        engine.update_weights(new[half:])
        engine.finish_weight_update(version=version)
    # Each payload's file goes when both processes have dropped the storage (the server's after
    # its load returns and its objects are collected): never more than the last sync's.
    deadline = time.monotonic() + 20
    while not _shm_torch_files() <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _shm_torch_files() <= before
    results = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    assert {r.weight_versions for r in results} == {(3,)}
    diff = gaps(checkpoints[1], results, 1.0)
    assert float(diff.max()) < 5e-5
    assert float(gaps(checkpoints[0], results, 1.0).max()) > 1e-2  # not the old weights


def test_distributed_update_over_gloo_then_the_group_is_destroyed(engine, checkpoints, weights_a):
    """update_weights_from_distributed where GPUs use NCCL: gloo on CPU, then both sides leave the group."""
    new = sorted(load_file(str(checkpoints[1] / "model.safetensors")).items())
    port, name = free_port("127.0.0.1"), "wu_test"
    join = threading.Thread(target=engine.init_weight_update_group, kwargs=dict(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=name, backend="gloo"))
    join.start()
    group = create_weight_update_group(master_address="127.0.0.1", master_port=port, world_size=2, group_name=name,
                                       backend="gloo", timeout_s=120)
    join.join(timeout=120)
    try:
        engine.update_weights_from_distributed(new, group=group, group_name=name)
        engine.finish_weight_update(version=5)
    finally:
        engine.destroy_weight_update_group(name)
        group.shutdown()
    results = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    assert {r.weight_versions for r in results} == {(5,)}
    assert float(gaps(checkpoints[1], results, 1.0).max()) < 5e-5


def test_a_bad_payload_is_refused_before_it_is_sent(engine, checkpoints, weights_a):
    """SGLang's loader raises on an unknown name inside the scheduler, and the server dies."""
    with pytest.raises(EngineError, match=r"names 'model.layers.9.mlp.up_proj.weight', which the served checkpoint"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(2, 2))])
    with pytest.raises(EngineError, match=r"sends 'model.norm.weight' with shape \(7,\), the served checkpoint has"):
        engine.update_weights([("model.norm.weight", torch.zeros(7))])
    assert engine.health()


def decode_lines(engine: SGLangEngine) -> int:
    """How many "Decode batch" lines the server has logged (one per 40 decode steps of its scheduler)."""
    return Path(engine.log_path).read_text(errors="replace").count("Decode batch")


def wait_decoding(engine: SGLangEngine, since: int, thread: threading.Thread) -> None:
    """Until the server logs a decode batch after its `since`-th: the request `thread` sent decodes there."""
    deadline = time.monotonic() + 120
    while decode_lines(engine) <= since:
        assert thread.is_alive() and time.monotonic() < deadline, "the server logged no decode batch"
        time.sleep(0.05)


def _long_generate(engine: SGLangEngine, out: dict, max_new_tokens: int = 3000) -> threading.Thread:
    """engine.generate of two long rows in a thread; returns once the server decodes them."""
    since = decode_lines(engine)

    def run() -> None:
        try:
            out["results"] = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=max_new_tokens, seed=3))
        except BaseException as err:
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_decoding(engine, since, thread)
    return thread


def test_the_state_guard_refuses_what_a_released_server_dies_of(engine, weights_a):
    out: dict = {}
    thread = _long_generate(engine, out)
    with pytest.raises(EngineError, match=r"release_memory while 1 generate call\(s\) run"):
        engine.release_memory()
    engine.abort()
    thread.join(timeout=60)
    assert {r.finish_reason for r in out["results"]} == {"abort"}
    engine.clear_abort()
    engine.release_memory()
    for call, what in [(lambda: engine.generate(PROMPTS, SamplingParams()), "/generate"),
                       (engine.health, "/health_generate"), (engine.release_memory, "release_memory")]:
        with pytest.raises(EngineError, match=f"{what} while its memory is released"):
            call()
    engine.resume_memory()
    with pytest.raises(EngineError, match="resume_memory without release_memory"):
        engine.resume_memory()
    assert engine.health()
    assert len(engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))) == 3


def test_abort_stops_what_runs_and_what_is_sent_after_it_until_cleared(engine, weights_a):
    """SGLang's abort reaches only what is queued or running: the next request ran to full length."""
    out: dict = {}
    thread = _long_generate(engine, out)
    engine.abort()
    thread.join(timeout=60)
    assert {r.finish_reason for r in out["results"]} == {"abort"}
    start = time.monotonic()
    after = engine.generate([[4, 5, 6]], SamplingParams(n=2, max_new_tokens=3000, seed=4))
    # Unaborted, 3000 tokens take minutes here; an aborted request's round trip under load a few seconds.
    assert time.monotonic() - start < 10.0
    assert [(r.finish_reason, r.output_ids) for r in after] == [("abort", [])] * 2
    engine.clear_abort()
    assert [r.finish_reason for r in engine.generate([[4, 5, 6]], SamplingParams(n=2, max_new_tokens=5))] == \
        ["length"] * 2


def test_a_partial_rollouts_continuations_stop_with_the_batch(engine, weights_a):
    """Streaming with a carried group: one request per cut response. Once the batch is full (the
    abort), its remaining continuations must not run: before the fix each ran to full length,
    one after the other, while every rank waited."""
    carried = tuple(GenerationResult(prompt_index=0, sample_index=j, output_ids=[7, 8], logprobs=[-1.0, -1.0],
                                     finish_reason="abort") for j in range(3))
    feed = PromptFeed(iter([CarriedPrompt(prompt=[1, 2, 3], results=carried)]))
    params = SamplingParams(n=3, max_new_tokens=3000, seed=5)
    engine.clear_abort()
    timer = threading.Timer(2.0, lambda: (feed.close(), engine.abort()))
    timer.start()
    start = time.monotonic()
    groups: list = []
    left = stream_per_prompt(engine, feed, params, groups.append, max_inflight=1)
    elapsed = time.monotonic() - start
    timer.join()
    assert groups == []
    assert elapsed < 8.0, f"continuations after the abort ran for {elapsed:.1f} s"
    assert [r.finish_reason for r in left] == ["abort"] * 3
    # The first continuation ran until the abort; the others were never sent.
    assert len(left[0].output_ids) > 2 and [r.output_ids for r in left[1:]] == [[7, 8], [7, 8]]


def test_episodes_on_sglang_are_token_exact(engine, checkpoints, weights_a):
    """Multi-turn episodes on SGLang's own server: token ids in and out across turns (issue 40), on
    the module's server (a server of their own cost CI an SGLang start)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from episode_utils import check_episode_exactness, check_streamed_episodes

    from megatron_dapo.rollout.controller import RolloutController

    engine.clear_abort()
    out = check_episode_exactness(engine.generate, checkpoints[0], vocab_size=SHAPE["vocab_size"])
    # Streaming collection's driver on the same server: the abort cuts episodes mid-turn or
    # mid-call, the partial rollout resumes them (issue 40 item 3).
    streamed = check_streamed_episodes(RolloutController([engine]), checkpoints[0], vocab_size=SHAPE["vocab_size"])
    assert out["policy_gap"] < 1e-4 and out["tool_tokens"] > 0 and out["turns_max"] >= 2, out
    assert streamed["policy_gap"] < 1e-4 and streamed["cut"] > 0, streamed


def test_a_server_that_stops_answering_mid_generate_is_abandoned_after_its_health_checks(engine, weights_a,
                                                                                          monkeypatch):
    """Issue 59: the real server's processes (HTTP front end, scheduler, detokenizer) SIGSTOPped
    while it decodes a /generate, as a wedged server or a lost node looks (connections are
    accepted, nothing answers). The call gives up after its health checks with one line naming
    the engine, the probe and the log, instead of holding the controller, and every rank, until
    request_timeout_s (an hour by default, 600 s here). SIGCONT then: the server serves the
    module's later tests. (vLLM's: tests/vllm_cpu/test_vllm_engine.py; on a fake server:
    tests/unit/test_rollout_sglang_death.py.)"""
    monkeypatch.setattr(engine, "_health_check_interval_s", 2.0)
    monkeypatch.setattr(engine, "_health_check_failures", 3)
    monkeypatch.setattr(engine, "_request_timeout_s", 600.0)
    pgid = engine.process.pid
    out: dict = {}
    thread = _long_generate(engine, out)
    try:
        os.killpg(pgid, signal.SIGSTOP)
        stopped = time.monotonic()
        thread.join(timeout=120)
        elapsed = time.monotonic() - stopped
        assert not thread.is_alive(), "generate still waits 120 s after the server stopped answering"
    finally:
        os.killpg(pgid, signal.SIGCONT)
    message = str(out.get("error"))
    assert isinstance(out.get("error"), EngineError), out
    assert message.startswith("SGLang engine sglang0: /generate abandoned after "), message
    assert f"{engine.base_url}/health_generate failed 3 times in a row meanwhile" in message, message
    assert message.endswith(f"; server log: {engine.log_path}") and "\n" not in message, message
    # 3 checks of 2 s each, 2 s apart, and the server's first answers under load: far below 600 s.
    assert elapsed < 40, elapsed
    engine.abort()  # the abandoned rows decode on after SIGCONT (weights_a clears the abort)
    assert engine.health()


def test_the_eval_commands_sglang_engine_starts_on_cpu(checkpoints, tmp_path, caplog):
    """`megatron-dapo eval --engine sglang` asked for --enable-deterministic-inference, which sglang
    0.5.18 refuses with its CPU attention (torch_native): the server exited at startup, so eval
    with SGLang failed on every CPU. It now samples unseeded there, and says so."""
    import logging

    from megatron_dapo.rollout.factory import EvalEngineArgs, eval_engine

    with caplog.at_level(logging.WARNING, logger="megatron_dapo.rollout.factory"):
        engine = eval_engine("sglang", EvalEngineArgs(hf_dir=checkpoints[0], vocab_size=SHAPE["vocab_size"],
                                                      max_batch_size=64, log_dir=tmp_path))
    try:
        results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3))
        assert [len(r.output_ids) for r in results] == [4] * 6
        assert float(gaps(checkpoints[0], results, 1.0).max()) < 1e-4
    finally:
        engine.shutdown()
    assert "samples without seeds" in caplog.text
