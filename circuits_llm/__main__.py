from circuits_llm.cli import main
import sys
sys.exit(main())
