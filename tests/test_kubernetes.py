"""The Kubernetes launch manifests (launch/kubernetes/) against the real schemas and the real pod environment.

Schemas: every manifest is validated with ``jsonschema`` against the openAPIV3Schema of its CRD, fetched from
the project at a release tag (tests/data/kubernetes/README.md says which; a test checks the files against the
git blob ids recorded there). The schema is made as strict as the API server under ``kubectl apply``'s
default strict field validation: an object that declares its properties (or none) and does not set
``x-kubernetes-preserve-unknown-fields`` accepts no other field, so a misspelled field fails instead of being
pruned silently; ``x-kubernetes-list-type: map`` keys must be unique and ``set`` items too; ``int-or-string``
takes either; CEL rules (``x-kubernetes-validations``) are not evaluated. Each TrainJob must name a runtime of
the fetched ClusterTrainingRuntimes, which themselves pass the same validation against their CRD.

Environment: what each operator gives its pods, written down from its Go source (Trainer v2.3.0's torch and MPI
plugins, MPI Operator v0.8.0's controller), is reproduced with real processes on this host, the pods' DNS names
replaced by this host's: two ``torchrun`` "nodes" configured by PET_* alone, and Open MPI's ``mpirun`` started
by launch/kubernetes/mpi-launcher.sh from the operators' hostfile and OMPI_MCA_* variables. Each runs a 2-rank
gpucomm training job (tests/ranks/kubernetes_train.py) whose ranks must agree on the trained parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gzip
import hashlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.steps import require_step
from tests.harness import PYTHON, ROOT, free_port, run, started
from tests.test_launchers import _torchrun

yaml = pytest.importorskip("yaml", reason="the manifest tests need PyYAML: pip install pyyaml")
jsonschema = pytest.importorskip("jsonschema", reason="the manifest tests need jsonschema: pip install jsonschema")

DATA = ROOT / "tests" / "data" / "kubernetes"
MANIFESTS = ROOT / "launch" / "kubernetes"
TRAIN = "tests/ranks/kubernetes_train.py"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: the CRDs are 0.5-0.9 MB of YAML

TRAINJOB_CRD = "trainer.kubeflow.org_trainjobs.yaml.gz"
RUNTIME_CRD = "trainer.kubeflow.org_clustertrainingruntimes.yaml.gz"
MPIJOB_CRD = "kubeflow.org_mpijobs.yaml.gz"
RUNTIMES = ("torch_distributed.yaml", "deepspeed_distributed.yaml")
# manifest -> the CRD it is an instance of
CRD_OF = {"trainjob-torch.yaml": TRAINJOB_CRD, "trainjob-mpi.yaml": TRAINJOB_CRD, "mpijob.yaml": MPIJOB_CRD}

# Trainer v2.3.0 pkg/constants/constants.go: env names its plugins own, which a TrainJob must not set
TORCH_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
MPI_RESERVED = {"OMPI_MCA_orte_default_hostfile", "OMPI_MCA_plm_rsh_args", "OMPI_MCA_orte_keep_fqdn_hostnames",
                "OMPI_MCA_orte_set_default_slots"}
TRAINER_PORT = 29500  # constants.ContainerTrainerPort: PET_MASTER_PORT
MPI_HOSTFILE = "/etc/mpi/hostfile"  # both operators mount the hostfile there
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

# The CRDs leave the root metadata open (the API server checks it as ObjectMeta): the fields a manifest sets.
OBJECT_META = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": DNS_SUBDOMAIN},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


# ---------------------------------------------------------------------------------------------- data


def data_bytes(name: str) -> bytes:
    """A file of tests/data/kubernetes as fetched (the .gz ones decompressed)."""
    raw = (DATA / name).read_bytes()
    return gzip.decompress(raw) if name.endswith(".gz") else raw


@functools.lru_cache(maxsize=None)
def data_yaml(name: str) -> Any:
    return yaml.load(data_bytes(name), Loader=LOADER)


def manifest(name: str) -> dict:
    """A manifest of launch/kubernetes, parsed (each is one YAML document)."""
    docs = list(yaml.load_all((MANIFESTS / name).read_text(), Loader=LOADER))
    assert len(docs) == 1 and isinstance(docs[0], dict), f"{name}: expected one YAML mapping, got {len(docs)} documents"
    return docs[0]


def sources() -> list[dict[str, str]]:
    """The provenance table of tests/data/kubernetes/README.md, one dict per row."""
    lines = [ln for ln in (DATA / "README.md").read_text().splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


# ---------------------------------------------------------------------------------------------- schemas


def strict(schema: dict, at: str = "") -> dict:
    """A Kubernetes structural schema as a draft-4 JSON schema (the draft OpenAPI 3.0's schema objects follow)
    that rejects what strict field validation rejects: objects without ``x-kubernetes-preserve-unknown-fields`` accept only their declared properties
    (the API server would prune any other field, or refuse it under strict validation); list-type ``set``
    items are unique; list-type ``map`` keys stay for ``_unique_map_keys``; ``int-or-string`` takes either;
    other x-kubernetes-* keys (CEL rules, map/list types) are dropped."""
    out = {k: v for k, v in schema.items()
           if not k.startswith("x-kubernetes-") and k not in ("properties", "items", "additionalProperties")}
    if schema.get("x-kubernetes-list-type") == "map":
        out["x-kubernetes-list-map-keys"] = schema["x-kubernetes-list-map-keys"]
    if schema.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for word in ("anyOf", "allOf", "oneOf"):
        if any("properties" in branch for branch in schema.get(word, ())):
            raise NotImplementedError(f"{at or '<root>'}: properties declared inside {word}; closing the object "
                                      f"would reject them, so strict() must learn to merge the branches first")
    if "properties" in schema:
        out["properties"] = {k: strict(v, f"{at}.{k}") for k, v in schema["properties"].items()}
    if isinstance(schema.get("items"), dict):
        out["items"] = strict(schema["items"], f"{at}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(schema["additionalProperties"], f"{at}{{}}")
    elif "additionalProperties" in schema:
        out["additionalProperties"] = schema["additionalProperties"]
    elif schema.get("type") == "object" and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _unique_map_keys(validator, keys, instance, schema):
    """``x-kubernetes-list-type: map``: no two items share their key fields (e.g. two env entries one name)."""
    if not validator.is_type(instance, "array"):
        return
    seen: dict[tuple, int] = {}
    for i, item in enumerate(instance):
        if isinstance(item, dict):
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"items {seen[key]} and {i} have the same {'/'.join(keys)} "
                                                 f"{key!r}: a list of type map takes each key once")
            seen[key] = i


KubernetesValidator = jsonschema.validators.extend(jsonschema.Draft4Validator,
                                                   {"x-kubernetes-list-map-keys": _unique_map_keys})


@functools.lru_cache(maxsize=None)
def crd_schemas(crd_file: str) -> tuple[str, str, dict[str, Any]]:
    """(apiVersion group, kind, {served version: strict validator}) of a stored CRD."""
    crd = data_yaml(crd_file)
    assert crd["kind"] == "CustomResourceDefinition", crd_file
    validators = {}
    for version in crd["spec"]["versions"]:
        if version.get("served"):
            schema = strict(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = OBJECT_META
            KubernetesValidator.check_schema(schema)
            validators[version["name"]] = KubernetesValidator(schema)
    return crd["spec"]["group"], crd["spec"]["names"]["kind"], validators


def validation_errors(obj: dict, crd_file: str) -> list[str]:
    """Why the API server would refuse ``obj`` as an instance of the CRD (empty: it would accept it)."""
    group, kind, validators = crd_schemas(crd_file)
    api_group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
    if obj.get("kind") != kind or api_group != group or version not in validators:
        return [f"apiVersion/kind {obj.get('apiVersion')}/{obj.get('kind')} is not one this CRD serves "
                f"({', '.join(f'{group}/{v}' for v in validators)}, {kind})"]
    errors = sorted(validators[version].iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def runtime_names() -> dict[str, dict]:
    """The fetched ClusterTrainingRuntimes by name."""
    return {data_yaml(name)["metadata"]["name"]: data_yaml(name) for name in RUNTIMES}


def runtime_ref_error(trainjob: dict) -> str | None:
    """Why ``spec.runtimeRef`` names no fetched runtime (None: it names one)."""
    ref = trainjob["spec"]["runtimeRef"]
    kind, group = ref.get("kind", "ClusterTrainingRuntime"), ref.get("apiGroup", "trainer.kubeflow.org")
    runtime = runtime_names().get(ref["name"])
    if runtime is None:
        return f"runtimeRef.name {ref['name']!r} is none of the Trainer's runtimes {sorted(runtime_names())}"
    if (kind, group) != (runtime["kind"], runtime["apiVersion"].split("/")[0]):
        return f"runtimeRef {group}/{kind} does not match {ref['name']}'s {runtime['apiVersion']} {runtime['kind']}"
    return None


def test_stored_schemas_are_the_fetched_files():
    rows = sources()
    assert {r["file"] for r in rows} == {p.name for p in DATA.iterdir() if p.name != "README.md"}, \
        "tests/data/kubernetes/README.md must list every data file, and only those"
    for row in rows:
        data = data_bytes(row["file"])
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        assert (len(data), blob) == (int(row["bytes"]), row["git blob"]), \
            f"{row['file']} is not {row['repository']}@{row['tag']}:{row['path']} as recorded"


def pod_hostnames(obj: dict) -> list[str]:
    """The host names the operator gives the job's pods (JobSet: <job>-<replicatedJob>-<index>-<pod>;
    MPI Operator: <job>-launcher, <job>-worker-<i>)."""
    name = obj["metadata"]["name"]
    if obj["kind"] == "TrainJob":
        nodes = obj["spec"]["trainer"]["numNodes"]
        if "mpi" in runtime_names()[obj["spec"]["runtimeRef"]["name"]]["spec"]["mlPolicy"]:  # launcher + nodes
            return [f"{name}-launcher-0-0"] + [f"{name}-node-0-{i}" for i in range(max(nodes - 1, 1))]
        return [f"{name}-node-0-{i}" for i in range(nodes)]
    workers = obj["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    return [f"{name}-launcher"] + [f"{name}-worker-{i}" for i in range(workers)]


@pytest.mark.parametrize("name", sorted(CRD_OF))
def test_manifest_validates_against_its_crd(name):
    obj = manifest(name)
    assert validation_errors(obj, CRD_OF[name]) == []
    # the TrainJob CRD's CEL rule on the name, and the MPI Operator's check of its pods' host names
    for host in [obj["metadata"]["name"], *pod_hostnames(obj)]:
        assert DNS_1035_LABEL.match(host) and len(host) <= 63, f"{host} is not a DNS label"


@pytest.mark.parametrize("name", RUNTIMES)
def test_the_trainers_runtimes_pass_the_strict_validation(name):
    """Strictness that rejected the project's own runtimes would prove nothing about ours."""
    assert validation_errors(data_yaml(name), RUNTIME_CRD) == []


