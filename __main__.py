"""`python -m bitnet_cpu ...`: the `bitnet` command."""
import sys

from .cli import main

sys.exit(main())
