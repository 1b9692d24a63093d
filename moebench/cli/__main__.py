"""`python -m moebench.cli`: the same as the `moebench` command."""

from moebench.cli import main

main()
