"""The documentation cannot drift from the code.

- Every ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` runs in a fresh interpreter
  (cwd: a temporary directory, the environment of one torchrun rank) and must exit 0; a block that
  includes files with pymdownx.snippets (``--8<-- "docs/examples/x.py"``) runs those files. A block
  that cannot run alone is marked ``<!-- fragment: why -->`` on the line before its fence: it is
  skipped and counted, and there may be only a few. A block that attaches must leave a run dir
  whose steps ``load_run`` reads.
- Every ``stragglerwatch ...`` command line of a shell block is parsed by the command's own
  argument parser; the synopses of the command line (``docs/analysis.md``) name only options that
  exist, and every option that exists.
- ``mkdocs build --strict`` succeeds: no broken link or anchor, no missing snippet file, no API
  reference target that does not resolve.

Examples that import torch (they train) and the site build are marked ``full``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
#: Seconds a block may run: a bound on a hang, no speed goal (the docs are tested at the lowest CPU priority
#: beside the multi-rank jobs: ``conftest.BESIDE``; a block takes 10 s at most alone).
TIMEOUT_S = 300
#: fragments (blocks that cannot run alone) allowed in all the pages together
MAX_FRAGMENTS = 3

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^`]*$")
FRAGMENT = re.compile(r"^\s*<!--\s*fragment:\s*(?P<why>.+?)\s*-->\s*$")
SNIPPET = re.compile(r'^\s*-{1,}8<-{1,}\s+"(?P<path>[^"]+)"\s*$')
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
#: how a command line may begin (after an optional "$ " and environment assignments)
COMMAND_PREFIXES = ("stragglerwatch", ".venv/bin/stragglerwatch", "python -m stragglerwatch",
                    ".venv/bin/python -m stragglerwatch")  # fmt: skip
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>", "1>"}


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    lines: tuple[tuple[int, str], ...]  # (line number, text), dedented to the fence's indent
    fragment: str | None  # why it cannot run alone, when marked

    @property
    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"

    @property
    def text(self) -> str:
        return "\n".join(text for _, text in self.lines) + "\n"

    def snippet_files(self) -> list[Path]:
        """The files a block made only of ``--8<--`` includes shows (sections included whole)."""
        codes = [text for _, text in self.lines if text.strip()]
        matches = [SNIPPET.match(text) for text in codes]
        if not codes or not all(matches):
            return []
        return [ROOT / m.group("path").split(":")[0] for m in matches if m]


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, also those indented in a list item."""
    out: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        before = FRAGMENT.match(lines[i - 1]) if i else None
        body: list[tuple[int, str]] = []
        j = i + 1
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while j < len(lines) and not closing.match(lines[j]):
            text = lines[j]
            body.append((j + 1, text[len(indent) :] if text.startswith(indent) else text.lstrip()))
            j += 1
        assert j < len(lines), f"{rel(page)}:{i + 1}: a code fence that is never closed"
        out.append(Block(page, i + 1, lang, tuple(body), before.group("why") if before else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def python_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang in ("python", "py", "python3")]


def trains(code: str) -> bool:
    """Whether a script is a training job (imports torch or a framework): those are slow."""
    return bool(re.search(r"^\s*(import|from)\s+(torch|lightning|transformers|accelerate)\b", code, re.M))


def runnable() -> list[pytest.param]:
    params = []
    for b in python_blocks():
        if b.fragment is not None:
            continue
        files = b.snippet_files()
        code = "".join(f.read_text(encoding="utf-8") for f in files if f.is_file()) if files else b.text
        marks = [pytest.mark.full] if trains(code) else []
        params.append(pytest.param(b, id=b.where, marks=marks))
    return params


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(tmp_path: Path) -> dict[str, str]:
    """The environment torchrun gives the one rank of a one-process job, in a clean temporary home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRAGGLERWATCH_")}
    env.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0", ROLE_RANK="0",
        ROLE_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        TORCHELASTIC_RUN_ID=f"docs-{tmp_path.name}", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
        HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )  # fmt: skip
    return env


# --- python blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize("block", runnable())
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    files = block.snippet_files()
    for f in files:
        assert f.is_file(), f"{block.where}: includes {rel(f)}, which does not exist"
    if not files:
        script = tmp_path / "block.py"
        script.write_text(block.text, encoding="utf-8")
        files = [script]
    work = tmp_path / "work"
    work.mkdir()
    for f in dict.fromkeys(files):
        proc = subprocess.run([sys.executable, str(f)], cwd=work, env=rank_env(tmp_path), capture_output=True,
                              text=True, timeout=TIMEOUT_S)  # fmt: skip
        output = (proc.stdout + proc.stderr)[-4000:]
        assert proc.returncode == 0, f"{block.where}: {f.name} exited with {proc.returncode}:\n{output}"
    code = "".join(f.read_text(encoding="utf-8") for f in files)
    if re.search(r"\battach\(|StragglerWatch(Callback)?\(", code):
        check_run_dirs(block, work)


def check_run_dirs(block: Block, work: Path) -> None:
    """A block that attaches leaves a run dir whose recorded steps add up."""
    from stragglerwatch import RunDirWarning, load_run

    run_dirs = sorted({p.parent for p in work.rglob("run.json")})
    assert run_dirs, f"{block.where}: it attaches, but no run dir was written under its working directory"
    for run_dir in run_dirs:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RunDirWarning)  # a truncated or foreign file in a fresh run fails
            steps = load_run(run_dir)
        assert len(steps) > 0, f"{block.where}: {run_dir.name} holds no step"
        assert (steps["step_s"] > 0).all() and (steps["busy_s"] >= 0).all(), f"{block.where}: {run_dir.name}"
        phases = steps[["data_wait_s", "forward_s", "backward_s", "allreduce_wait_s", "collective_wait_s",
                        "eval_s", "optimizer_s", "other_s"]].sum(axis=1)  # fmt: skip
        assert ((phases - steps["step_s"]).abs() < 1e-6).all(), f"{block.where}: the phases add up to the step"


def test_fragments_are_few_and_marked() -> None:
    """A block the tests cannot run is marked, on the line before its fence, and there are few."""
    fragments = [b for b in python_blocks() if b.fragment is not None]
    assert len(fragments) <= MAX_FRAGMENTS, f"too many fragments: {[b.where for b in fragments]}"
    for page in pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines):
            if FRAGMENT.match(line):
                nxt = FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
                assert nxt and nxt.group("lang") in ("python", "py"), (
                    f"{rel(page)}:{n + 1}: a fragment marker must sit on the line before a python fence"
                )
    executed = len(runnable())
    print(f"\ndocs: {executed} python blocks executed, {len(fragments)} fragments: {[b.where for b in fragments]}")
    assert executed >= 8, "the collector found too few python blocks: is it still reading the pages?"


def test_the_instrumenting_example_runs_in_full() -> None:
    """The README's short example is a fragment; its complete form is a file the tests run."""
    readme = [b for b in blocks(ROOT / "README.md") if b.lang == "python"]
    assert any("stragglerwatch.attach(model, optimizer=optimizer)" in b.text for b in readme)
    full = EXAMPLES / "instrument_ddp.py"
    included = {f for b in python_blocks() for f in b.snippet_files()}
    assert full in included, "docs/examples/instrument_ddp.py must be included (and so run) by a page"
    code = full.read_text(encoding="utf-8")
    for b in readme:
        if "stragglerwatch.attach(model, optimizer=optimizer)" in b.text:
            for _, line in b.lines:
                assert line.rstrip() in code.splitlines() or not line.strip(), (
                    f"README.md:{b.line}: {line.strip()!r} is not in {rel(full)}: the two examples drifted apart"
                )


def test_every_example_file_is_shown_and_run() -> None:
    """No example file lies in docs/examples/ without a page that includes it (and so a test that runs it)."""
    included = {f for b in python_blocks() if b.fragment is None for f in b.snippet_files()}
    orphans = [rel(f) for f in sorted(EXAMPLES.glob("*.py")) if f not in included]
    assert not orphans, f"example files no page includes: {orphans}"
    assert len(included) >= 8


# --- names of files and modules ------------------------------------------------------------------

#: repository paths the pages name (a file with its extension, or a folder with its slash)
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:stragglerwatch|tests|benchmarks|examples|scripts|dashboard|grafana|docs/examples|\.ci)/[\w./-]*)"
)
#: dotted names under the package (modules, and what they define)
DOTTED = re.compile(r"(?<![\w./-])stragglerwatch((?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"json", "jsonl", "yml", "yaml", "py", "md", "txt", "html", "arrows", "parquet", "pkl"}
NOT_MODULES = {"stragglerwatch.context_version"}  # the context stream's schema metadata key


def top_level_names(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names |= {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return names


def resolves(dotted: str) -> bool:
    """Whether ``stragglerwatch.a.b.name`` is a module of the source tree, or a name one defines."""
    parts, path = dotted.split(".")[1:], ROOT / "stragglerwatch"
    while parts and ((path / parts[0]).is_dir() or (path / f"{parts[0]}.py").is_file()):
        path = path / parts[0] if (path / parts[0]).is_dir() else path / f"{parts.pop(0)}.py"
        if path.is_dir():
            parts.pop(0)
    if not parts:
        return True
    module = path / "__init__.py" if path.is_dir() else path
    return module.is_file() and parts[0] in top_level_names(module)


def test_files_and_modules_the_pages_name_exist() -> None:
    """Every repository file or folder, and every ``stragglerwatch.*`` module or name, that a page
    names exists: a file moved or a module renamed fails here, not in a reader's terminal."""
    problems = []
    for page in pages():
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets: the site build checks those
            for m in REPO_PATH.finditer(line):
                name = m.group(1).rstrip(".")
                if "NAME" in name or "NNNNN" in name:
                    continue  # a placeholder
                last = name.rstrip("/").rsplit("/", 1)[-1]
                if "." not in last and not name.endswith("/"):
                    continue  # not a file name (a metric such as stragglerwatch/busy_share)
                if not (ROOT / name).exists():
                    problems.append(f"{rel(page)}:{n}: {name} does not exist")
            for m in DOTTED.finditer(line):
                dotted = "stragglerwatch" + m.group(1)
                if dotted in NOT_MODULES or dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                    continue
                if not resolves(dotted):
                    problems.append(f"{rel(page)}:{n}: {dotted} is no module or name of the package")
    assert not problems, "\n".join(problems)


def test_the_readme_keeps_the_test_command() -> None:
    """CI runs the README's test command: it stays in a shell block, as written."""
    shell = [text.strip() for b in blocks(ROOT / "README.md") if b.lang in SHELL_LANGS for _, text in b.lines]
    assert "bash scripts/test.sh" in shell
    assert "bash scripts/demo.sh" in shell
    assert "bash scripts/test.sh --full" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert all((ROOT / "scripts" / s).is_file() for s in ("test.sh", "demo.sh", "setup.sh"))


def github_anchors(page: Path) -> set[str]:
    """The anchors of a page's headings as GitHub makes them (and the site: mkdocs.yml's toc slugify)."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"[`*_]|<[^>]+>", "", re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", m.group(1))).lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text)))
    return anchors


def test_readme_links_resolve() -> None:
    """The site build checks the pages' links; the README is not part of the site, so here: every
    relative link of it points at a file that exists, and at a heading that exists."""
    readme = ROOT / "README.md"
    links = re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8"))
    problems = []
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else readme
        if not target.exists():
            problems.append(f"README.md: {link}: {path} does not exist")
        elif anchor and anchor not in github_anchors(target):
            problems.append(f"README.md: {link}: no heading of {path or 'README.md'} has the anchor #{anchor}")
    assert not problems, "\n".join(problems)
    assert len(links) >= 10


# --- command lines ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``stragglerwatch`` command's own parser (``stragglerwatch.cli.commands.build_parser``)."""
    for module in ("stragglerwatch.cli.commands", "stragglerwatch.cli.main", "stragglerwatch.cli"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                found = importlib.import_module(module)
                return found.build_parser()
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no build_parser() in stragglerwatch.cli")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def command_lines() -> list[tuple[str, str]]:
    """``(where, command line)`` of every stragglerwatch command in the pages' shell blocks, with
    backslash continuations joined."""
    out = []
    for b in all_blocks():
        if b.lang not in SHELL_LANGS:
            continue
        pending, start = "", 0
        for n, text in b.lines:
            if not pending:
                start = n
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            line, pending = (pending + text).strip(), ""
            line = re.sub(r"^\$\s+", "", line)
            line = re.sub(r"^(?:[A-Za-z_][A-Za-z0-9_]*=(?:'[^']*'|\"[^\"]*\"|\S*)\s+)+", "", line)
            if any(line == p or line.startswith(p + " ") for p in COMMAND_PREFIXES):
                out.append((f"{rel(b.page)}:{start}", line))
    return out


def arguments(line: str) -> list[str]:
    """The command's arguments: the words after ``stragglerwatch``, up to a pipe or redirection."""
    words = shlex.split(line, comments=True)
    words = words[words.index(next(w for w in words if w.endswith("stragglerwatch"))) + 1 :]
    for i, w in enumerate(words):
        if w in SHELL_OPERATORS or re.match(r"^\d*>", w) or w.startswith(("|", ">", "<")):
            return words[:i]
    return words


def test_command_lines_parse() -> None:
    parser = build_parser()
    failures, skipped = [], []
    lines = command_lines()
    for where, line in lines:
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                parser.parse_args(arguments(line))
        except SystemExit as exc:
            if exc.code not in (0, None):  # --help and --version exit 0
                if "$" in line:
                    skipped.append(where)  # a shell variable the parser cannot see through
                    continue
                message = err.getvalue().strip().splitlines()[-1:] or ["exit status " + str(exc.code)]
                failures.append(f"{where}: {line}\n    {message[0]}")
    print(f"\ndocs: {len(lines)} command lines parsed, {len(skipped)} with shell variables skipped: {skipped}")
    assert not failures, "command lines the stragglerwatch parser refuses:\n" + "\n".join(failures)
    assert len(lines) >= 15, f"the collector found only {len(lines)} command lines: is it still reading the pages?"
    assert len(skipped) <= 3, f"too many command lines skipped for shell variables: {skipped}"


def synopses() -> dict[str, tuple[str, set[str]]]:
    """The command-line synopsis (``docs/analysis.md``): per subcommand, where, and the options named."""
    out: dict[str, tuple[str, set[str]]] = {}
    page = DOCS / "analysis.md"
    for b in blocks(page):
        if b.lang not in ("", "text"):
            continue
        current = None
        for n, text in b.lines:
            if text.startswith("stragglerwatch "):
                words = text.split()
                current = words[1] if not words[1].startswith("-") else "<top>"
                out.setdefault(current, (f"{rel(page)}:{n}", set()))
            elif not text.startswith(" "):
                current = None
            if current is not None:
                out[current][1].update(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", text))
    return out


def test_synopsis_matches_the_parser() -> None:
    """Every option of the synopsis exists, and every option that exists is in the synopsis."""
    parser = build_parser()
    subs = subparsers(parser)
    written = synopses()
    assert set(subs) <= set(written), f"commands without a synopsis in docs/analysis.md: {set(subs) - set(written)}"
    problems = []
    for name, (where, options) in written.items():
        target = parser if name == "<top>" else subs.get(name)
        if target is None:
            problems.append(f"{where}: no command {name!r}")
            continue
        real = {s for a in target._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
        if name == "<top>":
            real &= options  # the top line shows only --version
        problems += [f"{where}: {name} has no option {o}" for o in sorted(options - real)]
        problems += [f"{where}: {name}'s option {o} is missing from the synopsis" for o in sorted(real - options)]
    assert not problems, "\n".join(problems)


# --- the site -----------------------------------------------------------------------------------


def mkdocs_missing() -> list[str]:
    wanted = {"mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings": "mkdocstrings-python",
              "mkdocstrings_handlers": "mkdocstrings-python"}  # fmt: skip
    return sorted({dist for module, dist in wanted.items() if importlib.util.find_spec(module) is None})


@pytest.mark.full
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    missing = mkdocs_missing()
    if missing:
        reason = f"NOT TESTED: the documentation build needs {', '.join(missing)}: pip install -e '.[dev]'"
        if os.environ.get("STRAGGLERWATCH_REQUIRE_ALL") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    for page in sorted(DOCS.rglob("*.md")):
        path = page.relative_to(DOCS).with_suffix("")
        html = site / ("index.html" if path.name == "index" and path.parent == Path(".") else
                       (path.parent if path.name == "index" else path) / "index.html")  # fmt: skip
        assert html.is_file(), f"{rel(page)} was not built"
    reference = (site / "reference" / "watch" / "index.html").read_text(encoding="utf-8")
    assert 'id="stragglerwatch.runtime.watch.attach"' in reference, "the API reference was not rendered"
    assert ":class:" not in reference, "a Sphinx role was left as written"
    instrumenting = (site / "instrumenting" / "index.html").read_text(encoding="utf-8")
    assert "init_process_group" in instrumenting, "the example file was not included"
    assert "8&lt;" not in instrumenting and "[start:" not in (site / "frameworks" / "index.html").read_text(
        encoding="utf-8"
    ), "a snippet directive or section marker was left in a page"
