"""The README and the documentation site (``docs/``, ``mkdocs.yml``) against the code they describe.

* The README stays a short entry page (at most 8 KB) whose first two commands are the newcomer's and the
  test command ``.ci/run`` runs; its quickstart is the quickstart page's script, run below.
* Every fenced block of the quickstart and Horovod migration pages runs, as the page's ``docs-test``
  markers say, and prints the lines the page shows.
* The generated references (``docs/_hooks/generate.py``) cover every setting, flag and counter; each
  setting's documented default is the one its read sites pass.
* The nav lists every page, the design page names every import-linter contract, and CONTRIBUTING.md's
  index names tests for every module.

The site itself is built with ``mkdocs build --strict`` by CI's docs step, which needs the ``docs`` extra;
nothing here imports MkDocs.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.steps import require_step
from tests.harness import PYTHON, ROOT, run

DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_BYTES = 8 * 1024
RUNNABLE_PAGES = ("quickstart.md", "migrating.md")
# settings whose default the code computes at the read site (from the host or another setting): the
# declaration's default text describes the rule, so there is no single value to compare
COMPUTED_DEFAULTS = {"GPUCOMM_SPIN_US", "GPUCOMM_LIVENESS_TIMEOUT"}


def generator():
    """docs/_hooks/generate.py, the MkDocs hook, as a module."""
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "_hooks" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- the README


@dataclass
class Block:
    """One fenced block of a Markdown page: its language, its text, and the docs-test marker before it."""

    lang: str
    text: str
    marker: str | None
    line: int


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


def blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown``, each with the ``<!-- docs-test: ... -->`` marker on the
    line right before it (None when there is none)."""
    out = []
    for m in FENCE.finditer(markdown):
        before = markdown[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        out.append(Block(m[1], m[2], marker[1] if marker else None, markdown.count("\n", 0, m.start()) + 1))
    return out


def ci_test_command() -> str:
    """The install-and-test line .ci/run runs."""
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.startswith("python3 -m venv .venv ") and "-m pytest" in ln]
    assert len(lines) == 1, f".ci/run should run one install-and-test line, found {len(lines)}"
    return lines[0].split(" || ")[0]  # .ci/run appends "|| exit 1" (set -e does not stop inside an && chain)


def test_the_readme_is_at_most_8_kb():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move depth to docs/"


def test_the_readme_opens_with_the_newcomer_command_then_ci_s_test_command():
    bash = [b for b in blocks(README.read_text())]
    assert [b.lang for b in bash[:2]] == ["bash", "bash"], "the README's first two blocks are its two commands"
    newcomer, tests = (b.text.strip() for b in bash[:2])
    assert "\n" not in newcomer and "\n" not in tests, "each of the two commands is one line, to paste"
    assert tests == ci_test_command(), "the README's test command must be the one .ci/run runs"
    assert tests in (ROOT / "CONTRIBUTING.md").read_text(), "CONTRIBUTING.md shows the same test command"
    prefix = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && "
    assert newcomer.startswith(prefix) and tests.startswith(prefix), "both start from the same venv and torch"
    assert newcomer.endswith(".venv/bin/gpucomm-run -np 2 .venv/bin/python examples/train_digits.py")
    assert (ROOT / "examples" / "train_digits.py").is_file()
    assert newcomer in (DOCS / "install.md").read_text(), "the install page shows the newcomer command as it is"


def test_the_readme_quickstart_is_the_script_the_quickstart_page_runs():
    readme = [b.text for b in blocks(README.read_text()) if b.lang == "python"]
    page = [b.text for b in blocks((DOCS / "quickstart.md").read_text()) if b.marker == "file train.py"]
    assert len(readme) == 1 and len(page) == 1
    assert readme[0] == page[0], "README.md's quickstart must be docs/quickstart.md's train.py (which the test runs)"
    code = [line for line in readme[0].splitlines() if line.strip()]
    assert len(code) <= 10, f"the quickstart is a ten-line script; it has {len(code)} lines of code"
    assert "gpucomm-run -np 2 python train.py" in README.read_text()


