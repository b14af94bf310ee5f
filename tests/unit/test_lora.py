"""model.lora on one rank (megatron_dapo/lora): what config refuses, the base's fingerprint, and the
adapters of a mixture-of-experts model (experts included) against the same maths by hand.

The layouts (TP, SP, PP) are held in tests/multirank/test_actor_lora.py, the checkpoints and
exports in tests/e2e/test_lora_export.py and tests/multirank/test_checkpoint_trainer_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo import cli

MOE = "model: {scratch: {family: qwen3_moe}}\n"
BAD = [
    ("model: {lora: {rank: 8}, transformer_impl: transformer_engine}",
     "{f}: model.lora.rank=8: needs megatron's local layer spec (Transformer Engine's fused linears are not wired "
     "for adapters yet); set model.transformer_impl=local (or auto, which picks local with LoRA)"),
    ("model: {lora: {rank: 8, dropout: 0.1}}\nparallel: {tensor_model_parallel_size: 2}",
     "{f}: model.lora.dropout=0.1: needs parallel.tensor_model_parallel_size=1 (TP ranks would draw different "
     "masks on replicated inputs); set model.lora.dropout=0"),
    ("model: {lora: {rank: 8, target_modules: [experts]}}",
     "{f}: model.lora.target_modules=['experts']: has experts, and the model is dense; leave experts out"),
    ("model: {lora: {rank: 8}, scratch: {family: qwen3_moe}}\n"
     "parallel: {tensor_model_parallel_size: 2, sequence_parallel: true}",
     "{f}: model.lora.target_modules: has experts (all-linear includes them), whose weights are "
     "split over expert_tensor_parallel_size=2; adapters on split experts are not supported: set "
     "parallel.expert_tensor_parallel_size=1 or list the targets without experts"),
    ("model: {lora: {rank: -1}}", "{f}: model.lora.rank=-1: must be >= 0 (0 = off)"),
    ("model: {lora: {rank: 4}}\nparallel: {context_parallel_size: 2}\ntrainer: {device: cuda}",
     "{f}: model.lora.rank=4: needs parallel.context_parallel_size=1, not 2: context parallelism runs on Transformer "
     "Engine's attention, and adapters on megatron's local layer spec"),
    ("rollout: {lora_sync: adapter, engine: vllm}",
     "{f}: rollout.lora_sync=adapter sends LoRA adapters, and model.lora.rank is 0; set "
     "model.lora.rank > 0 or rollout.lora_sync=merged"),
    ("model: {lora: {rank: 8}}\nrollout: {lora_sync: adapter, engine: local}",
     "{f}: rollout.lora_sync=adapter needs rollout.engine=vllm or sglang with rollout.placement=colocated "
     "(servers beside the trainer, which load each step's adapter directory), not engine=local "
     "placement=colocated; use rollout.lora_sync=merged (every engine and placement)"),
    ("model: {lora: {rank: 8}}\nrollout: {lora_sync: adapter, engine: sglang, placement: disaggregated}",
     "{f}: rollout.lora_sync=adapter needs rollout.engine=vllm or sglang with rollout.placement=colocated "
     "(servers beside the trainer, which load each step's adapter directory), not engine=sglang "
     "placement=disaggregated; use rollout.lora_sync=merged (every engine and placement)"),
    ("model: {scratch: {family: qwen3_moe}, lora: {rank: 8}}\nrollout: {lora_sync: adapter, engine: sglang}",
     "{f}: rollout.lora_sync=adapter: SGLang runs LoRA on experts with Triton kernels only (none on CPU; "
     "untested on GPUs) and this model is a mixture of experts (model.scratch.family=qwen3_moe); use "
     "rollout.lora_sync=merged"),
    ("model: {lora: {rank: 600}}\nrollout: {lora_sync: adapter, engine: vllm}",
     "{f}: model.lora.rank=600 is above vLLM's largest --max-lora-rank 512; lower it or use "
     "rollout.lora_sync=merged"),
    ("model: {lora: {rank: 4, target_modules: [q_proj]}}",
     "{f}: model.lora.target_modules=['q_proj']: has ['q_proj']; choose among ['all-linear', 'linear_qkv', "
     "'linear_proj', 'linear_fc1', 'linear_fc2', 'experts']"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_lora_settings_the_actor_cannot_build_are_one_line_and_exit_2(tmp_path, capsys, text, expected):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    code = cli.run(["config", "validate", "--static", str(f)])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "error: " + expected.format(f=f) + "\n"


def test_sglang_serves_adapters_of_any_rank_beside_the_trainer(tmp_path, capsys):
    """SGLang takes any --max-lora-rank (vLLM's are a fixed list): rank 600 validates there."""
    f = tmp_path / "exp.yaml"
    f.write_text("model: {lora: {rank: 600}}\nrollout: {lora_sync: adapter, engine: sglang}")
    assert cli.run(["config", "validate", "--static", str(f)]) == 0, capsys.readouterr().err


def test_the_base_fingerprint_names_the_weights_not_the_directory(tmp_path):
    from megatron_dapo.lora import base_identity

    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 8}')
    weights = bytearray(range(256)) * (3 * 4096 * 2)  # 6 MiB: first and last MiB apart from the middle
    (a / "model.safetensors").write_bytes(bytes(weights))
    b = tmp_path / "b"
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
    assert base_identity(a)["fingerprint"] == base_identity(b)["fingerprint"]
    assert base_identity(a)["path"] != base_identity(b)["path"]
    for where in (0, len(weights) - 1):
        changed = bytearray(weights)
        changed[where] ^= 1
        (b / "model.safetensors").write_bytes(bytes(changed))
        assert base_identity(a)["fingerprint"] != base_identity(b)["fingerprint"], where
    (b / "model.safetensors").write_bytes(bytes(weights))
    (b / "config.json").write_text('{"hidden_size": 16}')
    assert base_identity(a)["fingerprint"] != base_identity(b)["fingerprint"]


