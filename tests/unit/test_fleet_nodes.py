"""Where a fleet's servers run (rollout/fleet/nodes.py): beside the trainer, or srun steps on nodes of
their own; the sbatch split (ENGINE_NODES) and the config's one-line refusals. The real srun path runs
in tests/slurm/test_slurm_fleet.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.config.loader import load_config
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.fleet import nodes
from megatron_dapo.rollout.fleet.nodes import fleet_sites, job_cpus_per_node, weight_master_address

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def slurm_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SLURM job of nodes a,b,c (the trainer's step on a), scontrol answered as SLURM 22.05 does."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "a,b,c")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "a")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "8,4(x2)")
    monkeypatch.setattr(nodes.shutil, "which", lambda name: f"/usr/bin/{name}")

    def scontrol(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        if argv[1:3] == ["show", "hostnames"]:
            return subprocess.CompletedProcess(argv, 0, "\n".join(argv[3].split(",")) + "\n", "")
        if argv[1:4] == ["-o", "show", "node"]:
            return subprocess.CompletedProcess(argv, 0, f"NodeName={argv[4]} Arch=x86_64 NodeAddr=10.0.0.{ord(argv[4][0])} "
                                                        "NodeHostName=x CPUTot=8\n", "")
        raise AssertionError(argv)

    monkeypatch.setattr(nodes.subprocess, "run", scontrol)


def test_servers_beside_the_trainer_share_its_cores_and_bind_loopback() -> None:
    sites = fleet_sites(2)
    assert [(s.host, s.launcher, s.node, s.slot, s.peers, s.cores) for s in sites] == [
        ("127.0.0.1", (), None, 0, 2, None), ("127.0.0.1", (), None, 1, 2, None)]
    assert fleet_sites(1, host="10.1.1.1")[0].host == "10.1.1.1"
    assert weight_master_address(None) == "127.0.0.1" and weight_master_address("10.1.1.1") == "10.1.1.1"


@pytest.mark.usefixtures("slurm_job")
def test_servers_on_nodes_of_their_own_are_srun_steps_spread_over_the_nodes() -> None:
    sites = fleet_sites(3, nodes=["b", "c"])
    assert [(s.node, s.host, s.slot, s.peers) for s in sites] == [
        ("b", "10.0.0.98", 0, 2), ("c", "10.0.0.99", 0, 1), ("b", "10.0.0.98", 1, 2)]
    assert sites[2].launcher == ("srun", "--jobid=77", "--nodes=1", "--ntasks=1", "--nodelist=b", "--overlap",
                                 "--kill-on-bad-exit=1", "--cpu-bind=none", "--job-name=engine2")
    # The node's cores, not the trainer's: b holds 4 CPUs of the job.
    assert sites[0].cores == (0, 1, 2, 3)


@pytest.mark.usefixtures("slurm_job")
def test_a_node_of_the_fleet_takes_its_cores_whole_whatever_the_trainer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_dapo.rollout.sglang.server import cpu_fleet_binding as sglang_binding
    from megatron_dapo.rollout.vllm.server import cpu_fleet_binding as vllm_binding

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # dapo.sbatch's default for the trainer's ranks
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    first, _, third = fleet_sites(3, nodes=["b", "c"])
    assert sglang_binding(third.slot, third.peers, list(third.cores)) == {
        "OMP_NUM_THREADS": "2", "SGLANG_CPU_OMP_THREADS_BIND": "2,3"}
    assert vllm_binding(first.slot, first.peers, list(first.cores)) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    # Beside the trainer its OMP_NUM_THREADS still caps the servers (a sweep of trainers sets it).
    assert sglang_binding(0, 1)["OMP_NUM_THREADS"] == "1"


def test_job_cpus_per_node_reads_slurms_compressed_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodes, "_hostnames", lambda nodelist: nodelist.split(","))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1,n2,n3")
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "16,8(x2)")
    assert job_cpus_per_node() == {"n1": 16, "n2": 8, "n3": 8}
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "16(x2)")  # two counts for three nodes: not trusted
    assert job_cpus_per_node() == {}
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", "garbage")
    assert job_cpus_per_node() == {}


@pytest.mark.usefixtures("slurm_job")
@pytest.mark.parametrize(("names", "unset", "words"), [
    (["b"], "SLURM_JOB_ID", "not in one (no SLURM_JOB_ID)"),
    (["d"], None, "d not in this job's nodes (a,b,c)"),
    (["a", "b"], None, "a also runs the trainer's ranks"),
])  # fmt: skip
def test_nodes_outside_a_job_or_the_actors_own_are_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch, names: list[str], unset: str | None, words: str) -> None:
    if unset:
        monkeypatch.delenv(unset)
    with pytest.raises(UserError) as err:
        fleet_sites(2, nodes=names)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_missing_srun_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setattr(nodes.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="srun is not on this node's PATH"):
        fleet_sites(1, nodes=["b"])


@pytest.mark.parametrize(("overrides", "words"), [
    (["rollout.nodes=[b]"], "only a fleet has"),
    (["rollout.engine=vllm", "rollout.placement=disaggregated", "rollout.nodes=[b,b]"], "name each node once"),
    (["rollout.engine=vllm", "rollout.placement=disaggregated", "rollout.nodes=[b,c]"], "the rest would stay idle"),
])  # fmt: skip
def test_config_refuses_nodes_without_a_fleet_to_use_them(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(REPO / "examples" / "tiny_cpu.yaml", ["trainer.max_staleness=1",
                                                          "algorithm.rollout_correction.rollout_is=token", *overrides])


def test_a_server_on_another_node_takes_ports_free_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Its host is the other node's address, which no socket here can bind."""
    from megatron_dapo.rollout.sglang.server import (
        SGLangServerConfig,
        build_launch_command,
        resolve_server_config,
    )

    config = SGLangServerConfig(model_path=str(tmp_path), device="cpu", max_total_tokens=64, host="203.0.113.7",
                                python=sys.executable, log_path=str(tmp_path / "s.log"), launcher=("srun", "-w", "b"))
    resolved = resolve_server_config(config, "sglang0")
    assert resolved.launcher == ("srun", "-w", "b") and resolved.port > 0 and resolved.nccl_port > 0
    command = build_launch_command(resolved)
    assert command[command.index("--host") + 1] == "203.0.113.7"


