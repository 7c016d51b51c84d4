"""The GPU kernels compile for sm_90 at real model shapes, on a machine without a GPU (`tests/sm90.py`): the check
that would have caught the fused MLA chain's compile error before a GPU run did."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_mla_kernels_compile_for_sm90_at_real_shapes():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).resolve().parent
    r = subprocess.run([sys.executable, str(here / "sm90.py"), "mla"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "_mla_prep_kernel" in r.stdout and "_mla_split_kernel" in r.stdout and "_uv_kernel" in r.stdout
