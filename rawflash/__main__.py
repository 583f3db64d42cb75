"""``python -m rawflash``: the ``rawflash`` command line."""
from .cli.commands import main

if __name__ == "__main__":
    main(prog_name="rawflash")
