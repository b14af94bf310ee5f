"""Prompt data for DAPO: datasets, tokenizers and the embedded arithmetic task.

The controller (global rank 0) loads a prompt file once (`load_prompt_dataset`),
draws prompts with a resumable `PromptSampler` at step 1 of every RL step, and
hands their token ids to the rollout engines. `arithmetic` writes the small
integer-arithmetic task the default CPU run learns, and `tokenizer` trains the
sentencepiece tokenizer that task uses.
"""
