"""``python -m stiefkv``: the same CLI as the ``stiefkv`` command (what ``torchrun -m stiefkv`` launches)."""

from stiefkv.cli import main

if __name__ == "__main__":
    main(prog_name="stiefkv")
