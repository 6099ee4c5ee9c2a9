"""The worker preloads Intel's OpenMP once, when asked and where it is installed."""

from __future__ import annotations

from pathlib import Path

from worker.model.openmp_runtime import intel_openmp_library, preload_environment

LIB = Path("/opt/venv/lib/libiomp5.so")


def test_intel_is_preloaded_in_front_of_what_was_there() -> None:
    env = preload_environment({"PATH": "/bin", "LD_PRELOAD": "/x/libtcmalloc.so"}, "intel", LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{LIB}:/x/libtcmalloc.so", "CARPOOL_OPENMP_PRELOADED": "1"}
    assert preload_environment({}, "intel", LIB) == {"LD_PRELOAD": str(LIB), "CARPOOL_OPENMP_PRELOADED": "1"}


def test_nothing_changes_for_gnu_without_the_library_or_a_second_time() -> None:
    assert preload_environment({}, "gnu", LIB) is None
    assert preload_environment({}, "intel", None) is None
    assert preload_environment({"CARPOOL_OPENMP_PRELOADED": "1"}, "intel", LIB) is None
    assert preload_environment({"LD_PRELOAD": "/y/libiomp5.so"}, "intel", LIB) is None


def test_the_library_is_found_where_the_wheel_puts_it(tmp_path: Path) -> None:
    assert intel_openmp_library(str(tmp_path)) is None
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert intel_openmp_library(str(tmp_path)) == tmp_path / "lib" / "libiomp5.so"
