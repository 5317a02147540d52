"""`python -m s3serve_cli` runs the `s3serve` command."""

import sys

from s3serve_cli.main import main

sys.exit(main())
