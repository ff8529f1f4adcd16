"""Build the configured environment (``env`` in the config), and check a run against it
before anything starts."""

from __future__ import annotations

import inspect
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from sluice.config.tree import (
    ConfigError,
    DataConfig,
    EnvConfig,
    PolicyConfig,
    RewardConfig,
    RunConfig,
)
from sluice.engines.agents.episodes import AgentSpec
from sluice.engines.cluster.ray_cluster import child_env
from sluice.engines.reward_models.scorer import ModelScorer, render
from sluice.engines.reward_models.served import ServedModels, launch_served
from sluice.engines.rollout.dispatcher import LedgerSink
from sluice.engines.rollout.episodes import StepSpec
from sluice.engines.train.lora import check_base
from sluice.envs import ENV_NAMES, Environment, Problem, make_env
from sluice.envs.base import ChatPrompts
from sluice.envs.dataset import Columns, DatasetEnv, DataSource, Messages, Renderer
from sluice.envs.multi_turn import EpisodeLimits, is_multi_turn
from sluice.envs.prompts import FittingPrompts, PromptSource
from sluice.envs.registry import env_factory
from sluice.envs.rewards import (
    RewardFunction,
    RewardPool,
    check_signature,
    import_function,
    module_root,
)
from sluice.envs.scoring import RecordedScorer, Scorer, make_scorer
from sluice.envs.skyrl_gym_envs import SkyRLGymEnv
from sluice.storage.ledger import Ledger, LedgerEvent
from sluice.storage.urls import open_url

log = logging.getLogger("sluice")


def make_environment(cfg: EnvConfig, policy: PolicyConfig | None = None) -> tuple[Environment, str]:
    """The environment and a signature string that changes whenever its problems would.

    ``policy``: renders a dataset's chat-message prompts with its model folder's chat
    template. A ConfigError names an environment that cannot be built.
    """
    try:
        if cfg.name == "addition":
            env = make_env(
                "addition", digits=cfg.digits, long_tail=cfg.long_tail, scratch=cfg.scratch
            )
            knobs: dict[str, Any] = {
                "digits": cfg.digits,
                "long_tail": cfg.long_tail,
                "scratch": cfg.scratch,
            }
        elif cfg.name == "countdown":
            env = make_env(
                "countdown", count=cfg.count, max_number=cfg.max_number, long_tail=cfg.long_tail
            )
            knobs = {"count": cfg.count, "max_number": cfg.max_number, "long_tail": cfg.long_tail}
        elif cfg.name == "dataset":
            assert cfg.data is not None  # the config requires it
            env = dataset_environment(cfg.data, policy)
            knobs = {"data": cfg.data.model_dump()}
        elif cfg.name == "skyrl_gym":
            assert cfg.data is not None  # the config requires it
            skyrl = make_env(cfg.name, **cfg.args)
            assert isinstance(skyrl, SkyRLGymEnv)
            rows = dataset_environment(cfg.data, policy, every_column=True)
            skyrl.render_prompts(rows.render)
            skyrl.use_data(rows)
            env = skyrl
            knobs = {"args": cfg.args, "data": cfg.data.model_dump()}
        else:
            env = make_env(cfg.name, **cfg.args)
            knobs = {"args": cfg.args}
            if isinstance(env, ChatPrompts) and policy is not None:
                if not policy.path:
                    raise ConfigError(
                        f"{cfg.name!r} has no reference answers for the built-in tiny "
                        "policy to start from; set policy.path to a model folder (make "
                        "model writes SmolLM2-135M-Instruct's)"
                    )
                env.render_prompts(chat_renderer(policy.path))
    except ValueError as error:  # DataError is one
        raise ConfigError(f"env: {error}") from None
    return env, json.dumps({"name": cfg.name, **knobs}, sort_keys=True, default=str)


