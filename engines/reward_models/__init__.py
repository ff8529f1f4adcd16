"""Models that score completions, each served in Ray actors of its own beside the rollout
workers: a generative judge on vLLM (``judge.py``) and a sequence-classification reward
model on transformers (``classifier.py``); ``served.py`` launches and holds the actors,
``scorer.py`` is the rollout worker's side (a ``Scorer``) that sends them groups.
"""
