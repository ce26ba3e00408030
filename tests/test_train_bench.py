"""benchmarks/train.py as documented: a quick CPU run at 1 rank writes the baseline, a quick run at
2 ranks reads it and reports scaling efficiency; table, JSON and PNG; refused baselines."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from tests.launcher_util import PYTHON, ROOT, launcher_cmd, run

MODELS = ("cnn", "transformer")
QUICK = ("benchmarks/train.py", "--device", "cpu", "--quick", "--models", ",".join(MODELS))
# model, variant, samples/s per device, total, IQR, vs DDP, then "vs plain" and "scaling eff." in rest
ROW = (r"\[0\]<stdout>:{model}\s+{variant}\s+(?P<dev>[0-9.]+)\s+(?P<tot>[0-9.]+)\s+[0-9.]+-[0-9.]+\s+[0-9.]+"
       r"\s+(?P<rest>.*)$")


def _load_train():
    """benchmarks/ is not a package: load the script by path (once), as module ``benchmarks_train``."""
    if "benchmarks_train" not in sys.modules:
        spec = importlib.util.spec_from_file_location("benchmarks_train", ROOT / "benchmarks" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["benchmarks_train"]


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    """The documented verification chain: 1 rank (the baseline), then 2 ranks against it."""
    d = tmp_path_factory.mktemp("train_bench")
    one = run(launcher_cmd("-np", "1", PYTHON, *QUICK, "--json", str(d / "one.json")), timeout=90)
    assert one.returncode == 0, one.stderr
    two = run(launcher_cmd("-np", "2", PYTHON, *QUICK, "--baseline", str(d / "one.json"), "--json",
                           str(d / "two.json"), "--plot", str(d / "two.png")), timeout=90)
    assert two.returncode == 0, two.stderr
    return d, one, two


def test_one_rank_run_reports_plain_training_and_is_a_baseline(chained):
    d, one, _ = chained
    assert one.leftovers == []
    result = json.loads((d / "one.json").read_text())
    assert result["benchmark"] == "train" and result["ranks"] == 1 and result["device"] == "cpu"
    for model in MODELS:
        m = result["models"][model]
        assert set(m["variants"]) == {"gpucomm", "ddp", "plain"}  # DDP exists at world size 1 too
        assert set(m["overhead_vs_plain"]) == {"gpucomm", "ddp"}
        assert m["scaling_efficiency"] is None
        for variant in ("gpucomm", "ddp", "plain"):
            assert re.search(ROW.format(model=model, variant=variant), one.stdout, re.M), one.stdout
    assert "[0]<stdout>:1-rank run: pass its JSON as --baseline" in one.stdout


def test_two_ranks_report_throughput_ratio_and_scaling_efficiency(chained):
    d, _, two = chained
    assert two.leftovers == []
    out = two.stdout
    assert "[0]<stdout>:cnn, transformer on 2 CPU rank(s)" in out
    assert "[0]<stdout>:model        variant  samples/s/device total samples/s" in out
    assert re.search(r"^\[0\]<stdout>:progress: cnn: round 6/6: gpucomm [0-9.]+, ddp [0-9.]+ samples/s", out, re.M)
    for model in MODELS:
        for variant in ("gpucomm", "ddp"):
            row = re.search(ROW.format(model=model, variant=variant), out, re.M)
            assert row, out
            assert float(row["tot"]) == pytest.approx(2 * float(row["dev"]), rel=1e-3, abs=0.1)
            assert re.search(r"[0-9.]+%$", row["rest"].strip()), row["rest"]  # the efficiency column
        assert re.search(rf"^\[0\]<stdout>:gpucomm / DDP throughput, {model}: [0-9.]+ \(per-round ratios: median",
                         out, re.M)
    assert "[1]<stdout>" not in out  # only rank 0 reports

    result, base = (json.loads((d / f).read_text()) for f in ("two.json", "one.json"))
    assert {"benchmark", "ranks", "device", "batch_size", "rounds", "steps_per_round", "warmup", "threads_per_rank",
            "baseline", "notes", "models"} <= set(result)
    assert result["ranks"] == 2 and result["baseline"] == str(d / "one.json")
    for model in MODELS:
        m = result["models"][model]
        assert set(m["variants"]) == {"gpucomm", "ddp"} and m["overhead_vs_plain"] is None
        for variant, r in m["variants"].items():
            assert len(r["round_samples_per_s_per_device"]) == result["rounds"]
            assert r["samples_per_s_total"] == pytest.approx(2 * r["samples_per_s_per_device"])
            one = base["models"][model]["variants"][variant]["samples_per_s_per_device"]
            assert m["scaling_efficiency"][variant] == pytest.approx(r["samples_per_s_total"] / (2 * one))
        ratio = m["ratio_gpucomm_vs_ddp"]
        assert ratio["throughput_ratio"] == pytest.approx(m["variants"]["gpucomm"]["samples_per_s_per_device"]
                                                          / m["variants"]["ddp"]["samples_per_s_per_device"])
        assert len(ratio["round_ratios"]) == result["rounds"]
        assert ratio["range"][0] <= ratio["median"] <= ratio["range"][1]
    png = (d / "two.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _base(tmp_path, **changes):
    train = _load_train()
    args = train.parse_args(["--quick", "--device", "cpu"])
    record = {"benchmark": "train", "ranks": 1, "device": "cpu", "batch_size": args.batch_size,
              "models": {"cnn": {"parameters": 10}}}
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
