"""A vLLM server killed mid-generate is replaced in place (issue 31, rollout.max_engine_restarts).

The server is SIGKILLed (its whole process group) while a RolloutController's generate has
requests in flight. The controller relaunches it with the same settings and log, loads the
weights of the last sync into it, and sends the slice again: the call returns every
response, one restart is counted, and the log-probs are those of the synced weights, not of
the checkpoint the server was started from.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from importlib.util import find_spec

import pytest
import torch
from safetensors.torch import load_file
from test_vllm_engine import SHAPE, make_checkpoint, reference_log_probs

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.weight_sync import sync_weights

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm_cpu.sh)"),
]

# 256 requests of 64 tokens: still in flight 0.3 s after the first is sent.
PROMPTS = [[i % 90 + 1, 7, (3 * i) % 50 + 1] for i in range(64)]
PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=64, seed=5)


def test_server_killed_mid_generate_is_restarted_with_the_synced_weights(tmp_path):
    from megatron_dapo.rollout.vllm.engine import VLLMEngine

    started, synced = make_checkpoint(tmp_path / "a", seed=0), make_checkpoint(tmp_path / "b", seed=1)
    log = tmp_path / "vllm0.log"
    engine = VLLMEngine.launch(started, name="vllm0", log_path=log, host="127.0.0.1", device="cpu",
                               vocab_size=SHAPE["vocab_size"], startup_timeout_s=600)
    controller = RolloutController([engine], max_restarts=1)
    try:
        tensors = load_file(str(synced / "model.safetensors"))
        sync_weights(iter(sorted(tensors.items())), [controller], is_controller=True, bucket_bytes=64 * 1024)
        old_pid = engine.process.pid

        sent, answered = threading.Event(), []
        generate_one = engine._generate_one

        def counting(*args, **kwargs):
            sent.set()
            result = generate_one(*args, **kwargs)
            answered.append(engine.process.pid)
            return result

        engine._generate_one = counting  # kept by restart(): it updates the instance's attributes

        def kill() -> None:
            sent.wait(timeout=120)
            time.sleep(0.3)
            killed_after.append(sum(pid == old_pid for pid in answered))
            os.killpg(old_pid, signal.SIGKILL)

        killed_after: list[int] = []
        killer = threading.Thread(target=kill)
        killer.start()
        begin = time.monotonic()
        results = controller.generate(PROMPTS, PARAMS)
        seconds = time.monotonic() - begin
        killer.join()

        num_rows = len(PROMPTS) * PARAMS.n
        assert killed_after[0] < num_rows, "every request had finished before the kill"
        assert controller.num_restarts == 1
        assert engine.process.pid != old_pid and engine.process.returncode is None
        assert len(results) == num_rows
        assert [(r.prompt_index, r.sample_index) for r in results] == [(i, j) for i in range(64) for j in range(4)]
        assert all(len(r.output_ids) == len(r.logprobs) > 0 for r in results)
        # One log, both lives (appended): the first server's start is still in it.
        assert log.read_text(errors="replace").count("Starting vLLM server on") == 2

        diffs, stale = [], []
        for r in results[::67]:  # four rows of four prompts (each reference loads the model)
            prompt = PROMPTS[r.prompt_index]
            got = torch.tensor(r.logprobs)
            diffs.append((got - reference_log_probs(synced, prompt, r.output_ids, 1.0)).abs())
            stale.append((got - reference_log_probs(started, prompt, r.output_ids, 1.0)).abs())
        assert torch.cat(diffs).max().item() < 1e-4
        assert torch.cat(stale).mean().item() > 1e-2
        print(f"killed with {killed_after[0]} of {num_rows} rows answered; restarted and regenerated in "
              f"{seconds:.1f} s; log-prob gap to the synced weights {torch.cat(diffs).max().item():.1e}")
    finally:
        controller.shutdown()