def dataset_environment(
    data: DataConfig, policy: PolicyConfig | None, every_column: bool = False
) -> DatasetEnv:
    """The data file (local or s3://, through the run's storage code) as an environment;
    ``every_column``: each row's columns all reach its problem's fields (an environment's
    extras), the answer column none."""

    def source(path: str) -> DataSource:
        fs, root = open_url(path)
        return DataSource(root, fs, data.split)

    train = source(data.path)
    if every_column:
        columns = Columns(data.prompt, None, tuple(train.schema.names))
    else:
        columns = Columns(data.prompt, data.answer, tuple(data.fields))
    heldout = source(data.heldout_path) if data.heldout_path else None
    render = chat_renderer(policy.path) if policy is not None and policy.path else None
    skip = trained_prompts(data.skip_trained_in)
    return DatasetEnv(train, columns, heldout, render, skip)


def trained_prompts(urls: list[str]) -> frozenset[str]:
    """Prompt ids the ledgers of the runs at ``urls`` record as trained (a run without a
    ledger has trained none)."""
    trained: set[str] = set()
    for url in urls:
        ledger = Ledger(url)
        if not ledger.watermark():  # nothing flushed: nothing trained
            continue
        table = ledger.read().select(["prompt_id", "event"])
        trained.update(
            p
            for p, e in zip(*(table[c].to_pylist() for c in ("prompt_id", "event")), strict=True)
            if e == "trained"
        )
    return frozenset(trained)


def chat_renderer(model_dir: str) -> Renderer | None:
    """Chat messages -> the prompt text the model's chat template makes of them, ending with
    its generation prompt; None when the folder's tokenizer has no chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        return None

    def render(messages: Messages) -> str:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    return render


def eval_tokens(cfg: RunConfig, heldout: list[Problem]) -> int:
    """How many tokens a held-out answer may take: the built-in policy spells one token per
    character, so a little more than the longest reference answer; otherwise (or without
    reference answers, or for a multi-turn episode) ``rollout.max_new_tokens``."""
    if cfg.policy.path is None and all(p.answer for p in heldout) and not plays_episodes(cfg):
        return max(len(p.answer) for p in heldout) + 4
    return cfg.rollout.max_new_tokens


def plays_episodes(cfg: RunConfig) -> bool:
    """Whether the run plays episodes: an agent plays them, or the environment is
    multi-turn (a built-in one, or a plugin's class)."""
    if cfg.env.agent is not None:
        return True
    return cfg.env.name != "dataset" and is_multi_turn(env_factory(cfg.env.name))


def agent_spec(cfg: RunConfig) -> AgentSpec | None:
    """The run's agent (``env.agent``) as the rollout workers start it."""
    e = cfg.env
    if e.agent is None:
        return None
    root = module_root(e.agent)
    roots = (root,) if root is not None else ()
    return AgentSpec(e.agent, dict(e.agent_args), e.agent_timeout_s, cfg.reward.memory_mib, roots)


def step_spec(cfg: RunConfig) -> StepSpec | None:
    """How a multi-turn environment's steps are built in their own process (None: the
    environment is single-turn)."""
    e = cfg.env
    if e.name == "dataset" or not is_multi_turn(env_factory(e.name)):
        return None
    paths = [e.name] if ":" in e.name else []
    # an adapter's arguments that name the user's code (a game's factory, an opponent)
    paths += [
        str(e.args[a]) for a in getattr(env_factory(e.name), "import_args", ()) if e.args.get(a)
    ]
    roots = sorted({root for path in paths if (root := module_root(path)) is not None})
    return StepSpec(e.name, dict(e.args), tuple(roots), cfg.reward.memory_mib)


def check_agent(cfg: RunConfig) -> None:
    """The agent imports and takes what a run passes it, and the model folder has a chat
    template (or the tiny policy can be built as a chat model): a ConfigError before
    anything starts."""
    if cfg.env.agent is None:
        return
    names = ["base_url", "prompt", "answer", *reward_fields(cfg.env)[2:], *cfg.env.agent_args]
    try:
        agent = import_function(cfg.env.agent)
    except ValueError as error:
        raise ConfigError(f"env.agent: {error}") from None
    try:
        params = list(inspect.signature(agent).parameters.items())
    except (TypeError, ValueError):
        params = []  # no signature to read: the first call says
    missing = [
        name
        for name, p in params
        if p.default is p.empty
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and name not in names
    ]
    if missing:
        raise ConfigError(
            f"env.agent: {cfg.env.agent!r} requires {', '.join(map(repr, missing))}, which the "
            f"run does not pass; it is called with {', '.join(names)}"
        )
    if cfg.policy.path is None:  # the tiny policy, built as a chat model for the agent
        if cfg.env.name != "dataset" and is_multi_turn(env_factory(cfg.env.name)):
            raise ConfigError(
                f"env.agent: the tiny policy is warm-started as a chat model on single-turn "
                f"environments only, and {cfg.env.name!r} is multi-turn; set policy.path to a "
                "model folder with a chat template, or name a single-turn environment"
            )
        return
    folder = Path(cfg.policy.path).expanduser()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"env.agent: the model folder {str(folder)!r} has no chat template "
            "(tokenizer_config.json's chat_template, or chat_template.jinja); the agent's "
            "endpoint renders conversations with it"
        )
    probe = [{"role": "user", "content": "2+2?"}]
    bare = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    asking = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    if bare == asking:
        raise ConfigError(
            f"env.agent: the chat template of {str(folder)!r} has no generation prompt "
            "(add_generation_prompt changes nothing), so a reply would not start as the "
            "assistant's turn; use a template that opens the assistant's turn"
        )


