"""``python -m liger_portable COMMAND`` (info, check, warmup, demo): the same as the ``liger-portable`` command."""

import sys

from .cli import main

sys.exit(main())
