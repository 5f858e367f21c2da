"""`python -m kernels`: build the fused CPU kernels for this machine now (make install runs it)."""
from __future__ import annotations

import logging
import sys

from kernels import cpu_ops


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = cpu_ops.load(verbose="-v" in sys.argv)
    if module is None:
        sys.exit("the CPU kernels could not be built; stagemesh will use the torch reference on CPU")
    print(f"CPU kernels ready: {module.__file__}")


if __name__ == "__main__":
    main()
