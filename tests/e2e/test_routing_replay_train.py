"""Rollout routing replay (R3) through the whole trainer: one process, TP=2 and PP=2 under torchrun,
with full activation recompute (the recomputed forward replays too), and with partial rollouts (issue 26's acceptance, on the e2e tiny config with a Qwen3-MoE).

Every step's forward must use exactly the engine's routes (`moe/replay_route_mismatch` 0, on every
rank's share, summed by the trainer), while the same step also measures how often free routing
would have chosen otherwise (`moe/router_disagreement`, from the probe without replay). The
layout tests (tests/multirank/test_routing_replay.py) hold each replayed token to the engine's
route; this holds the wiring: the routes travel from the engine through collection, the DP
dispatch and the micro-batches into the actor at each layout, step after step.
"""

import pytest
from trainer_utils import read_rows, run_trainer, write_config

pytestmark = pytest.mark.e2e

MOE_SCRATCH = {"family": "qwen3_moe", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 88,
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


# A random-init model writes every response to the length limit, so no group is ever cut short;
# 40 SFT steps teach it to stop at different lengths, and a full batch then cuts groups short.
PARTIAL = {"sft_warm_start": {"enable": True, "num_steps": 40, "batch_size": 16, "lr": 3.0e-3}}
PARTIAL_DATA = {"max_prompt_length": 64, "max_response_length": 24, "embedded": {"num_train": 200, "num_val": 8,
                                                                                  "num_sft": 200}}


@pytest.mark.parametrize(
    ("nproc", "overrides"),
    [(1, ("rollout.partial_rollout=true",)), (2, ("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")),
     (2, ("parallel.pipeline_model_parallel_size=2",)), (1, ("model.recompute_activations=true",))],
    ids=["single-partial", "tp2", "pp2", "recompute"],
)
def test_replayed_routes_are_the_engines_at_every_step(tmp_path, cache_dir, nproc, overrides):
    out = tmp_path / "run"
    partial = "rollout.partial_rollout=true" in overrides
    model = {"scratch": MOE_SCRATCH, **(PARTIAL if partial else {"sft_warm_start": {"enable": False}})}
    config = write_config(tmp_path / "moe.yaml", model=model, **({"data": PARTIAL_DATA} if partial else {}))
    proc = run_trainer(config, f"trainer.output_dir={out}", "trainer.total_training_steps=3", "trainer.test_freq=0",
                       "trainer.val_before_train=false", "algorithm.routing_replay=rollout", *overrides,
                       cache_dir=cache_dir, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    if partial:
        # Groups were cut short, carried, and continued under the next weights: their replayed
        # routes come from two weight versions.
        assert sum(r["rollout/carried_groups"] for r in rows) > 0
        assert max(r["rollout/max_versions_per_response"] for r in rows) == 2
    for row in rows:
        assert row["train/num_responses"] == 16
        # The forward used the engine's experts for every token of every layer, on every rank.
        assert row["moe/replay_route_mismatch"] == 0.0
        # Replay is what makes the actor's old log-probs the engine's, here where the engine's
        # routes are the actor's own weights' routes: the gap stays at float noise (a continued
        # response's first tokens were sampled by the previous weights, so not in its steps).
        if row["rollout/max_versions_per_response"] == 1:
            assert row["rollout/train_logprob_abs_diff"] < 1e-4
        # The probe without replay ran, so the metric that tells users what replay removes is there.
        assert 0.0 <= row["moe/router_disagreement"] <= 1.0
