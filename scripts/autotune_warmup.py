#!/usr/bin/env python
"""Autotune warmup (the same as ``liger-portable warmup``): see :mod:`liger_portable.warmup`.

    python scripts/autotune_warmup.py llama-3-8b --tokens 8192 --dry-run
    torchrun --nproc-per-node 8 scripts/autotune_warmup.py llama-3-70b --tokens 8192
"""

import sys

from liger_portable.warmup import main

if __name__ == "__main__":
    sys.exit(main())
