"""``python -m tightfit``: the ``tightfit`` command line (:func:`tightfit.cli.main`)."""

import sys

from tightfit.cli import main

sys.exit(main())
