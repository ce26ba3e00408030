"""Shaped links and the model (issue 37, item 4): 2-host jobs between network-namespace hosts whose
links are rate-limited, against what the cost and step models say.

    sudo .venv/bin/python benchmarks/shaped_links.py [--out-dir DIR] [--quick]

Needs root (network namespaces, ``tc``) and OpenSSH's server; builds the hosts itself with
``tests/cluster.py`` (``cluster(2)``: two namespaces ``node0``/``node1`` on one bridge, an sshd on
each, torn down at the end also on failure) and runs every job as ``gpucomm-run -np 2 -H
node0:1,node1:1`` over ssh, one rank per host. Each host is pinned to a core of its own (its sshd,
and so every rank it starts, and the launcher on ``node0``; ``--no-pin`` leaves them floating), so a
host is one core, as the ranks of a 2-rank job on this 2-core machine would have; the benchmarks size
their thread pools from the cores they may use.

1. **The link's rate from the α-β fit.** Raw ``ProcessGroupGloo`` allreduces of 64 KiB .. 32 MiB
   (``benchmarks/model_check.py``'s ``GlooProbe``: each after a barrier, sizes interleaved), an α-β
   line fitted to the medians (``gpucomm.tuning.costs.fit_alpha_beta``), first on the unshaped link
   (the ceiling of two namespace hosts on this machine: veth, bridge and Gloo on 2 shared cores), then
   with every link limited by ``tc`` (token bucket on both ends of each host's veth) to each rate of
   ``--rates``, the bucket ``--burst-us`` deep (1 ms at the rate, at least 96 KiB: a shallower one cuts
   up TCP's 64 KiB GSO segments and cost 40 % of the rate here; the fixture's 256 KiB lets 2 ms of a
   1 Gbit/s link through at memory speed, measured beside as ``1gbit-burst256k``). The fit's
   ``bandwidth_Bps`` is *algorithm* bandwidth: an allreduce of S bytes takes α + S / bandwidth.
   Gloo's ring at n ranks sends 2(n-1)/n x S bytes each way per rank (reduce-scatter, then
   all-gather), so the link carries bus bandwidth = algorithm bandwidth x 2(n-1)/n; at n = 2 the
   factor is 1 and the fitted bandwidth is the rate each direction of the link carries. The configured
   rate counts Ethernet frames (tc's token bucket counts every byte of a frame from its Ethernet header
   on); TCP's payload is 1448 of each 1514-byte frame (MTU 1500, timestamps on), so a link fully used
   moves 0.956 x the configured rate of payload. The table gives the configured rate, the fitted
   rate (bus bandwidth, Gbit/s), their ratio (goal: within 10 %), and the payload ceiling's ratio.
2. **The step model across hosts.** ``benchmarks/model_check.py`` on the 2 hosts at ``--model-rate``
   (default 1 Gbit/s, where the collectives, not the cores, take most of a step): MLP, conv net and
   ResNet-18, gpucomm's default plan and the model's optimal plan, predicted (``step.simulate``, the
   round's measured Gloo curve) beside measured, with ``--processor dedicated``: on a slow link the
   collective waits on the wire, so it runs beside backward (the ``shared`` prediction is kept beside).
   Goal: within +-10 %.
3. **gpucomm against DDP.** ``benchmarks/optimizer_vs_ddp.py --model cnn10m`` at the same rate
   (interleaved rounds, quartiles); goal: gpucomm <= 0.9 x ddp-best. What the model predicts for each
   plan (gpucomm's default buckets, the optimal plan, DDP's 1 MiB first bucket then 25 MiB caps) is
   computed here from model_check's conv-net profile and 1 Gbit/s Gloo curve, with both processors.
4. **Autotune.** ``benchmarks/autotune.py --model cnn10m`` at the same rate: autotune against the
   default plan and fixed caps (``--caps``), DDP beside.

Prints a table; writes ``shaped_links.json`` (and each job's own JSON) to ``--out-dir``. ``--quick``: a
smoke run (fewer samples, rounds and steps). The whole run takes about 7.5 minutes on 2 cores
(results: ``benchmarks/results/2026-11-27-cpu-2core-netns/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
TCP_PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 with timestamps
FULL = {"probe_reps": 7, "mc_rounds": 5, "mc_steps": 4, "ovd_rounds": 8, "ovd_steps": 3, "ovd_warmup": 2,
        "at_rounds": 4, "at_steps": 3}
QUICK = {"probe_reps": 3, "mc_rounds": 2, "mc_steps": 2, "ovd_rounds": 4, "ovd_steps": 2, "ovd_warmup": 1,
         "at_rounds": 2, "at_steps": 2}


def rate_bps(rate: str) -> float:
    """tc's rate syntax (``1gbit``, ``500mbit``) in bits per second (tc's units are SI)."""
    m = re.fullmatch(r"([0-9.]+)\s*([a-z]+)", rate.strip().lower())
    if not m or m.group(2) not in RATE_UNITS:
        raise argparse.ArgumentTypeError(f"rate {rate!r}: write it as tc does, e.g. 1gbit, 10gbit, 500mbit")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="10gbit,3gbit,1gbit",
                    help="link rates to fit, tc's syntax (default %(default)s)")
    ap.add_argument("--burst-us", type=float, default=1000.0,
                    help="token bucket depth in microseconds at the rate, at least 96 KiB (default %(default)s; "
                         "the fixture's default 256 KiB passes 2 ms of traffic at 1 Gbit/s at memory speed)")
    ap.add_argument("--model-rate", default="1gbit", help="the rate of the step, DDP and autotune runs (%(default)s)")
    ap.add_argument("--caps", default="1,4,16,25,64", help="autotune.py's fixed caps, MiB (default %(default)s)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: model_check,ddp,autotune")
    ap.add_argument("--no-pin", action="store_true", help="leave the hosts' processes on every core")
    ap.add_argument("--probe-reps", type=int, help="allreduces per size in each fit (default 7; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run")
    ap.add_argument("--out-dir", default=".", help="where the JSON files go (default: here)")
    ap.add_argument("--rank-probe", action="store_true", help=argparse.SUPPRESS)  # the rank program of part 1
    ap.add_argument("--reps", type=int, default=FULL["probe_reps"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.settings = dict(QUICK if args.quick else FULL)
    if args.probe_reps:
        args.settings["probe_reps"] = args.probe_reps
    args.rates = [r for r in args.rates.split(",") if r]
    for r in [*args.rates, args.model_rate]:
        rate_bps(r)
    args.skip = {s for s in args.skip.split(",") if s}
    return args


# ------------------------------------------------------------------------------------------ rank side


def rank_probe(args: argparse.Namespace) -> None:
    """Under gpucomm-run: raw Gloo allreduces across the hosts; rank 0 writes the samples and the fit."""
    import torch  # noqa: PLC0415

    import gpucomm.torch as hvd  # noqa: PLC0415
    from gpucomm.tuning.costs import fit_alpha_beta, medians  # noqa: PLC0415
    from model_check import GlooProbe  # noqa: PLC0415

    hvd.init()
    torch.set_num_threads(1)
    probe = GlooProbe()
    probe.sample(1)  # warm: connections, TCP windows
    samples = probe.sample(args.reps)
    if hvd.rank() == 0:
        fit = fit_alpha_beta(medians(samples))
        Path(args.json).write_text(json.dumps({"ranks": hvd.size(), "local_size": hvd.local_size(),
                                               "samples": samples, "medians": medians(samples),
                                               "fit": fit.to_dict()}))
        print(f"alpha {fit.alpha_s * 1e6:.0f} us, bandwidth {fit.bandwidth_Bps * 8 / 1e9:.3f} Gbit/s")
    hvd.shutdown()


# ------------------------------------------------------------------------------------------ driver side


class Jobs:
    """2-rank jobs on a cluster, one rank per host, launched from node0 (pinned like the host)."""

    def __init__(self, c, pin: bool, out: Path) -> None:
        self.c, self.pin, self.out, self.log = c, pin, out, []

    def run(self, name: str, script: str, *script_args: str, timeout: float) -> dict:
        from tests.harness import PYTHON, launcher_cmd  # noqa: PLC0415

        c = self.c
        cmd = launcher_cmd("-np", "2", "-H", "node0:1,node1:1", *c.launcher_flags(), PYTHON, script, *script_args)
        if self.pin:
            cmd = ["taskset", "-c", "0", *cmd]
        t0, load = time.monotonic(), os.getloadavg()[0]
        r = c.run(c.hosts[0], cmd, timeout=timeout, env={"GPUCOMM_TIMEOUT": "120"})
        took = time.monotonic() - t0
        left = c.leftovers()
        entry = {"job": name, "command": " ".join(map(str, cmd[cmd.index(PYTHON, 3):])), "seconds": round(took, 1),
                 "returncode": r.returncode, "leftovers": left,
                 "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}  # before, after: other work?
        self.log.append(entry)
        print(f"--- {name}: exit {r.returncode} in {took:.0f} s" + (f", left behind: {left}" if left else ""),
              flush=True)
        print(r.stdout.rstrip(), flush=True)
        if r.returncode != 0:
            print(r.stderr[-4000:], flush=True)
            raise RuntimeError(f"{name} failed (exit {r.returncode})")
        return entry


def pin_hosts(c) -> dict[str, list[int]]:
    """Pin each host's sshd (so every session and rank it starts) to core ``index % cores``."""
    from tests.cluster import admin  # noqa: PLC0415

    cores = sorted(os.sched_getaffinity(0))
    pinned = {}
    for h in c.hosts:
        core = cores[h.index % len(cores)]
        admin("taskset", "-a", "-p", "-c", str(core), str(h.sshd.proc.pid))
        pinned[h.name] = [core]
    return pinned


