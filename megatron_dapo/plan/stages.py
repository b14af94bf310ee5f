"""How a model's layers split over pipeline stages: evenly where PP divides them, else uneven.

Models users train have layer counts no PP size divides (Qwen3-235B-A22B: 94 layers, DeepSeek-V3:
61). megatron-core 0.16.1 places uneven stages with `num_layers_in_first_pipeline_stage` and
`num_layers_in_last_pipeline_stage` (TransformerConfig; the middle stages share the rest equally,
transformer_layer.get_transformer_layer_offset numbers each stage's layers globally). One rule
here, a function of (layers, PP) alone, so the actor, the converters, the weight sync, the
planner and check_parity build the same stages without a setting to keep in agreement:

- PP divides L: every stage L / PP layers (megatron's default: no setting passed);
- else the middle stages take m layers each (megatron-core needs them equal) and the two end stages
  split the rest, the last never more than the first (it also holds the output layer and the
  loss); m is chosen so that the fullest stage, which sets the pipeline's pace, is as small as it
  can be, then the last stage as light as it can be. 94 layers at PP 8: 11 + 6 x 12 + 11; 61 at
  PP 16: 3 + 14 x 4 + 2; 3 at PP 2: 2 + 1; 28 at PP 3: 9 + 10 + 9.

Dist checkpoints name layers globally, so a checkpoint saved under one split loads under another.
This module imports nothing heavy: the planner (torch-free) uses it too.
"""

from __future__ import annotations

__all__ = ["first_layer", "megatron_split", "stage_layers"]


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers of each pipeline stage, first to last.

    Raises:
        ValueError: fewer layers than stages (a stage would hold none).
    """
    if pp < 1:
        raise ValueError(f"pp={pp} must be >= 1")
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers={num_layers} is fewer than the {pp} pipeline stages; "
                         f"use pp <= {num_layers}")
    if num_layers % pp == 0:
        return (num_layers // pp,) * pp
    if pp == 2:
        last = num_layers // 2
        return (num_layers - last, last)
    middle = pp - 2
    best: tuple[int, ...] | None = None
    for m in range(1, num_layers):
        rest = num_layers - m * middle
        if rest < 2:
            break
        last = rest // 2
        split = (rest - last, *(m,) * middle, last)
        # The fullest stage sets the pipeline's pace; among equals, the lightest last stage (it also
        # holds the logits), then the end stages closest together.
        key = (max(split), split[-1], split[0] - split[-1])
        if best is None or key < (max(best), best[-1], best[0] - best[-1]):
            best = split
    assert best is not None  # num_layers >= pp > 2 leaves m = 1 with rest >= 2
    return best

def first_layer(num_layers: int, pp: int, pp_rank: int) -> int:
    """The global 0-based index of stage `pp_rank`'s first layer."""
    return sum(stage_layers(num_layers, pp)[:pp_rank])


def megatron_split(num_layers: int, pp: int) -> dict[str, int]:
    """TransformerConfig keywords for this split: none when even, else the two end stages' counts.

    Raises:
        ValueError: a split megatron-core cannot express (its middle stages must be equal).
    """
    layers = stage_layers(num_layers, pp)
    if len(set(layers)) == 1:
        return {}
    if len(set(layers[1:-1])) > 1:
        raise ValueError(f"num_hidden_layers={num_layers} at pp={pp}: stages {list(layers)} have unequal middle "
                         "stages, which megatron-core cannot place; pick another pp")
    return {"num_layers_in_first_pipeline_stage": layers[0], "num_layers_in_last_pipeline_stage": layers[-1]}
