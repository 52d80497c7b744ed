"""Reference inference script: any Hugging Face causal LM, greedy `generate` over a seeded random prompt.

Implements the llm4llm script contract (`build`, `inputs`, `run`). The model is built from `workload.model`:
`model_type` + `config` with seeded random weights, or a local `checkpoint` directory (offline).
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Random-weight models must never stop early: no token may count as end-of-sequence.
_NO_SPECIAL_TOKENS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}


def build(workload) -> torch.nn.Module:
    """The model on `workload.device` in `workload.dtype`, eval mode."""
    dev = torch.device(workload.device)
    spec = workload.model
    if spec.checkpoint is not None:
        model = AutoModelForCausalLM.from_pretrained(
            spec.checkpoint, dtype=workload.torch_dtype, local_files_only=True
        ).to(dev)
    else:
        config = AutoConfig.for_model(spec.model_type, **copy.deepcopy({**_NO_SPECIAL_TOKENS, **spec.config}))
        torch.manual_seed(workload.seed)
        # Built on the target device directly: building a 7B model on the CPU first takes minutes.
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=workload.torch_dtype)
    return model.eval()


def inputs(workload) -> dict[str, torch.Tensor]:
    """Seeded random prompt: input_ids and attention_mask, both [batch, prompt_len]. Under `[regime] padding =
    "left"` the rows have different prompt lengths (`Regime.row_prompt_lens`), left-padded to prompt_len as
    `generate` expects them: pad id 0 and mask 0 before each row's prompt."""
    vocab = _vocab_size(workload)
    gen = torch.Generator().manual_seed(workload.seed)
    B, S = workload.batch_size, workload.prompt_len
    ids = torch.randint(0, vocab, (B, S), generator=gen)  # [B, S]
    regime = getattr(workload, "regime", None)
    lens = regime.row_prompt_lens(B, S, workload.seed) if regime is not None else [S] * B
    mask = (torch.arange(S)[None, :] >= S - torch.tensor(lens)[:, None]).long()  # [B, S], 0 on the left pads
    dev = torch.device(workload.device)
    return {"input_ids": (ids * mask).to(dev), "attention_mask": mask.to(dev)}


def run(model: torch.nn.Module, workload, inputs: dict[str, torch.Tensor], **generate_kwargs) -> torch.Tensor:
    """Prefill + exactly `decode_len` greedy decode steps; returns the ids [batch, prompt_len + decode_len].

    `generate_kwargs` reach `generate` (e.g. `cache_implementation="static"`, which the torch.compile baseline of
    `llm4llm evaluate` uses)."""
    with torch.inference_mode():
        return model.generate(
            **inputs,
            max_new_tokens=workload.decode_len,
            min_new_tokens=workload.decode_len,
            do_sample=False,
            pad_token_id=0,
            **generate_kwargs,
        )


def _vocab_size(workload) -> int:
    spec = workload.model
    if spec.checkpoint is not None:
        config = AutoConfig.from_pretrained(spec.checkpoint, local_files_only=True)
    else:
        config = AutoConfig.for_model(spec.model_type, **copy.deepcopy(spec.config))
    return config.get_text_config().vocab_size
