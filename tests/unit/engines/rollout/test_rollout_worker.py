"""A worker's finished groups become one trajectory block: rows, rewards, advantages, versions."""

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime
from types import SimpleNamespace

import pyarrow as pa

from sluice.config.tree import EnvConfig
from sluice.driver.batch import submit
from sluice.driver.environment import make_environment
from sluice.engines.protocols import Completion
from sluice.engines.rollout.dispatcher import GroupDispatcher
from sluice.engines.rollout.messages import (
    BatchShard,
    GroupDone,
    PartialGroup,
    PartialSample,
    StreamSettings,
)
from sluice.engines.rollout.scored import ScoredRows, block_of, score_groups
from sluice.engines.rollout.stream_loop import StreamLoop, _as_reported
from sluice.engines.rollout.worker import RolloutWorker
from sluice.envs.multi_turn import EpisodeLimits
from sluice.envs.prompts import PromptStream
from sluice.envs.rewards import RewardFunction
from sluice.envs.scoring import VerifierScorer, make_scorer
from sluice.rl.advantages import Credit
from sluice.storage.params import PullFailed
from sluice.storage.schema import validate_batch


def test_groups_become_contiguous_scored_rows_with_token_versions():
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    problems = env.problems("train", 2, seed=0)
    groups = [
        [
            Completion([5, 6], [-0.5, -0.25], problem.answer, True),
            Completion([7], [-1.0], "no sum here", False),
        ]
        for problem in problems
    ]
    # Group b's first sample saw a weight load after its first token.
    runs = [[[(0, 3)], [(0, 3)]], [[(0, 2), (1, 4)], [(0, 4)]]]
    rows, stats = score_groups(
        VerifierScorer(env),
        env.name,
        problems,
        [[1, 2], [1, 3, 4]],
        groups,
        runs,
        ["a@t", "b@t"],
        credit=Credit(scale_by_std=False),
    )
    block = block_of([rows])
    validate_batch(block)
    assert block.column("sample_id").to_pylist() == ["a@t/0", "a@t/1", "b@t/0", "b@t/1"]
    assert block.column("group_id").to_pylist() == ["a@t", "a@t", "b@t", "b@t"]
    assert block.column("prompt_ids").to_pylist() == [[1, 2], [1, 2], [1, 3, 4], [1, 3, 4]]
    assert block.column("reward").to_pylist() == [1.0, 0.0, 1.0, 0.0]
    # Dr. GRPO (no std scaling): reward minus the group's mean of 0.5
    assert block.column("advantage").to_pylist() == [0.5, -0.5, 0.5, -0.5]
    assert block.column("token_versions").to_pylist() == [[3, 3], [3], [2, 4], [4]]
    assert block.column("behaviour_logprobs").to_pylist()[0] == [-0.5, -0.25]
    assert (stats.samples, stats.groups, stats.tokens) == (4, 2, 6)
    assert stats.behaviour_version == 2  # the oldest version any response token has

    # A streaming worker scores each group as it finishes and builds one block per put:
    # the same rows as scoring them together.
    one_by_one = [
        score_groups(VerifierScorer(env), env.name, [problems[g]], [ids], [groups[g]],
                     [runs[g]], [group_id], credit=Credit(scale_by_std=False))[0]
        for g, (ids, group_id) in enumerate([([1, 2], "a@t"), ([1, 3, 4], "b@t")])
    ]  # fmt: skip
    merged = block_of(one_by_one)
    validate_batch(merged)
    timestamps = {"generated_at", "scored_at"}
    for name in set(block.schema.names) - timestamps:
        assert merged.column(name).to_pylist() == block.column(name).to_pylist(), name
    assert (stats.correct, stats.truncated, stats.reward_sum) == (2, 2, 2.0)
    assert stats.behaviour_version == 2  # the oldest version of any token