def test_the_readme_and_contributing_links_resolve():
    for doc in (README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"


def test_the_supported_torch_range_is_the_one_ci_tests():
    low, high = re.search(r'^\s*"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text(), re.M).groups()
    steps = dict(re.findall(r"^torch_range_step (\w+) [\d.]+ ([\d.]+)", (ROOT / ".ci" / "run").read_text(), re.M))
    claim = f"torch {steps['oldest']}–{steps['newest']}"
    for doc in (README, DOCS / "install.md"):
        assert claim in doc.read_text(), f"{doc.name} should state the range CI tests: {claim}"
        assert f"torch>={low},<{high}" in doc.read_text()


# ----------------------------------------------------------------------------- runnable documentation


def substitute(line: str) -> tuple[list[str], dict[str, str]]:
    """A launch line of the docs as this environment runs it: leading ``NAME=value`` words become the
    environment; ``python``, ``gpucomm-run`` and ``torchrun`` become this interpreter's."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    programs = {"python": [PYTHON], "gpucomm-run": [PYTHON, "-m", "gpucomm.runner"],
                "torchrun": [PYTHON, "-m", "torch.distributed.run"]}
    return [part for w in words for part in programs.get(w, [w])], env


def masked(text: str) -> str:
    return re.sub(r"\d+(?:\.\d+)?", "N", text)


def check_output(expected: str, output: str, numbers_vary: bool) -> list[str]:
    """The lines of ``expected`` that ``output`` lacks (in any order; with every number masked when
    ``numbers_vary``). Each is looked for as text, not as a whole line: ranks that share a pipe (torchrun's
    children) may write one line's text and another's before either newline."""
    want = [ln.strip() for ln in expected.splitlines() if ln.strip()]
    if numbers_vary:
        have = masked(output)
        return [ln for ln in want if masked(ln) not in have]
    return [ln for ln in want if ln not in output]


def plan(page: Path) -> list[Block]:
    """The page's blocks, each with a marker this test knows."""
    found = blocks(page.read_text())
    unknown = [f"{page.name}:{b.line} ({b.lang}): {b.marker!r}" for b in found
               if b.marker is None or not re.fullmatch(r"file [\w.]+|run|output|output, numbers vary", b.marker)]
    assert not unknown, ("every fenced block of this page must say how it runs, with a <!-- docs-test: file NAME | "
                         "run | output | output, numbers vary --> line right before it: " + "; ".join(unknown))
    return found


def test_a_block_without_a_marker_is_refused(tmp_path):
    page = "# t\n\n<!-- docs-test: run -->\n```bash\npython -V\n```\n\n```python\nprint(1)\n```\n"
    (tmp_path / "page.md").write_text(page)
    with pytest.raises(AssertionError, match=r"page.md:8 \(python\): None"):
        plan(tmp_path / "page.md")
    assert check_output("[0]<stdout>:loss 0.5", "[0]<stdout>:loss 0.7\n", numbers_vary=True) == []
    assert check_output("[0]<stdout>:loss 0.5", "[0]<stdout>:loss 0.7\n", numbers_vary=False) != []
    assert substitute("GPUCOMM_TIMELINE=t.json gpucomm-run -np 2 python x.py  # note") == (
        [PYTHON, "-m", "gpucomm.runner", "-np", "2", PYTHON, "x.py"], {"GPUCOMM_TIMELINE": "t.json"})


@pytest.mark.e2e
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_every_block_of_the_page_runs_as_shown(page, tmp_path, request):
    require_step(request.config, "e2e")
    last = None
    ran = 0
    for block in plan(DOCS / page):
        where = f"{page}:{block.line}"
        if block.marker.startswith("file "):
            (tmp_path / block.marker.split(" ", 1)[1]).write_text(block.text)
        elif block.marker == "run":
            for line in (ln for ln in block.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")):
                cmd, env = substitute(line)
                last = run(cmd, cwd=tmp_path, env=env, timeout=180)
                output = last.stdout + last.stderr
                assert last.returncode == 0, f"{where}: `{line}` exited {last.returncode}:\n{output[-3000:]}"
                assert not last.leftovers, f"{where}: `{line}` left processes behind: {last.leftovers}"
                ran += 1
        else:
            assert last is not None, f"{where}: an output block with no command before it"
            missing = check_output(block.text, last.stdout + last.stderr, block.marker.endswith("numbers vary"))
            assert not missing, f"{where}: the output lacks {missing}; it was:\n{(last.stdout + last.stderr)[-3000:]}"
    assert ran >= 2, f"{page} should show at least two commands that run"


# ------------------------------------------------------------------------------- generated references


def _where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _module_of(path: Path) -> str:
    if not path.is_relative_to(ROOT):
        return path.stem
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _absolute(module: str, level: int, name: str | None, path: Path) -> str:
    """The absolute module an ``from ...name import`` in ``path`` names."""
    if not level:
        return name or ""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - level + 1]
    return ".".join(package + ([name] if name else []))


class Unresolved(Exception):
    """A read site's default that is an expression computed at run time."""


def constant(expr: ast.expr, path: Path, seen: frozenset = frozenset()) -> object:
    """The value of ``expr`` in module ``path`` when it is a literal, arithmetic on literals, or a
    module-level name bound to one (followed through ``from ... import``)."""
    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub):
        return -constant(expr.operand, path, seen)
    if isinstance(expr, ast.BinOp):
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b, ast.LShift: lambda a, b: a << b, ast.Pow: lambda a, b: a ** b}
        if type(expr.op) in ops:
            return ops[type(expr.op)](constant(expr.left, path, seen), constant(expr.right, path, seen))
    if isinstance(expr, ast.Name) and (path, expr.id) not in seen:
        seen = seen | {(path, expr.id)}
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == expr.id for t in targets):
                    return constant(node.value, path, seen)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == expr.id:
                        source = _file_of(_absolute(_module_of(path), node.level, node.module, path))
                        if source is not None:
                            return constant(ast.Name(alias.name), source, seen)
    raise Unresolved(ast.unparse(expr))


