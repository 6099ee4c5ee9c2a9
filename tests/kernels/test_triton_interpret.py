"""Run triton_interpret_cases.py in a child pytest with TRITON_INTERPRET=1 (see that file for why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("triton_interpret_cases.py")


@pytest.mark.triton_interpret
def test_triton_kernels_match_twins_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-m", "triton_interpret"],
        env=env, capture_output=True, text=True, timeout=300, cwd=CASES.parents[2],
    )
    assert result.returncode == 0, f"interpreter cases failed:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
