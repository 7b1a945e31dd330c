"""Which buffers `parallel: ddp` broadcasts from rank 0 before each forward (hf_omni/parallel/ddp.py): a module's
state (BatchNorm statistics, what its state_dict holds), not the buffers each rank derives (a rotary embedding's
non-persistent `inv_freq`)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, ResNetConfig, ResNetModel

from hf_omni.parallel.ddp import state_buffers


def test_state_buffers_are_what_state_dict_holds_each_once():
    resnet = ResNetModel(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[16], depths=[1]))
    resnet.register_buffer("derived", torch.ones(3), persistent=False)
    resnet.encoder.register_buffer("shared", resnet.embedder.embedder.normalization.running_mean)  # one tensor, twice
    found = state_buffers(resnet)
    held = {id(v) for k, v in resnet.state_dict(keep_vars=True).items() if not isinstance(v, torch.nn.Parameter)}
    assert len(found) == len({id(b) for b in found}) == len(held) and {id(b) for b in found} == held
    assert any(b is resnet.embedder.embedder.normalization.running_var for b in found)
    assert not any(b is resnet.derived for b in found)


def test_a_rotary_embeddings_inv_freq_is_not_broadcast():
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2))
    assert dict(llm.named_buffers()) and state_buffers(llm) == []
