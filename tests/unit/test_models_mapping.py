"""HF <-> Megatron tensor layouts, config parsing and checkpoint errors, without processes or transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_dapo.models import HFCheckpoint, LlamaAdapter, Qwen2Adapter, adapter_for, mapping
from megatron_dapo.models.mapping import TensorMap

# 4 query heads, 2 KV heads, head_dim 1: each row of q/k/v is one head, so layouts read as lists.
TINY = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 5,
    "hidden_size": 4,
    "intermediate_size": 4,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or TINY))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _full_tiny_tensors() -> dict[str, torch.Tensor]:
    hf = Qwen2Adapter.from_hf_config(TINY, "test").hf
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in mapping.expected_hf_shapes(hf).items()}


def test_qkv_is_grouped_per_kv_head_and_split_by_group(tmp_path: Path) -> None:
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads q0..q3; groups {q0,q1}, {q2,q3}
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    names = ("q", "k", "v")
    ckpt = HFCheckpoint(_write(tmp_path, dict(zip(names, (q, k, v)))))
    hf = adapter_for(TINY).hf
    tm = TensorMap(mcore_name="qkv", hf_names=names, kind="qkv", sort_key=(0, 0))
    full = mapping.load_shard(tm, ckpt, hf, tp=1, tp_rank=0, padded_vocab=128)
    assert full.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    shards = [mapping.load_shard(tm, ckpt, hf, tp=2, tp_rank=r, padded_vocab=128) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[10, 11, 20, 30], [12, 13, 21, 31]]
    rebuilt = mapping.hf_from_shards(tm, shards, hf)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, (q, k, v), strict=True))


def test_fc1_is_gate_then_up_per_tp_shard(tmp_path: Path) -> None:
    gate = torch.arange(4.0).reshape(4, 1)
    up = 10 + torch.arange(4.0).reshape(4, 1)
    ckpt = HFCheckpoint(_write(tmp_path, {"gate": gate, "up": up}))
    hf = adapter_for(TINY).hf
    tm = TensorMap(mcore_name="fc1", hf_names=("gate", "up"), kind="fc1", sort_key=(0, 0))
    shards = [mapping.load_shard(tm, ckpt, hf, tp=2, tp_rank=r, padded_vocab=128) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    gate_back, up_back = mapping.hf_from_shards(tm, shards, hf)
    assert torch.equal(gate_back, gate) and torch.equal(up_back, up)


def test_vocab_rows_are_padded_with_zeros_and_dropped_on_export(tmp_path: Path) -> None:
    embed = torch.arange(1.0, 6.0).reshape(5, 1).expand(5, 4).contiguous()  # V=5, H=4
    ckpt = HFCheckpoint(_write(tmp_path, {"e": embed}))
    hf = adapter_for(TINY).hf
    tm = TensorMap(mcore_name="e", hf_names=("e",), kind="vocab", sort_key=(0, 0))
    # Vp = 8 at tp=2 (as if divisible_by were 4): rank 0 rows 0-3, rank 1 rows 4-7 of which 5-7 are padding.
    shards = [mapping.load_shard(tm, ckpt, hf, tp=2, tp_rank=r, padded_vocab=8) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[1, 2, 3, 4], [5, 0, 0, 0]]
    assert torch.equal(mapping.hf_from_shards(tm, shards, hf)[0], embed)


def test_row_parallel_splits_input_dim(tmp_path: Path) -> None:
    weight = torch.arange(8.0).reshape(2, 4)
    ckpt = HFCheckpoint(_write(tmp_path, {"o": weight}))
    hf = adapter_for(TINY).hf
    tm = TensorMap(mcore_name="o", hf_names=("o",), kind="row", sort_key=(0, 0))
    shards = [mapping.load_shard(tm, ckpt, hf, tp=2, tp_rank=r, padded_vocab=128) for r in range(2)]
    assert [s.tolist() for s in shards] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert torch.equal(mapping.hf_from_shards(tm, shards, hf)[0], weight)


@pytest.mark.parametrize(
    ("vocab", "tp", "padded"), [(100, 1, 128), (100, 2, 256), (128, 1, 128), (152064, 8, 152576)]
)
def test_padded_vocab_size(vocab: int, tp: int, padded: int) -> None:
    assert mapping.padded_vocab_size(vocab, tp) == padded


def test_local_and_te_norm_names_map_to_the_same_hf_tensors() -> None:
    local = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight"]
    te = [
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
    ]
    for names in (local, te):
        maps = mapping.tensor_maps([(n, torch.empty(1)) for n in names], {0: 3}, tied=False)
        assert [m.hf_names for m in maps] == [
            ("model.layers.3.input_layernorm.weight",),
            ("model.layers.3.post_attention_layernorm.weight",),
        ]


def test_tied_output_layer_mirrors_embedding_and_unknown_params_raise() -> None:
    (out,) = mapping.tensor_maps([("output_layer.weight", torch.empty(1))], {}, tied=True)
    assert (out.hf_names, out.mirror) == (("model.embed_tokens.weight",), True)
    with pytest.raises(
        ValueError, match=r"\['decoder.layers.0.self_attention.linear_proj.bias'\] have no HF"
    ):
        mapping.tensor_maps(
            [("decoder.layers.0.self_attention.linear_proj.bias", torch.empty(1))], {0: 0}, tied=False
        )


def test_checkpoint_mismatch_lists_every_difference_in_one_message(tmp_path: Path) -> None:
    tensors = _full_tiny_tensors()
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 4)
    tensors["model.layers.0.extra.weight"] = torch.zeros(1)
    ckpt = HFCheckpoint(_write(tmp_path, tensors))
    with pytest.raises(ValueError) as info:
        mapping.check_checkpoint(adapter_for(TINY).hf, ckpt)
    message = str(info.value)
    assert "1 missing: model.norm.weight" in message
    assert "1 unexpected: model.layers.0.extra.weight" in message
    assert "1 shape mismatch: model.layers.0.mlp.up_proj.weight (3, 4) != (4, 4)" in message
    assert "\n" not in message


def test_complete_checkpoint_passes_the_check(tmp_path: Path) -> None:
    ckpt = HFCheckpoint(_write(tmp_path, _full_tiny_tensors()))
    mapping.check_checkpoint(adapter_for(TINY).hf, ckpt)
    assert len(ckpt.shapes) == 15  # 3 outside layers + 12 in the layer (q/k/v biases included)


def test_config_fields_and_family_selection() -> None:
    qwen = adapter_for(TINY)
    assert isinstance(qwen, Qwen2Adapter)
    assert (qwen.hf.rope_theta, qwen.hf.qkv_bias, qwen.hf.head_dim) == (1000000.0, True, 1)
    llama = adapter_for(
        {**TINY, "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    assert isinstance(llama, LlamaAdapter)
    assert (llama.hf.rope_theta, llama.hf.qkv_bias) == (5e5, False)
    by_arch = adapter_for({**TINY, "model_type": "custom", "architectures": ["LlamaForCausalLM"]})
    assert isinstance(by_arch, LlamaAdapter)


def test_transformer_config_reproduces_hf_hyper_parameters() -> None:
    config = adapter_for(TINY).transformer_config(dtype=torch.bfloat16, tp=1, pp=1, recompute="full")
    assert (config.num_query_groups, config.kv_channels, config.layernorm_epsilon) == (2, 1, 1e-6)
    assert (config.add_qkv_bias, config.add_bias_linear, config.gated_linear_unit) == (True, False, True)
    assert (config.bf16, config.params_dtype, config.recompute_granularity) == (True, torch.bfloat16, "full")


def test_transformer_config_gets_sequence_and_context_parallel_settings() -> None:
    adapter = adapter_for(TINY)
    plain = adapter.transformer_config(dtype=torch.float32, tp=2, pp=1)
    assert not plain.sequence_parallel and plain.context_parallel_size == 1 and plain.cp_comm_type is None
    config = adapter.transformer_config(dtype=torch.float32, tp=2, pp=1, sequence_parallel=True, cp=2,
                                        cp_comm_type="a2a")
    assert (config.sequence_parallel, config.context_parallel_size, config.cp_comm_type) == (True, 2, "a2a")
    assert not adapter.transformer_config(dtype=torch.float32, tp=1, pp=1, sequence_parallel=True).sequence_parallel


def test_unsupported_features_are_reported_together() -> None:
    raw = {
        **TINY,
        "model_type": "llama",
        "attention_bias": True,
        "hidden_act": "gelu",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    with pytest.raises(ValueError) as info:
        adapter_for(raw)
    message = str(info.value)
    assert "attention_bias=true" in message and "hidden_act='gelu'" in message and "'llama3'" in message
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        adapter_for({**TINY, "use_sliding_window": True})
    with pytest.raises(
        ValueError, match=r"model_type='gpt2', architectures=\['GPT2LMHeadModel'\]; supported"
    ):
        adapter_for({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_broken_checkpoint_directories_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        HFCheckpoint(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match=r"has no \*.safetensors files \(found \['config.json'\]\)"):
        HFCheckpoint(empty)
    truncated = _write(tmp_path / "truncated", _full_tiny_tensors())
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or not a safetensors file"):
        HFCheckpoint(truncated)
    sharded = _write(tmp_path / "sharded", {"a": torch.zeros(1)})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"missing: \['model-00002-of-00002.safetensors'\]"):
        HFCheckpoint(sharded)
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        HFCheckpoint(bad_json)
