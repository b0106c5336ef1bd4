import sys

from scheduler_svc.cli import main

sys.exit(main())
