"""kvserve against HuggingFace transformers on the embedded GGUF (issue 2's correctness check).

transformers loads the same GGUF (dequantised to fp32) and is the reference: 8 prompts of 5
to 600 tokens, 64 greedy tokens each, run by kvserve as ONE mixed batch. Tokens must be
those transformers' greedy decoding gives (checked by teacher forcing: one forward pass over
prompt and output) and the log-probabilities of every generated position must match.

Tolerance: 2e-3 on log-probabilities. Both sides compute in fp32 from the same dequantised
weights; they differ only in summation order (fused qkv / gate-up matmuls, paged attention
over blocks vs one SDPA call), which over 30 layers moves logits by ~1e-4..1e-3 (we observe
the max in the assertion message). Larger differences would mean a real bug (a wrong RoPE
position or a KV slot mix-up shifts logits by whole units).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.sampling_params import SamplingParams

ATOL_LOGPROB = 2e-3
LENGTHS = [5, 17, 40, 64, 130, 257, 400, 600]
NUM_NEW = 64

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from "
    "those used to make wine. Before him, books were copied by hand, slowly and at great "
    "cost, so that a single volume could take a scribe many months. Printing changed the "
    "economics of knowledge: within fifty years, millions of books circulated across Europe, "
    "and ideas about science, religion and politics spread faster than any ruler could "
    "control. Universities grew, literacy rose among merchants and artisans, and vernacular "
    "languages gained standard spellings. Historians still debate how much the press caused "
    "these changes and how much it merely accelerated trends already under way, but few "
    "doubt that it was one of the most consequential inventions of the millennium. "
)


@pytest.fixture(scope="module")
def prompts(make_llm) -> tuple[object, list[list[int]]]:
    llm = make_llm(num_kv_blocks=1024, max_model_len=1024, max_num_batched_tokens=512)
    ids = llm.tokenizer.encode(TEXT * 8, add_special_tokens=False)
    assert len(ids) >= max(LENGTHS)
    return llm, [ids[:n] for n in LENGTHS]


def _hf_next_token_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of the next token after each prefix ``prompt +
    output[:i]`` (row i), from one forward pass over ``prompt + output``.

    NOTE: teacher forcing. Greedy decoding by transformers gives ``output`` exactly when
    every row's argmax is the next token of ``output`` (by induction over the prefix), so one
    forward checks the tokens and the log-probabilities that 64 decode steps of ``generate``
    checked, in a tenth of the time.
    """
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


def test_mixed_batch_matches_transformers(hf_model, prompts) -> None:
    llm, prompt_ids = prompts
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, logprobs=5)
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompt_ids, outs, strict=True):
        got = out.outputs[0]
        assert len(got.token_ids) == NUM_NEW
        ref_logprobs = _hf_next_token_logprobs(hf_model, prompt, got.token_ids)
        ref_tokens = ref_logprobs.argmax(dim=-1).tolist()
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert got.logprobs is not None and len(got.logprobs) == len(ref_tokens)
        for pos, entry in enumerate(got.logprobs):
            assert len(entry) >= 5
            for token_id, lp in entry.items():
                diff = abs(lp.logprob - ref_logprobs[pos][token_id].item())
                worst = max(worst, diff)
                assert diff < ATOL_LOGPROB, (len(prompt), pos, token_id, diff)
    print(f"max |logprob diff| vs transformers: {worst:.2e}")


def test_batch_equals_alone(prompts) -> None:
    llm, prompt_ids = prompts
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW)
    together = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params, use_tqdm=False)]
    for prompt, expected in zip(prompt_ids[::3], together[::3], strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == expected
