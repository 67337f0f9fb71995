"""A `main(argv)` for `moeserve.distributed.processes` to run in a child: it reports what the
child saw (its argv, an environment variable, whether the caller started it) and exits with
the code it is asked for."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from moeserve.distributed.processes import started_by


def main(argv: list[str]) -> int:
    out, parent, code = Path(argv[0]), int(argv[1]), int(argv[2])
    seen = {
        "argv": argv,
        "sys_argv0": sys.argv[0],
        "env": os.environ.get("MOESERVE_CHILD_PROBE"),
        "started_by_parent": started_by(parent),
        "started_by_other": started_by(parent + 1_000_000),
        "torch_preloaded": "torch" in sys.modules,
    }
    out.write_text(json.dumps(seen))
    if code < 0:
        signal.pause()  # wait to be signalled
    return code


if __name__ == "__main__":  # the fresh-interpreter path: python -m helpers.child_main ...
    sys.exit(main(sys.argv[1:]))