def _dry_run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    return subprocess.run(["bash", *args], env={**clean, "DRY_RUN": "1", **env}, text=True, capture_output=True,
                          timeout=120, cwd=REPO)


def test_dry_run_splits_the_nodes_and_plans_the_split() -> None:
    proc = _dry_run("slurm/dapo_32b.sbatch", "rollout.num_engines=4", "rollout.tensor_model_parallel_size=8",
                    ENGINE_NODES="4", NNODES="20")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].endswith("nodes: " + " ".join(f"node{i}" for i in range(16)))
    assert lines[2] == "engine nodes: node16 node17 node18 node19"
    assert "--nodes=16 --ntasks-per-node=8 --ntasks=128 " in lines[3]
    assert "--nodelist=node0,node1,node2,node3,node4,node5,node6,node7,node8,node9,node10,node11,node12,node13," \
           "node14,node15 " in lines[3]
    assert " trainer.nnodes=16 trainer.n_gpus_per_node=8 " in lines[3]
    assert " rollout.placement=disaggregated rollout.nodes=[node16,node17,node18,node19] rollout.num_engines=4" in lines[3]
    assert any(line.startswith("disaggregated split: --engine-nodes 4 of 20 nodes") for line in lines), proc.stdout


@pytest.mark.parametrize("value", ["2", "x"])
def test_dry_run_refuses_engine_nodes_that_leave_no_actor(value: str) -> None:
    proc = _dry_run("slurm/dapo_tiny.sbatch", ENGINE_NODES=value, NNODES="2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and f"ENGINE_NODES={value}" in proc.stderr


def test_a_vllm_cpu_fleet_of_tensor_parallel_servers_fails_config_validate_in_one_line() -> None:
    """`config validate` (dapo.sbatch's preflight) stops a vLLM fleet whose CPU servers would need
    more than one worker in seconds, not after the actor is built (the engines' start refuses it
    too, for trainer.device=auto); before, the setting was dropped and each server ran TP 1."""
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "config", "validate", "examples/tiny_cpu.yaml",
                           "trainer.device=cpu", "rollout.engine=vllm", "rollout.placement=disaggregated",
                           "rollout.tensor_model_parallel_size=2", "trainer.max_staleness=1",
                           "algorithm.rollout_correction.rollout_is=token"],
                          cwd=REPO, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "on CPU runs each server on one worker, not rollout.tensor_model_parallel_size=2" in proc.stderr


