"""`python -m worker.model MODEL`: make MODEL's local Hugging Face directory ready (a bundled model
is converted once, about a minute) and print its path. `carpool up` runs it before the worker so a
newcomer sees the one-time conversion as such."""

from __future__ import annotations

import sys

from worker.model.loader import ModelLoadError, resolve_model_dir


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m worker.model MODEL   (a bundled name such as smollm2, or a directory)",
              file=sys.stderr)
        return 2
    try:
        print(resolve_model_dir(argv[0]))
    except ModelLoadError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
