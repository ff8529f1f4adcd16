import re
from pathlib import Path
from typing import get_args

import pytest

from sluice.config.tree import MOVED, ConfigError, RunConfig, TrainConfig, cautions, load_config
from sluice.rl.advantages import ESTIMATORS
from sluice.rl.losses import AGGREGATIONS, KL_ESTIMATORS, LOSS_NAMES

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), RunConfig)


def test_configs_folder_is_not_empty():
    assert CONFIGS, "configs/ should ship at least one example"


def test_defaults_and_overrides():
    cfg = load_config(None, ["train.lr=3e-4", "env.name=countdown", "rollout.enforce_eager=false"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.env.name == "countdown"
    assert cfg.rollout.enforce_eager is False
    assert cfg.mode == "async" and cfg.max_staleness == 2


def test_a_reward_written_as_a_path_takes_overrides_of_its_section(tmp_path):
    """``reward: pkg:fn`` in a file is the section ``{functions: [pkg:fn]}``: ``--set
    reward.timeout_s=1`` and ``--set reward.functions=[...]`` apply to it."""
    config = tmp_path / "run.yaml"
    config.write_text("reward: my_rewards:exact\n")
    cfg = load_config(config, ["reward.timeout_s=2.5"])
    assert [f.fn for f in cfg.reward.functions] == ["my_rewards:exact"]
    assert cfg.reward.timeout_s == 2.5
    cfg = load_config(config, ["reward.functions=[other:fn, {fn: b:c, weight: 0.5}]"])
    assert [(f.fn, f.weight) for f in cfg.reward.functions] == [("other:fn", 1.0), ("b:c", 0.5)]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["train.lrr=1"], r"train\.lrr: unknown key; allowed here: .*\blr\b"),
        (["env.name=chess"], r"env\.name: unknown environment 'chess'; allowed: addition, count"),
        (["train.lr=-1"], r"train\.lr: Input should be greater than 0"),
        (["policy.hidden=100", "policy.heads=3"], r"policy\.heads \(3\) must divide"),
        (["nosuch.x=1"], r"nosuch: unknown key"),
        (["train.steps"], "not of the form"),
        (["train.steps=5", "train.steps.x=1"], "is a value, not a section"),
        (["train.loss=a2c"], r"train\.loss: .*'ppo', 'decoupled_ppo', 'tis' or 'gspo'.*'a2c'"),
        (["train.loss_agg=sum"], r"train\.loss_agg: .*'token_mean', 'seq_mean_token_mean' or"),
        (["train.advantage=gae"], r"train\.advantage: .*'grpo', 'rloo', 'reinforce_pp' or"),
        (
            ["train.advantage=rloo", "train.scale_adv_by_std=false"],
            r"scale_adv_by_std: false applies to train\.advantage: grpo only; 'rloo'",
        ),
        (["train.clip_eps_high=0"], r"train\.clip_eps_high: Input should be greater than 0"),
        (["train.kl_estimator=k4"], r"train\.kl_estimator: Input should be 'k1', 'k2' or 'k3'"),
        (
            ["train.critic={}", "train.advantage=rloo"],
            r"train\.critic computes the advantages \(GAE\); train\.advantage 'rloo' would",
        ),
        (["train.critic.lam=1.5"], r"train\.critic\.lam: Input should be less than or equal to 1"),
        (["train.kl_coef=-1"], r"train\.kl_coef: Input should be greater than or equal to 0"),
        (
            ["train.dynamic_sampling=true", "mode=one_step"],
            r"train\.dynamic_sampling needs mode: async \(mode 'one_step' generates a fixed",
        ),
        (
            ["train.overlong_buffer=64", "rollout.max_new_tokens=64"],
            r"train\.overlong_buffer \(64\) must be below rollout\.max_new_tokens \(64\)",
        ),
        (["train.is_cap=0.5"], r"train\.is_cap: Input should be greater than or equal to 1"),
        (["train.zero_stage=5"], r"train\.zero_stage: Input should be 1, 2 or 3 \(got 5\)"),
        (["train.engine=megatron"], r"train\.engine: .*'torch', 'fsdp' or 'deepspeed'.*'megatron'"),
        (["train.lora={}", "train.engine=deepspeed"], r"train\.lora needs train\.engine: torch"),
        (["train.lora.rank=600"], r"train\.lora\.rank: Input should be less than or equal to 512"),
        (["train.betas=[0.9, 1.5]"], r"train\.betas \[0\.9, 1\.5\] must each lie in \[0, 1\)"),
        (["store.capacity_batches=1"], r"store\.capacity_batches: .*greater than or equal to 2"),
        (["train.lr=inf"], r"train\.lr: Input should be a finite number"),
        (["rollout.temperature=.nan"], r"rollout\.temperature: Input should be a finite number"),
        (["name=.."], r"name: '\.\.' is not a folder name"),
        (["name=."], r"name: '\.' is not a folder name"),
        (["name=a/b"], r"name: String should match pattern"),
        (["policy.hidden=128", "policy.heads=8"], r"= 16 is a head size vLLM's attention does not"),
        (["rollout.max_new_tokens=256"], r"max_new_tokens \(256\) leaves no room for the prompt"),
        (["name=[x"], r"override 'name=\[x': the value is not valid YAML"),
    ],
    ids=[
        "typo",
        "bad-literal",
        "out-of-range",
        "cross-field",
        "bad-section",
        "no-equals",
        "into-value",
        "unknown-loss",
        "unknown-aggregation",
        "unknown-estimator",
        "std-scaling-off-grpo",
        "clip-high-zero",
        "unknown-kl-estimator",
        "critic-and-an-estimator",
        "gae-lambda-over-one",
        "negative-kl-coef",
        "dynamic-sampling-in-a-batch-mode",
        "overlong-buffer-too-long",
        "cap-below-one",
        "zero-stage-5",
        "unknown-engine",
        "lora-on-deepspeed",
        "lora-rank-vllm-cannot-serve",
        "beta-over-one",
        "new-place-out-of-range",
        "infinite",
        "nan",
        "name-dotdot",
        "name-dot",
        "name-separator",
        "head-size-vllm-refuses",
        "no-room-for-prompt",
        "yaml-in-set",
    ],
)
def test_config_errors_name_the_field(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()), ids=sorted(MOVED))
def test_a_moved_key_names_its_new_place(old, new):
    with pytest.raises(ConfigError, match=rf"{re.escape(old)}: moved; write {re.escape(new)}$"):
        load_config(None, [f"{old}=2"])
    load_config(None, [f"{new}=2"])  # and the new place takes the value


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(latin)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_loss_choices_are_the_losses_rl_losses_knows():
    assert get_args(TrainConfig.model_fields["loss"].annotation) == LOSS_NAMES
    assert get_args(TrainConfig.model_fields["loss_agg"].annotation) == AGGREGATIONS
    assert get_args(TrainConfig.model_fields["advantage"].annotation) == ESTIMATORS
    assert get_args(TrainConfig.model_fields["kl_estimator"].annotation) == KL_ESTIMATORS


