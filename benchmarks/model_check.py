"""Predicted beside measured: the step model of ``gpucomm.tuning`` against real 2-rank CPU steps.

    gpucomm-run -np 2 python benchmarks/model_check.py [--models mlp10m,cnn10m,resnet18] [--json model_check.json]
    gpucomm-run -np 2 -H a:1,b:1 python benchmarks/model_check.py --processor dedicated   # across 2 hosts

In one 2-rank job (one thread per rank), rank 0 fits the cost curve and both ranks profile and train:

1. **Gloo's cost curve.** Raw ``ProcessGroupGloo`` allreduces of 64 KiB .. 32 MiB (the bucket sizes
   these models have), each after a barrier, interleaved across sizes; an α-β line is fitted to the
   medians (``costs.fit_alpha_beta``, relative least squares). This first fit chooses the optimal
   plan; every round samples the curve again (3 per size) for its own prediction.
2. **The hooks' copy.** On CPU each gradient is copied, averaged, into its bucket as its hook fires
   (direct buckets): the bandwidth of that scaled copy is timed on a 4 MiB tensor.
3. **Rounds**, each variant in turn (the order rotates): ``profile`` — each rank alone (no
   communication; both ranks compute at once, as in training), ``profile_model`` hooks stamp when
   every gradient is ready; ``gloo`` — the cost curve sampled again; ``default`` — 2-rank steps
   with ``DistributedOptimizer`` and its default buckets (``fusion.plan_buckets``; the re-cut
   after step 1 is turned off so that the plan predicted is the plan run); ``optimal`` — 2-rank
   steps with the buckets the exact dynamic program (``optimal.optimal_plan``) chose from a first
   profile, passed as ``groups=``.
4. **Prediction**, per round, from that round's profiles and Gloo samples: ``step.simulate`` with
   the cost curve through that round's measured medians (``costs.MeasuredCurve``; ``--cost line``:
   the α-β line fitted to them, whose error is printed beside either way: Gloo here moves 16 MiB in
   11 ms and 32 MiB in 26 ms, a bend no single line follows) and the copy bandwidth; a synchronous step waits for
   the slower rank, so the job's prediction is the larger of the two ranks', plus the wait that
   per-step jitter adds (``sync_wait``: the median of the ranks' per-step maxima in that round's
   profiles less the larger median; on a shared 2-core machine steps vary by several percent). The processor model
   is ``shared`` when ranks x threads fill the cores (here 2 x 1 on 2): Gloo's copies and sums
   need the cores backward uses, so nothing hides; the ``dedicated`` (GPU-like) prediction is
   printed beside it (``--processor dedicated|shared`` picks one: across hosts on a slow link, where
   the collective waits on the wire rather than on the cores, ``dedicated``; see
   ``benchmarks/shaped_links.py``). Each round's prediction is compared with that round's measured job step
   (the slower rank's median), so load that drifts while the benchmark runs (the machine may be
   shared) hits both; the report gives the medians over rounds and the range of their errors.

Models: ``mlp10m`` and ``cnn10m`` from ``examples/models.py`` (batch 32), ResNet-18 from
``gpucomm.scaling.zoo`` on 3x64x64 images (batch 16: 224x224 would take seconds per step on one
core). Prints a table; writes JSON. ``--quick``: 2 rounds of 2 steps (a smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ["GPUCOMM_FUSION_BY_READINESS"] = "0"  # the plan predicted is the plan run (see the doc)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from bench_stats import write_json  # noqa: E402

import gpucomm.torch as hvd  # noqa: E402
from gpucomm.dataplane.fusion import plan_buckets  # noqa: E402
from gpucomm.scaling import zoo  # noqa: E402
from gpucomm.tuning.costs import CostFn, MeasuredCurve, fit_alpha_beta, medians  # noqa: E402
from gpucomm.tuning.measure import profile_model  # noqa: E402
from gpucomm.tuning.optimal import optimal_plan  # noqa: E402
from gpucomm.tuning.plans import to_groups  # noqa: E402
from gpucomm.tuning.profile import Profile  # noqa: E402
from gpucomm.tuning.step import Overheads, simulate  # noqa: E402

SPECS = {  # name: (builder, sample shape, batch per rank)
    "mlp10m": (models.mlp10m, (1024,), 32),
    "cnn10m": (models.cnn10m, (3, 32, 32), 32),
    "resnet18": (lambda: zoo.resnet(18), (3, 64, 64), 16),
}
SIZES = [64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20]
FULL = {"rounds": 9, "steps": 5, "fit_reps": 9}
QUICK = {"rounds": 2, "steps": 2, "fit_reps": 3}
ROUND_FIT_REPS = 3  # Gloo samples per size in each round


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp10m,cnn10m,resnet18", help="comma-separated, from %(default)s")
    ap.add_argument("--rounds", type=int, help=f"interleaved rounds (default {FULL['rounds']})")
    ap.add_argument("--steps", type=int, help=f"steps per variant and round (default {FULL['steps']})")
    ap.add_argument("--cost", choices=["measured", "line"], default="measured",
                    help="the collective cost each round's prediction uses: the round's measured Gloo times "
                         "(costs.MeasuredCurve, default) or the α-β line fitted to them; the other is printed beside")
    ap.add_argument("--processor", choices=["auto", "shared", "dedicated"], default="auto",
                    help="the step model's processor (gpucomm.tuning.step): auto (default) is shared when ranks x "
                         "threads fill the cores, else dedicated; dedicated fits a slow link, where the collective "
                         "waits on the wire rather than on the cores")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 2 steps, 3 samples per size")
    ap.add_argument("--json", default="model_check.json")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in SPECS]
    if unknown or not args.models:
        ap.error(f"--models: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(SPECS)}")
    defaults = QUICK if args.quick else FULL
    args.rounds = args.rounds or defaults["rounds"]
    args.steps = args.steps or defaults["steps"]
    args.fit_reps = defaults["fit_reps"]
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    return args


def gloo_group() -> tuple[dist.ProcessGroupGloo, dist.TCPStore]:
    """A raw ProcessGroupGloo on its own store, as gpucomm's CPU schedule builds one: on loopback when
    both ranks share a host, else on the address this host's name resolves to (Gloo's default device),
    with the store on rank 0's host (the launcher's rendezvous address)."""
    one_host = hvd.local_size() == hvd.size()
    store = dist.TCPStore("127.0.0.1", 0, hvd.size(), True, wait_for_workers=False) if hvd.rank() == 0 else None
    port = hvd.broadcast_object(store.port if store else None, 0, name="model_check.port")
    if store is None:
        host = "127.0.0.1" if one_host else os.environ.get("GPUCOMM_RENDEZVOUS_ADDR", "127.0.0.1")
        store = dist.TCPStore(host, port, hvd.size(), False)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if one_host
                     else dist.ProcessGroupGloo.create_default_device()]
    opts._timeout = datetime.timedelta(seconds=300)
    return dist.ProcessGroupGloo(store, hvd.rank(), hvd.size(), opts), store


class GlooProbe:
    """Raw Gloo allreduces of the sizes in ``SIZES`` on a group of their own."""

    def __init__(self) -> None:
        self.pg, self._store = gloo_group()
        self.tensors = {n: torch.ones(n // 4) for n in SIZES}
        for t in self.tensors.values():
            self.pg.allreduce([t]).wait()

    def sample(self, reps: int) -> list[tuple[int, float]]:
        """(bytes, seconds) of ``reps`` allreduces per size, each after a barrier, sizes interleaved."""
        samples = []
        for _ in range(reps):
            for n, t in self.tensors.items():
                self.pg.barrier().wait()
                t0 = time.perf_counter()
                self.pg.allreduce([t]).wait()
                samples.append((n, time.perf_counter() - t0))
        return samples


def copy_bandwidth() -> float:
    """Bytes/s of the hooks' scaled copy into a bucket slot (``torch.mul(g, s, out=slot)``)."""
    g, slot = torch.randn(1 << 20), torch.empty(1 << 20)
    times = []
    for _ in range(25):
        t0 = time.perf_counter()
        torch.mul(g, 0.5, out=slot)
        times.append(time.perf_counter() - t0)
    return g.numel() * g.element_size() / statistics.median(times[5:])


