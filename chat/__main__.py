import sys

from chat.app import main

sys.exit(main())
