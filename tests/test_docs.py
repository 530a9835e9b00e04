"""The docs the code cites exist in the repository, the code paths the docs cite exist, nothing
points outside it, and the operating guide's flag table is the one the code prints."""

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


# ------------------------------------------------------------ code paths the prose cites
# The pages whose paths a reader follows (paths in the code's docstrings are not checked here).
PROSE = ("README.md", "CONTRIBUTING.md", "docs/*.md", "kernels/README.md", "docker/README.md")
TOP_LEVEL = ("engram_sglang", "kernels", "tests", "bench", "fuzz", "configs", "docker", "scripts", "mk", ".ci",
             ".github", "requirements")
# A file name alone counts for source extensions; a data or config name alone (`manifest.json`,
# `config.json`) is a file a user has, not one of ours, so those count only with a folder.
SOURCE_EXT = {".py", ".h", ".cu", ".cpp", ".c", ".mk", ".sh"}
FOLDER_EXT = SOURCE_EXT | {".toml", ".json", ".yml", ".yaml", ".txt", ".md"}
BUILD_NAMES = re.compile(r"Makefile|Dockerfile(\.[\w-]+)?")
# Written by a run, never in a checkout.
GENERATED = ("bench/out/", "build/")
# Files the docs name that are not the project's: the demo corpus's standard-library files.
NOT_OURS = {"_pyio.py", "argparse.py", "bisect.py", "dataclasses.py", "llama.cpp"}
# A token: a run of path characters; placeholders (`*`, `<x>`, `{L}`) are kept in it so it can be skipped.
# Not one that continues an absolute path, a URL, a variable or an argument's value (`--domain code=a.py`).
TOKEN = re.compile(r"(?<![\w./:@~$=-])[\w.*<>{}-]+(?:/[\w.*<>{}-]*)*")
COMPONENT = re.compile(r"[A-Za-z_.][\w.-]*")
# A placeholder: a glob or template character, a component in capitals (`MODEL_DIR/`), or
# NAME / X inside a name (`tests/tools/test_bench_NAME.py`).
PLACEHOLDER = re.compile(r"[*<>{}]|(?:^|/)[A-Z][A-Z0-9_]*(?:\.\w+)?(?:/|$)|(?<![A-Za-z0-9])(?:NAME|X)(?![A-Za-z0-9])")
REAL_CAPS = re.compile(r"(?:^|/)(?:README|CONTRIBUTING|MANIFEST|LICENSE)\.\w+$")


def prose_files(root: Path) -> list[Path]:
    return sorted({p for pattern in PROSE for p in root.glob(pattern) if p.is_file()})


def is_code_path(token: str) -> bool:
    if "/" not in token:
        return Path(token).suffix in SOURCE_EXT or bool(BUILD_NAMES.fullmatch(token))
    if token.endswith("/"):
        parts = token[:-1].split("/")
        return all(COMPONENT.fullmatch(p) for p in parts) and parts[0] not in {".", ".."}
    name = token.rsplit("/", 1)[1]
    return Path(name).suffix in FOLDER_EXT or bool(BUILD_NAMES.fullmatch(name))


def skipped(token: str) -> bool:
    if token in NOT_OURS or any(token.startswith(g) for g in GENERATED):
        return True
    return bool(PLACEHOLDER.search(token)) and not REAL_CAPS.search(token)


def resolves(root: Path, token: str, page: Path) -> bool:
    """A path under a top-level folder is repo-relative; any other is tried against the package,
    kernels/, the repository root and the citing page's own folder (`serving/modes.py`,
    `cuda/vendor.h`, `setup.py`)."""
    path = token.rstrip("/")
    if path.split("/")[0] in TOP_LEVEL:
        bases = [root]
    else:
        bases = [root / "engram_sglang", root / "kernels", root, page.parent]
    return any((base / path).is_dir() if token.endswith("/") else (base / path).is_file() for base in bases)


def defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", path.read_text(), re.MULTILINE) is not None


