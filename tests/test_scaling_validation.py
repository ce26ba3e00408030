"""``benchmarks/scaling_validation.py``: the claims the README makes about it hold (DDP's 8- and
16-GPU rows within 5 % with the per-gradient cost fitted on the 1-GPU row, and not without it;
Horovod's VGG-16 loses far more than its other two models; with the cluster's ring speed and
straggler noise fitted on Horovod's 16-GPU rows alone, its 128- and 512-GPU efficiencies land within
5 points), computed from public inputs only."""

from __future__ import annotations

import importlib.util
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
