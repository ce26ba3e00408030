"""``gpucomm.run``: call a Python function in N ranks and get back their return values, as
``horovod.run`` does.

    def train(lr):
        import gpucomm.torch as hvd
        hvd.init()
        ...
        return hvd.rank(), final_loss

    results = gpucomm.run(train, args=(0.1,), num_proc=4)   # [(0, ...), (1, ...), (2, ...), (3, ...)]

The ranks are started exactly as ``gpucomm-run`` starts a script (same slot plan, environment,
``[rank]<stdout>:`` output, fail-fast supervision and process-tree cleanup); each one runs
``python -m gpucomm.runner.run_task``, which fetches ``(func, args, kwargs)`` (pickled with
cloudpickle, so lambdas and closures work) from the job's authenticated rendezvous store, calls it,
and stores the return value there. When a rank fails, ``RunError`` carries the first failing
rank's exception and traceback.

Side effect, as with ``gpucomm-run``: the calling process becomes a child subreaper (Linux), so
processes a rank leaves behind are found and stopped.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import RunError
from .cli import build_parser, host_list, run_fixed_job, run_through_mpi
from .hosts import HostSpecError, assign_slots
from .renamed import renamed
from .run_task import MAX_PAYLOAD, dumps, key
from .supervisor import describe_exit

ELASTIC_ADVICE = ("gpucomm.run starts fixed-size jobs only: leave out {names}, or run the training script "
                  "elastically with gpucomm-run's elastic options (--min-np, --max-np, --host-discovery-script) and "
                  "hvd.elastic.run in the script.")


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, num_proc: int = 1,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None, hosts: str | None = None,
        hostfile: str | None = None, host_discovery_script: str | None = None, start_timeout: float | None = None,
        ssh_port: int | None = None, ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | None = None, use_gloo: bool | None = None,
        use_mpi: bool | None = None, mpi_args: str | None = None, network_interface: str | None = None,
        network_interfaces: Sequence[str] | None = None, executable: str | None = None, np: int | None = None,
        min_np: int | None = None, max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` in ``num_proc`` ranks; return their results, ordered by rank.

    Parameters as in ``horovod.run`` (0.28.1), including its deprecated aliases ``np``, ``min_np``,
    ``max_np`` and ``network_interface``. ``func`` calls ``hvd.init()`` itself. ``hosts``
    ("node1:2,node2:2") or ``hostfile`` place the ranks (default: all on this host);
    ``start_timeout`` bounds how long the ranks may take to meet; ``output_filename`` also writes
    each rank's output to ``DIR/rank.<N>/stdout|stderr``; ``executable`` is the Python the ranks run
    (default: this one). Raises ``RunError`` with the first failing rank's exception and traceback;
    ``use_mpi=True`` starts the ranks through MPI's launcher, as ``gpucomm-run --mpi`` does
    (``mpi_args``: that launcher's own options); elastic options raise ``NotImplementedError`` saying
    what to do instead."""
    if network_interface:
        warnings.warn("network_interface is deprecated, use network_interfaces instead", DeprecationWarning, 2)
        network_interfaces = network_interface.split(",")
    num_proc = renamed("np", np, "num_proc", num_proc)
    min_num_proc = renamed("min_np", min_np, "min_num_proc", min_num_proc)
    max_num_proc = renamed("max_np", max_np, "max_num_proc", max_num_proc)
    if hosts is not None and hostfile is not None:
        raise ValueError("gpucomm.run: give hosts or hostfile, not both.")
    if use_gloo and use_mpi:
        raise ValueError("gpucomm.run: give use_gloo or use_mpi, not both.")
    elastic = [name for name, value in (("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc),
                                        ("slots", slots), ("reset_limit", reset_limit),
                                        ("cooldown_range", cooldown_range),
                                        ("host_discovery_script", host_discovery_script)) if value is not None]
    if elastic:
        raise NotImplementedError(ELASTIC_ADVICE.format(names=", ".join(elastic)))
    if mpi_args and not use_mpi:
        raise ValueError("gpucomm.run: mpi_args are the MPI launcher's own options and need use_mpi=True.")
    if not callable(func):
        raise TypeError(f"gpucomm.run: func must be callable, got {type(func).__name__}")
    payload = _payload(func, tuple(args), dict(kwargs or {}))
    argv = ["-np", str(num_proc)]
    for flag, value in (("--hosts", hosts), ("--hostfile", hostfile), ("--start-timeout", start_timeout),
                        ("--ssh-port", ssh_port), ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename)):
        if value is not None:
            argv.append(f"{flag}={value}")  # one token: a value starting with "-" is not read as a flag
    if network_interfaces:
        nics = network_interfaces.split(",") if isinstance(network_interfaces, str) else list(network_interfaces)
        argv.append(f"--network-interface={','.join(nics)}")
    argv += [flag for flag, on in (("--disable-cache", disable_cache), ("--verbose", verbose), ("--gloo", use_gloo),
                                   ("--mpi", use_mpi)) if on]
    if mpi_args:
        argv.append(f"--mpi-args={mpi_args}")
    return _run_job(argv, payload, executable or sys.executable)


def _payload(func: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    try:
        payload = dumps((func, args, kwargs))
    except Exception as e:
        raise TypeError(f"gpucomm.run could not pickle the function and its arguments ({type(e).__name__}: {e}). "
                        f"Pass a function defined at module level, or install cloudpickle for lambdas and closures; "
                        f"objects such as open files, locks or sockets cannot be sent to the ranks.") from e
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"gpucomm.run: the function and its arguments pickle to {len(payload) / 2**20:.1f} MiB, more "
                         f"than the {MAX_PAYLOAD >> 20} MiB the job's store carries; load large data inside the "
                         f"function instead (from files each rank can read).")
    return payload