def shown(value: object) -> str:
    """A default as the settings page writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def read_site_defaults(files: list[Path]) -> tuple[list[tuple[str, str, str]], set[str]]:
    """Every ``SETTING.read(env, default)`` in ``files``: (setting's first name, the default shown,
    where), and the settings whose default there is computed."""
    from gpucomm import settings

    declared = {name: value for name, value in vars(settings).items() if isinstance(value, settings.Setting)}
    found, computed = [], set()
    for path in files:
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and (node.module or "").endswith("settings") for a in node.names}
        aliases.update({name: name for name in declared} if _module_of(path) == "gpucomm.settings" else {})
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "read"):
                continue
            owner = node.func.value
            name = aliases.get(owner.id) if isinstance(owner, ast.Name) else (
                owner.attr if isinstance(owner, ast.Attribute) and owner.attr in declared else None)
            if name not in declared:
                continue
            default = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "default"), None)
            if default is None or (isinstance(default, ast.Constant) and default.value is None):
                continue  # no default at this site: the caller decides what unset means
            setting = declared[name].names[0]
            try:
                found.append((setting, shown(constant(default, path)), f"{_where(path)}:{node.lineno}"))
            except Unresolved:
                computed.add(setting)
    return found, computed


def test_each_setting_s_documented_default_is_the_one_the_code_reads():
    from gpucomm import settings

    found, computed = read_site_defaults(sorted((ROOT / "gpucomm").rglob("*.py")))
    documented = {s.names[0]: s.default for s in settings.SETTINGS}
    wrong = [f"{where}: {name} defaults to {value}, the declaration says {documented[name]!r}"
             for name, value, where in found if documented[name].split(" (")[0] != value]
    assert not wrong, wrong
    assert computed == COMPUTED_DEFAULTS, "a read site's default became (or stopped being) computed at run time"
    assert len({name for name, _, _ in found}) >= 25, "the scan found too few read sites: is it still reading them?"
    assert all(s.help and s.help.endswith(".") for s in settings.SETTINGS), "every setting says what it does"


def test_the_default_check_catches_a_drifted_default(tmp_path):
    """A default written at a read site is followed through names and imports, and compared."""
    module = tmp_path / "probe.py"
    module.write_text("from gpucomm.settings import TIMEOUT, FUSION_THRESHOLD as CAP, SPIN_US\n"
                      "from gpucomm.dataplane.fusion import DEFAULT_BUCKET_CAP_BYTES\nLIMIT = 1 << 3\n\n"
                      "def f(env, n):\n"
                      "    return (TIMEOUT.read(env, LIMIT * 2.0), CAP.read(env, DEFAULT_BUCKET_CAP_BYTES),\n"
                      "            SPIN_US.read(env, n + 1))\n")
    found, computed = read_site_defaults([module])
    assert found == [("GPUCOMM_TIMEOUT", "16", "probe.py:6"), ("GPUCOMM_FUSION_THRESHOLD", "26214400", "probe.py:6")]
    assert computed == {"GPUCOMM_SPIN_US"}
    documented = {s.names[0]: s.default for s in __import__("gpucomm.settings").settings.SETTINGS}
    assert documented["GPUCOMM_TIMEOUT"].split(" (")[0] != "16", "the drifted default would be reported"


def test_the_generated_references_cover_every_setting_flag_and_counter():
    from gpucomm import counters, settings
    from gpucomm.runner.cli import build_parser

    gen = generator()
    page = gen.settings_page()
    for s in settings.SETTINGS:
        assert f"## `{s.names[0]}`" in page and s.help in page and s.accepted in page
        assert all(f"`{n}`" in page for n in s.names)
    cli = gen.cli_page()
    flags = [f for a in build_parser()._actions for f in a.option_strings]
    assert flags and all(f"`{f}" in cli for f in flags), [f for f in flags if f"`{f}" not in cli]
    assert "%(" not in cli and sys.executable not in cli, "argparse placeholders expanded, no machine's paths"
    counted = gen.counters_page()
    assert all(f"| `{f}` |" in counted for f in counters.Counters.__dataclass_fields__)


# ----------------------------------------------------------------------------------- site structure


def nav_pages(nav: list) -> list[str]:
    out = []
    for item in nav:
        value = item if isinstance(item, str) else next(iter(item.values()))
        out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_nav_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    written = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_hooks" not in p.parts}
    generated = set(generator().generated_pages())
    assert written <= set(listed), f"pages missing from mkdocs.yml's nav: {sorted(written - set(listed))}"
    assert set(listed) <= written | generated, f"nav entries with no page: {sorted(set(listed) - written - generated)}"
    assert len(listed) == len(set(listed))


def test_the_design_page_and_contributing_name_every_import_contract():
    ids = re.findall(r'^id = "([\w-]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert ids, "pyproject.toml holds the import-linter contracts"
    for doc in (DOCS / "design.md", ROOT / "CONTRIBUTING.md"):
        text = doc.read_text()
        assert all(f"`{i}`" in text for i in ids), (doc.name, [i for i in ids if f"`{i}`" not in text])


def contributing_index() -> list[tuple[list[str], list[str]]]:
    """CONTRIBUTING.md's module-to-tests table: (module paths, test paths) per row."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## Where each module's tests are", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `gpucomm") and len(cells) == 2:
            rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1])))
    return rows


