"""``python -m gpucomm.scaling`` and the transcribed architectures behind it: parameter totals
against the published counts, a profile measured from a ``module:callable``, saved and reloaded,
an analytic profile of a built-in model, and the errors that name what to fix."""

from __future__ import annotations

import json

import pytest
import torch

from gpucomm.scaling import zoo
from gpucomm.scaling.cli import main
from gpucomm.tuning.profile import Profile
from tests.harness import PYTHON, ROOT, run


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_transcribed_architectures_match_published_parameter_counts(name):
    with torch.device("meta"):
        model, shape = zoo.build(name)
    assert sum(p.numel() for p in model.parameters()) == zoo.PUBLISHED_PARAMETERS[name]
    with torch.no_grad():  # and they run: one batch of the declared sample shape gives 1000 scores
        out = model(torch.empty(2, *shape, device="meta"))
    assert tuple(out.shape) == (2, 1000)


def test_profile_of_a_callable_is_saved_and_predicts_shapes(tmp_path, capsys):
    prof_path, out_path = tmp_path / "p.json", tmp_path / "out.json"
    code = main(["--model", "tests.test_scaling_models:tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                 "--save-profile", str(prof_path), "--json", str(out_path), "--gpus-per-node", "4",
                 "--nodes", "1,2", "--intra", "pci", "--cc", "60", "--nic-gbps", "25", "--show-plans"])
    assert code == 0
    text = capsys.readouterr().out
    assert "model tests.test_scaling_models:tiny: 6 gradients" in text
    assert "best plan at 8 GPUs" in text and "bucket 0:" in text
    prof = Profile.load(str(prof_path))
    assert prof.names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert prof.sizes == [64 * 256 * 4, 256 * 4, 256 * 256 * 4, 256 * 4, 256 * 10 * 4, 10 * 4]
    assert prof.ready_s[4] <= prof.ready_s[0]  # backward: the last layer's gradient first
    doc = json.loads(out_path.read_text())
    rows = doc["shapes"]
    assert [r["gpus"] for r in rows] == [4, 8]
    for r in rows:
        assert sorted(i for b in r["buckets"] for i in b) == list(range(6))
        assert 0 < r["efficiency"] <= 1.0 and r["samples_per_s"] == pytest.approx(16 * r["gpus"] / r["step_s"])


