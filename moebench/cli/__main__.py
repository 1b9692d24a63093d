"""`python -m moebench.cli`: the same as the `moebench` command."""

from moebench.cli import main

if __name__ == "__main__":
    main()
