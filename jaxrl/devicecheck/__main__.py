"""``python -m jaxrl.devicecheck``: see ``jaxrl.devicecheck.run``."""

import sys

from jaxrl.devicecheck.run import main

sys.exit(main())