def episode_limits(cfg: EnvConfig) -> EpisodeLimits:
    return EpisodeLimits(cfg.max_turns, cfg.max_turn_tokens, cfg.step_timeout_s)


def max_model_len(policy: PolicyConfig) -> int | None:
    """vLLM's context: the built-in policy's ``policy.max_positions``; for a model folder
    (``policy.path``) None, and vLLM takes the context from the folder's config.json."""
    return None if policy.path is not None else policy.max_positions


def check_model_folder(cfg: RunConfig) -> None:
    """A model folder (``policy.path``) holds a config, a tokenizer and safetensors weights;
    a ConfigError naming what is missing if not. Weights are read from safetensors only:
    a ``pytorch_model.bin`` is a pickle, and nothing is unpickled from storage."""
    if cfg.policy.path is not None:
        check_folder(Path(cfg.policy.path), "policy.path")


def check_folder(folder: Path, setting: str) -> None:
    """``folder`` (the value of ``setting``) is a loadable model folder; else a ConfigError."""
    where = f"{setting} {str(folder)!r}"
    if not folder.is_dir():
        raise ConfigError(f"{where} is not a folder; point it at a Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json: it is not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = (
            f" (it has {', '.join(pickled)}: pickled weights, which Sluice does not load; "
            "save the model with save_pretrained(..., safe_serialization=True))"
            if pickled
            else ""
        )
        raise ConfigError(f"{where} has no *.safetensors weights{hint}")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{where} has no tokenizer (tokenizer.json or tokenizer_config.json)")


def check_lora(cfg: RunConfig) -> None:
    """With ``train.lora``, the model folder (``policy.path``) can carry the adapters: vLLM
    serves LoRA for its architecture and it has the target modules; a ConfigError naming
    what is wrong if not. The built-in policy is a llama with every module the defaults
    name."""
    if cfg.train.lora is None or cfg.policy.path is None:
        return
    try:
        check_base(Path(cfg.policy.path), cfg.train.lora)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_prompts(cfg: RunConfig) -> None:
    """The environment supplies the run's training pool (``env.train_prompts``) and held-out
    set (``eval.prompts``), and with the built-in policy every prompt the run draws, plus
    ``rollout.max_new_tokens``, fits its context (``policy.max_positions``); a ConfigError
    naming the setting to change if not.

    The built-in policy has one token per character and a BOS token. A model folder
    (``policy.path``) is checked by vLLM when it starts.
    """
    env, _ = make_environment(cfg.env, cfg.policy)
    seed = cfg.seed if cfg.env.train_seed is None else cfg.env.train_seed
    try:
        train = env.problems("train", cfg.env.train_prompts, seed)
    except ValueError as error:
        raise ConfigError(f"env.train_prompts={cfg.env.train_prompts}: {error}") from None
    try:
        heldout = env.problems("heldout", cfg.eval.prompts, cfg.seed + 1)
    except ValueError as error:
        raise ConfigError(f"eval.prompts={cfg.eval.prompts}: {error}") from None
    if cfg.policy.path is not None:
        return
    longest = max([*train, *heldout], key=lambda p: len(p.prompt))
    need = len(longest.prompt) + 1 + cfg.rollout.max_new_tokens
    if need > cfg.policy.max_positions:
        raise ConfigError(
            f"the longest prompt ({len(longest.prompt) + 1} tokens, {longest.prompt!r}) plus "
            f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) is {need} tokens, more "
            f"than policy.max_positions ({cfg.policy.max_positions}); raise max_positions or "
            "lower max_new_tokens"
        )


