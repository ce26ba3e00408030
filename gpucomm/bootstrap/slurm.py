"""Slurm's compressed notations: hostlists ("node[01-03,07],gpu-a[1-2]") and tasks per node ("2(x3),1")."""

from __future__ import annotations

import re
from ..errors import SlurmSyntaxError


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...] brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise SlurmSyntaxError(f"Slurm hostlist {text!r} has unbalanced brackets.")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmSyntaxError(f"Slurm hostlist {text!r} has an unclosed '['.")
    return parts + [text[start:]]


def _expand_range(item: str, text: str) -> list[str]:
    """Expand one bracket item like "07" or "01-03", keeping zero padding."""
    lo, sep, hi = item.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise SlurmSyntaxError(f"Slurm hostlist {text!r} has a bad range {item!r}.")
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise SlurmSyntaxError(f"Slurm hostlist {text!r} has a descending range {item!r}.")
    return [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]


def _expand_host(pattern: str, text: str) -> list[str]:
    """Expand one host pattern, e.g. "rack[1-2]-n[01,03]" (cartesian product)."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    values = [v for item in match.group(1).split(",") for v in _expand_range(item, text)]
    return [head + v + rest for v in values for rest in _expand_host(tail, text)]


def expand_slurm_nodelist(s: str) -> list[str]:
    """Expand Slurm hostlist syntax ("node[01-03,07],gpu-a[1-2],login5") in order."""
    return [host for part in _split_top_level(s.strip()) if part
            for host in _expand_host(part, s)]


def parse_slurm_tasks_per_node(s: str) -> list[int]:
    """Expand Slurm's compressed tasks-per-node ("2(x3),1" -> [2, 2, 2, 1])."""
    counts: list[int] = []
    for part in s.strip().split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise SlurmSyntaxError(f"Slurm tasks-per-node {s!r} has a bad entry {part!r}; "
                             f"expected forms like '4' or '2(x3)'.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


__all__ = ["SlurmSyntaxError", "expand_slurm_nodelist", "parse_slurm_tasks_per_node"]
