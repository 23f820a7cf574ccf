"""The README's performance figures are the ones benches/RESULTS.md holds, on the same machine,
and RESULTS.md is what `python benches/run.py --summary` writes from benches/results/*.md."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = REPO / "benches" / "RESULTS.md"

# A quoted figure: a ratio ("7.0x"), a percentage ("2.0 %") or a bare decimal ("5.88"); not a
# piece of a longer number or word ("11.14x" holds no "1.14x", "uint16" no "16").
FIGURE = re.compile(r"(?<![\w.,])(?:\d[\d,]*(?:\.\d+)?(?:x|\s?%)(?!\w)|\d+\.\d+(?!\w|\.\d))")
# Fewer figures than this in the README's table means the check lost track of it, not a pass.
MIN_FIGURES = 15


def figures(text: str) -> set[str]:
    return {re.sub(r"\s", "", f) for f in FIGURE.findall(text)}


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the first markdown table in `text`, header and rule left out."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if start is None:
        return []
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def unquoted_figures(readme: str, results: str, min_figures: int = MIN_FIGURES) -> list[str]:
    """Each figure of the README's Performance section that RESULTS.md does not hold: a table row's
    figures must be in RESULTS.md's rows of the machine that row names, the prose's anywhere.
    A section with fewer than `min_figures` figures in its table is a ValueError."""
    section = readme.split("\n## Performance", 1)[-1].split("\n## ", 1)[0]
    summary = results.split("\n## This run", 1)[0]
    current = [(figures(" ".join(row[:3])), words(row[3])) for row in table_rows(summary) if len(row) >= 4]
    rows = table_rows(section)
    quoted = sum(len(figures(" ".join(row[:-1]))) for row in rows)
    if quoted < min_figures:
        raise ValueError(f"README's Performance table quotes {quoted} figures, expected at least {min_figures}")
    missing = []
    for row in rows:
        machine = words(row[-1])
        held = set().union(*(f for f, m in current if machine <= m))
        missing += [f"{f} ({row[0]}, {row[-1]})" for f in sorted(figures(" ".join(row[:-1])) - held)]
    prose = "\n".join(ln for ln in section.splitlines() if not ln.startswith("|"))
    held = set().union(*(f for f, _ in current))
    missing += [f"{f} (prose)" for f in sorted(figures(prose) - held)]
    return missing


def test_every_figure_of_the_readme_is_in_results_md():
    assert unquoted_figures(README.read_text(encoding="utf-8"), RESULTS.read_text(encoding="utf-8")) == []


def test_results_md_is_what_the_summary_writes_today(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benches" / "run.py")
    run = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_run", run)  # dataclasses look their module up
    spec.loader.exec_module(run)
    expected = "\n".join(run.results_header() + run.summary_lines(run.latest_results()))
    assert RESULTS.read_text(encoding="utf-8").startswith(expected), (
        "benches/RESULTS.md is out of date: python benches/run.py --summary"
    )


RESULTS_SAMPLE = """\
| job | compared with | result | machine | details |
|---|---|---|---|---|
| training | peer A / peer B | 7.0x / 10.4x faster | Big VM (AVX2) | [x](x.md) |
| encoding | peer A | 1.14x, val loss 2.0 % lower | Big VM (AVX2) | [x](x.md) |
| step | peer C | 0.40x | Small VM (AVX-512) | [x](x.md) |
"""


def readme_sample(table: str, prose: str = "") -> str:
    header = "| job | input | ferrolm | others | machine |\n|---|---|---|---|---|\n"
    return f"# x\n\n## Performance\n\nIntro.\n\n{header}{table}\n{prose}\n## Next\n\n| 99.9x | Big |\n"


GOOD_TABLE = (
    "| training | text | **7.0x** A | 10.4x B | Big |\n"
    "| encoding | text | **1.14x** A | 2.0 % lower | Big AVX2 |\n"
    "| step | shape | **0.40x** C | | Small |\n"
)


def test_the_check_passes_on_quoted_figures():
    assert unquoted_figures(readme_sample(GOOD_TABLE, "Prose quoting 10.4x.\n"), RESULTS_SAMPLE, 5) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("**7.0x**", "**7.1x**"),  # an altered figure
        ("10.4x B", "10x B"),  # a rounded one
        ("**1.14x**", "**11.14x**"),  # a figure that holds a quoted one
        ("2.0 % lower", "2.5 % lower"),
        ("**0.40x** C | | Small", "**0.40x** C | | Big"),  # a figure of another machine
    ],
)
def test_an_altered_figure_fails_the_check(old, new):
    assert GOOD_TABLE.count(old) == 1
    missing = unquoted_figures(readme_sample(GOOD_TABLE.replace(old, new)), RESULTS_SAMPLE, 5)
    assert len(missing) == 1 and missing[0].startswith(FIGURE.search(new).group().replace(" ", ""))


def test_a_figure_in_the_prose_is_checked_too():
    assert unquoted_figures(readme_sample(GOOD_TABLE, "It reaches 5.88 against 6.40.\n"), RESULTS_SAMPLE, 5) == [
        "5.88 (prose)",
        "6.40 (prose)",
    ]


def test_a_table_with_too_few_figures_is_an_error_not_a_pass():
    with pytest.raises(ValueError, match="quotes 3 figures"):
        unquoted_figures(readme_sample("| a | b | **7.0x** | 10.4x, 1.14x | Big |\n"), RESULTS_SAMPLE, 5)
    with pytest.raises(ValueError, match="quotes 0 figures"):
        unquoted_figures("# no performance section\n", RESULTS_SAMPLE, 5)
