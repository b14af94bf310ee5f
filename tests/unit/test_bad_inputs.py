"""A hostile user's inputs: each bad config, CLI argument, reward, prompt file, HF checkpoint
or resume checkpoint ends in ONE line naming it, exit code 2, no traceback.

Every case runs the real CLI in-process (`megatron-dapo config validate ...` and friends), which
reads what `train` would read first (megatron_dapo/config/preflight.py), so the table stays fast.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest

from megatron_dapo import cli

ROWS = [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}]
GOOD_JSONL = json.dumps(ROWS[0]) + "\n"


def _jsonl(*rows: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _safetensors_header(header: dict) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


# Eight aliases, each nine of the one before: 9^8 = 43 million strings once expanded.
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh"))
FLOW_BOMB = "[&a [x, x, x, x, x, x, x, x, x], " + ", ".join(
    f"&{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefg", "bcdefgh")) + "]"

LONG = "x" * 5000
DEEP_JSON = '{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}"
DEEP_ROW = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}\n'
# A 600 KB string used 12 times through an alias: 7 MB of YAML text would be over the file bound,
# the aliases are not, and the expanded strings pass 8 MiB.
LONG_ALIASES = f"trainer:\n  experiment_name: &s {'y' * 600_000}\ndata:\n  train_files: [{', '.join(['*s'] * 14)}]\n"

# (id, files {name: text|bytes} written under the case dir, argv after "megatron-dapo",
#  expected message fragment). In argv, files and expectations, {d} is the case dir, {hf} a
# valid tiny HF checkpoint and {tok} a tokenizer; c.yaml defaults to a one-line valid config.
DATA = ["model.hf_checkpoint={hf}", "model.tokenizer={tok}"]
# The embedded task whose tokenizer has the tags format's markers (examples/tiny_tools_cpu.yaml's mix).
TOOL_TASK = ["data.embedded.big_mul=0.4", "data.embedded.mul=0.0", "data.embedded.two_step=0.0"]
CASES: list[tuple[str, dict[str, str | bytes | None], list[str], str]] = [
    # ------------------------------------------------------------------ configs
    ("yaml-duplicate-section", {"c.yaml": "optim: {lr: 3.0e-4}\ntrainer: {seed: 1}\noptim: {lr: 1.0e-6}\n"},
     ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml line 3: duplicate key 'optim' (first at line 1); merge the two into one"),
    ("yaml-duplicate-key", {"c.yaml": "optim:\n  lr: 1.0\n  lr: 2.0\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml line 3: duplicate key 'lr' (first at line 2); merge the two into one"),
    ("yaml-duplicate-in-override", {}, ["config", "validate", "{d}/c.yaml", "optim={{lr: 1, lr: 2}}"],
     "command line: cannot parse the value of 'optim': line 1: duplicate key 'lr' (first at line 1)"),
    ("yaml-empty", {"c.yaml": ""}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: the file is empty (or only comments); start from examples/tiny_cpu.yaml"),
    ("yaml-only-comments", {"c.yaml": "# all defaults?\n"}, ["config", "show", "{d}/c.yaml"],
     "{d}/c.yaml: the file is empty (or only comments)"),
    ("yaml-not-utf8", {"c.yaml": b"trainer:\n  experiment_name: caf\xe9\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml line 2: not UTF-8 (byte 0xe9); save the file as UTF-8"),
    ("yaml-invalid", {"c.yaml": "model: {hf_checkpoint: [x\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml line 2: invalid YAML: expected ',' or ']'"),
    # Bounded reading (issue 42): an alias bomb under a known key grew memory without limit (the
    # message quoted its repr), 3,000-deep nesting was a RecursionError, a 5,000-digit integer
    # Python's conversion error, a 50 MB file took minutes.
    ("yaml-alias-bomb", {"c.yaml": BOMB + "data:\n  train_files: *h\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: the YAML expands to more than 100,000 values"),
    ("yaml-alias-bomb-other-key", {"c.yaml": BOMB + "optim:\n  lr: *h\n"}, ["config", "show", "{d}/c.yaml"],
     "{d}/c.yaml: the YAML expands to more than 100,000 values"),
    ("yaml-alias-bomb-in-override", {}, ["config", "validate", "{d}/c.yaml", "rollout.top_k=" + FLOW_BOMB],
     "command line: the value of 'rollout.top_k': the YAML expands to more than 100,000 values"),
    ("yaml-nested-3000", {"c.yaml": "trainer: " + "[" * 3000 + "]" * 3000 + "\n"},
     ["config", "validate", "{d}/c.yaml"], "{d}/c.yaml: nested deeper than the 64 levels a config may have"),
    ("yaml-nested-in-override", {}, ["config", "validate", "{d}/c.yaml", "trainer.seed=" + "[" * 200 + "]" * 200],
     "command line: the value of 'trainer.seed': nested deeper than the 64 levels"),
    ("yaml-integer-5000-digits", {"c.yaml": "trainer:\n  seed: " + "9" * 5000 + "\n"},
     ["config", "validate", "{d}/c.yaml"], "{d}/c.yaml: an integer of more than 4300 digits"),
    ("yaml-integer-5000-digits-override", {}, ["config", "validate", "{d}/c.yaml", "optim.lr=" + "7" * 5000],
     "command line: the value of 'optim.lr': an integer of more than 4300 digits"),
    ("yaml-file-2mb", {"c.yaml": "trainer: {seed: 1}\n" + ("# padding\n" * 220_000)}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: 2.1 MiB, more than the 1 MiB a config may have"),
    ("yaml-huge-value-quoted-short", {"c.yaml": "rollout:\n  engine: " + "x" * 500_000 + "\n"},
     ["config", "validate", "{d}/c.yaml"], "rollout.engine='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxx"),
    ("yaml-top-level-list", {"c.yaml": "- a\n- b\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: the top level must be a mapping of sections"),
    ("scratch-family-unknown", {}, ["config", "validate", "{d}/c.yaml", "model.scratch.family=mixtral"],
     "command line: model.scratch.family='mixtral': must be one of 'qwen2', 'qwen3_moe', got 'mixtral'"),
    # Issue 42: validate passed these and train refused them (the last three with a traceback per rank).
    ("expert-parallel-on-a-dense-model", {}, ["config", "validate", "{d}/c.yaml",
                                              "parallel.expert_model_parallel_size=2", "--world-size", "2"],
     "parallel.expert_model_parallel_size=2 needs a mixture-of-experts model, but model.scratch is dense; set it to 1"),
    ("moe-aux-loss-on-a-dense-model", {}, ["config", "validate", "{d}/c.yaml", "model.moe_aux_loss_coeff=0.01"],
     "model.moe_aux_loss_coeff=0.01 applies to mixture-of-experts models only; model.scratch is dense: set it to 0"),
    ("expert-parallel-not-dividing-experts", {}, ["config", "validate", "{d}/c.yaml", "model.scratch.family=qwen3_moe",
                                                  "model.scratch.num_experts=8", "model.scratch.num_experts_per_tok=2",
                                                  "parallel.expert_model_parallel_size=3", "--world-size", "3"],
     "parallel.expert_model_parallel_size=3 does not divide num_experts=8 of model.scratch; use one of [1, 2, 4, 8]"),
    ("expert-layout-not-dividing-the-world", {}, ["config", "validate", "{d}/c.yaml", "model.scratch.family=qwen3_moe",
                                                  "model.scratch.num_experts=8", "model.scratch.num_experts_per_tok=2",
                                                  "parallel.expert_model_parallel_size=4", "--world-size", "6"],
     "parallel: EP x ETP x PP = 4x1x1 = 4 does not divide the world size 6 (--world-size)"),
    ("hf-checkpoint-without-train-files", {}, ["config", "validate", "{d}/c.yaml", *DATA],
     "data.train_files is empty and model.hf_checkpoint is set; give prompt files"),
    ("scratch-moe-topk-above-experts", {}, ["config", "validate", "{d}/c.yaml", "model.scratch.family=qwen3_moe",
                                             "model.scratch.num_experts=4", "model.scratch.num_experts_per_tok=6"],
     "command line: model.scratch.num_experts_per_tok=6: must be in [1, num_experts=4]"),
    ("scratch-moe-dense-layer-outside", {}, ["config", "validate", "{d}/c.yaml", "model.scratch.family=qwen3_moe",
                                              "model.scratch.mlp_only_layers=[0,7]"],
     "command line: model.scratch.mlp_only_layers=[0, 7]: has [7], outside the layers [0, 4)"),
    ("scratch-moe-tp-without-sp", {}, ["config", "validate", "{d}/c.yaml", "model.scratch.family=qwen3_moe",
                                       "parallel.tensor_model_parallel_size=2"],
     "command line: model.scratch.family='qwen3_moe' conflicts with {d}/c.yaml: parallel.sequence_parallel: "
     "must be true with parallel.tensor_model_parallel_size=2 for a mixture-of-experts model "
     "(model.scratch.family=qwen3_moe; megatron-core's MoE layer needs it at TP > 1); set "
     "parallel.sequence_parallel=true"),
    ("yaml-missing-file", {}, ["config", "validate", "{d}/nope.yaml"],
     "{d}/nope.yaml: no such config file; pick one of examples/*.yaml"),
    ("lr-inf-in-file", {"c.yaml": "optim: {lr: .inf}\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: optim.lr=inf: expected a finite number, got inf"),
    ("lr-nan-override", {}, ["config", "validate", "{d}/c.yaml", "optim.lr=.nan"],
     "command line: optim.lr=nan: expected a finite number, got nan"),
    ("lr-decay-style", {}, ["config", "validate", "{d}/c.yaml", "optim.lr_decay_style=step"],
     "command line: optim.lr_decay_style='step': must be one of 'constant', 'linear', 'cosine', got 'step'"),
    ("lr-decay-steps-inside-warmup", {}, ["config", "validate", "{d}/c.yaml", "optim.lr_warmup_steps=4",
                                          "optim.lr_decay_steps=2"],
     "command line: optim.lr_decay_steps=2: must be > lr_warmup_steps=4 (or null: the run's last optimizer step)"),
    ("clip-minus-inf", {}, ["config", "validate", "{d}/c.yaml", "algorithm.clip_ratio_high=-.inf"],
     "command line: algorithm.clip_ratio_high=-inf: expected a finite number, got -inf"),
    ("reward-timeout-inf", {}, ["config", "validate", "{d}/c.yaml", "reward.timeout_s=.inf"],
     "command line: reward.timeout_s=inf: expected a finite number, got inf"),
    ("rollout-temperature-0", {}, ["config", "validate", "{d}/c.yaml", "rollout.temperature=0"],
     "command line: rollout.temperature=0: must be > 0 for training rollouts (the actor divides logits by it)"),
    ("output-dir-empty", {}, ["config", "validate", "{d}/c.yaml", "trainer.output_dir="],
     "command line: trainer.output_dir='': is empty: give a run directory"),
    ("output-dir-blank", {"c.yaml": "trainer: {output_dir: '  '}\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: trainer.output_dir='  ': is empty"),
    ("train-files-empty-name", {}, ["config", "validate", "{d}/c.yaml", "data.train_files=['']"],
     "command line: data.train_files=['']: holds an empty file name"),
    ("val-files-empty-name", {"c.yaml": "data: {val_files: [a.jsonl, '']}\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: data.val_files=['a.jsonl', '']: holds an empty file name"),
    ("resume-empty", {}, ["config", "validate", "{d}/c.yaml", "trainer.resume="],
     "command line: trainer.resume='': is empty: use auto, disable or a checkpoint path"),
    ("unknown-section", {"c.yaml": "optimizer: {lr: 1.0}\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: optimizer: unknown key; did you mean 'optim'?"),
    ("unknown-key-override", {}, ["config", "validate", "{d}/c.yaml", "optim.learning_rate=1"],
     "command line: optim.learning_rate: unknown key"),
    ("int-as-string", {"c.yaml": "trainer: {total_training_steps: ten}\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: trainer.total_training_steps='ten': expected an integer, got str 'ten'"),
    ("bool-as-int", {}, ["config", "validate", "{d}/c.yaml", "trainer.seed=true"],
     "command line: trainer.seed=True: expected an integer, got bool True"),
    ("steps-zero", {}, ["config", "validate", "{d}/c.yaml", "trainer.total_training_steps=0"],
     "command line: trainer.total_training_steps=0: must be > 0"),
    ("engine-typo", {}, ["config", "validate", "{d}/c.yaml", "rollout.engine=sglng"],
     "did you mean 'sglang'?"),
    ("section-as-scalar", {"c.yaml": "optim: 0.1\n"}, ["config", "validate", "{d}/c.yaml"],
     "{d}/c.yaml: optim=0.1: expected a mapping of OptimConfig fields, got 0.1"),
    ("gen-below-train-batch", {}, ["config", "validate", "{d}/c.yaml", "data.gen_batch_size=1"],
     "data.gen_batch_size=1: must be >= train_batch_size"),
    ("tp-does-not-divide-heads", {}, ["config", "validate", "{d}/c.yaml", "parallel.tensor_model_parallel_size=3"],
     "parallel.tensor_model_parallel_size=3 does not divide num_attention_heads"),
    ("train-batch-huge-does-not-hang", {}, ["config", "show", "{d}/c.yaml", "data.train_batch_size=1000000000001",
                                            "data.gen_batch_size=1000000000001"],
     "command line: data.train_batch_size=1000000000001 conflicts with {d}/c.yaml: trainer.ppo_mini_batch_size: "
     "must divide data.train_batch_size=1000000000001 (choose one of [1, 73, 137, 10001, "),
    ("cross-rule-names-the-overridden-key", {"c.yaml": "data: {gen_batch_size: 32, train_batch_size: 16}\n"
                                             "trainer: {ppo_mini_batch_size: 8}\n"},
     ["config", "validate", "{d}/c.yaml", "data.train_batch_size=64"],
     "command line: data.train_batch_size=64 conflicts with {d}/c.yaml: data.gen_batch_size=32: must be >= "
     "train_batch_size=64"),
    ("microbatch-budget-below-one-sequence", {}, ["config", "validate", "{d}/c.yaml",
                                                  "trainer.max_tokens_per_microbatch=1000"],
     "command line: trainer.max_tokens_per_microbatch=1000 is below one sequence (data.max_prompt_length + "
     "data.max_response_length = 22528); raise it to at least 22528"),
    # ------------------------------------------------------------------ command line
    ("cli-world-size-0", {}, ["config", "validate", "{d}/c.yaml", "--world-size", "0"],
     "argument --world-size: must be >= 1 (the number of processes), got 0"),
    ("cli-world-size-negative", {}, ["config", "validate", "{d}/c.yaml", "--world-size", "-2"],
     "argument --world-size: must be >= 1 (the number of processes), got -2"),
    ("cli-world-size-text", {}, ["config", "validate", "{d}/c.yaml", "--world-size", "two"],
     "argument --world-size: expected a whole number of processes, got 'two'"),
    ("cli-world-size-indivisible", {}, ["config", "validate", "{d}/c.yaml", "--world-size", "3",
                                        "parallel.tensor_model_parallel_size=2"],
     "does not divide the world size 3 (--world-size); launch a multiple of 2 processes"),
    ("cli-intermixed-override-is-read", {}, ["config", "validate", "{d}/c.yaml", "--world-size", "2",
                                             "optim.lr=.inf"],
     "command line: optim.lr=inf: expected a finite number, got inf"),
    ("cli-nodes-mismatch", {}, ["config", "validate", "{d}/c.yaml", "trainer.n_gpus_per_node=4", "--world-size", "2"],
     "trainer.nnodes x trainer.n_gpus_per_node = 1x4 but the launcher started 2 processes (--world-size)"),
    ("cli-dp-rank-without-sequences", {}, ["config", "validate", "{d}/c.yaml", "--world-size", "16",
                                           "trainer.ppo_mini_batch_size=1", "rollout.n=4"],
     "trainer.ppo_mini_batch_size x rollout.n = 1x4 = 4 sequences per mini-batch, fewer than the data-parallel "
     "size 16 at world size 16 (--world-size): some ranks would get none; raise trainer.ppo_mini_batch_size to "
     "at least 4 or launch fewer processes"),
    ("cli-unknown-flag", {}, ["config", "validate", "{d}/c.yaml", "--bogus"],
     "megatron-dapo: error: unrecognized arguments: --bogus"),
    ("cli-no-command", {}, [], "megatron-dapo: error: the following arguments are required: command"),
    ("cli-bad-command", {}, ["trian", "{d}/c.yaml"], "argument command: invalid choice: 'trian'"),
    ("cli-config-no-action", {}, ["config"], "the following arguments are required: action"),
    ("cli-validate-no-file", {}, ["config", "validate"], "the following arguments are required: file"),
    ("cli-override-no-equals", {}, ["config", "validate", "{d}/c.yaml", "optim.lr"],
     "command line: bad override 'optim.lr'; expected dotted.key=value"),
    ("cli-override-empty-part", {}, ["config", "validate", "{d}/c.yaml", "optim..lr=1"],
     "command line: bad override 'optim..lr=1'"),
    ("cli-override-into-value", {}, ["config", "validate", "{d}/c.yaml", "optim=1", "optim.lr=2"],
     "command line: cannot set optim.lr: optim is a value, not a section"),
    ("cli-override-unparsable", {}, ["config", "validate", "{d}/c.yaml", "optim.lr=[1"],
     "command line: cannot parse the value of 'optim.lr'"),
    ("cli-convert-missing-args", {}, ["convert", "mcore-to-hf"], "the following arguments are required: --ckpt"),
    # Issue 42: NotADirectoryError / OSError tracebacks after the model was read.
    ("convert-out-is-a-file", {"out": "x"}, ["convert", "hf-to-mcore", "--hf", "{hf}", "--out", "{d}/out"],
     "--out {d}/out is a file; pass a path for a new directory"),
    ("convert-out-under-a-file", {"f": "x"}, ["convert", "hf-to-mcore", "--hf", "{hf}", "--out", "{d}/f/out"],
     "--out {d}/f/out cannot be created: {d}/f is a file; pass another --out"),
    # ------------------------------------------------------------------ rewards
    ("reward-builtin-typo", {}, ["config", "validate", "{d}/c.yaml", "reward.reward_fn=math_dap"],
     "reward function 'math_dap' is not a built-in and not 'module:function'"),
    ("reward-module-missing", {}, ["config", "validate", "{d}/c.yaml", "reward.reward_fn=no_such_mod_18:f"],
     "reward function 'no_such_mod_18:f': module 'no_such_mod_18' not found"),
    ("reward-no-attribute", {"rw_noattr.py": "def g(a, b, extra_info=None):\n    return 1.0\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_noattr:f"],
     "module 'rw_noattr' has no attribute 'f'"),
    ("reward-not-callable", {"rw_notcall.py": "f = 3\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_notcall:f"],
     "rw_notcall.f is of type int, not callable"),
    ("reward-bad-signature", {"rw_sig.py": "def f(a):\n    return 1.0\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_sig:f"],
     "cannot be called as f(solution_str, ground_truth, extra_info=...)"),
    ("reward-raises-on-import", {"rw_raise.py": "raise RuntimeError('no GPU here')\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_raise:f"],
     "importing 'rw_raise' raised RuntimeError: no GPU here; fix the module so that it imports cleanly"),
    ("reward-exits-on-import", {"rw_exit.py": "import sys\nsys.exit(3)\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_exit:f"],
     "importing 'rw_exit' raised SystemExit: 3; fix the module so that it imports cleanly"),
    ("reward-syntax-error", {"rw_syntax.py": "def f(:\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_syntax:f"],
     "importing 'rw_syntax' raised SyntaxError"),
    ("reward-missing-dependency", {"rw_dep.py": "import not_installed_pkg_18\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_dep:f"],
     "importing 'rw_dep' failed: No module named 'not_installed_pkg_18'"),
    # ------------------------------------------------------------------ custom tools
    ("tool-module-missing", {}, ["config", "validate", "{d}/c.yaml", "tools.enable=true", *TOOL_TASK,
                                 "algorithm.filter_groups.mode=rounds", "tools.tools=['calculator=no_such_tool_mod_18:f']"],
     "tool 'no_such_tool_mod_18:f': module 'no_such_tool_mod_18' not found"),
    ("tool-not-callable", {"tl_notcall.py": "f = 3\n"},
     ["config", "validate", "{d}/c.yaml", "tools.enable=true", *TOOL_TASK, "algorithm.filter_groups.mode=rounds",
      "tools.tools=[calculator=tl_notcall:f]"],
     "tool 'tl_notcall:f': tl_notcall.f is of type int, not callable; point the spec at a function f(argument: str)"),
    # ------------------------------------------------------------------ prompt data
    ("data-not-utf8", {"p.jsonl": b'{"prompt": "caf\xe9", "answer": "1"}\n'},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8"),
    ("data-invalid-json", {"p.jsonl": GOOD_JSONL + '{"prompt": \n'},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 2: invalid JSON"),
    ("data-missing-file", {}, ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/none.jsonl]"],
     "prompt file {d}/none.jsonl does not exist; check data.train_files / data.val_files"),
    ("data-bad-extension", {"p.csv": "prompt,answer\n"},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.csv]"],
     "prompt file {d}/p.csv has extension '.csv'; use a .jsonl or .parquet file"),
    ("data-truncated-parquet", {"p.parquet": "PARQUET_TRUNCATED"},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.parquet]"],
     "prompt file {d}/p.parquet cannot be read as parquet ("),
    ("data-not-parquet", {"p.parquet": "just text\n"},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.parquet]"],
     "the file is truncated or corrupted: copy or export it again"),
    ("data-empty-file", {"p.jsonl": "\n"},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "prompt file {d}/p.jsonl has no rows"),
    ("data-no-prompt", {"p.jsonl": _jsonl({"question": "1+1?", "answer": "2"})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: row has no 'prompt' field"),
    ("data-plain-no-answer", {"p.jsonl": _jsonl({"prompt": "1+1?"})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: plain row (string 'prompt') has no 'answer' field"),
    ("data-empty-messages", {"p.jsonl": _jsonl({"prompt": [], "reward_model": {"ground_truth": "2"}})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: 'prompt' is an empty list"),
    ("data-answer-is-list", {"p.jsonl": _jsonl({"prompt": "1+1?", "answer": [2]})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "is not a string or number"),
    ("data-extra-info-not-object", {"p.jsonl": _jsonl({**ROWS[0], "extra_info": [1]})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: 'extra_info' = [1] is not an object"),
    ("data-source-not-string", {"p.jsonl": _jsonl({**ROWS[0], "data_source": 7})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: 'data_source' = 7 is not a string"),
    ("data-bad-val-file", {"p.jsonl": GOOD_JSONL, "v.jsonl": "not json\n"},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]", "data.val_files=[{d}/v.jsonl]"],
     "{d}/v.jsonl line 1: invalid JSON"),
    # A scratch model reads prompt files with the embedded task's tokenizer, as train does.
    ("data-scratch-model-too-few", {"p.jsonl": GOOD_JSONL},
     ["config", "validate", "{d}/c.yaml", "data.train_files=[{d}/p.jsonl]"],
     "data.train_files (1 file(s)) holds 1 usable prompt(s), fewer than data.train_batch_size=512"),
    ("data-tokenizer-missing", {"p.jsonl": GOOD_JSONL},
     ["config", "validate", "{d}/c.yaml", "model.tokenizer={d}/tok", "data.train_files=[{d}/p.jsonl]"],
     "tokenizer path {d}/tok is neither a sentencepiece .model file nor a local directory"),
    ("data-prompt-empty-string", {"p.jsonl": _jsonl({"prompt": "", "answer": "1"})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: 'prompt' is an empty string; give the question or drop the row"),
    ("data-messages-all-empty", {"p.jsonl": _jsonl({"prompt": [{"role": "user", "content": "  "}],
                                                     "reward_model": {"ground_truth": "2"}})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: every message of 'prompt' has empty 'content'"),
    ("data-answer-nan", {"p.jsonl": '{"prompt": "1+1?", "answer": NaN}\n'},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: 'answer' = nan is not a finite number (a missing answer?)"),
    ("data-answer-empty", {"p.jsonl": _jsonl({"prompt": "1+1?", "answer": " "})},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: 'answer' is empty; give the reference answer or drop the row"),
    ("data-directory-as-file", {"pdir/p.jsonl": GOOD_JSONL},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/pdir]"],
     "prompt file {d}/pdir is a directory; data.train_files / data.val_files: list the .jsonl/.parquet files"),
    ("data-fewer-prompts-than-batch", {"p.jsonl": _jsonl(*(ROWS * 3))},
     ["config", "validate", "{d}/c.yaml", *DATA, "data.train_files=[{d}/p.jsonl]", "data.train_batch_size=16",
      "data.gen_batch_size=32", "trainer.ppo_mini_batch_size=8"],
     "data.train_files (1 file(s)) holds 3 usable prompt(s), fewer than data.train_batch_size=16: every batch "
     "would repeat prompts; add prompts or lower data.train_batch_size"),
    ("embedded-space-too-small", {}, ["config", "validate", "{d}/c.yaml",
                                      "data.embedded={{add: 1.0, sub: 0.9, mul: 0, two_step: 0, max_digits: 1}}"],
     "data.embedded: could draw only 155 of 200 distinct arithmetic problems"),
    ("embedded-fewer-prompts-than-batch", {}, ["config", "validate", "{d}/c.yaml", "data.embedded.num_train=10"],
     "data.embedded.num_train holds 10 usable prompt(s), fewer than data.train_batch_size=512"),
    ("cache-dir-is-a-file", {"cachefile": "x", "$MEGATRON_DAPO_CACHE": "{d}/cachefile"},
     ["config", "validate", "{d}/c.yaml"],
     "MEGATRON_DAPO_CACHE='{d}/cachefile' is a file, not a directory; point MEGATRON_DAPO_CACHE at a writable "
     "directory"),
    # ------------------------------------------------------------------ run directory, device, engines
    ("output-dir-lock-is-a-directory", {"out/.run.lock/x": "x"},
     ["config", "validate", "{d}/c.yaml", "trainer.output_dir={d}/out"],
     "trainer.output_dir='{d}/out': {d}/out/.run.lock is a directory, not a trainer's lock file; remove it"),
    ("output-dir-is-a-file", {"out": "x"}, ["config", "validate", "{d}/c.yaml", "trainer.output_dir={d}/out"],
     "trainer.output_dir='{d}/out' is a file, not a directory; pick another trainer.output_dir"),
    ("output-dir-under-a-file", {"out": "x"}, ["config", "validate", "{d}/c.yaml", "trainer.output_dir={d}/out/run"],
     "trainer.output_dir='{d}/out/run' cannot be created: {d}/out is a file"),
    ("device-cuda-without-gpu", {}, ["config", "validate", "{d}/c.yaml", "trainer.device=cuda"],
     "trainer.device=cuda but this process sees no CUDA GPU (torch.cuda.is_available() is False); use "
     "trainer.device=cpu (or auto)"),
    ("engine-vllm-not-installed", {}, ["config", "validate", "{d}/c.yaml", "rollout.engine=vllm"],
     "rollout.engine=vllm: vLLM is not installed in "),
    ("engine-sglang-not-installed", {}, ["config", "validate", "{d}/c.yaml", "rollout.engine=sglang"],
     "rollout.engine=sglang: SGLang is neither importable in "),
    ("reward-hangs", {"rw_hang.py": "import time\ndef f(s, gt, extra_info=None):\n    time.sleep(60)\n"},
     ["config", "validate", "{d}/c.yaml", "reward.reward_fn=rw_hang:f", "reward.timeout_s=1"],
     "reward function 'rw_hang:f' did not return within reward.timeout_s=1 s on a probe call"),
    ("eval-engine-not-installed", {}, ["eval", "{hf}", "--data", "{d}/p.jsonl", "--engine", "vllm"],
     "--engine=vllm: vLLM is not installed in "),
    ("eval-out-is-a-directory", {"outdir/x": "x"}, ["eval", "{hf}", "--data", "{d}/p.jsonl", "--out", "{d}/outdir"],
     "--out {d}/outdir is a directory; pass a file path such as {d}/outdir/responses.jsonl"),
    ("eval-out-under-a-file", {"f": "x"}, ["eval", "{hf}", "--data", "{d}/p.jsonl", "--out", "{d}/f/r.jsonl"],
     "--out {d}/f/r.jsonl cannot be created: {d}/f is a file; pass another --out"),
    ("eval-data-missing", {}, ["eval", "{hf}", "--data", "{d}/none.jsonl", "--tokenizer", "{tok}", "--out",
                               "{d}/r.jsonl"],
     "prompt file {d}/none.jsonl does not exist; check --data"),
    # Issue 42: a NaN temperature and top-k 0 were tracebacks; --n 100000 ran unannounced.
    ("eval-temperature-nan", {"p.jsonl": GOOD_JSONL}, ["eval", "{hf}", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}",
                                                       "--temperature", "nan", "--out", "{d}/r.jsonl"],
     "--temperature nan: must be a finite number >= 0 (0 = greedy)"),
    ("eval-top-k-0", {"p.jsonl": GOOD_JSONL}, ["eval", "{hf}", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}",
                                               "--top-k", "0", "--out", "{d}/r.jsonl"],
     "--top-k 0: must be -1 (off) or >= 1"),
    ("eval-n-unbounded", {"p.jsonl": GOOD_JSONL}, ["eval", "{hf}", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}",
                                                   "--n", "100000", "--out", "{d}/r.jsonl"],
     "--n 100000: at most 1024 responses per prompt"),
    ("eval-half-written-checkpoint", {"ckpt/.tmp-step_3/dist/x": "x"},
     ["eval", "{d}/ckpt/.tmp-step_3", "--data", "{d}/p.jsonl"],
     "no checkpoint at {d}/ckpt/.tmp-step_3: manifest.json is missing (an unfinished save: use an earlier "
     "checkpoint)"),
    # ------------------------------------------------------------------ HF checkpoints
    ("hf-without-tokenizer", {}, ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={hf}"],
     "{hf} has no tokenizer files (none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, "
     "spiece.model); copy the model's tokenizer files into it or set model.tokenizer"),
    ("hf-int32-weights", {"hf/config.json": "COPY_HF_CONFIG", "hf/model.safetensors": "HF_WEIGHTS_EMBED_INT32"},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf", "model.tokenizer={tok}"],
     "does not match its config.json (Qwen2ForCausalLM): 1 not floating point (F32/BF16/F16/F64): "
     "model.embed_tokens.weight I32"),
    ("hf-wrong-model-type", {"hf/config.json": "HF_CONFIG_AS_LLAMA", "hf/model.safetensors": "HF_WEIGHTS"},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf", "model.tokenizer={tok}"],
     "does not match its config.json (LlamaForCausalLM): 3 unexpected: model.layers.0.self_attn.k_proj.bias"),
    ("hf-missing-dir", {}, ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint=/nonexistent/model"],
     "model.hf_checkpoint='/nonexistent/model' is not a directory; point it at an HF model directory"),
    ("hf-no-config", {"hf/model.safetensors": _safetensors_header({})},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf"], "config.json"),
    ("hf-config-not-json", {"hf/config.json": "{model_type: qwen2"},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf"], "cannot read {d}/hf/config.json: Expecting property name"),
    ("hf-unsupported-family", {"hf/config.json": json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf"],
     "has model_type='gpt2', architectures=['GPT2LMHeadModel']; supported model types are"),
    ("hf-corrupt-shard-header", {"hf/config.json": "COPY_HF_CONFIG", "hf/model.safetensors": b"\xff" * 64},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf"],
     "{d}/hf/model.safetensors is truncated or not a safetensors file"),
    ("hf-no-weights", {"hf/config.json": "COPY_HF_CONFIG"},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf"],
     "HF checkpoint {d}/hf has no *.safetensors files"),
    ("hf-index-missing-shard", {"hf/config.json": "COPY_HF_CONFIG", "hf/model.safetensors.index.json":
                                json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={d}/hf"],
     "lists shard files that are missing: ['model-00001-of-00002.safetensors']; the download is incomplete"),
    # Issue 42: eval skipped the checks above (transformers' tracebacks, or random weights loaded).
    ("eval-hf-int32-weights", {"hf/config.json": "COPY_HF_CONFIG", "hf/model.safetensors": "HF_WEIGHTS_EMBED_INT32",
                               "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/hf", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "does not match its config.json (Qwen2ForCausalLM): 1 not floating point (F32/BF16/F16/F64): "
     "model.embed_tokens.weight I32"),
    ("eval-hf-wrong-model-type", {"hf/config.json": "HF_CONFIG_AS_LLAMA", "hf/model.safetensors": "HF_WEIGHTS",
                                  "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/hf", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "does not match its config.json (LlamaForCausalLM): 3 unexpected: model.layers.0.self_attn.k_proj.bias"),
    ("eval-hf-corrupt-shard", {"hf/config.json": "COPY_HF_CONFIG", "hf/model.safetensors": b"\xff" * 64,
                               "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/hf", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "{d}/hf/model.safetensors is truncated or not a safetensors file"),
    # ------------------------------------------------------------------ resume checkpoints
    ("resume-missing", {}, ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "no checkpoint at {d}/ckpt/step_3: the directory does not exist; pass a step_<N> directory"),
    ("resume-incomplete", {"ckpt/step_3/dist/x": "x"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "no checkpoint at {d}/ckpt/step_3: manifest.json is missing"),
    ("resume-bad-manifest", {"ckpt/step_3/manifest.json": "{", "ckpt/step_3/dist/x": "x"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "{d}/ckpt/step_3/manifest.json is corrupted (Expecting property name"),
    ("resume-future-format", {"ckpt/step_3/manifest.json": json.dumps({"format_version": 99}),
                              "ckpt/step_3/dist/x": "x"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "format_version 99 in {d}/ckpt/step_3/manifest.json, this megatron-dapo reads 1"),
    ("resume-corrupted", {"ckpt/step_3/MARK": "FAKE_CKPT_CORRUPT"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "checkpoint {d}/ckpt/step_3: dist/__0_0.distcp does not match its checksum (corrupted on disk or in a copy); "
     "use an earlier checkpoint"),
    ("resume-auto-corrupted-latest", {"run/checkpoints/step_3/MARK": "FAKE_CKPT_CORRUPT"},
     ["config", "validate", "{d}/c.yaml", "trainer.output_dir={d}/run"],
     "checkpoint {d}/run/checkpoints/step_3: dist/__0_0.distcp does not match its checksum"),
    ("resume-other-model", {"ckpt/step_3/MARK": "FAKE_CKPT_WIDER"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "checkpoint {d}/ckpt/step_3 does not match the configured model: hidden_size="),
    ("resume-tp2-of-a-tp1-checkpoint", {"ckpt/step_3/MARK": "FAKE_CKPT"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3", "parallel.tensor_model_parallel_size=2"],
     "checkpoint {d}/ckpt/step_3 was saved at tensor_model_parallel_size=1, where Megatron pads the vocabulary of "
     "320 to 384 rows; at parallel.tensor_model_parallel_size=2 it pads to 512, which the saved embedding cannot "
     "load into; resume at parallel.tensor_model_parallel_size=1"),
    # ------------------------------------------------------------------ issue 59: fifth round
    # Paths the file system cannot take (OSError "File name too long" wherever the run touched them).
    ("path-too-long-hf-checkpoint", {}, ["config", "validate", "{d}/c.yaml", f"model.hf_checkpoint={{d}}/{LONG}"],
     "longest name is 5000 bytes; the file system takes at most 4096 bytes a path and 255 a name"),
    ("path-too-long-output-dir", {}, ["config", "validate", "{d}/c.yaml", f"trainer.output_dir={{d}}/{LONG}"],
     "command line: trainer.output_dir='"),
    ("path-too-long-tokenizer", {}, ["config", "validate", "{d}/c.yaml", f"model.tokenizer={{d}}/{LONG}"],
     "command line: model.tokenizer='"),
    ("path-too-long-train-files", {}, ["config", "validate", "{d}/c.yaml", *DATA, f"data.train_files=[{{d}}/{LONG}]"],
     "command line: data.train_files=['"),
    # JSON nested past the decoder's depth (RecursionError).
    ("data-row-nested-too-deep", {"p.jsonl": DEEP_ROW}, ["config", "validate", "{d}/c.yaml", *DATA,
                                                          "data.train_files=[{d}/p.jsonl]"],
     "{d}/p.jsonl line 1: JSON nested too deeply to read"),
    ("eval-data-row-nested-too-deep", {"p.jsonl": DEEP_ROW},
     ["eval", "{hf}", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "{d}/p.jsonl line 1: JSON nested too deeply to read"),
    ("hf-config-nested-too-deep", {"hf/config.json": DEEP_JSON}, ["config", "validate", "{d}/c.yaml",
                                                                    "model.hf_checkpoint={d}/hf"],
     "cannot read {d}/hf/config.json: maximum recursion depth exceeded"),
    ("eval-hf-config-nested-too-deep", {"hf/config.json": DEEP_JSON, "hf/model.safetensors": "HF_WEIGHTS",
                                        "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/hf", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "{d}/hf/config.json is not valid JSON (maximum recursion depth exceeded"),
    ("convert-hf-config-nested-too-deep", {"hf/config.json": DEEP_JSON, "hf/model.safetensors": "HF_WEIGHTS"},
     ["convert", "hf-to-mcore", "--hf", "{d}/hf", "--out", "{d}/out"],
     "{d}/hf/config.json is not valid JSON (maximum recursion depth exceeded"),
    ("tokenizer-config-nested-too-deep", {"tk/tokenizer_config.json": DEEP_JSON},
     ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={hf}", "model.tokenizer={d}/tk"],
     "{d}/tk: a tokenizer file (tokenizer_config.json) is JSON nested too deeply to read"),
    ("eval-tokenizer-config-nested-too-deep", {"tk/tokenizer_config.json": DEEP_JSON, "p.jsonl": GOOD_JSONL},
     ["eval", "{hf}", "--data", "{d}/p.jsonl", "--tokenizer", "{d}/tk", "--out", "{d}/r.jsonl"],
     "{d}/tk: a tokenizer file (tokenizer_config.json) is JSON nested too deeply to read"),
    ("resume-manifest-nested-too-deep", {"ckpt/step_3/manifest.json": DEEP_JSON, "ckpt/step_3/dist/x": "x"},
     ["config", "validate", "{d}/c.yaml", "trainer.resume={d}/ckpt/step_3"],
     "{d}/ckpt/step_3/manifest.json is corrupted (maximum recursion depth exceeded"),
    ("eval-manifest-nested-too-deep", {"ckpt/step_3/manifest.json": DEEP_JSON, "ckpt/step_3/dist/x": "x",
                                       "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/ckpt/step_3", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "{d}/ckpt/step_3/manifest.json is corrupted (maximum recursion depth exceeded"),
    ("convert-manifest-nested-too-deep", {"ckpt/step_3/manifest.json": DEEP_JSON, "ckpt/step_3/dist/x": "x"},
     ["convert", "mcore-to-hf", "--ckpt", "{d}/ckpt/step_3", "--out", "{d}/out"],
     "{d}/ckpt/step_3/manifest.json is corrupted (maximum recursion depth exceeded"),
    # The step's stored config.yaml, read by eval with the loader's bounds (it was plain yaml.safe_load).
    ("eval-stored-config-alias-bomb", {"ckpt/step_3/MARK": "FAKE_CKPT", "ckpt/step_3/config.yaml": BOMB,
                                       "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/ckpt/step_3", "--data", "{d}/p.jsonl", "--out", "{d}/r.jsonl"],
     "{d}/ckpt/step_3/config.yaml: the YAML expands to more than 100,000 values"),
    ("eval-stored-config-binary", {"ckpt/step_3/MARK": "FAKE_CKPT", "ckpt/step_3/config.yaml": b"\xff\xfe\x00",
                                   "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/ckpt/step_3", "--data", "{d}/p.jsonl", "--out", "{d}/r.jsonl"],
     "{d}/ckpt/step_3/config.yaml line 1: not UTF-8 (byte 0xff)"),
    ("eval-stored-config-deep", {"ckpt/step_3/MARK": "FAKE_CKPT", "ckpt/step_3/config.yaml": "a: " + "[" * 5000,
                                 "p.jsonl": GOOD_JSONL},
     ["eval", "{d}/ckpt/step_3", "--data", "{d}/p.jsonl", "--out", "{d}/r.jsonl"],
     "{d}/ckpt/step_3/config.yaml: nested deeper than the 64 levels a config may have"),
    # One long string through many aliases: under the value bound, 59 GB once printed.
    ("yaml-alias-of-a-long-string", {"c.yaml": LONG_ALIASES}, ["config", "show", "{d}/c.yaml"],
     "{d}/c.yaml: the YAML expands to more than 8 MiB of strings"),
    # Validate refuses what train would (each failed only after the warm start).
    ("tokenizer-larger-than-the-vocab", {}, ["config", "validate", "{d}/c.yaml", "model.hf_checkpoint={small}",
                                             "model.tokenizer={tok}"],
     "model.tokenizer: the tokenizer has 320 ids but the model {small} has 100 (config.json vocab_size)"),
    ("eval-tokenizer-larger-than-the-vocab", {"p.jsonl": GOOD_JSONL},
     ["eval", "{small}", "--data", "{d}/p.jsonl", "--tokenizer", "{tok}", "--out", "{d}/r.jsonl"],
     "tokenizer {tok}: the tokenizer has 320 ids but the model {small} has 100 (config.json vocab_size)"),
    ("tools-hermes-with-the-scratch-model", {}, ["config", "validate", "{d}/c.yaml", "tools.enable=true",
                                                 "tools.format=hermes", "tools.tools=[python]", *TOOL_TASK],
     "tools.format=hermes with the scratch model: the embedded task's tokenizer has no '</tool_call>' piece"),
    ("tools-tags-without-the-calculator", {}, ["config", "validate", "{d}/c.yaml", "tools.enable=true",
                                               "tools.tools=[python]"],
     "command line: tools.tools=['python']: has no tool named 'calculator' (['python']), and every call of "
     "tools.format=tags names it"),
    ("fleet-of-100000-engines", {}, ["config", "validate", "{d}/c.yaml", "rollout.num_engines=100000"],
     "command line: rollout.num_engines=100000: must be <= 1024"),
    ("tools-100000-custom-workers", {}, ["config", "validate", "{d}/c.yaml", "tools.custom_workers=100000"],
     "command line: tools.custom_workers=100000: must be <= 256"),
    ("rollout-host-does-not-resolve", {}, ["config", "validate", "{d}/c.yaml", "rollout.engine=sglang",
                                           "rollout.host=no-such-host.invalid"],
     "rollout.host='no-such-host.invalid' does not resolve"),
    ("rollout-host-of-another-machine", {}, ["config", "validate", "{d}/c.yaml", "rollout.engine=sglang",
                                             "rollout.host=203.0.113.7"],
     "rollout.host='203.0.113.7' is 203.0.113.7, not an address of this node"),
    ("rollout-nodes-outside-slurm", {"$SLURM_JOB_ID": None}, ["config", "validate", "{d}/c.yaml", "rollout.engine=vllm",
                                                            "rollout.placement=disaggregated", "rollout.nodes=[n1]"],
     "rollout.nodes=n1 starts the fleet's servers as srun steps of this SLURM job, but this process is not in one"),
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, str]:
    """A valid tiny HF checkpoint and the embedded task's tokenizer (made once)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from model_utils import make_tiny_checkpoint

    from megatron_dapo.config import EmbeddedTaskConfig
    from megatron_dapo.embedded import task_for

    root = tmp_path_factory.mktemp("shared")
    hf = make_tiny_checkpoint(root / "hf", num_layers=1, shape={"vocab_size": 320})  # the tokenizer's ids fit
    small = make_tiny_checkpoint(root / "small", num_layers=1)  # 100 ids: fewer than the tokenizer's
    task = task_for(EmbeddedTaskConfig(num_train=50, num_val=8, num_sft=8), root / "cache")
    return {"hf": str(hf), "tok": str(task.tokenizer_path), "small": str(small)}


