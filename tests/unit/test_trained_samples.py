"""Rewards reach their own responses: the trained-sample record (collect/trained.py) of real
collections, checked against a recomputation (tests/trained_samples.py).

The collections run the local engine on a tiny random model with the test reward
e2e_reward_fns.char_code_score (seven levels, a known function of each response's text): rounds,
streaming with aborts and partial carries across steps, the asynchronous loop's producer with
staleness, two engines, and tool episodes. Each batch goes through the trainer's own split
(collect.shards.split_batch) over two DP ranks before it is recorded. The check must fail on a permutation
of rewards, a mixed group and a flipped sign (injected below). The trainer's hook itself
(MEGATRON_DAPO_TRAINED_SAMPLES) is held end to end by tests/e2e/test_trainer.py's partial run and
tests/e2e/test_async.py's k2-partial run.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from test_rollout_local_engine import make_tiny_caller, make_tiny_qwen2
from trained_samples import check_trained_samples

from megatron_dapo.collect import CollectSettings, CollectState, collect_batch
from megatron_dapo.collect import batch as batch_module
from megatron_dapo.collect.producer import RolloutProducer, check_staleness
from megatron_dapo.collect.shards import split_batch
from megatron_dapo.collect.trained import trained_sample_records
from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # e2e_reward_fns
from e2e_reward_fns import char_code_score

N = 4
GROUPS = 3


class DigitsTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def score(ids: list[int], ground_truth: str) -> float:
    return char_code_score(DigitsTokenizer().decode(ids), ground_truth)["score"]


def settings(**overrides) -> CollectSettings:
    # Frequent stop tokens end responses at different steps, so a full batch cuts groups short.
    sampling = SamplingParams(n=N, temperature=1.0, max_new_tokens=24, seed=5, stop_token_ids=tuple(range(10, 90, 6)))
    values = dict(n=N, sampling=sampling, gen_batch_size=8, train_batch_size=GROUPS, filter_enable=True,
                  filter_metric="acc", max_num_gen_batches=8, max_response_length=24, overlong_enable=True,
                  overlong_len=8, overlong_penalty_factor=1.0, norm_adv_by_std=True, streaming=True,
                  partial_rollout=True, partial_max_versions=2)
    values.update(overrides)
    return CollectSettings(**values)


OVERLONG = (24, 8, 1.0)


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_qwen2(path)
    records = [PromptRecord(prompt_ids=[5 + i % 40, 6, 7 + i % 11], messages=[], prompt_text="",
                            ground_truth=str(i), data_source="t", index=i) for i in range(200)]
    rewards = RewardPool("e2e_reward_fns:char_code_score", num_workers=0, timeout_s=30.0)
    yield path, records, rewards
    rewards.close()


CLOSE = 16  # the tool call's closing token in test_tool_episodes


@pytest.fixture(scope="module")
def caller_path(tmp_path_factory):
    # 4 to 18 of the 36 responses call (sampling seeds 0-19 on a Zen 3); 0 on 5 of them without.
    return make_tiny_caller(tmp_path_factory.mktemp("tiny_qwen2_caller"), CLOSE)


def collect_steps(pieces, steps, *, num_engines=1, **overrides):
    """(records of every step, metrics of every step) of a synchronous collection."""
    path, records, rewards = pieces
    sampler = PromptSampler(records, seed=0)
    rollout = RolloutController([LocalEngine(path) for _ in range(num_engines)])
    state = CollectState()
    out, metrics = [], []
    try:
        for step in steps:
            batch, m = collect_batch(sampler, step, rollout=rollout, rewards=rewards, tokenizer=DigitsTokenizer(),
                                     settings=settings(**overrides), state=state)
            out += trained_sample_records(step, batch, split_batch(batch, 2, 2, False))
            metrics.append(m)
    finally:
        rollout.shutdown()
    return out, metrics


def check(records):
    return check_trained_samples(records, score=score, n=N, overlong=OVERLONG, num_groups=GROUPS)


def test_rounds(pieces):
    records, _ = collect_steps(pieces, [1, 2], streaming=False, partial_rollout=False)
    assert check(records) == 2 * GROUPS * N
    assert len({r["score"] for r in records}) > 2  # the rewards differ beyond a parity


def test_streaming_with_aborts_and_partial_carries_across_steps(pieces):
    records, metrics = collect_steps(pieces, range(1, 5))
    assert check(records) == 4 * GROUPS * N
    assert sum(m["rollout/carried_groups"] for m in metrics[:-1]) > 0
    # Responses continued from a carried prefix were trained and scored on their whole text.
    assert any(m["rollout/max_versions_per_response"] == 2 for m in metrics[1:])


def test_streaming_without_partial_rollouts_drops_what_the_abort_cut(pieces):
    records, metrics = collect_steps(pieces, range(1, 3), partial_rollout=False)
    assert check(records) == 2 * GROUPS * N
    assert any(m["rollout/aborted_tokens"] > 0 for m in metrics)


def test_two_engines(pieces):
    records, _ = collect_steps(pieces, range(1, 3), num_engines=2)
    assert check(records) == 2 * GROUPS * N


def test_tool_episodes(pieces, caller_path):
    from episode_utils import IdTokenizer

    from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings
    from megatron_dapo.tools.formats import CallFormat
    from megatron_dapo.tools.sandbox import ToolResult

    tok = IdTokenizer({"<c>": 2, "</c>": CLOSE, "<r>": 3, "</r>": 4}, 128)
    fmt = CallFormat("ids", "", "</c>", "<r> ", " </r>", default_tool="answer")
    runner = EpisodeRunner(EpisodeSettings(fmt=fmt, tools={"answer": lambda _a: ToolResult("21 22", "ok", 0.0)},
                                           max_turns=3, max_tool_output_tokens=6, max_response_tokens=24), tok)
    try:
        records, _ = collect_steps((caller_path, *pieces[1:]), range(1, 4), episodes=runner)
    finally:
        runner.close()
    assert check(records) == 3 * GROUPS * N
    # Tool answers are part of the scored text: responses hold the tool's tokens.
    calls = [any(r["response_ids"][i:i + 2] == [21, 22] for i in range(len(r["response_ids"]))) for r in records]
    assert sum(calls) >= 2, f"{sum(calls)} of {len(records)} responses called the tool"  # 4-18 of 36 over seeds 0-19


def test_the_asynchronous_loop_with_staleness(pieces):
    """The producer thread collects ahead of a trainer that syncs a new version after each batch."""
    path, prompts, rewards = pieces
    sampler = PromptSampler(prompts, seed=0)
    engine = LocalEngine(path)
    rollout = RolloutController([engine])
    state = CollectState()
    last, staleness = 5, 1

    started = threading.Condition()
    versions_at_start: dict[int, int] = {}

    def collect(step):
        with started:
            versions_at_start[step] = engine.weight_version
            started.notify_all()
        return collect_batch(sampler, step, rollout=rollout, rewards=rewards, tokenizer=DigitsTokenizer(),
                             settings=settings(max_staleness=staleness), state=state)

    producer = RolloutProducer(first_step=1, last_step=last, max_staleness=staleness, start_version=0,
                               collect=collect, snapshot=dict).start()
    records = []
    try:
        for step in range(1, last + 1):
            batch = producer.batch_for(step).groups
            check_staleness(batch, step, staleness)
            records += trained_sample_records(step, batch, split_batch(batch, 2, 2, False))
            # A slow trainer: the next batch starts under the old weights before this sync lands.
            with started:
                assert started.wait_for(lambda s=step: min(s + staleness, last) in versions_at_start, timeout=60)
            engine.weight_version = step  # the sync
            producer.weights_synced(step)
        producer.join(10)
    finally:
        producer.stop()
        rollout.abort()
        producer.join(10)
        rollout.shutdown()
    assert check(records) == last * GROUPS * N
    # Batches 2.. were collected a version behind the trainer (staleness 1).
    assert [versions_at_start[step] for step in range(1, last + 1)] == [0, 0, 1, 2, 3]


def _permute_rewards(monkeypatch):
    score_batch = RewardPool.score_batch

    def permuted(self, inputs):
        scored, stats = score_batch(self, inputs)
        return scored[1:] + scored[:1], stats  # each response gets the next one's reward

    monkeypatch.setattr(RewardPool, "score_batch", permuted)


def _mix_groups(monkeypatch):
    assign = batch_module.assign_advantages

    def mixed(groups, norm_by_std):
        groups[0].samples[0], groups[1].samples[0] = groups[1].samples[0], groups[0].samples[0]
        assign(groups, norm_by_std)

    monkeypatch.setattr(batch_module, "assign_advantages", mixed)


def _flip_sign(monkeypatch):
    assign = batch_module.assign_advantages

    def flipped(groups, norm_by_std):
        assign(groups, norm_by_std)
        for g in groups:
            for s in g.samples:
                s.advantage = -s.advantage

    monkeypatch.setattr(batch_module, "assign_advantages", flipped)


@pytest.mark.parametrize(("inject", "message"), [(_permute_rewards, "from its response"),
                                                 (_mix_groups, "a row of another prompt"),
                                                 (_flip_sign, "recomputed")],
                         ids=["permutation", "mixed-group", "sign-flip"])
def test_the_check_catches_each_injected_fault(pieces, monkeypatch, inject, message):
    inject(monkeypatch)
    records, _ = collect_steps(pieces, [1])
    with pytest.raises(AssertionError, match=message):
        check(records)


def test_design_names_the_hook_and_the_tier_helpers_as_the_code_does():
    import tiers

    from megatron_dapo.collect.trained import TRAINED_SAMPLES_ENV

    design = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text()
    assert f"`{TRAINED_SAMPLES_ENV}=<path>`" in design
    assert "`requires(sglang_missing())`" in design and "`tiers.unavailable(reason)`" in design
    assert all(callable(getattr(tiers, name)) for name in ("requires", "sglang_missing", "vllm_missing", "unavailable"))