def test_loss_defaults_and_overrides():
    assert (load_config(None).train.loss, load_config(None).train.is_cap) == ("ppo", 2.0)
    cfg = load_config(None, ["train.loss=tis", "train.is_cap=1"])
    assert (cfg.train.loss, cfg.train.is_cap) == ("tis", 1.0)


def test_engine_defaults_and_overrides():
    train = load_config(None).train
    assert (train.engine, train.zero_stage, train.betas, train.weight_decay) == (
        "torch",
        2,
        (0.9, 0.999),
        0.0,
    )
    cfg = load_config(
        None, ["train.engine=deepspeed", "train.zero_stage=1", "train.betas=[0.8, 0.9]"]
    )
    assert (cfg.train.engine, cfg.train.zero_stage, cfg.train.betas) == ("deepspeed", 1, (0.8, 0.9))


def test_placement_resources_default_empty_and_set_by_override():
    cfg = load_config(None, [])
    assert cfg.rollout.resources == {} and cfg.train.resources == {}
    cfg = load_config(None, ["rollout.resources.rollout=1", "train.resources={trainer: 0.5}"])
    assert cfg.rollout.resources == {"rollout": 1.0}
    assert cfg.train.resources == {"trainer": 0.5}


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.resources.CPU=1", r"rollout\.resources: CPU is Ray's own .*cpus_per_worker"),
        ("train.resources.GPU=1", r"train\.resources: GPU is Ray's own .*train\.gpus_per_rank"),
        ("rollout.resources={'9lives': 1}", r"'9lives' is not a custom Ray resource name"),
        ("rollout.resources={'a b': 1}", r"'a b' is not a custom Ray resource name"),
        ("train.resources.trainer=0", r"train\.resources: 'trainer' needs a positive amount"),
        ("rollout.resources=[rollout]", r"rollout\.resources: Input should be a valid dict"),
    ],
    ids=["cpu-builtin", "gpu-builtin", "leading-digit", "space", "zero", "not-a-mapping"],
)
def test_placement_resources_errors_name_the_field(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("overrides", "batches"),
    [
        ([], 4),  # async, max_staleness 2: the configured 4 batches hold the 3 in flight
        (["max_staleness=4"], 5),  # 5 batches may be started and not trained yet
        (["max_staleness=4", "store.capacity_batches=8"], 8),
        (["mode=sync", "max_staleness=8"], 4),  # the bound is async's only
        (["mode=one_step", "store.capacity_batches=2"], 2),
    ],
)
def test_async_store_holds_everything_admission_lets_start(overrides, batches):
    """A store smaller than what admission lets workers start hangs a pause: the workers'
    last puts wait for room that nothing consumes."""
    assert load_config(None, overrides).store_capacity_batches == batches


