"""The Dockerfile against pyproject.toml and the README, without Docker (it cannot run here).

Checks: an nvidia/cuda 12 or 13 base image; its distribution's Python satisfies ``requires-python``
and can make a venv; the extras it installs exist, include the image's ``cudaNN`` extra and pull no
wheel of the other CUDA major, and the ``test`` extra is among them; torch comes
from the PyTorch index of the image's CUDA version; the install steps are the README's test command
(venv -> torch -> editable install -> the same pytest runs), all through the venv; ``.dockerignore``
keeps ``.venv`` out and what the image needs in; the image fits ``launch/docker-run.sh``.
Each check is a function of the files' text, so the tests at the bottom also break the real Dockerfile
in known ways and see each check catch it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")

ROOT = Path(__file__).resolve().parent.parent

# python3 of the distributions nvidia/cuda images are built on (each distribution's own package)
DISTRO_PYTHON = {"ubuntu20.04": "3.8", "ubuntu22.04": "3.10", "ubuntu24.04": "3.12", "ubi8": "3.6", "ubi9": "3.9",
                 "rockylinux8": "3.6", "rockylinux9": "3.9"}
BASE_IMAGE = re.compile(r"^(?:docker\.io/|nvcr\.io/)?nvidia/cuda:(?P<cuda>\d+\.\d+\.\d+)-(?:cudnn\d*-)?"
                        r"(?P<flavour>base|runtime|devel)-(?P<distro>[a-z]+\d+(?:\.\d+)?)(?:@sha256:[0-9a-f]{64})?$")
CUDA_MAJORS = ("12", "13")  # the cudaNN extras pyproject offers
OTHER_MAJOR = {"12": re.compile(r"cu(?:da)?13"), "13": re.compile(r"cu(?:da)?12")}
NEEDED_IN_IMAGE = ("pyproject.toml", "README.md", "Dockerfile", ".dockerignore", "gpucomm/__init__.py",
                   "tests/test_dockerfile.py", "launch/docker-run.sh", "benchmarks/train.py", "examples/models.py")


# ---------------------------------------------------------------------------------------------- parsing


@dataclass
class Step:
    """One shell command of an install or test sequence, classified."""

    kind: str  # venv | torch | editable | pytest
    exe: str  # the program run (python or pip path)
    tokens: list[str]
    env: dict[str, str] = field(default_factory=dict)


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuations joined, ARG defaults
    substituted (``${NAME}`` and ``$NAME``) as the build would see them."""
    logical, pending = [], ""
    for line in dockerfile.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    out = []
    for text in logical:
        instr, _, rest = text.strip().partition(" ")
        for name, value in args.items():
            rest = rest.replace("${" + name + "}", value)
            rest = re.sub(rf"\${name}\b", value, rest)
        if instr.upper() == "ARG":
            name, _, default = rest.strip().partition("=")
            args[name] = default.strip().strip('"')
        out.append((instr.upper(), rest.strip()))
    return out


def one(dockerfile: str, instr: str) -> str:
    found = [rest for i, rest in instructions(dockerfile) if i == instr]
    assert len(found) == 1, f"expected one {instr} instruction in the Dockerfile, found {len(found)}"
    return found[0]


def shell_of_cmd(rest: str) -> str:
    """CMD in exec form ``["/bin/sh", "-c", "..."]`` or shell form, as one shell command line."""
    if rest.startswith("["):
        argv = json.loads(rest)
        return argv[2] if argv[:2] in (["/bin/sh", "-c"], ["sh", "-c"], ["/bin/bash", "-c"]) else shlex.join(argv)
    return rest


def classify(command: str) -> Step | None:
    """A ``&&``-free shell command as a Step, or None for anything else (apt-get, rm ...)."""
    tokens = shlex.split(command)
    env = {}
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    if not tokens:
        return None
    exe, rest = tokens[0], tokens[1:]
    if re.search(r"python[0-9.]*$", exe) and rest[:2] == ["-m", "venv"]:
        return Step("venv", exe, rest[2:], env)
    if re.search(r"python[0-9.]*$", exe) and rest[:2] == ["-m", "pytest"]:
        return Step("pytest", exe, rest[2:], env)
    if exe.endswith("pip") and rest[:1] == ["install"]:
        if "-e" in rest or "--editable" in rest:
            return Step("editable", exe, rest[1:], env)
        if any(not t.startswith("-") and canonicalize_name(Requirement(t).name) == "torch" for t in rest[1:]
               if re.match(r"[A-Za-z]", t) and not t.startswith("http")):
            return Step("torch", exe, rest[1:], env)
    return None


