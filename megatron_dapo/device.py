"""Device selection, and the CPU compatibility layer that lets megatron-core run without CUDA.

Every process calls :func:`setup_device` once, before building any Megatron module
(``parallel.init_distributed`` does it). On a CUDA machine it binds the process to its
local GPU and changes nothing else. Without CUDA it installs, once, the few shims that
megatron-core 0.16 needs to run GPTModel, DDP, the distributed optimizer and the pipeline
schedules on CPU tensors with gloo (DESIGN.md, "Megatron-Core on CPU"):

- a ``TorchFunctionMode`` that rewrites ``device="cuda"`` / ``device=0`` in factory
  calls, ``Tensor.cuda()`` and ``Tensor.to("cuda")`` to CPU, and answers
  ``Tensor.type()`` with the CUDA type name the optimizer checks for;
- ``torch.cuda`` entry points megatron-core calls unconditionally (current_device,
  synchronize, streams, events, RNG state, memory statistics) as CPU equivalents/no-ops;
- megatron's model-parallel RNG tracker forking the CPU generator, which is the
  generator CPU dropout and init actually draw from;
- megatron's activation recompute (CheckpointFunction.backward, CheckpointWithoutOutput's
  recompute hook) re-entering the mode, because the forward it re-runs inside the
  backward pass would otherwise run without it.
- the backward functions of megatron's tensor-parallel linear layers and mappings
  re-entering the mode too: under sequence parallelism they allocate communication
  buffers on the "current CUDA device" inside the backward pass.
- the MoE all-to-all token dispatcher's split sizes made lists on CPU as on CUDA
  (``maybe_move_tensor_to_cpu(..., as_numpy=True)`` converts only CUDA tensors), and its
  uneven all-gather / reduce-scatter over expert TP ranks padded to equal sizes (gloo
  refuses lists of tensors of different sizes; NCCL takes them).

This is the ``device: cpu`` product feature (laptop debugging, CI on the real stack). It
refuses to install while CUDA is usable, so a GPU run can never be silently remapped.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

DEVICE_KINDS = ("auto", "cpu", "cuda")

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}

_cpu_mode: _CudaToCpuMode | None = None
_thread_state = threading.local()


def setup_device(kind: str = "auto") -> torch.device:
    """Select this process' device; without CUDA, make megatron-core CPU-capable.

    Idempotent: calling it again returns the same device and installs nothing twice.
    On CPU, a thread other than the main one that creates megatron tensors must call it
    too (the device-remapping mode is per thread; the rest of the layer is global).

    Args:
        kind: "auto" (CUDA when available, else CPU), "cuda" (fail without CUDA) or "cpu"
            (fail when CUDA is visible, because the CPU layer must never patch a live
            CUDA runtime).

    Returns:
        ``cuda:LOCAL_RANK`` (also made the current CUDA device) or ``cpu``.
    """
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device kind {kind!r} is not one of {DEVICE_KINDS}; pass one of those")
    has_cuda = torch.cuda.is_available()
    if kind == "cuda" and not has_cuda:
        raise ValueError(
            "device kind 'cuda' was requested but torch.cuda.is_available() is False; "
            "use device 'cpu' or 'auto', or run on a machine with a visible GPU"
        )
    if kind == "cpu" and has_cuda:
        raise ValueError(
            "device kind 'cpu' was requested on a machine with CUDA; the CPU layer cannot run next "
            "to a live CUDA runtime: hide the GPUs with CUDA_VISIBLE_DEVICES='' or use 'auto'"
        )
    if has_cuda:
        # A CUDA process must run megatron-core's own CUDA path: none of the CPU shims may be in
        # place (they would remap streams, RNG and collectives silently).
        shims = active_shims()
        if _cpu_mode is not None or shims:
            raise RuntimeError(f"the CPU layer is installed in a process that sees CUDA ({', '.join(shims) or 'mode'}); "
                               "a process must pick its device before building anything")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    _install_cpu_layer()
    return torch.device("cpu")


def param_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The actor's parameter dtype for model.dtype `setting` (auto = bf16 on GPU, fp32 on CPU); the
    engines serve the same."""
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend of the default group for ``device``.

    On CUDA it is ``cpu:gloo,cuda:nccl``: megatron-core creates its groups with the default
    backend, so every group (TP, PP, DP, ...) then sends CUDA tensors over NCCL and CPU
    tensors over gloo, and object collectives (which torch runs on CPU when a group has a
    CPU backend) never stage pickles on the GPU. That is the rule for the control plane
    (DESIGN.md, "Where tensors live"): flags, counts, metric sums and pickled batches are
    CPU tensors; model data stays on the device. An NCCL-only default would fail, or hang,
    on the first CPU tensor.

    Args:
        device: the value :func:`setup_device` returned.

    Returns:
        "cpu:gloo,cuda:nccl" for CUDA, "gloo" for CPU.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def release_cached_memory(device: torch.device) -> None:
    """Give this process' cached but unused device memory back to the driver.

    The caching allocator keeps the training peak (activations, logits, gradients) after
    the tensors are freed; colocated engines resuming their weights and KV cache on the
    same GPU would otherwise run out of memory. Garbage is collected first so tensors held
    only by reference cycles are freed before the cache is emptied.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cpu_layer_active() -> bool:
    """Whether the CPU compatibility layer is installed in this process."""
    return _cpu_mode is not None


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (str, torch.device, bare int index) to "cpu"; keep others."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while it is on the stack."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # distrib_optimizer/optimizer accept only 'torch.cuda.*Tensor' params.
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if func is torch.Tensor.to:
            args = tuple(_to_cpu_device(a) if not isinstance(a, torch.Tensor) else a for a in args)
        if "device" in kwargs:
            kwargs = dict(kwargs)
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered, so waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stands in for torch.cuda.Event; elapsed_time is 0 because CPU work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        del end_event
        return 0.0


@contextlib.contextmanager
def _null_stream_context(stream: Any = None) -> Iterator[None]:
    del stream
    yield


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    del args, kwargs
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    del args, kwargs
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which must stay torch's
    # own lazy no-op or seeding would recurse.
    torch.default_generator.manual_seed(int(seed))


class _DropTrackerForkWarning(logging.Filter):
    """megatron's RNG tracker warns when the CPU RNG moves inside a fork; on CPU the tracked
    "cuda" generator IS the CPU generator, so every forked dropout/init would warn."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = _mark(lambda: 0)
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = _null_stream_context
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.set_stream = lambda stream: None
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.max_memory_reserved = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.memory_stats = lambda device=None: {}
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.random.manual_seed = _cpu_manual_seed


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _mark(_cpu_get_rng_state)
    mcore_random._set_cuda_rng_state = _mark(_cpu_set_rng_state)
    logging.getLogger(mcore_random.__name__).addFilter(_DropTrackerForkWarning())