def reward_fields(cfg: EnvConfig) -> list[str]:
    """What a reward function is called with besides the prompt and the completion."""
    return ["answer", "completion_tokens", *(cfg.data.fields if cfg.data is not None else [])]


def check_rewards(cfg: RunConfig) -> None:
    """Each configured reward function imports, is callable, and takes what the run passes
    (``check_signature``); an environment without a verifier has one. A ConfigError
    naming the first problem."""
    if cfg.reward.served is not None:
        check_served(cfg)
    if (
        cfg.env.name == "dataset"
        and not cfg.reward.functions
        and cfg.reward.served is None
        and cfg.env.agent is None
    ):
        raise ConfigError(
            "reward: a dataset has no verifier of its own; name your reward function "
            "(reward: mypkg.rewards:exact_match, or a built-in such as "
            "sluice.envs.verifiers:exact_match)"
        )
    for f in cfg.reward.functions:
        try:
            check_signature(f.fn, import_function(f.fn), [*reward_fields(cfg.env), *f.args])
        except ValueError as error:
            raise ConfigError(f"reward: {error}") from None


def check_served(cfg: RunConfig) -> None:
    """A judge's or reward model's folder loads, its template fits the problems, and a
    judge's ``parse_fn`` takes what it is passed: a ConfigError before anything starts."""
    served, section = cfg.reward.served, "reward.judge" if cfg.reward.judge else "reward.model"
    assert served is not None
    check_folder(Path(served.model), f"{section}.model")
    env, _ = make_environment(cfg.env, cfg.policy)
    if is_multi_turn(env) or cfg.env.agent is not None:
        raise ConfigError(
            f"{section}: an episode's verdict comes from its environment as it ends; a judge or "
            "reward model scores single-turn completions (unset env.agent, or score without it)"
        )
    problem = env.problems("train", 1, cfg.seed)[0]
    template = cfg.reward.judge.prompt if cfg.reward.judge else served.template  # type: ignore[union-attr]
    try:
        render(template, problem, "")
    except ValueError as error:
        where = "prompt" if cfg.reward.judge else "template"
        raise ConfigError(f"{section}.{where}: {error}") from None
    if cfg.reward.judge is not None and (fn := cfg.reward.judge.parse_fn) is not None:
        try:
            check_signature(fn, import_function(fn), [*reward_fields(cfg.env), "verdict"])
        except ValueError as error:
            raise ConfigError(f"{section}.parse_fn: {error}") from None


def check_environment(cfg: RunConfig) -> None:
    """The environment builds and, for a dataset, its columns and prompts are usable: a
    ConfigError before anything starts."""
    env, _ = make_environment(cfg.env, cfg.policy)
    rows = env.data if isinstance(env, SkyRLGymEnv) else env
    if isinstance(rows, DatasetEnv):
        try:
            rows.check()
            if not env.problems("heldout", 1, cfg.seed + 1):
                raise ValueError(
                    f"data {cfg.env.data.path if cfg.env.data else ''!r} yields no held-out "
                    "rows; give env.data.heldout_path or more rows"
                )
        except ValueError as error:
            raise ConfigError(f"env.data: {error}") from None


