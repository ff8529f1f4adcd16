"""What ``sluice simulate`` does: build one scenario per policy, simulate, print a table.

``flows/cli.py`` parses the command line and calls ``simulate_policies``; policies are
written ``sync``, ``one_step`` or ``async`` followed by comma-separated options
(``async,k=2,dispatch,repack``), so a comparison fits on one command line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sluice.sim.engine import simulate
from sluice.sim.results import SimResult, format_table, staleness_line
from sluice.sim.scenario import SKEW_HANDLING_OFF, ScenarioError, load_scenario

DEFAULT_POLICIES = [
    "sync",
    "one_step",
    "async,k=1",
    "async,k=2",
    "async,k=4",
    "async,k=2,dispatch",
    "async,k=2,dispatch,repack",
]
POLICY_HELP = (
    "sync | one_step | async, then options: k=<max staleness>, dispatch (longest first + "
    "balance), repack (both off unless named), no-partial, first-token (max_staleness "
    "counts a sample's first token, not its last: stale_by=first_token), no-credit (dropped "
    "groups keep their admission slot)"
)


def parse_policy(text: str) -> dict[str, Any]:
    """``async,k=2,dispatch`` -> PolicySpec fields; ScenarioError names what is wrong.

    Dispatch and repack are on only when the policy names them, whatever the scenario says,
    so ``async,k=2`` is plain async and each option is one step up from it; Sluice's
    defaults (``sluice/config/tree.py``) are ``async,k=2,dispatch,repack``.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or parts[0] not in ("sync", "one_step", "async"):
        head = parts[0] if parts else text
        raise ScenarioError(f"unknown policy {head!r}; choose {POLICY_HELP}")
    fields: dict[str, Any] = {"mode": parts[0], **SKEW_HANDLING_OFF}
    for option in parts[1:]:
        if option.startswith("k="):
            value = option[2:]
            if not value.isdigit():
                raise ScenarioError(
                    f"policy {text!r}: k must be a whole number >= 0, got {value!r}"
                )
            fields["max_staleness"] = int(value)
        elif option == "dispatch":
            fields.update(long_first=True, balance=True)
        elif option == "repack":
            fields["repack"] = True
        elif option == "no-partial":
            fields["partial_rollout"] = False
        elif option == "first-token":
            fields["stale_by"] = "first_token"
        elif option == "no-credit":
            fields["credit_drops"] = False
        else:
            raise ScenarioError(f"policy {text!r}: unknown option {option!r}; {POLICY_HELP}")
    if parts[0] != "async" and {
        "max_staleness",
        "partial_rollout",
        "credit_drops",
        "stale_by",
    } & set(fields):
        raise ScenarioError(
            f"policy {text!r}: k, no-partial, first-token and no-credit apply to async only"
        )
    return fields


def simulate_policies(
    scenario_file: Path | None,
    overrides: list[str],
    policies: list[str],
    profile: str | None = None,
) -> tuple[list[SimResult], float]:
    """One result per policy on the same scenario and seed; and the seconds it all took."""
    base = load_scenario(scenario_file, overrides, profile=profile)
    started = time.perf_counter()
    results = [simulate(base.with_policy(**parse_policy(p))) for p in policies]
    return results, time.perf_counter() - started


def render(results: list[SimResult], seconds: float) -> str:
    lines = [format_table(results), "", "staleness of trained samples (versions: samples):"]
    lines += [f"  {r.label}: {staleness_line(r)}" for r in results]
    lines.append(f"simulated {len(results)} policies in {seconds:.1f} s")
    return "\n".join(lines)
