"""One typed config tree for a Sluice run, loaded from YAML with command-line overrides.

Every field has a description; unknown keys are errors. ``load_config`` turns pydantic's
validation errors into one ``ConfigError`` whose message names each bad field, the value
given and what is allowed.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sluice.rl.staleness import StaleBy


class _Section(BaseModel):
    # Unknown keys are errors; so are inf and nan in any float field (an `lr: inf` would
    # only show as NaN weights steps later).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# The learning rate from which the tiny built policy's runs collapsed (its entropy and
# held-out accuracy), on the default task and on a two-word data file alike.
TINY_POLICY_LR_LIMIT = 3e-4

# Custom Ray resource names as infra/terraform's worker groups advertise them (the same rule
# as its variable validation), so a name that passes here is one a node can offer.
_RESOURCE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
# Ray's own resources have their own fields; Ray refuses them in `resources`.
_RAY_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory"}


def _check_resources(resources: dict[str, float]) -> dict[str, float]:
    for name, amount in resources.items():
        if name in ("CPU", "GPU"):
            raise ValueError(
                f"{name} is Ray's own resource, not a custom one: set it with "
                "rollout.cpus_per_worker / rollout.gpus_per_worker or train.cpus / "
                "train.gpus_per_rank"
            )
        if name in _RAY_BUILTIN or not _RESOURCE_NAME.match(name):
            raise ValueError(
                f"{name!r} is not a custom Ray resource name (letters, digits and '_', "
                f"starting with a letter; not {', '.join(sorted(_RAY_BUILTIN))})"
            )
        if amount <= 0:
            raise ValueError(f"{name!r} needs a positive amount, got {amount}")
    return resources


# Precision of a pool: "auto" is resolved where it runs (bfloat16 on a GPU, else float32).
Dtype = Literal["auto", "float32", "bfloat16"]


# Custom Ray resources an actor asks for (`rollout.resources`, `train.resources`); the
# error's location names the field.
RayResources = Annotated[dict[str, float], AfterValidator(_check_resources)]


# Head sizes vLLM's attention kernels take (vLLM 0.32, v1/attention/backends/cpu_attn.py;
# its GPU backends take these too). Any other shape of the tiny policy builds and trains,
# then fails when the rollout workers start vLLM.
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class PolicyConfig(_Section):
    """The starting policy: a tiny llama built and warm-started here, or a local HF folder."""

    path: str | None = Field(
        None,
        description="A local Hugging Face model folder (config.json, safetensors, tokenizer) to "
        "start from. Empty: build Sluice's own tiny character-level policy.",
    )
    layers: int = Field(4, ge=1, le=32, description="Decoder layers of the tiny policy.")
    hidden: int = Field(128, ge=16, le=4096, description="Hidden size of the tiny policy.")
    heads: int = Field(4, ge=1, le=64, description="Attention heads (must divide hidden).")
    intermediate: int = Field(512, ge=16, description="MLP width of the tiny policy.")
    max_positions: int = Field(256, ge=32, description="Longest prompt+response in tokens.")
    warmstart_target: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Supervised warm start stops once held-out greedy accuracy reaches this, so "
        "RL starts from a policy that is right sometimes, not never.",
    )
    warmstart_max_steps: int = Field(3000, ge=0, description="Upper bound on warm-start steps.")
    warmstart_batch: int = Field(64, ge=1, description="Warm-start batch size (sequences).")
    warmstart_lr: float = Field(2e-3, gt=0.0, description="Warm-start AdamW learning rate.")
    warmstart_eval_every: int = Field(
        20, ge=1, description="Check held-out accuracy every this many warm-start steps."
    )

    @model_validator(mode="after")
    def _a_shape_vllm_runs(self) -> PolicyConfig:
        if self.hidden % self.heads:
            raise ValueError(
                f"policy.heads ({self.heads}) must divide policy.hidden ({self.hidden})"
            )
        head = self.hidden // self.heads
        if self.path is None and head not in VLLM_HEAD_SIZES:
            sizes = ", ".join(map(str, VLLM_HEAD_SIZES))
            raise ValueError(
                f"policy.hidden / policy.heads = {head} is a head size vLLM's attention does not "
                f"run; choose hidden and heads so that it is one of {sizes}"
            )
        return self


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


# env.name values besides entry points and import paths (envs/registry.py builds them).
BUILTIN_ENVS = (
    "addition",
    "countdown",
    "dataset",
    "reasoning_gym",
    "calculator",
    "guessing",
    "textarena",
    "gym",
    "skyrl_gym",
    "openenv",
    "verifiers",
)
# verifiers environments are played by this agent, given env.args (envs/verifiers_tasksets.py).
VERIFIERS_AGENT = "sluice.envs.verifiers_tasksets:play"
# The environments that read env.data.
DATA_ENVS = ("dataset", "skyrl_gym")


class DataConfig(_Section):
    """A data file of prompts (``env.name: dataset``) and how its columns map to problems."""

    path: str = Field(
        description="A .jsonl or .parquet file (or a folder of Parquet files), or a folder "
        "saved by Hugging Face datasets' save_to_disk; a local path or an s3:// URL."
    )
    prompt: str = Field(
        "prompt", description="Column of the prompt: plain text, or a list of chat messages."
    )
    answer: str | None = Field(
        "answer", description="Column of the reference answer (reaches the reward); empty: none."
    )
    fields: list[str] = Field(
        default_factory=list, description="Further columns passed to the reward functions."
    )
    heldout_path: str | None = Field(
        None,
        description="Held-out prompts from this file. Empty: about 10% of the rows, chosen by "
        "a stable hash of the prompt.",
    )
    split: str = Field("train", description="The split to read from a datasets folder.")
    skip_trained_in: list[str] = Field(
        default_factory=list,
        description="Storage URLs of earlier runs: training rows their ledgers record as "
        "trained are left out (retrain sets this, to train on fresh rows only).",
    )


class EnvConfig(_Section):
    """Which verifiable environment to train on, and its difficulty knobs."""

    name: str = Field(
        "addition",
        description="Environment: addition, countdown, dataset (prompts from env.data), "
        "reasoning_gym (env.args: {task: <name>, size, seed, config}), the multi-turn "
        "calculator (env.args: {digits}) and guessing (env.args: {high}), TextArena games "
        "(textarena, env.args: {game: <id>}), gymnasium-style text environments (gym, "
        "env.args: {make: <import path>}), skyrl-gym's (skyrl_gym, env.args: {env_class}, "
        "with SkyRL's data file in env.data), OpenEnv's (openenv, env.args: {environment: "
        "<import path>}), verifiers' (verifiers, env.args: {taskset: <id>}; played by its own "
        "agent), a name a package "
        "registers under the sluice.environments entry point, or an import path "
        "'package.module:Class' of your own (built with env.args).",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of a plugin environment's constructor.",
    )
    data: DataConfig | None = Field(None, description="dataset: the data file and its columns.")
    digits: int = Field(2, ge=1, le=12, description="addition: most digits per operand.")
    scratch: bool = Field(
        True,
        description="addition: answer with column-by-column work (least significant digit "
        "first, with carries) before the sum; far easier for a small model to learn.",
    )
    count: int = Field(3, ge=2, le=6, description="countdown: how many numbers are given.")
    max_number: int = Field(10, ge=2, le=100, description="countdown: largest given number.")
    long_tail: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="0 = off. Above 0, problems need scratch work of widely varying length, "
        "which stretches response lengths into a long tail.",
    )
    max_turns: int = Field(
        4, ge=1, le=64, description="Multi-turn environments: model turns per episode at most."
    )
    max_turn_tokens: int | None = Field(
        None,
        ge=1,
        description="Multi-turn environments: tokens of one model turn at most (default: the "
        "episode's budget, rollout.max_new_tokens, which counts the environment's tokens too).",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Multi-turn environments: seconds one environment step may take; a step "
        "that takes longer fails its episode.",
    )
    agent: str | None = Field(
        None,
        pattern=_IMPORT_PATH.pattern,
        description="Import path 'package.module:function' of an agent that plays each "
        "episode against the rollout worker's OpenAI-compatible endpoint "
        "(docs/environments.md): called as agent(base_url, prompt, answer, **fields), it "
        "returns the reward. The environment gives the problems. With policy.path, the "
        "folder's tokenizer needs a chat template; without, the tiny policy is built as a chat "
        "model (a single-turn environment's).",
    )
    agent_args: dict[str, Any] = Field(
        default_factory=dict, description="Fixed keyword arguments of the agent."
    )
    agent_timeout_s: float = Field(
        120.0, gt=0.0, description="Seconds one agent run may take; a longer one fails."
    )
    train_prompts: int = Field(4096, ge=1, description="Size of the training prompt pool.")
    train_seed: int | None = Field(
        None,
        ge=0,
        description="Seed that draws the training prompt pool (default: the run's seed). "
        "Retraining sets a fresh one; the held-out set does not depend on it.",
    )

    @field_validator("name")
    @classmethod
    def _a_known_name(cls, name: str) -> str:
        if name in BUILTIN_ENVS or _IMPORT_PATH.match(name):
            return name
        registered = sorted(ep.name for ep in entry_points(group="sluice.environments"))
        if name in registered:
            return name
        raise ValueError(
            f"unknown environment {name!r}; allowed: {', '.join([*BUILTIN_ENVS, *registered])}, "
            "or an import path 'package.module:Class'"
        )

    @model_validator(mode="before")
    @classmethod
    def _verifiers_plays_its_episodes(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("name") != "verifiers":
            return data
        if data.get("agent") not in (None, VERIFIERS_AGENT):
            raise ValueError(
                f"env.agent: verifiers environments are played by {VERIFIERS_AGENT}; "
                "leave env.agent unset (a taskset's own harness is its agent)"
            )
        args = dict(data.get("args") or {})
        return {
            **data,
            "agent": VERIFIERS_AGENT,
            "agent_args": {**args, **(data.get("agent_args") or {})},
        }

    @model_validator(mode="after")
    def _data_goes_with_dataset(self) -> EnvConfig:
        if (self.name in DATA_ENVS) != (self.data is not None):
            raise ValueError(
                f"env.data (the data file) is what env.name={' or '.join(DATA_ENVS)} reads, "
                "and only they: set both or neither"
            )
        return self


class RewardFunctionConfig(_Section):
    """One reward function of the weighted sum."""

    fn: str = Field(description="Import path of the function, 'package.module:function'.")
    weight: float = Field(1.0, description="Its weight in the summed reward.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Fixed keyword arguments of every call (e.g. a format reward's pattern).",
    )

    @field_validator("fn")
    @classmethod
    def _an_import_path(cls, fn: str) -> str:
        if not _IMPORT_PATH.match(fn):
            raise ValueError(f"{fn!r} is not an import path of the form 'package.module:function'")
        return fn


class ServedModelConfig(_Section):
    """A model that scores completions, served in Ray actors of its own (a pool beside the
    rollout workers, with its own resources)."""

    model: str = Field(
        description="Folder of the model (config.json, tokenizer files, *.safetensors); "
        "never fetched from a hub."
    )
    workers: int = Field(1, ge=1, description="Actors serving it; a group goes to one.")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="Ray CPU slots per actor.")
    gpus_per_worker: float = Field(0.0, ge=0.0, description="GPUs per actor (0: on CPUs).")
    threads_per_worker: int = Field(1, ge=1, description="torch threads inside each actor.")
    timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="Longest a group's scoring may take; past it the group's samples fail "
        "(recorded with the reason) and the worker goes on.",
    )


class JudgeConfig(ServedModelConfig):
    """A generative judge (an LLM asked whether an answer is right), served by vLLM.
    Its answer is the verdict, kept in the trajectory rows and the ledger; ``parse`` or
    ``parse_fn`` turns it into the reward."""

    prompt: str = Field(
        description="The question put to the judge, a Python format string over {prompt} "
        "(the problem as the policy saw it), {completion}, {answer} (the reference answer) "
        "and the problem's data fields. Rendered through the judge folder's chat template "
        "when it has one."
    )
    parse: str | None = Field(
        r"(?i)^\W*yes\b",
        description="A regular expression searched in the verdict: with a group, the group "
        "is the score (a number, divided by max_score); without one, a match is reward 1 and "
        "no match 0. A verdict the pattern does not match fails its sample when the pattern "
        "has a group.",
    )
    parse_fn: str | None = Field(
        None,
        description="Instead of parse: a reward function 'package.module:function', run "
        "isolated like reward.functions, called with verdict= besides prompt=, completion= "
        "and the problem's fields.",
    )
    max_score: float = Field(1.0, gt=0.0, description="The top of the score parse captures.")
    max_new_tokens: int = Field(16, ge=1, description="Longest verdict in tokens.")
    kv_cache_gib: float | None = Field(
        None,
        gt=0.0,
        description="The judge's vLLM KV cache (None: vLLM's choice on GPUs, 0.5 GiB on CPUs).",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="The judge's context (None: the folder's)."
    )

    @field_validator("parse")
    @classmethod
    def _a_pattern(cls, parse: str | None) -> str | None:
        if parse is not None:
            try:
                compiled = re.compile(parse)
            except re.error as error:
                raise ValueError(f"{parse!r} is not a regular expression: {error}") from None
            if compiled.groups > 1:
                raise ValueError(f"{parse!r} has {compiled.groups} groups; give it one or none")
        return parse

    @field_validator("parse_fn")
    @classmethod
    def _an_import_path(cls, fn: str | None) -> str | None:
        if fn is not None and not _IMPORT_PATH.match(fn):
            raise ValueError(f"{fn!r} is not an import path of the form 'package.module:function'")
        return fn


class RewardModelConfig(ServedModelConfig):
    """A reward model: a sequence-classification folder (one label: its logit through a
    sigmoid is the reward; two or more: the probability of the last label)."""

    template: str = Field(
        "{prompt}{completion}",
        description="The text scored, a format string like judge.prompt's.",
    )
    max_length: int = Field(1024, ge=8, description="Longest scored text in tokens (cut left).")
    batch_size: int = Field(16, ge=1, description="Texts scored in one forward pass.")


class RewardConfig(_Section):
    """Reward functions of the user's own, run isolated in a pool of processes per rollout
    worker; or a judge model or a reward model, served in Ray actors of their own. None of
    them: the environment's built-in verifier scores in-process."""

    functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        description="The functions whose weighted sum is the reward. In a config, `reward:` "
        "may also be one import path, or a list of paths and {fn, weight} entries.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="Longest one call may take; a call still running then fails its sample, "
        "while the other calls go on.",
    )
    workers: int = Field(1, ge=1, description="Reward processes per rollout worker.")
    memory_mib: int = Field(
        4096,
        ge=64,
        description="Address space each reward process may map beyond the interpreter's own, "
        "in MiB.",
    )
    correct_at: float = Field(
        1.0,
        description="A sample counts as correct (accuracy, held-out) when its summed reward "
        "reaches this, unless a function returns 'correct' itself.",
    )

    judge: JudgeConfig | None = Field(
        None, description="Score with a generative judge model (instead of functions)."
    )
    model: RewardModelConfig | None = Field(
        None, description="Score with a sequence-classification reward model."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return reward_section(value)

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        given = [
            name
            for name, on in (
                ("functions", bool(self.functions)),
                ("judge", self.judge is not None),
                ("model", self.model is not None),
            )
            if on
        ]
        if len(given) > 1:
            raise ValueError(
                f"reward.{' and reward.'.join(given)} are both set: a run scores with one of "
                "them (a judge's verdict can go through a function: judge.parse_fn)"
            )
        if self.judge is not None and self.judge.parse is None and self.judge.parse_fn is None:
            raise ValueError("reward.judge needs parse (a regular expression) or parse_fn")
        return self

    @property
    def served(self) -> JudgeConfig | RewardModelConfig | None:
        """The judge or reward model, if the run scores with one."""
        return self.judge or self.model


def reward_section(value: Any) -> Any:
    """``reward:`` written as one import path or a list, as the section it stands for."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list):
        value = {"functions": value}
    if isinstance(value, dict) and isinstance(value.get("functions"), list):
        value = {
            **value,
            "functions": [{"fn": f} if isinstance(f, str) else f for f in value["functions"]],
        }
    return value


class RolloutConfig(_Section):
    """Generation: the vLLM rollout worker and its sampling parameters."""

    prompts_per_step: int = Field(16, ge=1, description="Prompt groups per training step.")
    samples_per_prompt: int = Field(
        8, ge=2, description="Completions per prompt (the GRPO group size)."
    )
    max_new_tokens: int = Field(32, ge=1, description="Longest response in tokens.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature for rollouts.")
    workers: int = Field(1, ge=1, description="Rollout actors in the pool.")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="Ray CPU slots per rollout actor.")
    threads_per_worker: int = Field(1, ge=1, description="torch threads inside each actor.")
    concurrency: int = Field(
        0,
        ge=0,
        description="async: samples in flight per worker (vLLM's running batch); 0 means "
        "one training batch (prompts_per_step x samples_per_prompt).",
    )
    partial_rollout: bool = Field(
        True,
        description="async: a sample in flight when new weights arrive continues under "
        "them (its tokens record both versions); off: finish running samples, then load.",
    )
    long_first: bool = Field(
        True,
        description="async: hand out the groups predicted to answer longest first "
        "(an online length predictor learns from this run's lengths).",
    )
    balance: bool = Field(
        True, description="async: spread predicted tokens evenly across rollout workers."
    )
    gpus_per_worker: float | None = Field(
        None,
        ge=0.0,
        description="Ray GPUs per rollout actor (Ray then sets its CUDA_VISIBLE_DEVICES). "
        "Unset: 1 when the Ray cluster has GPUs, else 0 (tensor_parallel_size when above 1).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vLLM's tensor-parallel ranks per rollout worker: the worker asks Ray for "
        "this many GPUs and vLLM runs one process per rank on them, so a model too large for "
        "one GPU's memory (with room for its KV cache) is served across several. Each weight "
        "push reaches every rank through files in shared memory (/dev/shm).",
    )
    dtype: Dtype = Field(
        "auto",
        description="vLLM's dtype, and the weights' on the wire. auto: bfloat16 on a GPU, "
        "float32 on a CPU.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="GPU: the share of the device's memory vLLM may use (weights, "
        "activations, KV cache); vLLM sizes the KV cache from it unless kv_cache_gib is set.",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0.0,
        description="vLLM KV-cache size. Unset: on a GPU vLLM sizes it from "
        "gpu_memory_utilization; on a CPU 0.5 GiB (vLLM's own probe there reads one NUMA "
        "node and refuses to start on small machines).",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip vLLM's graph compilation and CUDA graphs. Unset: on for CPUs "
        "(starts in seconds instead of ~40 s), off on GPUs (CUDA graphs decode faster).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times Ray restarts a rollout worker whose process died; its unfinished "
        "prompts go back to the queue each time. Past this the run fails.",
    )
    dispatcher_restarts: int = Field(
        3,
        ge=0,
        description="async: times Ray restarts the dispatcher in place after its process "
        "dies; the new one is rebuilt from its last journal in the trajectory store and the "
        "groups the rollout workers hold. Past this, the segment fails and is retried from "
        "the last checkpoint.",
    )
    repack: bool = Field(
        True,
        description="async, several workers: when workers' batches have drained to a few "
        "long stragglers each, move them onto one worker so the others load new weights and "
        "take fresh groups (Laminar's repack).",
    )
    repack_max_stragglers: int = Field(
        8, ge=1, description="repack: a worker straggles when it runs at most this many samples."
    )
    repack_min_age_s: float = Field(
        1.0,
        ge=0,
        description="repack: only samples running at least this long move (a young one may "
        "finish before the move pays for its prefill on the other worker).",
    )
    placement_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a run (or a resumed segment) waits for Ray to place its actors "
        "before it fails naming what could not be placed. async starts once the trainer and "
        "one rollout worker are placed; the others join when nodes offer their resources. "
        "sync and one_step wait for every worker.",
    )
    resources: RayResources = Field(
        default_factory=dict,
        description="Custom Ray resources each rollout actor asks for, e.g. {rollout: 1}: it "
        "is placed only on nodes that advertise them (`ray start --resources`; the "
        "infra/terraform rollout group advertises `rollout`). Empty: any node with CPUs.",
    )

    @model_validator(mode="after")
    def _a_gpu_per_tensor_parallel_rank(self) -> RolloutConfig:
        tp, gpus = self.tensor_parallel_size, self.gpus_per_worker
        if tp > 1 and gpus and gpus != tp:
            raise ValueError(
                f"rollout.gpus_per_worker {gpus} with rollout.tensor_parallel_size {tp}: a "
                f"tensor-parallel worker runs one rank per GPU, so it asks for {tp} (leave "
                "gpus_per_worker unset, or set it to 0 to run the ranks on CPUs)"
            )
        return self


# The adapter ranks vLLM can serve (vllm.config.lora.MaxLoRARanks, vLLM 0.32): a worker's
# engine reserves the smallest of these at least train.lora.rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class CriticConfig(_Section):
    """PPO's learned value function: a value head on the policy's last hidden state, whose
    generalised advantage estimates replace the group's (engines/train/critic.py)."""

    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="GAE's discount per token (arXiv 1506.02438)."
    )
    lam: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="GAE's lambda: 1 is the Monte Carlo return less the value, 0 the "
        "one-token TD error.",
    )
    vf_coef: float = Field(0.5, gt=0.0, description="Weight of the value loss in the loss.")
    value_clip: float = Field(
        0.2,
        gt=0.0,
        description="PPO's value clipping: the value moves at most this far from the "
        "critic's before the step (arXiv 1707.06347, as OpenAI's baselines ppo2 clips it).",
    )
    lr: float | None = Field(
        None, gt=0.0, description="The value head's AdamW learning rate (None: train.lr)."
    )


