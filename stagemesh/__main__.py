import sys

from stagemesh.cli import main

sys.exit(main())
