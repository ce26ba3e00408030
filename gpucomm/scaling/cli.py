"""``python -m gpucomm.scaling``: predicted step time, samples/s and scaling efficiency per cluster shape.

    python -m gpucomm.scaling --model resnet50 --batch-size 32              # profile here, NCCL's model
    python -m gpucomm.scaling --model mymodels:build --save-profile p.json  # your model: (model, batch, loss_fn)
    python -m gpucomm.scaling --profile p.json --gpus-per-node 8 --nodes 1,2,4,8 --intra nvlink --nvlinks 18 \\
        --cc 90 --nic-gbps 400 --nics-per-node 8 --plot eff.png
    python -m gpucomm.scaling --model vgg16 --analytic --step-time 0.489 --batch-size 64 --gpus-per-node 4 \\
        --nodes 1,4,128 --nic-gbps 25 --intra pci --cc 60 --algorithm ring
    python -m gpucomm.scaling --model resnet50 --analytic --step-time 0.097 --gpus-per-node 4,8 \\
        --nodes 1,4,16,64 --nic-gbps 25,100 --algorithm ring,tree --step-noise-cv 0.02   # a grid of shapes
    python -m gpucomm.scaling --model vgg16 --analytic --step-time 0.428 --batch-size 64 --gpus-per-node 4 \
        --nodes 16 --nic-gbps 40 --intra pci --cc 60 --algorithm ring --transport rdma,tcp    # plain TCP beside RDMA

``--gpus-per-node``, ``--nic-gbps``, ``--algorithm`` and ``--transport`` take comma lists as ``--nodes``
does: every combination is predicted, one table (and one plot line) each.
``--transport`` says what carries NCCL's inter-node traffic: ``rdma`` (the default, and the only
behaviour before it existed: NCCL's model as is, each channel at the NIC's rate) or ``tcp`` (NCCL's
socket transport: NCCL still picks its algorithm by the NIC's rate, but each network channel runs
no faster than the socket threads carry, ``gpucomm.tuning.transport``; ``--socket-threads`` and
``--socket-nsocks`` are NCCL_SOCKET_NTHREADS and NCCL_NSOCKS_PERTHREAD, NCCL's defaults 0 and 1).
Weak scaling: every GPU keeps the profiled batch. For each shape the step is predicted with the
best bucket plan (the exact dynamic program of ``gpucomm.tuning.optimal``) and, beside it, with
gpucomm's default buckets (1 MiB first, then 25 MiB). The collective's cost is NCCL's published
model (``gpucomm.tuning.nccl``) unless ``--link-latency-us`` and ``--link-gbps`` describe a plain
ring of links instead. A profile measured on another kind of device can be rescaled to a known
single-device step time with ``--step-time``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from typing import Any

from ..tuning.costs import ring_allreduce
from ..tuning.nccl import NCCL_VERSION, Cluster, NcclModel
from ..tuning.predict import predict_step, scaling_efficiency
from ..tuning.profile import Profile
from ..tuning.step import Overheads
from ..tuning.straggler import Stragglers
from ..tuning.transport import SOCKET_MAX_SOCKETS, SOCKET_MAX_THREADS, TRANSPORTS, Socket
from . import sources

__all__ = ["build_parser", "main", "predict_shapes", "shape_label", "shapes"]


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers (e.g. 25,100)") from None
    if not values or min(values) <= 0 or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more numbers > 0")
    return list(dict.fromkeys(values))


def _algorithm_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in ALGORITHMS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(ALGORITHMS)} (comma-separated)")
    return list(dict.fromkeys(values))


ALGORITHMS = ("auto", "ring", "tree")


def _transport_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in TRANSPORTS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(TRANSPORTS)} (comma-separated; "
                                         "rdma: InfiniBand/RoCE verbs, tcp: NCCL's socket transport)")
    return list(dict.fromkeys(values))


def _ns_pair(text: str) -> tuple[float, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 2 or min(values) <= 0 or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give SEND,RECV nanoseconds per byte, both > 0 (e.g. 0.27,0.19)")
    return values[0], values[1]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4,8)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more counts >= 1")
    return list(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gpucomm.scaling", description=__doc__.splitlines()[0],
                                 epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("the profile (one of --model, --profile)")
    src.add_argument("--model", help="a built-in name (resnet18, resnet50, resnet101, vgg16, inception_v3, "
                                     "inception_v3_aux) or module:callable returning (model, batch, loss_fn)")
    src.add_argument("--profile", metavar="JSON", help="a profile saved with --save-profile")
    src.add_argument("--batch-size", type=int, default=32, help="per device, built-in models (default %(default)s)")
    src.add_argument("--device", default=None, help="where to profile: cpu or cuda (default: cuda when available)")
    src.add_argument("--steps", type=int, default=5, help="timed steps (default %(default)s)")
    src.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    src.add_argument("--analytic", action="store_true",
                     help="built-in models: derive the profile from the architecture (FLOPs and bytes per layer) "
                          "instead of running it; needs --step-time")
    src.add_argument("--flops-per-s", type=float, default=15.7e12, help="--analytic: device FLOP/s (default V100)")
    src.add_argument("--bytes-per-s", type=float, default=900e9, help="--analytic: memory bytes/s (default V100)")
    src.add_argument("--step-time", type=float, metavar="S",
                     help="scale the profile to this single-device step time in seconds (e.g. a published one)")
    src.add_argument("--save-profile", metavar="JSON", help="write the profile used")
    cl = ap.add_argument_group("cluster shapes (NCCL's cost model)")
    cl.add_argument("--gpus-per-node", type=_int_list, default=[8], help="comma list (default 8)")
    cl.add_argument("--nodes", type=_int_list, default=[1, 2, 4, 8, 16], help="comma list (default 1,2,4,8,16)")
    cl.add_argument("--intra", choices=["nvlink", "pci"], default="nvlink",
                    help="GPU links in a node (default %(default)s)")
    cl.add_argument("--nvlinks", type=int, default=6, help="NVLink links per GPU (default %(default)s)")
    cl.add_argument("--nic-gbps", type=_float_list, default=[100.0], help="each NIC's Gbit/s, comma list (default 100)")
    cl.add_argument("--nics-per-node", type=int, default=1, help="default %(default)s")
    cl.add_argument("--cc", type=int, default=70,
                    help="compute capability x10: 60, 70, 80, 90, 100 (default %(default)s)")
    cl.add_argument("--cpu", choices=["intel", "amd"], default="intel")
    cl.add_argument("--algorithm", type=_algorithm_list, default=["auto"],
                    help="NCCL algorithm: auto, ring, tree, or a comma list of them (default auto)")
    cl.add_argument("--step-noise-cv", type=float, default=0.0, metavar="CV",
                    help="per-rank step-time noise as a fraction of the step: each step waits for its slowest rank "
                         "(tuning.straggler; 0.041 fits Horovod's 2017 cluster, see benchmarks/scaling_validation.py; "
                         "default 0)")
    cl.add_argument("--protocol", choices=["auto", "LL", "LL128", "Simple"], default="auto")
    cl.add_argument("--link-latency-us", type=float, help="instead of NCCL's model: a ring over links of this latency")
    cl.add_argument("--link-gbps", type=float, help="... and this bandwidth (Gbit/s)")
    cl.add_argument("--transport", type=_transport_list, default=["rdma"],
                    help="what carries NCCL's inter-node traffic: rdma (InfiniBand/RoCE; NCCL's model as is), tcp "
                         "(NCCL's socket transport), or a comma list (default rdma)")
    cl.add_argument("--socket-threads", type=int, default=None, metavar="N",
                    help=f"--transport tcp: NCCL_SOCKET_NTHREADS, 0..{SOCKET_MAX_THREADS} (default 0, NCCL's own; "
                         "NCCL picks 2 on AWS, 4 on GCP)")
    cl.add_argument("--socket-nsocks", type=int, default=None, metavar="N",
                    help=f"--transport tcp: NCCL_NSOCKS_PERTHREAD (default 1; AWS 8); threads x sockets <= "
                         f"{SOCKET_MAX_SOCKETS}")
    cl.add_argument("--socket-flow-gbps", type=float, default=None, metavar="GBPS",
                    help="--transport tcp: the network's own limit on one TCP flow (default none)")
    cl.add_argument("--tcp-flow-gbs", type=float, default=None, metavar="GBS",
                    help="--transport tcp: one TCP stream's rate on these hosts, GB/s (default: measured here, "
                         "gpucomm.tuning.transport.TCP_FLOW_GBS)")
    cl.add_argument("--tcp-host-ns", type=_ns_pair, default=None, metavar="SEND,RECV",
                    help="--transport tcp: a thread's CPU ns per byte sent and received (default: measured here)")
    cl.add_argument("--processor", choices=["dedicated", "shared"], default="dedicated",
                    help="dedicated: communication runs beside compute (GPUs); shared: it needs the cores that "
                         "compute (CPU ranks with every core busy)")
    ov = ap.add_argument_group("per-bucket overheads")
    ov.add_argument("--per-bucket-us", type=float, default=0.0, help="launch cost of a bucket (default 0)")
    ov.add_argument("--pack-gbs", type=float, default=math.inf,
                    help="pack + unpack copy bandwidth, GB/s (default free)")
    out = ap.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the predictions and plans")
    out.add_argument("--plot", metavar="PNG", help="efficiency against GPU count (needs matplotlib)")
    out.add_argument("--show-plans", action="store_true", help="list each best plan's buckets by parameter name")
    return ap


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if bool(args.model) == bool(args.profile):
        ap.error("give exactly one of --model NAME|module:callable and --profile JSON")
    if args.analytic and args.step_time is None:
        ap.error("--analytic needs --step-time (the single-device step it is scaled to; the architecture gives only "
                 "the shape of the step)")
    if (args.link_latency_us is None) != (args.link_gbps is None):
        ap.error("--link-latency-us and --link-gbps go together (a ring over links of that latency and bandwidth)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--save-profile", args.save_profile)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            ap.error(f"{flag} {path}: its folder does not exist")
    if args.batch_size < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--batch-size and --steps must be >= 1, --warmup >= 0")
    if not (math.isfinite(args.step_noise_cv) and args.step_noise_cv >= 0):
        ap.error(f"--step-noise-cv {args.step_noise_cv}: give a fraction >= 0 of the step (0.04 is 4 percent)")
    socket_flags = [f for f, v in (("--socket-threads", args.socket_threads), ("--socket-nsocks", args.socket_nsocks),
                                   ("--socket-flow-gbps", args.socket_flow_gbps), ("--tcp-flow-gbs", args.tcp_flow_gbs),
                                   ("--tcp-host-ns", args.tcp_host_ns)) if v is not None]
    if socket_flags and "tcp" not in args.transport:
        ap.error(f"{', '.join(socket_flags)} describe NCCL's socket transport: add --transport tcp (or rdma,tcp)")
    if args.link_latency_us is not None and args.transport != ["rdma"]:
        ap.error("--transport applies to NCCL's model; a --link-latency-us/--link-gbps ring already gives its links' "
                 "bandwidth: drop one of them")
    try:
        args.socket = socket_of(args)
    except ValueError as e:
        ap.error(str(e).replace("Socket: threads", "--socket-threads").replace("Socket: socks_per_thread",
                                                                              "--socket-nsocks"))


def socket_of(args: argparse.Namespace) -> Socket:
    """The socket transport the ``--socket-*`` and ``--tcp-*`` arguments describe (NCCL's defaults
    and the measured host costs where not given)."""
    kw: dict[str, Any] = {}
    for flag, name in (("socket_threads", "threads"), ("socket_nsocks", "socks_per_thread"),
                       ("socket_flow_gbps", "flow_gbps"), ("tcp_flow_gbs", "flow_gbs")):
        value = getattr(args, flag, None)
        if value is not None:
            kw[name] = value
    host = getattr(args, "tcp_host_ns", None)
    if host is not None:
        kw["send_ns_per_byte"], kw["recv_ns_per_byte"] = host
    return Socket(**kw)


def get_profile(args: argparse.Namespace) -> Profile:
    """The profile the arguments ask for."""
    if args.profile:
        prof = Profile.load(args.profile)
    elif args.analytic:
        return sources.analytic_profile_of(args.model, batch_size=args.batch_size, step_s=args.step_time,
                                           flops_per_s=args.flops_per_s, bytes_per_s=args.bytes_per_s)
    else:
        device = args.device
        if device is None:
            import torch  # noqa: PLC0415

            device = "cuda" if torch.cuda.is_available() else "cpu"
        prof = sources.measured_profile(args.model, batch_size=args.batch_size, device=device, steps=args.steps,
                                        warmup=args.warmup)
    return prof.scaled(args.step_time) if args.step_time else prof


def shapes(args: argparse.Namespace) -> list[tuple[int, float, str, str]]:
    """The (GPUs per node, NIC Gbit/s, algorithm, transport) combinations asked for, in the order
    given (a ``--link-*`` ring has no NIC, algorithm or transport of NCCL's: one combination per
    GPUs-per-node)."""
    def listed(value: Any) -> list:  # a Namespace built by hand may hold one value
        return list(value) if isinstance(value, (list, tuple)) else [value]

    per_node = listed(args.gpus_per_node)
    if args.link_latency_us is not None:
        return [(g, args.link_gbps, "ring", "rdma") for g in per_node]
    return [(g, nic, algo, transport) for g in per_node for nic in listed(args.nic_gbps)
            for algo in listed(args.algorithm) for transport in listed(getattr(args, "transport", ["rdma"]))]


def shape_label(row: dict[str, Any]) -> str:
    """A shape's name in tables and plot legends (``, tcp`` after a socket transport's)."""
    tcp = ", tcp" if row.get("transport") == "tcp" else ""
    return f"{row['gpus_per_node']}/node, {row['nic_gbps']:g} Gbit/s, {row['algorithm']}{tcp}"


def predict_shapes(prof: Profile, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per cluster shape and node count: the predicted step with the best plan and with
    gpucomm's default; with ``--step-noise-cv`` each also waits for its slowest rank."""
    overheads = Overheads(per_bucket_s=args.per_bucket_us * 1e-6, pack_Bps=args.pack_gbs * 2e9)
    noise = Stragglers(getattr(args, "step_noise_cv", 0.0))
    socket = getattr(args, "socket", None) or socket_of(args)
    rows = []
    for per_node, nic, algorithm, transport in shapes(args):
        for nodes in args.nodes:
            ranks = nodes * per_node
            if args.link_latency_us is not None:
                cost = ring_allreduce(ranks, args.link_latency_us * 1e-6, args.link_gbps * 1e9 / 8)
                model = f"ring of links {args.link_latency_us:g} us, {args.link_gbps:g} Gbit/s"
            else:
                cluster = Cluster(gpus_per_node=per_node, nodes=nodes, intra=args.intra, nvlinks=args.nvlinks,
                                  nic_gbps=nic, nics_per_node=args.nics_per_node, compute_capability=args.cc,
                                  cpu=args.cpu, transport=transport, socket=socket)
                nccl = NcclModel(cluster)
                cost = nccl.cost(algorithm, args.protocol)
                model = f"NCCL {algorithm}/{args.protocol}" + (" over TCP sockets" if transport == "tcp" else "")
            best = predict_step(prof, cost, overheads=overheads, processor=args.processor)
            default = predict_step(prof, cost, plan="gpucomm", overheads=overheads, processor=args.processor)
            algos = sorted({"/".join(nccl.choice(b.nbytes, algorithm, args.protocol)[:2]) for b in best.step.buckets}) \
                if args.link_latency_us is None and ranks > 1 else []
            wait = noise.delay_s(prof.step_s, ranks)
            step, default_step = best.step.step_s + wait, default.step.step_s + wait
            channel = {}
            if args.link_latency_us is None and nodes > 1:
                picked = "ring" if algorithm == "auto" else algorithm  # the big buckets' pick on these clusters
                channel = {"nccl_channel_gbs": nccl.graph(picked).bw_inter,
                           "channel_gbs": nccl.actual_graph(picked).bw_inter}
            rows.append({
                "gpus": ranks, "nodes": nodes, "gpus_per_node": per_node, "nic_gbps": nic, "algorithm": algorithm,
                "transport": transport, **channel, "cost_model": model, "nccl_choices": algos, "straggler_wait_s": wait,
                "step_s": step, "samples_per_s": prof.batch_size * ranks / step,
                "efficiency": scaling_efficiency(prof.step_s, step), "exposed_s": best.step.exposed_s,
                "overlap_fraction": best.step.overlap_fraction,
                "buckets": [list(b) for b in best.buckets], "bucket_bytes": [b.nbytes for b in best.step.buckets],
                "default_step_s": default_step,
                "default_efficiency": scaling_efficiency(prof.step_s, default_step),
                "default_buckets": len(default.buckets)})
    return rows


