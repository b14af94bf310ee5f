"""On-policy distillation end to end: a teacher of another architecture scores the student's tokens."""

from __future__ import annotations

import shutil

import pytest
from trainer_utils import read_rows, run_trainer, write_config

pytestmark = pytest.mark.e2e


def test_pure_distillation_from_a_wider_deeper_teacher(tmp_path):
    from megatron_dapo.config import ScratchModelConfig
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.config.preflight import check_teacher
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.errors import UserError
    from megatron_dapo.run import prepare_sources, scratch_checkpoint

    cache = tmp_path / "cache"
    cache.mkdir()
    config = write_config(tmp_path / "tiny.yaml", algorithm={"filter_groups": {"enable": False}})
    sources = prepare_sources(load_config(config), cache)  # the student's task, tokenizer, scratch model
    tokenizer = load_tokenizer(sources["tokenizer"])
    # The teacher: 3 layers of width 96 against the student's 2 of 64, the student's tokenizer.
    shape = ScratchModelConfig(hidden_size=96, num_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=192, max_position_embeddings=88)
    teacher = tmp_path / "teacher"
    shutil.copytree(scratch_checkpoint(shape, tokenizer.vocab_size, seed=11, cache_dir=tmp_path / "t"), teacher)
    shutil.copy(sources["tokenizer"], teacher / "spm.model")

    # A teacher without a row for every student token id is refused before anything starts.
    other = tmp_path / "other"
    shutil.copytree(scratch_checkpoint(shape, tokenizer.vocab_size - 8, seed=11, cache_dir=tmp_path / "o"), other)
    shutil.copy(sources["tokenizer"], other / "spm.model")
    with pytest.raises(UserError, match=rf"algorithm.distill.teacher='.*other': its embedding has "
                                        rf"{tokenizer.vocab_size - 8} rows \(config.json vocab_size\), fewer than"):
        check_teacher(load_config(config, [f"algorithm.distill.teacher={other}"]), tokenizer)
    check_teacher(load_config(config, [f"algorithm.distill.teacher={teacher}"]), tokenizer)

    out = tmp_path / "run"
    proc = run_trainer(config, f"trainer.output_dir={out}", f"algorithm.distill.teacher={teacher}",
                       "trainer.val_before_train=false", "trainer.test_freq=0", cache_dir=cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["timing_s/teacher"] > 0
        # Two random models: near-uniform log-probs, and a reverse KL that is positive (its estimate
        # on the student's own samples; measured 0.05).
        assert row["distill/teacher_logprob"] < -1.0 and row["distill/reverse_kl"] > 0
        # Pure distillation: the update follows the teacher's signal, clipped like any advantage.
        assert row["actor/grad_norm"] > 0
