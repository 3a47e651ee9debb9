"""The plots of the headline comparisons, drawn from ``bench/results/current.json`` into ``docs/img/``.

matplotlib is not a dependency of the project; it goes into a venv of its own (git-ignored)::

    python3 -m venv .plots-venv && .plots-venv/bin/pip install matplotlib==3.11.2
    .plots-venv/bin/python bench/plots.py            # checks the figures, then writes docs/img/*.png
    .plots-venv/bin/python bench/plots.py --check    # only the check (needs no matplotlib)

Every number drawn is a figure of ``current.json``, and every figure there is a cell of a table of
``BENCHMARKS.md`` (``disagreements``; ``tests/bench/test_bench_plots.py`` runs it without matplotlib). The ratios
written on the plots are the JSON's ratio columns, checked against the figures they divide, not recomputed
here. A new run changes BENCHMARKS.md's table and ``current.json`` together; then redraw.

The plots:

- ``checkpoint_blocked.png``: how long a save blocks training, ours against DeepSpeed ZeRO-2's
  ``save_checkpoint`` (64 MiB) and against torch DCP's ``async_save`` and Lightning's ``AsyncCheckpointIO``
  (568 MB);
- ``memory_between_steps.png``: what a zero2 rank holds between steps against the ZeRO formula, DeepSpeed
  ZeRO-2 and DDP;
- ``recovery.png``: a lost node's recovery from the fast tier resharded against the durable tier on S3.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is imported where a plot is drawn: the check runs without it
    from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]
CURRENT = REPO / "bench" / "results" / "current.json"
BENCHMARKS = REPO / "BENCHMARKS.md"
IMAGES = REPO / "docs" / "img"

OURS = "#1f6fb4"
OURS_LIGHT = "#9cc3e6"
OTHER = "#9a9a9a"
OTHER_LIGHT = "#d4d4d4"
FORMULA = "#e0a030"

# The site shows a plot at its page's width, about 700 px: a figure 8.5 inches wide is drawn at ~1.1 px per
# point there, so the smallest text (NOTE_SIZE) is ~11 px high and the labels ~12-13 px.
WIDTH = 8.5
FONT_SIZES = {"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "xtick.labelsize": 11,
              "ytick.labelsize": 11, "legend.fontsize": 10.5}
LABEL_SIZE = 10.5  # the figures written beside the bars
NOTE_SIZE = 10  # the data's source under each plot
TITLE_SIZE = 14


# --- the figures against BENCHMARKS.md's tables -------------------------------------------------------------

def load_current(path: Path = CURRENT) -> dict[str, Any]:
    return json.loads(path.read_text())


def plain(cell: str) -> str:
    """A table cell without Markdown emphasis or code marks."""
    return re.sub(r"[`*]", "", cell).strip()


def cell_number(cell: str) -> tuple[float, int] | None:
    """The number a cell prints (``1,578x``, ``72%``, ``0.80x``) and its count of decimals; None for text."""
    match = re.fullmatch(r"(-?\d+(?:\.(\d+))?)\s*(?:x|%)?", plain(cell).replace(",", ""))
    if match is None:
        return None
    return float(match[1]), len(match[2] or "")


def section_text(markdown: str, heading: str) -> str:
    """The text under ``heading`` (its words, without the ``#`` marks) up to the next heading of its level or
    above; outside fenced code blocks."""
    lines = markdown.splitlines()
    fenced = False
    start, level = None, 0
    for index, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#{1,6}) +(.+?) *$", line)
        if match is None:
            continue
        if start is not None and len(match[1]) <= level:
            return "\n".join(lines[start:index])
        if start is None and match[2] == heading:
            start, level = index + 1, len(match[1])
    if start is None:
        raise KeyError(f"BENCHMARKS.md has no heading {heading!r}")
    return "\n".join(lines[start:])


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Each pipe table of ``text`` as its rows, each a dict from the plain header to the cell."""
    tables: list[list[dict[str, str]]] = []
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            header = [plain(cell) for cell in block[0]]
            tables.append([dict(zip(header, row, strict=False)) for row in block[2:]])
        block = []
    return tables


def _same(cell: str, value: Any) -> bool:
    number = cell_number(cell)
    if isinstance(value, str) or number is None:
        return plain(cell) == str(value)
    return number[0] == float(value)


def _find_row(tables: list[list[dict[str, str]]], key: dict[str, Any], columns: set[str]) -> dict[str, str] | None:
    for table in tables:
        if not table or not columns <= table[0].keys():
            continue
        for row in table:
            if all(_same(row[name], value) for name, value in key.items()):
                return row
    return None


def disagreements(name: str, dataset: dict[str, Any], markdown: str) -> list[str]:
    """What in ``dataset`` (one entry of current.json's ``datasets``) differs from BENCHMARKS.md: a row or
    cell not found or not equal, a command absent from its section, a ratio column not the quotient of the
    figures it names to the precision printed. Empty when they agree."""
    try:
        text = section_text(markdown, dataset["section"])
    except KeyError as error:
        return [f"{name}: {error.args[0]}"]
    problems = []
    if dataset["command"] not in text:
        problems.append(f"{name}: the command {dataset['command']!r} is not in section {dataset['section']!r}")
    if dataset["commit"] not in text:
        problems.append(f"{name}: the commit {dataset['commit']} is not named in section {dataset['section']!r}")
    tables = markdown_tables(text)
    found: dict[int, dict[str, str]] = {}
    for index, row in enumerate(dataset["rows"]):
        key = {column: row[column] for column in dataset["key"]}
        cells = _find_row(tables, key, set(row))
        if cells is None:
            problems.append(f"{name}: no row {key} with the columns {sorted(row)} in {dataset['section']!r}")
            continue
        found[index] = cells
        for column, value in row.items():
            if not _same(cells[column], value):
                problems.append(f"{name}: {key} {column!r} is {value!r} in current.json, {cells[column]!r} in "
                                f"BENCHMARKS.md")
    for ratio in dataset["ratios"]:
        numerator_column, denominator_column = ratio["of"]
        against = ratio.get("against")
        base = next((row for row in dataset["rows"] if against is not None
                     and all(row.get(k) == v for k, v in against.items())), None)
        for index, row in enumerate(dataset["rows"]):
            denominator_row = row if against is None else base
            if index not in found or denominator_row is None or ratio["column"] not in row:
                continue
            printed = cell_number(found[index][ratio["column"]])
            assert printed is not None  # the cell equals the row's number, checked above
            quotient = row[numerator_column] / denominator_row[denominator_column]
            if abs(quotient - printed[0]) > 0.5 * 10 ** -printed[1] + 1e-9:
                problems.append(f"{name}: {ratio['column']!r} of row {index} prints {printed[0]} but "
                                f"{numerator_column} / {denominator_column} is {quotient:.4g}")
    return problems


def check(data: dict[str, Any], markdown: str) -> list[str]:
    return [problem for name, dataset in data["datasets"].items()
            for problem in disagreements(name, dataset, markdown)]


# --- the plots ----------------------------------------------------------------------------------------------

def _source(*datasets: dict[str, Any]) -> str:
    runs = "; ".join(f"{d['command'].split('.venv/bin/python ')[-1]} at {d['commit']} ({d['date']})"
                     for d in datasets)
    return f"CPU VM, 2 cores, gloo. Data: bench/results/current.json ({runs})"


def _note(text: str) -> str:
    """The line under a plot, wrapped to the figure's width at NOTE_SIZE."""
    return "\n".join(textwrap.wrap(text, 100))


def _wrap(label: str, width: int = 34) -> str:
    label = label.replace(" -> ", "\N{NO-BREAK SPACE}->\N{NO-BREAK SPACE}")  # "4 -> 2" on one line
    return "\n".join(textwrap.wrap(label, width, break_long_words=False, break_on_hyphens=False))


def _ms(value: float) -> str:
    """A figure as BENCHMARKS.md prints it (``3.0``, ``262.1``, ``2,288``), with its unit."""
    return f"{value:,} ms"


def draw_checkpoint_blocked(data: dict[str, Any]) -> Figure:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    peers = data["datasets"]["checkpoint_peers"]
    saves = data["datasets"]["checkpoint_save"]
    figure = Figure(figsize=(WIDTH, 10.5), layout="constrained")
    left, right = figure.subplots(2, 1, height_ratios=[1, 1.9])  # one above the other: legible at page width

    rows = peers["rows"]
    labels = [_wrap(row["save"], 22) for row in rows]
    positions = range(len(rows))
    height = 0.38
    for offset, (column, ratio, shade) in enumerate((("blocked ms", "blocked vs ours", 0),
                                                     ("to durable ms", "to durable vs ours", 1))):
        for position, row in zip(positions, rows, strict=True):
            ours = row["save"].startswith("lightning_zero")
            colour = (OURS, OURS_LIGHT)[shade] if ours else (OTHER, OTHER_LIGHT)[shade]
            y = position + (offset - 0.5) * height
            left.barh(y, row[column], height=height, color=colour, edgecolor="black", linewidth=0.4)
            note = _ms(row[column]) if ours else f"{_ms(row[column])}  ({row[ratio]:g}x ours)"
            left.text(row[column] + 4, y, f"{column.removesuffix(' ms')}: {note}", va="center", fontsize=LABEL_SIZE)
    left.legend(handles=[Patch(color=OURS, label="blocked: the training thread waits"),
                         Patch(color=OURS_LIGHT, label="to durable: fsynced, in the background (ours)")],
                loc="upper right")
    left.set_yticks(list(positions), labels)
    left.set_ylim(len(rows) - 0.5, -1.1)  # rows top down, with room above the first for the legend
    left.set_xlim(0, max(row["to durable ms"] for row in rows) * 1.9)
    left.set_xlabel("milliseconds (lower is better)")
    left.set_title(f"Against DeepSpeed ZeRO-2,\n{peers['state']}")

    rows = saves["rows"]
    for position, row in enumerate(rows):
        ours = row["save"].startswith("lightning_zero async_save")
        right.barh(position, row["call blocks ms"], color=OURS if ours else OTHER, edgecolor="black", linewidth=0.4)
        ratio = row["blocks vs ours sharded"]
        note = _ms(row["call blocks ms"]) + ("" if ratio == 1 else f"  ({ratio:,g}x ours)")
        right.text(row["call blocks ms"] * 1.15, position, note, va="center", fontsize=LABEL_SIZE)
    right.set_xscale("log")
    right.set_xlim(0.5, max(row["call blocks ms"] for row in rows) * 250)
    right.set_yticks(range(len(rows)), [_wrap(row["save"], 26) for row in rows], fontsize=LABEL_SIZE)
    right.invert_yaxis()
    right.set_xlabel("milliseconds the save call blocks training\n(log scale, lower is better)")
    right.set_title(f"Against torch DCP and Lightning,\n{saves['state']}")

    figure.suptitle("How long a checkpoint save blocks the training loop", fontsize=TITLE_SIZE, weight="bold")
    figure.text(0.5, -0.01, _note("ColossalAI is not measured: its LowLevelZero asserts a CUDA or NPU device. "
                                  + _source(peers, saves)), ha="center", va="top", fontsize=NOTE_SIZE)
    return figure


def draw_memory(data: dict[str, Any]) -> Figure:
    from matplotlib.figure import Figure

    memory = data["datasets"]["memory_between_steps"]
    figure = Figure(figsize=(WIDTH, 6.2), layout="constrained")
    axes = figure.subplots()
    bars = (("zero2 MiB", "lightning_zero zero2", OURS), ("ZeRO formula MiB", "ZeRO paper's formula", FORMULA),
            ("DeepSpeed ZeRO-2 MiB", "DeepSpeed ZeRO-2", OTHER), ("DDP MiB", "DDP", OTHER_LIGHT))
    width = 0.2
    for group, row in enumerate(memory["rows"]):
        for index, (column, label, colour) in enumerate(bars):
            x = group + (index - 1.5) * width
            axes.bar(x, row[column], width=width, color=colour, edgecolor="black", linewidth=0.4,
                     label=label if group == 0 else None)
            axes.text(x, row[column] + 2, f"{row[column]:g}", ha="center", fontsize=LABEL_SIZE - 1)
        top = max(row[column] for column, _, _ in bars)
        axes.text(group - 1.5 * width, top + 14,
                  f"zero2 = {row['zero2 / formula']:.2f}x formula\n"
                  f"{row['zero2 / DeepSpeed ZeRO-2']:.2f}x DeepSpeed ZeRO-2\n{row['zero2 / DDP']:.2f}x DDP",
                  fontsize=LABEL_SIZE, color=OURS, va="bottom")
    axes.set_xticks(range(len(memory["rows"])), [f"{row['world size']} ranks" for row in memory["rows"]])
    axes.set_ylabel("MiB a rank holds between steps (lower is better)")
    axes.set_ylim(0, max(row["DDP MiB"] for row in memory["rows"]) * 1.75)
    axes.legend(loc="upper right")
    axes.set_title("Memory between steps: zero2 against the formula,\nDeepSpeed ZeRO-2 and DDP "
                   "(10.27M-parameter GPT, AdamW, fp32;\nresident memory, each method in processes of its own)")
    figure.text(0.5, -0.01, _note(_source(memory)), ha="center", va="top", fontsize=NOTE_SIZE)
    return figure


def draw_recovery(data: dict[str, Any]) -> Figure:
    from matplotlib.figure import Figure

    recovery = data["datasets"]["recovery"]
    ratios = {row["durable / fast tier, both 4 -> 2"]: row["x"] for row in data["datasets"]["recovery_ratios"]["rows"]}
    figure = Figure(figsize=(WIDTH, 5.6), layout="constrained")
    axes = figure.subplots()
    parts = (("choose ms", "choose the checkpoint", "#c6dbef"), ("reshard ms", "reshard", "#6baed6"),
             ("load ms", "load", "#2171b5"), (None, "lost steps trained again", "#e6550d"))
    rows = recovery["rows"]
    for position, row in enumerate(rows):
        left = 0.0
        for column, label, colour in parts:
            width = row[column] if column else row["back at step 8 ms"] - row["resume ms"]
            axes.barh(position, width, left=left, color=colour, edgecolor="black", linewidth=0.4,
                      label=label if position == 0 else None)
            left += width
        lost = "none lost" if row["steps lost"] == 0 else f"{row['steps lost']} steps lost"
        axes.text(row["back at step 8 ms"] + 10, position,
                  f"resume {row['resume ms']:g} ms at step {row['step resumed']}, {lost}:\n"
                  f"back at step 8 after {row['back at step 8 ms']:g} ms", va="center", fontsize=LABEL_SIZE)
    axes.set_yticks(range(len(rows)), [_wrap(row["resume"], 22) for row in rows])
    axes.invert_yaxis()
    axes.set_xlim(0, max(row["back at step 8 ms"] for row in rows) * 2.1)
    axes.set_xlabel("milliseconds, from the restarted job's load\nto being back at step 8 (lower is better)")
    axes.legend(loc="lower right")
    resume = ratios["resume (choose + reshard + load)"]
    back = ratios["back at step 8 (resume + lost steps trained again)"]
    start = ratios["worker start -> back at step 9 (first step + lost steps)"]
    axes.set_title(f"A lost node: the fast tier resharded 4 -> 2\nagainst the durable tier on S3. "
                   f"Durable / fast: {resume:.2f}x the resume,\n{back:.2f}x to be back at step 8, "
                   f"{start:.2f}x counted from the workers' start")
    figure.text(0.5, -0.01, _note("Not drawn: the workers' start (4.7 s for both, mostly imports). S3 is moto on "
                                  "loopback, so the durable figures are a floor. " + _source(recovery)),
                ha="center", va="top", fontsize=NOTE_SIZE)
    return figure


PLOTS: dict[str, Callable[[dict[str, Any]], Figure]] = {
    "checkpoint_blocked.png": draw_checkpoint_blocked,
    "memory_between_steps.png": draw_memory,
    "recovery.png": draw_recovery,
}


def build_figures(data: dict[str, Any]) -> dict[str, Figure]:
    import matplotlib

    with matplotlib.rc_context(FONT_SIZES):  # read when each text is made
        return {name: draw(data) for name, draw in PLOTS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check current.json against BENCHMARKS.md")
    parser.add_argument("--out-dir", type=Path, default=IMAGES)
    args = parser.parse_args(argv)
    data = load_current()
    problems = check(data, BENCHMARKS.read_text())
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems or args.check:
        return 1 if problems else 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, figure in build_figures(data).items():
        figure.savefig(args.out_dir / name, dpi=150, bbox_inches="tight")
        print(args.out_dir / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
