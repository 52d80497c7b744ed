"""The `llm4llm` command (cli.main.app), on top of every layer: flows, tasks, deployments, storage and the core sit
below it and import nothing of it."""
