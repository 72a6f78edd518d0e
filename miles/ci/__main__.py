import sys

from miles.ci.cli import main

sys.exit(main())
