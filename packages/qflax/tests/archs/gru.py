"""A GRU sequence classifier: ``layers`` of ``nn.RNN(nn.GRUCell)``, then a Dense head."""

import dataclasses

import flax.linen as nn


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 32
    layers: int = 2
    classes: int = 10


class GRUClassifier(nn.Module):
    """``__call__(x: (batch, time, features)) -> logits`` from the last step."""

    config: Config = Config()

    @nn.compact
    def __call__(self, x):
        for i in range(self.config.layers):
            x = nn.RNN(nn.GRUCell(self.config.d_model), name=f"gru{i}")(x)
        return nn.Dense(self.config.classes, name="head")(x[:, -1])