def steps(commands: list[str]) -> list[Step]:
    out = []
    for command in commands:
        for part in command.split("&&"):
            step = classify(part.strip())
            if step is not None:
                out.append(step)
    return out


def dockerfile_steps(dockerfile: str) -> list[Step]:
    runs = [rest for i, rest in instructions(dockerfile) if i == "RUN"]
    return steps(runs + [shell_of_cmd(one(dockerfile, "CMD"))])


def readme_test_command(readme: str) -> str:
    """The README's install-and-test one-liner (the one .ci/run runs)."""
    lines = [line for line in readme.splitlines() if "-m venv" in line and "-m pytest" in line]
    assert len(lines) == 1, f"expected one install-and-test command in README.md, found {len(lines)}"
    return lines[0]


def editable(dockerfile: str) -> tuple[list[str], list[Requirement]]:
    """The extras of the editable install of '.', and the other requirements the same pip names."""
    found = [s for s in dockerfile_steps(dockerfile) if s.kind == "editable"]
    assert len(found) == 1, f"expected one editable install (pip install -e) in the Dockerfile, found {len(found)}"
    tokens = [t for t in found[0].tokens if not t.startswith("-")]
    project = [t for t in tokens if re.fullmatch(r"\.(\[.*\])?", t)]
    assert len(project) == 1, f"the editable install must name the project '.' once: {tokens}"
    extras = [e.strip() for e in project[0][2:-1].split(",") if e.strip()] if "[" in project[0] else []
    return extras, [Requirement(t) for t in tokens if t not in project]


def base_image(dockerfile: str) -> re.Match | None:
    return BASE_IMAGE.match(one(dockerfile, "FROM").split()[0])


def apt_packages(dockerfile: str) -> set[str]:
    packages = set()
    for i, rest in instructions(dockerfile):
        for part in rest.split("&&") if i == "RUN" else []:
            tokens = shlex.split(part)
            if tokens[:2] in (["apt-get", "install"], ["apt", "install"]):
                packages |= {t.split("=")[0] for t in tokens[2:] if not t.startswith("-")}
    return packages


def dockerignore_excludes(patterns: str, path: str) -> bool:
    """Whether Docker leaves ``path`` out of the build context: the last matching pattern wins, ``!``
    re-includes, a pattern that matches a folder covers what is inside it."""
    excluded = False
    for raw in patterns.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


# ---------------------------------------------------------------------------------------------- checks


def check_base_image(dockerfile: str) -> list[str]:
    m = base_image(dockerfile)
    if m is None:
        return [f"FROM {one(dockerfile, 'FROM')!r} is not an official nvidia/cuda:X.Y.Z-[cudnn-]FLAVOUR-DISTRO image"]
    problems = []
    if m["cuda"].split(".")[0] not in CUDA_MAJORS:
        problems.append(f"base image is CUDA {m['cuda']}; gpucomm has extras for CUDA {' and '.join(CUDA_MAJORS)} only")
    if m["flavour"] == "base":
        problems.append("the 'base' flavour lacks the CUDA runtime libraries: use runtime or devel")
    return problems


def check_python(dockerfile: str, pyproject: dict) -> list[str]:
    m = base_image(dockerfile)
    venvs = [s for s in dockerfile_steps(dockerfile) if s.kind == "venv"]
    if m is None or not venvs:
        return ["no nvidia/cuda base image or no venv step: cannot tell which Python the image runs"]
    interpreter = venvs[0].exe.rsplit("/", 1)[-1]
    packages = apt_packages(dockerfile)
    if interpreter == "python3":
        version = DISTRO_PYTHON.get(m["distro"])
        if version is None:
            return [f"unknown distribution {m['distro']!r}: add its python3 version to DISTRO_PYTHON"]
    else:
        version = interpreter.removeprefix("python")
    problems = []
    if interpreter not in packages:
        problems.append(f"the venv is made with {interpreter}, but apt-get does not install {interpreter}")
    if f"{interpreter}-venv" not in packages and m["distro"].startswith("ubuntu"):
        problems.append(f"{interpreter} -m venv needs the {interpreter}-venv package on Ubuntu (ensurepip)")
    wanted = SpecifierSet(pyproject["project"]["requires-python"])
    if version not in wanted:
        problems.append(f"the image's Python is {version} ({m['distro']}), pyproject requires-python {wanted}")
    return problems


