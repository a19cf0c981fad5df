"""Generate text with an exported run (`crucible-coordinator export`, or crucible-swarm's `hf/` folder).

  python -m scripts.generate runs/<run id>/hf --prompt "def " [--tokens 200] [--temperature 0.8] [--greedy]

Loads the folder with `transformers.AutoModelForCausalLM.from_pretrained` (offline; a Llama, or a GLM-4-MoE
for an MoE run) and samples one token at a time over a window of the model's context (`max_position_embeddings`, the run's seq_len). Byte-level runs
(no tokenizer.json in the folder) encode the prompt as UTF-8 bytes; with a tokenizer.json beside the
weights, its ids. Prints the prompt and the continuation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


class Codec:
    """Text <-> token ids: UTF-8 bytes, or the run's `tokenizers` tokenizer when the export ships one."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        self.tok = None
        if path.is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids if self.tok is not None else list(text.encode())

    def decode(self, ids: list[int]) -> str:
        if self.tok is not None:
            return str(self.tok.decode(ids))
        return bytes(i for i in ids if i < 256).decode(errors="replace")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    ids: list[int],
    n: int,
    context: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> list[int]:
    """n new token ids after `ids`, each from the last `context` ids; temperature 0 = greedy."""
    g = torch.Generator().manual_seed(seed)
    out = list(ids)
    for _ in range(n):
        window = torch.tensor([out[-context:]])  # (1, L)
        logits = model(input_ids=window).logits[0, -1].float()  # (V,)
        if temperature <= 0:
            out.append(int(logits.argmax()))
            continue
        top = torch.topk(logits / temperature, min(top_k, logits.numel()))
        probs = torch.softmax(top.values, dim=-1)
        out.append(int(top.indices[int(torch.multinomial(probs, 1, generator=g))]))
    return out[len(ids) :]


def load(folder: Path) -> tuple[torch.nn.Module, int]:
    """(the model in eval mode, its context length); ValueError naming what is missing."""
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ValueError(
            f"{folder} holds no exported model (config.json + model.safetensors): export one with "
            "`crucible-coordinator export RUN --out DIR ...`"
        )
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, local_files_only=True
    ).eval()
    context = int(json.loads((folder / "config.json").read_text())["max_position_embeddings"])
    return model, context


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="an exported model folder (example: runs/swarm-1a2b/hf)")
    ap.add_argument("--prompt", default="def ", help='text to continue (default "def ")')
    ap.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    ap.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (default 40)")
    ap.add_argument("--greedy", action="store_true", help="always take the likeliest token")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.top_k < 1:
        ap.error(f"--tokens {args.tokens} and --top-k {args.top_k} must be positive")
    try:
        model, context = load(args.folder)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    codec = Codec(args.folder)
    ids = codec.encode(args.prompt) or [ord("\n")]
    new = generate(
        model, ids, args.tokens, context, 0.0 if args.greedy else args.temperature, args.top_k, args.seed
    )
    print(args.prompt + codec.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
