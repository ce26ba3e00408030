"""Reading gpucomm's settings from the environment, through one parser.

Every GPUCOMM_* and Horovod variable that tunes gpucomm is declared here once (``SETTINGS``): its
names (the first one set to a non-blank value wins, so ``GPUCOMM_X`` beats Horovod's ``HOROVOD_X``),
its kind and the values it accepts. Modules read a setting through its declaration
(``STORE_MAX_BYTES.read(env, default)``) or through the ``env_*`` functions. Either way a value that
does not parse (garbage, NaN, infinity, a fraction where a whole number is meant, a value out of
range) raises ``SettingError``, which names the variable, its value and what it accepts.

``settings_problems(env)`` checks every declared setting at once: gpucomm-run does so before it
starts a rank, and every rank at ``init``, so a bad value stops the job at the start, on every rank
alike, instead of at one rank's first use of it.

Not settings, and not declared here: the variables a launcher sets to place a rank (rank, size,
rendezvous address and port, job secret, run id), which ``bootstrap/world.py`` reads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
MAX_SECONDS = 1e8  # about 3 years: "never" in practice, and still a wait that sockets and locks can take
MAX_SPIN_US = 10_000.0  # a longer poll would burn a core for every op that waits on a slower rank
_FLAG_WORDS = "on (1, true, yes or on) or off (0, false, no or off)"


class SettingError(ValueError):
    """A setting's value that does not parse or lies outside its range (a ``ValueError``)."""

    def __init__(self, name: str, value: str, problem: str, accepted: str) -> None:
        self.name, self.value, self.problem, self.accepted = name, value, problem, accepted
        super().__init__(f"{name}={value!r} {problem}; set {accepted}, or unset {name} for the default.")


@dataclass(frozen=True)
class Setting:
    """One setting: its variables (the first set wins), how a value converts, and what it accepts;
    ``kind``, ``default`` and ``help`` describe it for the settings reference (docs/), which is
    generated from these declarations."""

    names: tuple[str, ...]
    convert: Callable[[str, str], Any]  # (variable, value as set) -> the value, or raises SettingError
    accepted: str  # what the values may be, for messages and docs
    kind: str = "text"  # integer, number, seconds, flag, choice or text
    default: str = ""  # what applies when unset, as the docs say it ("": nothing); tests/test_docs.py checks it
    help: str = ""  # what the setting does, one sentence

    def given(self, env: Mapping[str, str]) -> tuple[str, str] | None:
        """(variable, value) of the first of ``names`` set to a non-blank value in ``env``, else None."""
        for name in self.names:
            value = env.get(name)
            if value is not None and value.strip():
                return name, value
        return None

    def read(self, env: Mapping[str, str] | None = None, default: Any = None) -> Any:
        """The setting's value in ``env`` (default: this process's environment), else ``default``."""
        given = self.given(os.environ if env is None else env)
        return default if given is None else self.convert(*given)

    def problem(self, env: Mapping[str, str]) -> SettingError | None:
        """Why the value set in ``env`` is refused, or None (unset or fine)."""
        try:
            self.read(env)
        except SettingError as e:
            return e
        return None


