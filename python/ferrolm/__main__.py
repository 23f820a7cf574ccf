"""`python -m ferrolm ...` is the same as the `ferrolm` command (torchrun uses this form)."""

from ferrolm.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