def scorer_factory(
    env: Environment, cfg: RewardConfig, env_cfg: EnvConfig, served: ServedModels | None = None
) -> Callable[[], Scorer]:
    """What a rollout worker (or the driver) calls to build its scorer, picklable for Ray:
    the user's reward functions in a pool, with the folders their modules import from; a
    judge or reward model in the actors ``served`` (else in actors the scorer starts for
    itself); else a plugin environment's own ``reward`` in a pool (user code too); else the
    built-in environment's verifier."""
    if is_multi_turn(env) or env_cfg.agent:  # each episode's verdict comes as it ends
        return partial(RecordedScorer, [])
    if cfg.served is not None:
        parse_fn = cfg.judge.parse_fn if cfg.judge else None
        root = module_root(parse_fn) if parse_fn else None
        compare = env if env_cfg.name in ENV_NAMES else None  # a built-in verifier
        return partial(model_scorer, cfg, served, compare, (root,) if root else ())
    paths = [f.fn for f in cfg.functions]
    plugin = None
    if not paths and env_cfg.name not in (*ENV_NAMES, "dataset"):
        plugin = (env_cfg.name, dict(env_cfg.args))
        paths = [env_cfg.name] if ":" in env_cfg.name else []
    roots = sorted({root for path in paths if (root := module_root(path)) is not None})
    return partial(
        make_scorer,
        env,
        [RewardFunction(f.fn, f.weight, f.args) for f in cfg.functions],
        cfg.workers,
        cfg.timeout_s,
        cfg.memory_mib,
        cfg.correct_at,
        roots,
        plugin,
    )


def model_scorer(
    cfg: RewardConfig,
    served: ServedModels | None,
    verifier: Environment | None,
    roots: tuple[str, ...],
) -> ModelScorer:
    """A scorer over the judge or reward model of ``cfg``: in ``served``'s actors, or in
    actors of its own (stopped with it) when none are given."""
    assert cfg.served is not None
    owned = served is None
    if served is None:
        served = launch_served(cfg.served, 0, child_env())
        served.wait_loaded()
    parse = None
    if cfg.judge is not None and cfg.judge.parse_fn is not None:
        parse = RewardPool(
            [RewardFunction(cfg.judge.parse_fn)],
            cfg.workers,
            cfg.timeout_s,
            cfg.memory_mib,
            cfg.correct_at,
            roots,
        )
    return ModelScorer(served, cfg.correct_at, verifier, parse, owned)


def model_context(model_dir: str) -> int | None:
    """The context length of a model folder (``max_position_embeddings`` in config.json,
    which vLLM takes as its ``max_model_len``); None when the config does not say."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


class PromptTokens:
    """How many tokens a prompt is to vLLM (``engines/rollout/vllm_engine.py: prompt_ids``): the
    model folder's tokenizer, no second BOS after a template's. Picklable (the tokenizer
    is loaded where it is first used)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._tokenizer: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "_tokenizer": None}

    def __call__(self, prompt: str) -> int:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        bos = self._tokenizer.bos_token
        add = not (bos and prompt.startswith(bos))
        return len(self._tokenizer(prompt, add_special_tokens=add)["input_ids"])


@dataclass
class LedgerSkips:
    """Records a passed-over prompt as a ``dropped`` sample with the reason (``FittingPrompts``
    calls it), through the trajectory store's ledger."""

    ledger: LedgerSink

    def skipped(self, problem: Problem, reason: str) -> None:
        sample = f"{problem.prompt_id}@too-long-{uuid.uuid4().hex[:8]}/0"
        self.ledger.record([LedgerEvent(sample, problem.prompt_id, "dropped", reason=reason)])


def fitting(
    cfg: RunConfig, prompts: PromptSource, heldout: list[Problem], ledger: LedgerSink
) -> tuple[PromptSource, list[Problem]]:
    """With a model folder, the prompts that leave ``rollout.max_new_tokens`` of its context
    for the response: longer training prompts are passed over (recorded in the ledger),
    longer held-out ones left out of the evaluation (with a warning)."""
    if cfg.policy.path is None:
        return prompts, heldout  # check_prompts made sure that every prompt fits
    context = model_context(cfg.policy.path)
    if context is None:
        return prompts, heldout
    limit = context - cfg.rollout.max_new_tokens
    why = (
        f"the model's context ({context}) less rollout.max_new_tokens "
        f"({cfg.rollout.max_new_tokens}) leaves {limit}"
    )
    length = PromptTokens(cfg.policy.path)
    fit = [p for p in heldout if length(p.prompt) <= limit]
    if len(fit) < len(heldout):
        log.warning(
            "%d of %d held-out prompts are too long (%s): left out",
            len(heldout) - len(fit),
            len(heldout),
            why,
        )
    if not fit:
        raise ConfigError(f"every held-out prompt is too long: {why}")
    return FittingPrompts(prompts, length, limit, LedgerSkips(ledger), why), fit
