"""``python -m stiefkv``: the same CLI as the ``stiefkv`` command (the form a launcher such as ``torchrun -m``
takes)."""

from stiefkv.cli import main

if __name__ == "__main__":
    main(prog_name="stiefkv")
