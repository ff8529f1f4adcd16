"""Pure algorithm code: the config schema, advantages and policy losses.

Nothing here imports Ray, Prefect, vLLM or MLflow, so every function can be tested on its
own against closed forms.
"""
