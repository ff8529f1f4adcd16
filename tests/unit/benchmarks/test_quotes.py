"""Numbers quoted outside their tables (benchmarks/quotes.py): each is what its source's
records say, and the files that are converted quote every measured number."""

from __future__ import annotations

import json

import pytest

from benchmarks import learning, quotes
from benchmarks.regenerate import NOT_YET_RECORDED
from benchmarks.report import ROOT


def _quotes() -> list[tuple[str, str, str, str]]:
    found = []
    for path in quotes.files():
        for source, name, value in quotes.QUOTE.findall(path.read_text()):
            found.append((str(path.relative_to(ROOT)), source, name, value))
    return found


def test_every_quoted_number_is_what_its_source_says():
    found = _quotes()
    assert found, "no quotes found: the pattern or the files moved"
    read = {source: quotes.values(source) for source in {q[1] for q in found}}
    for where, source, name, value in found:
        said = read[source]
        if said is None:  # a section still waiting for its first record waits with its quotes
            assert source in NOT_YET_RECORDED, f"{where}: {source} has no records"
            continue
        assert name in said, f"{where}: {source} quotes no {name!r} (it has {sorted(said)})"
        assert value == said[name], (
            f"{where}: {source}:{name} reads {value!r}, its records say {said[name]!r}: run "
            ".venv/bin/python -m benchmarks.regenerate"
        )


@pytest.mark.parametrize("name", quotes.quoted_files())
def test_a_converted_file_quotes_every_measured_number(name):
    assert quotes.unquoted(quotes.converted(name)) == []


def test_the_converted_files_are_every_page_but_those_named_as_not_yet():
    names = quotes.quoted_files()
    assert {"README.md", "BENCHMARKS.md", "docs/algorithms.md"} <= set(names)
    assert not set(names) & {*quotes.UNCONVERTED, *quotes.GENERATED_FILES}
    listed = {str(p.relative_to(ROOT)) for p in quotes.files()}
    assert {*quotes.UNCONVERTED, *quotes.GENERATED_FILES} <= listed  # none left over
    headings = quotes._HEADING.findall((ROOT / "BENCHMARKS.md").read_text())
    assert set(quotes.UNCONVERTED_SECTIONS) <= set(headings)


def test_benchmarks_md_is_checked_but_for_its_sections_not_yet_converted():
    text = quotes.converted("BENCHMARKS.md")
    assert "## Simulator: out of sample" in text
    assert "## The trainer on one GPU" not in text  # waits for its first record
    heading = "## Simulator: out of sample\n"
    assert quotes.unquoted(text.replace(heading, heading + "1.5x faster\n")) == ["1.5x"]


def test_unquoted_numbers_are_found_outside_quotes_code_and_generated_sections():
    text = (
        "It ran 1.42x faster at 190.6 samples/s, +5.5 points, 61.9% held out, 37 ms a pull.\n"
        "<!-- q:x:y -->2.00x<!-- /q --> is quoted.\n"
        "```\nheld-out accuracy 33.6% -> 68.8%\n```\n"
        "A log line: `took 9.80 s, 12x the run's median`; `eval.collapse_drop` (`0.1`).\n"
        "<!-- modes:begin -->\n| a | 1.72x |\n<!-- modes:end -->\n"
        "Seed 2 of 3, 16 prompts, 1,600 steps, version 12, a 95% bootstrap interval.\n"
    )
    assert quotes.unquoted(text) == ["1.42x", "190.6 samples/s", "+5.5 points", "61.9%", "37 ms"]


def test_rewriting_writes_each_quote_from_its_source(monkeypatch):
    monkeypatch.setattr(quotes, "values", lambda source: {"a": "2.50x"} if source == "s" else None)
    rest = " y <!-- q:t:a -->9%<!-- /q --> z <!-- q:s:b -->3<!-- /q -->"
    # t has no records: left as written; s has no b: left for the test above to report
    assert quotes.rewrite("x <!-- q:s:a -->1.00x<!-- /q -->" + rest) == (
        "x <!-- q:s:a -->2.50x<!-- /q -->" + rest
    )


def test_learning_runs_are_quoted_per_variant_and_per_seed(tmp_path, monkeypatch):
    folder = tmp_path / "results" / "learning"
    folder.mkdir(parents=True)
    for seed, (start, end) in enumerate([(0.332, 0.672), (0.164, 0.402), (0.203, 0.516)]):
        record = {"variant": "one_step", "seed": seed, "steps": 400, "commit": f"c{seed}",
                  "heldout": {"0": start, "400": end}, "samples_per_s": 125.7,
                  "wall_s": 1825.1, "rl_seconds": {"400": 1666.0}}  # fmt: skip
        (folder / f"one-step-s{seed}-400steps.json").write_text(json.dumps(record))
    monkeypatch.setattr(learning, "RECORDS", folder)
    said = learning.quotes("learning", 400)
    assert said["one-step.gain"] == "+31.3 (+23.8 to +34.0)"
    assert said["one-step.start"] == "20.3% (16.4-33.2)"
    assert said["one-step.s1.end"] == "40.2%" and said["one-step.s0.commit"] == "c0"
    assert said["one-step.s0.wall-s"] == "1,825" and said["one-step.s0.minutes"] == "28"
    assert said["commits"] == "c0, c1, c2"
    assert learning.quotes("learning", 1600) is None
