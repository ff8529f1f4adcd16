"""What the rollout workers are told to make of a group's rewards (``credit_of``)."""

import torch

from sluice.config.tree import load_config
from sluice.driver.batch import credit_of
from sluice.rl.advantages import Credit


def test_the_train_section_becomes_the_workers_credit():
    cfg = load_config(
        None,
        ["train.advantage=rloo", "train.overlong_buffer=4", "train.overlong_penalty=0.5"],
    )
    assert credit_of(cfg) == Credit("rloo", True, 4, 0.5, cfg.rollout.max_new_tokens)


def test_under_a_critic_the_rows_carry_each_samples_reward():
    """The critic's GAE starts from the (shaped) reward itself; a failed sample's row
    carries 0, and the trainer leaves its tokens out (``to_train_batch(skip_failed)``)."""
    credit = credit_of(load_config(None, ["train.critic={}"]))
    rewards, valid = torch.tensor([[1.0, 0.25, 0.5]]), torch.tensor([[True, True, False]])
    assert credit.advantages(rewards, valid).tolist() == [[1.0, 0.25, 0.0]]
