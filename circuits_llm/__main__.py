import sys

from circuits_llm.app.cli import main

sys.exit(main())
