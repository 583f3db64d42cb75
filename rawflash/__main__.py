"""``python -m rawflash``: the ``rawflash`` command line."""
from .cli import main

if __name__ == "__main__":
    main(prog_name="rawflash")
