"""`python -m dsv41_decode ...` is `dsv41-decode ...`."""

import sys

from .cli import main

sys.exit(main())
