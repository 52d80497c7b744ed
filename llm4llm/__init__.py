"""llm4llm: deployment-aware, closed-loop optimizer of GPU kernels for language-model inference."""

__version__ = "0.1.0"
