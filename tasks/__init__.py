"""Prefect tasks: thin wrappers over the pure stage functions in llm4llm.stages and storage.

They pass paths and ids only (Prefect cannot hash tensors or modules and would silently re-run). Retries are for
infrastructure failures; bad input (an Llm4llmError) fails once, with its message.
"""
