"""Streaming collection with partial rollouts: incomplete groups are carried, continued, checkpointed."""

import json
import sys
from pathlib import Path

import pytest
from test_rollout_local_engine import make_tiny_caller, make_tiny_qwen2

from megatron_dapo.collect import CollectSettings, CollectState, collect_batch
from megatron_dapo.data.datasets import PromptRecord, PromptSampler
from megatron_dapo.rewards.pool import RewardPool
from megatron_dapo.rollout.controller import RolloutController
from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # e2e_reward_fns: char_parity

N = 4


class DigitsTokenizer:
    """decode() is all the collector needs: the ids as text, so char_parity varies per response."""

    def decode(self, ids):
        return " ".join(map(str, ids))


def settings(**overrides) -> CollectSettings:
    # Frequent stop tokens end responses at different steps, so a full batch cuts groups short.
    sampling = SamplingParams(n=N, temperature=1.0, max_new_tokens=24, seed=3, stop_token_ids=tuple(range(10, 90, 6)))
    values = dict(n=N, sampling=sampling, gen_batch_size=8, train_batch_size=3, filter_enable=True,
                  filter_metric="acc", max_num_gen_batches=8, max_response_length=24, overlong_enable=False,
                  overlong_len=4, overlong_penalty_factor=1.0, norm_adv_by_std=True, streaming=True,
                  partial_rollout=True, partial_max_versions=2)
    values.update(overrides)
    return CollectSettings(**values)


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_qwen2(path)
    records = [PromptRecord(prompt_ids=[5 + i % 40, 6, 7 + i % 11], messages=[], prompt_text="", ground_truth="",
                            data_source="t", index=i) for i in range(200)]
    rewards = RewardPool("e2e_reward_fns:char_parity", num_workers=0, timeout_s=30.0)
    yield path, records, rewards
    rewards.close()


def run_steps(pieces, steps, state=None, sampler_state=None, lag=None, **overrides):
    """Collect the batches of `steps`; with `lag`, the engine holds version step - lag at each
    (the asynchronous loop's weights: lag 1 = the trainer is never behind, lag 1 + k = k behind)."""
    path, records, rewards = pieces
    sampler = PromptSampler(records, seed=0)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    engine = LocalEngine(path)
    rollout = RolloutController([engine])
    state = state if state is not None else CollectState()
    out = []
    for step in steps:
        if lag is not None:
            engine.weight_version = step - lag
        batch, metrics = collect_batch(sampler, step, rollout=rollout, rewards=rewards, tokenizer=DigitsTokenizer(),
                                       settings=settings(**overrides), state=state)
        out.append((batch, metrics, [list(c.results) for c in state.carried]))
    rollout.shutdown()
    return out, state, sampler


def test_cut_short_groups_are_carried_and_continued_from_their_tokens(pieces):
    out, _, _ = run_steps(pieces, range(1, 5))
    carried_steps = [i for i, (_, m, _) in enumerate(out) if m["rollout/carried_groups"] > 0]
    assert carried_steps, [m["rollout/carried_groups"] for _, m, _ in out]
    for batch, metrics, _ in out:
        assert len(batch) == 3 and all(len(g.samples) == N for g in batch)
        assert all(0 < sum(s.acc for s in g.samples) < N for g in batch)
        # Nothing thrown away but groups dropped at the version bound: cut short again, they are carried.
        assert (metrics["rollout/aborted_tokens"] > 0) == (metrics["rollout/partial_dropped_groups"] > 0)
        assert max(s.num_versions for g in batch for s in g.samples) <= 2
    i = carried_steps[0]
    carried = out[i][2]
    # The next step continues them first: each response starts with its carried tokens and
    # keeps the log-probs those tokens were sampled with.
    cut = [r for results in carried for r in results if r.finish_reason == "abort" and r.output_ids]
    assert cut, "a carried group has a response cut short with tokens"
    later = [s for g in out[i + 1][0] for s in g.samples if s.num_versions == 2]
    for s in later:
        match = [r for r in cut if s.response_ids[: len(r.output_ids)] == r.output_ids
                 and s.rollout_log_probs[: len(r.logprobs)] == r.logprobs]
        assert match, "a two-version response continues a carried one"
    assert later, "a carried group made it into the next step's batch"


def test_the_carry_round_trips_through_the_checkpoint_state(pieces):
    whole, _, _ = run_steps(pieces, range(1, 4))
    _, state, sampler = run_steps(pieces, range(1, 3))
    assert state.carried, "step 2 left groups to carry"
    # The trainer state is JSON in the checkpoint: the carry must survive that exactly.
    saved, sampler_saved = json.loads(json.dumps(state.state_dict(sampler))), sampler.state_dict()
    restored = CollectState()
    restored.load_state_dict(saved, PromptSampler(pieces[1], seed=0))
    assert restored.state_dict(PromptSampler(pieces[1], seed=0)) == saved
    resumed, _, _ = run_steps(pieces, [3], state=restored, sampler_state=sampler_saved)

    def same(metrics):
        return {k: v for k, v in metrics.items() if not k.startswith("timing_s/")}

    assert same(resumed[0][1]) == same(whole[2][1])
    assert [[s.response_ids for s in g.samples] for g in resumed[0][0]] == \
        [[s.response_ids for s in g.samples] for g in whole[2][0]]


