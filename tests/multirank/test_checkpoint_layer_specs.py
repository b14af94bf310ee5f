"""Checkpoints cross megatron's layer specs, local -> TE layout -> local, bit-exact (issue 39, item 2).

Transformer Engine cannot run on a CPU, so the TE spec's state-dict layout is built here from
the local model the way megatron-core 0.16.1 writes it (checkpoint/spec_keys.py has the facts
and where they were read): every module that is a TE module in the TE spec gets TE's
``_extra_state`` (an empty uint8 tensor without FP8, TE >= 2.9), which megatron's own
``make_sharded_tensors_for_checkpoint`` turns into the ShardedObjects a TE run saves (keys,
[layers] and [layers, experts] shapes); megatron's local linears already save one (None), its
norms none, so the norms' are what differs; an MoE layer saves its pre-MLP norm under its own
name (the TE spec has no key map for it). The saved TE-layout checkpoint is checked against those
names, so the oracle cannot drift into the local layout unnoticed.

Per model (dense Qwen2, Qwen3-MoE with qk norms and a dense layer), with a distributed optimizer
after one step: a local checkpoint loads into the TE layout (model and Adam state), which saves a
TE checkpoint; that loads back into the local layout, and the CPU streaming exporter reads it:
every parameter, every optimizer state and the export equal the original bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from dist_utils import run_distributed
from model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.multirank

TE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "q_layernorm", "k_layernorm")


def _te_extra_state(module: torch.nn.Module) -> None:
    """Give one module TE's extra state (TransformerEngineBaseModule / ops.BasicOperation without FP8)."""
    cls = type(module)
    module.__class__ = type(f"TE{cls.__name__}", (cls,), {
        "get_extra_state": lambda self: torch.empty(0, dtype=torch.uint8),
        "set_extra_state": lambda self, state: None,
    })


