"""Whether a run is still learning: a collapse seen in the step line, in MLflow and in the summary.

The flow's step (``flows/rl_job.py``) hands every step's metrics to one ``LearningHealth``
held by the session. It keeps the best held-out accuracy and its step (the session saves
that version's policy beside the final one), and says when the run has collapsed:

- held-out accuracy ``eval.collapse_drop`` or more below its best so far, or half of that
  when it is also half of what the run had gained over its start (a run that learned and
  then unlearned: the summary then points at the best policy, not the last; the second
  rule sees it on a task whose accuracies are all low, 12.5% falling to 4.7%);
- the policy's entropy, averaged over its last ``ENTROPY_WINDOW`` steps, under
  ``eval.entropy_floor`` of its entropy over the first steps while held-out accuracy has
  set no new best for ``eval.collapse_patience`` evaluations (the policy stopped exploring
  and stopped improving: GRPO's advantages vanish once every sample of a group is the
  same). Entropy alone is not a collapse: the default run's falls under 10% of its start
  by step 400 while its held-out accuracy climbs for another 1,000 steps.

Both are reported once when they start and carried on every step line while they last.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps whose mean entropy is the reference for the entropy floor: one step's entropy is
# noisy (a batch of 16 prompts), the first few together describe the starting policy.
ENTROPY_REFERENCE_STEPS = 5
# Steps whose mean entropy is compared with the floor (one step's swings by 2x).
ENTROPY_WINDOW = 20


@dataclass
class LearningHealth:
    """The run's best held-out accuracy and whether it has collapsed (see the module)."""

    collapse_drop: float
    entropy_floor: float
    patience: int = 5
    start_accuracy: float | None = None
    best_accuracy: float | None = None
    best_step: int = 0
    evals_since_best: int = 0
    reference_entropy: float | None = None
    recent_entropy: float | None = None  # the mean of the last ENTROPY_WINDOW steps
    _entropies: tuple[float, ...] = ()
    accuracy_collapsed: bool = False
    entropy_collapsed: bool = False

    def held_out(self, step: int, accuracy: float) -> bool:
        """Record an evaluation; True when it is a new best (or the first)."""
        if self.start_accuracy is None:
            self.start_accuracy = accuracy
        if self.best_accuracy is None or accuracy > self.best_accuracy:
            self.best_accuracy, self.best_step = accuracy, step
            self.accuracy_collapsed, self.evals_since_best = False, 0
            self._check_entropy()
            return True
        self.evals_since_best += 1
        drop, gained = self.best_accuracy - accuracy, self.best_accuracy - self.start_accuracy
        self.accuracy_collapsed = drop >= self.collapse_drop or (
            drop >= self.collapse_drop / 2 and drop >= gained / 2
        )
        self._check_entropy()
        return False

    def entropy(self, value: float) -> None:
        """Record a training step's entropy of the sampled tokens."""
        if self.reference_entropy is None:
            self._entropies += (value,)
            if len(self._entropies) == ENTROPY_REFERENCE_STEPS:
                self.reference_entropy = sum(self._entropies) / len(self._entropies)
                self._entropies = ()
            return
        self._entropies = (*self._entropies, value)[-ENTROPY_WINDOW:]
        if len(self._entropies) == ENTROPY_WINDOW:
            self.recent_entropy = sum(self._entropies) / ENTROPY_WINDOW
        self._check_entropy()

    def _check_entropy(self) -> None:
        low = (
            self.recent_entropy is not None
            and self.reference_entropy is not None
            and self.recent_entropy < self.entropy_floor * self.reference_entropy
        )
        self.entropy_collapsed = low and self.evals_since_best >= self.patience

    @property
    def collapsed(self) -> bool:
        return self.accuracy_collapsed or self.entropy_collapsed

    def warnings(self, accuracy: float | None) -> list[str]:
        """What is wrong now, one phrase each (empty when the run is healthy); ``accuracy``
        is the latest held-out accuracy."""
        out = []
        if self.accuracy_collapsed and accuracy is not None and self.best_accuracy is not None:
            out.append(
                f"held-out {100 * accuracy:.1f}% is {100 * (self.best_accuracy - accuracy):.1f} "
                f"points below its best ({100 * self.best_accuracy:.1f}% at step "
                f"{self.best_step})"
            )
        if self.entropy_collapsed and self.reference_entropy is not None:
            out.append(
                f"entropy {self.recent_entropy:.3f} is under {100 * self.entropy_floor:.0f}% "
                f"of its start ({self.reference_entropy:.3f}) and held-out accuracy has not "
                f"improved for {self.evals_since_best} evaluations"
            )
        return out

    def metrics(self) -> dict[str, float]:
        """For MLflow: the best accuracy so far and whether each collapse holds (0 or 1)."""
        out = {
            "health/accuracy_collapsed": float(self.accuracy_collapsed),
            "health/entropy_collapsed": float(self.entropy_collapsed),
        }
        if self.best_accuracy is not None:
            out["eval/best_accuracy"] = self.best_accuracy
        return out

    def state(self) -> dict[str, float | int | None]:
        """What a checkpoint keeps, so a resumed run knows its best and its reference."""
        return {
            "start_accuracy": self.start_accuracy,
            "best_accuracy": self.best_accuracy,
            "best_step": self.best_step,
            "evals_since_best": self.evals_since_best,
            "reference_entropy": self.reference_entropy,
        }

    def restore(self, state: dict[str, float | int | None]) -> None:
        def number(key: str) -> float | None:
            value = state.get(key)
            return None if value is None else float(value)

        self.start_accuracy = number("start_accuracy")
        self.best_accuracy = number("best_accuracy")
        self.best_step = int(state.get("best_step") or 0)
        self.evals_since_best = int(state.get("evals_since_best") or 0)
        self.reference_entropy = number("reference_entropy")
