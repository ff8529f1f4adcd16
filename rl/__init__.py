"""Pure algorithm code: advantages, policy losses, padded training batches, the staleness rule
and skew-aware dispatch.

Nothing here imports Ray, Prefect, vLLM or MLflow, so every function can be tested on its
own against closed forms.
"""
