"""One parser for every setting (issue 36): what it refuses and how it says so, that every read of a
GPUCOMM_*/HOROVOD_* variable in gpucomm/ goes through ``gpucomm/settings.py``, that gpucomm-run
refuses a bad setting in one line before it starts a rank, and what a rank of a launch by hand
says when rank 0 failed at start."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gpucomm import settings
from gpucomm.bootstrap.arrival import open_store
from gpucomm.bootstrap.world import detect_world
from gpucomm.errors import RendezvousUnreachable
from gpucomm.settings import SETTINGS, SettingError, check_settings, settings_problems
from tests.harness import PYTHON, ROOT, launcher_cmd, run, run_rank_scripts

PACKAGE = ROOT / "gpucomm"
PROGRAM = str(ROOT / "tests" / "ranks" / "settings_program.py")
OURS = re.compile(r"(GPUCOMM|HOROVOD)_[A-Z0-9_]+")

# Variables that are not settings: a launcher sets them to place each rank and reach the store
# (``bootstrap/world.py`` reads them as one contract, and the launchers' helpers read back their own)
NOT_SETTINGS = {
    **dict.fromkeys(("GPUCOMM_RANK", "GPUCOMM_SIZE", "GPUCOMM_LOCAL_RANK", "GPUCOMM_LOCAL_SIZE", "GPUCOMM_CROSS_RANK",
                     "GPUCOMM_CROSS_SIZE", "GPUCOMM_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                     "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME"),
                    "a rank's place in the job, set by the launcher"),
    **dict.fromkeys(("GPUCOMM_RENDEZVOUS_ADDR", "GPUCOMM_RENDEZVOUS_PORT", "GPUCOMM_RENDEZVOUS_HOSTED",
                     "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "GPUCOMM_RUN_ID"),
                    "where the job's store is, set by the launcher"),
    "GPUCOMM_SECRET": "the job secret (never a setting: it is not echoed in any message)",
    "GPUCOMM_ELASTIC_WORKER": "an elastic worker's id, set by the elastic driver",
    **dict.fromkeys(("GPUCOMM_OUTPUT_ADDR", "GPUCOMM_OUTPUT_PORT"), "where gpucomm-run --mpi collects a rank's output"),
}
# Reads of settings not yet routed, in files another engineer owns: (file, variable) -> what to do there
PENDING = {
}
# Files that read the environment with keys computed at run time (none of them a GPUCOMM_/HOROVOD_ setting)
COMPUTED_KEYS = {
    "gpucomm/bootstrap/world.py": "every launcher's placement variables (torchrun, Slurm, Open MPI, MPICH), by table",
    "gpucomm/backends/nccl.py": "NCCL's own variables, read as NCCL reads them",
    "gpucomm/runner/mpi_launch.py": "variables forwarded to MPI's launcher by prefix (OMPI_MCA_*)",
    "gpucomm/settings.py": "the parser itself",
}
ENV_NAMES = {"env", "environ", "environment"}


# ---------------------------------------------------------------------------------------------
# the parser


@pytest.mark.parametrize("setting, value, says", [
    (settings.STORE_MAX_BYTES, "inf", "is not a whole number of bytes; set a whole number of bytes >= 65536"),
    (settings.STORE_MAX_BYTES, "1.5", "is not a whole number of bytes"),
    (settings.STORE_MAX_BYTES, "garbage", "is not a whole number of bytes"),
    (settings.STORE_MAX_BYTES, "0", "is out of range"),
    (settings.CACHE_CAPACITY, "1.5", "is not a whole number of entries"),
    (settings.TIMEOUT, "nan", r"is not a number \(NaN\); set a number of seconds > 0 and <= 100000000"),
    (settings.TIMEOUT, "inf", "is not a finite number"),
    (settings.TIMEOUT, "0", "is out of range"),
    (settings.START_TIMEOUT, "1e300", "is out of range"),
    (settings.CYCLE_TIME_MS, "-1", "is out of range; set a number of milliseconds from 0"),
    (settings.SPIN_US, "20000", "is out of range; set a number of microseconds from 0 to 10000"),
    (settings.AUTOTUNE_STEPS_PER_SAMPLE, "1", "is out of range; set a whole number of steps >= 2"),
    (settings.AUTOTUNE_WARMUP_SAMPLES, "2.5", "is not a whole number of steps"),
    (settings.SINGLE_GPU_TEST, "maybe", r"is not a boolean; set on \(1, true, yes or on\) or off"),
    (settings.CPU_OPERATIONS, "ccl", r"is not a choice \(Horovod's oneCCL is not offered\); set one of auto, gloo"),
    (settings.LOG_LEVEL, "loud", "is not a choice; set one of TRACE, DEBUG"),
    (settings.ELASTIC_TIMEOUT, "nan", "is not a number"),
])
def test_a_refused_value_names_the_variable_its_value_and_what_it_accepts(setting, value, says):
    name = setting.names[-1]  # Horovod's name where there is one: the error names the variable that was set
    with pytest.raises(SettingError, match=f"^{name}='{re.escape(value)}' {says}") as info:
        setting.read({name: value})
    assert isinstance(info.value, ValueError) and info.value.name == name and info.value.value == value
    assert str(info.value).endswith(f"or unset {name} for the default.")


def test_valid_values_read_as_before():
    assert settings.STORE_MAX_BYTES.read({"GPUCOMM_STORE_MAX_BYTES": " 16_777_216 "}, 1) == 16 << 20
    assert settings.TIMEOUT.read({"HOROVOD_GLOO_TIMEOUT_SECONDS": "2.5"}, 300.0) == 2.5
    assert settings.TIMEOUT.read({"GPUCOMM_TIMEOUT": "7", "HOROVOD_GLOO_TIMEOUT_SECONDS": "nan"}, 300.0) == 7.0
    assert settings.TIMEOUT.read({"GPUCOMM_TIMEOUT": "  "}, 300.0) == 300.0  # blank is unset
    assert settings.CYCLE_TIME_MS.read({"GPUCOMM_CYCLE_TIME": "0"}, 1.0) == 0.0
    assert settings.LOG_LEVEL.read({"HOROVOD_LOG_LEVEL": "debug"}) == "DEBUG"
    assert settings.KERNEL_LAUNCH.read({"GPUCOMM_KERNEL_LAUNCH": "Direct"}, "driver") == "driver"
    assert settings.CHECK_FINITE.read({"GPUCOMM_CHECK_FINITE": "ON"}, "off") == "raise"
    assert settings.AUTOTUNE.read({"HOROVOD_AUTOTUNE": "TRUE"}, False) is True
    assert settings.env_flag_default_on("GPUCOMM_DEADLOCK_CHECK", {}) is True
    assert settings.env_flag_default_on("GPUCOMM_DEADLOCK_CHECK", {"GPUCOMM_DEADLOCK_CHECK": "off"}) is False
    assert settings.env_int({"X": "12"}, "X", 0, minimum=10) == 12
    assert settings.env_seconds({}, ("X",), 3.0) == 3.0


def test_every_setting_is_checked_at_once_and_the_first_error_names_the_others():
    env = {"GPUCOMM_STORE_MAX_BYTES": "1.5", "HOROVOD_CYCLE_TIME": "inf", "GPUCOMM_TIMEOUT": "60"}
    assert [p.name for p in settings_problems(env)] == ["HOROVOD_CYCLE_TIME", "GPUCOMM_STORE_MAX_BYTES"]
    with pytest.raises(SettingError, match=r"^HOROVOD_CYCLE_TIME='inf' is not a finite number \(and "
                                           r"GPUCOMM_STORE_MAX_BYTES is refused too\)"):
        check_settings(env)
    check_settings({"GPUCOMM_TIMEOUT": "60"})


# ---------------------------------------------------------------------------------------------
# every read goes through settings.py


def _string_constants() -> dict[str, set[str]]:
    """Module-level names bound to a string or a tuple of strings anywhere in gpucomm/ -> their values
    (also through other such names: ``A = "X"; B = (A, "Y")``)."""
    bindings = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if targets and node.value is not None:
                bindings += [(target.id, node.value) for target in targets if isinstance(target, ast.Name)]
    table: dict[str, set[str]] = {}
    while True:  # until no binding resolves to more strings
        size = sum(len(v) for v in table.values())
        for name, value in bindings:
            values = _strings(value, table)
            if values is not None:
                table.setdefault(name, set()).update(values)
        if sum(len(v) for v in table.values()) == size:
            return table


def _strings(node: ast.AST, table: dict[str, set[str]]) -> set[str] | None:
    """The strings ``node`` may stand for, or None when it is computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List)):
        parts = [_strings(e, table) for e in node.elts]
        return None if any(p is None for p in parts) else set().union(*parts)
    if isinstance(node, ast.Name):
        return table.get(node.id)
    if isinstance(node, ast.Subscript):
        return _strings(node.value, table)
    return None


