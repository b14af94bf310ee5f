"""A LoRA run's checkpoint out as HF weights (lora/export.py, `convert mcore-to-hf [--peft]`).

One tiny LoRA run (2 steps, rank 4 on every linear); its last checkpoint holds adapters only:
- merged: every adapted HF weight equals the base's plus (alpha/r) B A merged by hand in
  float32 from the adapters PEFT's export holds (bit-equal), every other tensor is the base's;
- PEFT: `peft` loads the adapter directory onto the HF base, and its log-probs of a fixed
  sequence equal the Megatron actor's (the checkpoint loaded onto the base) within 1e-5;
- `eval`'s path (an export of the training checkpoint) takes it, and a wrong --base is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_utils import REPO, run_trainer, trainer_env, write_config

pytestmark = pytest.mark.e2e

RANK, ALPHA = 4, 8.0
SEQUENCE = [3, 17, 5, 9, 22, 41, 7, 13, 2, 30, 11]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_export")
    out, cache = tmp / "run", tmp / "cache"
    config = write_config(tmp / "tiny.yaml")
    proc = run_trainer(config, f"trainer.output_dir={out}", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
                       "optim.lr=0.05", "trainer.test_freq=0", "trainer.val_before_train=false", cache_dir=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = out / "checkpoints" / "step_2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return {"tmp": tmp, "ckpt": ckpt, "cache": cache, "base": Path(manifest["lora"]["base"]["path"])}


def _convert(run: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "convert", "mcore-to-hf", "--ckpt",
                           str(run["ckpt"]), "--out", str(out), *extra], env=trainer_env(run["cache"]), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_merged_export_is_the_base_plus_the_adapters_merged_by_hand(run: dict) -> None:
    merged_dir, peft_dir = run["tmp"] / "merged", run["tmp"] / "peft"
    for out, extra in ((merged_dir, ()), (peft_dir, ("--peft",))):
        proc = _convert(run, out, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
    merged, base = _tensors(merged_dir), _tensors(run["base"])
    adapters = _tensors(peft_dir)
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    assert merged.keys() == base.keys()
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] + ".weight" for k in adapters}
    assert len(adapted) == 2 * 7  # q, k, v, o, gate, up, down in 2 layers
    moved = 0
    for name, tensor in merged.items():
        if name not in adapted:
            assert torch.equal(tensor, base[name]), name
            continue
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
        by_hand = (base[name].float() + (ALPHA / RANK) * (b.float() @ a.float())).to(base[name].dtype)
        assert torch.equal(tensor, by_hand), name
        moved += not torch.equal(tensor, base[name])
    assert moved == len(adapted), "every adapted weight moved in 2 steps"


def _actor_log_probs(ckpt: str, base: str) -> torch.Tensor:
    from megatron_dapo import parallel
    from megatron_dapo.checkpoint import read_manifest
    from megatron_dapo.lora.export import load_lora_checkpoint

    parallel.init_distributed("cpu")
    dims = parallel.initialize_model_parallel(1, 1)
    adapter, model, _ = load_lora_checkpoint(Path(ckpt), read_manifest(Path(ckpt)), Path(base), dims, torch.float32)
    model.eval()
    ids = torch.tensor([SEQUENCE])
    with torch.no_grad():
        logits = model(ids, torch.arange(len(SEQUENCE)).unsqueeze(0), None)[..., : adapter.hf.vocab_size]
    return torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]


def test_peft_loads_the_adapter_onto_the_hf_base_with_the_actors_log_probs(run: dict) -> None:
    from dist_utils import run_distributed
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_dir = run["tmp"] / "peft"
    if not peft_dir.is_dir():
        assert _convert(run, peft_dir, "--peft").returncode == 0
    actor = run_distributed(_actor_log_probs, 1, str(run["ckpt"]), str(run["base"]))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(run["base"]), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, str(peft_dir)).eval()
    ids = torch.tensor([SEQUENCE])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    theirs = torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    with torch.no_grad(), model.disable_adapter():
        plain = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert (theirs - actor).abs().max() < 1e-5, (theirs - actor).abs().max()
    assert (plain - actor).abs().max() > 1e-4, "the adapters change nothing: the check would hold for any adapter"


def test_a_wrong_base_is_refused_in_one_line(run: dict, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for f in run["base"].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4 - i for i in range(4))  # the last weight bytes differ: a fine-tuned copy
    weights.write_bytes(bytes(data))
    proc = _convert(run, tmp_path / "out", "--base", str(other))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "has other weights" in last and "--base" in last, last
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert os.path.isdir(run["ckpt"])
