"""A pure-torch rollout engine on CPU: the reference engine for tests, the tiny run and debugging.

It holds the HF-layout model of the family named in ``config.json`` (transformers'
AutoModelForCausalLM, fp32) and implements the same contract as the SGLang engine:
token ids in, token ids + temperature-scaled log-probs + finish reason out, weights in as
full tensors under their HF names (a mixture-of-experts layer's experts one tensor per expert
and projection, as an HF checkpoint stores them: rollout/local/hf_tensors.py). Because weight
sync targets HF names, a state dict that this engine accepts is exactly what an SGLang server
would be sent, so the multi-rank weight-sync tests use it as the receiving end.

Generation is continuous batching with a KV cache (rollout/local/decoder.py): up to
max_batch_size responses decode together, finished ones leave the batch at once and
waiting ones join in their place, so the batch stays full until the work runs out.
Prompts are left-padded, the attention mask hides the padding and position ids count only
real tokens, so every row computes what it would compute alone. Sampling is in
rollout/local/sampling.py (float64, one batched draw per decode step from counter-based
per-response streams). `stream` feeds the same batch from a PromptFeed and hands back each
prompt's group as soon as its n responses are done (streaming dynamic sampling).
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from megatron_dapo.rollout.engine import (
    EngineError,
    GenerationResult,
    SamplingParams,
    check_prompts,
    response_seed,
)
from megatron_dapo.rollout.local.attention import attention_for
from megatron_dapo.rollout.local.decoder import ContinuousDecoder, DecodeRow, FinishedRow
from megatron_dapo.rollout.local.hf_tensors import hf_named_tensors, hf_parameter_names
from megatron_dapo.rollout.routes import HFRouteRecorder, hf_routers, perturb_router_choice
from megatron_dapo.rollout.streaming import GroupCallback, PromptFeed, settled

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
        router_noise_std: float = 0.0,
        router_noise_seed: int = 0,
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
            router_noise_std: perturbs which experts an MoE router chooses (rollout/routes.py,
                `perturb_router_choice`); 0 = the model's own routing.
            router_noise_seed: seeds that noise.
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
        self._device = torch.device(device)
        # SDPA reading grouped KV heads in place, on CPU (rollout/local/attention.py).
        attention = attention_for(config.model_type, self._device.type)
        # transformers 5.19 runs MoE experts through torch's grouped_mm by default, which refuses
        # float64 ("Expected mat_a to be Float32, BFloat16 or Float16"); its eager loop takes any dtype.
        experts = "eager" if dtype == torch.float64 else None
        if load_weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                         attn_implementation=attention, experts_implementation=experts)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention,
                                                     experts_implementation=experts)
        self._model: PreTrainedModel = model.to(self._device).eval()
        self._vocab_size = int(config.vocab_size)
        eos = config.eos_token_id
        self._eos_ids: frozenset[int] = frozenset(
            [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        )
        self._max_positions = getattr(config, "max_position_embeddings", None)
        # Every HF name of the state dict is accepted (tied aliases such as lm_head.weight
        # included, fused experts per expert); a full update must cover every distinct parameter once.
        self._tensors: dict[str, torch.Tensor] = hf_named_tensors(self._model)
        self._required = hf_parameter_names(self._model)
        self._received: set[str] = set()
        self._weights_ready = load_weights
        self._released = False
        self._abort = threading.Event()
        self.weight_version = 0
        """The weights' version (the trainer's step that made them; 0 = as loaded); every result
        lists the versions its tokens were sampled under."""
        self.between_steps: Callable[[], None] | None = None
        """Called before every decode step: an engine process applies weight updates and aborts
        that arrived meanwhile here (rollout/local/process.py), so a swap pauses decoding only
        for the copy, and rows in flight go on under the new weights."""
        if router_noise_std > 0:
            perturb_router_choice(self._model, router_noise_std, seed=router_noise_seed)
        self._routes = HFRouteRecorder(self._model) if hf_routers(self._model) else None
        """An MoE model reports every response's routed experts (rollout/routes.py)."""
        self._finished_versions: dict[tuple[int, int], list[int]] = {}
        """(prompt, sample) -> weight versions of a row that left the batch, until its result is made."""

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
        self._check_ready()
        check_prompts(prompts, vocab_size=self._vocab_size, engine=self.name)
        self._abort.clear()
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        pending = deque(row for i, prompt in enumerate(prompts)
                        for row in self._rows(index_offset + i, prompt, params, base_seed))
        finished = self._decode(params, lambda free: [pending.popleft() for _ in range(min(free, len(pending)))],
                                lambda row: None)
        by_row = {(f.row.prompt_index, f.row.sample_index): self._result(f) for f in finished}
        by_row.update(((r.prompt_index, r.sample_index), _aborted(r)) for r in pending)  # abort() came first
        return [by_row[(index_offset + i, j)] for i in range(len(prompts)) for j in range(params.n)]

    @torch.no_grad()
    def stream(
        self, feed: PromptFeed, params: SamplingParams, on_group: GroupCallback, *, max_inflight: int
    ) -> list[GenerationResult]:
        """Generate groups for prompts taken from `feed` as rows free up (continuous batching).

        At most `max_inflight` prompts' rows (and max_batch_size rows) run at once. A prompt
        is taken when its n rows fit; its group goes to `on_group` as
        soon as all n responses are done, from this thread, before the next decode step, so
        a callback that closes the feed and aborts stops the engine at a point that depends
        on token counts only (a seeded run stays reproducible).

        Returns:
            The responses of prompts whose group the abort left incomplete: those cut short
            (reason abort, with whatever they had generated) and their finished mates.
        """
        self._check_ready()
        self._abort.clear()
        base_seed = params.seed if params.seed is not None else secrets.randbits(62)
        pending: deque[DecodeRow] = deque()
        groups: dict[int, list[FinishedRow]] = {}

        capacity = min(self._max_batch_size, max(1, max_inflight) * params.n)

        def done(f: FinishedRow) -> None:
            group = groups.setdefault(f.row.prompt_index, [])
            group.append(f)
            if len(group) == params.n and all(g.finish_reason != "abort" for g in group):
                del groups[f.row.prompt_index]
                on_group(sorted((self._result(g) for g in group), key=lambda r: r.sample_index))

        def admit(free: int) -> list[DecodeRow]:
            free -= self._max_batch_size - capacity
            while free - len(pending) >= min(params.n, capacity):
                item = feed.take(block=False)  # this thread decodes: never wait for the gate here
                if item is None:
                    break
                check_prompts([item.prompt], vocab_size=self._vocab_size, engine=self.name)
                rows = self._rows(item.index, item.prompt, params, base_seed)
                if item.carried is not None:  # a partial rollout: finished mates are final, the rest resume
                    for row, carried in zip(rows, item.carried, strict=True):
                        carried = settled(carried, params)
                        if carried.finish_reason == "abort":
                            pending.append(replace(row, prefix=tuple(carried.output_ids),
                                                   prefix_logprobs=tuple(carried.logprobs),
                                                   prefix_routes=carried.routed_experts))
                        else:
                            done(FinishedRow(row=row, output_ids=carried.output_ids, logprobs=carried.logprobs,
                                             finish_reason=carried.finish_reason,
                                             routed_experts=carried.routed_experts))
                else:
                    pending.extend(rows)
            return [pending.popleft() for _ in range(min(free, len(pending)))]

        self._decode(params, admit, done)
        # Groups the abort left incomplete: rows cut short, and their mates that had finished.
        return [self._result(f) for group in groups.values() for f in group] + [_aborted(r) for r in pending]

    def _result(self, f: FinishedRow) -> GenerationResult:
        versions = self._finished_versions.pop((f.row.prompt_index, f.row.sample_index), [self.weight_version])
        return GenerationResult(prompt_index=f.row.prompt_index, sample_index=f.row.sample_index,
                                output_ids=f.output_ids, logprobs=f.logprobs, finish_reason=f.finish_reason,
                                weight_versions=tuple(versions), routed_experts=f.routed_experts)

    def _check_ready(self) -> None:
        if self._released:
            raise EngineError(f"engine {self.name}: generate() after release_memory(); call resume_memory() first")
        if not self._weights_ready:
            raise EngineError(
                f"engine {self.name}: no weights yet (built with load_weights=False); "
                "sync the trainer's weights (update_weights + finish_weight_update) before generating"
            )

    def _rows(self, prompt_index: int, prompt: Sequence[int], params: SamplingParams, base_seed: int) -> list[DecodeRow]:
        limit = params.max_new_tokens
        if self._max_positions is not None:
            limit = min(limit, self._max_positions - len(prompt))  # the row's own context limit
        return [DecodeRow(prompt_index=prompt_index, sample_index=j, prompt=prompt, limit=limit,
                          seed=response_seed(base_seed, prompt_index * params.n + j)) for j in range(params.n)]

    def _decode(
        self, params: SamplingParams, admit: Callable[[int], list[DecodeRow]], done: Callable[[FinishedRow], None]
    ) -> list[FinishedRow]:
        """Run the continuous batch until `admit` has nothing more and every row finished.

        Args:
            admit: called before every step with the number of free rows; returns the rows to join.
            done: called with each row as it finishes, aborted ones included.

        Returns:
            Every finished row, aborted ones included.
        """
        decoder = ContinuousDecoder(self._model, params=params, stop_ids=self._eos_ids | set(params.stop_token_ids),
                                    max_rows=self._max_batch_size, device=self._device, routes=self._routes)
        finished: list[FinishedRow] = []
        running: dict[tuple[int, int], list[int]] = {}  # (prompt, sample) -> versions of its tokens so far
        self._finished_versions.clear()

        version = self.weight_version

        def leave(f: FinishedRow) -> None:
            key = (f.row.prompt_index, f.row.sample_index)
            self._finished_versions[key] = running.pop(key, [version])
            finished.append(f)
            done(f)

        while True:
            if self.between_steps is not None:
                self.between_steps()
            if self._abort.is_set():
                break
            admitted = admit(decoder.num_free)  # an engine process serves its pipe here too
            if self.weight_version != version:  # a swap between steps: rows in flight go on under it
                version = self.weight_version
                for versions in running.values():
                    versions.append(version)
            joining = []
            for row in admitted:
                running[(row.prompt_index, row.sample_index)] = [version]
                if row.limit > len(row.prefix):
                    joining.append(row)
                else:  # the prompt (and any prefix) fills the context: nothing to generate
                    leave(FinishedRow(row=row, output_ids=list(row.prefix), logprobs=list(row.prefix_logprobs),
                                      finish_reason="length", routed_experts=row.prefix_routes))
            if not joining and decoder.num_running == 0:
                return finished
            for f in decoder.step(joining):
                leave(f)
        for f in decoder.abort():
            leave(f)
        return finished

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

    def finish_weight_update(self, version: int | None = None) -> None:
        """End a weight update; the first one must have covered every parameter.

        Args:
            version: the new weights' version (the trainer's step); None = the last one + 1.

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
        self.weight_version = self.weight_version + 1 if version is None else version

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

    def clear_abort(self) -> None:
        """Nothing to clear: each generate()/stream() call starts unaborted (it is one session)."""

    def health(self) -> bool:
        """Always healthy while the process lives."""
        return True

    def shutdown(self) -> None:
        """Nothing to stop: the model is freed with the engine object."""
        self._abort.set()


def _aborted(row: DecodeRow) -> GenerationResult:
    """A row that never joined: whatever it carried in, cut short."""
    return GenerationResult(prompt_index=row.prompt_index, sample_index=row.sample_index, output_ids=list(row.prefix),
                            logprobs=list(row.prefix_logprobs), finish_reason="abort", routed_experts=row.prefix_routes)
