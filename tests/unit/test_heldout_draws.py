"""The warm start's band checks and the trainer's validation draw their own samples.

SFT stops at the first check whose held-out accuracy lies in the band, so that check is selected
for a high reading. When the run's step-0 val/acc was the same draw (the same seed), it overstated
the starting accuracy and understated every gain: seed 21's stopping check read 0.316 where ten
fresh draws of the same weights read 0.264-0.309 (docs/benchmarks.md, 2026-11-29), and runs on
another engine, which draw anew, looked as if they learned more (issue 41's window misses).
"""

from __future__ import annotations

from test_rollout_local_engine import EOS, PROMPTS, make_tiny_qwen2

from megatron_dapo.collect.heldout import BAND_CHECK_SEED_OFFSET, VAL_SEED_OFFSET, val_sampling_params
from megatron_dapo.config import ValKwargsConfig
from megatron_dapo.rollout.local.engine import LocalEngine


def test_the_band_check_and_the_validation_are_independent_draws_of_the_same_sampling(tmp_path) -> None:
    make_tiny_qwen2(tmp_path)
    engine = LocalEngine(tmp_path)
    kwargs = ValKwargsConfig(n=4, temperature=1.0, top_p=0.7)
    val = val_sampling_params(kwargs, max_new_tokens=12, eos_id=EOS, seed=21)
    check = val_sampling_params(kwargs, max_new_tokens=12, eos_id=EOS, seed=21, offset=BAND_CHECK_SEED_OFFSET)
    assert (val.n, val.temperature, val.top_p, val.top_k) == (check.n, check.temperature, check.top_p, check.top_k)
    assert val.seed == 21 + VAL_SEED_OFFSET != check.seed

    def draw(params):
        return [r.output_ids for r in engine.generate(PROMPTS, params)]

    assert draw(val) == draw(val)  # each draw is reproducible (the evaluation's default seed)
    differing = sum(a != b for a, b in zip(draw(val), draw(check), strict=True))
    assert differing >= len(PROMPTS) * 4 // 2, differing  # most of the 16 responses differ


def test_accuracy_by_kind_is_the_avg_at_n_of_each_kinds_prompts():
    # What the warm start's band_by_kind reads (issue 63): one skill learnt must not hide another absent.
    from megatron_dapo.collect.heldout import accuracy_by_kind
    from megatron_dapo.collect.types import Group, Sample
    from megatron_dapo.data.datasets import PromptRecord

    def group(kind, accs):
        record = PromptRecord(prompt_ids=[1], messages=[], prompt_text="", ground_truth="1", data_source="d", index=0,
                              extra_info={} if kind is None else {"kind": kind})
        return Group(prompt=record, samples=[Sample(prompt_ids=[1], response_ids=[2], rollout_log_probs=[0.0],
                                                    finish_reason="stop", acc=a) for a in accs])

    groups = [group("add", [1, 0, 0, 0]), group("big_mul", [1, 1, 1, 1]), group("add", [1, 1, 0, 0]), group(None, [1] * 4)]
    assert accuracy_by_kind(groups) == {"add": 0.375, "big_mul": 1.0}
    assert accuracy_by_kind([group(None, [1])]) == {}
