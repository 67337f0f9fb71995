"""`python -m moeserve ...` runs the `moeserve` command."""

import sys

from moeserve.cli import main

sys.exit(main())
