"""The installed Carpool package's version (/version, TGI's /info)."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    try:
        return importlib.metadata.version("carpool")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown"
