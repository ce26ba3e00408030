"""``gpucomm-run``, the job launcher: slot assignment, local and ssh spawning, fail-fast supervision.

The command line lives in ``gpucomm.runner.cli`` (imported on use, so that the remote wrapper
``python -m gpucomm.runner.remote`` starts without loading the launcher).
"""

from .hosts import HostSlots, HostSpecError, assign_slots, parse_hostfile, parse_hostfile_text, parse_hosts

__all__ = ["HostSlots", "HostSpecError", "assign_slots", "parse_hostfile", "parse_hostfile_text",
           "parse_hosts"]