def _under_cpu_mode(fn: Callable) -> Callable:
    """``fn`` with the CUDA-to-CPU mode pushed on the calling thread's stack while it runs."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        assert _cpu_mode is not None, "the CPU layer is installed before megatron runs"
        with _cpu_mode:
            return fn(*args, **kwargs)

    return _mark(wrapper)


def _patch_megatron_recompute() -> None:
    # The recomputed forward (full recompute: every layer, selective: core attention or
    # the norm/MLP modules) runs inside the backward pass, where the mode is not on the
    # stack: torch.autograd.backward and Tensor.backward dispatch to the mode themselves,
    # and a mode is popped while its __torch_function__ runs, so the whole backward runs
    # below it (megatron's schedules call torch.autograd.backward). Re-entering the mode
    # around autograd.backward instead cannot work: the re-entered mode intercepts the
    # same call again and is popped again; only torch's private engine entry point would
    # avoid that. Pushing it inside the two recompute entry points also does not depend
    # on which thread autograd runs them on, nor on how backward was started (where the
    # mode is already on the stack, a second push only remaps twice, idempotently).
    from megatron.core.tensor_parallel import random as mcore_random

    function = mcore_random.CheckpointFunction
    function.backward = staticmethod(_under_cpu_mode(function.backward))
    without_output = mcore_random.CheckpointWithoutOutput
    without_output._recompute = _under_cpu_mode(without_output._recompute)


def _patch_megatron_tensor_parallel_backward() -> None:
    # Sequence parallelism's communication runs in autograd backward functions (the
    # linear layers' reduce-scatter of the input gradient, the scatter/gather mappings),
    # which allocate their buffers on torch.cuda.current_device(); like the recompute
    # above they run below the mode and need it pushed around them.
    from megatron.core.tensor_parallel import layers, mappings

    functions = [layers.LinearWithGradAccumulationAndAsyncCommunication]
    functions += [obj for obj in vars(mappings).values()
                  if isinstance(obj, type) and issubclass(obj, torch.autograd.Function)]
    for function in functions:
        if "backward" in vars(function):
            function.backward = staticmethod(_under_cpu_mode(function.backward))


def _patch_megatron_moe_splits() -> None:
    # megatron-core 0.16.1's alltoall token dispatcher counts tokens per EP rank in tensors
    # and passes them to all_to_all_single after maybe_move_tensor_to_cpu(as_numpy=True),
    # which converts only CUDA tensors; CPU ones stay tensors, which all_to_all_single
    # refuses as split sizes. Give CPU tensors the numpy conversion CUDA ones get.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _mark(move)


def _patch_megatron_uneven_gather() -> None:
    # With expert tensor parallelism the MoE dispatcher gathers and reduce-scatters tokens
    # over the TP group in per-rank counts (mappings._gather_along_first_dim with
    # output_split_sizes, _reduce_scatter_along_first_dim with input_split_sizes), through
    # list collectives of tensors of different sizes, which gloo refuses ("invalid tensor
    # size"). The same results through equal-size collectives of zero-padded blocks.
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
                      use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * most: i * most + n] for i, n in enumerate(sizes)])

    def reduce_scatter_uneven(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                              use_global_buffer: bool = False) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most * len(sizes), *input_.shape[1:]))
        for i, chunk in enumerate(input_.split(sizes)):
            padded[i * most: i * most + chunk.shape[0]] = chunk
        out = input_.new_empty((most, *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = _mark(gather_uneven)
    mappings._reduce_scatter_along_first_dim = _mark(reduce_scatter_uneven)


@dataclass(frozen=True)
class CpuShim:
    """One patch of the CPU layer: what it replaces, why, and where that was read."""

    name: str
    targets: tuple[str, ...]
    """What is replaced, as ``module:attribute`` (``module:Class.method`` for a method)."""
    why: str
    read_in: str
    """The versions whose source the need was read in (and tested against on CPU)."""
    install: Callable[[], None]


CPU_SHIMS: tuple[CpuShim, ...] = (
    CpuShim("torch.cuda entry points",
            tuple(f"torch.cuda:{n}" for n in ("current_device", "synchronize", "Stream", "Event", "stream",
                                              "current_stream", "default_stream", "set_stream", "get_rng_state",
                                              "set_rng_state", "manual_seed", "empty_cache", "memory_allocated",
                                              "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                                              "reset_peak_memory_stats", "memory_stats")),
            "megatron-core calls them unconditionally (streams in DDP and the optimizer, RNG in the tracker, "
            "memory statistics in its logging)", "megatron-core 0.16.1, torch 2.13", _patch_torch_cuda),
    CpuShim("model-parallel RNG on the CPU generator",
            ("megatron.core.tensor_parallel.random:_get_cuda_rng_state",
             "megatron.core.tensor_parallel.random:_set_cuda_rng_state"),
            "the tracker forks the CUDA generator; CPU dropout and init draw from the CPU one",
            "megatron-core 0.16.1", _patch_megatron_rng),
    CpuShim("recompute under the device mode",
            ("megatron.core.tensor_parallel.random:CheckpointFunction.backward",
             "megatron.core.tensor_parallel.random:CheckpointWithoutOutput._recompute"),
            "the forward re-run inside backward runs below the mode that remaps device='cuda'",
            "megatron-core 0.16.1, torch 2.13", _patch_megatron_recompute),
    CpuShim("tensor-parallel backward under the device mode",
            ("megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward",
             "megatron.core.tensor_parallel.mappings:<every autograd.Function>.backward"),
            "sequence parallelism's backward allocates buffers on torch.cuda.current_device()",
            "megatron-core 0.16.1", _patch_megatron_tensor_parallel_backward),
    CpuShim("MoE dispatcher split sizes",
            ("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
             "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu"),
            "it converts only CUDA tensors to numpy; all_to_all_single refuses tensor split sizes",
            "megatron-core 0.16.1", _patch_megatron_moe_splits),
    CpuShim("uneven gather / reduce-scatter padded",
            ("megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
             "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim"),
            "gloo refuses list collectives of tensors of different sizes (NCCL takes them)",
            "megatron-core 0.16.1, torch 2.13 gloo", _patch_megatron_uneven_gather),
)
"""The CPU layer, patch by patch (DESIGN.md "Megatron-Core on CPU"): installed only without CUDA;
``active_shims`` tells which are in place, and ``setup_device`` refuses a CUDA device while any is."""


def _resolve(target: str) -> Any:
    import importlib

    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def active_shims() -> list[str]:
    """The CPU shims in place in this process, by name: each target that is one of ours.

    Looks only at modules already imported (a shim of megatron-core cannot be in place before
    megatron-core is imported); the mapping backward functions are held through their module."""
    import sys

    found = []
    for shim in CPU_SHIMS:
        for target in shim.targets:
            if "<" in target or target.partition(":")[0] not in sys.modules:
                continue
            try:
                obj = _resolve(target)
            except (ImportError, AttributeError):
                continue
            if getattr(obj, _SHIM_MARK, False):
                found.append(shim.name)
                break
    return found


_SHIM_MARK = "__megatron_dapo_cpu_shim__"


def _mark(obj: Any) -> Any:
    """Tag a replacement as the CPU layer's (``active_shims`` finds it)."""
    with contextlib.suppress(AttributeError, TypeError):  # a builtin, a class without a writable dict
        setattr(obj, _SHIM_MARK, True)
    return obj


