"""PPO's learned value function: a value head on the policy's last hidden state
(``train.critic``).

Held by the trainer (``engines/train/trainer.py``), which feeds it the final hidden states
of each micro-batch's loss positions and adds its clipped value loss to the policy's (the
gradient reaches the shared trunk through the policy's optimiser). The head itself is a
linear layer outside the policy model, so weight publishes and saved policies never carry
it, with its own AdamW (``train.critic.lr``) stepped after the policy's; several training
ranks average its gradients first. Its weights and AdamW state travel in the checkpoint as
``critic.safetensors`` and ``critic_optimizer.*``. The critic is the trainer's, always at
the trainer's version: rollouts never read it, so ``async`` needs no version of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from sluice.config.tree import CriticConfig
from sluice.engines.train.ranks import rank_and_world
from sluice.storage.checkpoints import tensors_of
from sluice.storage.safetensors_stream import Streamed
from sluice.storage.torch_state import load_optimizer, optimizer_to_files, tensors_to_bytes

CRITIC_FILE = "critic.safetensors"
CRITIC_OPTIMIZER = "critic_optimizer"  # critic_optimizer.json + critic_optimizer.safetensors


class ValueHead:
    """V(s_t) = w . h_t + b on the policy's final hidden state h_t, float32."""

    def __init__(
        self, hidden_size: int, device: torch.device, cfg: CriticConfig, lr: float, seed: int
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.module = torch.nn.Linear(hidden_size, 1)
        with torch.no_grad():  # small and seeded: every rank starts from the same head
            self.module.weight.copy_(torch.randn(1, hidden_size, generator=generator) * 0.01)
            self.module.bias.zero_()
        self.module.to(device)
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=cfg.lr or lr)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens] float32, outside any autocast of the forward."""
        with torch.autocast(hidden.device.type, enabled=False):
            return self.module(hidden.float()).squeeze(-1)

    def step(self, grad_clip: float) -> float:
        """Average the head's gradients over the ranks, clip them, step its AdamW; returns
        the gradient norm before clipping."""
        params = list(self.module.parameters())
        world = rank_and_world()[1]
        if world > 1:  # every rank reduces every tensor, a rank without loss tokens zeros
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def files(self) -> dict[str, bytes | Streamed]:
        """The head's weights and AdamW state, for a checkpoint."""
        weights = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        return {
            CRITIC_FILE: tensors_to_bytes(weights),
            **optimizer_to_files(self.optimizer, CRITIC_OPTIMIZER),
        }

    def load(self, files: Mapping[str, bytes]) -> None:
        """Restore what ``files`` wrote; a checkpoint without a critic is refused."""
        if CRITIC_FILE not in files:
            raise ValueError(
                "the checkpoint holds no critic (a run without train.critic): resume it "
                "without train.critic, or start a run with a critic afresh"
            )
        stored = tensors_of(files, CRITIC_FILE)
        device = self.module.weight.device
        self.module.load_state_dict({k: stored[k].to(device) for k in ("weight", "bias")})
        load_optimizer(self.optimizer, files, CRITIC_OPTIMIZER)
