"""``python -m loaderd`` runs the command line."""

from loaderd.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
