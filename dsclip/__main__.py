import sys

from dsclip.cli import main

sys.exit(main())
