"""A tiny Llama with random weights, built offline, for real vLLM servers in the testbed.

Run with the vLLM environment's Python (it needs `transformers` and `tokenizers`, which vLLM
brings; nothing of the extproc package is imported):

    .venv-vllm/bin/python testbed/extproc_testbed/tiny_model.py OUT_DIR

4 layers, hidden size 1024, 8 heads of 128, `max_position_embeddings` 16384, a 2048-token
byte-level BPE trained on text of Python's own standard library (on this machine, no
download), and a chat template. About 133 MB of safetensors (66 M parameters), built in about
5 s. Its answers are noise; what the tests need is a real engine scheduling real tokens.

Why not smaller: an engine step of a 2-layer model of width 128 takes about 1.5 ms on a CPU,
and the server's API process, which handles every step's output, then lags its engine by
seconds on a 2-core machine (its `/metrics` and `/health` stall, requests reach the engine late
and answers leave it late). At this size a step takes about 8 ms, nearer a GPU's step on a real
model, and the API process keeps up.

The tokenizer has no end-of-sequence token, so every answer runs to its `max_tokens` (or to
the context's end), as the simulator's do: completion counts are exact, not left to chance.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VERSION = "2"  # bump when anything below changes: the cached model is rebuilt
VOCAB = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<|pad|>", "<|user|>", "<|system|>", "<|assistant|>"]
CORPUS_MODULES = ("argparse.py", "typing.py", "inspect.py", "json/decoder.py", "email/message.py", "textwrap.py")


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text("utf-8") for name in CORPUS_MODULES]


def build(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=16384, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "extproc-tiny-model.json").write_text(json.dumps({"version": VERSION}), "utf-8")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    print(build(Path(sys.argv[1])))
