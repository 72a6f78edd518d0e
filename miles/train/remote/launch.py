"""`python -m miles.train.remote.launch PARENT_PID MODULE ARGS...`: run `python -m MODULE ARGS`
as an engine process that dies with the trainer thread that started it (Linux
`PR_SET_PDEATHSIG`, miles.children.die_with), so a killed trainer leaves no engine behind."""

from __future__ import annotations

import runpy
import sys

from miles import children


def main() -> None:
    parent, module, *args = sys.argv[1:]
    children.die_with(int(parent))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
