"""Rules of the GPU path that can be checked on CPU (DESIGN.md, "Where tensors live" and the
launcher rules): the default group's backend, the server environment under torchrun, the
engine address, SGLang's serializer output, TE's cross-entropy version gate and the fp32
temperature of the fused log-prob path."""

import base64
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_dapo.actor import logprobs
from megatron_dapo.device import distributed_backend
from megatron_dapo.rollout.server_process import HOST_ENV, node_address, server_environment
from megatron_dapo.rollout.sglang.protocol import payload_text


def test_cuda_groups_carry_a_cpu_backend_for_control_tensors():
    assert distributed_backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert distributed_backend(torch.device("cpu")) == "gloo"


TORCHRUN_ENV = {
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8",
    "GROUP_RANK": "0", "ROLE_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}  # fmt: skip


def test_server_environment_drops_the_launchers_variables_and_keeps_the_rest():
    env = server_environment({"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}, base={**TORCHRUN_ENV, "PATH": "/bin", "HF_HOME": "/h"})
    assert env == {"PATH": "/bin", "HF_HOME": "/h", "SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}


def test_a_server_started_from_a_torchrun_rank_can_build_its_own_tcp_process_group(tmp_path):
    """What SGLang does at start: init_process_group("tcp://...") with its own port.

    With torchrun's TORCHELASTIC_USE_AGENT_STORE inherited, torch builds a client-only store
    that waits for a master that never comes; the scrubbed environment initialises at once.
    """
    from megatron_dapo.launcher import free_port

    script = textwrap.dedent(f"""
        import datetime, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=20))
        print("initialised")
    """)
    base = {**os.environ, **TORCHRUN_ENV}
    ok = subprocess.run([sys.executable, "-c", script], env=server_environment(base=base), capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and "initialised" in ok.stdout, ok.stderr[-2000:]
    try:
        hung = subprocess.run([sys.executable, "-c", script], env=base, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return  # the inherited environment hangs: the reason for the scrub
    assert hung.returncode != 0, "the torchrun environment should not initialise a tcp:// group"


def test_engine_address_is_the_route_to_the_master_and_can_be_overridden(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    assert node_address("127.0.0.1") == "127.0.0.1"
    # Debian's 127.0.1.1 hostname entry never reaches the engines: no loopback alias is returned.
    monkeypatch.setattr("socket.gethostbyname", lambda _: "127.0.1.1")
    assert node_address("") == "127.0.0.1"
    monkeypatch.setenv(HOST_ENV, "10.1.2.3")
    assert node_address("127.0.0.1") == "10.1.2.3"


def _sglang_deserialize(data):
    """SGLang's MultiprocessingSerializer.deserialize (0.5.x): base64 str, or raw pickle bytes."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return pickle.loads(data)


@pytest.mark.parametrize("form", ["str", "base64 bytes (sglang 0.5.4)", "raw pickle bytes"])
def test_serializer_output_becomes_json_text_that_sglang_decodes(form):
    bucket = [("model.norm.weight", torch.arange(4.0))]
    raw = pickle.dumps(bucket)
    out = {"str": base64.b64encode(raw).decode(), "base64 bytes (sglang 0.5.4)": base64.b64encode(raw),
           "raw pickle bytes": raw}[form]
    text = payload_text(out)
    assert isinstance(text, str)
    (name, tensor), = _sglang_deserialize(text)
    assert name == "model.norm.weight" and torch.equal(tensor, torch.arange(4.0))


def test_sglang_own_deserializer_reads_our_payload_where_sglang_imports():
    utils = pytest.importorskip("sglang.srt.utils", reason="sglang is a GPU extra")
    bucket = [("w", torch.ones(3))]
    text = payload_text(utils.MultiprocessingSerializer.serialize(bucket, output_str=True))
    assert torch.equal(utils.MultiprocessingSerializer.deserialize(text)[0][1], torch.ones(3))


@pytest.mark.parametrize(("version", "ok"), [("2.2.0", False), ("2.7.1", False), ("2.8.0.dev0+e9a5fa4", False),
                                              ("2.8.0", True), ("2.9.0+cu13", True), ("garbage", False)])
def test_te_fused_cross_entropy_only_from_2_8(version, ok):
    assert logprobs.te_cross_entropy_supported(version) is ok


@pytest.mark.parametrize("temperature", [0.6, 0.7, 1.0])
def test_fused_path_divides_bf16_logits_by_the_temperature_in_fp32(temperature):
    """The fused (TE) path and the chunked path agree on bf16 logits at any temperature.

    TE computes in fp32 from its input; the stand-in does the same. Dividing in bf16 first
    moved log-probs by 0.1-0.25 at T = 0.6-0.7, so old and new log-probs disagreed.
    """
    def te_like(x, target, group):  # [s, b, v] -> -log p [s, b], fp32 inside like TE
        return -torch.log_softmax(x.float(), dim=-1).gather(-1, target[..., None]).squeeze(-1)

    torch.manual_seed(0)
    logits = (torch.randn(64, 1000) * 6).to(torch.bfloat16)
    target = torch.randint(0, 1000, (64,))
    fused = logprobs._fused_log_probs(te_like, logits, target, temperature, None, None)
    chunked = logprobs.log_probs_and_entropy(logits, target, temperature=temperature)[0]
    assert float((fused - chunked).abs().max()) < 1e-5


@pytest.mark.parametrize(("use_te", "apex_wgrad", "triton", "on"), [
    (False, True, True, set()),  # CPU, or the local spec on a GPU: megatron's unfused defaults
    (True, False, False, {"apply_rope_fusion"}),
    (True, True, False, {"apply_rope_fusion", "gradient_accumulation_fusion"}),
    (True, False, True, {"apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion"}),
    (True, True, True, {"apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion",
                        "bias_dropout_fusion"}),
])
def test_kernel_fusions_follow_what_each_needs(use_te, apex_wgrad, triton, on):
    from megatron_dapo.models.transformer_impl import FUSION_FLAGS, kernel_fusions

    fusions = kernel_fusions(use_te=use_te, apex_wgrad=apex_wgrad, triton=triton)
    assert set(fusions) == set(FUSION_FLAGS)
    assert {flag for flag, value in fusions.items() if value} == on
    # MoE: TE's fused permutation, and its fused router unless routes are replayed.
    moe = {flag for flag, value in kernel_fusions(use_te=use_te, apex_wgrad=apex_wgrad, triton=triton,
                                                   moe=True).items() if value}
    assert moe == on | ({"moe_permute_fusion", "moe_router_fusion"} if use_te else set())
    replay = kernel_fusions(use_te=use_te, apex_wgrad=apex_wgrad, triton=triton, moe=True, routing_replay=True)
    assert not replay["moe_router_fusion"] and replay["moe_permute_fusion"] == use_te


def test_fusion_flags_reach_the_constructor_and_its_checks():
    """Issue 39: flags set on the config after __post_init__ skipped megatron-core's own checks. Passed
    to the constructor, a fusion this machine cannot run is refused there (TE's fused permutation,
    absent without TE). kernel_fusions never asks for it without TE."""
    import torch

    from megatron_dapo.models import adapter_for

    adapter = adapter_for({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                           "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                           "vocab_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 16, "max_position_embeddings": 64})
    assert adapter.transformer_config(dtype=torch.float32, tp=1, pp=1, fusions={"moe_permute_fusion": False})
    # megatron-core 0.16.1 without TE: moe_utils has no fused kernels to import (ImportError), with an
    # older TE they are None (ValueError "fused permutation is not available").
    with pytest.raises((ImportError, ValueError), match=r"fused_permute|fused permutation"):
        adapter.transformer_config(dtype=torch.float32, tp=1, pp=1, fusions={"moe_permute_fusion": True})


@pytest.mark.parametrize(("packed", "use_te", "cp", "device_type", "on"), [
    (False, False, 1, "cpu", True),
    (False, False, 1, "cuda", False),  # SDPA with a mask and grouped heads: the math kernel on CUDA
    (True, True, 1, "cuda", False),    # TE's thd packing
    (False, True, 2, "cuda", False),   # CP splits padded rows
    (False, False, 2, "cpu", False),
])
def test_shared_prompts_run_only_on_cpu_with_the_local_attention(packed, use_te, cp, device_type, on):
    from megatron_dapo.actor.shared_layout import uses_shared_prompts

    assert uses_shared_prompts(requested=True, packed=packed, use_te=use_te, cp=cp, device_type=device_type) is on
    assert not uses_shared_prompts(requested=False, packed=packed, use_te=use_te, cp=cp, device_type=device_type)


def test_the_engines_grouped_kv_attention_is_cpu_only():
    from megatron_dapo.rollout.local.attention import ATTENTION, attention_for

    assert attention_for("qwen2", "cpu") == ATTENTION and attention_for("llama", "cpu") == ATTENTION
    assert attention_for("qwen2", "cuda") is None  # transformers' sdpa: no math-kernel fallback
    assert attention_for("gemma2", "cpu") is None  # other attention variants keep their default


@pytest.mark.parametrize("per_stage", [False, True])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_controllers_export_of_cuda_tensors_runs_the_collective_export(monkeypatch, rank, per_stage):
    """DESIGN.md, "The controller's export on CUDA": no point-to-point on NCCL; rank 0 alone keeps the
    tensors, or with receivers="stages" (TP 2 x PP 2 here) each stage's first rank its own stage's,
    from the collective export of that stage alone."""
    from types import SimpleNamespace

    from megatron_dapo.models import export

    calls = []

    def collective(hf, local, params, dims, *, own_stage=False):
        calls.append((dims.rank, own_stage))
        yield "model.embed_tokens.weight", torch.zeros(2)
        yield "model.norm.weight", torch.ones(2)

    def no_p2p(*args, **kwargs):
        raise AssertionError("point-to-point on a CUDA job")

    monkeypatch.setattr(export, "export_to_all", collective)
    monkeypatch.setattr(export.dist, "send", no_p2p)
    monkeypatch.setattr(export.dist, "recv", no_p2p)
    monkeypatch.setattr(export.dist, "all_gather_object", no_p2p)
    dims = SimpleNamespace(device=torch.device("cuda", rank), rank=rank, world_size=4, pp=2, pp_rank=rank // 2)
    names = [name for name, _ in export.export_to_controller(None, [], {}, dims, per_stage=per_stage)]
    assert calls == [(rank, per_stage)]  # every rank drives the collectives
    receivers = (0, 2) if per_stage else (0,)
    assert names == (["model.embed_tokens.weight", "model.norm.weight"] if rank in receivers else [])