@pytest.mark.parametrize("name, runtime", [("trainjob-torch.yaml", "torch-distributed"),
                                           ("trainjob-mpi.yaml", "deepspeed-distributed")])
def test_trainjob_names_a_runtime_the_trainer_ships(name, runtime):
    """The runtime exists and is what the manifest is written for: the torch policy, or OpenMPI with the
    launcher running ranks too (the hostfile the MPI manifest expects)."""
    job = manifest(name)
    assert job["spec"]["runtimeRef"]["name"] == runtime and runtime_ref_error(job) is None
    policy = runtime_names()[runtime]["spec"]["mlPolicy"]
    if runtime == "torch-distributed":
        assert set(policy) == {"numNodes", "torch"}, policy
    else:
        assert (policy["mpi"]["mpiImplementation"], policy["mpi"]["runLauncherAsNode"]) == ("OpenMPI", True), policy
    broken = copy.deepcopy(job)
    broken["spec"]["runtimeRef"]["name"] = "mpi-distributed"  # an early Trainer name, not in v2.3.0
    assert "is none of the Trainer's runtimes" in runtime_ref_error(broken)


DOMAIN_PREFIXED_PATH = re.compile(DNS_SUBDOMAIN[:-1] + r"/\S+$")


@pytest.mark.parametrize("name", ["trainjob-torch.yaml", "trainjob-mpi.yaml"])
def test_runtime_patches_pass_the_trainers_checks(name):
    """What the Trainer's webhook checks of runtimePatches (jobset.go ValidateObjects): a domain-prefixed
    manager; replicated jobs and containers the runtime has; no env on a `node` container."""
    job = manifest(name)
    spec = runtime_names()[job["spec"]["runtimeRef"]["name"]]["spec"]
    containers = {(rj["name"], c["name"]) for rj in spec["template"]["spec"]["replicatedJobs"]
                  for c in rj["template"]["spec"]["template"]["spec"]["containers"]}
    patched = []
    for patch in job["spec"]["runtimePatches"]:
        assert DOMAIN_PREFIXED_PATH.match(patch["manager"]), patch["manager"]
        for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            for c in rj["template"]["spec"]["template"]["spec"].get("containers", []):
                patched.append((rj["name"], c["name"]))
                assert "env" not in c or c["name"] != "node", "the Trainer refuses env patches on `node`"
    assert patched and set(patched) <= containers, f"{patched} are not all containers of the runtime: {containers}"