def _moe_worker(directory: str) -> dict:
    from megatron_dapo import parallel
    from megatron_dapo.lora import apply_lora, lora_of
    from megatron_dapo.models import adapter_for

    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1, seed=0)
    adapter = adapter_for(directory)
    model = adapter.build_model(dims, dtype=torch.float32, init_weights=False)
    adapter.load_hf(model, directory, dims)
    ids = torch.tensor([[5, 9, 2, 33, 7, 21, 4]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    model.eval()
    with torch.no_grad():
        before = model(ids, pos, None).clone()
    lora = apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=("linear_qkv", "linear_fc1", "experts"), seed=1)
    assert lora_of(model) is lora
    with torch.no_grad():
        same = model(ids, pos, None).clone()  # B = 0: the base
        gen = torch.Generator().manual_seed(0)
        for _, p in lora.params():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        adapted = model(ids, pos, None).clone()
        with lora.disabled():
            off = model(ids, pos, None).clone()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    # As megatron marks its expert weights: the grad norm counts an expert's adapters on every
    # rank (each holds its own experts), not only on dense TP rank 0.
    marks = {n: bool(getattr(p, "tensor_model_parallel", False)) for n, p in model.named_parameters()
             if p.requires_grad}
    merged = dict(adapter.export_hf(model, dims))
    factors = {s.global_path: (s.module.lora_A.detach().clone(), s.b_matrix().detach().clone()) for s in lora.sites}
    base = {}
    with lora.disabled():
        base = dict(adapter.export_hf(model, dims))
    return {"before": before, "same": same, "adapted": adapted, "off": off, "trainable": trainable, "marks": marks,
            "merged": merged, "base": base, "factors": factors}


def test_an_moe_models_experts_take_adapters_and_merge_like_the_dense_linears(tmp_path):
    from dist_utils import run_distributed
    from model_utils import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", num_layers=2, seed=4,
                                     moe={"num_experts": 4, "num_experts_per_tok": 2})
    r = run_distributed(_moe_worker, 1, str(directory))[0]
    assert torch.equal(r["same"], r["before"]) and torch.equal(r["off"], r["before"])
    assert (r["adapted"] - r["before"]).abs().max() > 1e-3
    assert all(n.endswith(("lora_A", "lora_B")) for n in r["trainable"])
    assert all(marked == (".experts." in n) for n, marked in r["marks"].items()), r["marks"]
    # Layer 0 is sparse (4 experts x fc1/fc2 x A/B), layer 1 dense (its fc1's A/B), qkv in both.
    assert sum(".experts." in n for n in r["trainable"]) == 4 * 2 * 2 and len(r["trainable"]) == 16 + 2 + 4
    scale = 4.0 / 2
    for site, hf in (("decoder.layers.0.mlp.experts.3.linear_fc1", "model.layers.0.mlp.experts.3"),
                     ("decoder.layers.1.mlp.linear_fc1", "model.layers.1.mlp")):
        a, b = r["factors"][site]
        ffn = b.shape[0] // 2
        for half, name in ((b[:ffn], "gate_proj"), (b[ffn:], "up_proj")):
            by_hand = r["base"][f"{hf}.{name}.weight"] + scale * (half @ a)
            assert torch.allclose(r["merged"][f"{hf}.{name}.weight"], by_hand, atol=1e-6), (site, name)
    down_a, down_b = r["factors"]["decoder.layers.0.mlp.experts.1.linear_fc2"]
    by_hand = r["base"]["model.layers.0.mlp.experts.1.down_proj.weight"] + scale * (down_b @ down_a)
    assert torch.allclose(r["merged"]["model.layers.0.mlp.experts.1.down_proj.weight"], by_hand, atol=1e-6)
    assert torch.equal(r["merged"]["model.layers.0.mlp.gate.weight"], r["base"]["model.layers.0.mlp.gate.weight"])
