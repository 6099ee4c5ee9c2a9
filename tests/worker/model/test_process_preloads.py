"""The worker preloads tcmalloc and, when asked, Intel's OpenMP, once, where they are installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.__main__ import main as worker_main
from worker.model.process_preloads import (
    intel_openmp_library,
    preload_environment,
    tcmalloc_library,
    wanted_libraries,
)

IOMP = Path("/opt/venv/lib/libiomp5.so")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def test_the_libraries_go_in_front_of_what_was_there() -> None:
    env = preload_environment({"PATH": "/bin", "LD_PRELOAD": "/x/libfoo.so"}, [TCMALLOC, IOMP])
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{TCMALLOC}:{IOMP}:/x/libfoo.so", "CARPOOL_PRELOADED": "1"}
    assert preload_environment({}, [IOMP]) == {"LD_PRELOAD": str(IOMP), "CARPOOL_PRELOADED": "1"}


def test_nothing_changes_without_libraries_a_second_time_or_when_preloaded_already() -> None:
    assert preload_environment({}, []) is None
    assert preload_environment({"CARPOOL_PRELOADED": "1"}, [TCMALLOC]) is None
    assert preload_environment({"LD_PRELOAD": "/y/libiomp5.so"}, [IOMP]) is None
    # Only what is not there yet is added.
    env = preload_environment({"LD_PRELOAD": str(TCMALLOC)}, [TCMALLOC, IOMP])
    assert env is not None and env["LD_PRELOAD"] == f"{IOMP}:{TCMALLOC}"


def test_the_settings_choose_among_what_is_installed() -> None:
    assert wanted_libraries("tcmalloc", "gnu", TCMALLOC, IOMP) == [TCMALLOC]
    assert wanted_libraries("tcmalloc", "intel", TCMALLOC, IOMP) == [TCMALLOC, IOMP]
    assert wanted_libraries("system", "intel", TCMALLOC, IOMP) == [IOMP]
    assert wanted_libraries("system", "gnu", TCMALLOC, IOMP) == []
    assert wanted_libraries("tcmalloc", "intel", None, None) == []


def test_the_libraries_are_found_where_their_packages_put_them(tmp_path: Path) -> None:
    assert intel_openmp_library(str(tmp_path)) is None
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert intel_openmp_library(str(tmp_path)) == tmp_path / "lib" / "libiomp5.so"
    installed = tmp_path / "libtcmalloc_minimal.so.4"
    assert tcmalloc_library([installed]) is None
    installed.write_bytes(b"")
    assert tcmalloc_library([tmp_path / "absent.so", installed]) == installed


def test_an_unknown_allocator_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CARPOOL_ALLOCATOR", "jemalloc")
    assert worker_main(["--model", "synthetic"]) == 2  # before any model or Redis is touched
    assert "allocator" in capsys.readouterr().err
    monkeypatch.delenv("CARPOOL_ALLOCATOR")
    with pytest.raises(SystemExit) as refused:  # the flag: argparse names the choices
        worker_main(["--model", "synthetic", "--allocator", "jemalloc"])
    assert refused.value.code == 2
    assert "'tcmalloc', 'system'" in capsys.readouterr().err
