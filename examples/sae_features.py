"""Sparse-autoencoder features: read which features fire on a prompt, then steer with one of them.

    python examples/sae_features.py --sae DIR

DIR is an SAE saved by SAELens (``cfg.json`` + ``sae_weights.safetensors``) on a residual site of the default
model, e.g. ``blocks.6.hook_resid_post``.

1. The ``sae_features`` consumer returns each prompt position's top-k feature ids and activations.
2. The strongest feature at the last position becomes a steering entry ``{sae, feature, scale}``: the engine
   adds ``scale * W_dec[feature]`` at the SAE's site.
"""

import argparse

from vllm import SamplingParams

from vllm_interp import LLM, steered_params
from vllm_interp.hooks import parse_site_name

PROMPT = "The weather today is cold and rainy, so I will"


def main(llm: LLM, sae: str) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    output = llm.generate(PROMPT, greedy, capture={"sae_features": {"sae": sae, "k": 3, "positions": "all_prompt"}},
                          use_tqdm=False)[0]
    features = output.capture["sae_features"].result
    tokens = llm.get_tokenizer().convert_ids_to_tokens(output.prompt_token_ids)
    for token, ids, values in zip(tokens, features["feature_ids"], features["feature_values"], strict=True):
        print(f"{token!r:>12}  " + "  ".join(f"#{i}={v:.2f}" for i, v in zip(ids, values, strict=True)))

    strongest = features["feature_ids"][-1][0]
    layer, hook = parse_site_name(features["site"])
    steer = {hook: {layer: {"sae": sae, "feature": strongest, "scale": 12.0}}}
    plain, steered = llm.generate([PROMPT, PROMPT], [greedy, steered_params(greedy, steering_vectors=steer)],
                                  use_tqdm=False)
    texts = {"unsteered": plain.outputs[0].text, f"+feature {strongest}": steered.outputs[0].text}
    for label, text in texts.items():
        print(f"{label:<16} {PROMPT}{text!r}")
    return {"site": features["site"], "top": features["feature_ids"], "texts": texts}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sae", required=True, help="an SAELens SAE directory on a residual site")
    args = parser.parse_args()
    main(LLM(dtype="float32", enable_steering=True, capture_consumers=("sae_features",), saes={"sae": args.sae}),
         "sae")
