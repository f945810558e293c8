import sys

from circuits_llm.cli import main

sys.exit(main())
