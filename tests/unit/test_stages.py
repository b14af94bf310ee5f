"""How layers split over pipeline stages (megatron_dapo/plan/stages.py, issue 39 item 8)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.plan.stages import first_layer, megatron_split, stage_layers


@pytest.mark.parametrize(("layers", "pp", "split"), [
    (64, 8, (8,) * 8),                          # even: megatron's default, nothing passed
    (3, 2, (2, 1)),                             # the tiny models of the PP=2 parity and convert tests
    (94, 8, (11, *(12,) * 6, 11)),              # Qwen3-235B-A22B
    (61, 16, (3, *(4,) * 14, 2)),               # DeepSeek-V3
    (28, 3, (9, 10, 9)),
    (7, 5, (2, 1, 1, 1, 2)),
])
def test_known_splits(layers: int, pp: int, split: tuple[int, ...]) -> None:
    assert stage_layers(layers, pp) == split


def test_every_split_is_one_megatron_core_can_place() -> None:
    for layers in range(1, 130):
        for pp in range(1, min(layers, 32) + 1):
            split = stage_layers(layers, pp)
            assert len(split) == pp and sum(split) == layers and min(split) >= 1
            assert len(set(split[1:-1])) <= 1  # megatron-core's middle stages are equal
            assert split[-1] <= max(split)
            kwargs = megatron_split(layers, pp)
            if len(set(split)) == 1:
                assert kwargs == {}
            else:
                assert kwargs == {"num_layers_in_first_pipeline_stage": split[0],
                                  "num_layers_in_last_pipeline_stage": split[-1]}
            assert [first_layer(layers, pp, r) for r in range(pp)] == [sum(split[:r]) for r in range(pp)]


def test_megatron_core_numbers_the_layers_as_we_do() -> None:
    """Our stage offsets equal megatron-core 0.16.1's get_transformer_layer_offset (global numbering
    is what dist checkpoints and the HF mapping rely on)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for layers, pp in [(3, 2), (94, 8), (61, 16), (28, 3), (64, 8)]:
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   **megatron_split(layers, pp))
        for rank in range(pp):
            assert get_transformer_layer_offset(config, pp_rank=rank) == first_layer(layers, pp, rank), (layers, pp)


def test_fewer_layers_than_stages_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than the 4 pipeline stages; use pp <= 3"):
        stage_layers(3, 4)