def test_saved_profile_with_a_link_model_and_a_plot(tmp_path, capsys):
    prof = Profile("hand", 8, ["a", "b", "c"], [4 << 20, 4 << 20, 8 << 20], [0.03, 0.02, 0.01], 0.01, 0.03, 0.005,
                   source="hand-made")
    path = tmp_path / "p.json"
    prof.save(str(path))
    png = tmp_path / "eff.png"
    assert main(["--profile", str(path), "--nodes", "1,4", "--gpus-per-node", "2", "--link-latency-us", "10",
                 "--link-gbps", "10", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "model hand: 3 gradients, 16.0 MiB" in text
    # 2 GPUs: a ring of 2 steps, 10 us each, 1/2 of the data per step at 1.25 GB/s
    line = next(ln for ln in text.splitlines() if ln.split()[:2] == ["2", "1"])
    assert float(line.split()[2]) > prof.step_s * 1e3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analytic_profile_of_a_builtin(capsys):
    assert main(["--model", "vgg16", "--analytic", "--step-time", "0.489", "--batch-size", "64", "--nodes", "1,128",
                 "--gpus-per-node", "4", "--intra", "pci", "--cc", "60", "--nic-gbps", "25",
                 "--algorithm", "ring"]) == 0
    text = capsys.readouterr().out
    assert "model vgg16: 32 gradients, 527.8 MiB; batch 64 per GPU; one device: step 489.0 ms" in text


def test_lists_of_shapes_are_each_predicted_and_stragglers_lengthen_every_step(tmp_path, capsys):
    base = ["--model", "resnet50", "--analytic", "--step-time", "0.097", "--nodes", "1,16", "--intra", "pci",
            "--cc", "70"]
    out = tmp_path / "grid.json"
    assert main(base + ["--gpus-per-node", "4,8", "--nic-gbps", "25,100", "--algorithm", "ring,tree",
                        "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["shapes"]
    combos = [(r["gpus_per_node"], r["nic_gbps"], r["algorithm"]) for r in rows]
    assert combos == [(g, n, a) for g in (4, 8) for n in (25.0, 100.0) for a in ("ring", "tree") for _ in (1, 16)]
    assert [r["gpus"] for r in rows[:2]] == [4, 64] and [r["gpus"] for r in rows[-2:]] == [8, 128]
    assert text.count("shape: ") == 8 and "shape: 8/node, 100 Gbit/s, tree" in text
    slow, fast = (next(r for r in rows if (r["gpus_per_node"], r["nic_gbps"], r["algorithm"], r["nodes"]) == key)
                  for key in ((8, 25.0, "ring", 16), (8, 100.0, "ring", 16)))
    assert slow["step_s"] > fast["step_s"]  # a slower NIC never makes the step shorter
    assert main(base + ["--gpus-per-node", "8", "--step-noise-cv", "0.04", "--json", str(out)]) == 0
    noisy = json.loads(out.read_text())["shapes"]
    assert main(base + ["--gpus-per-node", "8", "--json", str(out)]) == 0
    quiet = json.loads(out.read_text())["shapes"]
    from gpucomm.tuning.straggler import expected_max_normal

    for a, b in zip(noisy, quiet):  # the wait for the slowest of n ranks, on top of the same plan
        assert a["step_s"] - b["step_s"] == pytest.approx(0.04 * 0.097 * expected_max_normal(a["gpus"]), rel=1e-6)
        assert a["efficiency"] < b["efficiency"] or a["gpus"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--model", "nosuchmodule:build"], "cannot import 'nosuchmodule'"),
    (["--model", "tests.test_scaling_models:not_a_triple", "--device", "cpu"], "must return (model, batch, loss_fn)"),
    (["--model", "resnet"], "write a built-in name or module:callable"),
    (["--model", "tests.test_scaling_models:tiny", "--analytic", "--step-time", "1"], "--analytic needs a built-in model"),
])
def test_bad_models_are_named(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    ([], "give exactly one of --model"),
    (["--model", "vgg16", "--analytic"], "--analytic needs --step-time"),
    (["--model", "vgg16", "--link-gbps", "10"], "go together"),
    (["--model", "vgg16", "--nodes", "0"], "give one or more counts >= 1"),
    (["--model", "vgg16", "--algorithm", "ring,mesh"], "give one or more of auto, ring, tree"),
    (["--model", "vgg16", "--nic-gbps", "25,-1"], "give one or more numbers > 0"),
    (["--model", "vgg16", "--step-noise-cv", "-0.1"], "give a fraction >= 0"),
    (["--model", "vgg16", "--transport", "tcp,udp"], "give one or more of rdma, tcp"),
    (["--model", "vgg16", "--socket-threads", "2"], "add --transport tcp"),
    (["--model", "vgg16", "--transport", "rdma", "--tcp-flow-gbs", "2"], "add --transport tcp"),
    (["--model", "vgg16", "--transport", "tcp", "--socket-threads", "17"], "--socket-threads=17"),
    (["--model", "vgg16", "--transport", "tcp", "--socket-threads", "8", "--socket-nsocks", "9"],
     "at most 64 per connection"),
    (["--model", "vgg16", "--transport", "tcp", "--socket-nsocks", "0"], "NCCL_NSOCKS_PERTHREAD must be >= 1"),
    (["--model", "vgg16", "--transport", "tcp", "--tcp-host-ns", "0.3"], "give SEND,RECV nanoseconds per byte"),
    (["--model", "vgg16", "--transport", "tcp", "--tcp-flow-gbs", "0"], "flow_gbs=0.0 must be a number > 0"),
    (["--model", "vgg16", "--transport", "tcp", "--link-gbps", "10", "--link-latency-us", "5"],
     "--transport applies to NCCL's model"),
])
def test_bad_arguments_exit_2_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_transport_tcp_beside_rdma(tmp_path, capsys):
    """``--transport`` defaults to rdma (the output of before); tcp keeps NCCL's picks and caps each
    network channel at the socket transport's rate, so VGG-16 at 40 Gbit/s loses efficiency."""
    common = ["--model", "vgg16", "--analytic", "--step-time", "0.428", "--batch-size", "64", "--gpus-per-node", "4",
              "--nodes", "1,16", "--nic-gbps", "40", "--intra", "pci", "--cc", "60", "--algorithm", "ring"]
    assert main(common + ["--json", str(tmp_path / "rdma.json")]) == 0
    default = capsys.readouterr().out
    assert "socket" not in default and "ring, tcp" not in default and "shape: 4/node, 40 Gbit/s, ring;" in default
    out = tmp_path / "both.json"
    assert main(common + ["--transport", "rdma,tcp", "--tcp-flow-gbs", "1.5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tcp: NCCL's socket transport, 0 helper thread(s) x 1 socket(s)" in text
    assert "shape: 4/node, 40 Gbit/s, ring, tcp; a network channel runs at 1.50 GB/s (NCCL assumes 5.00)" in text
    doc = json.loads(out.read_text())
    rows = {(r["transport"], r["gpus"]): r for r in doc["shapes"]}
    assert doc["socket"]["flow_gbs"] == 1.5 and doc["socket"]["threads"] == 0
    assert rows["tcp", 4]["efficiency"] == rows["rdma", 4]["efficiency"]  # one node: no network
    assert rows["tcp", 64]["efficiency"] < rows["rdma", 64]["efficiency"] - 0.1
    assert rows["tcp", 64]["channel_gbs"] == 1.5 and rows["tcp", 64]["nccl_channel_gbs"] == 5.0
    assert rows["rdma", 64]["channel_gbs"] == rows["rdma", 64]["nccl_channel_gbs"] == 5.0
    assert json.loads((tmp_path / "rdma.json").read_text())["shapes"][1]["efficiency"] == \
        pytest.approx(rows["rdma", 64]["efficiency"])
    # more threads and sockets (AWS's 2 x 8) lift the channel back to the NIC's rate
    assert main(common + ["--nodes", "16", "--transport", "tcp", "--socket-threads", "2", "--socket-nsocks", "8",
                          "--tcp-flow-gbs", "1.5", "--json", str(out)]) == 0
    assert "a network channel runs at 5.00 GB/s" in capsys.readouterr().out
    assert json.loads(out.read_text())["shapes"][0]["efficiency"] == pytest.approx(rows["rdma", 64]["efficiency"])


def test_module_entry_point_runs():
    r = run([PYTHON, "-m", "gpucomm.scaling", "--model", "resnet50", "--analytic", "--step-time", "0.097",
             "--nodes", "1,2"], timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "best plan at 16 GPUs" in r.stdout
