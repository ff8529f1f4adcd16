"""Samples in a streaming engine, one request each, and multi-turn episodes turn by turn.

``SampleRunner`` is what a rollout worker's loops share: it starts samples in the engine
(``begin``), takes what each engine step added (``advance``), and, for a multi-turn
environment, ends a model turn by handing the episode to the environment
(``engines/rollout/episodes.py``) and goes on with it when the environment has answered
(``take_stepped``): the observation is tokenized once and appended after the sampled tokens,
with loss mask 0, log-prob 0 and the version of the weights it follows; then the model's
next turn starts from the whole sequence as it stands, never re-tokenized. A group whose
samples are all done goes to ``finish``. With an agent (``engines/agents/episodes.py``),
a sample is the agent's episode: its calls decode here, and its session is the sample.
Driven by ``stream_loop.StreamLoop`` (``async``) and by ``Play`` here (the multi-turn
batches of ``sync``/``one_step``, held-out evaluation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, wait

from sluice.engines.agents.chat_template import TemplateError, TurnFormat
from sluice.engines.agents.episodes import AgentEpisodes
from sluice.engines.protocols import Completion, Delta, StreamingRolloutEngine
from sluice.engines.rollout.episodes import EpisodeSteps, StepFailed, Stepped
from sluice.engines.rollout.messages import PartialGroup, PartialSample
from sluice.envs import RewardResult
from sluice.envs.multi_turn import EpisodeLimits, episode_result


class SampleRunner(ABC):
    """Running samples and episodes of one worker; ``finish`` takes each done group."""

    def __init__(
        self,
        engine: StreamingRolloutEngine,
        episodes: EpisodeSteps | None,
        limits: EpisodeLimits,
        max_new_tokens: int,
        temperature: float,
        counters: dict[str, float],
        agents: AgentEpisodes | None = None,
    ) -> None:
        self.engine, self.episodes, self.limits = engine, episodes, limits
        self.agents = agents
        self._turns: TurnFormat | None = None
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.counters = counters
        self.running: dict[str, PartialSample] = {}  # by request id
        self.groups: dict[str, PartialGroup] = {}  # not finished yet
        # Episodes waiting for their environment's step: (its answer, group id, sample).
        self.stepping: list[tuple[Future[Stepped], str, PartialSample]] = []

    @abstractmethod
    def finish(self, group_id: str, group: PartialGroup) -> None:
        """Every sample of ``group`` is done."""

    def turn_format(self) -> TurnFormat:
        """The model's chat template, for observations that are chat messages."""
        if self._turns is None:
            self._turns = TurnFormat(getattr(self.engine, "tokenizer", None))
        return self._turns

    def count(self, name: str, value: float) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value

    def begin(self, group_id: str, group: PartialGroup, sample: PartialSample) -> None:
        """Start ``sample`` in the engine, or continue it from the tokens it has (a repacked
        sample, an episode's next turn); or start its agent."""
        if self.agents is not None:
            self.agents.start(group_id, sample, group.problem)
            return
        request, done = f"{group_id}/{sample.index}", len(sample.token_ids)
        budget = self.max_new_tokens - done
        if self.episodes is not None:
            budget = min(budget, self.limits.max_turn_tokens or budget)
            if sample.turns:  # a later turn: a request of its own
                request += f"#{len(sample.turns)}"
        version = self.engine.version()
        if not sample.marks or sample.marks[-1][1] != version:
            sample.marks.append((done, version))
        sample.offset = done
        self.running[request] = sample
        self.engine.start(
            request,
            group.prompt_ids + sample.token_ids,
            budget,
            self.temperature,
            group.seed * 131 + sample.index + done,
        )

    def go_on(self, group_id: str, group: PartialGroup, sample: PartialSample) -> None:
        """Continue an unfinished ``sample`` from where it stood on another worker (repack)
        or before a resume: an episode whose model turn had ended asks its environment
        again (a step is a function of the problem and the turns so far); any other sample
        goes on decoding from its tokens."""
        if self.episodes is not None and len(sample.turns) % 2 == 1:
            answer = self.episodes.submit(group.problem, list(sample.turns))
            self.stepping.append((answer, group_id, sample))
        else:
            self.begin(group_id, group, sample)

    def advance(self, delta: Delta) -> None:
        if self.agents is not None and self.agents.advance(delta):
            return
        sample = self.running.get(delta.request_id)
        if sample is None:
            return  # handed to another worker by repack (vLLM may report it once more)
        sample.token_ids.extend(delta.token_ids)
        sample.logprobs.extend(delta.logprobs)
        if sample.mask is not None:  # an episode's later turn: sampled, so learned from
            sample.mask.extend([1] * len(delta.token_ids))
        if not delta.finished:
            return
        del self.running[delta.request_id]
        if self.episodes is not None:
            self.end_turn(sample)
        else:
            self.sample_done(sample, delta.finish_reason == "stop")

    def sample_done(self, sample: PartialSample, finished: bool) -> None:
        sample.done = Completion(
            sample.token_ids, sample.logprobs, self.engine.decode(sample.token_ids), finished
        )
        group = self.groups[sample.group]
        if all(s.done is not None for s in group.samples):
            del self.groups[sample.group]
            self.finish(sample.group, group)

    def abandon(self) -> None:
        """Stop what this runner started in the engine and its agents (its loop raised), so
        that what the worker's next loop finds is its own."""
        self.engine.abort(list(self.running))
        self.running.clear()
        if self.agents is not None:
            self.agents.abandon()

    def decoding(self) -> bool:
        """Requests are running in the engine."""
        return bool(self.running) or (self.agents is not None and self.agents.busy())

    def waiting(self) -> bool:
        """Episodes wait for their environment or their agent."""
        return bool(self.stepping) or (self.agents is not None and bool(self.agents.runs))

    def wait(self, timeout: float) -> None:
        """Until an environment answers, an agent calls or returns, or ``timeout``."""
        if self.agents is not None:
            self.agents.wake.wait(timeout)
        else:
            self.wait_for_steps(timeout)

    def poll(self) -> None:
        """Go on with what environments and agents have done meanwhile."""
        self.take_stepped()
        if self.agents is not None:
            for _, sample in self.agents.poll(self.max_new_tokens, self.temperature):
                self.sample_done(sample, True)

    # -- multi-turn episodes ---------------------------------------------------------------

    def end_turn(self, sample: PartialSample) -> None:
        """The model's turn is over: its environment answers off this thread."""
        assert self.episodes is not None
        sample.turns.append(self.engine.decode(sample.token_ids[sample.turn_start :]))
        problem = self.groups[sample.group].problem
        answer = self.episodes.submit(problem, list(sample.turns))
        self.stepping.append((answer, sample.group, sample))

    def take_stepped(self) -> None:
        """Go on with each episode whose environment has answered."""
        answered, waiting = [], []
        for entry in self.stepping:  # one look at each: an answer may arrive meanwhile
            (answered if entry[0].done() else waiting).append(entry)
        self.stepping = waiting
        for answer, group_id, sample in answered:
            stepped = answer.result()
            self.count("env_steps", 1)
            self.count("env_s", stepped.seconds)
            self.next_turn(group_id, sample, stepped)

    def wait_for_steps(self, timeout: float) -> None:
        wait([a for a, _, _ in self.stepping], timeout=timeout, return_when=FIRST_COMPLETED)

    def next_turn(self, group_id: str, sample: PartialSample, stepped: Stepped) -> None:
        """Append the environment's observation and start the model's next turn, or end the
        episode: done, failed, or out of turns or tokens (not solved)."""
        step = stepped.outcome
        if isinstance(step, StepFailed):
            sample.result = RewardResult(0.0, False, error=step.reason)
            self.sample_done(sample, False)
            return
        self.count("tool_calls", step.tool_calls)
        for kind, n in step.tool_errors.items():
            self.count(f"tool_errors/{kind}", n)
        if step.done:
            sample.result = episode_result(step)
            self.sample_done(sample, True)
            return
        text = step.observation
        if step.role is not None:  # a chat message: the template's turn around it
            try:
                message = {"role": step.role, "content": step.observation}
                text = self.turn_format().after_turn(
                    sample.token_ids[sample.turn_start :], [message]
                )
            except TemplateError as error:
                sample.result = RewardResult(0.0, False, error=f"observation: {error}")
                self.sample_done(sample, False)
                return
        tokens = self.engine.encode(text)
        model_turns = (len(sample.turns) + 1) // 2
        room = self.max_new_tokens - len(sample.token_ids) - len(tokens)
        if model_turns >= self.limits.max_turns or room <= 0:
            sample.result = RewardResult(0.0, False)
            self.count("episodes_cut", 1)
            self.sample_done(sample, False)
            return
        self.count("env_tokens", len(tokens))
        if sample.mask is None:
            sample.mask = [1] * len(sample.token_ids)
        sample.token_ids.extend(tokens)
        sample.logprobs.extend([0.0] * len(tokens))
        sample.mask.extend([0] * len(tokens))
        sample.turns.append(step.observation)
        sample.turn_start = len(sample.token_ids)
        self.begin(group_id, self.groups[group_id], sample)


class Play(SampleRunner):
    """Runs groups to their end on the caller's thread: the multi-turn batches of ``sync``
    and ``one_step``, and held-out evaluation of a multi-turn environment."""

    def finish(self, group_id: str, group: PartialGroup) -> None:
        self.finished[group_id] = group

    def run(self, groups: dict[str, PartialGroup]) -> dict[str, PartialGroup]:
        """Every group's samples done, in the order given."""
        try:
            return self._run(groups)
        except BaseException:
            self.abandon()
            raise

    def _run(self, groups: dict[str, PartialGroup]) -> dict[str, PartialGroup]:
        self.finished: dict[str, PartialGroup] = {}
        for group_id, group in groups.items():
            self.groups[group_id] = group
            for sample in group.samples:
                self.go_on(group_id, group, sample)
        while self.groups:
            if self.decoding():
                for delta in self.engine.step():
                    self.advance(delta)
            elif self.waiting():
                self.wait(1.0)
            else:
                raise RuntimeError(f"groups {sorted(self.groups)} neither decode nor wait")
            self.poll()
        return {group_id: self.finished[group_id] for group_id in groups}
