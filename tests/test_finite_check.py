"""Non-finite gradients caught where they start (issue 26): one rank's NaN or Inf gradient is named
(rank, step, parameter) on every rank in the same step, through the slots each bucket's allreduce
carries; "warn" reports and continues; AMP's GradScaler steps are reported, not raised; off, NaN
spreads silently as in Horovod and DDP. The GPU's checked pack kernels are tested bit-exact in the
simulator suite (tests/kernels/test_sim.py) and compiled in tests/kernels/test_compile.py."""

from __future__ import annotations

import pytest
import torch

from tests.ranks import finite_scenarios as sc
from tests.harness import run_ranks


@pytest.mark.parametrize("compression", ["none", "fp16", "user"])
@pytest.mark.parametrize("size", [2, 3])
def test_raise_names_the_rank_step_and_parameter_on_every_rank(size, compression):
    results = run_ranks(sc.poison_step, size, args=("raise", compression, size - 1, "2.weight", 2))
    for rank, seen in enumerate(results):
        raised = seen["raised"]
        assert raised is not None, (rank, seen)
        assert raised["step"] == 2 and raised["error_step"] == 2, (rank, raised)
        assert raised["findings"] == [(size - 1, "2.weight")], (rank, raised)
        assert f"first on rank {size - 1} in parameter '2.weight'" in raised["message"], raised["message"]
        assert "step 2" in raised["message"]


@pytest.mark.parametrize("param", ["2.weight", "0.weight"])
def test_a_report_of_the_first_step_names_the_parameter_though_the_buckets_were_re_cut(param):
    """Before: step 1's slots were read against the layout re-cut right after step 1 (by readiness, on
    the CPU): a NaN in '2.weight' was named '0.bias', one in '0.weight' raised IndexError."""
    env = {"GPUCOMM_FUSION_THRESHOLD": "200"}  # several buckets, so that the re-cut moves parameters
    for rank, seen in enumerate(run_ranks(sc.poison_step, 2, args=("raise", "none", 1, param, 1), env=env)):
        raised = seen["raised"]
        assert raised is not None and raised["findings"] == [(1, param)], (rank, seen)


def test_inf_is_caught_like_nan():
    for seen in run_ranks(sc.poison_step, 2, args=("raise", "none", 0, "0.bias", 3, float("inf"))):
        assert seen["raised"]["findings"] == [(0, "0.bias")] and seen["raised"]["step"] == 3, seen


def test_fp16_overflow_on_the_wire_is_caught():
    """A finite float32 gradient of 1e6 overflows the fp16 wire: the packed value is Inf."""
    for seen in run_ranks(sc.poison_step, 2, args=("raise", "fp16", 1, "4.weight", 2, 1e6)):
        assert seen["raised"]["findings"] == [(1, "4.weight")], seen


def test_warn_reports_on_rank_0_and_training_goes_on():
    results = run_ranks(sc.poison_step, 2, args=("warn", "none", 1, "2.weight", 2))
    # step 2: rank 1's gradient; steps 3 and 4: every rank's (the NaN reached the weights everywhere)
    assert len(results[0]["warnings"]) == 3, results[0]["warnings"]
    assert "in step 2: first on rank 1 in parameter '2.weight'" in results[0]["warnings"][0]
    assert "in step 3: first on rank 0" in results[0]["warnings"][1] and "also rank 1" in results[0]["warnings"][1]
    assert results[1]["warnings"] == []
    for seen in results:
        assert seen["raised"] is None and seen["findings"] == [(1, "2.weight")], seen
        assert seen["counts"]["nonfinite_steps"] == 3, seen
        assert not seen["finite_after"]  # it spread, as reported: the check names it, it does not mend it


def test_the_environment_turns_it_on(monkeypatch):
    results = run_ranks(sc.poison_step, 2, args=("env", "none", 0, "0.weight", 2), env={"GPUCOMM_CHECK_FINITE": "raise"})
    for seen in results:
        assert seen["raised"]["findings"] == [(0, "0.weight")], seen


