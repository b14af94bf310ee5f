"""Config loading: every bad config is one line naming key, source and fix, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_dapo import cli
from megatron_dapo.config import Config, ConfigError
from megatron_dapo.config.loader import from_dict, load_config, to_dict, to_yaml

EXAMPLES = sorted(Path(__file__).resolve().parents[2].glob("examples/*.yaml"))

# (yaml text, overrides, exact expected message after "error: "); {f} is the file path.
BAD_CONFIGS = [
    ("algorithm: {clip_ratio_hgh: 0.3}", [],
     "{f}: algorithm.clip_ratio_hgh: unknown key; did you mean 'algorithm.clip_ratio_high'?"),
    ("trainer: {seed: 1}", ["algorithm.clip_ratio_hgh=0.3"],
     "command line: algorithm.clip_ratio_hgh: unknown key; did you mean 'algorithm.clip_ratio_high'?"),
    ("algorithm: {clip_ratio_low: 1.5}", [],
     "{f}: algorithm.clip_ratio_low=1.5: must be in (0, 1]; DAPO uses 0.2"),
    ("algorithm: {clip_ratio_low: 0}", [],
     "{f}: algorithm.clip_ratio_low=0: must be in (0, 1]; DAPO uses 0.2"),
    ("algorithm: {clip_ratio_high: -0.1}", [],
     "{f}: algorithm.clip_ratio_high=-0.1: must be in (0, 10); DAPO uses 0.28"),
    ("algorithm: {clip_ratio_c: 0.5}", [],
     "{f}: algorithm.clip_ratio_c=0.5: must be > 1 (or null to disable dual clip)"),
    ("algorithm: {loss_agg_mode: token_mean}", [],
     "{f}: algorithm.loss_agg_mode='token_mean': must be one of 'token-mean', 'seq-mean-token-mean', "
     "'seq-mean-token-sum', 'seq-mean-token-sum-norm', got 'token_mean'; did you mean 'token-mean'?"),
    ("algorithm: {policy_loss: {loss_mode: gspo}, loss_agg_mode: token-mean}", [],
     "{f}: algorithm.loss_agg_mode='token-mean': is not what policy_loss.loss_mode=gspo allows "
     "(seq-mean-token-mean, its paper's); set it to one of those or to null"),
    ("trainer: {seed: 1}", ["algorithm.policy_loss.loss_mode=sapo", "algorithm.clip_ratio_high=0.28"],
     "command line: algorithm.clip_ratio_high=0.28: is set but policy_loss.loss_mode=sapo clips no ratio; "
     "set it to null"),
    ("algorithm: {policy_loss: {loss_mode: gpg}}", [],
     "{f}: algorithm.policy_loss.loss_mode='gpg': must be one of 'vanilla', 'gspo', 'cispo', 'sapo', 'geo_mean', "
     "'clip_cov', 'kl_cov', got 'gpg'"),
    ("algorithm: {policy_loss: {clip_cov_lb: 6.0}}", [],
     "{f}: algorithm.policy_loss.clip_cov_lb=6.0: must be below clip_cov_ub=5.0; the paper uses 1 and 5"),
    ("algorithm: {kl_loss_coef: 0.01}", [],
     "{f}: algorithm.kl_loss_coef=0.01: is > 0 but use_kl_loss is false; set use_kl_loss=true"),
    ("algorithm: {filter_groups: {max_num_gen_batches: -1}}", [],
     "{f}: algorithm.filter_groups.max_num_gen_batches=-1: must be >= 0 (0 = unlimited)"),
    ("algorithm: {filter_groups: {enable: 'yes please'}}", [],
     "{f}: algorithm.filter_groups.enable='yes please': expected true or false, got str 'yes please'"),
    ("data: {train_batch_size: 10, gen_batch_size: 10}\ntrainer: {ppo_mini_batch_size: 3}", [],
     "{f}: trainer.ppo_mini_batch_size=3: must divide data.train_batch_size=10 (choose one of [1, 2, 5, 10])"),
    ("data: {train_batch_size: 64, gen_batch_size: 32}", [],
     "{f}: data.gen_batch_size=32: must be >= train_batch_size=64 (each round generates that many prompts)"),
    ("data: {max_response_length: 4096}", [],
     "{f}: reward.overlong_buffer.len: must be < data.max_response_length=4096; shrink the buffer or "
     "disable it (reward.overlong_buffer.enable=false)"),
    ("trainer: {seed: 1}", ["reward.overlong_buffer.len=30000"],
     "command line: reward.overlong_buffer.len=30000: must be < data.max_response_length=20480; shrink the "
     "buffer or disable it (reward.overlong_buffer.enable=false)"),
    ("parallel: {tensor_model_parallel_size: 3}", [],
     "{f}: parallel.tensor_model_parallel_size=3 does not divide num_attention_heads=4 of model.scratch; "
     "use one of [1, 2, 4]"),
    ("parallel: {tensor_model_parallel_size: 4}", [],
     "{f}: parallel.tensor_model_parallel_size=4 does not divide num_key_value_heads=2 of model.scratch; "
     "use one of [1, 2]"),
    # PP 3 of 4 layers is uneven stages (2 + 1 + 1 ... stages.py), not an error; 5 stages of 4 layers is.
    ("parallel: {pipeline_model_parallel_size: 5}", [],
     "{f}: parallel.pipeline_model_parallel_size=5 is more stages than the 4 layers of model.scratch; use at most 4 "
     "(a size that does not divide the layers gives uneven stages)"),
    ("parallel: {tensor_model_parallel_size: 0}", [],
     "{f}: parallel.tensor_model_parallel_size=0: must be >= 1"),
    ("parallel: {sequence_parallel: true}", [],
     "{f}: parallel.sequence_parallel=True: needs tensor_model_parallel_size > 1; set it to false"),
    ("parallel: {context_parallel_size: 2}\ntrainer: {device: cpu}", [],
     "{f}: parallel.context_parallel_size=2: needs Transformer Engine attention on CUDA; set it to 1 "
     "with trainer.device=cpu"),
    ("rollout: {engine: sglng}", [],
     "{f}: rollout.engine='sglng': must be one of 'local', 'sglang', 'vllm', got 'sglng'; did you mean 'sglang'?"),
    ("rollout: {engine: vllm, top_p: 0.9}", [],
     "{f}: rollout.top_p=0.9: with engine vllm: vLLM reports log-probs renormalised after top-k/top-p, not "
     "log_softmax(logits/T); use top_p 1.0 and top_k -1 for training rollouts (val_kwargs may truncate)"),
    ("rollout: {engine: vllm}\ntrainer: {device: cpu}\nmodel: {scratch: {hidden_size: 64}}", [],
     "{f}: model.scratch.hidden_size=64: head_dim 64/4=16 is below 32, which vLLM's CPU attention does not "
     "support; raise hidden_size or lower num_attention_heads"),
    ("rollout: {n: 1}", [],
     "{f}: rollout.n=1: must be >= 2 with algorithm.filter_groups.enable=true (a group of one has no spread)"),
    ("rollout: {top_p: 0}", [], "{f}: rollout.top_p=0: must be in (0, 1]"),
    ("rollout: {val_kwargs: {top_k: 0}}", [], "{f}: rollout.val_kwargs.top_k=0: must be -1 (off) or > 0"),
    ("trainer: {seed: abc}", [], "{f}: trainer.seed='abc': expected an integer, got str 'abc'"),
    ("trainer: {total_training_steps: 2.5}", [],
     "{f}: trainer.total_training_steps=2.5: expected an integer, got float 2.5"),
    ("optim: {lr: '1e-6'}", [], "{f}: optim.lr='1e-6': expected a number, got str '1e-6'"),
    ("optim: {lr: 0}", [], "{f}: optim.lr=0: must be > 0"),
    ("optim: 0.1", [], "{f}: optim=0.1: expected a mapping of OptimConfig fields, got 0.1"),
    ("modle: {}", [], "{f}: modle: unknown key; did you mean 'model'?"),
    ("- a\n- b", [], "{f}: the top level must be a mapping of sections (model, data, ...)"),
    ("model: {hf_checkpoint: [x", [], "{f} line 1: invalid YAML: expected ',' or ']', but got '<stream end>'"),
    ("trainer: {seed: 1}", ["algorithm.clip_ratio_high"],
     "command line: bad override 'algorithm.clip_ratio_high'; expected dotted.key=value, e.g. "
     "algorithm.clip_ratio_high=0.28"),
    ("trainer: {seed: 1}", ["trainer..seed=1"],
     "command line: bad override 'trainer..seed=1'; expected dotted.key=value, e.g. "
     "algorithm.clip_ratio_high=0.28"),
]


@pytest.mark.parametrize(("text", "overrides", "expected"), BAD_CONFIGS)
def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys, text, overrides, expected):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    code = cli.run(["config", "validate", str(f), *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "error: " + expected.format(f=f) + "\n"


def test_at_least_twenty_bad_configs():
    assert len(BAD_CONFIGS) >= 20


def test_loss_agg_modes_of_config_and_actor_agree():
    # The config accepts exactly the modes the actor's aggregation implements, in the same order.
    from megatron_dapo.algo import LOSS_AGG_MODES as ALGO_MODES
    from megatron_dapo.config import LOSS_AGG_MODES

    assert LOSS_AGG_MODES == ALGO_MODES
    for mode in ALGO_MODES:
        assert load_config(None, [f"algorithm.loss_agg_mode={mode}"]).algorithm.loss_agg_mode == mode


def test_missing_file(tmp_path, capsys):
    assert cli.run(["config", "show", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'nope.yaml'}: no such config file; pick one of examples/*.yaml\n"


def test_override_types_follow_yaml():
    cfg = load_config(None, ["algorithm.clip_ratio_high=0.3", "trainer.seed=7", "algorithm.clip_ratio_c=null",
                             "data.train_files=[a.parquet, b.parquet]", "algorithm.filter_groups.enable=false"])
    assert cfg.algorithm.clip_ratio_high == 0.3
    assert cfg.trainer.seed == 7
    assert cfg.algorithm.clip_ratio_c is None
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.algorithm.filter_groups.enable is False


def test_int_widens_to_float_and_later_override_wins():
    cfg = load_config(None, ["optim.lr=1", "optim.lr=2"])
    assert cfg.optim.lr == 2.0 and isinstance(cfg.optim.lr, float)


def test_a_whole_section_override_merges_into_the_files_section(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("optim: {lr: 3.0e-4, lr_warmup_steps: 4, clip_grad: 0.5}\n")
    cfg = load_config(f, ["optim={lr: 1.0e-4}"])
    # Before: the section was replaced, so warmup and clip_grad fell back to the defaults.
    assert (cfg.optim.lr, cfg.optim.lr_warmup_steps, cfg.optim.clip_grad) == (1e-4, 4, 0.5)


def test_validate_reads_options_between_overrides(tmp_path, capsys):
    f = tmp_path / "exp.yaml"
    f.write_text("trainer: {seed: 1}\n")
    assert cli.run(["config", "validate", str(f), "optim.lr=1", "--world-size", "2", "trainer.seed=3"]) == 0
    assert capsys.readouterr().out == f"{f}: OK (data-parallel size 2 at world size 2)\n"


def test_defaults_are_the_paper_settings():
    cfg = Config()
    a = cfg.algorithm
    assert a.policy_loss.loss_mode == "vanilla"
    assert (*a.clip_ratios, a.agg_mode) == (0.2, 0.28, "token-mean")
    assert a.filter_groups.enable and a.filter_groups.metric == "acc"
    assert not a.use_kl_loss and a.kl_loss_coef == 0.0
    assert cfg.reward.overlong_buffer.len == 4096 and cfg.data.max_response_length == 20480
    assert cfg.rollout.n == 16 and cfg.rollout.val_kwargs.top_p == 0.7


@pytest.mark.parametrize(("mode", "low", "high", "agg"), [
    ("gspo", 3e-4, 4e-4, "seq-mean-token-mean"), ("cispo", 1.0, 0.28, "token-mean"),
    ("sapo", None, None, "seq-mean-token-mean"), ("geo_mean", 0.4, 0.4, "seq-mean-token-mean"),
    ("clip_cov", 0.2, 0.2, "token-mean"), ("kl_cov", None, None, "token-mean"),
])
def test_each_loss_mode_defaults_to_its_papers_clip_and_aggregation(mode, low, high, agg):
    a = load_config(EXAMPLES[0].parent / "tiny_cpu.yaml", [f"algorithm.policy_loss.loss_mode={mode}"]).algorithm
    assert (*a.clip_ratios, a.agg_mode) == (low, high, agg)
    # An explicit value wins over the mode's default.
    if low is not None:
        a = load_config(EXAMPLES[0].parent / "tiny_cpu.yaml",
                        [f"algorithm.policy_loss.loss_mode={mode}", "algorithm.clip_ratio_high=0.5"]).algorithm
        assert a.clip_ratios == (low, 0.5)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_round_trip(path):
    cfg = load_config(path)
    assert load_config(None) != cfg or path.name == "defaults"
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg
    assert to_dict(again) == to_dict(cfg)


def test_world_size_checks():
    cfg = load_config(None, ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
    assert cfg.check_world_size(8, "WORLD_SIZE") == 2
    with pytest.raises(ConfigError, match=r"TP x PP x CP = 2x2x1 = 4 does not divide the world size 6 \(WORLD_SIZE\)"):
        cfg.check_world_size(6, "WORLD_SIZE")
    cfg = load_config(None, ["trainer.nnodes=2", "trainer.n_gpus_per_node=8"])
    with pytest.raises(ConfigError, match=r"2x8 but the launcher started 8 processes"):
        cfg.check_world_size(8, "SLURM_NTASKS")


def test_hf_checkpoint_shape_is_checked(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 64}')
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.hf_checkpoint={tmp_path}", "parallel.tensor_model_parallel_size=16"])
    assert str(e.value) == (f"command line: parallel.tensor_model_parallel_size=16 does not divide "
                            f"num_attention_heads=40 of {tmp_path / 'config.json'}; use one of [1, 2, 4, 5, 8, 10, 20, 40]")


def test_an_hf_mixture_of_experts_at_tp_needs_sequence_parallelism(tmp_path):
    # megatron-core's MoE layer raises inside the actor at TP > 1 without SP: the config says so first.
    (tmp_path / "config.json").write_text('{"num_attention_heads": 32, "num_key_value_heads": 4, '
                                          '"num_hidden_layers": 48, "num_experts": 128}')
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel: must be true with parallel.tensor_model_"
                                          r"parallel_size=2 for a mixture-of-experts model \(128 experts in "):
        load_config(None, [f"model.hf_checkpoint={tmp_path}", "parallel.tensor_model_parallel_size=2"])
    load_config(None, [f"model.hf_checkpoint={tmp_path}", "parallel.tensor_model_parallel_size=2",
                       "parallel.sequence_parallel=true"])
    (tmp_path / "config.json").write_text('{"num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 48}')
    load_config(None, [f"model.hf_checkpoint={tmp_path}", "parallel.tensor_model_parallel_size=2"])


def test_console_script_show_prints_override():
    example = EXAMPLES[0]
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "config", "show", str(example),
                          "algorithm.clip_ratio_high=0.3"], capture_output=True, text=True, check=True)
    assert yaml.safe_load(out.stdout)["algorithm"]["clip_ratio_high"] == 0.3


def test_console_script_typo_exits_2_one_line():
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "config", "validate", str(EXAMPLES[0]),
                          "trainer.sav_interval=3"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "did you mean 'trainer.save_interval'?" in out.stderr
    assert "Traceback" not in out.stderr


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("optim: {lr: 1e-6, adam_eps: 1E-8}\n")
    cfg = load_config(f, ["algorithm.kl_loss_coef=0", "optim.weight_decay=1e-2"])
    assert (cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.weight_decay) == (1e-6, 1e-8, 1e-2)


def test_messages_quote_huge_values_bounded_and_build_them_only_on_failure() -> None:
    # 99,000 uses of one 600 KB string made 59 GB messages (issue 59); 600 bytes here (59 MB
    # unbounded) keeps the test safe to run where the guard is missing.
    from megatron_dapo.config.fields import _FieldError
    from megatron_dapo.config.rollout import RolloutConfig
    from megatron_dapo.config.tools import ToolsConfig

    big = "x" * 600
    with pytest.raises(_FieldError, match=r"has \['xxx") as err:
        ToolsConfig(tools=[big] * 99_000)
    assert len(str(err.value)) < 1_000
    with pytest.raises(_FieldError, match="name each node once") as err:
        RolloutConfig(engine="vllm", placement="disaggregated", num_engines=1_000, nodes=[big] * 99_000)
    assert len(str(err.value)) < 1_000
    spec = "calculator=pkg.mod:" + "f" * 600_000
    ToolsConfig(tools=[spec])  # a valid long entry: its messages are never built