def missing_functions(root: Path, page: Path, text: str) -> list[str]:
    """Test functions cited as `path::name` (or `::name` after such a path on its line) that
    the file does not define."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        current = None
        for m in re.finditer(r"(tests/[\w/]+\.py)?::(\w+)", line):
            if m.group(1):
                current = root / m.group(1)
            if current is not None and current.is_file() and not defines(current, m.group(2)):
                found.append(f"{page.relative_to(root)}:{number}: cites {current.relative_to(root)}::{m.group(2)}, "
                             f"which that file does not define")
    return found


def missing_code_paths(root: Path) -> list[str]:
    found = []
    for page in prose_files(root):
        text = page.read_text()
        for m in TOKEN.finditer(text):
            token = m.group(0).rstrip(".")
            if not is_code_path(token) or skipped(token) or resolves(root, token, page):
                continue
            line = text[:m.start()].count("\n") + 1
            found.append(f"{page.relative_to(root)}:{line}: cites {token}, which is not in the repository")
        found += missing_functions(root, page, text)
    return found


def test_every_cited_code_path_exists():
    found = missing_code_paths(ROOT)
    assert not found, "\n".join(found)


def test_a_missing_code_path_is_reported(tmp_path):
    for path in ("engram_sglang/serving/modes.py", "kernels/cuda/vendor.h", "tests/core/test_x.py", "setup.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("def test_y():\n    pass\n" if path.endswith("test_x.py") else "")
    (tmp_path / "README.md").write_text(
        "Present: `serving/modes.py`, engram_sglang/serving/, `cuda/vendor.h`, tests/core/test_x.py::test_y, "
        "setup.py.\n"
        "Gone: `engram_sglang/gone.py`, `ops/gather.py`,\nmodes.py, tests/test_x.py, `kernels/io/`, Makefile.\n"
        "`tests/core/test_x.py::test_y`, `::test_gone`.\n`::test_z` follows no file.\n"
        "Not paths: bench/NAME.py, tests/tools/test_bench_NAME.py, `configs/recipes/*.json`, MODEL_DIR/config.json,\n"
        "manifest.json, argparse.py, https://x.org/a/b.py, /dev/shm/, --domain code=a.py, bench/out/gather.json, "
        "3.5/7.2/.\n")
    found = missing_code_paths(tmp_path)
    reported = {f.split(" cites ")[1].split(",")[0] for f in found if "does not define" not in f}
    assert reported == {"engram_sglang/gone.py", "ops/gather.py", "modes.py", "tests/test_x.py", "kernels/io/",
                        "Makefile"}, found
    assert any(f.startswith("README.md:3: cites modes.py") for f in found), found
    functions = [f for f in found if "does not define" in f]
    assert functions == ["README.md:4: cites tests/core/test_x.py::test_gone, which that file does not define"], found


def _subcommands(parser):
    """The subcommand parsers of an argparse parser ({} for a leaf), lazy ones loaded."""
    import argparse

    parser = parser.load() if getattr(parser, "_module", "") else parser  # the CLI's lazy command parsers
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return parser, dict(action.choices)
    return parser, {}


def cited_cli_problems(text: str) -> list[str]:
    """`--engram-*` flags that are not knobs and `engram-sglang` command lines (subcommands and
    their options) that the CLI does not have, in a page's text."""
    from engram_sglang.serving.settings import KNOBS
    from engram_sglang.tools.cli import build_parser

    flags = {f"--engram-{k.flag}" for k in KNOBS}
    found = [f"{f}: not a knob" for f in sorted(set(re.findall(r"--engram-[a-z-]*[a-z]", text)) - flags)]
    for line in re.findall(r"engram-sglang((?: [a-z][\w-]*)+(?: [^\n`|]*)?)", text):
        words = line.split()
        parser, subs = _subcommands(build_parser())
        path = []
        while words and subs and words[0] in subs:
            path.append(words.pop(0))
            parser, subs = _subcommands(subs[path[-1]])
        if subs:
            found.append(f"engram-sglang {' '.join(path + words[:1])}: no such subcommand")
            continue
        options = {o for a in parser._actions for o in a.option_strings}
        found += [f"engram-sglang {' '.join(path)} {w}: no such option" for w in words
                  if w.startswith("--") and w.split("=")[0] not in options]
    return found


def test_the_deepseek_deploy_page_cites_flags_and_commands_that_exist():
    text = (ROOT / "docs" / "deploy-deepseek.md").read_text()
    assert not cited_cli_problems(text), "\n".join(cited_cli_problems(text))
    bad = "engram-sglang tables convrt X --engram-placment host\n`engram-sglang plan --gpu H200 --no-such`"
    assert cited_cli_problems(bad) == ["--engram-placment: not a knob", "engram-sglang tables convrt: no such subcommand",
                                       "engram-sglang plan --no-such: no such option"]


# ------------------------------------------------------------- curl examples (issue 25 item 7)


def curl_problems(text: str, where: str) -> list[str]:
    """Each `curl` command in a page's ```bash blocks that sends a body must say it is JSON
    (SGLang parses the body by its content type) and send JSON that parses."""
    import json
    import shlex

    problems = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        lines, i = block.splitlines(), 0
        while i < len(lines):
            if not lines[i].lstrip().startswith("curl "):
                i += 1
                continue
            cmd = lines[i]
            while i + 1 < len(lines) and (cmd.endswith("\\") or cmd.count("'") % 2):  # continued
                i += 1
                cmd = cmd.rstrip("\\") + "\n" + lines[i]
            i += 1
            words = shlex.split(cmd.split("|")[0] if cmd.count("'") % 2 == 0 else cmd)
            body = next((words[k + 1] for k, w in enumerate(words[:-1]) if w in ("-d", "--data", "--data-raw")), None)
            if body is None:
                continue
            headers = [words[k + 1].lower().replace(" ", "") for k, w in enumerate(words[:-1]) if w in ("-H", "--header")]
            if "content-type:application/json" not in headers:
                problems.append(f"{where}: `{cmd.splitlines()[0]} ...` sends a body without "
                                f"-H 'Content-Type: application/json'")
            try:
                json.loads(body)
            except ValueError as e:
                problems.append(f"{where}: `{cmd.splitlines()[0]} ...` sends a body that is not JSON ({e})")
    return problems


def test_curl_examples_send_json_with_its_content_type():
    pages = [ROOT / "README.md", ROOT / "docker" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for page in pages for p in curl_problems(page.read_text(), str(page.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)
    assert any("curl" in page.read_text() and " -d " in page.read_text() for page in pages)  # still checks one


def test_a_curl_example_without_its_content_type_is_reported():
    page = "```bash\ncurl -s localhost:30000/generate -d '{\"text\": \"a\",\n  \"sampling_params\": {}}'\n```\n"
    assert [p.split(": ", 1)[1].split("` ")[1] for p in curl_problems(page, "x.md")] == [
        "sends a body without -H 'Content-Type: application/json'"]
    assert "is not JSON" in "".join(curl_problems(page.replace("{}}", "{}"), "x.md"))
