"""benchmarks/train.py: a quick run at 2 ranks reads a 1-rank baseline and reports, for gpucomm and
each of its anchors (DDP at its defaults, DDP at its best, no communication), wall and CPU time per
step, ratios round by round and scaling efficiency (table, JSON and PNG); baselines that measured
something else are refused with the difference named. The 1-rank run itself (the one-rank reducer) is
in tests/test_benchmarks_smoke.py."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys

import pytest

from tests.steps import require_step
from tests.harness import PYTHON, ROOT, launcher_cmd, run

QUICK = ("benchmarks/train.py", "--device", "cpu", "--quick", "--models", "cnn", "--rounds", "4",
         "--steps-per-round", "1", "--warmup", "1")
VARIANTS = ["gpucomm", "ddp-default", "ddp-best", "no-comm"]
# model, variant, samples/s per device, total, IQR, ms/step, CPU ms, vs best, vs default, vs floor, scaling eff.
ROW = (r"\[0\]<stdout>:{model}\s+{variant}\s+(?P<dev>[0-9.]+)\s+(?P<tot>[0-9.]+)\s+[0-9.]+-[0-9.]+"
       r"\s+(?P<ms>[0-9.]+)\s+(?P<cpu>[0-9.]+)" + r"\s+[0-9.]+" * 3 + r"\s+(?P<eff>[0-9.]+)%$")


def _load_train():
    """benchmarks/ is not a package: load the script by path (once), as module ``benchmarks_train``."""
    if "benchmarks_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location("benchmarks_train", ROOT / "benchmarks" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["benchmarks_train"]


def _baseline(path, rate: float = 100.0) -> dict:
    """A 1-rank result for ``cnn`` as benchmarks/train.py writes it (the 1-rank run itself is in
    tests/test_benchmarks_smoke.py); made by hand so the 2-rank run below needs no second job."""
    train = _load_train()
    params = sum(p.numel() for p in train.models.build("cnn")[0].parameters())
    variant = {"samples_per_s_per_device": rate, "samples_per_s_total": rate}
    record = {"benchmark": "train", "ranks": 1, "device": "cpu", "batch_size": 8, "threads_per_rank": 1,
              "models": {"cnn": {"parameters": params, "variants": dict.fromkeys(VARIANTS, variant)}}}
    path.write_text(json.dumps(record))
    return record


@pytest.mark.e2e
def test_two_ranks_report_throughput_ratio_and_scaling_efficiency(tmp_path, request):
    require_step(request.config, "e2e")
    base = _baseline(tmp_path / "one.json")
    two = run(launcher_cmd("-np", "2", PYTHON, *QUICK, "--baseline", str(tmp_path / "one.json"), "--json",
                           str(tmp_path / "two.json"), "--plot", str(tmp_path / "two.png")), timeout=180)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert two.leftovers == []
    out = two.stdout
    assert "[0]<stdout>:cnn on 2 CPU rank(s)" in out
    assert "[0]<stdout>:NCCL socket settings: untouched (ranks do not share a GPU, or no NCCL)" in out
    assert "[0]<stdout>:model        variant              samples/s/device total samples/s" in out
    assert re.search(r"^\[0\]<stdout>:progress: cnn: round 4/4: gpucomm [0-9.]+, ddp-default [0-9.]+, "
                     r"ddp-best [0-9.]+, no-comm [0-9.]+ samples/s", out, re.M)
    for variant in VARIANTS:  # every variant with its wall and CPU ms per step and its efficiency
        assert re.search(ROW.format(model="cnn", variant=variant), out, re.M), (variant, out)
    for anchor in ("DDP-best", "DDP-default"):
        assert re.search(rf"^\[0\]<stdout>:throughput, cnn: gpucomm / {anchor} [0-9.]+ \(per-round ratios: median",
                         out, re.M), anchor
    assert re.search(r"^\[0\]<stdout>:added over no-comm, cnn, wall / CPU ms per step: gpucomm -?[0-9.]+ / -?[0-9.]+; "
                     r"ddp-default .*; ddp-best .*; gpucomm / ddp-best added: ", out, re.M)
    assert "one-rank reducer" not in out  # two ranks: the reducer runs anyway
    assert "[1]<stdout>" not in out  # only rank 0 reports

    result = json.loads((tmp_path / "two.json").read_text())
    assert {"benchmark", "ranks", "device", "batch_size", "rounds", "steps_per_round", "warmup", "threads_per_rank",
            "baseline", "notes", "models", "round_orders", "ddp_options", "nccl_sockets", "one_rank_reducer",
            "labels"} <= set(result)
    assert result["ranks"] == 2 and result["baseline"] == str(tmp_path / "one.json") and result["notes"] == []
    assert result["one_rank_reducer"]["applies"] is False and result["labels"]["gpucomm"] == "gpucomm"
    assert result["one_rank_reducer"]["counters"]["gloo_collectives"] > 0  # its gradients went through Gloo
    m = result["models"]["cnn"]
    assert list(m["variants"]) == VARIANTS
    for variant, r in m["variants"].items():
        assert len(r["round_samples_per_s_per_device"]) == len(r["round_cpu_seconds"]) == result["rounds"] == 4
        assert r["samples_per_s_total"] == pytest.approx(2 * r["samples_per_s_per_device"])
        assert r["wall_s_per_step"] > 0 and r["cpu_s_per_step"] >= 0
        one = base["models"]["cnn"]["variants"][variant]["samples_per_s_per_device"]
        assert m["scaling_efficiency"][variant] == pytest.approx(r["samples_per_s_total"] / (2 * one))
    rates = {v: r["round_samples_per_s_per_device"] for v, r in m["variants"].items()}
    for key, anchor in (("vs_ddp_best", "ddp-best"), ("vs_ddp_default", "ddp-default"), ("vs_no_comm", "no-comm")):
        ratio = m["ratios"][key]["gpucomm"]
        assert ratio["round_ratios"] == pytest.approx([g / a for g, a in zip(rates["gpucomm"], rates[anchor])])
        assert ratio["range"][0] <= ratio["quartiles"][0] <= ratio["median"] <= ratio["quartiles"][1] \
            <= ratio["range"][1]
    assert m["ratio_gpucomm_vs_ddp_best"] == m["ratios"]["vs_ddp_best"]["gpucomm"]
    assert m["ratio_gpucomm_vs_ddp_default"]["throughput_ratio"] == pytest.approx(
        m["variants"]["gpucomm"]["samples_per_s_per_device"] / m["variants"]["ddp-default"]["samples_per_s_per_device"])
    added = m["added_over_floor"]
    per_step = {v: [s / result["steps_per_round"] for s in r["round_seconds"]] for v, r in m["variants"].items()}
    assert added["wall_s"]["gpucomm"]["median"] == pytest.approx(
        statistics.median(g - f for g, f in zip(per_step["gpucomm"], per_step["no-comm"])))
    assert (tmp_path / "two.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _base(tmp_path, **changes):
    train = _load_train()
    args = train.parse_args(["--quick", "--device", "cpu"])
    variants = {v: {"samples_per_s_per_device": 5.0} for v in VARIANTS}
    record = {"benchmark": "train", "ranks": 1, "device": "cpu", "batch_size": args.batch_size,
              "models": {"cnn": {"parameters": 10, "variants": variants}}}
    record.update(changes)
    path = tmp_path / "base.json"
    path.write_text(json.dumps(record))
    return train, args, str(path)


@pytest.mark.parametrize("changes, message", [
    ({"ranks": 4}, "its ranks is 4, this run needs 1"),
    ({"batch_size": 64}, "its batch_size is 64, this run needs 8"),
    ({"device": "cuda"}, "its device is 'cuda', this run needs 'cpu'"),
    ({"benchmark": "optimizer_vs_ddp"}, "not a benchmarks/train.py result"),
    ({"models": {}}, "has no 'cnn'"),
    ({"models": {"cnn": {"parameters": 11}}}, "the model changed since the baseline was made"),
    ({"models": {"cnn": {"parameters": 10, "variants": {"gpucomm": {"samples_per_s_per_device": 5.0}}}}},
     "its 'cnn' has no samples/s for ddp-default, ddp-best, no-comm (a partial or hand-edited file"),
    ({"models": {"cnn": {"parameters": 10, "variants": {v: {"samples_per_s_per_device": 5.0}
                                                        for v in ("gpucomm", "ddp", "plain")}}}},
     "made before these variants existed"),  # a baseline from before the anchors: made again, not mixed
])
def test_a_baseline_that_measured_something_else_is_refused(tmp_path, changes, message):
    import torch

    train, args, path = _base(tmp_path, **changes)
    with pytest.raises(SystemExit, match=re.escape(message)):
        train.check_baseline(path, args, torch.device("cpu"), {"cnn": 10})


def test_a_matching_baseline_is_accepted_and_bad_arguments_are_explained(tmp_path, capsys):
    import torch

    train, args, path = _base(tmp_path)
    assert train.check_baseline(path, args, torch.device("cpu"), {"cnn": 10})["ranks"] == 1
    with pytest.raises(SystemExit):
        train.parse_args(["--models", "cnn,vgg"])
    assert "--models: unknown vgg" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--rounds", "1"])
    assert "at least 2" in capsys.readouterr().err
