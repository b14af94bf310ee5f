"""algorithm.routing_replay: bad combinations are one line and exit code 2 (issue 26)."""

from __future__ import annotations

import pytest

from megatron_dapo import cli

MOE = "model: {scratch: {family: qwen3_moe}}\n"
BAD = [
    (MOE + "algorithm: {routing_replay: rollout}\nrollout: {engine: vllm}",
     "{f}: algorithm.routing_replay='rollout': needs the engine's routed experts, which rollout.engine=vllm does "
     "not report here (vLLM 0.32 returns them only from its Model Runner V2); use rollout.engine=sglang or local, "
     "or algorithm.routing_replay=old_policy"),
    ("algorithm: {routing_replay: old_policy}",
     "{f}: algorithm.routing_replay='old_policy': needs a mixture-of-experts model "
     "(model.scratch.family=qwen2); set algorithm.routing_replay=off"),
    ("rollout: {router_noise_std: -1}", "{f}: rollout.router_noise_std=-1: must be >= 0 (0 = off)"),
    ("rollout: {router_noise_std: 0.5, engine: sglang}",
     "{f}: rollout.router_noise_std=0.5: is a perturbation of the local engine in the trainer's process: needs "
     "rollout.engine=local and rollout.placement=colocated"),
    ("algorithm: {routing_replay: r3}",
     "{f}: algorithm.routing_replay='r3': must be one of 'off', 'rollout', 'old_policy', got 'r3'"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_bad_routing_replay_settings_are_one_line_and_exit_2(tmp_path, capsys, text, expected):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    code = cli.run(["config", "validate", str(f)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "error: " + expected.format(f=f) + "\n"


def test_the_tiny_moe_run_validates_with_every_mode(capsys):
    for mode in ("off", "rollout", "old_policy"):
        assert cli.run(["config", "validate", "examples/tiny_moe_cpu.yaml", f"algorithm.routing_replay={mode}"]) == 0
    # Replay under full recompute (actor/routing_replay.py: the recomputed forward takes the forward's routes).
    assert cli.run(["config", "validate", "examples/tiny_moe_cpu.yaml", "algorithm.routing_replay=rollout",
                    "model.recompute_activations=true"]) == 0
