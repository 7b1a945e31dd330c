"""`Projector`: the small MLP that maps one module's features into another's embedding space.

Almost every VLM needs one (vision features -> LLM embeddings), so it ships as an HF model of its own,
registered with `AutoConfig` / `AutoModel` so that an exported `projector/` folder loads alone.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN


class ProjectorConfig(PretrainedConfig):
    model_type = "hf_omni_projector"

    def __init__(
        self,
        in_features: int = 768,
        out_features: int = 768,
        hidden_size: int | None = None,
        num_layers: int = 2,
        hidden_act: str = "gelu",
        bias: bool = True,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.in_features = in_features
        self.out_features = out_features
        self.hidden_size = hidden_size if hidden_size is not None else out_features
        self.num_layers = num_layers
        self.hidden_act = hidden_act
        self.bias = bias
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


class Projector(PreTrainedModel):
    """`num_layers` linear layers with `hidden_act` between them: in_features -> ... -> out_features."""

    config_class = ProjectorConfig
    base_model_prefix = "projector"
    main_input_name = "hidden_states"

    def __init__(self, config: ProjectorConfig):
        super().__init__(config)
        if config.num_layers < 1:
            raise ValueError(f"ProjectorConfig.num_layers must be >= 1, got {config.num_layers}")
        dims = [config.in_features] + [config.hidden_size] * (config.num_layers - 1) + [config.out_features]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=config.bias) for a, b in zip(dims[:-1], dims[1:]))
        self.act = ACT2FN[config.hidden_act]
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                module.bias.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i:
                hidden_states = self.act(hidden_states)
            hidden_states = layer(hidden_states)
        return hidden_states


AutoConfig.register(ProjectorConfig.model_type, ProjectorConfig, exist_ok=True)
AutoModel.register(ProjectorConfig, Projector, exist_ok=True)
