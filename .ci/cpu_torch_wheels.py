"""Wheel files of a CPU PyTorch stack for ``scripts/install.py --torch-wheels`` on a machine that reaches only PyPI.

    python3 .ci/cpu_torch_wheels.py OUT

PyPI's Linux torchvision and torchaudio wheels link CUDA libraries that a CPU torch does not ship. The copies
written to OUT leave out those compiled libraries (ComfyUI uses only their Python parts) and guard torchvision's
two fake-op registrations that need them; their RECORD lists the files as they are. torch itself is the machine's
CPU wheel (``pip download torch==2.13.0`` takes it). Reused when OUT already holds all three.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile

TORCH, TORCHVISION, TORCHAUDIO = "2.13.0", "0.28.0", "2.11.0"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _patched(name: str, data: bytes) -> bytes | None:
    """The member as the CPU copy holds it; None to leave it out."""
    if name.endswith(".so") or ".so." in name or name.startswith(("torchvision.libs/", "torchaudio.libs/")):
        return None
    if name == "torchvision/_meta_registrations.py":
        guarded = r'@(\1.register_fake("torchvision::\2") if torchvision.extension._has_ops() else (lambda f: f))'
        return re.sub(r'@([\w.]+)\.register_fake\("torchvision::(nms|qnms)"\)', guarded, data.decode()).encode()
    return data


def repack(source: str, dest: str) -> None:
    with zipfile.ZipFile(source) as zin:
        members = [(i.filename, zin.read(i.filename)) for i in zin.infolist() if not i.is_dir()]
    record = next(n for n, _ in members if n.endswith(".dist-info/RECORD"))
    kept = [(n, d) for n, d in ((n, _patched(n, d)) for n, d in members if n != record) if d is not None]
    lines = [_record_line(n, d) for n, d in kept] + [f"{record},,"]
    with zipfile.ZipFile(dest + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
        for name, data in kept:
            zout.writestr(name, data)
        zout.writestr(record, "\n".join(lines) + "\n")
    os.replace(dest + ".tmp", dest)


def main(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    wanted = [f"torch-{TORCH}", f"torchvision-{TORCHVISION}", f"torchaudio-{TORCHAUDIO}"]
    if all(glob.glob(os.path.join(out, f"{w}*.whl")) for w in wanted):
        return 0
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*pip, "-d", out, f"torch=={TORCH}"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "-d", tmp, f"torchvision=={TORCHVISION}", f"torchaudio=={TORCHAUDIO}"], check=True)
        for wheel in glob.glob(os.path.join(tmp, "*.whl")):
            repack(wheel, os.path.join(out, os.path.basename(wheel)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
