"""``python -m interlace sweep SWEEP.yaml``: see :mod:`interlace.cli`."""

from interlace.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
