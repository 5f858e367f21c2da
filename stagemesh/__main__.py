import sys

from stagemesh.entry.cli import main

sys.exit(main())
