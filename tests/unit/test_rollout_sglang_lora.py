"""rollout.lora_sync=adapter on the SGLang engine (rollout/sglang/adapters.py): the server's LoRA
flags and the exact adapter swap against a fake server, including a server restarted behind the
client's back. The real server runs it in tests/sglang_cpu/test_sglang_lora.py."""

import pytest
from test_rollout_sglang import FakeSGLang, _engine, _row

from megatron_dapo.config.model import LORA_TARGETS
from megatron_dapo.rollout.engine import EngineError, SamplingParams
from megatron_dapo.rollout.sglang.adapters import lora_modules
from megatron_dapo.rollout.sglang.server import (
    SGLangServerConfig,
    build_launch_command,
    resolve_server_config,
)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def fake():
    server = FakeSGLang()
    yield server
    server.close()


def _lora_flags(command: list[str]) -> list[str]:
    return command[command.index("--enable-lora"):] if "--enable-lora" in command else []


def test_the_servers_lora_flags_name_the_rank_the_hf_modules_and_the_backend_that_runs_there():
    assert lora_modules(LORA_TARGETS) == ALL  # experts have no flag (refused by config)
    assert lora_modules(("linear_qkv", "linear_fc2")) == ("q_proj", "k_proj", "v_proj", "down_proj")
    cpu = dict(model_path="/m", python="/p", device="cpu", max_total_tokens=4096)
    on_cpu = build_launch_command(resolve_server_config(SGLangServerConfig(**cpu, lora_rank=8, lora_modules=ALL), "e"))
    assert _lora_flags(on_cpu) == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *ALL,
                                   "--max-loras-per-batch", "2", "--lora-backend", "torch_native"]
    # A GPU server that releases its weights for training keeps a host copy: only adapters come back.
    gpu = resolve_server_config(SGLangServerConfig(model_path="/m", python="/p", lora_rank=64, lora_modules=ALL[:3]),
                                "e")
    assert _lora_flags(build_launch_command(gpu)) == [
        "--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
        "--max-loras-per-batch", "2", "--enable-weights-cpu-backup"]
    assert not _lora_flags(build_launch_command(resolve_server_config(SGLangServerConfig(**cpu), "e")))
    with pytest.raises(ValueError, match=r"lora_rank=8 must be >= 0 .* needs lora_modules"):
        SGLangServerConfig(**cpu, lora_rank=8)


def test_each_version_is_loaded_under_a_new_name_before_the_old_one_goes_and_requests_name_it(fake):
    fake.answers["/generate"] = [(200, [_row([4], [-0.5], "stop")])]
    engine = _engine(fake)
    engine.generate([[1, 2]], SamplingParams())
    assert "lora_path" not in fake.requests[-1][3]  # the base before the first adapter
    engine.load_adapter("/run/lora_adapters/v0", 0)
    engine.load_adapter("/run/lora_adapters/v1", 1)
    engine.generate([[1, 2]], SamplingParams())
    assert [(path, body) for _, path, _, body in fake.requests[1:]][:3] == [
        ("/load_lora_adapter", {"lora_name": "policy-v0", "lora_path": "/run/lora_adapters/v0"}),
        ("/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": "/run/lora_adapters/v1"}),
        ("/unload_lora_adapter", {"lora_name": "policy-v0"}),
    ]
    assert fake.requests[-1][3]["lora_path"] == "policy-v1"


def test_a_server_restarted_behind_the_client_gets_its_adapter_again(fake):
    """The controller loads the kept adapter into a server its owner relaunched (the client still
    names it); a server relaunched at a resume answers the next sync's unload with "does not exist"."""
    engine = _engine(fake)
    engine.load_adapter("/a/v3", 3)
    engine.load_adapter("/a/v3", 3)  # after a restart by the server's owner: sent again, nothing unloaded
    fake.answers["/load_lora_adapter"] = [
        (400, {"success": False, "error_message": "Failed to load LoRA adapter policy-v3 because it is already loaded"})]
    engine.load_adapter("/a/v3", 3)  # the server still had it: nothing to do
    fake.answers["/load_lora_adapter"] = [(200, {"success": True})]
    fake.answers["/unload_lora_adapter"] = [
        (400, {"success": False, "error_message": "LoRA with name policy-v3 does not exist. Loaded LoRAs: []"})]
    engine.load_adapter("/a/v4", 4)
    assert [(p, b["lora_name"]) for _, p, _, b in fake.requests] == [
        ("/load_lora_adapter", "policy-v3"), ("/load_lora_adapter", "policy-v3"), ("/load_lora_adapter", "policy-v3"),
        ("/load_lora_adapter", "policy-v4"), ("/unload_lora_adapter", "policy-v3")]
    assert engine._adapter == "policy-v4"
    # Any other refusal is the engine's failure (the controller restarts it or stops).
    fake.answers["/load_lora_adapter"] = [(400, {"success": False, "error_message": "Repo id must be in the form"})]
    with pytest.raises(EngineError, match=r"load_lora_adapter failed with HTTP 400: .*Repo id"):
        engine.load_adapter("/a/v5", 5)
    fake.answers["/load_lora_adapter"] = [
        (400, {"success": False, "error_message": "Failed to load LoRA adapter policy-v6 because it is already loaded"})]
    with pytest.raises(EngineError, match="already loaded"):  # a name this client never loaded is not ours
        engine.load_adapter("/a/v6", 6)
    assert engine._adapter == "policy-v4"
