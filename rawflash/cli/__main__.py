"""``python -m rawflash.cli``: the ``rawflash`` command line."""
from .commands import main

if __name__ == "__main__":
    main()
