"""`python -m ringmaster.cli …` is the `ringmaster` command."""

import sys

from ringmaster.cli.app import app

sys.exit(app())