def test_a_misspelled_field_fails_validation():
    job = manifest("trainjob-torch.yaml")
    job["spec"]["trainer"]["numProcsPerNode"] = job["spec"]["trainer"].pop("numProcPerNode")
    errors = validation_errors(job, TRAINJOB_CRD)
    assert len(errors) == 1 and errors[0].startswith("spec.trainer:") and "'numProcsPerNode'" in errors[0], errors
    # the published schema alone does not catch it: without strict field validation the API server prunes it silently
    raw = data_yaml(TRAINJOB_CRD)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert list(jsonschema.Draft4Validator(raw).iter_errors(job)) == []

    mpijob = manifest("mpijob.yaml")  # deep inside a pod template
    container = mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    errors = validation_errors(mpijob, MPIJOB_CRD)
    assert len(errors) == 1 and "spec.mpiReplicaSpecs.Worker.template.spec.containers.0:" in errors[0] \
        and "'volumeMount'" in errors[0], errors


def test_wrong_types_duplicate_keys_and_kinds_fail_validation():
    job = manifest("trainjob-torch.yaml")
    job["spec"]["trainer"]["numNodes"] = "2"
    assert any(e.startswith("spec.trainer.numNodes:") for e in validation_errors(job, TRAINJOB_CRD))
    job = manifest("trainjob-mpi.yaml")
    job["spec"]["trainer"]["env"].append(dict(job["spec"]["trainer"]["env"][0]))
    assert any("spec.trainer.env:" in e and "same name" in e for e in validation_errors(job, TRAINJOB_CRD))
    job = manifest("mpijob.yaml")
    job["metadata"]["name"] = "GPUcomm"
    assert any(e.startswith("metadata.name:") for e in validation_errors(job, MPIJOB_CRD))
    assert "is not one this CRD serves" in validation_errors(manifest("mpijob.yaml"), TRAINJOB_CRD)[0]


