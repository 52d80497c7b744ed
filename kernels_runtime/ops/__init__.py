"""Triton kernel families. One op per file: `_<op>_kernel` (private, @triton.jit), `<op>_ref` (pure PyTorch),
`<op>(...)` launcher (check -> allocate -> launch), and a module-level config space."""