def print_report(prof: Profile, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"model {prof.model}: {len(prof.sizes)} gradients, {prof.total_bytes / 2 ** 20:.1f} MiB; batch "
          f"{prof.batch_size} per GPU; one device: step {prof.step_s * 1e3:.1f} ms "
          f"(forward {prof.forward_s * 1e3:.1f}, "
          f"backward {prof.backward_s * 1e3:.1f}, update {prof.update_s * 1e3:.1f}) [{prof.source}; {prof.device}]")
    if args.link_latency_us is None:
        print(f"collective: NCCL's cost model {NCCL_VERSION}; GPUs per node over {args.intra}, "
              f"{args.nics_per_node} NIC(s) per node, compute capability {args.cc}")
        if "tcp" in args.transport:
            sock = getattr(args, "socket", None) or socket_of(args)
            print(f"tcp: NCCL's socket transport, {sock.threads} helper thread(s) x {sock.socks_per_thread} socket(s) "
                  f"per connection ({sock.streams} TCP flow(s)); one flow {sock.flow_gbs:g} GB/s, a thread "
                  f"{sock.send_ns_per_byte:g}/{sock.recv_ns_per_byte:g} ns per byte sent/received; a network channel "
                  f"runs at the least of that and the NIC's rate (gpucomm.tuning.transport)")
    if args.step_noise_cv:
        print(f"each step waits for its slowest rank: per-rank step noise {args.step_noise_cv * 100:g} % of the step "
              f"(tuning.straggler)")
    several = len(shapes(args)) > 1
    for label in dict.fromkeys(shape_label(r) for r in rows):
        first = next(r for r in rows if shape_label(r) == label and "channel_gbs" in r) if any(
            shape_label(r) == label and "channel_gbs" in r for r in rows) else None
        speed = (f"; a network channel runs at {first['channel_gbs']:.2f} GB/s (NCCL assumes "
                 f"{first['nccl_channel_gbs']:.2f})" if first else "")
        print(f"shape: {label}{speed}")
        print(f"{'GPUs':>5s} {'nodes':>5s} {'step ms':>9s} {'samples/s':>11s} {'eff':>6s} {'exposed ms':>10s} "
              f"{'buckets':>7s} {'default ms':>10s} {'def eff':>7s}  NCCL picks")
        for r in rows:
            if shape_label(r) != label:
                continue
            print(f"{r['gpus']:5d} {r['nodes']:5d} {r['step_s'] * 1e3:9.1f} {r['samples_per_s']:11.1f} "
                  f"{r['efficiency'] * 100:5.1f}% {r['exposed_s'] * 1e3:10.1f} {len(r['buckets']):7d} "
                  f"{r['default_step_s'] * 1e3:10.1f} {r['default_efficiency'] * 100:6.1f}%  "
                  f"{', '.join(r['nccl_choices'])}")
    for r in rows:
        sizes = ", ".join(f"{b / 2 ** 20:.2f}" for b in r["bucket_bytes"])
        where = f" ({shape_label(r)})" if several else ""
        print(f"best plan at {r['gpus']} GPUs{where}: {len(r['buckets'])} buckets of [{sizes}] MiB")
        if args.show_plans:
            for k, b in enumerate(r["buckets"]):
                print(f"  bucket {k}: {prof.names[b[0]]} .. {prof.names[b[-1]]} ({len(b)} tensors)")


def plot(rows: list[dict[str, Any]], prof: Profile, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = list(dict.fromkeys(shape_label(r) for r in rows))
    for label in labels:
        mine = [r for r in rows if shape_label(r) == label]
        gpus = [r["gpus"] for r in mine]
        suffix = f", {label}" if len(labels) > 1 else ""
        line, = ax.plot(gpus, [r["efficiency"] * 100 for r in mine], "o-", label="best plan (exact DP)" + suffix)
        ax.plot(gpus, [r["default_efficiency"] * 100 for r in mine], "s--", color=line.get_color(),
                label="gpucomm default buckets" + suffix)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{prof.model}, batch {prof.batch_size} per GPU (predicted)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)
    try:
        prof = get_profile(args)
    except ValueError as e:
        print(f"python -m gpucomm.scaling: error: {e}", file=sys.stderr)
        return 2
    if args.save_profile:
        prof.save(args.save_profile)
    rows = predict_shapes(prof, args)
    print_report(prof, rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": prof.to_dict(), "shapes": rows,
                       "nccl": NCCL_VERSION if args.link_latency_us is None else None,
                       "socket": args.socket.to_dict() if "tcp" in args.transport else None}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, prof, args.plot)
        print(f"wrote {args.plot}")
    return 0