def _names(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _show(number: float) -> str:
    return str(int(number)) if float(number).is_integer() and abs(number) < 1e16 else f"{number:g}"


def _range(minimum: float, maximum: float | None, above_minimum: bool) -> str:
    low = f"{'>' if above_minimum else '>='} {_show(minimum)}"
    if maximum is None:
        return low
    return f"{low} and <= {_show(maximum)}" if above_minimum else f"from {_show(minimum)} to {_show(maximum)}"


def integer(names: str | tuple[str, ...], *, minimum: int = 0, maximum: int | None = None,
            unit: str = "", default: str = "", help: str = "") -> Setting:
    """A whole number from ``minimum`` to ``maximum`` (decimal digits; ``_`` between them allowed)."""
    of = f" of {unit}" if unit else ""
    accepted = f"a whole number{of} {_range(minimum, maximum, False)}"

    def convert(name: str, value: str) -> int:
        try:
            number = int(value.strip(), 10)
        except ValueError:
            raise SettingError(name, value, f"is not a whole number{of}", accepted) from None
        if number < minimum or (maximum is not None and number > maximum):
            raise SettingError(name, value, "is out of range", accepted)
        return number

    return Setting(_names(names), convert, accepted, "integer", default, help)


def number(names: str | tuple[str, ...], *, minimum: float = 0.0, maximum: float | None = None,
           above_minimum: bool = False, unit: str = "", default: str = "", help: str = "") -> Setting:
    """A finite number from ``minimum`` (excluded with ``above_minimum``) to ``maximum``."""
    of = f" of {unit}" if unit else ""
    accepted = f"a number{of} {_range(minimum, maximum, above_minimum)}"

    def convert(name: str, value: str) -> float:
        try:
            result = float(value.strip())
        except ValueError:
            raise SettingError(name, value, "is not a number", accepted) from None
        if math.isnan(result):
            raise SettingError(name, value, "is not a number (NaN)", accepted)
        if math.isinf(result):
            raise SettingError(name, value, "is not a finite number", accepted)
        if result < minimum or (above_minimum and result == minimum) or (maximum is not None and result > maximum):
            raise SettingError(name, value, "is out of range", accepted)
        return result

    return Setting(_names(names), convert, accepted, "number", default, help)


def seconds(names: str | tuple[str, ...], *, allow_zero: bool = False, default: str = "", help: str = "") -> Setting:
    """A duration in seconds: above 0 (or from 0, with ``allow_zero``) and at most ``MAX_SECONDS``."""
    return replace(number(names, minimum=0.0, maximum=MAX_SECONDS, above_minimum=not allow_zero, unit="seconds",
                          default=default, help=help), kind="seconds")


def flag(names: str | tuple[str, ...], *, default: str = "", help: str = "") -> Setting:
    """On (1, true, yes, on) or off (0, false, no, off), in any case."""
    accepted = _FLAG_WORDS

    def convert(name: str, value: str) -> bool:
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise SettingError(name, value, "is not a boolean", accepted)

    return Setting(_names(names), convert, accepted, "flag", default, help)


def choice(names: str | tuple[str, ...], choices: tuple[str, ...], *, aliases: Mapping[str, str] | None = None,
           notes: Mapping[str, str] | None = None, default: str = "", help: str = "") -> Setting:
    """One of ``choices`` in any case (returned as written in ``choices``); ``aliases`` map other
    words to a choice; ``notes`` add why a refused word is not offered."""
    words = {c.lower(): c for c in choices}
    words.update({a.lower(): c for a, c in (aliases or {}).items()})
    accepted = f"one of {', '.join(choices)}"

    def convert(name: str, value: str) -> str:
        word = value.strip().lower()
        if word in words:
            return words[word]
        note = (notes or {}).get(word)
        raise SettingError(name, value, f"is not a choice{f' ({note})' if note else ''}", accepted)

    return Setting(_names(names), convert, accepted, "choice", default, help)


def text(names: str | tuple[str, ...], what: str, *, default: str = "", help: str = "") -> Setting:
    """Free text (a path, an interface name), taken as set; ``what`` says what it names."""
    return Setting(_names(names), lambda name, value: value, what, "text", default, help)


# ---------------------------------------------------------------------------------------------
# the ad-hoc readers: one call, the same parser


def env_int(env: Mapping[str, str], names: str | tuple[str, ...], default: int | None, *, minimum: int = 0,
            maximum: int | None = None, unit: str = "") -> int | None:
    """The first of ``names`` set in ``env`` as a whole number in range, else ``default``."""
    return integer(names, minimum=minimum, maximum=maximum, unit=unit).read(env, default)


def env_float(env: Mapping[str, str], names: str | tuple[str, ...], default: float | None, *,
              minimum: float = 0.0, maximum: float | None = None, above_minimum: bool = False,
              unit: str = "") -> float | None:
    """The first of ``names`` set in ``env`` as a finite number in range, else ``default``."""
    return number(names, minimum=minimum, maximum=maximum, above_minimum=above_minimum, unit=unit).read(env, default)


def env_number(env: Mapping[str, str], names: tuple[str, ...], default: float | None, *,
               allow_zero: bool = False, maximum: float | None = None) -> float | None:
    """``env_float`` above 0 (from 0 with ``allow_zero``): the older spelling, kept for callers."""
    return env_float(env, names, default, maximum=maximum, above_minimum=not allow_zero)


def env_seconds(env: Mapping[str, str], names: str | tuple[str, ...], default: float, *,
                allow_zero: bool = False) -> float:
    """The first of ``names`` set in ``env`` as seconds (above 0, at most ``MAX_SECONDS``), else ``default``."""
    return seconds(names, allow_zero=allow_zero).read(env, default)


def env_flag(env: Mapping[str, str], names: str | tuple[str, ...], default: bool = False) -> bool:
    """Whether the first of ``names`` set in ``env`` says on; ``default`` when none is set."""
    return flag(names).read(env, default)


def env_flag_default_on(name: str, env: Mapping[str, str] | None = None) -> bool:
    """``env_flag`` for a setting that is on unless set to off (``env``: default this process's)."""
    return flag(name).read(env, True)


def env_choice(env: Mapping[str, str], names: str | tuple[str, ...], default: str | None,
               choices: tuple[str, ...]) -> str | None:
    """The first of ``names`` set in ``env`` as one of ``choices``, else ``default``."""
    return choice(names, choices).read(env, default)


# ---------------------------------------------------------------------------------------------
# every setting gpucomm reads (the launcher checks them all before it starts a rank)

START_TIMEOUT = seconds(("GPUCOMM_START_TIMEOUT", "HOROVOD_START_TIMEOUT"), default="120",
                        help="Seconds all ranks have to reach init() and meet at the rendezvous store.")
TIMEOUT = seconds(("GPUCOMM_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS"), default="300",
                  help="Seconds a collective may take before it fails on every rank.")
CYCLE_TIME_MS = number(("GPUCOMM_CYCLE_TIME", "HOROVOD_CYCLE_TIME"), maximum=MAX_SECONDS * 1000, unit="milliseconds",
                       default="1", help="Milliseconds asynchronous requests wait to share one control round.")
CACHE_CAPACITY = integer(("GPUCOMM_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"), unit="entries", default="1024",
                         help="Response-cache entries: a named op repeated alike travels as one bit (0: no cache).")
STALL_CHECK_SECONDS = seconds(("GPUCOMM_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS"), default="60",
                              help="Seconds some ranks wait for others to submit an op before rank 0 logs which "
                                   "ranks miss which op.")
STALL_SHUTDOWN_SECONDS = seconds(("GPUCOMM_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
                                 allow_zero=True, default="0 (never)",
                                 help="Seconds after which such a stall becomes an error on every rank.")
STALL_CHECK_DISABLE = flag(("GPUCOMM_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE"), default="off",
                           help="Turn the stall inspector off.")
INLINE_BYTES = integer("GPUCOMM_INLINE_BYTES", unit="bytes", default="16384",
                       help="CPU allreduces, broadcasts and allgathers up to this size per rank ride the control "
                            "round instead of a second round trip (0: off).")
LIVENESS_TIMEOUT = seconds("GPUCOMM_LIVENESS_TIMEOUT", allow_zero=True,
                           default="20 (half of GPUCOMM_TIMEOUT when that is below 40, at least 5)",
                           help="Seconds of silence on the control channel after which a stopped or frozen rank is "
                                "named on every other rank and the job ends (0: off).")
SPIN_US = number("GPUCOMM_SPIN_US", maximum=MAX_SPIN_US, unit="microseconds",
                 default="250 (0 when the host's ranks outnumber the cores this process may use)",
                 help="Microseconds a caller blocked on a control round polls before it sleeps (0: off).")
DEADLOCK_CHECK = flag("GPUCOMM_DEADLOCK_CHECK", default="on",
                      help="Raise on every rank when all members of a process set have waited about 1 s in "
                           "collectives that lack another member (off: for programs that submit from several "
                           "threads while one is blocked).")
# the store's byte cap: below one small frame (64 KiB, no reservation needed) it cannot carry the bootstrap
STORE_MAX_BYTES = integer("GPUCOMM_STORE_MAX_BYTES", minimum=64 << 10, unit="bytes", default="134217728 (128 MiB)",
                          help="Bytes of values ranks may keep in the rendezvous store, and of frames in flight "
                               "(read where the store runs).")
FUSION_THRESHOLD = integer(("GPUCOMM_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"), unit="bytes",
                           default="26214400 (25 MiB)",
                           help="Gradient bucket cap (0: no fusion, one tensor per bucket).")
FUSION_FIRST_BUCKET = integer("GPUCOMM_FUSION_FIRST_BUCKET", unit="bytes", default="1048576 (1 MiB)",
                              help="Cap of the first bucket, so that the first gradients of backward launch early.")
FUSION_BY_READINESS = flag("GPUCOMM_FUSION_BY_READINESS", default="on",
                           help="CPU: after the first step, cut DistributedOptimizer's buckets where backward "
                                "paused (off: keep the static plan).")
FUSION_KERNELS = flag("GPUCOMM_FUSION_KERNELS", default="on",
                      help="Copy GPU buckets with the Numba kernels (off: torch ops from the start).")
GRADIENT_VIEWS = flag("GPUCOMM_GRADIENT_VIEWS", default="on",
                      help="Let gradients live in their buckets as views (off: pack and unpack every GPU bucket "
                           "every step).")
ZERO_GRAD_KEEPS_VIEWS = flag("GPUCOMM_ZERO_GRAD_KEEPS_VIEWS", default="off",
                             help="Let zero_grad(set_to_none=True) zero the gradients that live in their buckets "
                                  "instead of freeing them: backward then accumulates into the buckets and no "
                                  "bucket packs (on a GPU: no copy kernel and no table per bucket and step).")
HOOKS_BY_ARRIVAL_ORDER = flag("GPUCOMM_HOOKS_BY_ARRIVAL_ORDER", default="on",
                              help="Once a step's gradients came in an order, give a Python hook only to each "
                                   "bucket's last one (the others' hooks are C calls, counted when it comes); "
                                   "a step in another order is launched at synchronize and the order recorded "
                                   "again (off: a Python hook per gradient).")
ONE_RANK_REDUCER = flag("GPUCOMM_ONE_RANK_REDUCER", default="off",
                        help="Run DistributedOptimizer's full schedule in a one-rank job too, to measure the "
                             "reducer's own cost.")
CHECK_FINITE = choice("GPUCOMM_CHECK_FINITE", ("raise", "warn", "auto", "off"),
                      aliases={**{w: "raise" for w in TRUE_WORDS}, **{w: "off" for w in (*FALSE_WORDS, "none")}},
                      default="auto",
                      help="DistributedOptimizer's finite check: raise on every rank, warn at every non-finite step, "
                           "auto (warn at the first, log the rest), or off.")
AUTOTUNE = flag(("GPUCOMM_AUTOTUNE", "HOROVOD_AUTOTUNE"), default="off",
                help="Choose DistributedOptimizer's buckets from measured costs.")
AUTOTUNE_LOG = text(("GPUCOMM_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"), "a CSV file's path",
                    help="Where autotune records each plan it tried (the set's first rank).")
AUTOTUNE_WARMUP_SAMPLES = integer(("GPUCOMM_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
                                  unit="steps", default="3", help="Untimed steps before autotune's trial.")
AUTOTUNE_STEPS_PER_SAMPLE = integer(("GPUCOMM_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
                                    minimum=2, unit="steps", default="10",  # a median needs samples
                                    help="Steps timed per plan in autotune's trial; their median decides.")
TIMELINE = text(("GPUCOMM_TIMELINE", "HOROVOD_TIMELINE"), "a file's path, or DYNAMIC",
                help="Chrome-trace timeline written by rank 0 from init() on (DYNAMIC: none until "
                     "hvd.start_timeline()).")
TIMELINE_MARK_CYCLES = flag(("GPUCOMM_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES"), default="off",
                            help="Mark each control-plane cycle in the timeline.")
LOG_LEVEL = choice(("GPUCOMM_LOG_LEVEL", "HOROVOD_LOG_LEVEL"), ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"),
                   default="WARNING (and autotune's progress at INFO)", help="Level of gpucomm's log on stderr.")
LOG_TIMESTAMP = flag("GPUCOMM_LOG_TIMESTAMP", default="off", help="Start gpucomm's log lines with the time.")
CPU_AFFINITY = flag("GPUCOMM_CPU_AFFINITY", default="off", help="Bind each rank to the CPUs of its GPU's NUMA node.")
SINGLE_GPU_TEST = flag("GPUCOMM_SINGLE_GPU_TEST", default="off",
                       help="Test mode: every rank shares one GPU over NCCL's socket transport (correct, slow; "
                            "never for training).")
GLOO_IFACE = text(("GPUCOMM_GLOO_IFACE", "HOROVOD_GLOO_IFACE"), "a network interface's name",
                  help="Network interface for Gloo across hosts.")
CPU_OPERATIONS = choice(("GPUCOMM_CPU_OPERATIONS", "HOROVOD_CPU_OPERATIONS"), ("auto", "gloo", "mpi"),
                        notes={"ccl": "Horovod's oneCCL is not offered"}, default="auto",
                        help="Transport of CPU collectives: auto takes MPI under an MPI launcher with mpi4py, "
                             "else Gloo.")
ISSUE_ORDER = choice("GPUCOMM_ISSUE_ORDER", ("cuda", "all"), default="cuda",
                     help="all: order CPU collectives against optimizer steps as CUDA ones always are (a "
                          "debugging aid).")
KERNEL_LAUNCH = choice("GPUCOMM_KERNEL_LAUNCH", ("driver", "core", "numba"), aliases={"direct": "driver"},
                       default="driver", help="How the fusion kernels are launched.")
NUMBA_COMPAT = flag("GPUCOMM_NUMBA_COMPAT", default="on",
                    help="Restore the NumPy names numba-cuda 0.30 needs while it loads (off: see its own failure).")
DYNAMIC_PROCESS_SETS = flag(("GPUCOMM_DYNAMIC_PROCESS_SETS", "HOROVOD_DYNAMIC_PROCESS_SETS"), default="off",
                            help="Allow add_process_set and remove_process_set after init().")
REQUIRE_SECRET = flag("GPUCOMM_REQUIRE_SECRET", default="off",
                      help="Refuse to start with a job secret derived from the job id, address and port.")
RENDEZVOUS_BIND = text("GPUCOMM_RENDEZVOUS_BIND", "a local address to listen on (::, every interface; 0.0.0.0, every IPv4 one)",
                       default="the rendezvous address",
                       help="Where rank 0's store listens, when the ranks reach it through an address it does not "
                            "own (NAT, a service address).")
ELASTIC = flag(("GPUCOMM_ELASTIC", "HOROVOD_ELASTIC"), default="off",
               help="Set by the elastic launcher: this rank joins the job's elastic rounds.")
ELASTIC_TIMEOUT = seconds(("GPUCOMM_ELASTIC_TIMEOUT", "HOROVOD_ELASTIC_TIMEOUT"), default="600",
                          help="Seconds an elastic job waits for enough slots after a change.")
MPIEXEC = text("GPUCOMM_MPIEXEC", "the MPI launcher's name or path",
               help="The MPI launcher gpucomm-run --mpi uses (else the mpiexec beside this Python, then one on PATH).")

SETTINGS: tuple[Setting, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Setting))

DEFAULT_LIVENESS_S = 20.0  # a silent peer (a stopped rank, a host off the network) is named within this
DEFAULT_TIMEOUT_S = 300.0  # GPUCOMM_TIMEOUT's default: seconds a collective may take


def liveness_seconds(env: Mapping[str, str], timeout: float | None = None) -> float | None:
    """Seconds of silence after which a peer is declared gone (``GPUCOMM_LIVENESS_TIMEOUT``; None: 0,
    the check is off). By default ``DEFAULT_LIVENESS_S``, but at most half the collective timeout
    (``timeout``, else ``GPUCOMM_TIMEOUT`` in ``env``) and at least 5 s, so a stopped rank or a cut
    link is named before a transfer times out. Read by the ranks' control plane and by gpucomm-run
    (its remote ranks' link to it)."""
    timeout = TIMEOUT.read(env, DEFAULT_TIMEOUT_S) if timeout is None else timeout
    value = LIVENESS_TIMEOUT.read(env, min(DEFAULT_LIVENESS_S, max(5.0, timeout / 2)))
    return value or None



def settings_problems(env: Mapping[str, str], settings: tuple[Setting, ...] = SETTINGS) -> list[SettingError]:
    """Every setting in ``env`` whose value is refused (none: all parse), in declaration order."""
    return [p for p in (s.problem(env) for s in settings) if p is not None]


def check_settings(env: Mapping[str, str] | None = None) -> None:
    """Raise the first refused setting's ``SettingError`` (naming any others too); None when all parse."""
    problems = settings_problems(os.environ if env is None else env)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        first = problems[0]
        others = ", ".join(p.name for p in problems[1:])
        verb = "is" if len(problems) == 2 else "are"
        problem = f"{first.problem} (and {others} {verb} refused too)"
        raise SettingError(first.name, first.value, problem, first.accepted)


__all__ = ["DEFAULT_LIVENESS_S", "DEFAULT_TIMEOUT_S", "MAX_SECONDS", "MAX_SPIN_US", "SETTINGS", "Setting", "SettingError", "check_settings",
           "choice", "liveness_seconds",
           "env_choice", "env_flag", "env_flag_default_on", "env_float", "env_int", "env_number", "env_seconds",
           "flag", "integer", "number", "seconds", "settings_problems", "text", "START_TIMEOUT", "TIMEOUT",
           "CYCLE_TIME_MS", "CACHE_CAPACITY", "STALL_CHECK_SECONDS", "STALL_SHUTDOWN_SECONDS", "STALL_CHECK_DISABLE",
           "INLINE_BYTES", "LIVENESS_TIMEOUT", "SPIN_US", "DEADLOCK_CHECK", "STORE_MAX_BYTES", "FUSION_THRESHOLD",
           "FUSION_FIRST_BUCKET", "FUSION_BY_READINESS", "FUSION_KERNELS", "GRADIENT_VIEWS", "ZERO_GRAD_KEEPS_VIEWS", "HOOKS_BY_ARRIVAL_ORDER",
           "ONE_RANK_REDUCER",
           "CHECK_FINITE", "AUTOTUNE", "AUTOTUNE_LOG", "AUTOTUNE_WARMUP_SAMPLES", "AUTOTUNE_STEPS_PER_SAMPLE",
           "TIMELINE", "TIMELINE_MARK_CYCLES", "LOG_LEVEL", "LOG_TIMESTAMP", "CPU_AFFINITY", "SINGLE_GPU_TEST", "GLOO_IFACE",
           "CPU_OPERATIONS", "ISSUE_ORDER", "KERNEL_LAUNCH", "NUMBA_COMPAT", "DYNAMIC_PROCESS_SETS",
           "REQUIRE_SECRET", "RENDEZVOUS_BIND", "ELASTIC", "ELASTIC_TIMEOUT", "MPIEXEC"]
