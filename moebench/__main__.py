"""`python -m moebench ...`: the same as the `moebench` command (for clusters where the console
script is not on PATH: module environments, `srun python -m moebench ...`)."""

from moebench.cli import main

if __name__ == "__main__":
    main()
