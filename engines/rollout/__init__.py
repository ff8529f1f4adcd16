"""Rollout: the rollout worker actor, the vLLM engine it holds, streaming samples and
multi-turn episodes, and the dispatcher that hands prompt groups to streaming workers."""
