"""Build a small local tokenizer for the load tools' synthetic prompts, with no downloads.

guidellm and inference-perf size their synthetic prompts in tokens, so both need a Hugging Face
tokenizer; on a machine without hub access neither can fetch one. This trains a byte-level BPE
on the Python standard library's own sources and saves it as a Hugging Face tokenizer directory
that `transformers.AutoTokenizer.from_pretrained(DIR)` loads offline:

    /path/to/tool-venv/bin/python bench/make_tokenizer.py /tmp/lt/tokenizer

Run it with either tool's interpreter (both bring `tokenizers` and `transformers`). Then point the
tools at DIR: guidellm `tokenizer: {kind: hf_auto, model: DIR}` (or `--tokenizer kind=hf_auto,model=DIR`),
inference-perf `tokenizer.pretrained_model_name_or_path: DIR`. Against a real engine, use the
engine's own tokenizer instead: the counts then match what the engine bills.

The vocabulary is small (2000) on purpose: inference-perf builds its prompts from random token
ids, and with 2000 tokens such a prompt of N tokens is about 3.9 N characters, so the sidecar's
estimate (4 characters a token) reads it as about N tokens (0.96 N, measured). With 8000 tokens
it read 1.35 N, and prompts of 9700 tokens were already refused as too long for the 13107-token
usable context.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path


def stdlib_sources(limit: int) -> list[str]:
    """The first `limit` .py files of the running interpreter's standard library, sorted (the same
    corpus, so the same tokenizer, on every run)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())[:limit]
    return [str(p) for p in files]


def build(out: Path, vocab_size: int = 2000, files: int = 200) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(stdlib_sources(files), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>", model_max_length=16384)
    # A minimal chat template, for the tools that render chat prompts through the tokenizer.
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the tokenizer to")
    parser.add_argument("--vocab-size", type=int, default=2000)
    args = parser.parse_args()
    path = build(args.out, args.vocab_size)
    print(f"tokenizer written to {path}")


if __name__ == "__main__":
    main()
