"""What a run needs beyond a valid config tree, checked before Prefect or Ray start
(``flows/api.py: check_run``): folders it can make, and prompts the environment supplies
and that fit the context."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.config.tree import ConfigError, load_config
from sluice.flows.api import check_run

SMOKE = Path(__file__).parents[3] / "configs" / "smoke.yaml"


def test_a_run_that_fits_passes_and_makes_its_folders(tmp_path: Path) -> None:
    cfg = load_config(SMOKE, [f"root={tmp_path}/runs", f"cache={tmp_path}/c"])
    check_run(cfg)
    assert cfg.run_dir.is_dir() and cfg.cache_dir.is_dir()


def test_an_output_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    cfg = load_config(None, [f"root={blocker}/runs"])
    with pytest.raises(ConfigError, match=r"root: cannot create .*set root= to a folder"):
        check_run(cfg)


def test_the_longest_prompt_plus_the_response_must_fit_the_context(tmp_path: Path) -> None:
    # 3-digit addition prompts are 8 characters plus BOS; 250 new tokens leave too little.
    cfg = load_config(
        None,
        [f"root={tmp_path}", "env.digits=3", "rollout.max_new_tokens=250", "env.scratch=false"],
    )
    with pytest.raises(ConfigError, match=r"longest prompt \(\d+ tokens.*more than policy"):
        check_run(cfg)


def test_a_held_out_set_larger_than_the_environment_holds_names_eval_prompts(
    tmp_path: Path,
) -> None:
    # One-digit addition has 100 problems, a few of them held out.
    cfg = load_config(None, [f"root={tmp_path}", "env.digits=1", "eval.prompts=100"])
    with pytest.raises(ConfigError, match=r"^eval\.prompts=100: .*problem space too small"):
        check_run(cfg)