def test_overlong_shaping_moves_advantages_and_leaves_the_rewards_as_scored():
    """Two right answers of 2 and 4 tokens with max_new_tokens 4 and a buffer of 2: the
    longer loses the whole penalty (0.5). Shaped rewards 1 and 0.5, centred on their mean
    0.75 (Dr. GRPO): +0.25 and -0.25."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    [problem] = env.problems("train", 1, seed=0)
    group = [
        Completion([5, 6], [-0.5, -0.25], problem.answer, True),
        Completion([5, 6, 7, 8], [-0.5] * 4, problem.answer, False),
    ]
    credit = Credit(scale_by_std=False, overlong_buffer=2, overlong_penalty=0.5, max_new_tokens=4)
    rows, stats = score_groups(
        VerifierScorer(env), env.name, [problem], [[1, 2]], [group], [[[(0, 1)], [(0, 1)]]],
        ["a@t"], credit,
    )  # fmt: skip
    block = block_of([rows])
    assert block.column("reward").to_pylist() == [1.0, 1.0]
    assert block.column("advantage").to_pylist() == [0.25, -0.25]
    assert stats.reward_metrics == {"overlong_penalty": -0.5}

    # An episode's turns are not one generation: no penalty, whatever its length.
    rows, _ = score_groups(
        VerifierScorer(env), env.name, [problem], [[1, 2]], [group], [[[(0, 1)], [(0, 1)]]],
        ["a@t"], credit, loss_masks=[[[1, 1], [1, 0, 0, 1]]],
    )  # fmt: skip
    assert block_of([rows]).column("advantage").to_pylist() == [0.0, 0.0]


def test_a_users_weighted_reward_outside_0_1_is_stored_as_scored():
    """A weight of 2 and the built-in overlong penalty take the summed reward outside
    [0, 1] (docs/environments.md's own example): the rows keep it and pass the store's
    schema, which once refused them."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    [problem] = env.problems("train", 1, seed=0)
    group = [
        Completion([5, 6], [-0.5, -0.25], problem.answer, True),
        Completion([5, 6, 7, 8], [-0.5] * 4, "no sum here", False),
    ]
    penalty = {"max_tokens": 4, "buffer": 2}
    scorer = make_scorer(
        env,
        [
            RewardFunction("sluice.envs.verifiers:addition", 2.0),
            RewardFunction("sluice.envs.verifiers:overlong_penalty", 1.0, penalty),
        ],
    )
    try:
        rows, _ = score_groups(
            scorer, env.name, [problem], [[1, 2]], [group], [[[(0, 1)], [(0, 1)]]], ["a@t"],
            Credit(),
        )  # fmt: skip
    finally:
        scorer.close()
    block = block_of([rows])
    validate_batch(block)
    assert block.column("reward").to_pylist() == [2.0, -1.0]
    assert block.column("reason").to_pylist() == [None, None]


def test_a_handed_over_group_keeps_only_marks_within_its_reported_tokens():
    """Repack: a version mark taken from vLLM's count can lie past the tokens ``step``
    reported; the handoff cuts it back, and leaves the worker's own group untouched."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    [problem] = env.problems("train", 1, seed=0)
    running = PartialSample("g", 0, 20.0, token_ids=[5, 6, 7], marks=[(0, 1), (2, 2), (5, 3)])
    finished = Completion([5], [-1.0], "", True)
    done = PartialSample("g", 1, 20.0, token_ids=[5], marks=[(0, 1)], done=finished)
    group = PartialGroup(problem, [1, 2], [running, done], seed=0)
    moved = _as_reported(group)
    assert [s.marks for s in moved.samples] == [[(0, 1), (2, 2), (3, 3)], [(0, 1)]]
    assert moved.samples[1].done == finished
    assert running.marks == [(0, 1), (2, 2), (5, 3)]  # this worker's copy is not changed


class _Store:
    """Puts the test settles by hand, numbered like ``StoreClient``'s."""

    def __init__(self) -> None:
        self.puts = self.settled = self.written = 0
        self.answered = 0

    def put(self, batch) -> int:
        self.puts += 1
        return self.puts

    def settle_answered(self) -> None:
        self.settled = self.answered

    def write_settled(self) -> None:
        self.settle_answered()
        self.written = self.settled


def _worker(**fields):
    """What ``StreamLoop`` reads of its ``RolloutWorker``: a worker with no engine, environment,
    scorer or episodes unless given."""
    defaults = dict(
        engine=SimpleNamespace(version=lambda: 0), env=None, scorer=None, scoring=None,
        store=_Store(), params=None, stream_counters={}, episodes=None,
        limits=EpisodeLimits(), agents=None, served_digest="",
    )  # fmt: skip
    worker = SimpleNamespace(**{**defaults, **fields})
    worker.load = lambda weights: worker.engine.load_weights(weights, weights.version)
    return worker


class _Source:
    def __init__(self) -> None:
        self.reported: list[list[str]] = []
        self.report = SimpleNamespace(
            remote=lambda worker, groups, counters: self.reported.append(
                [g.group_id for g in groups]
            )
        )


def _rows(group_id: str) -> ScoredRows:
    columns = {
        "sample_ids": [f"{group_id}/0"], "prompt_ids": ["p"], "group_ids": [group_id],
        "prompts": [[1]], "responses": [[2]], "logprobs": [[-0.5]], "version_runs": [[(0, 0)]],
        "rewards": [1.0], "advantages": [0.0], "reasons": [None],
    }  # fmt: skip
    return ScoredRows("addition", columns, datetime.now(UTC))


def _done(group_id: str) -> GroupDone:
    return GroupDone(group_id, "p", 3, [2], 1.0, 1, 0, 0)


def test_a_group_is_reported_done_only_once_the_store_took_its_rows():
    """Reported sooner, a worker dying with its put on the way would take the group out of
    the dispatcher's hands unrecorded: nobody would drop it when the worker died."""
    store, source = _Store(), _Source()
    worker = _worker(store=store)
    stream = StreamLoop(worker, source, StreamSettings(0, 4, 8, 1.0, Credit(scale_by_std=False), 8))
    stream.unsent, stream.unsent_done = [_rows("g0")], [_done("g0")]
    stream.send()
    stream.unsent, stream.unsent_done = [_rows("g1")], [_done("g1")]
    stream.send()
    stream.report()
    store.answered = 1
    stream.report()
    store.answered = 2
    stream.report()
    assert source.reported == [[], ["g0"], ["g1"]]


class _Engine:
    """Holds a weight version, generates one fixed completion per sample."""

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self._version = 0

    def version(self) -> int:
        return self._version

    def load_weights(self, weights, version: int) -> None:
        self.loaded.append(version)
        self._version = version

    def prompt_ids(self, prompts):
        return [[1, 2] for _ in prompts]

    def generate(self, prompts, n, max_new_tokens, temperature, seed):
        return [[Completion([5], [-0.5], "", True) for _ in range(n)] for _ in prompts]


class _Relay:
    def pull(self, after: int, timeout: float):
        return SimpleNamespace(version=3, loaded="d" * 32) if after < 3 else None


class _Puts:
    def __init__(self) -> None:
        self.blocks: list[pa.RecordBatch] = []

    def put(self, block) -> int:
        self.blocks.append(block)
        return len(self.blocks)


def test_a_restarted_worker_loads_the_batchs_version_before_it_generates():
    """Ray restarted the worker after the flow's last weight sync: it starts from the
    policy folder (version 0), and a batch of version 3 must not be generated with that."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    puts, engine = _Puts(), _Engine()
    worker = RolloutWorker(lambda: engine, env, lambda: VerifierScorer(env), puts, _Relay())
    shard = BatchShard(2, 4, 1.0, 0, "t", Credit(scale_by_std=False), version=3, pull_timeout_s=5.0)
    worker.rollout(env.problems("train", 1, seed=0), shard)
    assert engine.loaded == [3] and worker.served_digest == "d" * 32
    assert puts.blocks[0].column("token_versions").to_pylist() == [[3], [3]]
    worker.rollout(env.problems("train", 1, seed=1), shard)
    assert engine.loaded == [3]  # nothing to load the second time


def test_a_prompt_twice_in_a_batch_gets_sample_ids_of_its_own_each_time():
    """A prompt stream's epoch can end inside a batch and the next begin with a prompt the
    batch already holds (seed 2 of the default run, at step 421): the store refuses a
    sample id twice, so each time the prompt comes is a group of its own."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    puts = _Puts()
    worker = RolloutWorker(lambda: _Engine(), env, lambda: VerifierScorer(env), puts, _Relay())
    a, b = env.problems("train", 2, seed=0)
    client = SimpleNamespace(rollout=worker.rollout)  # two workers, one process
    submit([client, client], [a, b, a, a], 2, 4, 1.0, seed=5, credit=Credit(scale_by_std=False))
    ids = [i for block in puts.blocks for i in block.column("sample_id").to_pylist()]
    groups = {i.rpartition("/")[0] for i in ids}
    assert len(ids) == len(set(ids)) == 8 and len(groups) == 4
    assert sorted(g.split("@")[0] for g in groups) == sorted([a.prompt_id] * 3 + [b.prompt_id])


def test_a_worker_samples_for_the_logprob_check_only_at_the_trainers_version():
    """A restarted worker still on the policy folder's weights would compare other weights
    with the trainer's: it answers nothing, and the check is skipped rather than failed."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    engine = _Engine()
    worker = RolloutWorker(lambda: engine, env, lambda: VerifierScorer(env), _Puts(), _Relay())
    assert worker.sampled(["1+1="], 4, 1.0, 0, version=3) == []
    engine.load_weights(None, 3)
    (sample,) = worker.sampled(["1+1="], 4, 1.0, 0, version=3)
    assert (sample.prompt_ids, sample.response_ids, sample.behaviour_logprobs) == (
        [1, 2],
        [5],
        [-0.5],
    )


class _HeldScorer:
    """An isolated scorer that holds the group of problem ``held`` until the test lets it go."""

    isolated = True

    def __init__(self, env, held: str) -> None:
        self.verifier, self.release, self.held = VerifierScorer(env), threading.Event(), held

    def score(self, problems, completions, lengths):
        if problems[0].prompt_id == self.held:
            assert self.release.wait(30)
        return self.verifier.score(problems, completions, lengths)


def test_an_isolated_scorer_scores_off_the_decoding_thread_and_a_slow_group_holds_back_no_other():
    """A user's reward that takes long holds back only its own group: ``finish`` returns at
    once (the loop goes on stepping the engine), and a group scored meanwhile on another
    thread reaches the unsent ones first."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    problems = env.problems("train", 2, seed=0)
    scorer = _HeldScorer(env, held=problems[0].prompt_id)
    with ThreadPoolExecutor(2) as scoring:
        worker = _worker(env=env, scorer=scorer, scoring=scoring)
        stream = StreamLoop(
            worker, _Source(), StreamSettings(0, 1, 8, 1.0, Credit(scale_by_std=False), 8)
        )
        for g, problem in enumerate(problems):
            done = Completion([5], [-1.0], problem.answer, True)
            sample = PartialSample(f"g{g}", 0, 1.0, token_ids=[5], marks=[(0, 0)], done=done)
            stream.groups[f"g{g}"] = PartialGroup(problem, [1], [sample], seed=0)
            stream.finish(f"g{g}", stream.groups[f"g{g}"])
        [(_, _, g1)] = [entry for entry in stream.being_scored if entry[0] == "g1"]
        wait([g1])
        stream.take_scored()
        assert [d.group_id for d in stream.unsent_done] == ["g1"]  # g0 is still scoring
        assert [entry[0] for entry in stream.being_scored] == ["g0"]
        scorer.release.set()
        wait([future for _, _, future in stream.being_scored])
        stream.take_scored()
    assert [d.group_id for d in stream.unsent_done] == ["g1", "g0"]
    assert [rows.columns["rewards"] for rows in stream.unsent] == [[1.0], [1.0]]


class _Counting:
    """An engine that holds one request and says how many tokens it has generated."""

    def __init__(self) -> None:
        self._version, self.loaded = 0, []

    def version(self) -> int:
        return self._version

    def start(self, request_id, prompt_ids, max_new_tokens, temperature, seed) -> None:
        self.request = request_id

    def generated(self, request_id):
        return 3 if request_id == self.request else None

    def load_weights(self, weights, version) -> None:
        self._version = version


def test_a_weight_load_marks_the_token_where_it_lands_in_a_continued_sample():
    """A later turn of an episode, or a repacked sample, continues from the tokens it has:
    vLLM counts the request's tokens from its start, the mark counts from the sample's."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    [problem] = env.problems("train", 1, seed=0)
    worker = _worker(engine=_Counting(), env=env, stream_counters={"weight_loads": 0.0})
    stream = StreamLoop(
        worker, _Source(), StreamSettings(0, 1, 32, 1.0, Credit(scale_by_std=False), 8)
    )
    sample = PartialSample("g", 0, 1.0, token_ids=list(range(10)), marks=[(0, 0)])
    stream.groups["g"] = PartialGroup(problem, [1], [sample], seed=0)
    stream.begin("g", stream.groups["g"], sample)
    stream.newer = SimpleNamespace(version=4)
    stream.load_newer()
    assert sample.marks == [(0, 0), (13, 4)]  # 10 it had, then 3 generated under version 0


class _Lost(_Counting):
    """An engine whose pull of a version fails before any of it is read (a lost bucket)."""

    def load_weights(self, weights, version) -> None:
        raise PullFailed(f"bucket 0 of version {version} from relay 0 failed: its buckets are lost")


def test_a_version_lost_before_any_of_it_is_read_is_skipped_and_asked_again(caplog):
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    [problem] = env.problems("train", 1, seed=0)
    counters = {"weight_loads": 0.0, "weight_pull_failures": 0.0}
    worker = _worker(engine=_Lost(), env=env, stream_counters=counters)
    stream = StreamLoop(
        worker, _Source(), StreamSettings(0, 1, 32, 1.0, Credit(scale_by_std=False), 8)
    )
    sample = PartialSample("g", 0, 1.0, token_ids=list(range(10)), marks=[(0, 0)])
    stream.groups["g"] = PartialGroup(problem, [1], [sample], seed=0)
    stream.begin("g", stream.groups["g"], sample)
    stream.newer = SimpleNamespace(version=4)
    with caplog.at_level("WARNING"):
        stream.load_newer()  # the worker goes on: no exception
    assert stream.newer is None  # the next weight check asks for the newest again
    assert sample.marks == [(0, 0)]  # its tokens stay on the version it had
    assert (stream.counters["weight_loads"], stream.counters["weight_pull_failures"]) == (0, 1)
    assert "rollout worker 0 skips version 4: bucket 0 of version 4" in caplog.text


class _Starts:
    """An engine that only takes requests (the test never steps it)."""

    def __init__(self) -> None:
        self._version = 0

    def version(self) -> int:
        return self._version

    def prompt_ids(self, prompts):
        return [[1, 2] for _ in prompts]

    def start(self, request_id, prompt_ids, max_new_tokens, temperature, seed) -> None:
        """Taken; the test counts the stream's running samples, not the engine's."""


class _Dispatching:
    """The real dispatcher's logic behind a handle whose calls answer Ray refs."""

    def __init__(self, ray, dispatcher) -> None:
        self.takes = 0

        def take(*args):
            self.takes += 1
            return ray.put(dispatcher.take(*args))

        self.take = SimpleNamespace(remote=take)
        self.report = SimpleNamespace(remote=lambda *args: ray.put(dispatcher.report(*args)))


def test_a_held_worker_asks_again_only_at_the_version_it_waits_for_or_when_told(ray_local):
    """Admission holds the worker back: it sends no take (an idle poll) until it holds the
    version the dispatcher named, or its report's answer says the window opened."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    ledger = SimpleNamespace(record=lambda events, wait=True: None, journal=lambda state: None)
    dispatcher = GroupDispatcher(ledger, PromptStream(env, 8, seed=0), env.name, 2, 1, 0, 0)
    source, engine = _Dispatching(ray_local, dispatcher), _Starts()
    worker = _worker(engine=engine, env=env)
    stream = StreamLoop(worker, source, StreamSettings(0, 1, 8, 1.0, Credit(scale_by_std=False), 8))
    stream.refill()
    assert len(stream.running) == 2 and source.takes == 1  # the whole window at version 0
    stream.running.clear()  # they finished: room again
    stream.refill()
    assert source.takes == 2 and stream.held_until == 1
    for _ in range(3):
        stream.refill()
    assert source.takes == 2  # held: no polls
    dispatcher.credit(1)  # the store dropped a group: one place opens at version 0
    stream.report()
    ray_local.wait([stream.reported])
    stream.refill()
    assert source.takes == 3 and len(stream.running) == 1
    stream.running.clear()
    stream.refill()
    assert source.takes == 4 and stream.held_until == 1
    engine._version = 1  # newer weights loaded
    stream.refill()
    assert source.takes == 5 and len(stream.running) == 2


def test_a_checkpoint_gets_every_group_whose_rows_are_not_stored_without_waiting():
    """Asked by a report's answer, the worker sends every group as it stands (being scored,
    or finished with its put not taken yet, included) with marks cut to its reported
    tokens, and has the rows the store took written: what a resume from the checkpoint
    continues. It waits for no put: the store may be full while the trainer checkpoints."""
    env, _ = make_environment(EnvConfig(scratch=False, train_prompts=8))
    [problem] = env.problems("train", 1, seed=0)
    store, source = _Store(), _Source()
    kept: list = []
    source.keep = SimpleNamespace(remote=lambda worker, n, groups: kept.append((worker, n, groups)))
    stream = StreamLoop(
        _worker(store=store), source, StreamSettings(3, 2, 8, 1.0, Credit(scale_by_std=False), 8)
    )
    running = PartialSample("g", 0, 9.0, token_ids=[5, 6], marks=[(0, 1), (4, 2)])
    stream.groups["g"] = PartialGroup(problem, [1], [running], seed=0)
    scoring = PartialGroup(problem, [1], [PartialSample("h", 0, 9.0, token_ids=[7])], seed=1)
    stream.being_scored.append(("h", scoring, None))
    for name in ("f", "e"):  # finished; "f" put and taken by the store, "e" put, not yet
        stream.unstored[name] = PartialGroup(problem, [1], [PartialSample(name, 0, 1.0)], 2)
        stream.unsent, stream.unsent_done = [_rows(name)], [_done(name)]
        stream.send()
    store.answered = 1
    stream.keep_asked = 2
    stream.keep()
    assert store.puts == 2 and store.written == 1  # nothing new put; "f"'s rows written
    [(worker, n, groups)] = kept
    assert (worker, n, stream.kept) == (3, 2, 2)
    assert [h.group_id for h in groups] == ["g", "h", "e"]
    assert groups[0].group.samples[0].marks == [(0, 1), (2, 2)]