# ---------------------------------------------------------------------------------------------- what the operators set
# (host names are the pods' DNS names; the tests below run them on this host as "localhost"/127.0.0.1)


def torch_plugin_env(trainjob: str, num_nodes: int, num_proc_per_node: int, node_rank: int,
                     master_addr: str | None = None, master_port: int = TRAINER_PORT) -> dict[str, str]:
    """The PET_* variables Trainer's Torch plugin puts on the trainer container of node ``node_rank``
    (torch.go EnforceMLPolicy; PET_NODE_RANK comes from the pod's Job completion index)."""
    return {"PET_NNODES": str(num_nodes), "PET_NPROC_PER_NODE": str(num_proc_per_node),
            "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": master_addr or f"{trainjob}-node-0-0.{trainjob}",
            "PET_MASTER_PORT": str(master_port)}


def openmpi_hostfile(hosts: list[str], slots: int) -> str:
    """An Open MPI hostfile as both operators write it: "<host> slots=<n>" per pod."""
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def trainer_mpi_hosts(trainjob: str, num_nodes: int) -> list[str]:
    """The hosts of Trainer's MPI plugin hostfile for a runLauncherAsNode runtime (mpi.go buildHostFileConfigMap
    over the JobSet endpoints <trainjob>-<replicatedJob>-<job index>-<pod index>.<trainjob>): the launcher, then
    the numNodes - 1 node pods (at least one)."""
    return [f"{trainjob}-launcher-0-0.{trainjob}"] + [f"{trainjob}-node-0-{i}.{trainjob}"
                                                      for i in range(max(num_nodes - 1, 1))]