class LoraConfig(_Section):
    """LoRA adapters (peft): the trainer trains and publishes only these, and every rollout
    worker hot-loads each published adapter into vLLM over the frozen base model."""

    rank: int = Field(
        8,
        ge=1,
        le=VLLM_LORA_RANKS[-1],
        description="Rank r of each adapter's A (r x in) and B (out x r) matrices.",
    )
    alpha: int = Field(
        16, ge=1, description="LoRA's alpha: the adapter's update is scaled by alpha / rank."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input in training. 0 keeps the trainer's "
        "log-probs equal to vLLM's, which never drops out.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Names of the linear modules that get adapters (the last part of their "
        "name, e.g. q_proj, v_proj, gate_proj); the trainer lists the model's own when one is "
        "missing.",
    )
    merged_export: bool = Field(
        False,
        description="Also save the trained policy with the adapter merged into the base "
        "weights, as a plain model folder (<policy>/merged), beside the adapter.",
    )


class TrainConfig(_Section):
    """The trainer: engine, optimiser, loss and schedule."""

    engine: Literal["torch", "fsdp", "deepspeed"] = Field(
        "torch",
        description="Training engine. torch: plain torch AdamW (DDP across train.ranks). "
        "fsdp: torch FSDP2, weights, gradients and AdamW state sharded across the ranks. "
        "deepspeed: DeepSpeed ZeRO (train.zero_stage). gloo on CPU, NCCL on GPU; from the "
        "same weights and batch all three take the same step, and each resumes the others' "
        "checkpoints.",
    )
    ranks: int = Field(
        1,
        ge=1,
        description="Trainer ranks: actors forming one torch.distributed group (gloo on CPU, "
        "NCCL on GPU), each holding train.cpus, train.gpus_per_rank and train.resources, and "
        "training on a token-balanced share of each batch. torch: DDP; fsdp: FSDP2; "
        "deepspeed: ZeRO across the ranks. 1: a single process, no group.",
    )
    placement: Literal["pack", "spread"] = Field(
        "pack",
        description="Several ranks: pack them onto as few nodes as fit (fast collectives), or "
        "spread them over nodes (Ray placement group strategies PACK and SPREAD).",
    )
    collective_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="Several ranks: how long a collective waits for the other ranks before "
        "it fails (a rank that died then fails the segment instead of hanging it).",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of the full weights (train.lora: {} for the "
        "defaults). Publishes only the adapter; needs train.engine torch (DDP across "
        "train.ranks). Unset: full fine-tuning.",
    )
    zero_stage: Literal[1, 2, 3] = Field(
        2,
        description="deepspeed: ZeRO stage. 1 partitions the optimiser state across ranks, "
        "2 the gradients too, 3 the weights too. Unused by the torch engine.",
    )

    steps: int = Field(1600, ge=1, description="RL steps (one optimiser step each).")
    lr: float = Field(
        1e-4,
        gt=0.0,
        description="AdamW learning rate. 3e-4 and above collapsed the tiny policy's entropy "
        "and lost held-out accuracy (a run warns at start).",
    )
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear learning-rate warm-up. Adam's first updates are full-size whatever "
        "the gradient's noise; ramping the rate keeps them from knocking the policy over.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Weight of an entropy bonus in the loss (0 = none)."
    )
    loss: Literal["ppo", "decoupled_ppo", "tis", "gspo"] = Field(
        "ppo",
        description="Policy loss (rl.losses). ppo: PPO-clip with the ratio taken against the "
        "behaviour (generating) policy (Schulman et al., arXiv 1707.06347). decoupled_ppo: "
        "PPO-clip against the trainer's policy before the step, times the behaviour weight "
        "pi_prox/pi_behav capped at is_cap (AReaL, arXiv 2505.24298). tis: plain policy "
        "gradient weighted by pi/pi_behav truncated at is_cap (IMPALA, arXiv 1802.01561). "
        "gspo: PPO-clip with one ratio per sequence, the geometric mean of its tokens' "
        "(GSPO, arXiv 2507.18071; use loss_agg seq_mean_token_mean and clip_eps 3e-4, "
        "clip_eps_high 4e-4 as the paper does).",
    )
    clip_eps: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="PPO clip range epsilon: the ratio is clipped to [1 - clip_eps, "
        "1 + clip_eps_high].",
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0.0,
        description="The upper clip bound's epsilon when it differs from clip_eps (DAPO's "
        "clip-higher, arXiv 2503.14476 §3.1: 0.28 beside clip_eps 0.2 leaves rare tokens room "
        "to grow and keeps entropy from collapsing). None: clip_eps. Unused by tis.",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        "token_mean",
        description="How per-token losses make a batch's loss (verl's loss_agg_mode). "
        "token_mean: every loss token of the batch weighs the same (DAPO §3.3, arXiv "
        "2503.14476). seq_mean_token_mean: each sequence's token mean, then the mean over "
        "sequences (GRPO as published, arXiv 2402.03300 eq. 3; GSPO). seq_mean_token_sum: each "
        "sequence's token sum, then the mean over sequences.",
    )
    advantage: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="Advantage estimator (rl.advantages). grpo: the group's mean subtracted, "
        "divided by its std under scale_adv_by_std (arXiv 2402.03300). rloo: each sample "
        "against the mean of the others of its group (arXiv 2402.14740). reinforce_pp: the "
        "reward normalised over the training batch's tokens, no per-prompt baseline "
        "(REINFORCE++, arXiv 2501.03262). reinforce_pp_baseline: the group's mean subtracted, "
        "then normalised over the batch the same way.",
    )
    critic: CriticConfig | None = Field(
        None,
        description="PPO with a learned value function (train.critic: {} for the "
        "defaults): a value head on the policy, its advantages by GAE from each sample's "
        "reward at its last token, its clipped value loss added to the policy loss. Unset: "
        "the group's advantages (train.advantage).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of a KL penalty toward a frozen reference policy, the starting "
        "one (0: none), added to the loss with loss_agg's weights and logged per step as "
        "train/kl_reference. Under lora the reference is the base with the adapters off (no "
        "second copy); otherwise a frozen copy of the starting policy on every training rank, "
        "in the forward passes' dtype (parameters x 4 bytes in float32, x 2 in bfloat16).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="The per-token KL(pi || ref) estimate kl_coef weighs (Schulman, "
        "http://joschu.net/blog/kl-approx.html; d = log pi - log ref): k1 = d; k2 = d^2 / 2; "
        "k3 = e^-d + d - 1 (unbiased, non-negative: verl's low_var_kl).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (arXiv 2503.14476 §3.2): a group whose rewards "
        "are all equal (no learning signal under a group baseline) is dropped as it "
        "completes, recorded in the ledger with the reason, and its place in the admission "
        "window goes back to the dispatcher, so the stream fills the batch with another "
        "prompt. mode: async only (a batch mode generates a fixed batch).",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's overlong shaping (arXiv 2503.14476 §3.4): an answer longer than "
        "rollout.max_new_tokens minus this many tokens loses up to overlong_penalty of its "
        "reward, linearly to the whole penalty at max_new_tokens. 0: none. Single-turn "
        "samples only (an episode's length is not one generation's).",
    )
    overlong_penalty: float = Field(
        1.0, gt=0.0, description="The reward an answer at rollout.max_new_tokens loses."
    )
    is_cap: float = Field(
        2.0,
        ge=1.0,
        description="Truncation of importance weights for tis, and the cap of decoupled_ppo's "
        "behaviour weight (IMPALA's rho-bar is 1: weights never exceed 1). Unused by ppo.",
    )
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm.")
    betas: tuple[float, float] = Field(
        (0.9, 0.999),
        description="AdamW's beta1 and beta2: how slowly its averages of the gradient and of "
        "its square forget; each in [0, 1).",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's decoupled weight decay.")
    adam_eps: float = Field(
        1e-8,
        gt=0.0,
        description="AdamW's epsilon, added to the root of its squared-gradient average. A "
        "gradient much smaller than it moves its weight by less than the learning rate; one "
        "much larger moves it by about the rate whatever its size.",
    )
    scale_adv_by_std: bool = Field(
        True,
        description="GRPO's std scaling of advantages (False: Dr. GRPO, centred only, arXiv "
        "2503.20783).",
    )
    micro_batch: int = Field(256, ge=1, description="Sequences per forward/backward pass.")
    micro_batch_tokens: int = Field(
        1024,
        ge=64,
        description="Padded tokens per forward/backward pass. A batch over this is sorted by "
        "length and split, each part padded only to its own longest row (long-tail answers "
        "then stop padding every short one). On this project's CPUs 512-1024 are fastest "
        "(a part's activations then stay in the core's cache; see BENCHMARKS.md); on GPUs "
        "raise it to what memory allows (8k-32k).",
    )
    logits_chunk_tokens: int = Field(
        1024,
        ge=16,
        description="Response tokens whose vocabulary logits the trainer holds at once, in "
        "the forward and the backward pass (the prompt's logits are never computed). At a "
        "49k vocabulary 1,024 tokens are 200 MB of float32 logits; their share of the peak "
        "no longer grows with micro_batch_tokens beyond this (make bench-vocab).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass "
        "(transformers' gradient checkpointing, non-reentrant) instead of holding them from "
        "the forward: a micro-batch then holds one layer's activations and each layer's "
        "input, for about one more forward pass of compute. For micro-batches of thousands "
        "of tokens, whose activations outgrow the weights (make bench-vocab).",
    )
    packing: bool = Field(
        False,
        description="Pack samples end to end into rows of up to micro_batch_tokens tokens "
        "(positions restart with each sample; attention never crosses samples) instead of "
        "padding each part to its longest row. Same loss and gradients; the trainer checks "
        "at start that the model's attention honours the packing, and refuses it if not. "
        "Pays on GPUs with flash-attention; slower on CPUs (BENCHMARKS.md).",
    )
    cpus: float = Field(1.0, gt=0.0, description="Ray CPU slots for the trainer actor.")
    gpus_per_rank: float | None = Field(
        None,
        ge=0.0,
        description="Ray GPUs for the trainer (Ray then sets its CUDA_VISIBLE_DEVICES; the "
        "trainer runs on that device). Unset: 1 when the Ray cluster has GPUs, else 0.",
    )
    dtype: Dtype = Field(
        "auto",
        description="Training precision: bfloat16 runs the forward passes in bf16 autocast "
        "over float32 master weights. auto: bfloat16 on a GPU, float32 on a CPU.",
    )
    threads: int = Field(1, ge=1, description="torch threads inside the trainer actor.")
    resources: RayResources = Field(
        default_factory=dict,
        description="Custom Ray resources the trainer asks for, e.g. {trainer: 1}: it is "
        "placed only on a node that advertises them (the infra/terraform trainer group "
        "advertises `trainer`). Empty: any node with CPUs.",
    )

    @model_validator(mode="after")
    def _one_advantage(self) -> TrainConfig:
        if self.critic is not None and self.advantage != "grpo":
            raise ValueError(
                f"train.critic computes the advantages (GAE); train.advantage "
                f"{self.advantage!r} would be ignored: leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _scale_by_std_is_grpo(self) -> TrainConfig:
        if not self.scale_adv_by_std and self.advantage != "grpo":
            raise ValueError(
                f"train.scale_adv_by_std: false applies to train.advantage: grpo only; "
                f"{self.advantage!r} does not divide by a group's std (leave it true)"
            )
        return self

    @model_validator(mode="after")
    def _betas_below_one(self) -> TrainConfig:
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"train.betas {list(self.betas)} must each lie in [0, 1)")
        return self

    @model_validator(mode="after")
    def _lora_on_the_torch_engine(self) -> TrainConfig:
        if self.lora is not None and self.engine != "torch":
            raise ValueError(
                f"train.lora needs train.engine: torch (DDP across train.ranks); "
                f"train.engine {self.engine!r} trains full weights only in this release"
            )
        return self


class EvalConfig(_Section):
    """Held-out evaluation: greedy accuracy, and mean@k / pass@k when k > 1."""

    every: int = Field(50, ge=1, description="Evaluate every this many RL steps (and at 0, end).")
    prompts: int = Field(256, ge=1, description="Held-out prompts per evaluation.")
    k: int = Field(
        1,
        ge=1,
        description="Above 1: also k samples per held-out prompt at eval.temperature, logged "
        "as eval/mean_at_<k> (share of right samples) and eval/pass_at_<k> (share of prompts "
        "with a right one), beside the greedy eval/accuracy.",
    )
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature for k > 1.")
    collapse_drop: float = Field(
        0.10,
        gt=0.0,
        le=1.0,
        description="A held-out accuracy this far below the run's best so far (0.10: 10 "
        "points), or half as far when that is half of what the run had gained, is a "
        "collapse: said in the step line, MLflow (health/*) and the summary, which then "
        "points at the best policy (driver/health.py).",
    )
    entropy_floor: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="The policy's entropy (mean of the last 20 steps) under this share of its "
        "mean over the first 5 steps is a collapse once held-out accuracy has also set no new "
        "best for collapse_patience evaluations (the policy stopped exploring and improving); "
        "0 turns the check off.",
    )
    collapse_patience: int = Field(
        5,
        ge=1,
        description="Evaluations without a new best held-out accuracy after which low entropy "
        "(entropy_floor) counts as a collapse.",
    )
    mismatch_prompts: int = Field(
        16,
        ge=0,
        description="At each evaluation a rollout worker samples one answer to this many "
        "held-out prompts and the trainer scores the same tokens at the same version: "
        "eval/logprob_mismatch is the mean |difference| of their log-probs (0: no check).",
    )
    max_logprob_mismatch: float | None = Field(
        None,
        gt=0.0,
        description="A mean log-prob difference above this between the trainer and the rollout "
        "engine is warned about. Unset: 1e-3 when both run in float32 (they agree to about "
        "1e-7; a weight push that missed one tensor differed by 6e-3), 0.05 when either runs "
        "in bf16 (about 1e-2 apart when healthy).",
    )
    keep_best: bool = Field(
        True,
        description="Save the policy of the best held-out evaluation as best_policy/ in the "
        "run folder whenever it improves, beside the final policy/.",
    )


class StorageConfig(_Section):
    """Where the run's durable state goes: the ledger, trajectories and checkpoints."""

    url: str | None = Field(
        None,
        description="Where the run's durable state goes, as file:///abs/path or "
        "s3://bucket/prefix (S3 credentials from AWS_* variables); the run's name is appended. "
        "Default: the run folder itself.",
    )
    credentials_block: str | None = Field(
        None,
        description="Name of a Prefect secret block holding the S3 credentials as JSON "
        '(e.g. {"AWS_ACCESS_KEY_ID": ..., "AWS_SECRET_ACCESS_KEY": ...}). Default: the '
        "AWS_* variables of the environment. Never put credentials in a config file.",
    )

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        """A URL's ``user:secret@`` part would be printed by show-config and kept in the
        run folder's config.yaml; the message never repeats it."""
        if url is not None and "@" in url.partition("://")[2].partition("/")[0]:
            raise ValueError(
                "credentials in the URL are not allowed: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment, or name a Prefect secret block "
                "in storage.credentials_block"
            )
        return url


class StoreConfig(_Section):
    """The trajectory store: scored groups between the rollout workers and the trainer."""

    capacity_batches: int = Field(
        4,
        ge=2,
        description="Trajectory store capacity in training batches; rollout workers wait "
        "when it is full instead of letting it grow. async raises it to max_staleness + 1 "
        "when smaller (what admission may have in flight must always fit).",
    )
    lease_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="A leased batch not acknowledged within this many seconds goes back to "
        "the ready pool (its consumer is presumed dead).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times Ray restarts the trajectory store in place after its process "
        "dies; the new one is rebuilt from the ledger and the trajectory files, and the "
        "rollout workers send it the rows it lacks. Past this, the segment fails and is "
        "retried from the last checkpoint.",
    )