def _is_environment(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Attribute) and node.attr in ENV_NAMES) or
            (isinstance(node, ast.Name) and node.id in ENV_NAMES))


def _keys_read(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, key) of every read of an environment mapping: ``.get/.pop/.setdefault(key)``,
    ``[key]``, ``key in env`` and ``os.getenv(key)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr in ("get", "pop", "setdefault") and _is_environment(node.func.value)) or \
                    node.func.attr == "getenv":
                found.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environment(node.value):
            found.append((node.lineno, node.slice))
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_environment(node.comparators[0])):
            found.append((node.lineno, node.left))
    return found


def _loop_values(tree: ast.AST, table: dict[str, set[str]]) -> dict[str, set[str] | None]:
    """Names bound by ``for`` loops over string constants -> the strings (None: over something computed)."""
    loops: dict[str, set[str] | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            values = _strings(node.iter, table)
            known = loops.get(node.target.id, set())
            loops[node.target.id] = None if values is None or known is None else known | values
    return loops


def _environment_reads() -> tuple[list[str], list[str]]:
    """(reads of GPUCOMM_/HOROVOD_ variables outside settings.py that no list allows, reads with a
    computed key in files not listed in COMPUTED_KEYS), each as "file:line: what"."""
    table = _string_constants()
    direct, computed = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        loops = _loop_values(tree, table)
        for line, key in _keys_read(tree):
            values = _strings(key, table)
            if values is None and isinstance(key, ast.Name) and key.id in loops:
                values = loops[key.id]
            if values is None:
                if where not in COMPUTED_KEYS:
                    computed.append(f"{where}:{line}: {ast.unparse(key)}")
                continue
            for name in sorted(v for v in values if OURS.fullmatch(v)):
                if where != "gpucomm/settings.py" and name not in NOT_SETTINGS and (where, name) not in PENDING:
                    direct.append(f"{where}:{line}: {name}")
    return direct, computed


def test_every_read_of_a_setting_goes_through_settings_py():
    direct, computed = _environment_reads()
    assert direct == [], ("these read a setting from the environment themselves; read it through its declaration "
                          f"in gpucomm/settings.py (e.g. settings.TIMEOUT.read(env, default)): {direct}")
    assert computed == [], ("these read the environment with a computed key; read settings through "
                            f"gpucomm/settings.py, or list the file in COMPUTED_KEYS with why: {computed}")


def test_every_variable_gpucomm_names_is_a_declared_setting_or_the_launchers():
    declared = {name for setting in SETTINGS for name in setting.names}
    named = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and OURS.fullmatch(node.value):
                named.setdefault(node.value, path.relative_to(ROOT).as_posix())
    unknown = {name: where for name, where in named.items() if name not in declared and name not in NOT_SETTINGS}
    assert unknown == {}, ("declare each setting in gpucomm/settings.py (so that gpucomm-run and init check it), or "
                           f"list it in NOT_SETTINGS with why: {unknown}")
    assert not declared & NOT_SETTINGS.keys()


def test_the_allow_lists_name_only_what_is_there():
    for (where, name) in PENDING:
        assert name in (ROOT / where).read_text(), f"{where} no longer names {name}: remove it from PENDING"
    for where in COMPUTED_KEYS:
        assert (ROOT / where).exists(), f"{where} is gone: remove it from COMPUTED_KEYS"


# ---------------------------------------------------------------------------------------------
# gpucomm-run: one line, exit 2, no rank started


@pytest.mark.parametrize("env, flags, says", [
    ({"GPUCOMM_STORE_MAX_BYTES": "inf"}, (), "GPUCOMM_STORE_MAX_BYTES='inf' is not a whole number of bytes"),
    ({"GPUCOMM_STORE_MAX_BYTES": "garbage"}, (), "GPUCOMM_STORE_MAX_BYTES='garbage' is not a whole number of bytes"),
    ({"GPUCOMM_STORE_MAX_BYTES": "0"}, (), "GPUCOMM_STORE_MAX_BYTES='0' is out of range"),
    ({"GPUCOMM_STORE_MAX_BYTES": "1.5"}, (), "GPUCOMM_STORE_MAX_BYTES='1.5' is not a whole number of bytes"),
    ({"HOROVOD_START_TIMEOUT": "inf", "GPUCOMM_CACHE_CAPACITY": "1.5"}, (), "2 settings are refused: "),
    ({"GPUCOMM_SINGLE_GPU_TEST": "maybe"}, ("--min-np", "1", "-H", "localhost:2"), "is not a boolean"),
    ({"GPUCOMM_SPIN_US": "nan"}, ("--mpi",), "GPUCOMM_SPIN_US='nan' is not a number"),
])
def test_gpucomm_run_refuses_a_bad_setting_in_one_line_before_any_rank_starts(tmp_path, env, flags, says):
    marker = tmp_path / "a rank ran"
    r = run(launcher_cmd("-np", "2", *flags, PYTHON, "-c", f"open({str(marker)!r}, 'w')"), timeout=60,
            env={"GPUCOMM_START_TIMEOUT": "", **env})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("gpucomm-run: ") and says in lines[0], lines
    assert lines[0].endswith("No rank was started."), lines
    assert not marker.exists() and r.stdout == "" and r.leftovers == []


# ---------------------------------------------------------------------------------------------
# a launch by hand: rank 0 serves the store


def test_ranks_sharing_a_bad_setting_all_refuse_it_at_once_in_a_launch_by_hand():
    results = run_rank_scripts([PROGRAM], 2, env={"GPUCOMM_STORE_MAX_BYTES": "inf"}, store_on_rank0=True, timeout=90)
    for r in results:  # rank 1 names the setting too, instead of waiting for rank 0's store
        assert r.returncode == 1 and "SettingError: GPUCOMM_STORE_MAX_BYTES='inf' is not a whole number" in r.stderr, \
            r.stderr


def test_a_rank_that_cannot_reach_rank_0s_store_says_rank_0_may_have_failed_at_start_and_where_to_look():
    results = run_rank_scripts([PROGRAM, "GPUCOMM_STORE_MAX_BYTES=garbage"], 2, store_on_rank0=True, timeout=90,
                               env={"GPUCOMM_START_TIMEOUT": "3"})
    assert results[0].returncode == 1 and "GPUCOMM_STORE_MAX_BYTES='garbage'" in results[0].stderr, results[0].stderr
    last = results[1].stderr.strip().splitlines()[-1]
    assert results[1].returncode == 1 and last.startswith("gpucomm.errors.RendezvousUnreachable: could not reach"), last
    assert "In this gpucomm launch rank 0 serves the store: if it failed at start" in last, last
    assert "the output of the process started with GPUCOMM_RANK=0" in last, last


def test_the_hint_names_where_the_launcher_shows_rank_0s_output():
    unused_port = 1  # nothing listens there: the connection is refused until the start timeout
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "GPUCOMM_RENDEZVOUS_ADDR": "127.0.0.1",
           "GPUCOMM_RENDEZVOUS_PORT": str(unused_port), "GPUCOMM_SECRET": "ab" * 32}
    with pytest.raises(RendezvousUnreachable, match=r"openmpi launch rank 0 serves the store.*mpirun's output for "
                                                    r"rank 0"):
        open_store(detect_world(env), 1, 0.2, 1.0, prefix="t/g1/", record={})


# ---------------------------------------------------------------------------------------------
# autotune in a one-rank job


def test_autotune_in_a_one_rank_job_says_once_that_it_is_off_and_why():
    r = run([PYTHON, PROGRAM], timeout=120, env={"HOROVOD_AUTOTUNE": "1"})
    said = [line for line in r.stderr.splitlines() if "autotune" in line]
    assert r.returncode == 0 and "rank 0 of 1: init ok" in r.stdout, r.stderr
    assert len(said) == 1 and "HOROVOD_AUTOTUNE=1 asks for autotune, but autotune is off in a one-rank job" in said[0]
    quiet = run([PYTHON, PROGRAM], timeout=120)
    assert quiet.returncode == 0 and "autotune" not in quiet.stderr, quiet.stderr