def median_profile(profiles: list[Profile]) -> Profile:
    """Element-wise median of several profiles of one model."""
    p0 = profiles[0]
    med = statistics.median
    return Profile(p0.model, p0.batch_size, p0.names, p0.sizes,
                   [med(p.ready_s[i] for p in profiles) for i in range(len(p0.sizes))],
                   med(p.forward_s for p in profiles), med(p.backward_s for p in profiles),
                   med(p.update_s for p in profiles), p0.device, f"median of {len(profiles)} profile rounds", p0.extra)


def check_model(name: str, args: argparse.Namespace, cost: AlphaBeta, overheads: Overheads,
                probe: GlooProbe) -> dict:
    make, shape, batch = SPECS[name]
    torch.manual_seed(0)
    base = make()
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    local = _copy(base)
    first = profile_model(local, x, loss_fn, steps=args.steps, warmup=1, name=name)
    first = hvd.broadcast_object(first, 0, name=f"model_check.{name}.first")
    plan = optimal_plan(first.ready_s, first.sizes, cost, overheads=overheads, processor=args.processor)
    variants = {}
    for variant in ("default", "optimal"):
        model = _copy(base)
        params = list(model.parameters())
        groups = to_groups(params, [list(b) for b in plan.buckets]) if variant == "optimal" else None
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1e-3, momentum=0.9),
                                       named_parameters=model.named_parameters(), groups=groups)
        variants[variant] = (model, opt)
    default_buckets = [list(b.param_indices) for b in plan_buckets([p.detach() for p in base.parameters()])]

    def train(variant: str, n: int) -> list[float]:
        model, opt = variants[variant]
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x)).backward()
            opt.step()
            out.append(time.perf_counter() - t0)
        return out

    for variant in variants:  # warm-up: the first steps build groups and buffers
        train(variant, 1)
    rounds = []
    order = ["profile", "gloo", "default", "optimal"]
    for r in range(args.rounds):
        this: dict = {}
        for variant in order[r % 4:] + order[:r % 4]:
            if variant == "profile":
                this["profile"] = profile_model(local, x, loss_fn, steps=args.steps, warmup=0, name=name)
            elif variant == "gloo":
                this["gloo"] = probe.sample(ROUND_FIT_REPS)
            else:
                this[variant] = statistics.median(train(variant, args.steps))
        rounds.append(this)
    every = hvd.allgather_object(rounds, name=f"model_check.{name}.results")  # [rank][round]
    buckets = {"default": default_buckets, "optimal": [list(b) for b in plan.buckets]}

    def predict(prof: Profile, bk: list[list[int]], mode: str, curve: CostFn) -> float:
        return simulate(prof.ready_s, prof.sizes, bk, curve, overheads=overheads, forward_s=prof.forward_s,
                        backward_s=prof.backward_s, update_s=prof.update_s, processor=mode).step_s

    round_fits = [fit_alpha_beta(medians(rd["gloo"])) for rd in every[0]]  # rank 0's samples of each round
    round_curves = [MeasuredCurve.from_samples(rd["gloo"]) for rd in every[0]]

    other = "dedicated" if args.processor == "shared" else "shared"
    profs = [median_profile([rd["profile"] for rd in mine]) for mine in every]
    result = {"model": name, "batch_size": batch, "parameters": sum(first.sizes) // 4, "tensors": len(first.sizes),
              "alone_step_s": [p.step_s for p in profs], "profile_rank0": profs[0].to_dict(), "plans": {}}
    for variant, bk in buckets.items():
        per_round = []
        for r in range(args.rounds):
            # a synchronous step waits for the slower rank: each rank's own profile through the model
            line = round_fits[r]
            curve = round_curves[r] if args.cost == "measured" else line
            wait = sync_wait([every[k][r]["profile"] for k in range(len(every))])
            ranks = range(len(every))
            pred = max(predict(every[k][r]["profile"], bk, args.processor, curve) for k in ranks) + wait
            alt = max(predict(every[k][r]["profile"], bk, other, curve) for k in ranks) + wait
            by_line = max(predict(every[k][r]["profile"], bk, args.processor, line) for k in ranks) + wait
            measured = max(every[k][r][variant] for k in ranks)
            per_round.append({"predicted_s": pred, "measured_s": measured, "error": pred / measured - 1,
                              "sync_wait_s": wait, f"{other}_s": alt, "gloo_fit": line.to_dict(),
                              "alpha_beta_predicted_s": by_line, "alpha_beta_error": by_line / measured - 1})
        med = statistics.median
        detail = simulate(profs[0].ready_s, profs[0].sizes, bk, cost, overheads=overheads,
                          forward_s=profs[0].forward_s, backward_s=profs[0].backward_s, update_s=profs[0].update_s,
                          processor=args.processor)
        result["plans"][variant] = {
            "buckets": bk, "bucket_bytes": [sum(first.sizes[i] for i in b) for b in bk], "rounds": per_round,
            "predicted_step_s": med(x["predicted_s"] for x in per_round),
            "measured_step_s": med(x["measured_s"] for x in per_round),
            "error": med(x["error"] for x in per_round),
            "error_range": [min(x["error"] for x in per_round), max(x["error"] for x in per_round)],
            "other_processor_step_s": med(x[f"{other}_s"] for x in per_round),
            "sync_wait_s": med(x["sync_wait_s"] for x in per_round),
            "alpha_beta_error": med(x["alpha_beta_error"] for x in per_round),
            "predicted_rank0_median_profile": detail.to_dict()}
    result["round_gloo_fits"] = [f.to_dict() for f in round_fits]
    return result