def trainer_mpi_env(slots: int, hostfile: str = MPI_HOSTFILE) -> dict[str, str]:
    """What Trainer's MPI plugin sets on the launcher's `node` container for OpenMPI (mpi.go EnforceMLPolicy)."""
    return {"OMPI_MCA_orte_default_hostfile": hostfile, "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
            "OMPI_MCA_orte_set_default_slots": str(slots), "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}


def mpi_operator_hosts(mpijob: str, workers: int, namespace: str) -> list[str]:
    """The hosts of the MPI Operator's hostfile without runLauncherAsWorker (newConfigMap): the workers."""
    return [f"{mpijob}-worker-{i}.{mpijob}.{namespace}.svc" for i in range(workers)]


def mpi_operator_env(slots: int, hostfile: str = MPI_HOSTFILE) -> dict[str, str]:
    """What the MPI Operator sets on the launcher's first container for OpenMPI (newLauncherPodTemplate)."""
    return {"K_MPI_JOB_ROLE": "launcher", "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
            "OMPI_MCA_orte_default_hostfile": hostfile, "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
            "OMPI_MCA_orte_set_default_slots": str(slots)}


def gpus(resources: dict) -> int:
    return int(resources.get("limits", {}).get("nvidia.com/gpu", 0))


def launcher_command(name: str) -> list[str]:
    """The command a manifest's launcher runs."""
    obj = manifest(name)
    if obj["kind"] == "TrainJob":
        return obj["spec"]["trainer"]["command"]
    return obj["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]


def test_torch_trainjob_is_what_the_torch_plugin_expects():
    """torchrun must be the command itself (the plugin only sets PET_*, it does not wrap the command), one rank
    per GPU, no reserved variable (the webhook refuses them); the header shows the environment the pods get."""
    job, text = manifest("trainjob-torch.yaml"), (MANIFESTS / "trainjob-torch.yaml").read_text()
    trainer = job["spec"]["trainer"]
    assert trainer["command"][0] == "torchrun" and (ROOT / trainer["command"][1].removeprefix("/workspace/")).is_file()
    assert trainer["numProcPerNode"] == gpus(trainer["resourcesPerNode"]) > 0
    assert not TORCH_RESERVED & {e["name"] for e in trainer.get("env", [])}
    for rank in range(trainer["numNodes"]):
        env = torch_plugin_env(job["metadata"]["name"], trainer["numNodes"], trainer["numProcPerNode"], rank)
        for var in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
            assert f"{var}={env[var]}" in text, f"the header should show {var}={env[var]}"


@pytest.mark.parametrize("name", ["trainjob-mpi.yaml", "mpijob.yaml"])
def test_mpi_manifests_are_what_their_operator_expects(name):
    """Slots = GPUs per pod; the launcher's command is valid bash whose last step runs mpi-launcher.sh and a
    training script that the image holds (/workspace is this checkout; the TrainJob unpacks the same tree to
    /tmp/gpucomm); the header shows the hostfile the operator writes."""
    obj, text = manifest(name), (MANIFESTS / name).read_text()
    command = launcher_command(name)
    if obj["kind"] == "TrainJob":
        trainer, tree = obj["spec"]["trainer"], "/tmp/gpucomm/"
        slots, pods = trainer["numProcPerNode"], trainer_mpi_hosts(obj["metadata"]["name"], trainer["numNodes"])
        assert slots == gpus(trainer["resourcesPerNode"]) > 0
        assert not MPI_RESERVED & {e["name"] for e in trainer.get("env", [])}, "the Trainer refuses these"
        assert command[:2] == ["bash", "-c"] and len(command) == 3, command
        script = command[2]
        assert "mpirun --hostfile /etc/mpi/hostfile --map-by ppr:1:node" in script  # the install, once per pod
        last_step = shlex.split(script.replace("\\\n", " ").strip().splitlines()[-1])
    else:
        spec, tree = obj["spec"], "/workspace/"
        worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        slots = spec["slotsPerWorker"]
        pods = mpi_operator_hosts(obj["metadata"]["name"], spec["mpiReplicaSpecs"]["Worker"]["replicas"], "<namespace>")
        assert slots == gpus(worker["resources"]) > 0
        script, last_step = shlex.join(command), command
    r = run(["bash", "-n", "-c", script], timeout=30)
    assert r.returncode == 0, r.stderr
    at = last_step.index(f"{tree}launch/kubernetes/mpi-launcher.sh")
    assert last_step[at - 1] == "bash" and last_step[at + 1] == "python", last_step
    assert (ROOT / last_step[at + 2].removeprefix(tree)).is_file(), last_step
    for line in openmpi_hostfile(pods, slots).splitlines():
        assert f"#   {line}\n" in text, f"the header should show the hostfile line {line!r}"


# ---------------------------------------------------------------------------------------------- real processes


RANK_LINE = re.compile(r"^k8s-rank (\d+)/(\d+) local (\d+)/(\d+) cross (\d+)/(\d+) launcher (\w+) rank_sum (\S+) "
                       r"first_loss (\S+) final_loss (\S+) params (\w+)$", re.M)


def check_job(out: str, size: int, local_size: int, launcher: str) -> None:
    """Every rank reported, in the expected place, and the ranks trained one model together."""
    ranks = sorted(RANK_LINE.findall(out), key=lambda m: int(m[0]))
    assert [int(m[0]) for m in ranks] == list(range(size)), out
    for rank, size_, local, local_size_, cross, cross_size, seen_launcher, rank_sum, first, final, _ in ranks:
        assert (int(size_), int(local_size_), int(cross_size)) == (size, local_size, size // local_size), out
        assert (int(local), int(cross)) == (int(rank) % local_size, int(rank) // local_size), out
        assert seen_launcher == launcher and float(rank_sum) == size * (size - 1) / 2, out
        assert float(final) < float(first) / 4, out  # it trained
    assert len({(m[8], m[9], m[10]) for m in ranks}) == 1, f"the ranks disagree on the losses or parameters:\n{out}"


@pytest.mark.e2e
def test_torch_runtime_environment_runs_a_two_node_job(request):
    """trainjob-torch.yaml's command (plain ``torchrun script``) in two processes standing for its two pods,
    configured by nothing but the PET_* the torch plugin sets for each node (master address: this host; port:
    a free one; one process per node here, the manifest's 4 being its GPUs)."""
    require_step(request.config, "e2e")
    job = manifest("trainjob-torch.yaml")
    num_nodes, port = job["spec"]["trainer"]["numNodes"], free_port()
    assert num_nodes == 2
    cmd = _torchrun() + [TRAIN]
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(started(cmd, timeout=120, env=torch_plugin_env(
            job["metadata"]["name"], num_nodes, 1, node, master_addr="127.0.0.1", master_port=port)))
            for node in range(num_nodes)]
        outputs = [node.proc.communicate(timeout=120) for node in nodes]
    report = "\n".join(f"node {i} (exit {n.proc.returncode}):\n{out}\n{err}" for i, (n, (out, err)) in
                       enumerate(zip(nodes, outputs)))
    assert [n.proc.returncode for n in nodes] == [0, 0], report
    check_job("".join(out for out, _ in outputs), size=2, local_size=1, launcher="torchrun")
    assert [n.leftovers for n in nodes] == [[], []]


def open_mpi_mpirun() -> str:
    """Open MPI's mpirun (what both operators' OMPI_MCA_* variables are for), or skip."""
    for candidate in (shutil.which("mpirun"), "/usr/bin/mpirun"):
        if candidate and Path(candidate).exists():
            version = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=60)
            if "Open MPI" in version.stdout + version.stderr:
                return candidate
    pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin; .ci/run does this)")


@pytest.mark.e2e
@pytest.mark.parametrize("operator", ["trainer-mpi-plugin", "mpi-operator"])
def test_mpi_operator_environment_runs_a_job(operator, tmp_path, request):
    """The launcher pod's command (launch/kubernetes/mpi-launcher.sh) with the operator's hostfile and
    OMPI_MCA_* variables: one host standing for the pods ("localhost slots=2"), the hostfile in a temporary
    directory instead of /etc/mpi, the test's training script in place of the example."""
    require_step(request.config, "e2e")
    mpirun = open_mpi_mpirun()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(openmpi_hostfile(["localhost"], 2))
    env = (trainer_mpi_env if operator == "trainer-mpi-plugin" else mpi_operator_env)(2, str(hostfile))
    r = run(["bash", str(MANIFESTS / "mpi-launcher.sh"), PYTHON, TRAIN], env=dict(env, MPIRUN=mpirun), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    check_job(r.stdout, size=2, local_size=2, launcher="openmpi")
    assert "2 ranks on 1 hosts" in r.stderr, r.stderr
    assert "accepts any process that can reach" not in r.stderr, r.stderr  # the ranks got the secret
    assert r.leftovers == []


def fake_mpirun(tmp_path: Path) -> Path:
    """A stand-in for mpirun that prints its arguments and the GPUCOMM_* variables it was given."""
    path = tmp_path / "mpirun"
    path.write_text("#!/bin/bash\nprintf 'arg %s\\n' \"$@\"\nenv | grep '^GPUCOMM_' | sed 's/^/env /'\n")
    path.chmod(0o755)
    return path


def test_mpi_launcher_reads_the_hostfile(tmp_path):
    """Ranks = the slots of every line (a line without slots= gets the operator's default), rank 0's store on
    the first host, a fresh secret passed in the environment only; missing or malformed hostfiles stop it."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# written by the operator\nlocalhost slots=3\n127.0.0.1\n")
    env = dict(trainer_mpi_env(2, str(hostfile)), MPIRUN=str(fake_mpirun(tmp_path)))
    r = run(["bash", str(MANIFESTS / "mpi-launcher.sh"), "python", "train.py"], env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    args = [ln[4:] for ln in r.stdout.splitlines() if ln.startswith("arg ")]
    given = dict(ln[4:].split("=", 1) for ln in r.stdout.splitlines() if ln.startswith("env "))
    assert args[args.index("-np") + 1] == "5" and args[args.index("--hostfile") + 1] == str(hostfile), args
    assert args[-2:] == ["python", "train.py"] and "-x" in args and "GPUCOMM_SECRET" in args
    assert given["GPUCOMM_RENDEZVOUS_ADDR"] == "localhost" and given["GPUCOMM_REQUIRE_SECRET"] == "1"
    assert re.fullmatch(r"[0-9a-f]{64}", given["GPUCOMM_SECRET"]) and given["GPUCOMM_SECRET"] not in " ".join(args)
    assert "5 ranks on 2 hosts" in r.stderr

    hostfile.write_text("localhost slots=two\n")
    r = run(["bash", str(MANIFESTS / "mpi-launcher.sh"), "python", "train.py"], env=env, timeout=60)
    assert r.returncode == 2 and "host localhost has slots=two, which is not a positive whole number" in r.stderr
    r = run(["bash", str(MANIFESTS / "mpi-launcher.sh"), "python", "train.py"], timeout=60,
            env=dict(env, OMPI_MCA_orte_default_hostfile=str(tmp_path / "missing")))
    assert r.returncode == 2 and f"cannot read the MPI hostfile {tmp_path / 'missing'}" in r.stderr