@pytest.mark.parametrize(
    ("assignment", "value"),
    [
        ("root=/data/runs #1 100% é", "/data/runs #1 100% é"),  # '#' starts no YAML comment
        ("root=/data/a b", "/data/a b"),
        ("root='/data/q'", "/data/q"),  # a quoted string loses its quotes
        ("train.steps=7", 7),
        ("rollout.enforce_eager=false", False),
    ],
    ids=["hash-percent-unicode", "space", "quoted", "int", "bool"],
)
def test_set_values_are_taken_as_written(assignment: str, value: object) -> None:
    key, _, _ = assignment.partition("=")
    section, _, field = key.rpartition(".")
    cfg = load_config(None, [assignment])
    got = getattr(getattr(cfg, section), field) if section else getattr(cfg, field)
    assert got == value


def test_a_learning_rate_the_tiny_policy_collapses_at_is_cautioned(tmp_path):
    assert cautions(load_config(None)) == []
    (line,) = cautions(load_config(None, ["train.lr=1e-3"]))
    assert line.startswith("train.lr 0.001: the tiny policy collapsed at 0.0003")
    folder = tmp_path / "policy"  # a real model's rate is its own business
    assert cautions(load_config(None, ["train.lr=1e-3", f"policy.path={folder}"])) == []
    assert cautions(load_config(None, ["train.lr=1e-3", "train.lora={}"])) == []


def test_credentials_in_the_storage_url_are_refused_without_repeating_them():
    with pytest.raises(ConfigError, match=r"storage\.url: credentials in the URL") as caught:
        load_config(None, ["storage.url=s3://AKIAKEY:S3CRET@bucket/runs"])
    assert "S3CRET" not in str(caught.value) and "AKIAKEY" not in str(caught.value)
    assert load_config(None, ["storage.url=s3://bucket/a@b"]).storage.url == "s3://bucket/a@b"
