"""Write reference cases for a GGUF model with Hugging Face transformers (an independent float32
implementation): the prompt rendered and tokenized by transformers' own tokenizer and chat
template from the GGUF (a model without a template: the text after BOS), 32 greedy tokens, and
teacher-forced top-8 logits (see README.md).

    pip install transformers accelerate
    python tests/data/cases/make_case.py PATH.gguf OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

MESSAGES = {
    "prime": [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    "capital": [{"role": "user", "content": "The capital of France is"}],
}
NEW_TOKENS = 32


def main(gguf: str, out: str) -> None:
    import transformers as tf

    path = Path(gguf)
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    cases = {}
    for name, messages in MESSAGES.items():
        if tok.chat_template:
            prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        else:  # a pre-trained model: the user text as is, after the tokenizer's BOS
            prompt = tok(messages[-1]["content"]).input_ids
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float()  # (32, V)
        top = logits.topk(8, dim=-1)
        cases[name] = {"messages": messages, "prompt_ids": prompt, "greedy_ids": ids[len(prompt):],
                       "text": tok.decode(ids[len(prompt):]), "top8_ids": top.indices.tolist(),
                       "top8_logits": [[round(v, 5) for v in row] for row in top.values.tolist()]}
    Path(out).write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
