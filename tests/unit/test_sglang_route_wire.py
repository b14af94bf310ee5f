"""SGLang's routed experts on the wire, and the tied lm_head its Qwen3-MoE needs (issue 39).

What sglang 0.5.18 answers (read in its source; the real CPU server: tests/sglang_cpu/test_sglang_routes.py):
``meta_info["routed_experts"]`` base64 int32 [prompt + output - 1, num_hidden_layers, k] for a
finished row, nothing for an aborted one.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from megatron_dapo.rollout.engine import EngineError, SamplingParams
from megatron_dapo.rollout.routes import RouteShape
from megatron_dapo.rollout.sglang.protocol import build_generate_payload, parse_generate_response
from megatron_dapo.rollout.sglang.server import copies_lm_head
from megatron_dapo.rollout.weight_sync import with_lm_head_copy

SHAPE = RouteShape(num_layers=3, moe_layers=(0, 2), top_k=2, num_experts=8)


def _row(ids: np.ndarray | None, output: list[int], reason: str = "length") -> dict:
    meta = {"finish_reason": {"type": reason}, "output_token_logprobs": [[-0.5, t, None] for t in output]}
    if ids is not None:
        meta["routed_experts"] = base64.b64encode(ids.astype(np.int32).tobytes()).decode()
    return {"output_ids": output, "meta_info": meta}


def test_the_request_asks_for_routes_only_when_told():
    params = SamplingParams(n=2, max_new_tokens=4)
    assert "return_routed_experts" not in build_generate_payload([[1, 2]], params, index_offset=0, rid_prefix="r")
    assert build_generate_payload([[1, 2]], params, index_offset=0, rid_prefix="r",
                                  return_routes=True)["return_routed_experts"] is True


def test_a_finished_rows_routes_become_ours_and_an_aborted_row_has_none():
    ids = np.arange(4 * 3 * 2).reshape(4, 3, 2) % 8  # prompt 2 + output 3 - 1 = 4 rows
    rows = [_row(ids, [5, 6, 7]), _row(None, [9], reason="abort")]
    out = parse_generate_response(rows, num_prompts=1, n=2, index_offset=0, engine="e", prompt_lens=[2],
                                  routes=SHAPE)
    assert out[0].routed_experts.dtype == np.uint8
    assert np.array_equal(out[0].routed_experts, ids[:, [0, 2]])  # the MoE layers' columns
    assert out[1].routed_experts is None


@pytest.mark.parametrize(("ids", "message"), [
    (None, "no routed_experts; the server must run with --enable-return-routed-experts"),
    (np.zeros((3, 3, 2)), "row 0: 18 routed-expert ids, expected 4 tokens x 3 layers x top-2 = 24"),
    (np.full((4, 3, 2), 8), "routed-expert ids outside [0, 8)"),
])
def test_missing_short_or_foreign_routes_are_one_engine_error(ids, message):
    with pytest.raises(EngineError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_generate_response([_row(ids, [5, 6, 7])], num_prompts=1, n=1, index_offset=0, engine="e",
                                prompt_lens=[2], routes=SHAPE)


def test_a_tied_qwen3_moe_gets_its_embedding_as_lm_head_and_nothing_else_does(tmp_path):
    for model_type, tied, wanted in (("qwen3_moe", True, True), ("qwen3_moe", False, False), ("qwen2", True, False)):
        d = tmp_path / f"{model_type}-{tied}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type, "tie_word_embeddings": tied}))
        assert copies_lm_head(d) is wanted, (model_type, tied)
    emb, other = torch.ones(4, 2), torch.zeros(2)
    sent = list(with_lm_head_copy(iter([("model.embed_tokens.weight", emb), ("model.norm.weight", other)])))
    assert [n for n, _ in sent] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert sent[1][1] is emb
    # A bucket that already holds the copy (a restart replaying the kept sync) is sent as it is.
    assert len(list(with_lm_head_copy(sent))) == 3


def test_a_fleet_broadcast_also_sends_a_tied_qwen3_moe_its_lm_head():
    """The fleet's broadcast bypasses each server's own update (where the copy was added), so a
    tied Qwen3-MoE fleet served an lm_head nobody loaded (found reading the GPU fleet, 2026-11-29)."""
    from megatron_dapo.rollout.fleet.broadcast import WeightBroadcast

    class Server:
        name, tp_size, lm_head_copy = "sglang0", 1, True

        def __init__(self):
            self.names = []

        def receive_distributed(self, bucket, **kwargs):
            self.names.append([n for n, _ in bucket])

    class Group:
        def broadcast(self, tensors, options):
            class Done:
                def wait(self):
                    pass
            return Done()

    server = Server()
    fleet = WeightBroadcast([server], master_address="127.0.0.1", timeout_s=5)
    fleet._group, fleet._members = Group(), (id(server),)
    fleet.update_weights([("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.zeros(2))])
    assert sorted(server.names[0]) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert fleet.bytes_broadcast == 2 * 4 * 2 * 4 + 2 * 4


def test_eval_refuses_a_tied_qwen3_moe_on_sglang_in_one_line(tmp_path):
    from megatron_dapo.errors import UserError
    from megatron_dapo.rollout.factory import EvalEngineArgs, eval_engine

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "tie_word_embeddings": True}))
    with pytest.raises(UserError, match=r"whose lm_head sglang 0\.5\.18 never ties"):
        eval_engine("sglang", EvalEngineArgs(hf_dir=tmp_path, vocab_size=100, max_batch_size=8, tensor_parallel_size=1,
                                             gpu_memory_utilization=0.5, log_dir=tmp_path))