def check_extras(dockerfile: str, pyproject: dict) -> list[str]:
    optional = pyproject["project"]["optional-dependencies"]
    extras, named = editable(dockerfile)
    problems = [f"extra {e!r} is not in pyproject's optional-dependencies ({', '.join(optional)})"
                for e in extras if e not in optional]
    m = base_image(dockerfile)
    major = m["cuda"].split(".")[0] if m is not None else "12"
    if f"cuda{major}" not in extras:
        problems.append(f"the editable install's extras {extras} do not include cuda{major} (the image is CUDA {major})")
    installed = named + [Requirement(r) for e in extras if e in optional for r in optional[e]]
    other = OTHER_MAJOR.get(major)
    problems += [f"{r} is a package of another CUDA major in a CUDA {major} image (from the extras or named beside "
                 f"them)" for r in installed if other is not None and other.search(str(r))]
    if "test" not in extras:
        problems.append(f"the editable install's extras {extras} do not include the test extra, which the "
                        f"image's default command (the test suite) needs")
    return problems


def check_torch(dockerfile: str) -> list[str]:
    m = base_image(dockerfile)
    found = [s for s in dockerfile_steps(dockerfile) if s.kind == "torch"]
    if len(found) != 1 or m is None:
        return [f"expected one `pip install torch` step on an nvidia/cuda image, found {len(found)}"]
    tokens = found[0].tokens
    urls = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t in ("--index-url", "--extra-index-url", "-i")]
    major, minor, _ = m["cuda"].split(".")
    wanted = f"https://download.pytorch.org/whl/cu{major}{minor}"
    if [u.rstrip("/") for u in urls] != [wanted]:
        return [f"torch must come from {wanted} (CUDA {major}.{minor}, the image's); the step names {urls}"]
    if any("+cpu" in t for t in tokens):
        return [f"the torch step asks for a CPU build: {tokens}"]
    return []


def check_sequence(dockerfile: str, readme: str) -> list[str]:
    ours, theirs = dockerfile_steps(dockerfile), steps([readme_test_command(readme)])
    kinds = ([s.kind for s in ours], [s.kind for s in theirs])
    if kinds[0] != kinds[1]:
        return [f"the Dockerfile's steps {kinds[0]} differ from the README's test command {kinds[1]}"]
    problems = []
    for image, doc in zip(ours, theirs):
        if image.kind == "pytest" and (image.tokens, image.env) != (doc.tokens, doc.env):
            problems.append(f"pytest run {image.env} {image.tokens} differs from the README's {doc.env} {doc.tokens}")
    for where, seq in (("Dockerfile", ours), ("README", theirs)):
        venv = seq[0].tokens[0].rstrip("/")
        problems += [f"{where}: {s.kind} step runs {s.exe}, not the venv's ({venv}/bin/)"
                     for s in seq[1:] if not s.exe.startswith(f"{venv}/bin/")]
    return problems


def check_dockerignore(dockerignore: str) -> list[str]:
    problems = [] if dockerignore_excludes(dockerignore, ".venv") else [".dockerignore does not exclude .venv"]
    problems += [f".dockerignore excludes {p}, which the image needs" for p in NEEDED_IN_IMAGE
                 if dockerignore_excludes(dockerignore, p)]
    return problems


def check_docker_run_recipe(dockerfile: str, recipe: str) -> list[str]:
    """launch/docker-run.sh runs ``gpucomm-run`` by name in ``-w DIR``: the venv must be on PATH."""
    problems = []
    workdir = re.search(r"-w\s+(\S+)", recipe)
    if workdir and workdir[1] != one(dockerfile, "WORKDIR"):
        problems.append(f"WORKDIR {one(dockerfile, 'WORKDIR')} differs from docker-run.sh's -w {workdir[1]}")
    venv = next((s.tokens[0] for s in dockerfile_steps(dockerfile) if s.kind == "venv"), None)
    env = " ".join(rest for i, rest in instructions(dockerfile) if i == "ENV")
    if venv is None or not re.search(rf"PATH={re.escape(venv)}/bin:", env):
        problems.append(f"ENV PATH does not start with the venv's bin ({venv}/bin), so gpucomm-run is not found")
    return problems


