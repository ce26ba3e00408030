"""Which hosts and slots a Ray cluster offers an elastic job now (Horovod's ``RayHostDiscovery``).

Every alive node is a host, named by its IP address (``NodeManagerAddress``, the name the node's
``node:<ip>`` resource carries, which is how workers are placed there); its slots are its CPUs
divided by ``cpus_per_slot`` (and, with GPUs, no more than its GPUs divided by ``gpus_per_slot``).
Like Horovod's, it counts a node's whole resources, so the job assumes the cluster is its own.
A discovery of one's own (``override_discovery=False``) has the same method and returns the same
kind of mapping.
"""

from __future__ import annotations

import ray


class RayHostDiscovery:
    """``find_available_hosts_and_slots() -> {node_ip: slots}`` from Ray's view of its nodes."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: float = 1) -> None:
        if cpus_per_slot <= 0 or (use_gpu and gpus_per_slot <= 0):
            raise ValueError(f"gpucomm.ray: a slot needs resources: cpus_per_slot={cpus_per_slot!r} and (with use_gpu) "
                             f"gpus_per_slot={gpus_per_slot!r} must be above 0.")
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts: dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            resources = node.get("Resources", {})
            slots = resources.get("CPU", 0) // self.cpus_per_slot
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_slot)
            if slots >= 1:
                hosts[node["NodeManagerAddress"]] = int(slots)
        return hosts


__all__ = ["RayHostDiscovery"]