def _install_cpu_layer() -> None:
    global _cpu_mode
    if _cpu_mode is None:
        assert not torch.cuda.is_available(), "the CPU layer must never patch a live CUDA runtime"
        _cpu_mode = _CudaToCpuMode()
        for shim in CPU_SHIMS:
            shim.install()
    # Torch function modes live on a per-thread stack, so every thread that builds or
    # moves megatron tensors needs its own push; it stays entered for the thread's life
    # because megatron creates CUDA tensors at arbitrary depth.
    if not getattr(_thread_state, "mode_entered", False):
        _cpu_mode.__enter__()
        _thread_state.mode_entered = True


# ------------------------------------------------------------- CPU-only work on a GPU node
# The one-process converters stream a checkpoint through host memory on the CPU layer below,
# which cannot run beside a live CUDA runtime; on the GPU nodes where users train,
# `tools/convert_mcore_to_hf.py` and `megatron-dapo eval <training checkpoint>` died with "the CPU
# layer cannot run next to a live CUDA runtime" unless the user set CUDA_VISIBLE_DEVICES=''
# (issue 39). The driver reads CUDA_VISIBLE_DEVICES once, at its first CUDA call (torch's
# `is_available()` included, which megatron-core's imports make; importing torch makes none), so
# hide_gpus_for_cpu_work runs at the entry point, before megatron-core is imported.


def one_process(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether no launcher started this process as one of several ranks (launcher.launcher_ranks' rule)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return env["WORLD_SIZE"] == "1"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return env["SLURM_NTASKS"] == "1"
    return True


def hide_gpus_for_cpu_work() -> bool:
    """Make this process see no GPU (CUDA_VISIBLE_DEVICES=''), if it is one process and CUDA is untouched.

    Returns:
        True if the GPUs are hidden now (or were already); False under a multi-rank launcher, whose
        ranks use their GPUs.

    Raises:
        RuntimeError: CUDA was initialised before the call (a bug: call it at the entry point).
    """
    if not one_process():
        return False
    if torch.cuda.is_initialized():
        raise RuntimeError("hide_gpus_for_cpu_work() called after CUDA was initialised; call it at the entry point")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True
