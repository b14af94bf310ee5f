"""RolloutController: spreading prompts over engines gives the same results as one engine."""

import threading

import pytest
from model_utils import make_tiny_checkpoint

from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import EngineError, SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12], [13, 14, 15]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ctrl"), num_layers=2, seed=3)


def test_results_in_prompt_order_independent_of_engine_count(checkpoint):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=8, seed=11)
    single = RolloutController([LocalEngine(checkpoint, name="e0")])
    multi = RolloutController([LocalEngine(checkpoint, name=f"e{i}") for i in range(4)])
    one = single.generate(PROMPTS, params)
    four = multi.generate(PROMPTS, params)
    assert [(r.prompt_index, r.sample_index) for r in four] == [(i, j) for i in range(6) for j in range(2)]
    assert [r.output_ids for r in four] == [r.output_ids for r in one]
    # Same tokens; log-probs agree to fp32 rounding (a different batch means different padding).
    for a, b in zip(four, one):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    stats = multi.last_throughput
    assert [(s.engine, s.num_prompts) for s in stats] == [("e0", 2), ("e1", 2), ("e2", 1), ("e3", 1)]
    assert sum(s.num_tokens for s in stats) == sum(len(r.output_ids) for r in four)
    assert all(s.tokens_per_s > 0 for s in stats)
    single.shutdown()
    multi.shutdown()


class FailingEngine:
    """Raises from generate once the other engine has started, like a server that died."""

    def __init__(self, started: threading.Event) -> None:
        self.name = "bad"
        self._started = started

    def generate(self, prompts, params, *, index_offset=0):
        self._started.wait(timeout=30)
        raise EngineError("SGLang engine bad exited with code 1")

    def abort(self):
        pass

    def clear_abort(self):
        pass


def test_a_failing_engine_aborts_the_others_at_once_and_raises(checkpoint):
    good = LocalEngine(checkpoint, name="good")
    started = threading.Event()
    steps = []

    def count_steps(*args):
        steps.append(1)
        started.set()

    good.model.register_forward_hook(count_steps)
    # The good engine comes first: the controller must not wait for it to finish 400 steps.
    controller = RolloutController([good, FailingEngine(started)])
    with pytest.raises(EngineError, match="engine bad exited with code 1"):
        controller.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=400, seed=0))
    assert 1 <= len(steps) < 200
    with pytest.raises(ValueError, match="needs at least one engine"):
        RolloutController([])
