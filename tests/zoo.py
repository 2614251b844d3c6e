"""Small random-weight fp32 checkpoints of every supported architecture, and where transformers exposes
each architecture's post_attn stream (for the hooked reference in tests/reference.py)."""

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from tests.reference import PostAttnSite, stream_arg, visit_tensor
from vllm_interp.default_model import default_model_path

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, vocab_size=49152, tie_word_embeddings=False)


@dataclass(frozen=True)
class Arch:
    name: str
    make_config: Callable[[], transformers.PretrainedConfig]
    post_attn: PostAttnSite
    model_impl: str = "auto"
    # torch.compile for one architecture of each hook form (pair layers are compiled on SmolLM2 itself);
    # the rest run eager to keep the suite's engine start-ups short. Sites are the same code either way.
    compiled: bool = False
    # Steering is checked against transformers too: one architecture of each hook form that is not Llama's.
    steered: bool = False


def _input_of(child: str) -> PostAttnSite:
    """The post_attn stream is the first input of ``child`` (a pre-MLP norm, or the MLP in post-norm blocks).
    Editing it in place also edits the residual the layer adds back: they are one tensor."""
    def install(layer, visit):
        return [getattr(layer, child).register_forward_pre_hook(lambda _m, args: visit_tensor(visit, args[0]))]
    return install


def _neox_parallel(layer, visit) -> list:
    """Parallel residual: the stream is never materialised; it is the layer input plus the attention output,
    and an edit changes the attention output (the MLP reads the layer input)."""
    inputs = []

    def attention_out(_m, _a, out):
        x, attn = inputs.pop(), out[0][0]
        visit(lambda: x + attn, lambda new: attn.copy_(new - x))

    return [layer.register_forward_pre_hook(lambda _m, args, kwargs: inputs.append(stream_arg(args, kwargs)[0]),
                                            with_kwargs=True),
            layer.attention.register_forward_hook(attention_out)]


def _config(cls, **overrides):
    return lambda: cls(**{**TINY, **overrides})


_moe = dict(num_local_experts=4, num_experts_per_tok=2)
ARCHS = [
    Arch("mistral", _config(transformers.MistralConfig, sliding_window=None), _input_of("post_attention_layernorm")),
    Arch("qwen2", _config(transformers.Qwen2Config), _input_of("post_attention_layernorm")),
    Arch("qwen3", _config(transformers.Qwen3Config, head_dim=32), _input_of("post_attention_layernorm")),
    Arch("gemma2", _config(transformers.Gemma2Config, head_dim=32, tie_word_embeddings=True),
         _input_of("pre_feedforward_layernorm")),
    # Gemma3's default layer pattern makes all three tiny layers sliding-window, which vLLM's CPU attention
    # cannot lay out; mix in a global layer as the real models do.
    Arch("gemma3", _config(transformers.Gemma3TextConfig, head_dim=32, tie_word_embeddings=True,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
         _input_of("pre_feedforward_layernorm")),
    Arch("phi3", _config(transformers.Phi3Config, pad_token_id=0), _input_of("post_attention_layernorm")),
    Arch("olmo2", _config(transformers.Olmo2Config, pad_token_id=0), _input_of("mlp")),
    Arch("gpt2", lambda: transformers.GPT2Config(n_embd=128, n_layer=3, n_head=4, n_positions=1024, vocab_size=49152),
         _input_of("ln_2"), compiled=True, steered=True),
    Arch("gpt_neox", _config(transformers.GPTNeoXConfig, use_parallel_residual=True), _neox_parallel, compiled=True,
         steered=True),
    Arch("mixtral", _config(transformers.MixtralConfig, **_moe), _input_of("post_attention_layernorm")),
    Arch("qwen2_moe", _config(transformers.Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, shared_expert_intermediate_size=64),
         _input_of("post_attention_layernorm")),
    Arch("qwen3_moe", _config(transformers.Qwen3MoeConfig, head_dim=32, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64), _input_of("post_attention_layernorm")),
    Arch("transformers_llama", _config(transformers.LlamaConfig), _input_of("post_attention_layernorm"),
         model_impl="transformers", compiled=True, steered=True),
]


def build_checkpoint(arch: Arch, root: Path) -> Path:
    """Write a random fp32 checkpoint with SmolLM2's tokenizer; deterministic per architecture."""
    path = root / arch.name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = arch.make_config()
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Default initialisation leaves some norms at exactly 1 and biases at 0; perturb everything so that
    # a site read from the wrong tensor cannot match by accident.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer_src = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, path / name)
    return path