def _parse(argv: list[str]):
    """The launcher's own parser (whose checks raise ValueError instead of exiting) and ``argv`` parsed."""
    parser = build_parser()

    def error(message: str):
        raise ValueError(f"gpucomm.run: {message}")

    parser.error = error  # type: ignore[method-assign]
    return parser, parser.parse_args([*argv, "run_task"])


def _no_exit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a launcher helper that reports bad input with SystemExit; raise ValueError instead."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        raise ValueError(str(e.code).replace("gpucomm-run:", "gpucomm.run:", 1)) from None


def _run_job(argv: list[str], payload: bytes, executable: str) -> list[Any]:
    """``gpucomm-run``'s own launch (``cli.run_fixed_job``) of ``executable -m gpucomm.runner.run_task``."""
    parser, opts = _parse(argv)
    opts.remote_python = executable
    try:
        slots = assign_slots(host_list(opts), opts.np)
    except HostSpecError as e:
        raise ValueError(f"gpucomm.run: {e}") from None
    env = dict(os.environ)
    # the ranks import this very gpucomm, even when it is not installed for `executable`
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), package_root) if p)

    def publish(server, run_id: str) -> None:
        server.put(key(run_id, "sys_path"), json.dumps(sys.path).encode())
        server.put(key(run_id, "payload"), payload)

    command = [executable, "-m", "gpucomm.runner.run_task"]

    def collect(server, run_id: str) -> tuple[str, dict[str, bytes]]:
        return run_id, server.snapshot(key(run_id, ""))

    if opts.mpi:  # the MPI launcher starts the ranks (`gpucomm-run --mpi`); CPU collectives then run on MPI
        opts.command = command
        end = _no_exit(run_through_mpi, opts, parser, slots, env, publish=publish, collect=collect)
        run_id, snapshot = end.collected
        failed = None if end.blamed is None else (end.blamed.rank, _returncode(end.blamed.code))
        return _outcome(snapshot, run_id, end.code, failed, slots, end.stderr_tails)
    code, supervisor, records = _no_exit(run_fixed_job, opts, slots, command, env, publish=publish, collect=collect)
    run_id, snapshot = records
    return _outcome(snapshot, run_id, code, supervisor.first_failure, slots, supervisor.stderr_tails)


def _returncode(exit_status: int) -> int:
    """An exit status as gpucomm-run gives it (128+N after signal N) as a Popen return code (-N)."""
    return -(exit_status - 128) if exit_status > 128 else exit_status


def _outcome(records: dict[str, bytes], run_id: str, code: int, first_failure: tuple[int, int] | None,
             slots: list, stderr_tails: dict) -> list[Any]:
    """The results by rank, or the error of the job's first failure."""
    prefix = key(run_id, "errors/")
    raised = [pickle.loads(records[k]) for k in sorted(records)
              if k.startswith(prefix) and k[len(prefix):].isdigit()]
    # The first rank to exit may only echo another's exception (a collective that lost its peer):
    # then the first exception stored is the cause. A first rank that stored none died without one
    # (os._exit, a signal, a crash), and the exceptions stored afterwards are its echoes.
    if raised and (first_failure is None or any(r["rank"] == first_failure[0] for r in raised)):
        raise _raised_error(raised[0], len(slots))
    if code != 0 or first_failure is not None:
        if first_failure is None:  # a signal to this process stopped the job
            if code == 128 + signal.SIGINT:
                raise KeyboardInterrupt
            raise RunError(f"gpucomm.run: the job was stopped by signal {code - 128}.", exit_code=code)
        rank, returncode = first_failure
        host = slots[rank].host
        tail = "\n".join(f"  | {line}" for line in stderr_tails.get(rank, ()))
        echoes = f" (rank(s) {sorted({r['rank'] for r in raised})} then failed as a consequence)" if raised else ""
        raise RunError(f"gpucomm.run: rank {rank} of {len(slots)} on {host} {describe_exit(returncode)} before its "
                       f"function returned{echoes}." + (f"\nLast lines of its stderr:\n{tail}" if tail else ""),
                       rank=rank, host=host, exit_code=returncode)
    results = []
    for rank in range(len(slots)):
        data = records.get(key(run_id, f"result/{rank}"))
        if data is None:
            raise RunError(f"gpucomm.run: rank {rank} exited with status 0 without returning a result (did the "
                           f"function end its process with os._exit?).", rank=rank, host=slots[rank].host,
                           exit_code=0)
        results.append(pickle.loads(data))
    return results


def _raised_error(record: dict, size: int) -> RunError:
    exc = None
    if record["exception"] is not None:
        try:
            exc = pickle.loads(record["exception"])
        except Exception:  # its class does not import here, or its constructor refuses the pickled args
            exc = None
    err = RunError(f"gpucomm.run: rank {record['rank']} of {size} on {record['host']} raised "
                   f"{record['type']}: {record['message']}\n\nTraceback of rank {record['rank']}:\n"
                   f"{record['traceback'].rstrip()}", rank=record["rank"], host=record["host"], exception=exc,
                   remote_traceback=record["traceback"])
    err.__cause__ = exc
    return err


__all__ = ["RunError", "run"]
