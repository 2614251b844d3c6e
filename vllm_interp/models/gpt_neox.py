"""GPT-NeoX block forward with the three sites.

With ``use_parallel_residual`` the attention and MLP both read the layer input, so no module ever
receives the post-attention stream; it is defined as ``x + attn(ln1(x))``, the stream with the attention
contribution added and the MLP's not yet. The arithmetic keeps the order of vLLM's block
(``GPTNeoXLayer.forward``) so that post_block is bit-identical to the unhooked model.
"""

from vllm_interp.hooks import POST_ATTN, POST_BLOCK, PRE_ATTN
from vllm_interp.models.hook_points import visit


def gpt_neox_layer_forward(self, position_ids, hidden_states):
    visit(self, hidden_states, None, PRE_ATTN)
    attn_output = self.attention(position_ids=position_ids, hidden_states=self.input_layernorm(hidden_states))
    if self.use_parallel_residual:
        # Steering adds to the attention output; a patch leaves the layer input alone (the MLP reads it).
        visit(self, hidden_states, attn_output, POST_ATTN, hidden_in_use=True)
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = mlp_output + attn_output + hidden_states
    else:
        attn_output = attn_output + hidden_states
        visit(self, attn_output, None, POST_ATTN)
        hidden_states = self.mlp(self.post_attention_layernorm(attn_output)) + attn_output
    visit(self, hidden_states, None, POST_BLOCK)
    return hidden_states
