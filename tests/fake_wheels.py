"""Tiny wheels made on the spot, for install tests that must run offline.

:func:`make_wheel` writes a pure-Python wheel (a package folder, METADATA with
``Requires-Dist`` lines, WHEEL, a RECORD with hashes) that pip installs with
``--no-index --find-links``. The module is also a PEP 517 build backend
(``build-backend = "fake_wheels"``, ``backend-path = ["."]``) for a copy of the lab whose
``pip install -e .`` must not download setuptools: :func:`build_editable` makes a wheel
holding one ``.pth`` line that points at the source folder.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path


def make_wheel(directory: str | os.PathLike, name: str, version: str, files: dict[str, str] | None = None,
               requires: tuple[str, ...] = ()) -> Path:
    """Write ``<name>-<version>-py3-none-any.whl`` into ``directory``; return its path."""
    files = dict(files if files is not None else {f"{name}/__init__.py": f"__version__ = {version!r}\n"})
    info = f"{name}-{version}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires))
    files[f"{info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: fake_wheels\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n")
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    out = Path(directory) / f"{name}-{version}-py3-none-any.whl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return out


# ----------------------------------------------------------------- PEP 517 backend (lab_utils 0.1.0)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return make_wheel(wheel_directory, "lab_utils", "0.1.0", {"lab_utils_stub.py": ""}).name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    pth = {"_lab_utils_editable.pth": os.getcwd() + "\n"}
    return make_wheel(wheel_directory, "lab_utils", "0.1.0", pth).name