def test_sglang_and_vllm_fleets_may_run_on_gpus() -> None:
    from megatron_dapo.config import Config
    from megatron_dapo.rollout.factory import check_engine_device

    cfg = Config()
    cfg.rollout.placement, cfg.rollout.tensor_model_parallel_size = "disaggregated", 2
    for engine in ("sglang", "vllm"):
        cfg.rollout.engine = engine
        check_engine_device(cfg.rollout, "cuda")
    with pytest.raises(UserError, match="runs each server on one worker"):
        check_engine_device(cfg.rollout, "cpu")
    cfg.rollout.engine = "sglang"
    check_engine_device(cfg.rollout, "cpu")


def test_gpu_vllm_servers_beside_the_trainer_see_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM takes the first GPUs it sees (no --base-gpu-id): CUDA_VISIBLE_DEVICES names each server's,
    counted in the trainer's own CUDA_VISIBLE_DEVICES when set; an srun step gets its GPUs from SLURM."""
    from megatron_dapo.rollout.fleet.nodes import FleetSite, visible_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sites = fleet_sites(2, gpus_per_server=2, trainer_gpus=4, node_gpus=8)
    assert [visible_gpus(s, 2) for s in sites] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,6,7,9,10,11")
    assert [visible_gpus(s, 2) for s in sites] == [{"CUDA_VISIBLE_DEVICES": "7,9"}, {"CUDA_VISIBLE_DEVICES": "10,11"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    with pytest.raises(UserError, match=r"needs GPUs 6..7 of those this process sees, CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 "
                                        r"lists 6") as err:
        visible_gpus(sites[1], 2)
    assert "\n" not in str(err.value)
    assert visible_gpus(FleetSite(host="b", launcher=("srun",), node="b"), 2) == {}


def test_a_vllm_gpu_fleet_launches_tensor_parallel_servers_in_the_actors_dtype_without_sleep_mode(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The factory's half of a vLLM GPU fleet (DESIGN.md "GPU fleets"): two trainer ranks on GPUs 0-1
    of a 6-GPU node, two TP-2 servers on 2-3 and 4-5, bf16, the broadcast backend, each a member of
    TP 2 in the weight group. Not run on a GPU: the launch is captured."""
    import torch

    from megatron_dapo.config import Config
    from megatron_dapo.rollout import factory
    from megatron_dapo.rollout.vllm.engine import VLLMEngine
    from megatron_dapo.rollout.vllm.server import build_launch_command

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    launched: list[dict] = []
    monkeypatch.setattr(VLLMEngine, "launch", classmethod(lambda cls, hf_dir, **kw: launched.append(kw) or kw["name"]))
    cfg = Config()
    cfg.rollout.engine, cfg.rollout.placement, cfg.rollout.num_engines = "vllm", "disaggregated", 2
    cfg.rollout.tensor_model_parallel_size, cfg.rollout.gpu_memory_utilization = 2, 0.8
    assert factory._vllm_training(cfg, tmp_path, None, torch.device("cuda"), tmp_path) == ["vllm0", "vllm1"]
    launched.sort(key=lambda kw: kw["name"])
    assert [kw["env"] for kw in launched] == [{"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"}]
    assert all(kw["device"] == "cuda" and kw["tensor_parallel_size"] == 2 and kw["dtype"] == "bfloat16"
               and kw["broadcast"] and kw["gpu_memory_utilization"] == 0.8 for kw in launched)
    command = build_launch_command("/ckpt", host="h", port=1, device="cuda", broadcast=True, tensor_parallel_size=2,
                                   dtype="bfloat16", gpu_memory_utilization=0.8)
    flag = {a: command[i + 1] for i, a in enumerate(command[:-1]) if a.startswith("--")}
    assert "--enable-sleep-mode" not in command and flag["--tensor-parallel-size"] == "2"
    assert flag["--dtype"] == "bfloat16" and flag["--weight-transfer-config"] == '{"backend": "megatron_dapo_broadcast"}'

    class Stopped:
        def stop(self) -> None:
            pass

    engine = VLLMEngine("http://127.0.0.1:1", name="vllm0", api_key="k", process=Stopped(), tp_size=2)  # type: ignore[arg-type]
    try:
        from megatron_dapo.rollout.fleet.broadcast import WeightBroadcast

        assert WeightBroadcast([engine, engine], master_address="127.0.0.1", backend="gloo").world_size == 5
    finally:
        engine.shutdown()


def test_gpu_servers_beside_the_trainer_take_the_gpus_after_its_ranks() -> None:
    """Four trainer ranks on GPUs 0-3 of an 8-GPU node: two TP-2 servers on GPUs 4-5 and 6-7
    (SGLang's --base-gpu-id); a third would not fit, and says so before anything starts."""
    sites = fleet_sites(2, gpus_per_server=2, trainer_gpus=4, node_gpus=8)
    assert [(s.base_gpu_id, s.launcher) for s in sites] == [(4, ()), (6, ())]
    with pytest.raises(UserError, match=r"need 10 GPUs, this node shows 8") as err:
        fleet_sites(3, gpus_per_server=2, trainer_gpus=4, node_gpus=8)
    assert "\n" not in str(err.value)


@pytest.mark.usefixtures("slurm_job")
def test_gpu_servers_on_nodes_of_their_own_are_steps_with_gpus_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not --overlap (it shares GRES since SLURM 22.05: every server would see the same GPUs):
    --gres=gpu:TP steps, each with its share of the node's CPUs and of the job's memory there, so
    the node's steps start side by side; SLURM sets each one's CUDA_VISIBLE_DEVICES (base GPU 0)."""
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "64000")
    sites = fleet_sites(3, nodes=["b", "c"], gpus_per_server=2)
    assert sites[0].launcher == ("srun", "--jobid=77", "--nodes=1", "--ntasks=1", "--nodelist=b", "--exact",
                                 "--gres=gpu:2", "--cpus-per-task=2", "--mem=32000M", "--kill-on-bad-exit=1",
                                 "--cpu-bind=none", "--job-name=engine0")
    # c runs one server: the node's 4 CPUs and the job's memory there are its own.
    assert "--cpus-per-task=4" in sites[1].launcher and "--mem=64000M" in sites[1].launcher
    assert all("--overlap" not in s.launcher and s.base_gpu_id == 0 for s in sites)
    # No memory request of the job: --mem=0 (the job's memory on the node, held from no other step).
    monkeypatch.delenv("SLURM_MEM_PER_NODE")
    assert "--mem=0" in fleet_sites(1, nodes=["b"], gpus_per_server=1)[0].launcher


@pytest.mark.usefixtures("slurm_job")
def test_gpu_servers_that_cannot_start_side_by_side_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on the test cluster (SLURM 22.05, 2026-11-29): two one-GPU steps on a node where the job
    held one CPU ran one after the other ("step creation temporarily disabled"), so a second server
    would never start. Too few CPUs, or GPUs, of the job on an engine node is one line up front."""
    with pytest.raises(UserError, match=r"node b holds 4 CPU\(s\) of this job, fewer than the 5 servers") as err:
        fleet_sites(9, nodes=["b", "c"], gpus_per_server=1)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "h100:4")
    fleet_sites(4, nodes=["b", "c"], gpus_per_server=2)  # 2 servers x 2 GPUs on each node: fits
    with pytest.raises(UserError, match=r"node b gets 3 servers of rollout.tensor_model_parallel_size=2 GPU\(s\), "
                                        r"6 GPUs, but the job holds 4 per node"):
        fleet_sites(5, nodes=["b", "c"], gpus_per_server=2)


def test_a_server_does_not_pass_the_jobs_requests_on_to_its_srun_step() -> None:
    """srun reads SLURM_MEM_PER_NODE as --mem, SLURM_GPUS_PER_NODE as --gpus-per-node, ...: a server
    step inheriting them asked for the job's whole node and held the next server's step back."""
    from megatron_dapo.rollout.server_process import server_environment

    env = server_environment(base={"SLURM_MEM_PER_NODE": "64000", "SLURM_GPUS_PER_NODE": "8", "SLURM_JOB_ID": "7",
                                   "SLURM_CPUS_PER_TASK": "16", "PATH": "/bin", "LOCAL_RANK": "3"})
    assert env == {"SLURM_JOB_ID": "7", "PATH": "/bin"}
