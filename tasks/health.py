"""Whether a run is still learning: a collapse seen in the step line, in MLflow and in the summary.

The flow's step (``flows/rl_job.py``) hands every step's metrics to one ``LearningHealth``
held by the session. It keeps the best held-out accuracy and its step (the session saves
that version's policy beside the final one), and says when the run has collapsed:

- held-out accuracy ``eval.collapse_drop`` or more below its best so far (a run that
  learned and then unlearned: the summary then points at the best policy, not the last);
- the policy's entropy under ``eval.entropy_floor`` of its entropy over the first steps
  (the policy stopped exploring: GRPO's advantages vanish once every sample of a group
  is the same).

Both are reported once when they start and carried on every step line while they last.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps whose mean entropy is the reference for the entropy floor: one step's entropy is
# noisy (a batch of 16 prompts), the first few together describe the starting policy.
ENTROPY_REFERENCE_STEPS = 5


@dataclass
class LearningHealth:
    """The run's best held-out accuracy and whether it has collapsed (see the module)."""

    collapse_drop: float
    entropy_floor: float
    best_accuracy: float | None = None
    best_step: int = 0
    reference_entropy: float | None = None
    last_entropy: float | None = None
    _entropies: tuple[float, ...] = ()
    accuracy_collapsed: bool = False
    entropy_collapsed: bool = False

    def held_out(self, step: int, accuracy: float) -> bool:
        """Record an evaluation; True when it is a new best (or the first)."""
        if self.best_accuracy is None or accuracy > self.best_accuracy:
            self.best_accuracy, self.best_step = accuracy, step
            self.accuracy_collapsed = False
            return True
        self.accuracy_collapsed = self.best_accuracy - accuracy >= self.collapse_drop
        return False

    def entropy(self, value: float) -> None:
        """Record a training step's entropy of the sampled tokens."""
        self.last_entropy = value
        if self.reference_entropy is None:
            self._entropies += (value,)
            if len(self._entropies) == ENTROPY_REFERENCE_STEPS:
                self.reference_entropy = sum(self._entropies) / len(self._entropies)
            return
        self.entropy_collapsed = value < self.entropy_floor * self.reference_entropy

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
                f"entropy {self.last_entropy:.3f} fell under {100 * self.entropy_floor:.0f}% "
                f"of its start ({self.reference_entropy:.3f})"
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
            "best_accuracy": self.best_accuracy,
            "best_step": self.best_step,
            "reference_entropy": self.reference_entropy,
        }

    def restore(self, state: dict[str, float | int | None]) -> None:
        best, step, reference = (
            state.get("best_accuracy"),
            state.get("best_step"),
            state.get("reference_entropy"),
        )
        self.best_accuracy = None if best is None else float(best)
        self.best_step = int(step or 0)
        self.reference_entropy = None if reference is None else float(reference)
