"""A pure-torch rollout engine on CPU: the reference engine for tests, the tiny run and debugging.

It holds the HF-layout model of the family named in ``config.json`` (transformers'
AutoModelForCausalLM, fp32) and implements the same contract as the SGLang engine:
token ids in, token ids + temperature-scaled log-probs + finish reason out, weights in as
full tensors under their HF names. Because weight sync targets HF names, a state dict that
this engine accepts is exactly what an SGLang server would be sent, so the multi-rank
weight-sync tests use it as the receiving end.

Generation runs a batch of responses at once with a KV cache: prompts are left-padded,
the attention mask hides the padding and position ids count only real tokens, so every
row computes what it would compute alone. Rows that finish leave the batch (and the KV
cache) at once. Sampling is in rollout/sampling.py (float64, one batched draw per decode
step from counter-based per-response streams).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel

from megatron_dapo.rollout.engine import (
    EngineError,
    FinishReason,
    GenerationResult,
    SamplingParams,
    check_prompts,
    response_seed,
)
from megatron_dapo.rollout.sampling import counter_uniforms, sample_next_tokens

__all__ = ["LocalEngine"]


class LocalEngine:
    """Batched KV-cache generation with an HF model (CPU, or the controller's GPU); implements RolloutEngine."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        name: str = "local0",
        load_weights: bool = True,
        max_batch_size: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        """Build the model from a checkpoint directory.

        Args:
            model_path: HF directory with config.json (and weights when load_weights).
            name: engine name used in messages and metrics.
            load_weights: True loads the checkpoint's weights; False builds the architecture
                only and refuses to generate until a complete weight update arrived
                (the colocated flow: the trainer's weights are synced before step 1).
            max_batch_size: responses decoded together; bounds memory of the KV cache.
            dtype: parameter dtype (fp32 so log-probs are comparable with the actor's).
            device: where the model runs (the controller's device). Sampling always runs on
                CPU in float64 with per-response generators, so a seeded run draws the same
                tokens on any device.
        """
        self.name = name
        self._max_batch_size = max_batch_size
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"engine {name}: {path} has no config.json; pass an HF model directory "
                "(the tiny-checkpoint maker or `save_pretrained` writes one)"
            )
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if load_weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self._device = torch.device(device)
        self._model: PreTrainedModel = model.to(self._device).eval()
        self._vocab_size = int(config.vocab_size)
        eos = config.eos_token_id
        self._eos_ids: frozenset[int] = frozenset(
            [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        )
        self._max_positions = getattr(config, "max_position_embeddings", None)
        # Every name a state dict lists is accepted (tied aliases such as lm_head.weight
        # included); a full update must cover every distinct parameter once.
        self._tensors: dict[str, torch.Tensor] = dict(self._model.state_dict())
        self._required = {n for n, _ in self._model.named_parameters()}
        self._received: set[str] = set()
        self._weights_ready = load_weights
        self._released = False
        self._abort = threading.Event()

    @property
    def model(self) -> PreTrainedModel:
        """The HF model (read-only use: tests compare its state dict and logits)."""
        return self._model

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, index_offset: int = 0
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses per prompt (see RolloutEngine.generate).

        Args:
            prompts: token ids per prompt.
            params: sampling settings.
            index_offset: global index of prompts[0] (results and seeds use global indices).

        Returns:
            ``len(prompts) * n`` results, prompt-major.
        """
        if self._released:
            raise EngineError(f"engine {self.name}: generate() after release_memory(); call resume_memory() first")
        if not self._weights_ready:
            raise EngineError(
                f"engine {self.name}: no weights yet (built with load_weights=False); "
                "sync the trainer's weights (update_weights + finish_weight_update) before generating"
            )
        check_prompts(prompts, vocab_size=self._vocab_size, engine=self.name)
        self._abort.clear()
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        rows = [(index_offset + i, j) for i in range(len(prompts)) for j in range(params.n)]
        seeds = torch.tensor([response_seed(base_seed, p * params.n + j) for p, j in rows], dtype=torch.long)
        results: list[GenerationResult] = []
        for start in range(0, len(rows), self._max_batch_size):
            chunk = rows[start : start + self._max_batch_size]
            if self._abort.is_set():
                results.extend(
                    GenerationResult(prompt_index=p, sample_index=j, output_ids=[], logprobs=[], finish_reason="abort")
                    for p, j in chunk
                )
                continue
            chunk_prompts = [prompts[p - index_offset] for p, _ in chunk]
            outs = self._generate_batch(chunk_prompts, params, seeds[start : start + len(chunk)])
            results.extend(
                GenerationResult(prompt_index=p, sample_index=j, output_ids=ids, logprobs=lps, finish_reason=why)
                for (p, j), (ids, lps, why) in zip(chunk, outs)
            )
        return results

    def _generate_batch(
        self, prompts: list[Sequence[int]], params: SamplingParams, seeds: torch.Tensor
    ) -> list[tuple[list[int], list[float], FinishReason]]:
        """Decode one batch of rows to completion with a shared KV cache.

        A finished row leaves the batch at once (its KV-cache rows are dropped), so the
        decode steps of the long tail only compute the rows still running. Each row keeps
        its own token count, limit and seed, which is what lets rows of different ages share
        a batch: the tokens of a response do not depend on its batch mates.
        """
        num_rows = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        max_len = int(lens.max())
        mask = torch.arange(max_len).unsqueeze(0) >= (max_len - lens).unsqueeze(1)  # [B, L] left-padded
        input_ids = torch.zeros(num_rows, max_len, dtype=torch.long)
        input_ids[mask] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        mask = mask.long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # real tokens count 0, 1, ...; pads 0
        stop_ids = torch.tensor(sorted(self._eos_ids | set(params.stop_token_ids)), dtype=torch.long)
        limits = torch.full((num_rows,), params.max_new_tokens, dtype=torch.long)
        if self._max_positions is not None:
            limits = torch.minimum(limits, self._max_positions - lens)  # each row's own context limit
        width = max(int(limits.max()), 0)
        out_ids = torch.zeros(num_rows, width, dtype=torch.long)
        out_lps = torch.zeros(num_rows, width, dtype=torch.float64)
        num_out = torch.zeros(num_rows, dtype=torch.long)
        reasons: list[FinishReason] = ["length"] * num_rows
        active = torch.nonzero(limits > 0).squeeze(-1)  # [b] source row of each batch row
        if active.numel() < num_rows:
            input_ids, mask, positions = input_ids[active], mask[active], positions[active]
        cache = DynamicCache(config=self._model.config)
        input_ids, mask, positions = (t.to(self._device) for t in (input_ids, mask, positions))
        step_ids = input_ids
        while active.numel() > 0:
            logits = self._model(
                input_ids=step_ids.to(self._device), attention_mask=mask.to(self._device),
                position_ids=positions.to(self._device), past_key_values=cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1, :].cpu()  # [b, V]; sampling and bookkeeping stay on CPU
            counts = num_out[active]
            uniforms = None if params.greedy else counter_uniforms(seeds[active], counts)
            tokens, logprobs = sample_next_tokens(
                logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, uniforms=uniforms
            )
            out_ids[active, counts] = tokens
            out_lps[active, counts] = logprobs
            num_out[active] = counts = counts + 1
            stopped = torch.isin(tokens, stop_ids)
            done = stopped | (counts >= limits[active])
            for r in active[stopped].tolist():
                reasons[r] = "stop"
            if self._abort.is_set():
                for r in active[~done].tolist():
                    reasons[r] = "abort"
                break
            if bool(done.any()):
                keep = torch.nonzero(~done).squeeze(-1)
                if keep.numel() == 0:
                    break
                cache.batch_select_indices(keep)
                active, tokens, mask, positions = active[keep], tokens[keep], mask[keep], positions[keep]
            step_ids = tokens.unsqueeze(-1)  # [b, 1]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            positions = positions[:, -1:] + 1
        counts_list = num_out.tolist()
        return [
            (out_ids[r, :n].tolist(), out_lps[r, :n].tolist(), reasons[r]) for r, n in enumerate(counts_list)
        ]

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the model, checking names and shapes.

        Args:
            bucket: (hf_name, full tensor) pairs; dtypes are converted to the engine's.

        Raises:
            ValueError: a name the model does not have, or a shape that differs.
        """
        for name, tensor in bucket:
            target = self._tensors.get(name)
            if target is None:
                raise ValueError(
                    f"engine {self.name}: unknown tensor {name!r} in weight update; the model has e.g. "
                    f"{sorted(self._tensors)[:3]}: the model adapter's HF names and the rollout model differ"
                )
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"engine {self.name}: tensor {name!r} has shape {tuple(tensor.shape)} but the model "
                    f"expects {tuple(target.shape)}; the trainer and rollout configs describe different models"
                )
            target.copy_(tensor.to(device=target.device))
            self._received.add(name)

    def finish_weight_update(self) -> None:
        """End a weight update; the first one must have covered every parameter.

        Raises:
            ValueError: on the first full sync, parameters that no bucket delivered.
        """
        missing = self._required - self._received
        # A tied lm_head arrives under either of its names; named_parameters lists one of them.
        missing = {n for n in missing if not self._alias_received(n)}
        if missing and not self._weights_ready:
            raise ValueError(
                f"engine {self.name}: the weight update missed {len(missing)} parameters, e.g. "
                f"{sorted(missing)[:3]}; the model adapter's export must cover the whole model"
            )
        self._weights_ready = True
        self._received.clear()

    def _alias_received(self, name: str) -> bool:
        storage = self._tensors[name].data_ptr()
        return any(self._tensors[other].data_ptr() == storage for other in self._received)

    # ------------------------------------------------------------------ lifecycle

    def release_memory(self) -> None:
        """Mark the engine released; CPU memory is shared with training, so nothing moves."""
        self._released = True

    def resume_memory(self) -> None:
        """Allow generation again after :meth:`release_memory`."""
        self._released = False

    def abort(self) -> None:
        """Make the running generate() return after the current decode step."""
        self._abort.set()

    def health(self) -> bool:
        """Always healthy while the process lives."""
        return True

    def shutdown(self) -> None:
        """Nothing to stop: the model is freed with the engine object."""
        self._abort.set()
