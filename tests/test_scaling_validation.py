"""``benchmarks/scaling_validation.py``: the claims docs/guide/scaling.md makes about it hold (DDP's 8- and
16-GPU rows within 5 % with the per-gradient cost fitted on the 1-GPU row, and not without it;
Horovod's VGG-16 loses far more than its other two models; with the cluster's ring speed and
straggler noise fitted on Horovod's 16-GPU rows alone, its 128- and 512-GPU efficiencies land within
5 points), computed from public inputs only."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.harness import ROOT


@pytest.fixture(scope="module")
def validation():
    path = ROOT / "benchmarks" / "scaling_validation.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("scaling_validation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ddp_rows_within_five_percent_once_its_cost_per_gradient_is_fitted(validation):
    doc = validation.ddp()
    assert 0 < doc["hook_s_per_gradient"] < 1e-4
    targets = [r for m in doc["models"].values() for r in m["rows"] if r["target"]]
    assert len(targets) == 4
    assert all(abs(r["error"]) < 0.05 for r in targets), [(r["published_s"], r["predicted_s"]) for r in targets]
    assert any(abs(r["uncalibrated_error"]) > 0.05 for r in targets)


def test_horovod_predictions_at_512_gpus(validation):
    effs = {}
    for name, img_s in validation.HOROVOD_BASELINE_IMG_S.items():
        prof = validation.profile(name, validation.HOROVOD_BATCH, validation.HOROVOD_BATCH / img_s)
        nccl = validation.NcclModel(validation.horovod_cluster(512))
        effs[name] = prof.step_s / validation.horovod_step(prof, nccl)
    assert 0 < effs["vgg16"] < effs["resnet101"] <= 1.0 and effs["vgg16"] < effs["inception_v3"] <= 1.0
    assert effs["inception_v3"] - effs["vgg16"] > 0.1  # VGG-16's 528 MiB cannot hide behind its backward


@pytest.fixture(scope="module")
def horovod_doc(validation):
    return validation.horovod()


def test_horovod_constants_are_fitted_on_the_16_gpu_rows_only(validation, horovod_doc, monkeypatch):
    profs = {name: validation.profile(name, validation.HOROVOD_BATCH, validation.HOROVOD_BATCH / img_s)
             for name, img_s in validation.HOROVOD_BASELINE_IMG_S.items()}
    rows = validation.fit_rows(profs, None)
    assert [g for _, g, _ in rows] == [16, 16, 16]
    assert [e for _, _, e in rows] == [validation.HOROVOD_PUBLISHED[n][16] for n in profs]
    # the held-out figures could be anything: the constants do not move
    scrambled = {n: {g: (e if g == 16 else 0.33) for g, e in by_gpus.items()}
                 for n, by_gpus in validation.HOROVOD_PUBLISHED.items()}
    monkeypatch.setattr(validation, "HOROVOD_PUBLISHED", scrambled)
    bw, cv = validation.fit_cluster(profs)
    assert (bw, cv) == (pytest.approx(horovod_doc["ring_bw_gbs"], rel=1e-3), pytest.approx(horovod_doc["cv"], rel=1e-3))


def test_horovod_held_out_rows_within_five_points(horovod_doc):
    assert 1.0 < horovod_doc["ring_bw_gbs"] <= 3.125  # at most the NIC's line rate
    assert 0 < horovod_doc["cv"] < 0.1
    held = [(n, r["gpus"], r["predicted_efficiency"], r["published_efficiency"])
            for n, m in horovod_doc["models"].items() for r in m["rows"] if r["role"] == "held out"]
    assert sorted((n, g) for n, g, _, _ in held) == [(n, g) for n in ("inception_v3", "resnet101", "vgg16")
                                                     for g in (128, 512)]
    assert all(abs(p - e) <= 0.05 for _, _, p, e in held), held
    # without the straggler term the same model misses all three at 512 GPUs by more than 5 points
    plain = {n: r["no_stragglers_efficiency"] - r["published_efficiency"]
             for n, m in horovod_doc["models"].items() for r in m["rows"] if r["gpus"] == 512}
    assert all(d > 0.05 for d in plain.values()), plain


def test_plain_tcp_tables_beside_rdma(validation, horovod_doc):
    """Horovod's TCP rows (NCCL's socket transport), predicted with nothing fitted on them: the
    25 Gbit/s cluster keeps its RDMA fit, the plain 40 Gbit/s one NCCL's channel; the socket
    transport caps each network channel. On the plain 40 Gbit/s network the transport-blind model
    put VGG-16 more than 20 points above the published figure; knowing the transport, within 10."""
    doc = validation.horovod_tcp(horovod_doc)
    assert (doc["ring_bw_gbs_25g"], doc["cv"]) == (horovod_doc["ring_bw_gbs"], horovod_doc["cv"])
    rows = {(r["table"], r["model"]): r for r in doc["rows"]}
    assert len(rows) == 9 and {t for t, _ in rows} == {"25G, 16 GPUs", "25G, 16 GPUs, pre-fusion",
                                                        "40G plain, 64 GPUs"}
    vgg = rows["40G plain, 64 GPUs", "vgg16"]
    assert vgg["published_tcp"] == pytest.approx(6084.2 / (64 * 149.6))
    assert vgg["error_transport_blind"] > 0.2 and abs(vgg["error_tcp"]) < 0.1
    assert vgg["nccl_channel_gbs"] == 5.0 and vgg["channel_gbs"] == pytest.approx(doc["socket_channel_gbs"])
    for r in rows.values():
        assert r["predicted_tcp"] <= r["predicted_transport_blind"] + 1e-3  # Horovod's 5 ms cycle: not monotone
        assert r["channel_gbs"] == pytest.approx(min(r["nccl_channel_gbs"], doc["socket_channel_gbs"]))
        if r["implied_channel_gbs"] is not None:
            assert 0.1 < r["implied_channel_gbs"] <= r["nccl_channel_gbs"]
    # the published TCP rows sit below the RDMA ones on the same cluster, VGG-16 by far the most
    tcp16 = {m: rows["25G, 16 GPUs", m] for m in ("inception_v3", "resnet101", "vgg16")}
    assert all(r["published_tcp"] < r["published_rdma"] for r in tcp16.values())
    assert tcp16["vgg16"]["published_rdma"] - tcp16["vgg16"]["published_tcp"] > 0.2


def test_tcp_host_cost_measures_one_loopback_flow(tmp_path, capsys):
    """``benchmarks/tcp_host_cost.py``, where the socket transport's host constants come from, at its
    smallest: structure and signs only (this machine is shared)."""
    path = ROOT / "benchmarks" / "tcp_host_cost.py"
    spec = importlib.util.spec_from_file_location("tcp_host_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = module.main(["--seconds", "0.2", "--repeats", "1", "--json", str(tmp_path / "t.json")])
    assert "one thread doing both" in capsys.readouterr().out
    assert len(doc["runs"]) == 1 and doc["runs"][0]["bytes"] > 0
    med = doc["median"]
    assert med["throughput_Bps"] > 0 and med["send_ns_per_byte"] > 0 and med["recv_ns_per_byte"] > 0
    assert med["both_ns_per_byte"] == pytest.approx(med["send_ns_per_byte"] + med["recv_ns_per_byte"])
    assert json.loads((tmp_path / "t.json").read_text())["benchmark"] == "tcp_host_cost"
    with pytest.raises(SystemExit):
        module.main(["--seconds", "0"])