# ---------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def files() -> dict:
    return {"dockerfile": (ROOT / "Dockerfile").read_text(), "readme": (ROOT / "README.md").read_text(),
            "pyproject": tomllib.loads((ROOT / "pyproject.toml").read_text()),
            "dockerignore": (ROOT / ".dockerignore").read_text(),
            "recipe": (ROOT / "launch" / "docker-run.sh").read_text()}


def run_check(name: str, f: dict) -> list[str]:
    d = f["dockerfile"]
    return {"base_image": lambda: check_base_image(d), "python": lambda: check_python(d, f["pyproject"]),
            "extras": lambda: check_extras(d, f["pyproject"]), "torch": lambda: check_torch(d),
            "sequence": lambda: check_sequence(d, f["readme"]),
            "dockerignore": lambda: check_dockerignore(f["dockerignore"]),
            "recipe": lambda: check_docker_run_recipe(d, f["recipe"])}[name]()


CHECKS = ("base_image", "python", "extras", "torch", "sequence", "dockerignore", "recipe")


@pytest.mark.parametrize("check", CHECKS)
def test_dockerfile(files, check):
    assert run_check(check, files) == []


BREAKAGES = [
    ("base_image", "dockerfile", "nvidia/cuda:13.0.0-cudnn-runtime", "nvidia/cuda:11.8.0-cudnn-runtime",
     "extras for CUDA 12 and 13 only"),
    ("base_image", "dockerfile", "FROM nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04", "FROM python:3.12", "official"),
    ("python", "dockerfile", "-ubuntu24.04", "-ubuntu20.04", "requires-python"),
    ("python", "dockerfile", " python3-venv ", " ", "python3-venv"),
    ("extras", "dockerfile", '".[cuda13,test,examples]"', '".[cuda12,cuda13,test,examples]"', "another CUDA major"),
    ("extras", "dockerfile", '".[cuda13,test,examples]"', '".[cuda12,test,examples]"', "do not include cuda13"),
    ("extras", "dockerfile", '".[cuda13,test,examples]"', '".[cuda13,test,exmples]"', "'exmples' is not in pyproject"),
    ("extras", "dockerfile", '".[cuda13,test,examples]"', '".[cuda13,examples]"', "do not include the test extra"),
    ("torch", "dockerfile", "whl/cu130", "whl/cpu", "torch must come from https://download.pytorch.org/whl/cu130"),
    ("sequence", "dockerfile", "python3 -m venv /opt/venv && ", "", "differ from the README"),
    ("sequence", "dockerfile", "RUN /opt/venv/bin/pip install --no-cache-dir -e", "RUN pip install --no-cache-dir -e",
     "not the venv's"),
    ("sequence", "dockerfile", " && NUMBA_ENABLE_CUDASIM=1 /opt/venv/bin/python -m pytest -q tests/kernels/test_sim.py",
     "", "differ from the README"),
    ("sequence", "dockerfile", "NUMBA_ENABLE_CUDASIM=1 /opt/venv", "/opt/venv", "differs from the README's"),
    ("dockerignore", "dockerignore", ".venv\n", "", "does not exclude .venv"),
    ("dockerignore", "dockerignore", ".venv\n", ".venv\n*.md\n", "excludes README.md"),
    ("recipe", "dockerfile", "ENV PATH=/opt/venv/bin:$PATH", "ENV PATH=$PATH", "gpucomm-run is not found"),
    ("recipe", "dockerfile", "WORKDIR /workspace", "WORKDIR /src", "differs from docker-run.sh"),
]


@pytest.mark.parametrize("check, file, old, new, message", BREAKAGES, ids=[f"{b[0]}:{b[4]}" for b in BREAKAGES])
def test_each_check_catches_a_broken_dockerfile(files, check, file, old, new, message):
    assert old in files[file], f"the breakage no longer applies: {old!r} is not in {file}"
    broken = dict(files, **{file: files[file].replace(old, new)})
    problems = run_check(check, broken)
    assert any(message in p for p in problems), problems
