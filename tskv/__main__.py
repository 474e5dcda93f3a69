import sys

from tskv.cli import main

sys.exit(main())
