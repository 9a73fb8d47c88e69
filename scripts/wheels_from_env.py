#!/usr/bin/env python
"""Rebuild wheels of installed distributions from the files they installed: the GPU check's rehearsal source.

    python scripts/wheels_from_env.py OUT_DIR NAME [NAME...]

Why: ``scripts/gpu_check.sh`` installs the GPU machine's missing packages with ``pip install --no-index
--no-deps --target DIR`` from a folder of wheels. Its CPU rehearsal must run that same install in the test
suite, on a clean clone with no network beyond what ``make install`` used, so it cannot download the wheels.
The interpreter that runs the rehearsal already has every one of those distributions (``make install`` put
them there), so their wheels are made again here from what they installed: the files their RECORD lists
(inside site-packages; console scripts outside it are left out: pip writes them again from
``entry_points.txt``), byte for byte, with a fresh RECORD of sha256 digests, and the tags their own
``WHEEL`` file names. Standard library only; nothing is imported from the distributions themselves.

Prints one line per wheel (name, files, size). A distribution that is not installed, or was installed
without a RECORD (an editable or a system package), stops it with one line naming it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import os
import re
import sys
import zipfile

#: files an installer writes into .dist-info that are not part of a wheel
_INSTALLER_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel_name(dist: metadata.Distribution) -> str:
    """``name-version-pytag-abitag-plattag.whl`` from the distribution's own WHEEL tags (several tags of one
    wheel are joined per field with dots, as pip compresses them)."""
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    if not tags:
        raise SystemExit(f"wheels_from_env: {dist.metadata['Name']} has no Tag in its WHEEL file; cannot name a wheel")
    fields = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
    return f"{name}-{dist.version}-" + "-".join(".".join(f) for f in fields) + ".whl"


def _members(dist: metadata.Distribution) -> list[str]:
    """The distribution's installed files, relative to site-packages, without byte code, installer files
    and files outside site-packages."""
    if dist.files is None:
        raise SystemExit(f"wheels_from_env: {dist.metadata['Name']} has no RECORD (editable or system install); "
                         "install it with pip from a wheel first")
    out = []
    for f in dist.files:
        path = str(f)
        if path.startswith("..") or "__pycache__" in f.parts or path.endswith(".pyc"):
            continue
        if f.parts[0].endswith(".dist-info") and f.name in _INSTALLER_FILES:
            continue
        out.append(path)
    return out


def repack(name: str, out_dir: str) -> str:
    """Write ``name``'s wheel into ``out_dir``; return its path."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"wheels_from_env: {name} is not installed in {sys.prefix}; run make install") from None
    members = _members(dist)
    info = next(p for p in members if p.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
    path = os.path.join(out_dir, _wheel_name(dist))
    record, size = [], 0
    # stored, not deflated: the rehearsal unpacks it at once, and compressing 50 MB of transformers costs seconds
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for member in members:
            data = dist.locate_file(member).read_bytes()
            zf.writestr(member, data)
            record.append(f"{member},{_digest(data)},{len(data)}")
            size += len(data)
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    print(f"{os.path.basename(path)}: {len(members)} files, {size / 2**20:.1f} MiB")
    return path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    os.makedirs(argv[0], exist_ok=True)
    for name in argv[1:]:
        repack(name, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
