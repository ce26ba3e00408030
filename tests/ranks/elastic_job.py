"""An elastic training job for tests/test_elastic.py, run by ``gpucomm-run --host-discovery-script``.

Linear regression with SGD, committed every step. Two data modes:

* ``fixed``: step ``s`` trains on samples ``[s*G, (s+1)*G)`` split evenly among the current ranks;
  each rank's loss is its share of the global mean and gradients are summed, so the result equals
  one process on the full batches whatever the job's size was at each step.
* ``sampler``: an ``ElasticSampler`` shards the epoch; every step's global batch (all ranks'
  indices) is recorded in the committed state, so the test can check that no sample was lost or
  repeated within an epoch and replay the same batches in one process.

Faults come from the environment: ``ELASTIC_KILL=worker@step`` SIGKILLs that worker in the middle
of that step (after the forward pass, before backward sends its gradients); ``ELASTIC_KILL_IN_RESET=worker[@n]``
SIGKILLs it when the job re-forms (the nth time), before its optimizer rebinds (the others are then in that
collective); ``ELASTIC_SYNC_ALONE=worker`` makes it judge alone that the state needs a sync after each re-form;
``ELASTIC_STOP=worker@step`` SIGSTOPs it instead (a hung worker); ``ELASTIC_RAISE=worker@step`` makes it raise a
``RuntimeError`` there, out of the training function, so that it exits 1 (Horovod's ``exit_mode='exception'``);
``ELASTIC_INTERNAL=worker@step`` makes it raise ``HorovodInternalError`` there once (a fault nobody dies of: the
job re-forms with the same workers); ``ELASTIC_ADD=step@host:slots[,host:slots]`` makes rank 0 append hosts to the
discovery file at that step; ``ELASTIC_OTHER_INSTALL=worker`` makes that worker report another gpucomm version at ``init()``,
as a host with another install would; ``ELASTIC_AWAIT_RESET=N`` holds training after the addition until the job
has N ranks; ``ELASTIC_AWAIT_REMOVAL=1`` holds it after the removal until the job re-formed without the host;
``ELASTIC_SLOW_RESTART=worker`` delays a worker started again in that slot. Rank 0 writes ``result.json`` at the end.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

import gpucomm.torch as hvd

OUT = Path(os.environ.get("ELASTIC_OUT", "."))  # the tests import this module for its dataset
MODE = os.environ.get("ELASTIC_MODE", "fixed")
STEPS = int(os.environ.get("ELASTIC_STEPS", "16"))
EPOCHS = int(os.environ.get("ELASTIC_EPOCHS", "2"))
GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks
LOCAL_BATCH = 3  # sampler mode
SAMPLES = 96
FEATURES = 5
STEP_SLEEP = float(os.environ.get("ELASTIC_STEP_SLEEP", "0.05"))
WORKER = os.environ.get("GPUCOMM_ELASTIC_WORKER", "")


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES * 2, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g) + 0.1 * torch.randn(SAMPLES * 2, 1, generator=g)
    return x, y


def kill_plan() -> dict[str, int]:
    """``ELASTIC_KILL=worker@step[,worker@step...]``."""
    plan = {}
    for item in filter(None, os.environ.get("ELASTIC_KILL", "").split(",")):
        worker, _, step = item.rpartition("@")
        plan[worker] = int(step)
    return plan


def at_plan(var: str) -> tuple[int, str] | None:
    """``ELASTIC_ADD=step@host:slots`` (at that step), ``ELASTIC_REMOVE=size@host:slots`` (once the job has that size)."""
    when, _, host = os.environ.get(var, "").partition("@")
    return (int(when), host) if host else None


KILL = kill_plan()
RAISE = os.environ.get("ELASTIC_RAISE", "")
INTERNAL = os.environ.get("ELASTIC_INTERNAL", "")
ADD = at_plan("ELASTIC_ADD")
REMOVE = at_plan("ELASTIC_REMOVE")


def maybe_die(step: int) -> None:
    if os.environ.get("ELASTIC_STOP") == f"{WORKER}@{step}":  # hangs instead of dying (SIGSTOP)
        (OUT / f"stopped.{WORKER}.json").write_text(json.dumps({"worker": WORKER, "step": step, "time": time.time()}))
        os.kill(os.getpid(), signal.SIGSTOP)
    if KILL.get(WORKER) == step:
        (OUT / f"killed.{WORKER}.json").write_text(json.dumps({"worker": WORKER, "step": step, "time": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)
    if RAISE == f"{WORKER}@{step}":
        raise RuntimeError(f"worker {WORKER} fails at step {step} (ELASTIC_RAISE)")
    if INTERNAL == f"{WORKER}@{step}" and not (OUT / f"internal.{WORKER}").exists():
        (OUT / f"internal.{WORKER}").write_text(str(time.time()))
        raise hvd.elastic.HorovodInternalError(f"worker {WORKER} reports a fault at step {step} (ELASTIC_INTERNAL)")


def other_install() -> None:
    """(``ELASTIC_OTHER_INSTALL``) This worker reports another gpucomm version when it arrives in ``init()``."""
    if os.environ.get("ELASTIC_OTHER_INSTALL") == WORKER:
        import gpucomm.job.setup as setup  # noqa: PLC0415

        mine = setup.software_stack()
        setup.software_stack = lambda: {**mine, "gpucomm": "0.0.9"}


def sync_alone() -> None:
    """(``ELASTIC_SYNC_ALONE``) After each re-form this worker judges on its own that the state needs a sync,
    as a worker does that saw a round given up which the others never read."""
    import importlib  # noqa: PLC0415

    module = importlib.import_module("gpucomm.torch.elastic.run")
    reform = module._reform

    def reform_judging_alone(state, skip_sync: bool) -> bool:
        reform(state, skip_sync)
        return False

    module._reform = reform_judging_alone


def slow_restart() -> None:
    """(``ELASTIC_SLOW_RESTART=worker``) A worker started again in this slot (its host was listed again) waits
    5 s after ``init()`` before its first collective, so that it outlives a worker that dies meanwhile."""
    if os.environ.get("ELASTIC_SLOW_RESTART") == WORKER:
        marker = OUT / f"started.{WORKER}"
        if marker.exists():
            time.sleep(5)
        marker.write_text(str(time.time()))


def change_hosts(step: int) -> None:
    """Rank 0 edits the discovery file: add a host at a step, remove one once the job has grown."""
    if hvd.rank() != 0:
        return
    hosts = Path(os.environ.get("ELASTIC_HOSTS_FILE", "/nonexistent"))
    if ADD and ADD[0] == step and not (OUT / "added").exists():
        (OUT / "added").write_text(str(time.time()))
        with open(hosts, "a") as f:  # (several: host:slots,host:slots)
            f.write(ADD[1].replace(",", "\n") + "\n")
    if REMOVE and REMOVE[0] == hvd.size() and not (OUT / "removed").exists():
        (OUT / "removed").write_text(str(time.time()))
        lines = [line for line in hosts.read_text().splitlines() if line.strip() != REMOVE[1]]
        hosts.write_text("\n".join(lines) + "\n")


def main() -> None:
    other_install()
    hvd.init()
    slow_restart()
    torch.manual_seed(1)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(), op=hvd.Sum)
    x, y = dataset()
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3) if MODE == "sampler" else None
    extra = {"sampler": sampler} if sampler is not None else {}
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0, epoch=0, batches=[], sizes=[], **extra)
    resets = {"count": 0}

    def on_reset() -> None:
        resets["count"] += 1
        resets["at"] = time.time()

    state.register_reset_callbacks([on_reset])
    dying, _, nth = os.environ.get("ELASTIC_KILL_IN_RESET", "").partition("@")
    if dying == WORKER:  # dies while the job re-forms (its nth re-form, default the first), before the rebind
        plain_reset = state.reset
        seen = {"resets": 0}

        def dying_reset() -> None:
            seen["resets"] += 1
            if seen["resets"] == int(nth or 1):
                (OUT / f"killed.{WORKER}.json").write_text(json.dumps({"worker": WORKER, "in": "reset"}))
                os.kill(os.getpid(), signal.SIGKILL)
            plain_reset()

        state.reset = dying_reset
    if os.environ.get("ELASTIC_SYNC_ALONE") == WORKER:
        sync_alone()

    def train_step(idx: list[int], global_count: int) -> None:
        optimizer.zero_grad()
        rows = torch.tensor(idx, dtype=torch.long)
        loss = ((model(x[rows]) - y[rows]) ** 2).sum() / global_count
        maybe_die(state.step)  # mid-step, before its gradients leave: the others' step cannot complete
        loss.backward()
        optimizer.step()

    @hvd.elastic.run
    def train(state) -> None:
        if MODE == "fixed":
            while state.step < STEPS:
                part = GLOBAL_BATCH // hvd.size()
                start = state.step * GLOBAL_BATCH + hvd.rank() * part
                train_step(list(range(start, start + part)), GLOBAL_BATCH)
                after_step(state)
            return
        while state.epoch < EPOCHS:  # the sampler resumes the epoch where the last commit left it
            mine = list(iter(sampler))
            steps = hvd.allreduce(torch.tensor(len(mine)), op=hvd.Max, name="steps").item()
            for b in range((steps + LOCAL_BATCH - 1) // LOCAL_BATCH):
                idx = mine[b * LOCAL_BATCH:(b + 1) * LOCAL_BATCH]
                every = hvd.allgather_object(idx, name="batch")
                flat = [i for part in every for i in part]
                if not flat:
                    break
                train_step(idx, len(flat))
                sampler.record_indices(flat) if hasattr(sampler, "record_indices") else sampler.record_batch(b, LOCAL_BATCH)
                state.batches = state.batches + [(state.epoch, flat)]
                after_step(state)
            state.epoch += 1
            sampler.set_epoch(state.epoch)  # at the end of an epoch (Horovod's rule): a fresh shuffle
            state.commit()

    def after_step(state) -> None:
        state.sizes = state.sizes + [hvd.size()]
        state.step += 1
        if resets.get("at") and hvd.rank() == 0 and not (OUT / "resumed.json").exists():
            (OUT / "resumed.json").write_text(json.dumps({"time": time.time(), "step": state.step}))
        change_hosts(state.step)
        await_removal(state)
        await_reset(state)
        time.sleep(STEP_SLEEP)
        state.commit()

    def await_removal(state) -> None:
        """(``ELASTIC_AWAIT_REMOVAL=1``) Once rank 0 removed the host, train no further until the job re-formed
        without it, so that a host added back later is seen added, not as never removed (every rank decides
        alike: the size and the sizes the synced state recorded are the same everywhere, newcomers' too)."""
        deadline = time.monotonic() + 120
        while os.environ.get("ELASTIC_AWAIT_REMOVAL") and REMOVE and hvd.size() == REMOVE[0] == min(state.sizes):
            if time.monotonic() > deadline:
                raise RuntimeError("ELASTIC_AWAIT_REMOVAL: the job did not re-form without the host within 120 s")
            time.sleep(0.1)
            state.check_host_updates()

    def await_reset(state) -> None:
        """(``ELASTIC_AWAIT_RESET=N``) Once the hosts are added, train no further until the job has N ranks, so
        that the added workers arrive before training ends however slowly they start (every rank decides alike:
        the step and the job's size are the same everywhere, newcomers' too)."""
        want = int(os.environ.get("ELASTIC_AWAIT_RESET") or 0)
        deadline = time.monotonic() + 120
        while want and ADD and state.step >= ADD[0] and hvd.size() != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ELASTIC_AWAIT_RESET: the job did not re-form with {want} ranks within 120 s")
            time.sleep(0.1)
            state.check_host_updates()

    train(state)
    if hvd.rank() == 0:
        result = {"weight": model.weight.detach().view(-1).tolist(), "bias": model.bias.detach().tolist(),
                  "steps": state.step, "sizes": state.sizes, "batches": state.batches, "resets": resets["count"],
                  "final_size": hvd.size()}
        (OUT / "result.json").write_text(json.dumps(result))
    print(f"worker {WORKER} done as rank {hvd.rank()} of {hvd.size()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
