"""A digest of the gpucomm sources this process runs: what tells two installs of one version apart.

gpucomm's version string changes only at a release, but its wire (control messages, bucket layouts,
store keys) may change between any two commits. Two hosts with checkouts or images of one version built
at different times then pass a version comparison and still read each other's messages differently.
The digest covers every ``.py`` file under the package's folder, tracked or not (paths and contents, in
sorted order; an editor's lock file, not a regular file, is skipped): the same wheel or the same clean
checkout gives the same digest on every host, whatever the file times, bytecode or install location.
Computed once per process (about 10 ms for the package's ~190 files).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["DIGEST_CHARS", "source_digest"]

DIGEST_CHARS = 12  # hex characters shown and compared (48 bits: no accidental collision between hosts)


@functools.cache
def source_digest() -> str | None:
    """The first ``DIGEST_CHARS`` hex characters of SHA-256 over the package's ``.py`` files, or None
    where they cannot be read (a zipped or frozen install): such a rank is compared by version only."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    try:
        files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts and p.is_file())
        for path in files:
            name, text = path.relative_to(root).as_posix().encode(), path.read_bytes()
            digest.update(len(name).to_bytes(8, "little") + name + len(text).to_bytes(8, "little") + text)
    except OSError:
        return None
    return digest.hexdigest()[:DIGEST_CHARS] if files else None
