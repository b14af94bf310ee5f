"""Run by test_vllm_moe.py in a process of its own: vLLM's own layerwise reload of a served Qwen3-MoE, on CPU.

``python vllm_moe_reload_probe.py CHECKPOINT`` builds vLLM in this process (no server, no
plugin), reloads the checkpoint's own weights the way a weight update does
(initialize_layerwise_reload, load_weights, finalize_layerwise_reload) and prints one JSON
line: the expert tensors that the reload changed although the weights were the same, or the
error the reload raised. It holds vLLM's behaviour, not ours: when a vLLM release packs
reloaded experts itself, or reloads padded ones, the test that reads this line fails and
transfer.py's repair or engine.py's refusal should go.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(checkpoint: str) -> None:
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    llm = LLM(model=checkpoint, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              enable_chunked_prefill=False, max_model_len=128)
    model_config = llm.llm_engine.model_config
    weights = list(load_file(os.path.join(checkpoint, "model.safetensors")).items())

    def reload(model) -> dict:
        before = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
        try:
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, model_config)
        except RuntimeError as error:
            return {"error": str(error)}
        after = dict(model.named_parameters())
        return {"expert_tensors": sorted(before),
                "changed": sorted(n for n, t in before.items() if not after[n].detach().equal(t))}

    print("PROBE " + json.dumps(llm.apply_model(reload)[0]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
