"""Write a random-weight Llama of a chosen size, with the tokenizer of another model folder.

    python benchmarks/make_random_llama.py OUT --tokenizer DIR [--hidden 2048] [--layers 16]

For benchmarks where no real weights can travel (the lent GPU has no network).
"""

import argparse
import shutil
from pathlib import Path

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                                      num_key_value_heads=max(1, args.hidden // 512), vocab_size=len(tokenizer),
                                      max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in Path(args.tokenizer).glob("tokenizer*"):
        shutil.copy(name, Path(args.out) / name.name)
    print(f"random llama: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params -> {args.out}")


if __name__ == "__main__":
    main()