# Cases that hold only where a package or device is absent (skipped where it is present).
NEEDS_ABSENT = {"engine-vllm-not-installed": "vllm", "eval-engine-not-installed": "vllm",
                "engine-sglang-not-installed": "sglang", "device-cuda-without-gpu": "cuda"}


def _fake_checkpoint(step_dir: Path, kind: str) -> None:
    """A checkpoint directory as read_manifest and the preflight see it: manifest, checksums, a
    torch_dist index without tensors; of the default config's scratch model at TP=1."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from megatron_dapo.checkpoint.integrity import checksum_tree
    from megatron_dapo.config import ScratchModelConfig

    s = ScratchModelConfig()
    (step_dir / "dist").mkdir(parents=True, exist_ok=True)
    (step_dir / "dist" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (step_dir / "dist" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={})))
    (step_dir / "dist" / "__0_0.distcp").write_bytes(b"tensor bytes")
    model = {"num_layers": s.num_layers, "hidden_size": s.hidden_size + (64 if kind.endswith("WIDER") else 0),
             "ffn_hidden_size": s.intermediate_size, "num_attention_heads": s.num_attention_heads,
             "num_query_groups": s.num_key_value_heads, "vocab_size": 384}
    manifest = {"format_version": 1, "step": 3, "model": model, "layout": {"tp": 1, "pp": 1, "dp": 1},
                "has_optimizer": True, "optimizer_sharding": "fully_reshardable",
                "checksums": checksum_tree(step_dir)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    (step_dir.parent / "latest").write_text(step_dir.name)
    if kind.endswith("CORRUPT"):
        (step_dir / "dist" / "__0_0.distcp").write_bytes(b"tensor bytez")


def test_at_least_sixty_bad_inputs() -> None:
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "files", "argv", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, shared, name, files, argv, expected) -> None:
    absent = NEEDS_ABSENT.get(name)
    if absent == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible here")
    elif absent is not None:
        from importlib.util import find_spec

        if find_spec(absent) is not None:
            pytest.skip(f"{absent} is installed here")
    d = tmp_path
    monkeypatch.syspath_prepend(str(d))  # the reward modules of the case
    # Relative defaults (runs/default, .cache/, ~/.cache/megatron-dapo/venvs) inside the case's directory.
    monkeypatch.chdir(d)
    monkeypatch.setenv("HOME", str(d))
    monkeypatch.delenv("MEGATRON_DAPO_CACHE", raising=False)
    monkeypatch.delenv("MEGATRON_DAPO_SGLANG_VENV", raising=False)
    files = {"c.yaml": "trainer: {seed: 1}\n", **files}
    for name, content in files.items():
        if name.startswith("$"):
            if content is None:
                monkeypatch.delenv(name[1:], raising=False)
            else:
                monkeypatch.setenv(name[1:], content.format(d=d))
            continue
        path = d / name
        if isinstance(content, str) and content.startswith("FAKE_CKPT"):
            _fake_checkpoint(path.parent, content)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "COPY_HF_CONFIG":
            content = (Path(shared["hf"]) / "config.json").read_text()
        if content == "HF_CONFIG_AS_LLAMA":
            config = json.loads((Path(shared["hf"]) / "config.json").read_text())
            content = json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        if content in ("HF_WEIGHTS", "HF_WEIGHTS_EMBED_INT32"):
            from safetensors.torch import load_file, save_file

            tensors = load_file(str(Path(shared["hf"]) / "model.safetensors"))
            if content.endswith("INT32"):
                tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].int()
            save_file(tensors, str(path))
            continue
        if content == "PARQUET_TRUNCATED":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": "2"}] * 50), path)
            content = path.read_bytes()[: path.stat().st_size // 2]
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    fill = {"d": str(d), **shared}
    args = [a.format(**fill) for a in argv]
    try:
        code = cli.run(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert expected.format(**fill) in err, err
    assert re.match(r"^(error: |megatron-dapo[\w -]*: error: )", err), err
