"""The docs cite what the repository holds: every file or folder path named in README.md, docs/,
bench/README.md and tools/README.md exists (paths with placeholders or wildcards, or an upper-case
name such as SCRIPT.py, are skipped), and no doc sends the reader to a file outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "tools" / "README.md",
               *(ROOT / "docs").glob("*.md")])
# a path: one of the repository's top folders followed by more, or a markdown file's name
PATH = re.compile(r"(?<![\w./-])((?:kiln|tests|bench|tools|docs)/[\w./-]*[\w/]|[\w-]+\.md)(?![\w/-])")
ELSEWHERE = ("REFERENCE.md", "DESIGN.md", "STYLE.md", "DEVELOPERS.md")


def cited(doc: Path) -> list[str]:
    text = doc.read_text()
    return [m.group(1) for m in PATH.finditer(text)
            if not any(c in text[m.start(1) - 1:m.end(1) + 1] for c in "<*{")
            and not Path(m.group(1)).stem.isupper()]     # SCRIPT.py, OUT.json: placeholders


def exists(doc: Path, path: str) -> bool:
    return any((base / path).exists() for base in (ROOT, doc.parent))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_path_exists(doc):
    missing = sorted({p for p in cited(doc) if not exists(doc, p)})
    assert not missing, f"{doc.relative_to(ROOT)} cites paths the repository does not hold: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_cites_a_file_outside_the_repository(doc):
    text = doc.read_text()
    assert not [name for name in ELSEWHERE if name in text and not (ROOT / name).exists()]


def test_adding_a_model_family_has_its_page():
    """docs/adding-a-model.md walks through the steps (its paths checked above), and the map links it."""
    page = ROOT / "docs" / "adding-a-model.md"
    assert page.exists()
    assert {"kiln/models/__init__.py", "kiln/weights/synth.py", "kiln/cache.py"} <= set(cited(page))
    assert "adding-a-model.md" in (ROOT / "docs" / "architecture.md").read_text()