def test_off_nan_spreads_silently_as_in_horovod():
    for seen in run_ranks(sc.poison_step, 2, args=(False, "none", 1, "2.weight", 2)):
        assert seen["raised"] is None and seen["warnings"] == [] and seen["findings"] is None, seen
        assert not seen["finite_after"] and seen["counts"]["nonfinite_steps"] == 0, seen


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="a CPU GradScaler (torch.amp.GradScaler) needs torch >= 2.3")
def test_grad_scaler_steps_are_reported_not_raised():
    """AMP: the scaled loss overflows now and then; GradScaler skips that step and lowers its scale."""
    for seen in run_ranks(sc.poison_step, 2, args=("raise", "none", 1, "2.weight", 2, float("inf"), 4, "cpu", True)):
        assert seen["raised"] is None, seen
        assert seen["findings"] == [(1, "2.weight")], seen
        assert seen["counts"]["nonfinite_skipped"] == 1 and seen["counts"]["nonfinite_steps"] == 1, seen
        assert seen["finite_after"], seen  # the scaler skipped the poisoned step


def test_ranks_must_agree_on_the_check():
    for message in run_ranks(sc.mismatched_modes, 2):
        assert "check_finite" in message and "ranks disagree" in message, message


def test_a_healthy_run_pays_no_collective_or_control_message():
    on, off = run_ranks(sc.steps_with_and_without_check, 2, args=(True,)), run_ranks(sc.steps_with_and_without_check, 2,
                                                                                     args=(False,))
    for a, b in zip(on, off):
        assert a == b and a["control_rounds"] == 0 and a["nonfinite_steps"] == 0, (a, b)


def test_a_bad_mode_is_refused_with_the_choices():
    from gpucomm.torch.finite_check import resolve_mode

    with pytest.raises(ValueError, match="'raise'.*'warn'"):
        resolve_mode("loud")
    assert resolve_mode(True) == "raise" and resolve_mode(False) is None and resolve_mode("WARN") == "warn"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and CUDA torch")
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_cuda_raise_names_the_rank_and_parameter(compression):
    results = run_ranks(sc.poison_step, 2, args=("raise", compression, 1, "2.weight", 2, float("nan"), 4, "cuda"),
                        env={"GPUCOMM_SINGLE_GPU_TEST": "1"}, timeout=600)
    for seen in results:
        assert seen["raised"]["findings"] == [(1, "2.weight")], seen


def test_the_default_checks_within_its_budget_and_still_reports_a_lasting_nan():
    """Issue 36, finding 7: the default mode's search costs at most ``AUTO_BUDGET`` of the step on
    average. With a clock that moves 10 ms at every reading (a search then costs 10 ms of a step of
    10 to 30 ms, far over the budget), about one step in 200 is searched; with a search that costs
    nothing, every step is; a skipped step writes 0 ("nothing found") into its slot."""
    import torch

    from gpucomm.dataplane.finite import AUTO_BUDGET, FiniteSlots

    now = [0.0]

    def ticking() -> float:
        now[0] += 0.010
        return now[0]

    slots = FiniteSlots("auto", 0, 2, budget=AUTO_BUDGET, clock=ticking)
    bad = torch.tensor([1.0, float("nan")])
    out = torch.zeros(1)
    found = []
    for _ in range(1000):
        slots.search([bad], out)
        found.append(float(out))
        slots.step_done()
    assert 3 <= slots.searched_steps <= 12, (slots.searched_steps, slots.skipped_steps)
    assert found[0] == 1.0 and found.count(1.0) == slots.searched_steps  # each searched step reports the NaN
    spent = slots.searched_steps * 0.010
    assert spent <= 2 * AUTO_BUDGET * (now[0] - 0.0), (spent, now[0])  # within the budget (one step's slack)

    still = [0.0]
    cheap = FiniteSlots("auto", 0, 2, budget=AUTO_BUDGET, clock=lambda: still[0])
    for _ in range(100):  # a search that takes no measurable time: every step is searched
        cheap.search([bad], out)
        still[0] += 0.010
        cheap.step_done()
    assert cheap.searched_steps == 100 and cheap.skipped_steps == 0
    always = FiniteSlots("raise", 0, 2, clock=ticking)  # the explicit modes search every step, whatever it costs
    for _ in range(10):
        always.search([bad], out)
        always.step_done()
    assert always.searched_steps == 10
