"""The command line: nccl-tests' flags (-b -e -f -i -w -n -z -d -o -r -c -a) plus the benchmark's own
(--ops, --impls, --device, --cpu-operations, -R, --json, --plot, --quick), the defaults that depend on
the device, and the checks that turn a request this job cannot run into one line and exit status 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from .impl_base import IMPLS
from .impl_choice import unavailable
from .inputs import DTYPES, OPS
from .sizes import COLLECTIVES, parse_size

DTYPE_ALIASES = {"char": "int8", "int": "int32", "float16": "half", "fp16": "half", "float32": "float",
                 "fp32": "float", "float64": "double", "fp64": "double", "bf16": "bfloat16"}


class UsageError(Exception):
    """A request this job cannot run; main() prints it on one line and exits with status 2."""


def _csv(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or '(none given)'}; choose from "
                                             f"{', '.join(choices)} (comma-separated)")
        return items
    return parse


def _dtypes(text: str) -> list[str]:
    if text == "all":
        return list(DTYPES)
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown datatype {text!r}; choose from {', '.join(DTYPES)}, all "
                                         f"(aliases: {', '.join(DTYPE_ALIASES)})")
    return [name]


def _ops(text: str) -> list[str]:
    if text == "all":
        return list(OPS)
    if text not in OPS:
        raise argparse.ArgumentTypeError(f"unknown op {text!r}; choose from {', '.join(OPS)}, all")
    return [text]


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``description`` is the script's docstring, shown by --help."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--minbytes", type=parse_size, help="smallest size (default 8)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, help="largest size (default 32M on cuda, 4M on cpu)")
    ap.add_argument("-f", "--stepfactor", type=int, help="multiply the size by this (default 2)")
    ap.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20, help="add this when -f is 1 (default 1M)")
    ap.add_argument("-w", "--warmup_iters", type=int, help="warm-up calls (default 5)")
    ap.add_argument("-n", "--iters", type=int, help="timed calls per size (default 20)")
    ap.add_argument("-R", "--rounds", type=int, default=1,
                    help="run the sweep this many times, the implementations' tables in turn each round, and "
                         "report each cell's median: interleaved, so load that drifts during the run is shared "
                         "(default 1: nccl-tests' single pass)")
    ap.add_argument("-z", "--blocking", type=int, choices=(0, 1), default=0,
                    help="1: wait for completion and run a barrier after each call")
    ap.add_argument("-d", "--datatype", dest="dtype_list", type=_dtypes, default=["float"],
                    help="int8, uint8, int32, int64, half, float, double, bfloat16 or all (default float)")
    ap.add_argument("-o", "--op", dest="ops_list", type=_ops, default=["sum"],
                    help="sum, prod, max, min, avg or all (default sum; reducing collectives only)")
    ap.add_argument("-r", "--root", type=int, default=0, help="broadcast's root; -1 runs every root (default 0)")
    ap.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="check results (default 1)")
    ap.add_argument("-a", "--average", type=int, choices=(0, 1, 2, 3), default=1,
                    help="time reported: 0 rank 0's, 1 average over ranks, 2 minimum, 3 maximum (default 1)")
    ap.add_argument("--ops", dest="collectives", type=_csv(COLLECTIVES, "collective"), default=list(COLLECTIVES),
                    help="collectives to run (default: all five)")
    ap.add_argument("--impls", type=_csv(IMPLS, "implementation"), default=None,
                    help="gpucomm, nccl, torch (default: those available on the device)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    ap.add_argument("--cpu-operations", choices=("auto", "gloo", "mpi"), default="auto",
                    help="gpucomm's transport for CPU tensors (GPUCOMM_CPU_OPERATIONS): auto (default: MPI under an "
                         "MPI launcher with mpi4py, else Gloo), gloo, or mpi (needs gpucomm-run --mpi, mpiexec or "
                         "mpirun); torch.distributed stays on Gloo")
    ap.add_argument("--json", default="bench-out/collectives.json", help="results file ('' to skip)")
    ap.add_argument("--plot", default="bench-out/collectives.png", help="PNG plot ('' to skip)")
    ap.add_argument("--quick", action="store_true", help="a tiny sweep for tests: 8 B .. 64K by 8x, -w 1 -n 2")
    return ap


def fill_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on the device or on --quick; explicit flags always win."""
    quick = {"minbytes": 8, "maxbytes": 64 << 10, "stepfactor": 8, "warmup_iters": 1, "iters": 2}
    full = {"minbytes": 8, "maxbytes": (32 << 20) if args.device == "cuda" else (4 << 20), "stepfactor": 2,
            "warmup_iters": 5, "iters": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def validate(args: argparse.Namespace) -> None:
    """Pick the device, fill the defaults, and raise UsageError for a request this job cannot run."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda needs a CUDA GPU and a CUDA build of torch, but torch.cuda.is_available() "
                         f"is False (torch {torch.__version__}); run with --device cpu, or on a GPU machine.")
    fill_defaults(args)
    if args.minbytes > args.maxbytes:
        raise UsageError(f"invalid sizes: minbytes {args.minbytes} > maxbytes {args.maxbytes}")
    if args.stepfactor < 1 or args.iters < 1 or args.warmup_iters < 0 or args.stepbytes < 1 or args.rounds < 1:
        raise UsageError("-f and -i must be at least 1, -n and -R at least 1 and -w at least 0")
    if args.minbytes < 1:
        raise UsageError("-b must be at least 1 byte")
    if args.impls is not None:
        for name in args.impls:
            reason = unavailable(name, args.device)
            if reason:
                raise UsageError(f"--impls {name}: {reason}")
