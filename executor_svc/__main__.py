import sys

from executor_svc.cli import main

sys.exit(main())