def test_a_carried_group_past_the_version_bound_is_dropped_and_counted(pieces):
    out, _, _ = run_steps(pieces, range(1, 6), partial_max_versions=2)
    for _, metrics, _ in out:
        assert metrics["rollout/max_versions_per_response"] <= 2
        # Thrown away only when carried groups were dropped at the bound.
        assert (metrics["rollout/aborted_tokens"] > 0) == (metrics["rollout/partial_dropped_groups"] > 0)
    assert sum(m["rollout/partial_dropped_groups"] for _, m, _ in out) > 0  # cut short twice happens here
    wider, _, _ = run_steps(pieces, range(1, 6), partial_max_versions=5)
    assert max(m["rollout/max_versions_per_response"] for _, m, _ in wider) <= 5


def test_without_partial_rollouts_cut_short_tokens_are_counted_as_aborted(pieces):
    out, state, _ = run_steps(pieces, range(1, 3), partial_rollout=False)
    assert state.carried == []
    assert any(m["rollout/aborted_tokens"] > 0 for _, m, _ in out)


def test_episodes_are_carried_with_their_segments_and_resumed_through_the_checkpoint_state(pieces, tmp_path):
    """Issue 40 item 3: streaming collection with tools; the full batch's abort leaves episodes cut
    short, carried with their policy mask and calls (through the JSON trainer state), and the
    next step continues them: each continued sample starts with the carried ids, log-probs and mask."""
    from episode_utils import IdTokenizer

    from megatron_dapo.tools.episode import EpisodeRunner, EpisodeSettings
    from megatron_dapo.tools.formats import CallFormat
    from megatron_dapo.tools.sandbox import ToolResult

    close = 16  # one of the stop tokens: a turn ending on it is a call
    caller_path = make_tiny_caller(tmp_path / "caller", close)  # calls often, on every sampling stream
    tok = IdTokenizer({"<c>": 2, "</c>": close, "<r>": 3, "</r>": 4}, 128)
    fmt = CallFormat("ids", "", "</c>", "<r> ", " </r>", default_tool="answer")
    runner = EpisodeRunner(EpisodeSettings(fmt=fmt, tools={"answer": lambda _a: ToolResult("21 22", "ok", 0.0)},
                                           max_turns=3, max_tool_output_tokens=6, max_response_tokens=24), tok)
    try:
        out, state, sampler = run_steps((caller_path, *pieces[1:]), range(1, 7), episodes=runner)  # more steps: when cuts land is timing
        saved = json.loads(json.dumps(state.state_dict(sampler)))
        restored = CollectState()
        restored.load_state_dict(saved, PromptSampler(pieces[1], seed=0))
        assert restored.state_dict(PromptSampler(pieces[1], seed=0)) == saved
        assert [[r.episode for r in c.results] for c in restored.carried] == \
            [[r.episode for r in c.results] for c in state.carried]
    finally:
        runner.close()
    samples = [s for batch, _, _ in out for g in batch for s in g.samples]
    assert all(s.episode is not None for s in samples)
    assert any(s.episode.calls for s in samples) and any(0 in s.loss_mask for s in samples)
    cut = [r for _, _, carried in out for results in carried for r in results
           if r.finish_reason == "abort" and r.output_ids]
    assert cut, "a carried episode was cut short with tokens"
    # A continued sample starts with a carried episode's ids and the log-probs they were sampled
    # with (both: a one-token prefix alone matches other samples by chance), and keeps its mask.
    continued = [(s, r) for s in samples for r in cut if s.num_versions == 2
                 and s.response_ids[: len(r.output_ids)] == r.output_ids
                 and s.rollout_log_probs[: len(r.logprobs)] == r.logprobs]
    assert continued, "a carried episode made it into a later batch"
    for s, r in continued:
        assert list(s.episode.policy_mask[: len(r.output_ids)]) == list(r.episode.policy_mask)


@pytest.mark.parametrize("lag", [1, 2])
def test_with_a_staleness_bound_carried_responses_keep_their_versions_and_none_exceeds_it(pieces, lag):
    """Issue 41: partial rollouts in the asynchronous loop (max_staleness 1). A carried response
    keeps the versions of its earlier tokens (engines know only this step's), so the bound
    applies to its oldest token: with the trainer one version ahead (lag 1) carried groups
    continue, spanning two versions; with the collection at the bound (lag 2) the carried ones,
    a version older, are dropped before they are continued."""
    from megatron_dapo.collect.producer import check_staleness

    out, state, sampler = run_steps(pieces, range(2, 8), lag=lag, max_staleness=1)
    for step, (batch, _, _) in zip(range(2, 8), out):
        check_staleness(batch, step, 1)  # raises over the bound
        for s in (s for g in batch for s in g.samples):
            assert s.weight_versions and s.weight_versions[0] >= step - 2
            assert len(s.weight_versions) == s.num_versions or not s.response_ids
    spanning = [s for batch, _, _ in out for g in batch for s in g.samples if len(s.weight_versions) == 2]
    carried = sum(m["rollout/carried_groups"] for _, m, _ in out[:-1])
    stale = sum(m["rollout/partial_dropped_stale_groups"] for _, m, _ in out)
    assert carried > 0
    if lag == 1:
        assert spanning and stale == 0
    else:
        assert not spanning and stale > 0  # groups never started carry no version and continue
    # The versions travel through the checkpoint's trainer state with the tokens.
    saved = json.loads(json.dumps(state.state_dict(sampler)))
    restored = CollectState()
    restored.load_state_dict(saved, PromptSampler(pieces[1], seed=0))
    assert [[r.weight_versions for r in c.results] for c in restored.carried] == \
        [[r.weight_versions for r in c.results] for c in state.carried]
