import sys

from tskv._cli import main

sys.exit(main())