def as_te_layout(gpt: torch.nn.Module) -> None:
    """The local GPTModel `gpt`, made to save and load what the TE spec's model does (megatron-core 0.16.1)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for name, module in gpt.named_modules():
        if name.endswith((*TE_LINEARS, "final_layernorm")):
            if any(True for _ in module.parameters()):  # not an IdentityOp (no qk norm)
                _te_extra_state(module)
        elif isinstance(module, TransformerLayer) and isinstance(module.mlp, MoELayer):
            _te_extra_state(module.pre_mlp_layernorm)  # a TENorm of its own, under its own name
            keys = {k: v for k, v in module.submodules_config.sharded_state_dict_keys_map.items()
                    if k != "pre_mlp_layernorm."}
            module.submodules_config = dataclasses.replace(module.submodules_config, sharded_state_dict_keys_map=keys)
        elif isinstance(module, MLP):  # a dense layer's MLP or one expert of SequentialMLP (TEGroupedLinear's keys)
            _te_extra_state(module.linear_fc1)
            _te_extra_state(module.linear_fc2)


def _build(directory: str, dims, te: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dapo.models import adapter_for

    adapter = adapter_for(directory)
    gpt = adapter.build_model(dims, dtype=torch.float32, use_te=False)
    with torch.no_grad():
        for p in gpt.parameters():
            p.zero_()  # only a load gives it weights
    if te:
        as_te_layout(gpt)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp])
    return adapter, ddp, opt


def _step(ddp, opt, vocab: int) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, 8), generator=gen)
    pos = torch.arange(8).unsqueeze(0).expand(2, 8)

    def forward_step(data_iter, model):
        return model(tokens, pos, None), lambda out: (out.float().pow(2).mean(), {})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
                                num_microbatches=1, seq_length=8, micro_batch_size=2, forward_only=False)
    assert opt.step()[0]


def _state(ddp, opt) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in ddp.module.named_parameters()}
    for j, inner in enumerate(getattr(opt, "chained_optimizers", [opt])):  # MoE: experts apart
        for i, (main, state) in enumerate(inner.optimizer.state.items()):
            out[f"main/{j}/{i}"] = main.detach().clone()
            for k, v in state.items():
                out[f"adam/{j}/{i}/{k}"] = v.detach().clone()
    return out


def _stored(ckpt) -> tuple[set[str], set[str]]:
    from megatron_dapo.checkpoint.files import DIST_DIR
    from megatron_dapo.checkpoint.format import _MetadataUnpickler
    from megatron_dapo.checkpoint.spec_keys import StoredIndex

    with open(ckpt / DIST_DIR / ".metadata", "rb") as f:
        index = StoredIndex.from_metadata(_MetadataUnpickler(f).load())
    return set(index.tensors), index.objects


def _worker(models: dict[str, str], root: str) -> dict:
    from pathlib import Path

    from megatron_dapo import parallel
    from megatron_dapo.checkpoint import CheckpointManager
    from megatron_dapo.convert import mcore_to_hf

    parallel.init_distributed(os.environ["MEGATRON_DAPO_TEST_DEVICE"])
    results = {}
    for name, directory in models.items():
        adapter = __import__("megatron_dapo.models", fromlist=["adapter_for"]).adapter_for(directory)
        dims = parallel.initialize_model_parallel(1, 1, seed=0, num_experts=adapter.hf.num_experts or None)
        out: dict = {}
        _, local, opt = _build(directory, dims, te=False)
        with torch.no_grad():  # the original: seeded random weights, one Adam step
            gen = torch.Generator().manual_seed(11)
            for p in local.module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        opt.reload_model_params()
        _step(local, opt, adapter.hf.vocab_size)
        out["original"] = _state(local, opt)
        first = CheckpointManager(Path(root) / name / "local").save(1, [local], opt, None, {}, {}, hf_dir=directory)

        _, te, te_opt = _build(directory, dims, te=True)
        CheckpointManager(Path(root) / name / "local").load(first, [te], te_opt, load_rng=False)
        out["te"] = _state(te, te_opt)
        te_ckpt = CheckpointManager(Path(root) / name / "te").save(1, [te], te_opt, None, {}, {}, hf_dir=directory)
        out["te_stored"] = _stored(te_ckpt)
        out["local_stored"] = _stored(first)

        _, back, back_opt = _build(directory, dims, te=False)
        CheckpointManager(Path(root) / name / "te").load(te_ckpt, [back], back_opt, load_rng=False)
        out["back"] = _state(back, back_opt)
        mcore_to_hf(str(first), str(Path(root) / name / "hf_local"))
        mcore_to_hf(str(te_ckpt), str(Path(root) / name / "hf_te"))
        results[name] = out
    return results


def _name(stored: str) -> str:
    """A stored key without "decoder.", its shard suffix and layer number: ``layers.mlp.linear_fc1._extra_state``."""
    return re.sub(r"^layers\.\d+\.", "layers.", stored.split("/shard_")[0].removeprefix("decoder."))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_checkpoint_round_trips_local_te_local_bit_exactly_dense_and_moe(tmp_path):
    from safetensors.torch import load_file

    models = {"dense": str(make_tiny_checkpoint(tmp_path / "dense", "qwen2", seed=1)),
              "moe": str(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=2))}
    [out] = run_distributed(_worker, 1, models, str(tmp_path / "ckpt"), timeout_s=400)
    for name, result in out.items():
        _same(result["original"], result["te"])  # local -> TE: weights and Adam state
        _same(result["original"], result["back"])  # TE -> local
        tensors, objects = result["te_stored"]
        extra = {_name(o) for o in objects if "_extra_state" in o}
        wanted = {"final_layernorm._extra_state", "layers.self_attention.linear_qkv._extra_state",
                  "layers.self_attention.linear_proj._extra_state"}
        wanted |= {"layers.self_attention.q_layernorm._extra_state",
                   "layers.self_attention.k_layernorm._extra_state"} if name == "moe" else set()
        wanted |= {"layers.mlp.linear_fc1._extra_state", "layers.mlp.linear_fc2._extra_state"}  # dense layers
        if name == "moe":
            wanted |= {"layers.pre_mlp_layernorm._extra_state", "layers.mlp.experts.experts.linear_fc1._extra_state",
                       "layers.mlp.experts.experts.linear_fc2._extra_state"}
            # The TE spec's MoE norm under its own name (per layer: a model with a dense layer has per-layer keys).
            assert {_name(t) for t in tensors} >= {"layers.pre_mlp_layernorm.weight", "layers.mlp.linear_fc1.layer_norm_weight"}
            assert "layers.pre_mlp_layernorm.weight" not in {_name(t) for t in result["local_stored"][0]}
            expert = [o for o in objects if ".experts.experts.linear_fc1._extra_state" in o]
            # One object per expert: the expert axis last (TEGroupedLinear's offsets), all experts of a layer.
            shards = [o.split("/shard_")[1].split("_") for o in expert if o.startswith(expert[0].split("/")[0] + "/")]
            assert sorted(int(off.split(".")[-1]) for off, _ in shards) == list(range(int(shards[0][1].split(".")[-1])))
        assert extra == wanted, extra ^ wanted
        # megatron's local linears save an extra state too (None, "compatibility with TE state dict"); its
        # norms do not: the TENorms' are what a local checkpoint lacks.
        local_extra = {_name(o) for o in result["local_stored"][1] if "_extra_state" in o}
        norms = {k for k in wanted if "layernorm" in k}
        assert local_extra == wanted - norms and norms, local_extra ^ (wanted - norms)
        hf_local = load_file(str(tmp_path / "ckpt" / name / "hf_local" / "model.safetensors"))
        hf_te = load_file(str(tmp_path / "ckpt" / name / "hf_te" / "model.safetensors"))
        assert sorted(hf_local) == sorted(hf_te) and all(torch.equal(hf_local[k], hf_te[k]) for k in hf_local)
