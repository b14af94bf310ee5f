"""The local engine reports the routed experts of every prompt and response token (issue 26).

Reference: transformers' own Qwen3-MoE on each whole sequence (prompt + response), its
routers' top-k ids recorded with the same hook; the engine's come from left-padded prefills
of shared prompts and one-token decode steps in a continuous batch, and from the re-prefill
of a continued partial rollout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_utils import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.local.engine import LocalEngine
from megatron_dapo.rollout.routes import HFRouteRecorder, route_dtype, routes_from_bytes, routes_to_bytes
from megatron_dapo.rollout.streaming import CarriedPrompt, PromptFeed

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [20]]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    moe = {"num_experts": 8, "mlp_only_layers": [1]}  # layers 0, 2, 3 routed
    return make_tiny_checkpoint(tmp_path_factory.mktemp("routes"), "qwen3_moe", num_layers=4, moe=moe, seed=11)


def _reference_routes(path, sequence: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
    recorder = HFRouteRecorder(model)
    with torch.no_grad():
        model(torch.tensor([sequence]))
    return recorder.take(1, len(sequence))[0].numpy()


def test_every_forwarded_token_has_the_routes_transformers_computes(moe_checkpoint):
    engine = LocalEngine(moe_checkpoint, dtype=torch.float64, max_batch_size=3)  # rows join as others leave
    results = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=9, seed=3))
    for r in results:
        prompt = PROMPTS[r.prompt_index]
        routes = r.routed_experts
        assert routes.dtype == np.uint8 and routes.shape == (len(prompt) + len(r.output_ids) - 1, 3, 2)
        expected = _reference_routes(moe_checkpoint, prompt + r.output_ids)[:-1]
        # top-k order can differ between batched and single kernels only on exact ties: compare sets.
        assert (np.sort(routes, -1) == np.sort(expected, -1)).all(), r.prompt_index


def test_a_continued_partial_rollout_has_routes_of_its_prefill_and_its_new_tokens(moe_checkpoint):
    engine = LocalEngine(moe_checkpoint, dtype=torch.float64)
    first = engine.generate([PROMPTS[2]], SamplingParams(n=2, max_new_tokens=4, seed=5))
    carried = tuple(r if r.sample_index == 0 else type(r)(
        prompt_index=0, sample_index=1, output_ids=r.output_ids, logprobs=r.logprobs, finish_reason="abort",
        routed_experts=r.routed_experts) for r in first)
    feed = PromptFeed(iter([CarriedPrompt(prompt=PROMPTS[2], results=carried)]))
    groups = []
    engine.stream(feed, SamplingParams(n=2, max_new_tokens=8, seed=6), groups.append, max_inflight=1)
    done = {r.sample_index: r for r in groups[0]}
    assert done[0].routed_experts is first[0].routed_experts  # finished before the carry: its own
    resumed = done[1]
    assert resumed.output_ids[:4] == first[1].output_ids and len(resumed.output_ids) == 8
    expected = _reference_routes(moe_checkpoint, PROMPTS[2] + resumed.output_ids)[:-1]
    assert resumed.routed_experts.shape == expected.shape
    assert (np.sort(resumed.routed_experts, -1) == np.sort(expected, -1)).all()


def test_a_dense_model_reports_no_routes(tmp_path):
    engine = LocalEngine(make_tiny_checkpoint(tmp_path, "qwen3", num_layers=2, seed=12))
    assert all(r.routed_experts is None for r in engine.generate(PROMPTS[:1], SamplingParams(n=2, max_new_tokens=3)))


def test_routes_are_compact_and_round_trip_through_json():
    assert route_dtype(8) == np.uint8 and route_dtype(256) == np.uint8 and route_dtype(257) == np.int16
    routes = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2) + 300
    again = routes_from_bytes(routes_to_bytes(routes))
    assert again.dtype == np.int16 and (again == routes).all()


def test_router_noise_changes_the_chosen_experts_only(moe_checkpoint):
    """The experiment's perturbation: some routes differ from the model's own, and transformers
    forced to the engine's routes gives the engine's log-probs (the gates are the clean ones)."""
    engine = LocalEngine(moe_checkpoint, dtype=torch.float64, router_noise_std=0.5, router_noise_seed=1)
    results = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=9, seed=3))
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    recorder = HFRouteRecorder(model)
    forced: list[np.ndarray | None] = [None]
    for layer, router in enumerate(recorder.routers):
        original = router.forward

        def forward(hidden, router=router, original=original, layer=layer):
            logits, top, indices = original(hidden)
            if forced[0] is None:
                return logits, top, indices
            indices = torch.from_numpy(forced[0][:, layer].astype(np.int64))
            chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)  # as transformers
            return logits, (chosen / chosen.sum(-1, keepdim=True)).to(logits.dtype), indices

        router.forward = forward
    differ = 0
    for r in results:
        sequence = PROMPTS[r.prompt_index] + r.output_ids
        with torch.no_grad():
            model(torch.tensor([sequence]))
        own = recorder.take(1, len(sequence))[0].numpy()[:-1]
        differ += int((np.sort(own, -1) != np.sort(r.routed_experts, -1)).any(-1).sum())
        forced[0] = np.concatenate([r.routed_experts, r.routed_experts[-1:]])  # the last token: any experts
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0]
        recorder.take(1, len(sequence))
        forced[0] = None
        logp = torch.log_softmax(logits, dim=-1)[len(PROMPTS[r.prompt_index]) - 1:-1]
        expected = logp.gather(-1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert float((expected - torch.tensor(r.logprobs, dtype=torch.float64)).abs().max()) < 1e-10
    assert differ > 10, differ
