"""Process bootstrap and the parallel layout: the only module that calls megatron.core.parallel_state.

Every process runs :func:`init_distributed` (reads torchrun or SLURM env, or falls back to
a one-process world), then :func:`initialize_model_parallel` once, which builds Megatron's
TP/PP/CP/DP groups, seeds every RNG and returns a frozen :class:`ParallelDims`. Everything
else in the package receives that object (or the groups/sizes in it) instead of asking
parallel_state, so the layout is explicit at every call site (STYLE.md rule 4).
Global rank 0 is also the controller (DESIGN.md, "SPMD over torch.distributed").
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_dapo import launcher
from megatron_dapo.device import distributed_backend, setup_device
from megatron_dapo.errors import SharedUserError, UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class DistEnv:
    """Where this process sits in the job, as read from the launcher."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node; selects the GPU."""
    local_world_size: int
    """Processes of the job on one node (torchrun's LOCAL_WORLD_SIZE, SLURM's SLURM_NTASKS_PER_NODE;
    1 when the launcher does not say). Ranks 0..local_world_size-1 share the first node."""
    device: torch.device
    """This process' device (cuda:local_rank or cpu)."""
    backend: str
    """torch.distributed backend of the default group ("nccl" or "gloo")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    """Sizes, ranks and process groups of the Megatron layout; built by initialize_model_parallel.

    The global layout is world = dp * cp * pp * tp (megatron order "tp-cp-ep-dp-pp": TP
    ranks are adjacent, PP is outermost). Mixture-of-experts layers lay the same ranks out
    a second way, world = edp * ep * etp * pp (megatron's expert grid "tp-ep-dp-pp"): an
    expert-parallel group holds every expert of a layer once, spread over ep ranks of
    one pipeline stage, and an expert's weights are sharded over etp ranks.
    """

    world_size: int
    """Number of processes."""
    rank: int
    """Global rank."""
    device: torch.device
    """This process' device."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    cp: int
    """Context-parallel size."""
    dp: int
    """Data-parallel size (without CP)."""
    tp_rank: int
    """Rank in the tensor-parallel group."""
    pp_rank: int
    """Pipeline stage of this rank."""
    cp_rank: int
    """Rank in the context-parallel group."""
    dp_rank: int
    """Rank in the data-parallel group."""
    tp_group: dist.ProcessGroup
    """Tensor-parallel group."""
    pp_group: dist.ProcessGroup
    """Pipeline group (one rank per stage, same tp/dp coordinates)."""
    dp_group: dist.ProcessGroup
    """Data-parallel group without CP."""
    cp_group: dist.ProcessGroup
    """Context-parallel group."""
    dp_cp_group: dist.ProcessGroup
    """Data-parallel group including CP ranks: gradient reduction and global token counts."""
    mp_group: dist.ProcessGroup
    """Model-parallel group (TP x PP): all ranks holding one replica of the model."""
    embedding_group: dist.ProcessGroup | None
    """First and last pipeline stage (tied embeddings' gradient sync); None on middle stages."""
    pp_global_ranks: tuple[int, ...]
    """Global rank of each pipeline stage in this rank's pipeline group, by stage."""
    ep: int = 1
    """Expert-parallel size (MoE layers): each rank holds num_experts / ep experts."""
    etp: int = 1
    """Expert tensor-parallel size: how many ranks shard one expert's weights."""
    ep_rank: int = 0
    """Rank in the expert-parallel group."""
    etp_rank: int = 0
    """Rank in the expert tensor-parallel group."""
    ep_group: dist.ProcessGroup | None = None
    """Expert-parallel group (the token dispatcher's all-to-all); None without experts."""
    etp_group: dist.ProcessGroup | None = None
    """Expert tensor-parallel group; None without experts."""

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the embedding (pipeline stage 0)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the output layer and computes the loss."""
        return self.pp_rank == self.pp - 1

    @property
    def is_controller(self) -> bool:
        """Whether this rank drives rollouts, rewards and logging (global rank 0)."""
        return self.rank == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ControlGroups:
    """CPU (gloo) groups of the control plane, with the long timeout of waiting for the controller.

    Between two steps every rank but the controller waits while it generates, scores and
    validates (hours at 32B). Those waits happen here, in gloo collectives on CPU tensors:
    no NCCL kernel spins on the GPU the colocated engines are using, and the NCCL timeout
    (trainer.collective_timeout_minutes) stays short for real hangs. The batch travels
    controller -> the first rank of every data-parallel replica (`leaders`) -> the replica's
    other ranks (`replica`), so the controller pickles each data-parallel share once, not
    once per TP x PP x CP rank.
    """

    world: dist.ProcessGroup
    """Every rank: the end-of-step agreement (preemption) waits here."""
    replica: dist.ProcessGroup
    """The ranks of this rank's data-parallel replica (same dp_rank: TP x PP x CP ranks)."""
    replica_src: int
    """Global rank of the replica's first rank, which receives the replica's share."""
    leaders: dist.ProcessGroup | None
    """The first rank of every replica (the controller is one); None on the other ranks."""
    leader_ranks: tuple[int, ...]
    """Global rank of each replica's first rank, by data-parallel rank."""
    stage_sources: dist.ProcessGroup | None = None
    """The first rank of every pipeline stage (PP > 1; None elsewhere): a fleet's per-stage weight
    broadcast (rollout/fleet/stages.py) is driven here."""
    stage_source_ranks: tuple[int, ...] = (0,)
    """Global rank of each pipeline stage's first rank, by stage (``stage_source``)."""


def build_control_groups(dims: ParallelDims, timeout_minutes: float) -> ControlGroups:
    """Create the control-plane gloo groups (collective: every rank calls it, in the same order).

    Args:
        dims: this rank's layout.
        timeout_minutes: how long a rank may wait in these groups (the controller's rollout).

    Returns:
        This rank's ControlGroups.
    """
    global _peers
    timeout = timedelta(minutes=timeout_minutes)
    # Each rank's (dp_rank, host, pid); host and pid let a rank whose peer vanished name it.
    gathered: list[tuple[int, str, int]] = [(0, "", 0)] * dims.world_size
    dist.all_gather_object(gathered, (dims.dp_rank, socket.gethostname(), os.getpid()))
    dp_rank_of = [dp_rank for dp_rank, _, _ in gathered]
    _peers = [(host, pid) for _, host, pid in gathered]
    replicas = [[r for r in range(dims.world_size) if dp_rank_of[r] == d] for d in range(dims.dp)]
    leader_ranks = tuple(ranks[0] for ranks in replicas)
    world = dist.new_group(list(range(dims.world_size)), backend="gloo", timeout=timeout)
    replica = None
    for ranks in replicas:  # every rank creates every group, in the same order
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if dims.rank in ranks:
            replica = group
    leaders = dist.new_group(list(leader_ranks), backend="gloo", timeout=timeout)
    assert replica is not None and leader_ranks[0] == 0, "the controller leads data-parallel replica 0"
    sources = tuple(stage_source(dims, stage) for stage in range(dims.pp))
    stage_sources = dist.new_group(list(sources), backend="gloo", timeout=timeout) if dims.pp > 1 else None
    return ControlGroups(world=world, replica=replica, replica_src=replicas[dims.dp_rank][0],
                         leaders=leaders if dims.rank in leader_ranks else None, leader_ranks=leader_ranks,
                         stage_sources=stage_sources if dims.rank in sources else None, stage_source_ranks=sources)


def stage_source(dims: ParallelDims, stage: int) -> int:
    """Global rank of pipeline stage ``stage``'s first rank: PP is outermost in megatron's order,
    so stage s starts at s x TP x CP x DP (the controller is stage 0's)."""
    return stage * (dims.world_size // dims.pp)


def scatter_to_replicas(shares: list[Any] | None, control: ControlGroups) -> Any:
    """Hand each data-parallel replica its share of the controller's data (collective, CPU).

    Args:
        shares: on the controller, one picklable share per data-parallel rank; None elsewhere.
        control: this rank's control groups.

    Returns:
        This rank's share (every rank of a replica gets the same one).
    """
    box: list[Any] = [None]
    if control.leaders is not None:
        payload = None
        if shares is not None:
            if len(shares) != len(control.leader_ranks):
                raise ValueError(f"got {len(shares)} shares for {len(control.leader_ranks)} data-parallel ranks")
            # Group ranks follow global ranks: order the shares by their leader's global rank.
            order = sorted(range(len(shares)), key=lambda d: control.leader_ranks[d])
            payload = [shares[d] for d in order]
        dist.scatter_object_list(box, payload, src=0, group=control.leaders)
    if dist.get_world_size(control.replica) > 1:
        dist.broadcast_object_list(box, src=control.replica_src, group=control.replica)
    return box[0]


_env: DistEnv | None = None
_dims: ParallelDims | None = None
_peers: list[tuple[str, int]] | None = None
"""(host, pid) of every global rank, from build_control_groups; kept after destroy() for lost_ranks()."""


def init_distributed(device_kind: str = "auto", timeout_minutes: int = 30) -> DistEnv:
    """Set the device and join (or create) the default process group.

    Reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, else SLURM's
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with the master from MASTER_ADDR or the first
    host of SLURM_JOB_NODELIST (port from MASTER_PORT or derived from SLURM_JOB_ID), else
    starts a one-process world on a free port of 127.0.0.1. Idempotent.

    Args:
        device_kind: "auto" | "cpu" | "cuda", passed to device.setup_device.
        timeout_minutes: collective timeout of the default group.

    Returns:
        This process' DistEnv.
    """
    global _env
    if _env is not None:
        return _env
    rank, world_size, local_rank = launcher.launcher_ranks()
    one_process = not launcher.launched()
    if one_process:
        # A one-process world rendezvous with itself: a MASTER_ADDR left in the shell by
        # another job would make it wait for a host that never answers.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(launcher.free_port())
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    device = setup_device(device_kind)
    backend = distributed_backend(device)
    if not dist.is_initialized():
        # env:// is the launchers' convention: it reads MASTER_ADDR/MASTER_PORT/RANK/
        # WORLD_SIZE (exported above for SLURM and the one-process case) and, under
        # torchrun, joins the agent's store instead of hosting a second one.
        for attempt in range(3):
            try:
                dist.init_process_group(
                    backend=backend,
                    init_method="env://",
                    rank=rank,
                    world_size=world_size,
                    timeout=timedelta(minutes=timeout_minutes),
                )
                break
            except dist.DistNetworkError as err:
                # A one-process world's port is free when picked and may be taken before its store
                # binds it (an outgoing connection's ephemeral port; seen in CI-like runs beside the
                # unit tier): pick another. A launcher's port is the launcher's to choose.
                if not one_process or "EADDRINUSE" not in str(err) or attempt == 2:
                    raise
                os.environ["MASTER_PORT"] = str(launcher.free_port())
    _env = DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=launcher.launcher_local_world_size(),
                   device=device, backend=backend)
    return _env


def initialize_model_parallel(
    tp: int,
    pp: int,
    cp: int = 1,
    *,
    seed: int = 1234,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    num_layers: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    num_experts: int | None = None,
) -> ParallelDims:
    """Build Megatron's parallel groups for world = dp * cp * pp * tp and seed every RNG.

    Calls init_distributed() first if needed. Seeds python/numpy/torch with
    ``seed + 100 * pp_rank`` (stages initialise different layers differently, as in
    Megatron-LM) and megatron's model-parallel RNG tracker with ``seed`` (TP ranks get
    distinct streams, DP replicas identical ones).

    Args:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size (needs Transformer Engine attention, so CUDA).
        seed: base random seed.
        num_attention_heads: if given, checked to be divisible by tp.
        num_query_groups: if given (KV heads), checked to be divisible by tp.
        num_layers: if given, checked to be at least pp (uneven stages where pp does not divide it).
        ep: expert-parallel size (MoE models); ep * etp must divide world / pp.
        etp: expert tensor-parallel size; None = tp (megatron's default).
        num_experts: if given, checked to be divisible by ep.

    Returns:
        The ParallelDims of this rank.
    """
    global _dims
    env = init_distributed()
    etp = tp if etp is None else etp
    validate_layout(
        world_size=env.world_size,
        tp=tp,
        pp=pp,
        cp=cp,
        device=env.device,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        num_layers=num_layers,
        ep=ep,
        etp=etp,
        num_experts=num_experts,
    )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    expert_kwargs = {}
    if ep > 1 or etp != tp:  # the dense call stays exactly what it was
        expert_kwargs = {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        **expert_kwargs,
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    _dims = ParallelDims(
        world_size=env.world_size,
        rank=env.rank,
        device=env.device,
        tp=tp,
        pp=pp,
        cp=cp,
        dp=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=pp_rank,
        cp_rank=parallel_state.get_context_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_group=pp_group,
        dp_group=parallel_state.get_data_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group(),
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        mp_group=parallel_state.get_model_parallel_group(),
        embedding_group=parallel_state.get_embedding_group(check_initialized=False),
        pp_global_ranks=tuple(dist.get_process_group_ranks(pp_group)),
        ep=ep,
        etp=etp,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        etp_group=parallel_state.get_expert_tensor_parallel_group(),
    )
    seed_everything(seed, pp_rank=pp_rank)
    return _dims


def validate_layout(
    *,
    world_size: int,
    tp: int,
    pp: int,
    cp: int,
    device: torch.device,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    num_layers: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    num_experts: int | None = None,
) -> None:
    """Raise a one-line ValueError for a layout Megatron cannot build; see initialize_model_parallel."""
    etp = tp if etp is None else etp
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
        if value < 1:
            raise ValueError(f"parallel size {name}={value} must be >= 1")
    if (ep > 1 or etp != tp) and world_size % (ep * etp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by ep*etp*pp = {ep}*{etp}*{pp} = {ep * etp * pp}: "
            "expert-parallel groups hold ep x etp ranks of one pipeline stage; change ep or etp"
        )
    if num_experts is not None and num_experts % ep != 0:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by expert_model_parallel_size={ep}; "
            f"pick ep among the divisors of {num_experts}"
        )
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
            f"launch a multiple of {tp * pp * cp} processes or change tp/pp/cp"
        )
    if cp > 1 and device.type != "cuda":
        raise ValueError(
            f"context parallelism cp={cp} needs Transformer Engine attention on CUDA, but the device is "
            f"{device}; set cp=1 on CPU"
        )
    if num_attention_heads is not None and num_attention_heads % tp != 0:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} is not divisible by tp={tp}; "
            f"pick tp among the divisors of {num_attention_heads}"
        )
    if num_query_groups is not None and num_query_groups % tp != 0:
        raise ValueError(
            f"num_key_value_heads={num_query_groups} is not divisible by tp={tp}; "
            f"pick tp among the divisors of {num_query_groups}"
        )
    if num_layers is not None and num_layers < pp:
        raise ValueError(
            f"num_hidden_layers={num_layers} is fewer than the pp={pp} pipeline stages; use pp <= {num_layers} "
            "(a pp that does not divide the layers gives uneven stages: plan/stages.py)"
        )


