"""MkDocs hook: the pages generated from the code and the repository at build time, so they cannot drift.

* ``reference/settings.md`` from the declarations in ``gpucomm/settings.py`` (``SETTINGS``);
* ``reference/cli.md`` from ``gpucomm.runner.cli.build_parser()`` (argparse's own help);
* ``reference/counters.md`` from the fields of ``gpucomm.counters.Counters`` and their comments;
* ``repo/<path>``: the repository's Markdown outside ``docs/`` that the pages link to (``REPO_PAGES``:
  CONTRIBUTING.md, CHANGELOG.md, the launch recipes' READMEs and every ``benchmarks/results/``
  write-up), copied as they are (``<details>`` blocks marked for Markdown inside), plus
  ``repo/benchmarks/results/index.md``, which lists the result folders.

The generators are plain functions of the code (no MkDocs import), so ``tests/test_docs.py`` checks
what they write without building the site.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # mkdocs may run from a venv where gpucomm is not installed editable
    sys.path.insert(0, str(ROOT))

# Markdown outside docs/ that the site carries (globs relative to the repository root)
REPO_PAGES = ("CONTRIBUTING.md", "CHANGELOG.md", "launch/README.md", "launch/kubernetes/README.md",
              "benchmarks/results/README.md", "benchmarks/results/*/*.md")


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def settings_page() -> str:
    """The settings reference: one section per declaration of ``gpucomm.settings.SETTINGS``."""
    from gpucomm import settings

    lines = [
        "# Settings",
        "",
        "<!-- Generated from gpucomm/settings.py by docs/_hooks/generate.py: edit the declarations there. -->",
        "",
        "Every environment variable that tunes gpucomm is declared once, with its range, in `gpucomm/settings.py`, and "
        "read through that declaration. This page is generated from those declarations when the site is built.",
        "",
        "- **Names.** The first of a setting's names set to a non-blank value wins: `GPUCOMM_*` before Horovod's "
        "`HOROVOD_*`.",
        "- **Values.** A value that does not parse is an error naming the variable, its value and what it accepts: "
        "garbage, NaN, infinity, a fraction where a whole number is meant, or a value out of range. Flags take "
        f"{settings._FLAG_WORDS}, in any case. Durations are at most {settings._show(settings.MAX_SECONDS)} s.",
        "- **Checked at the start.** `gpucomm-run` checks every setting the ranks would get before it starts one "
        "(one `gpucomm-run: ...` line, exit status 2). Every rank checks them all at `init()`, so ranks that share an "
        "environment fail alike, at once.",
        "- **Launcher variables are not settings.** The variables a launcher sets to place a rank are read by "
        "`gpucomm/bootstrap/world.py` and described under [Launching](../guide/launching.md#how-a-rank-finds-its-job). "
        "They cover the rank, the size, the rendezvous address and port, the job secret and the run id.",
        "",
        "| setting | kind | default |",
        "|---|---|---|",
    ]
    for s in settings.SETTINGS:
        anchor = s.names[0].lower()
        lines.append(f"| [`{s.names[0]}`](#{anchor}) | {s.kind} | {_cell(s.default) or '—'} |")
    for s in settings.SETTINGS:
        lines += ["", f"## `{s.names[0]}`", "", s.help, ""]
        if len(s.names) > 1:
            lines.append("- **Also read as:** " + ", ".join(f"`{n}`" for n in s.names[1:]))
        lines.append(f"- **Kind:** {s.kind}; accepts {s.accepted}")
        lines.append(f"- **Default:** {s.default or 'unset (nothing)'}")
    return "\n".join(lines) + "\n"


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    value = ""
    if action.nargs != 0:
        metavar = action.metavar
        if metavar is None:
            metavar = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
        value = " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
        if action.nargs == "?":
            value = f" [{value.strip()}]"
    return ", ".join(f"`{flag}{value}`" for flag in action.option_strings)


def _help(action: argparse.Action, prog: str) -> str:
    """An action's help with argparse's ``%(...)s`` expanded; the launcher's own interpreter path is
    named in words, since it differs on every machine."""
    params: dict[str, Any] = dict(vars(action), prog=prog)
    if params.get("default") == sys.executable:
        params["default"] = "sys.executable"
    for name, value in list(params.items()):
        if value is argparse.SUPPRESS:
            del params[name]
        elif hasattr(value, "__name__"):
            params[name] = value.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    if not action.help and getattr(action, "advice", ""):  # a refused horovodrun flag says what to do instead
        return f"not offered: {action.advice}"
    return (action.help or "") % params


def cli_page() -> str:
    """The ``gpucomm-run`` reference, from the parser the command itself uses."""
    from gpucomm.runner.cli import build_parser

    parser = build_parser()
    lines = [
        "# gpucomm-run",
        "",
        "<!-- Generated from gpucomm.runner.cli.build_parser() by docs/_hooks/generate.py at build time. -->",
        "",
        f"{parser.description} `python -m gpucomm.runner` is the same command without the console script. "
        "This page is generated from the parser the command uses, so it lists every flag `gpucomm-run --help` "
        "shows. How the flags work together: [Launching](../guide/launching.md).",
        "",
        "```text",
        f"{parser.prog} [flags] COMMAND [ARGS ...]",
        "```",
        "",
        parser.epilog or "",
    ]
    for group in parser._action_groups:  # argparse keeps its groups here; there is no public accessor
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        title = {"positional arguments": "Command", "options": "Options",
                 "optional arguments": "Options"}.get(group.title or "", group.title or "Options")
        lines += ["", f"## {title}", "", "| flag | what it does |", "|---|---|"]
        for action in actions:
            lines.append(f"| {_flags(action)} | {_cell(_help(action, parser.prog))} |")
    return "\n".join(lines) + "\n"


def counters_page() -> str:
    """The ``hvd.stats()`` reference: each field of ``Counters`` with the comment that says what it counts."""
    from gpucomm import counters

    source = Path(counters.__file__).read_text()
    said = dict(re.findall(r"^    (\w+): int = 0\s+# (.*)$", source, re.M))
    names = [f.name for f in dataclasses.fields(counters.Counters)]
    missing = [n for n in names if n not in said]
    if missing:
        raise ValueError(f"gpucomm/counters.py: fields without a comment saying what they count: {missing}")
    lines = [
        "# Counters",
        "",
        "<!-- Generated from gpucomm/counters.py by docs/_hooks/generate.py at build time. -->",
        "",
        "`hvd.stats()` (also `gpucomm.stats()`) returns this process's counts as a dict. `hvd.stats(reset=True)` "
        "returns them and sets them back to zero. Tests and benchmarks read them to prove that a fast path is taken. "
        "In this list, \"... of which\" refers to the counter above it.",
        "",
        "| counter | what it counts |",
        "|---|---|",
    ]
    lines += [f"| `{n}` | {_cell(said[n])} |" for n in names]
    return "\n".join(lines) + "\n"


def repo_pages(root: Path = ROOT) -> dict[str, str]:
    """``{site path: Markdown}`` of the repository pages the site carries (``REPO_PAGES``), with an
    index of the benchmark result folders."""
    pages = {}
    for pattern in REPO_PAGES:
        for path in sorted(root.glob(pattern)):
            # <details> blocks as GitHub shows them: the Markdown inside is rendered (md_in_html)
            text = path.read_text().replace("<details>", '<details markdown="1">')
            pages["repo/" + path.relative_to(root).as_posix()] = text
    results = root / "benchmarks" / "results"
    listing = ["", "## The result folders", ""]
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        files = sorted(p.name for p in folder.glob("*.md"))
        links = ", ".join(f"[{name}]({folder.name}/{name})" for name in files)
        listing.append(f"- `{folder.name}/`: {links or 'data files only (JSON and text)'}")
    readme = pages.pop("repo/benchmarks/results/README.md")
    pages["repo/benchmarks/results/index.md"] = readme + "\n".join(listing) + "\n"
    return pages


def generated_pages() -> dict[str, str]:
    """Every generated page, by its path in the site."""
    return {"reference/settings.md": settings_page(), "reference/cli.md": cli_page(),
            "reference/counters.md": counters_page(), **repo_pages()}


def on_files(files, config):  # noqa: ANN001, ANN201 - MkDocs' hook signature
    """Add the generated pages to the site's files (MkDocs calls this before it builds the nav)."""
    from mkdocs.structure.files import File  # noqa: PLC0415 - only the build needs MkDocs

    for uri, content in generated_pages().items():
        files.append(File.generated(config, uri, content=content))
    return files
