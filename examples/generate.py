"""Load a Hugging Face folder (as ``zeropipe export`` writes it) with transformers alone,
and continue a prompt greedily.

    python examples/generate.py walk/tuned "the cat"
"""

from __future__ import annotations

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer


def main(folder: str, prompt: str, new_tokens: int = 24) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
    )
    return str(tokenizer.decode(out[0], skip_special_tokens=True))


if __name__ == "__main__":
    print(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "the"))
