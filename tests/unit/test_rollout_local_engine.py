"""LocalEngine: greedy parity with transformers, log-prob definition, seeding, stops, weights."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from megatron_dapo.rollout.engine import EngineError, RolloutEngine, SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine

EOS = 3
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [20]]


def make_tiny_qwen2(path: Path, *, seed: int = 0, tie: bool = True) -> torch.nn.Module:
    """A random 2-layer Qwen2 saved as an HF checkpoint (wide init: varied tokens, not one repeated)."""
    config = Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tie, eos_token_id=EOS,
        initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def make_tiny_caller(path: Path, close: int) -> Path:
    """make_tiny_qwen2 (untied) whose output row for `close` points along its mean final hidden
    state: close near 6% per position, so a random policy ends tool calls often. On the plain
    random model the token is one of 97, and some sampling streams (CPU- and seed-dependent)
    never emit it in a few steps (CI on 2026-12-02 drew one)."""
    model = make_tiny_qwen2(path, tie=False)
    ids = torch.tensor([[5 + i % 40, 6, 7 + i % 11] + [(7 * i + 13 * j) % 97 for j in range(20)] for i in range(64)])
    with torch.no_grad():
        mean = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[close] = 2.0 * mean / mean.norm() ** 2
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    return path, make_tiny_qwen2(path)


def test_local_engine_is_a_rollout_engine(tiny):
    assert isinstance(LocalEngine(tiny[0]), RolloutEngine)


def test_greedy_matches_transformers_generate(tiny):
    path, model = tiny
    engine = LocalEngine(path)
    results = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16))
    assert [r.prompt_index for r in results] == [0, 1, 2, 3]
    for prompt, result in zip(PROMPTS, results):
        ids = torch.tensor([prompt])
        reference = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16, eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert result.output_ids == reference
        assert result.finish_reason == ("stop" if reference[-1] == EOS else "length")


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.0, -1, 1.0), (0.7, -1, 0.9), (1.3, 20, 1.0)])
def test_logprobs_equal_full_forward_log_softmax_over_temperature(tiny, temperature, top_k, top_p):
    path, model = tiny
    engine = LocalEngine(path)
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=7)
    results = engine.generate(PROMPTS, params)
    assert len(results) == 8
    scale = temperature if temperature > 0 else 1.0
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + r.output_ids])).logits[0].float()  # [T, V]
        logp = torch.log_softmax(logits / scale, dim=-1)[len(prompt) - 1 : -1]
        expected = logp.gather(-1, torch.tensor(r.output_ids).unsqueeze(-1)).squeeze(-1)
        assert (expected - torch.tensor(r.logprobs)).abs().max().item() < 1e-4


def test_seeded_sampling_is_deterministic_and_independent_of_batching(tiny):
    path, _ = tiny
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=123)
    together = LocalEngine(path).generate(PROMPTS, params)
    again = LocalEngine(path, max_batch_size=2).generate(PROMPTS, params)
    split = LocalEngine(path).generate(PROMPTS[:1], params) + LocalEngine(path).generate(
        PROMPTS[1:], params, index_offset=1
    )
    ids = [r.output_ids for r in together]
    assert ids == [r.output_ids for r in again] == [r.output_ids for r in split]
    assert [(r.prompt_index, r.sample_index) for r in split] == [(i, j) for i in range(4) for j in range(3)]
    other = LocalEngine(path).generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=124))
    assert ids != [r.output_ids for r in other]
    assert len({tuple(x) for x in ids[:3]}) > 1  # the n samples of a prompt differ


def test_stop_tokens_and_max_new_tokens(tiny):
    path, _ = tiny
    engine = LocalEngine(path)
    greedy = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6))[0]
    assert greedy.finish_reason == "length" and len(greedy.output_ids) == 6
    stop = greedy.output_ids[2]
    first_stop = greedy.output_ids.index(stop)
    stopped = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert stopped.output_ids == greedy.output_ids[: first_stop + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.logprobs == greedy.logprobs[: first_stop + 1]


def test_abort_ends_generation_with_reason_abort(tiny):
    path, _ = tiny
    engine = LocalEngine(path)
    calls = []

    def abort_on_fifth_step(module, args, output):
        calls.append(1)
        if len(calls) == 5:
            engine.abort()  # as the controller's thread would, mid-generation

    engine.model.register_forward_hook(abort_on_fifth_step)
    results = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=400, seed=0))
    assert len(calls) == 5
    for r in results:
        assert (r.finish_reason, len(r.output_ids)) == ("abort", 5) or (r.finish_reason == "stop" and r.output_ids[-1] == EOS)
    assert sum(r.finish_reason == "abort" for r in results) >= 1
    again = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=7))
    assert all(r.finish_reason != "abort" for r in again)  # a new call starts un-aborted


def test_update_weights_checks_names_shapes_and_completeness(tiny, tmp_path):
    path, model = tiny
    engine = LocalEngine(path, load_weights=False)
    with pytest.raises(EngineError, match="no weights yet"):
        engine.generate(PROMPTS, SamplingParams(temperature=0))
    with pytest.raises(ValueError, match=r"unknown tensor 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(31,\) but the model expects \(32,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(31))])
    state = model.state_dict()
    engine.update_weights([(n, t) for n, t in state.items() if n != "model.norm.weight" and n != "lm_head.weight"])
    with pytest.raises(ValueError, match=r"missed 1 parameters, e\.g\. \['model.norm.weight'\]"):
        engine.finish_weight_update()
    # The HF checkpoint omits the tied lm_head; the embedding alone completes the model.
    engine.update_weights([(n, t.to(torch.bfloat16).float()) for n, t in state.items() if n != "lm_head.weight"])
    engine.finish_weight_update()
    received = engine.model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(received[name], tensor.to(torch.bfloat16).float()), name
    reloaded = LocalEngine(path)
    reloaded.update_weights(list(engine.model.state_dict().items()))
    reloaded.finish_weight_update()
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    assert [r.output_ids for r in reloaded.generate(PROMPTS, greedy)] == [
        r.output_ids for r in engine.generate(PROMPTS, greedy)
    ]


def test_release_blocks_generation_until_resume(tiny):
    engine = LocalEngine(tiny[0])
    engine.release_memory()
    with pytest.raises(EngineError, match="after release_memory"):
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=2))
    engine.resume_memory()
    assert len(engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=2))[0].output_ids) == 2


def test_bad_inputs_name_the_value(tiny):
    engine = LocalEngine(tiny[0], name="loc7")
    with pytest.raises(ValueError, match=r"engine loc7: prompt 1 has token ids \[97\] outside \[0, 97\)"):
        engine.generate([[1], [97]], SamplingParams())
    with pytest.raises(ValueError, match="engine loc7: prompt 0 is empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LocalEngine(tiny[0] / "missing")


def test_finished_rows_leave_the_batch_without_changing_any_response(tiny):
    path, _ = tiny
    engine = LocalEngine(path)
    batch_rows: list[int] = []
    engine.model.register_forward_hook(lambda module, args, output: batch_rows.append(output.logits.shape[0]))
    # Stopping on a few frequent tokens ends responses at different steps.
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=(10, 20, 30, 40, 50))
    together = engine.generate(PROMPTS, params)
    lengths = sorted(len(r.output_ids) for r in together)
    assert lengths[0] < lengths[-1]
    # One forward per decode step of the longest response; each has exactly the unfinished
    # rows, except the first (the prefill), which runs each prompt once for its n rows.
    assert batch_rows == [len(PROMPTS)] + [sum(n > step for n in lengths) for step in range(1, lengths[-1])]
    for i in range(len(PROMPTS)):
        alone = LocalEngine(path).generate([PROMPTS[i]], params, index_offset=i)
        mates = together[4 * i : 4 * i + 4]
        assert [(r.output_ids, r.finish_reason) for r in alone] == [(r.output_ids, r.finish_reason) for r in mates]
        # fp32 matmuls of other batch shapes round differently, far below a sampling decision.
        for a, b in zip(alone, mates):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_abort_before_rows_join_returns_every_response_aborted(tiny):
    # More rows than the batch holds: an abort before the first step leaves all of them pending.
    path, _ = tiny
    engine = LocalEngine(path, max_batch_size=2)
    engine.between_steps = engine.abort
    results = engine.generate([[1, 2], [3], [4, 5, 6]], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert [(r.prompt_index, r.sample_index, r.finish_reason, r.output_ids) for r in results] == [
        (i, j, "abort", []) for i in range(3) for j in range(2)]


def test_a_weight_swap_while_rows_are_admitted_tags_them_with_the_new_version(tiny):
    # An engine process serves its pipe inside admit (the feed's take): a swap that lands there
    # must not tag the joining rows with the version before it.
    from megatron_dapo.rollout.streaming import FeedItem

    path, _ = tiny
    engine = LocalEngine(path, max_batch_size=8)

    class SwappingFeed:
        def __init__(self):
            self.items = [FeedItem(index=i, prompt=[1 + i, 2]) for i in range(2)]

        def take(self, *, block=True):
            if len(self.items) == 1:  # between the two prompts, as the pipe could deliver it
                engine.finish_weight_update(version=9)
            return self.items.pop(0) if self.items else None

    groups = []
    engine.stream(SwappingFeed(), SamplingParams(n=2, max_new_tokens=3, seed=0), groups.append, max_inflight=2)
    assert {r.weight_versions for g in groups for r in g} == {(9,)}


def test_engine_attention_reads_grouped_kv_heads_in_place_with_the_same_results(tiny):
    """rollout/local/attention.py against transformers' eager attention (which repeats the KV heads)."""
    from transformers import DynamicCache

    from megatron_dapo.rollout.local.attention import ATTENTION

    path, _ = tiny
    engine = LocalEngine(path)
    assert engine.model.config._attn_implementation == ATTENTION
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    assert eager.config.num_key_value_heads < eager.config.num_attention_heads  # grouped heads exercised
    # A left-padded prefill (a mask: transformers' sdpa would copy the KV heads), then one decode step.
    ids = torch.tensor([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = []
    with torch.no_grad():
        for model in (engine.model, eager):
            cache = DynamicCache(config=model.config)
            first = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            second = model(input_ids=torch.tensor([[14], [15]]), attention_mask=step_mask,
                           position_ids=positions[:, -1:] + 1, past_key_values=cache).logits
            outs.append((first[mask.bool()], second))
    for ours, reference in zip(outs[0], outs[1], strict=True):
        assert float((ours - reference).abs().max()) < 1e-5
