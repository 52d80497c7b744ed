"""`python -m llm4llm.cli`, the name the GPU scripts and the commands recorded in docs/results run the CLI by. The
CLI itself lives on top of every layer (cli/, the `llm4llm` command); see __main__.py."""
