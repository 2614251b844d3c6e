"""Capture over HTTP with the openai client: rows come back in the response.

    vllm-interp serve --dtype float32 --capture-consumers inline &
    python examples/capture_openai_client.py --base-url http://localhost:8000

The ``capture`` field rides in ``extra_body``; a non-streaming response carries ``capture_results``, where
the inline consumer's rows are a base64 safetensors blob that ``ResidualReadout.from_result`` decodes.
"""

import argparse

from openai import OpenAI

from vllm_interp import ResidualReadout


def main(base_url: str) -> dict[str, object]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
        extra_body={"capture": {"inline": {"hooks": {"post_block": [10, 20]}, "positions": "all_prompt"}}},
    )
    result = completion.model_dump()["capture_results"]["inline"]
    if result["status"] != "ok":
        raise RuntimeError(f"capture failed: {result['message']}")
    readout = ResidualReadout.from_result(result["result"])
    return {
        "text": completion.choices[0].text,
        "sites": readout.sites,
        "shape": tuple(readout["20.post_block"].shape),  # [prompt tokens, hidden]
        "last_token_norms": [round(float(readout[site][-1].norm()), 2) for site in readout.sites],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://localhost:8000")
    print(main(parser.parse_args().base_url))
