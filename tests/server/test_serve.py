"""`vllm-interp serve` on the default model: starts, hooks, answers /v1/completions."""

import subprocess

from tests.conftest import VLLM_INTERP


def test_serve_answers_completions_on_the_default_model(server):
    url, _ = server
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model.endswith("SmolLM2-135M-Instruct")
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
    assert completion.choices[0].text.startswith(" Paris")


def test_serve_help_lists_our_flags():
    out = subprocess.run([VLLM_INTERP, "serve", "--help=vllm-interp"], capture_output=True, text=True, check=True)
    for flag in ("--enable-steering", "--enable-patching", "--max-patch-rows", "--patch-source-bytes",
                 "--max-sweep-cells", "--capture-consumers", "--sae"):
        assert flag in out.stdout
    top = subprocess.run([VLLM_INTERP, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "trace", "demo", "models", "export-saelens"):
        assert command in top
    trace = subprocess.run([VLLM_INTERP, "trace", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--clean", "--corrupt", "--answer", "--foil", "--server", "--out"):
        assert flag in trace


def test_a_bad_sae_flag_is_refused_before_start(tmp_path):
    out = subprocess.run([VLLM_INTERP, "serve", "--enable-steering", "--sae", "nodir"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--sae 'nodir': expected NAME=DIR" in out.stderr + out.stdout


def test_unknown_capture_consumer_is_refused_before_start():
    out = subprocess.run([VLLM_INTERP, "serve", "--capture-consumers", "nosuch:root=/tmp"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "unknown consumer 'nosuch'" in out.stderr + out.stdout
