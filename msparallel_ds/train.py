"""`python -m msparallel_ds.train RUN.yaml ...`: the same as `msparallel-ds train` (see msparallel_ds/run)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
