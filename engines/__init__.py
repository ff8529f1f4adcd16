"""Compute and the Ray actors that host it, one sub-package per subject:

- ``engines.rollout``: the rollout worker (an actor holding vLLM and the scorer), its vLLM
  engine, the streaming sample runner, multi-turn episodes, and the async dispatcher;
- ``engines.train``: the training pool (actors holding a torch, FSDP2 or DeepSpeed engine),
  the trainer step, LoRA adapters and the ranks' collectives;
- ``engines.agents``: the OpenAI-compatible chat endpoint a rollout worker serves to a
  user's agent, its token-exact sessions and chat-template boundaries;
- ``engines.cluster``: where Ray comes from, placement of the pools, spot interruptions;
- ``engines.reward_models``: a judge model (vLLM) or a reward model (sequence
  classification) in Ray actors of their own, and the scorer that sends them groups.

``engines.protocols`` holds the seams between the actors and the engines they hold.
"""
