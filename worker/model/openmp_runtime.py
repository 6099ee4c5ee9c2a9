"""Which OpenMP runtime the model's CPU threads run on.

torch's CPU build links GNU OpenMP. Intel's runtime (libiomp5, the PyPI package `intel-openmp`)
implements the same GOMP entry points and, loaded first, serves every parallel region instead:
torch's, oneDNN's and the C++ kernels'. vLLM's CPU backend preloads it the same way. On a
2-core Sapphire Rapids shared with other work it gave Carpool 406/339 tok/s against 377/303 on GNU
OpenMP, pair by pair (`LD_PRELOAD=.../libiomp5.so python scripts/bench_engine.py --num-requests 128
--modes continuous --baselines none --no-profile --threads 2`). It must be in place when the
process starts, so the worker re-executes itself once with LD_PRELOAD set.

Opt-in (CARPOOL_OPENMP=intel), not the default: with it on, one run of the integration suite saw
two workers stop serving without a word in their logs, which no later run reproduced; two OpenMP
runtimes in one process (libtorch still links GNU's) is the suspect until that is understood.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

_PRELOADED = "CARPOOL_OPENMP_PRELOADED"  # set on the re-executed process: never twice


def intel_openmp_library(prefix: str = sys.prefix) -> Path | None:
    """libiomp5.so as the intel-openmp wheel installs it into this environment, if it does."""
    candidate = Path(prefix) / "lib" / "libiomp5.so"
    return candidate if candidate.is_file() else None


def preload_environment(environ: Mapping[str, str], runtime: str,
                        library: Path | None) -> dict[str, str] | None:
    """The environment to re-execute with so that Intel's OpenMP loads first; None when the
    process should run as it is (GNU asked for, no library here, or already preloaded)."""
    preload = environ.get("LD_PRELOAD", "")
    if runtime != "intel" or library is None or environ.get(_PRELOADED) or "libiomp5" in preload:
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(part for part in (str(library), preload) if part)
    env[_PRELOADED] = "1"
    return env
