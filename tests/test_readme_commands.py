"""The README's commands run as written, and every link in README.md and docs/ resolves.

Each ```bash block of README.md runs, whole, in one shared temporary working directory
(so ``runs/fedring.db`` lands there), with ``.venv`` linked to this checkout's; a block is
left out only when the line before it says why, in a comment
``<!-- not run by tests/test_readme_commands.py: REASON -->``. A ```python block whose
first line is ``# NAME.py`` is written to that directory first, as the README tells the
reader to save it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = re.compile(r"^<!-- not run by tests/test_readme_commands\.py: (?P<reason>.+?) -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<body>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    line: int  # where the block starts in README.md, for the test id
    skip: str | None  # the reason it is not run, or None


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` with its language and, if marked, why it is not run."""
    blocks = []
    for m in FENCE.finditer(text):
        before = [ln for ln in text[:m.start()].splitlines() if ln.strip()]
        marker = SKIP.match(before[-1]) if before else None
        blocks.append(Block(m["lang"], m["body"], text[:m.start()].count("\n") + 1,
                            marker["reason"] if marker else None))
    return blocks


BLOCKS = readme_blocks(README.read_text())
BASH = [b for b in BLOCKS if b.lang == "bash"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A fresh working directory with this checkout's ``.venv`` and the README's files."""
    work = tmp_path_factory.mktemp("readme")
    (work / ".venv").symlink_to(Path(sys.prefix))
    for block in BLOCKS:
        name = re.match(r"# ([\w.-]+\.py)\n", block.body) if block.lang == "python" else None
        if name:
            (work / name[1]).write_text(block.body)
    return work


def test_the_readme_has_commands_to_run_and_says_why_it_skips_the_others():
    run = [b for b in BASH if b.skip is None]
    assert len(run) >= 10
    assert all(b.skip.strip() for b in BASH if b.skip is not None)
    assert any("fedring report" in b.body for b in run)
    markers = re.findall(r"^<!-- not run by tests/test_readme_commands\.py", README.read_text(),
                         flags=re.M)
    assert len(markers) == sum(b.skip is not None for b in BLOCKS)  # none stray from a block


@pytest.mark.slow
@pytest.mark.parametrize("block", BASH, ids=[f"line{b.line}" for b in BASH])
def test_readme_block_runs_as_written(block: Block, workdir: Path):
    if block.skip is not None:
        pytest.skip(block.skip)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FEDRING_", "FLWR_"))}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"README.md line {block.line}:\n{block.body}\n"
                                  f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n"
                                  f"{proc.stderr[-4000:]}")


# links ------------------------------------------------------------------------------------

LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_anchor(m[1]) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOCS, ids=[p.name if p == README else f"docs/{p.name}"
                                            for p in DOCS])
def test_every_link_resolves(page: Path):
    broken = []
    for m in LINK.finditer(FENCE.sub("", page.read_text())):
        target = m["target"]
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_first_screen_links_the_architecture_and_the_reading_order():
    first_screen = "\n".join(README.read_text().splitlines()[:24])
    assert "(docs/ARCHITECTURE.md)" in first_screen and "(docs/README.md)" in first_screen


def test_the_readme_is_a_tour():
    assert len(README.read_text().splitlines()) <= 300