def test_contributing_names_the_tests_of_every_module():
    rows = contributing_index()
    listed = [m for modules, _ in rows for m in modules]
    for path in listed + [t for _, tests in rows for t in tests]:
        assert (ROOT / path).exists(), f"CONTRIBUTING.md names {path}, which does not exist"
    assert all(tests for _, tests in rows), "every row names at least one test file"
    folders = [m for m in listed if m.endswith("/")]
    uncovered = []
    for path in sorted((ROOT / "gpucomm").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in listed or any(rel.startswith(f) for f in folders):
            continue
        if path.name == "__init__.py" and any(m.startswith(rel[:-len("__init__.py")]) for m in listed):
            continue  # a package's __init__ goes with its modules
        uncovered.append(rel)
    assert not uncovered, f"add these modules, with their tests, to CONTRIBUTING.md's index: {uncovered}"


# ------------------------------------------------------------------------------------------- the tests

CLOCKS = {"monotonic", "time", "perf_counter", "monotonic_ns", "perf_counter_ns", "time_ns"}
DURATION_NAMES = {"elapsed", "seconds", "duration", "took", "wall_s", "exited_after"}


def duration_asserts(source: str) -> list[int]:
    """The lines of ``source`` whose ``assert`` orders a measured duration: a difference of clock
    readings (``time.monotonic() - t0 < 5``) or a value named like one (``res.seconds < 60``). A wait's
    deadline (``time.monotonic() < deadline``) is not a duration and is allowed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            if not any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in cmp.ops):
                continue
            for side in [cmp.left, *cmp.comparators]:
                names = {n.id for n in ast.walk(side) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(side) if isinstance(n, ast.Attribute)}
                clock_difference = isinstance(side, ast.BinOp) and isinstance(side.op, ast.Sub) and any(
                    isinstance(c, ast.Call) and getattr(c.func, "attr", getattr(c.func, "id", "")) in CLOCKS
                    for c in ast.walk(side))
                if clock_difference or names & DURATION_NAMES:
                    found.append(node.lineno)
    return sorted(set(found))


def test_no_test_asserts_on_a_measured_duration():
    """A 2-core CI machine shared with other jobs makes any bound on a measured time flaky: tests assert
    causes (which error, which detector, which counter) and leave speed to the benchmarks."""
    offenders = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        lines = duration_asserts(path.read_text())
        if lines:
            offenders[path.relative_to(ROOT).as_posix()] = lines
    assert not offenders, f"these asserts bound a measured duration; assert the cause instead: {offenders}"


def test_the_duration_check_catches_a_bound_on_a_measured_time():
    source = ("import time\nt0 = time.monotonic()\nassert time.monotonic() - t0 < 5\n"
              "assert res.seconds < 60, res.seconds\nassert 0.1 < time.perf_counter() - t0\n"
              "while time.monotonic() < deadline:\n    pass\nassert time.monotonic() < deadline\n")
    assert duration_asserts(source) == [3, 4, 5]