def sync_wait(profiles: list[Profile]) -> float:
    """What a synchronous step adds to the slower rank's median step: each step waits for whichever
    rank is slower *on that step*, so the job's step is the median of the per-step maxima, not the
    larger median. Measured from the ranks' profiles of one round (both ranks compute at once, no
    communication; step i of each rank runs at about the same time): that median of maxima less the
    larger of the medians (0 with one rank, or without per-step times). Nothing aligns the ranks'
    steps while they profile (each round starts them together after a collective), so the pairing
    drifts by up to a step's jitter per step: an estimate, not a measurement of the job's waits."""
    steps = [p.extra.get("step_s") or [] for p in profiles]
    n = min(len(s) for s in steps)
    if len(steps) < 2 or n == 0:
        return 0.0
    slowest = [max(s[i] for s in steps) for i in range(n)]
    return max(0.0, statistics.median(slowest) - max(statistics.median(s[:n]) for s in steps))


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy  # noqa: PLC0415

    return copy.deepcopy(model)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    if hvd.size() != 2:
        raise SystemExit(f"model_check.py: run it on 2 ranks (gpucomm-run -np 2 ...), not {hvd.size()}: the "
                         "predictions are for the 2-rank job that this script measures.")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    probe = GlooProbe()
    samples = probe.sample(args.fit_reps)
    cost = fit_alpha_beta(medians(samples))
    hook_Bps = copy_bandwidth()
    cost, hook_Bps, samples = hvd.broadcast_object((cost, hook_Bps, samples), 0, name="model_check.fit")
    overheads = Overheads(hook_Bps=hook_Bps)
    # every core computes (ranks x threads >= cores): Gloo's work needs those cores too
    if args.processor == "auto":
        args.processor = "shared" if hvd.size() * torch.get_num_threads() >= (os.cpu_count() or 1) else "dedicated"
    results = [check_model(name, args, cost, overheads, probe) for name in args.models]
    load_after = os.getloadavg()
    if hvd.rank() == 0:
        busy = max(load_before[0], load_after[0]) > (os.cpu_count() or 1)
        where = "over loopback" if hvd.local_size() == hvd.size() else f"across {hvd.size() // hvd.local_size()} hosts"
        print(f"machine: {os.cpu_count()} CPUs, 2 ranks x 1 thread, Gloo {where}; load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after"
              + (" (above the core count: other work shared the cores; expect noisy rounds)" if busy else ""))
        print(f"Gloo allreduce fit: alpha {cost.alpha_s * 1e6:.0f} us, beta {cost.bandwidth_Bps / 1e9:.2f} GB/s "
              f"(medians: " + ", ".join(f"{b >> 10} KiB {s * 1e3:.2f} ms" for b, s in medians(samples)) + ")")
        print(f"hook copy bandwidth: {hook_Bps / 1e9:.2f} GB/s")
        other = "dedicated" if args.processor == "shared" else "shared"
        print(f"processor model: {args.processor} ({hvd.size()} ranks x 1 thread on {os.cpu_count()} cores); the "
              f"'{other}' column is the other model, for comparison")
        print("per round: prediction from that round's profiles (the slower rank's), beside that round's measured "
              "step; medians over rounds, error = median of the rounds' errors (their range beside)")
        cost_name = "the round's measured Gloo times" if args.cost == "measured" else "the round's alpha-beta line"
        print(f"collective cost: {cost_name}; the 'a-b error' column is the alpha-beta line's error, for comparison")
        print(f"{'model':10s} {'plan':8s} {'buckets':>7s} {'alone ms':>9s} {'predicted ms':>13s} {'measured ms':>12s} "
              f"{'error':>7s} {'range':>15s} {'a-b error':>9s} {other + ' ms':>12s}")
        for r in results:
            for variant, p in r["plans"].items():
                lo, hi = p["error_range"]
                print(f"{r['model']:10s} {variant:8s} {len(p['buckets']):7d} {max(r['alone_step_s']) * 1e3:9.1f} "
                      f"{p['predicted_step_s'] * 1e3:13.1f} {p['measured_step_s'] * 1e3:12.1f} "
                      f"{p['error'] * 100:+6.1f}% {lo * 100:+6.1f}..{hi * 100:+5.1f}% "
                      f"{p['alpha_beta_error'] * 100:+8.1f}% {p['other_processor_step_s'] * 1e3:12.1f}")
        write_json(args.json, {"benchmark": "model_check", "ranks": 2, "threads_per_rank": 1, "rounds": args.rounds,
                               "steps_per_round": args.steps, "cpus": os.cpu_count(), "processor": args.processor,
                               "cost": args.cost,
                               "load_average": {"before": load_before, "after": load_after},
                               "gloo_samples": samples, "gloo_fit": cost.to_dict(),
                               "hook_copy_Bps": hook_Bps, "models": results})
        print(f"wrote {args.json}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
