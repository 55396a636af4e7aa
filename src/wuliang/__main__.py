import sys

from wuliang.cli import main

sys.exit(main())
