"""`python -m cli`: the `llm4llm` command, with the stop handlers of cli.main.main."""
from cli.main import main

main()
