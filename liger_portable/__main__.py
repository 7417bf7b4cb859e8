"""``python -m liger_portable info|check``: the same as the ``liger-portable`` command."""

import sys

from .cli import main

sys.exit(main())