class CheckpointConfig(_Section):
    """Checkpoints, and the training segments that end in one."""

    every: int = Field(
        200,
        ge=1,
        description="Checkpoint every this many steps, and at the end. Training runs in "
        "segments of this many steps (Prefect tasks); a failed segment is retried from the "
        "last checkpoint.",
    )
    segment_retries: int = Field(
        2,
        ge=0,
        description="Times a failed training segment is retried, each time from the last "
        "checkpoint with freshly started pools.",
    )
    keep: int = Field(3, ge=1, description="Newest checkpoints kept.")
    keep_in_flight: bool = Field(
        True,
        description="async: save the rollouts in flight at a checkpoint with it (their "
        "tokens, log-probs and versions, an episode's turns), and after a resume from it "
        "continue them from their tokens instead of starting over; a group the staleness "
        "bound would drop starts over from its prompt. An agent's episodes always start over.",
    )


class WeightsConfig(_Section):
    """The parameter service: how new weights travel from the trainer to rollout workers."""

    relays: Annotated[int, Field(ge=1)] | Literal["per_node"] = Field(
        "per_node",
        description="Relay actors of the parameter service. per_node: one on every node alive "
        "at the start, so a node's rollout workers check for new weights on their own node "
        "(one relay for a cluster would answer every engine's checks).",
    )
    bucket_mib: int = Field(
        64, ge=1, description="Weights travel in safetensors buckets of at most this size."
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times Ray restarts relay 0 in place after its process dies; the "
        "trainer then publishes its version again. Past this, the segment fails and is "
        "retried from the last checkpoint.",
    )
    pull_timeout_s: float = Field(
        120.0,
        gt=0.0,
        description=(
            "A rollout worker's weight pull fails after this long; a worker that has served "
            "one version this long while a newer one is published is named in a warning."
        ),
    )


