"""``python -m meshinfer`` runs the command line."""

import sys

from meshinfer.app.cli import main

sys.exit(main())