def burst_bytes(rate: str, burst_us: float) -> int:
    """The token bucket's depth for ``rate``: ``burst_us`` of traffic at the rate, at least 96 KiB
    (so that a 64 KiB TCP segment burst, GSO's largest, passes without being cut up)."""
    return max(96 << 10, int(rate_bps(rate) / 8 * burst_us * 1e-6))


def limit(c, rate: str | None, burst: int | None = None) -> None:
    """Every host's link limited to ``rate`` both ways with a bucket of ``burst`` bytes (None: the
    fixture's default, 256 KiB), or unlimited (``rate`` None)."""
    from tests.cluster import admin  # noqa: PLC0415

    for h in c.hosts:
        if rate is None:
            for ns, dev in ((h.netns, "eth0"), (c.switch, h.ports[0])):
                admin("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        elif burst is None:
            c.limit(h, rate)
        else:
            c.limit(h, rate, burst=f"{burst}b")


def fit_row(label: str, configured: float | None, probe: dict) -> dict:
    alg = probe["fit"]["bandwidth_Bps"]
    n = probe["ranks"]
    bus = alg * 2 * (n - 1) / n  # what each direction of a link carries
    row = {"link": label, "configured_bps": configured, "alpha_s": probe["fit"]["alpha_s"],
           "algorithm_bandwidth_Bps": alg, "bus_bandwidth_Bps": bus, "fitted_bps": bus * 8,
           "medians": probe["medians"]}
    big, t_big = probe["medians"][-1]  # the largest message alone: its rate, α aside
    row["largest_message_bps"] = big / t_big * 2 * (n - 1) / n * 8
    if configured:
        row["ratio"] = bus * 8 / configured
        row["ratio_to_payload_ceiling"] = bus * 8 / (configured * TCP_PAYLOAD_SHARE)
        row["within_10_percent"] = abs(row["ratio"] - 1) <= 0.10
    return row


def model_plans(mc: dict) -> dict:
    """The step model's prediction for each plan of the conv net (optimizer_vs_ddp's variants) from
    model_check's rank-0 median profile and its first Gloo curve at the shaped rate."""
    import math  # noqa: PLC0415

    from gpucomm.tuning.costs import MeasuredCurve, fit_alpha_beta, medians  # noqa: PLC0415
    from gpucomm.tuning.policies import capped_buckets  # noqa: PLC0415
    from gpucomm.tuning.profile import Profile  # noqa: PLC0415
    from gpucomm.tuning.step import Overheads, simulate  # noqa: PLC0415

    model = next((m for m in mc["models"] if m["model"] == "cnn10m"), None)
    if model is None:
        return {}
    prof = Profile.from_dict(model["profile_rank0"])
    p = model["profile_rank0"]
    ready, sizes = (prof.ready_s, prof.sizes) if prof else (p["ready_s"], p["sizes"])
    fwd, bwd, upd = (prof.forward_s, prof.backward_s, prof.update_s) if prof else (p["forward_s"], p["backward_s"],
                                                                                  p["update_s"])
    curve = MeasuredCurve.from_samples([tuple(s) for s in mc["gloo_samples"]])
    line = fit_alpha_beta(medians([tuple(s) for s in mc["gloo_samples"]]))
    overheads = Overheads(hook_Bps=mc.get("hook_copy_Bps", math.inf))
    import torch  # noqa: PLC0415

    from gpucomm.dataplane.fusion import plan_by_readiness  # noqa: PLC0415

    # what a default DistributedOptimizer runs from step 2 on: its buckets re-cut where backward pauses
    recut = [list(b.param_indices) for b in plan_by_readiness([torch.empty(n // 4) for n in sizes],
                                                               [t * 1e6 for t in ready])]
    plans = {"gpucomm default, re-cut (as run)": recut,
             "gpucomm default, first cut": model["plans"]["default"]["buckets"],
             "optimal (model's plan)": model["plans"]["optimal"]["buckets"],
             "ddp (1 MiB first, 25 MiB caps)": capped_buckets(sizes, first_bytes=1 << 20, cap_bytes=25 << 20,
                                                              rule="ddp")}
    out = {}
    for name, bk in plans.items():
        out[name] = {"buckets": len(bk)}
        for proc in ("dedicated", "shared"):
            for cname, cost in (("curve", curve), ("line", line)):
                s = simulate(ready, sizes, bk, cost, overheads=overheads, forward_s=fwd, backward_s=bwd, update_s=upd,
                             processor=proc)
                out[name][f"{proc}_{cname}_step_s"] = s.step_s
                if cname == "curve":
                    out[name][f"{proc}_exposed_s"] = s.exposed_s
                    out[name][f"{proc}_comm_s"] = s.comm_s
    return out


def drive(args: argparse.Namespace) -> None:
    from tests.cluster import cluster, unavailable  # noqa: PLC0415

    reason = unavailable()
    if reason:
        raise SystemExit(f"shaped_links.py: cannot make namespace hosts here: {reason}")
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    s = args.settings
    report: dict = {"benchmark": "shaped_links", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "cpus": os.cpu_count(), "load_average_before": os.getloadavg(), "settings": s,
                    "model_rate": args.model_rate, "fits": []}
    t_all = time.monotonic()
    with cluster(2) as c:
        report["cluster_start_s"] = c.start_seconds
        report["pinned"] = pin_hosts(c) if not args.no_pin else None
        jobs = Jobs(c, not args.no_pin, out)
        script = str(HERE / "shaped_links.py")
        # the unshaped ceiling; each rate with a shallow bucket; the model's rate also with the fixture's
        # default 256 KiB bucket, which lets the small messages through at memory speed
        links = [(None, None), *[(r, burst_bytes(r, args.burst_us)) for r in args.rates], (args.model_rate, None)]
        for rate, burst in links:
            limit(c, rate, burst)
            label = "unshaped" if rate is None else f"{rate}" + ("" if burst else "-burst256k")
            path = out / f"probe_{label}.json"
            jobs.run(f"probe {label}", script, "--rank-probe", "--reps", str(s["probe_reps"]), "--json", str(path),
                     timeout=240)
            row = fit_row(label, rate_bps(rate) if rate else None, json.loads(path.read_text()))
            row["burst_bytes"] = None if rate is None else (burst or 256 << 10)
            if rate is not None and report["fits"]:
                row["ratio_to_unshaped"] = row["fitted_bps"] / report["fits"][0]["fitted_bps"]
            report["fits"].append(row)
        limit(c, args.model_rate, burst_bytes(args.model_rate, args.burst_us))
        report["model_rate_burst_bytes"] = burst_bytes(args.model_rate, args.burst_us)
        tag = args.model_rate
        if "model_check" not in args.skip:
            path = out / f"model_check_{tag}.json"
            jobs.run("model_check", str(HERE / "model_check.py"), "--rounds", str(s["mc_rounds"]), "--steps",
                     str(s["mc_steps"]), "--processor", "dedicated", "--json", str(path), timeout=600)
            mc = json.loads(path.read_text())
            report["model_check"] = [
                {"model": m["model"], "plan": plan, "buckets": len(p["buckets"]),
                 "alone_step_s": max(m["alone_step_s"]), "predicted_s": p["predicted_step_s"],
                 "measured_s": p["measured_step_s"], "error": p["error"], "error_range": p["error_range"],
                 "shared_predicted_s": p["other_processor_step_s"],
                 "shared_error": p["other_processor_step_s"] / p["measured_step_s"] - 1,
                 "alpha_beta_error": p["alpha_beta_error"]}
                for m in mc["models"] for plan, p in m["plans"].items()]
            report["model_plans_cnn10m"] = model_plans(mc)
        if "ddp" not in args.skip:
            path = out / f"optimizer_vs_ddp_cnn10m_{tag}.json"
            jobs.run("optimizer_vs_ddp", str(HERE / "optimizer_vs_ddp.py"), "--model", "cnn10m", "--rounds",
                     str(s["ovd_rounds"]), "--steps-per-round", str(s["ovd_steps"]), "--warmup", str(s["ovd_warmup"]),
                     "--json", str(path), timeout=600)
            report["optimizer_vs_ddp"] = summarize_ovd(json.loads(path.read_text()))
        if "autotune" not in args.skip:
            path = out / f"autotune_cnn10m_{tag}.json"
            jobs.run("autotune", str(HERE / "autotune.py"), "--model", "cnn10m", "--caps", args.caps, "--rounds",
                     str(s["at_rounds"]), "--steps", str(s["at_steps"]), "--json", str(path), timeout=600)
            at = json.loads(path.read_text())
            job = at["median_step_s"]
            best = at["best_fixed_cap"]
            report["autotune"] = {"median_step_s": job, "best_fixed_cap": best,
                                  "autotune_vs_default": job["autotune"] / job["default"],
                                  "autotune_vs_best_cap": job["autotune"] / job[best],
                                  "autotune_vs_ddp": job["autotune"] / job["ddp"], "tuning_steps": at["tuning_steps"],
                                  "chosen": next((r for r in at["trial"] if r.get("chosen") == "1"), None)}
        report["jobs"] = jobs.log
    report["cluster_stop_s"] = c.stop_seconds
    report["seconds"] = time.monotonic() - t_all
    report["load_average_after"] = os.getloadavg()
    print_table(report)
    (out / "shaped_links.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'shaped_links.json'} ({report['seconds']:.0f} s in all)")


def summarize_ovd(d: dict) -> dict:
    """The parts of optimizer_vs_ddp's JSON the table shows (it is kept whole beside)."""
    keep = {}
    for key in ("variants", "median_step_s", "step_s", "ratios", "round_ratios", "quartiles"):
        if key in d:
            keep[key] = d[key]
    return keep or d


def print_table(r: dict) -> None:
    print("\n== link rate from the alpha-beta fit (2 hosts, 1 rank each; bus bandwidth = algorithm bandwidth at 2 "
          "ranks)")
    print(f"{'link':18s} {'configured':>11s} {'fitted':>12s} {'ratio':>7s} {'/payload':>9s} {'alpha':>9s} "
          f"{'32 MiB alone':>13s}")
    for f in r["fits"]:
        conf = f"{f['configured_bps'] / 1e9:.2f} Gb/s" if f["configured_bps"] else "-"
        ratio = f"{f['ratio']:.3f}" if "ratio" in f else "-"
        pay = f"{f['ratio_to_payload_ceiling']:.3f}" if "ratio" in f else "-"
        print(f"{f['link']:18s} {conf:>11s} {f['fitted_bps'] / 1e9:8.3f} Gb/s {ratio:>7s} {pay:>9s} "
              f"{f['alpha_s'] * 1e6:6.0f} us {f['largest_message_bps'] / 1e9:8.3f} Gb/s")
    if "model_check" in r:
        print(f"\n== step model vs measured 2-host step at {r['model_rate']} (processor 'dedicated'; 'shared' beside)")
        print(f"{'model':9s} {'plan':8s} {'bk':>3s} {'alone ms':>9s} {'pred ms':>8s} {'meas ms':>8s} {'error':>7s} "
              f"{'range':>15s} {'shared err':>10s}")
        for m in r["model_check"]:
            lo, hi = m["error_range"]
            print(f"{m['model']:9s} {m['plan']:8s} {m['buckets']:3d} {m['alone_step_s'] * 1e3:9.1f} "
                  f"{m['predicted_s'] * 1e3:8.1f} {m['measured_s'] * 1e3:8.1f} {m['error'] * 100:+6.1f}% "
                  f"{lo * 100:+6.1f}..{hi * 100:+5.1f}% {m['shared_error'] * 100:+9.1f}%")
    if r.get("model_plans_cnn10m"):
        print("\n== the model's conv-net step per plan (model_check's profile and Gloo curve)")
        for name, p in r["model_plans_cnn10m"].items():
            print(f"  {name:32s} {p['buckets']:3d} buckets: dedicated {p['dedicated_curve_step_s'] * 1e3:7.1f} ms "
                  f"(exposed {p['dedicated_exposed_s'] * 1e3:6.1f}), shared {p['shared_curve_step_s'] * 1e3:7.1f} ms")
    if "optimizer_vs_ddp" in r:
        o = r["optimizer_vs_ddp"]
        print(f"\n== gpucomm vs DDP, conv net, {r['model_rate']} (median of rounds, quartiles; ratios round by round)")
        for name, v in o.get("variants", {}).items():
            q = v["wall_quartiles"]
            best = o.get("round_ratios", {}).get("vs_ddp_best", {}).get(name)
            ratio = (f"  / ddp-best {best['median']:.3f} [{best['quartiles'][0]:.3f}, {best['quartiles'][1]:.3f}]"
                     if best else "")
            print(f"  {v['label']:14s} {v['wall_s_per_step'] * 1e3:7.1f} ms [{q[0] * 1e3:.1f}, {q[1] * 1e3:.1f}]"
                  + ratio)
    if "autotune" in r:
        a = r["autotune"]
        print(f"\n== autotune at {r['model_rate']}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in
                                                                  a["median_step_s"].items()))
        print(f"   autotune/default {a['autotune_vs_default']:.3f}, autotune/best cap ({a['best_fixed_cap']}) "
              f"{a['autotune_vs_best_cap']:.3f}, autotune/ddp {a['autotune_vs_ddp']:.3f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank_probe:
        rank_probe(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
