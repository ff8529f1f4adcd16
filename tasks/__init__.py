"""The Prefect tasks the flows compose (``job``: a run's tasks, each with its retries;
``evaluation``; ``registry``) and which failures their retries can help with."""
