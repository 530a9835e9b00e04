"""The docs the code cites exist in the repository, nothing points outside it, and the
operating guide's flag table is the one the code prints."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Generated, installed or vendored trees: not the project's text.
SKIP_DIRS = {".git", ".venv", "build", "out", "__pycache__", ".pytest_cache", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".json", ".toml", ".txt", ".sh", ".mk", ".h", ".cpp", ".cu", ".hip", ".c",
                 ".yml", ".yaml", ".cfg", ""}
CITATION = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)")
OUTSIDE = re.compile(r"\.\./shared\b|/work/shared\b|shared docs/")


def project_files(root: Path):
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in {"Makefile", "Dockerfile"} or path.name.startswith("Dockerfile"):
            yield path


def broken_citations(root: Path) -> list[str]:
    found = []
    for path in project_files(root):
        if path.resolve() == Path(__file__).resolve():  # its own examples
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(root)
        for m in CITATION.finditer(text):
            if not (root / "docs" / m.group(1)).is_file():
                found.append(f"{rel}:{text[:m.start()].count(chr(10)) + 1}: cites docs/{m.group(1)}, which does not exist")
        for m in OUTSIDE.finditer(text):
            found.append(f"{rel}:{text[:m.start()].count(chr(10)) + 1}: points outside the repository ({m.group(0)})")
    return found


def test_every_cited_doc_exists_and_nothing_points_outside():
    assert (ROOT / "docs").is_dir()
    found = broken_citations(ROOT)
    assert not found, "\n".join(found)


def test_the_docs_are_cited():
    """Every page under docs/ is reachable from the README or the code (no orphan pages)."""
    cited = set()
    for path in project_files(ROOT):
        if path.parent != ROOT / "docs":
            cited |= set(CITATION.findall(path.read_text(errors="replace")))
    orphans = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in cited)
    assert not orphans, f"docs/ pages nobody cites: {orphans}"


def test_operations_guide_lists_the_flags_the_code_has():
    from engram_sglang.serving.settings import knobs_markdown

    guide = (ROOT / "docs" / "operations.md").read_text()
    assert knobs_markdown().strip() in guide, (
        "docs/operations.md's flag table differs from `python -m engram_sglang.serving.settings`: paste that output")


def test_a_broken_citation_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('"""See docs/here.md and\ndocs/gone.md; also ../shared/docs/x.md."""\n')
    found = broken_citations(tmp_path)
    assert any("m.py:2: cites docs/gone.md" in f for f in found), found
    assert any("points outside" in f for f in found), found
    assert not any("here.md" in f for f in found), found
