"""`python -m llm4llm.cli ...` runs `python -m cli ...`. The core imports nothing of the CLI above it: the CLI is
run here by its name, as a program, and this module is never imported by anything."""
import runpy

runpy.run_module("cli", run_name="__main__", alter_sys=True)
