"""bench/plots.py and bench/results/current.json: every figure the plots draw is a cell of its BENCHMARKS.md
table (checked without matplotlib), the check finds a figure or ratio that differs, every data set names a
commit of this repository, every plot is committed and shown on docs/benchmarks.md, and (where matplotlib is
installed, `.plots-venv`) the plots build from the JSON."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plots(bench_import: Any) -> Any:
    return bench_import("plots")


@pytest.fixture(scope="module")
def current(plots: Any) -> dict[str, Any]:
    return plots.load_current()


def test_every_figure_of_current_json_is_a_cell_of_its_benchmarks_table(plots: Any, current: dict[str, Any]) -> None:
    assert plots.check(current, (REPO / "BENCHMARKS.md").read_text()) == []


def test_a_figure_changed_in_the_json_alone_is_reported(plots: Any, current: dict[str, Any]) -> None:
    changed = copy.deepcopy(current)
    changed["datasets"]["memory_between_steps"]["rows"][0]["zero2 MiB"] = 99.9
    problems = plots.check(changed, (REPO / "BENCHMARKS.md").read_text())
    assert "'zero2 MiB' is 99.9 in current.json, '108.5' in BENCHMARKS.md" in problems[0]
    # and the three ratio columns that divide it no longer match what the table prints
    assert [problem.split("'")[1] for problem in problems[1:]] == [
        "zero2 / formula", "zero2 / DeepSpeed ZeRO-2", "zero2 / DDP"]


def test_a_ratio_that_is_not_the_quotient_of_its_figures_is_reported(plots: Any) -> None:
    markdown = ("# Page\n\n## Run (bench/x.py)\n\nRecorded in `abc1234`.\n\n```\n.venv/bin/python bench/x.py\n```\n\n"
                "| method | ms | vs ours |\n| --- | ---: | ---: |\n| ours | 2.0 | 1.0x |\n| theirs | 50.0 | 2.5x |\n\n"
                "## Next\n")
    dataset = {"section": "Run (bench/x.py)", "command": ".venv/bin/python bench/x.py", "commit": "abc1234",
               "key": ["method"],
               "ratios": [{"column": "vs ours", "of": ["ms", "ms"], "against": {"method": "ours"}}],
               "rows": [{"method": "ours", "ms": 2.0, "vs ours": 1.0}, {"method": "theirs", "ms": 50.0, "vs ours": 2.5}]}
    problems = plots.disagreements("x", dataset, markdown)
    assert len(problems) == 1 and "'vs ours' of row 1 prints 2.5 but ms / ms is 25" in problems[0]
    assert plots.disagreements("x", {**dataset, "section": "Missing"}, markdown) == [
        "x: BENCHMARKS.md has no heading 'Missing'"]


def test_every_data_set_names_a_commit_of_this_repository(current: dict[str, Any]) -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow or unreadable clone lacks the recorded commits")
    for name, dataset in current["datasets"].items():
        found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                                f"{dataset['commit']}^{{commit}}"], capture_output=True)
        assert found.returncode == 0, f"{name}: no commit {dataset['commit']}"


def test_every_plot_is_committed_and_shown_on_the_summary_page(plots: Any) -> None:
    page = (REPO / "docs" / "benchmarks.md").read_text()
    for name in plots.PLOTS:
        assert (plots.IMAGES / name).is_file(), f"docs/img/{name} is missing: .plots-venv/bin/python bench/plots.py"
        assert f"](img/{name})" in page, f"docs/benchmarks.md does not show img/{name}"


def test_the_plots_build_from_current_json_with_titles_and_labelled_axes(plots: Any, current: dict[str, Any]) -> None:
    pytest.importorskip("matplotlib")
    figures = plots.build_figures(current)
    assert set(figures) == set(plots.PLOTS)
    for name, figure in figures.items():
        for axes in figure.axes:
            assert axes.get_title(), f"{name}: an axes without a title"
            assert axes.get_xlabel() or axes.get_ylabel(), f"{name}: an axes without axis labels"
            assert axes.patches, f"{name}: an axes without bars"


def test_every_text_of_a_plot_is_legible_at_the_sites_page_width(plots: Any, current: dict[str, Any]) -> None:
    """The site shows a plot about 700 px wide: every text, tick labels included, is 10 px high or more there."""
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text

    for name, figure in plots.build_figures(current).items():
        px_per_point = 700 / (figure.get_figwidth() * 72)
        sizes = [text.get_fontsize() for text in figure.findobj(Text) if text.get_text().strip()]
        assert sizes and min(sizes) * px_per_point >= 10, f"{name}: a text {min(sizes) * px_per_point:.1f} px high"