def seed_everything(seed: int, pp_rank: int = 0) -> None:
    """Seed python, numpy, torch (CPU and CUDA) and megatron's model-parallel RNG tracker.

    Args:
        seed: base seed.
        pp_rank: pipeline stage; offsets the non-tracker seeds by 100 per stage.
    """
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    # On CPU the device layer points megatron's "cuda" RNG at the CPU generator, so this
    # seeds the tracker's streams there; on GPU it seeds the CUDA generators.
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(stage_seed)


def current_dims() -> ParallelDims:
    """The ParallelDims built by the last initialize_model_parallel call in this process."""
    if _dims is None:
        raise RuntimeError("initialize_model_parallel() has not been called in this process; call it first")
    return _dims


def destroy() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    global _env, _dims
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _env = None
    _dims = None


def lost_ranks(own_rank: int) -> str:
    """Which ranks are gone, for the line of a rank whose peer left a collective.

    A rank on this host is gone when its process no longer runs (or is a zombie); ranks on
    other hosts cannot be checked from here and are listed as such. Empty before
    build_control_groups (no table yet).

    Args:
        own_rank: this process' global rank.

    Returns:
        E.g. "rank 1 (pid 4242 on node3) is gone" or "no rank on node3 is gone; ranks 2, 3 on
        other hosts could not be checked"; "" when not known.
    """
    if _peers is None:
        return ""
    here = socket.gethostname()
    local = [r for r, (host, _) in enumerate(_peers) if host == here and r != own_rank]
    gone = [r for r in local if _pid_gone(_peers[r][1])]
    remote = [r for r, (host, _) in enumerate(_peers) if host != here]
    parts = []
    if gone:
        names = ", ".join(f"rank {r} (pid {_peers[r][1]} on {here})" for r in gone)
        parts.append(f"{names} {'is' if len(gone) == 1 else 'are'} gone")
    elif local:
        parts.append(f"no other rank on {here} is gone")
    if remote:
        parts.append(f"rank{'s' if len(remote) > 1 else ''} {', '.join(map(str, remote))} on other hosts "
                     "could not be checked")
    return "; ".join(parts)


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] in "ZX"  # exited, not yet reaped by the launcher
    except FileNotFoundError:
        return True
    except OSError:  # no procfs
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def on_controller(fn: Any) -> Any:
    """Run `fn` on the controller and broadcast its result (collective).

    A UserError there is raised on every rank as a SharedUserError, so every rank exits
    with code 2 and the message prints once, instead of the others waiting in the next
    collective for a controller that is gone.
    """
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    result, error = broadcast_object((result, error))
    if error is not None:
        raise SharedUserError(error)
    return result


def broadcast_object(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
