"""avg@k / pass@k of `megatron-dapo eval`: the unbiased estimator against counting subsets."""

import itertools
import math

import pytest

from megatron_dapo.evaluate import batches, default_ks, pass_at_k, summarize


@pytest.mark.parametrize(("n", "c"), [(4, 0), (4, 1), (4, 3), (6, 2), (8, 5), (8, 8)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_of_large_n_has_no_overflow():
    # 1 - C(1014, 32) / C(1024, 32), evaluated with exact integers.
    exact = 1 - math.comb(1014, 32) / math.comb(1024, 32)
    assert pass_at_k(1024, 10, 32) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


def test_summary_per_data_source():
    def row(index, source, acc, length, reason="stop"):
        return {"index": index, "data_source": source, "acc": acc, "score": 1.0 if acc else -1.0,
                "response_length": length, "finish_reason": reason}

    rows = [row(0, "aime", True, 10), row(0, "aime", False, 20, "length"),
            row(1, "gsm8k", False, 4), row(1, "gsm8k", False, 6)]
    summary = summarize(rows, n=2, ks=[1, 2])
    assert summary["all"] == {"num_prompts": 2.0, "avg@2": 0.25, "pass@1": 0.25, "pass@2": 0.5, "score/mean": -0.5,
                              "response_length/mean": 10.0, "truncation_rate": 0.25}
    assert summary["aime"]["pass@2"] == 1.0 and summary["gsm8k"]["avg@2"] == 0.0


def test_batches_fill_whole_engine_chunks():
    assert default_ks(32) == [1, 2, 4, 8, 16, 32] and default_ks(6) == [1, 2, 4, 6]
    assert [len(b) for b in batches(40, 4)] == [16, 16, 8]  # 64 rows each, as the trainer's chunks
    assert [len(b) for b in batches(5, 3)] == [5]  # 64 prompts x 3 = 3 whole chunks per batch
    assert [len(b) for b in batches(3, 128)] == [1, 1, 1]