class TrackingConfig(_Section):
    """MLflow: where runs are recorded and the name the trained policy is registered under."""

    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (http://127.0.0.1:5000, sqlite:///...). Default: "
        "MLFLOW_TRACKING_URI if set, else a sqlite database every run under root shares "
        "(<root>/mlflow.db).",
    )
    experiment: str = Field("sluice", description="MLflow experiment name.")
    model_name: str = Field(
        "sluice-policy",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Registered model name; each finished run adds a version (alias "
        "'challenger'); the retrain flow moves 'champion'.",
    )
    register_model: bool = Field(
        True, description="Register the trained policy at the end of a run."
    )


class RunConfig(_Section):
    """A whole run. Everything it writes lands under ``<root>/<name>/``."""

    name: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.-]+$",
        max_length=128,
        description="Run name: letters, digits, '_', '.' and '-'; the run's folder under "
        "root and its storage location are named after it.",
    )
    root: str = Field("runs", description="Folder that holds one sub-folder per run.")
    cache: str = Field(".cache", description="Shared caches: built policies, vLLM, inductor.")
    seed: int = Field(0, ge=0, description="Seed for prompts, models and sampling.")
    mode: Literal["sync", "one_step", "async"] = Field(
        "async",
        description="sync: generate a batch, train on it, load the new weights, repeat. "
        "one_step: generate the next batch while training on this one (one version stale). "
        "async: rollout workers stream continuously; every group is trained at most "
        "max_staleness versions after the policy that finished it (stale_by).",
    )
    max_staleness: int = Field(
        2,
        ge=0,
        le=64,
        description="async: how many versions a trained group may lag the trainer (dated as "
        "stale_by says); admission never starts generation further ahead, staler groups are "
        "dropped and counted.",
    )
    stale_by: StaleBy = Field(
        "last_token",
        description="async with rollout.partial_rollout: which token's policy version "
        "max_staleness bounds. last_token: the policy that finished the sample; its earlier "
        "tokens may be older, and the loss's per-token ratio against the log-probs they were "
        "sampled with corrects for them (long samples are kept). first_token: every token; "
        "a sample whose generation spans more than max_staleness versions is dropped "
        "(rl/staleness.py).",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Starting policy.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Environment.")
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="The user's reward functions, if any."
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    storage: StorageConfig = Field(
        default_factory=StorageConfig, description="Where durable state goes."
    )
    store: StoreConfig = Field(default_factory=StoreConfig, description="Trajectory store.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints and training segments."
    )
    weights: WeightsConfig = Field(
        default_factory=WeightsConfig, description="Parameter service (weight transfer)."
    )
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="MLflow tracking and model registry."
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_folder(cls, name: str) -> str:
        if set(name) == {"."}:
            raise ValueError(f"{name!r} is not a folder name: the run would write outside root")
        return name

    @model_validator(mode="after")
    def _dynamic_sampling_streams(self) -> RunConfig:
        if self.train.dynamic_sampling and self.mode != "async":
            raise ValueError(
                f"train.dynamic_sampling needs mode: async (mode {self.mode!r} generates a "
                "fixed batch, which dropped groups would leave short); set mode: async"
            )
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> RunConfig:
        if self.train.overlong_buffer >= self.rollout.max_new_tokens:
            raise ValueError(
                f"train.overlong_buffer ({self.train.overlong_buffer}) must be below "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}): the penalty starts "
                "that many tokens before the limit"
            )
        return self

    @model_validator(mode="after")
    def _responses_fit_the_context(self) -> RunConfig:
        if self.policy.path is None and self.rollout.max_new_tokens >= self.policy.max_positions:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for the "
                f"prompt in policy.max_positions ({self.policy.max_positions}) tokens"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.root).resolve() / self.name

    @property
    def storage_url(self) -> str:
        """This run's storage URL: ``<storage.url>/<name>``, or the run folder."""
        if self.storage.url is None:
            return self.run_dir.as_uri()
        return f"{self.storage.url.rstrip('/')}/{self.name}"

    @property
    def cache_dir(self) -> Path:
        return Path(self.cache).resolve()

    @property
    def store_capacity_batches(self) -> int:
        """The trajectory store's capacity in training batches: ``store.capacity_batches``,
        and in ``async`` mode at least ``max_staleness + 1``.

        Admission lets workers start up to ``max_staleness + 1`` batches that are not trained
        yet. A smaller store can be full while they still hold samples; when a pause (held-out
        evaluation, the end of a segment) then waits for them to put those samples, nothing
        consumes and the run hangs.
        """
        if self.mode != "async":
            return self.store.capacity_batches
        return max(self.store.capacity_batches, self.max_staleness + 1)


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which field and what is allowed."""


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is parsed as YAML (``1e-3``, ``true``)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {assignment!r} is not of the form section.field=value")
    parts = key.strip().split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if depth == 0 and part == "reward":  # `reward: pkg:fn` in the file, reward.x set here
            child = node[part] = reward_section(child)
        if not isinstance(child, dict):
            raise ConfigError(f"override {assignment!r}: {part!r} is a value, not a section")
        node = child
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(
            f"override {assignment!r}: the value is not valid YAML ({_first_line(error)}); "
            "quote it, e.g. --set 'name=\"a b\"'"
        ) from None
    if isinstance(value, str) and raw.strip()[:1] not in ("'", '"'):
        value = raw.strip()  # a plain string as written: '#' in a path starts no comment
    node[parts[-1]] = value


# Keys that moved when the grab-bag `storage` section was split by what each configures.
MOVED = {
    "storage.capacity_batches": "store.capacity_batches",
    "storage.lease_timeout_s": "store.lease_timeout_s",
    "storage.checkpoint_every": "checkpoint.every",
    "storage.segment_retries": "checkpoint.segment_retries",
    "storage.keep_checkpoints": "checkpoint.keep",
    "storage.param_relays": "weights.relays",
    "storage.bucket_mib": "weights.bucket_mib",
    "storage.weight_pull_timeout_s": "weights.pull_timeout_s",
}


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        if where in MOVED:
            lines.append(f"  {where}: moved; write {MOVED[where]}")
        elif item["type"] == "extra_forbidden":
            section = _section_for(item["loc"][:-1])
            allowed = ", ".join(sorted(section.model_fields)) if section else "?"
            lines.append(f"  {where}: unknown key; allowed here: {allowed}")
        elif item["type"] == "value_error":  # a validator's own message names the fields
            lines.append(f"  {where}: {item['ctx']['error']}")
        else:
            lines.append(f"  {where}: {item['msg']} (got {item.get('input')!r})")
    return "invalid config:\n" + "\n".join(lines)


def _section_for(path: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in path:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def cautions(cfg: RunConfig) -> list[str]:
    """What in a valid config is known to spoil a run, each line saying how to change it."""
    found = []
    if not cfg.policy.path and cfg.train.lora is None and cfg.train.lr >= TINY_POLICY_LR_LIMIT:
        found.append(
            f"train.lr {cfg.train.lr:g}: the tiny policy collapsed at {TINY_POLICY_LR_LIMIT:g} "
            "and above (held-out accuracy fell to a fraction of its best within 30 steps); "
            "the default is 1e-4"
        )
    return found


def build_config(tree: dict[str, Any]) -> RunConfig:
    """Validate a nested dict into a RunConfig, or raise ConfigError naming every bad field."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read a YAML config (defaults when ``path`` is None), then apply ``key=value`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {str(file)!r} does not exist")
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"config file {str(file)!r} is not UTF-8 text (byte {error.start}); save it "
                "as UTF-8"
            ) from None
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {str(file)!r} is not valid YAML: {error}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(file)!r} must hold a mapping at the top level")
        tree = loaded or {}
    for assignment in overrides:
        apply_override(tree, assignment)
    return build_config(tree)
